"""Builds (or finds cached) libtapehook_lite.so: LCE's ops for LiteRT.

The library holds cc_kernels/core (framework-free) and cc_kernels/lite (the
LiteRT glue) and nothing of TensorFlow, so it is built without TF's flags,
with every symbol hidden but its registerers: it can share a process with
tapehook's TF op library (the same core, built apart) without either
binding the other's symbols. It goes into the kernel cache
(tapehook.kernels.cache_root) under a key of compiler, flags and sources.
"""

import fcntl
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile

from tapehook.errors import TapehookError
from tapehook.kernels import _compiler, cache_root, compiler_version, source_dir

LIBRARY_NAME = "libtapehook_lite.so"
SUBDIRS = ("core", "lite")


def _flags(root):
    return [
        "-O3",
        "-fPIC",
        "-std=c++17",
        "-Wall",
        "-Wno-sign-compare",
        "-Wno-interference-size",
        "-fvisibility=hidden",
        "-fvisibility-inlines-hidden",
        "-pthread",
        f"-I{root}",
    ]


def _sources(root):
    return sorted(p for sub in SUBDIRS for p in (root / sub).glob("*.cc"))


def _key(root, flags):
    digest = hashlib.sha256()
    version = compiler_version()
    for part in (version, *flags):
        digest.update(part.encode() + b"\0")
    for sub in SUBDIRS:
        for path in sorted((root / sub).glob("*")):
            if path.suffix in (".cc", ".h"):
                digest.update(f"{sub}/{path.name}".encode() + b"\0" + path.read_bytes())
    return f"lite-{digest.hexdigest()[:16]}"


def _compile(root, flags, out_path):
    """One source at a time (the build must not take the machine's cores)."""
    with tempfile.TemporaryDirectory(prefix="tapehook-lite-build-") as tmp:
        objects = []
        for src in _sources(root):
            obj = pathlib.Path(tmp) / f"{src.parent.name}_{src.stem}.o"
            done = subprocess.run(
                [_compiler(), *flags, "-c", str(src), "-o", str(obj)],
                capture_output=True,
                text=True,
            )
            if done.returncode:
                raise TapehookError(f"compiling {src} failed:\n{done.stderr[-4000:]}")
            objects.append(obj)
        tmp_lib = pathlib.Path(tmp) / LIBRARY_NAME
        link = subprocess.run(
            [_compiler(), "-shared", "-pthread", *map(str, objects), "-o", str(tmp_lib)],
            capture_output=True,
            text=True,
        )
        if link.returncode:
            raise TapehookError(f"linking {LIBRARY_NAME} failed:\n{link.stderr[-4000:]}")
        shutil.move(str(tmp_lib), str(out_path.with_suffix(".tmp")))
        os.replace(out_path.with_suffix(".tmp"), out_path)


def build() -> pathlib.Path:
    """The library's path, built first if no cached build matches the sources."""
    root = source_dir()
    if not (root / "lite").is_dir():
        raise TapehookError(
            f"tapehook's LiteRT sources ({root / 'lite'}) are missing; reinstall "
            "tapehook with `pip install -e .` from a checkout"
        )
    flags = _flags(root)
    directory = cache_root() / _key(root, flags)
    directory.mkdir(parents=True, exist_ok=True)
    lib_path = directory / LIBRARY_NAME
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not lib_path.exists():
            _compile(root, flags, lib_path)
    return lib_path


if __name__ == "__main__":
    print(build())
