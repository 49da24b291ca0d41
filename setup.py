"""The one build step pyproject.toml cannot declare: cc_kernels/ shipped inside the package.

Everything else (name, version, dependencies, extras) is in pyproject.toml. The C++
kernels are built against the installed TensorFlow on first use (or by
`python -m tapehook.build`), cached per TF version.
"""

import pathlib
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent


class BuildPyWithKernelSources(build_py):
    """Copies cc_kernels/ into the built package as tapehook/_cc_kernels."""

    def run(self):
        super().run()
        target = pathlib.Path(self.build_lib) / "tapehook" / "_cc_kernels"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(ROOT / "cc_kernels", target, ignore=shutil.ignore_patterns("*.o", "*.so"))


setup(cmdclass={"build_py": BuildPyWithKernelSources})
