"""Installs tapehook. The C++ kernels are built against the installed TensorFlow
on first use (or by `python -m tapehook.build`), cached per TF version."""

import pathlib
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent


class BuildPyWithKernelSources(build_py):
    """Ships cc_kernels/ inside the package as tapehook/_cc_kernels."""

    def run(self):
        super().run()
        target = pathlib.Path(self.build_lib) / "tapehook" / "_cc_kernels"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(ROOT / "cc_kernels", target,
                        ignore=shutil.ignore_patterns("*.o", "*.so"))


setup(
    name="tapehook",
    version="0.1.0",
    description="Binary-weight convnets in TensorFlow 2 through its registered gradients",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tapehook", "tapehook.*"]),
    python_requires=">=3.10",
    # TensorFlow comes in several distributions (tensorflow, tensorflow-cpu,
    # tf-nightly); pick one with an extra so pip never installs a second one.
    install_requires=["numpy", "wrapt"],
    extras_require={"cpu": ["tensorflow-cpu>=2.16"],
                    "gpu": ["tensorflow[and-cuda]>=2.16"],
                    "test": ["pytest", "pytest-timeout", "hypothesis", "scikit-learn", "matplotlib"],
                    "examples": ["scikit-learn", "matplotlib"]},
    cmdclass={"build_py": BuildPyWithKernelSources},
)
