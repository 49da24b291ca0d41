"""The side environment LCE's converter runs in.

larq-compute-engine 0.16 pins TensorFlow 2.16.1 (and has wheels up to
Python 3.11), which cannot share a process with tapehook's TF. tapehook
builds a virtual environment once, from the package registry, and caches it:

    $TAPEHOOK_LCE_ENV                         (a venv directory), else
    <tapehook cache>/lce-0.16-py3.11/venv     (~/.cache/tapehook/...)

with the interpreter from $TAPEHOOK_LCE_PYTHON, else ``python3.11``. The
environment is built in a temporary directory and renamed into place when
every package imported, so a failed or interrupted build leaves nothing a
later call would mistake for a working one; a file lock serializes builds.
"""

import fcntl
import os
import pathlib
import shutil
import subprocess
import sys

from tapehook.errors import TapehookError
from tapehook.kernels import cache_root

PACKAGES = ("tensorflow-cpu==2.16.1", "tf-keras==2.16.0", "larq-compute-engine==0.16.0")
PYTHON_VERSION = (3, 11)
ENV_VAR = "TAPEHOOK_LCE_ENV"
PYTHON_VAR = "TAPEHOOK_LCE_PYTHON"
_READY = ".tapehook-ready"
WORKER = pathlib.Path(__file__).with_name("lce_worker.py")


def env_dir() -> pathlib.Path:
    override = os.environ.get(ENV_VAR)
    if override:
        return pathlib.Path(override)
    return cache_root() / "lce-0.16-py3.11" / "venv"


def _python_for_venv():
    explicit = os.environ.get(PYTHON_VAR)
    if explicit:
        return explicit
    if sys.version_info[:2] == PYTHON_VERSION:
        return sys.executable
    found = shutil.which("python3.11")
    if found is None:
        raise TapehookError(
            "target='lce' needs Python 3.11 for its side environment "
            "(larq-compute-engine 0.16 has no wheel for newer Pythons) and none was "
            f"found: install python3.11, set {PYTHON_VAR}=/path/to/python3.11, or "
            f"point {ENV_VAR} at a venv holding {' '.join(PACKAGES)}"
        )
    return found


def _env_python(directory):
    return pathlib.Path(directory) / "bin" / "python"


def _run(cmd, what, timeout=1800):
    try:
        done = subprocess.run(
            [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{what}: {exc}"
    if done.returncode != 0:
        return f"{what} failed ({done.returncode}):\n{done.stderr[-3000:]}"
    return None


def _build(target):
    """Creates the venv in a temporary sibling of ``target``, then renames it."""
    staging = target.with_name(f"{target.name}.building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        error = (
            _run([_python_for_venv(), "-m", "venv", staging], "creating the venv")
            or _run(
                [_env_python(staging), "-m", "pip", "install", "-q", *PACKAGES],
                f"pip install {' '.join(PACKAGES)}",
            )
            or _run([_env_python(staging), WORKER, "check"], "importing LCE")
        )
        if error:
            raise TapehookError(
                f"could not build the LCE side environment at {target}: {error}\n"
                f"target='lce' installs {' '.join(PACKAGES)} from the package "
                f"registry with Python 3.11; make the registry reachable (or pip's "
                f"index configured), or build such a venv yourself and set "
                f"{ENV_VAR} to it; target='litert' needs none of this"
            )
        (staging / _READY).write_text("\n".join(PACKAGES) + "\n")
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def python() -> pathlib.Path:
    """The side environment's interpreter, building the environment if needed."""
    target = env_dir()
    if (target / _READY).exists():
        return _env_python(target)
    if os.environ.get(ENV_VAR) and _env_python(target).exists():
        # A venv the user made: accepted once LCE imports in it.
        error = _run([_env_python(target), WORKER, "check"], "importing LCE", timeout=300)
        if error:
            raise TapehookError(
                f"{ENV_VAR}={target} is not a working LCE environment: "
                f"{error}\ninstall {' '.join(PACKAGES)} into it"
            )
        return _env_python(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TapehookError(
            f"cannot create {target.parent} for the LCE side "
            f"environment ({exc}); set {ENV_VAR} to a writable path"
        )
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / _READY).exists():
            if target.exists():
                shutil.rmtree(target)  # an unfinished environment of an older layout
            _build(target)
    return _env_python(target)


def worker(*args, timeout=1800):
    """Runs lce_worker.py with ``args`` in the side environment."""
    error = _run([python(), WORKER, *args], f"LCE {args[0]}", timeout=timeout)
    if error:
        raise TapehookError(error)
