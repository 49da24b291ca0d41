"""The CUDA kernels without a GPU: they compile and link, their tile logic
matches the CPU core on the host, and the TF GPU wrapper compiles.

The GPU run itself is bench/cuda_run.sh (bench/CUDA.md).
"""

import ctypes
import importlib.util
import pathlib
import subprocess

import numpy as np
import pytest
import tensorflow as tf

from tapehook import cuda_build, kernels

ROOT = pathlib.Path(__file__).resolve().parent.parent
CC = ROOT / "cc_kernels"
# One arch keeps the test quick; the real build adds sm_80 and sm_90.
TEST_ARCHS = ("75",)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        cuda_build.find_nvcc() is None, reason=str(cuda_build.cuda_unavailable_reason())
    ),
]


def _start(cmd):
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc):
    output = proc.communicate()[0]
    assert proc.returncode == 0, f"{' '.join(proc.args)} failed:\n{output[-4000:]}"


@pytest.fixture(scope="session")
def host_builds(tmp_path_factory):
    """Starts the two slow host compiles first, so they overlap compile_cuda."""
    tile_test = tmp_path_factory.mktemp("cuda_host") / "tile_logic_test"
    includes, _ = cuda_build.toolkit_dirs(cuda_build.find_nvcc())
    compile_flags, _ = kernels.build_flags(CC)
    return {
        "tile_test": (
            tile_test,
            _start(
                [
                    cuda_build.find_nvcc(),
                    "-std=c++17",
                    "-O2",
                    f"-I{CC}",
                    str(CC / "cuda/harness/tile_logic_test.cu"),
                    *map(str, sorted((CC / "core").glob("*.cc"))),
                    "-o",
                    str(tile_test),
                ]
            ),
        ),
        # As a CUDA build of TF compiles binary_conv_ops_gpu.cc (compile_cuda's flags).
        "gpu_wrapper": _start(
            [
                "g++",
                *compile_flags,
                "-DGOOGLE_CUDA=1",
                *(f"-I{d}" for d in includes),
                "-fsyntax-only",
                str(CC / "tf/binary_conv_ops_gpu.cc"),
            ]
        ),
    }


@pytest.fixture(scope="session")
def cuda_objects(host_builds, tmp_path_factory):
    """(objects, compile flags, link flags) of compile_cuda, built once."""
    return cuda_build.compile_cuda(CC, tmp_path_factory.mktemp("cuda"), archs=TEST_ARCHS)


def test_cuda_objects_link_with_the_returned_flags(cuda_objects, tmp_path):
    objects, _, link_flags = cuda_objects
    assert [o.name for o in objects] == [f"cuda_{p.stem}.o" for p in cuda_build.cuda_sources(CC)]
    lib = tmp_path / "libcuda_only.so"
    subprocess.run(
        ["g++", "-shared", *map(str, objects), "-o", str(lib), *link_flags, "-Wl,--no-undefined"],
        check=True,
    )
    symbols = subprocess.run(
        ["nm", "-D", "-C", str(lib)], capture_output=True, text=True, check=True
    ).stdout
    for name in ("BinaryConv2DForward", "BinaryConv2DBackpropInput", "BinaryConv2DBackpropFilter"):
        assert f"tapehook::cuda::{name}(" in symbols


def test_harness_library_builds_and_loads(cuda_objects, tmp_path):
    spec = importlib.util.spec_from_file_location(
        "cuda_harness", ROOT / "bench" / "cuda_harness.py"
    )
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    lib = cuda_build.build_harness(
        CC, tmp_path / "libharness.so", archs=TEST_ARCHS, cuda_objects=cuda_objects[0]
    )
    h = harness.Harness(lib)
    s = h.shape(1, 5, 5, 2, 3, 1, 2, 1, "EXPLICIT", (1, 1, 1, 1))
    assert (s.out_h, s.out_w, s.pad_top, s.pad_left) == (3, 3, 1, 1)
    x, w = np.ones((1, 5, 5, 2), np.float32), -np.ones((3, 3, 2, 1), np.float32)
    y = np.zeros((1, 3, 3, 1), np.float32)
    h.lib.th_cpu_forward(s, x.ctypes.data, w.ctypes.data, 1, 0, y.ctypes.data)
    np.testing.assert_array_equal(y[0, :, :, 0], -2 * np.array([[4, 6, 4], [6, 9, 6], [4, 6, 4]]))


def test_tile_logic_matches_cpu_core(host_builds):
    binary, build = host_builds["tile_test"]
    _finish(build)
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " 0 failed" in run.stdout, run.stdout[-2000:]


def test_gpu_wrapper_compiles_with_google_cuda(host_builds, cuda_objects):
    """binary_conv_ops_gpu.cc with -DGOOGLE_CUDA=1 against TF's headers."""
    assert "-DGOOGLE_CUDA=1" in cuda_objects[1]
    _finish(host_builds["gpu_wrapper"])


def test_gpu_wrapper_is_empty_in_the_cpu_library():
    assert CC / "tf" / "binary_conv_ops_gpu.cc" in kernels._sources(CC)
    record = kernels.build()
    assert pathlib.Path(record["path"]).exists()
    lib = ctypes.CDLL(record["path"])
    assert lib.tapehook_built_tf_version() and tf.__version__
