"""The framework-free C++ core, tested without TensorFlow (tests/cc/)."""

import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _build_and_run(tmp_path, test_name):
    """Compiles tests/cc/<test_name>.cc with the whole core, runs it, checks its
    exit status and returns its stdout."""
    binary = tmp_path / test_name
    subprocess.run(["g++", "-std=c++17", "-O2", "-Wall", f"-I{ROOT}",
                    str(ROOT / "tests" / "cc" / f"{test_name}.cc"),
                    *map(str, sorted(ROOT.glob("cc_kernels/core/*.cc"))),
                    "-lpthread", "-o", str(binary)], check=True)
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
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
