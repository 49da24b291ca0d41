"""The framework-free C++ core, tested without TensorFlow (tests/cc/), compiled
with the flags the kernel library is built with (kernels.build_flags), and
once more under AddressSanitizer + UndefinedBehaviorSanitizer."""

import pathlib
import subprocess

import pytest

from tapehook import kernels

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent
SANITIZE = [
    "-O1",
    "-g",
    "-fno-omit-frame-pointer",
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
]


def _build_and_run(tmp_path, test_name, extra_flags=(), timeout=300):
    """Compiles tests/cc/<test_name>.cc with the whole core and the library's
    compile flags (plus extra_flags), runs it, checks its exit status and
    returns its stdout."""
    compile_flags, _ = kernels.build_flags(kernels.source_dir())
    binary = tmp_path / test_name
    subprocess.run(
        [
            kernels._compiler(),
            *compile_flags,
            *extra_flags,
            f"-I{ROOT}",
            str(ROOT / "tests" / "cc" / f"{test_name}.cc"),
            *map(str, sorted(ROOT.glob("cc_kernels/core/*.cc"))),
            *extra_flags,
            "-lpthread",
            "-o",
            str(binary),
        ],
        check=True,
    )
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return run.stdout


def test_core_against_naive_loops(tmp_path):
    stdout = _build_and_run(tmp_path, "test_binary_conv")
    assert "0 failed" in stdout, stdout[-2000:]


def test_amx_split_is_exact_and_packed_backprops(tmp_path):
    """tests/cc/test_amx_conv.cc: packed-input backprops equal the float-input
    ones bitwise; the AMX kernels' bf16x3 split loses no bits (skipped on CPUs
    without AMX)."""
    stdout = _build_and_run(tmp_path, "test_amx_conv")
    assert "packed: 0 failures" in stdout, stdout[-2000:]
    if "skipped" in stdout:
        pytest.skip(stdout.strip())
    assert "amx: 0 failures" in stdout, stdout[-2000:]


@pytest.mark.parametrize("test_name", ["test_binary_conv", "test_amx_conv"])
def test_core_under_sanitizers(tmp_path, test_name):
    """Both C++ tests once under ASan + UBSan: any out-of-bounds access, leak
    or undefined behaviour in the core (or the tests) fails the run."""
    stdout = _build_and_run(tmp_path, test_name, SANITIZE, timeout=600)
    assert (
        ("0 failed" in stdout)
        if test_name == "test_binary_conv"
        else ("packed: 0 failures" in stdout)
    ), stdout[-2000:]
