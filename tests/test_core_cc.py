"""The framework-free C++ core, tested without TensorFlow (tests/cc/)."""

import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_core_against_naive_loops(tmp_path):
    binary = tmp_path / "test_binary_conv"
    subprocess.run(["g++", "-std=c++17", "-O2", "-Wall", f"-I{ROOT}",
                    str(ROOT / "tests/cc/test_binary_conv.cc"),
                    *map(str, sorted(ROOT.glob("cc_kernels/core/*.cc"))),
                    "-lpthread", "-o", str(binary)], check=True)
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "0 failed" in run.stdout, run.stdout[-2000:]


def test_amx_split_is_exact_and_packed_backprops(tmp_path):
    """tests/cc/test_amx_conv.cc: packed-input backprops equal the float-input
    ones bitwise; the AMX kernels' bf16x3 split loses no bits (skipped on CPUs
    without AMX)."""
    binary = tmp_path / "test_amx_conv"
    subprocess.run(["g++", "-std=c++17", "-O2", "-Wall", f"-I{ROOT}",
                    str(ROOT / "tests/cc/test_amx_conv.cc"),
                    *map(str, sorted(ROOT.glob("cc_kernels/core/*.cc"))),
                    "-lpthread", "-o", str(binary)], check=True)
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "packed: 0 failures" in run.stdout, run.stdout[-2000:]
    if "skipped" in run.stdout:
        pytest.skip(run.stdout.strip())
    assert "amx: 0 failures" in run.stdout, run.stdout[-2000:]
