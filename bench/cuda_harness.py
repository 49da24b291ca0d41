"""Framework-free GPU check of tapehook's CUDA kernels (no TensorFlow).

Builds cc_kernels/cuda + the CPU core into one shared library with nvcc, runs
every CUDA kernel on random inputs and compares it with the CPU core, then
times the kernels against cuDNN through PyTorch. See bench/CUDA.md.

    python bench/cuda_harness.py [--archs 90] [--skip-bench] [--out FILE]

Correctness needs numpy and a GPU (device memory through the shim's
cudaMalloc); the benchmark also needs PyTorch (cuDNN, CUDA events).
"""

import argparse
import ctypes
import importlib.util
import json
import pathlib
import platform
import re
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIELDS = (
    "batch",
    "in_h",
    "in_w",
    "in_c",
    "k_h",
    "k_w",
    "out_c",
    "out_h",
    "out_w",
    "stride_h",
    "stride_w",
    "dil_h",
    "dil_w",
    "pad_top",
    "pad_left",
)
PADDING = {"SAME": 0, "VALID": 1, "EXPLICIT": 2}
ESTIMATOR = {"none": 0, "ste_sign": 1, "approx_sign": 2, "swish_sign": 3}
SCALE = {"none": 0, "mean_abs": 1}
DTYPES = {"float32": (0, np.float32, 1e-4), "float16": (1, np.float16, 2e-2)}


class ConvShape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in FIELDS]


# (name, batch, h, w, in_c, k, out_c, stride, dilation, padding, explicit pads t,b,l,r)
CASES = [
    ("odd_c_same", 1, 9, 7, 3, 3, 5, 1, 1, "SAME", None),
    ("words2_stride2", 16, 15, 15, 33, 3, 7, 2, 1, "SAME", None),
    ("dilated_valid", 1, 12, 11, 17, 3, 9, 1, 2, "VALID", None),
    ("explicit_stride2_dil2", 16, 10, 9, 65, 3, 3, 2, 2, "EXPLICIT", (2, 0, 1, 3)),
    ("k5_many_tiles", 1, 13, 14, 130, 5, 67, 1, 1, "SAME", None),
    ("pointwise_stride2", 16, 9, 9, 32, 1, 70, 2, 1, "VALID", None),
    ("resnet_like", 16, 28, 28, 64, 3, 64, 1, 1, "SAME", None),
    ("deep_filter", 1, 7, 7, 256, 3, 129, 1, 1, "SAME", None),
]
# (binary input, activation estimator, weight estimator, scale, clip)
SPECS = [
    (False, "none", "ste_sign", "none", 1.0),
    (True, "ste_sign", "ste_sign", "mean_abs", 1.0),
    (True, "approx_sign", "swish_sign", "none", 0.5),
    (False, "none", "approx_sign", "mean_abs", 1.0),
    (True, "swish_sign", "ste_sign", "mean_abs", 0.5),
]
BENCH_SHAPES = [  # (batch, h, w, in_c, k, out_c)
    (16, 56, 56, 128, 3, 128),
    (16, 28, 28, 256, 3, 256),
    (16, 14, 14, 512, 3, 512),
]


def load_cuda_build():
    # By path: importing the tapehook package would import TensorFlow.
    spec = importlib.util.spec_from_file_location(
        "tapehook_cuda_build", ROOT / "tapehook" / "cuda_build.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(out_dir, archs):
    lib = pathlib.Path(out_dir) / "libtapehook_cuda_harness.so"
    start = time.time()
    load_cuda_build().build_harness(ROOT / "cc_kernels", lib, archs=tuple(archs))
    print(f"built {lib} for sm_{','.join(archs)} in {time.time() - start:.0f} s")
    return lib


class Harness:
    def __init__(self, lib_path):
        self.lib = lib = ctypes.CDLL(str(lib_path))
        p, i, f, shape = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.POINTER(ConvShape)
        for name, args in {
            "th_geometry": [
                i,
                ctypes.c_int64,
                ctypes.c_int64,
                ctypes.c_int64,
                ctypes.c_int64,
                shape,
            ],
            "th_cuda_forward": [i, shape, p, p, i, i, p, p, p],
            "th_cuda_backprop_input": [i, shape, p, p, p, i, f, i, p, p, p],
            "th_cuda_backprop_filter": [i, shape, p, p, p, i, i, f, i, p, p, p],
            "th_malloc": [ctypes.c_size_t, ctypes.POINTER(p)],
            "th_free": [p],
            "th_to_device": [p, p, ctypes.c_size_t],
            "th_to_host": [p, p, ctypes.c_size_t],
            "th_synchronize": [],
            "th_device_name": [],
        }.items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = ctypes.c_char_p
        lib.th_set_tensor_cores.argtypes = [i]
        lib.th_set_tensor_cores.restype = None
        lib.th_workspace_bytes.argtypes = [i, shape, i]
        lib.th_workspace_bytes.restype = ctypes.c_size_t
        for name in ("th_cpu_forward", "th_cpu_backprop_input", "th_cpu_backprop_filter"):
            getattr(lib, name).restype = None
        lib.th_cpu_forward.argtypes = [shape, p, p, i, i, p]
        lib.th_cpu_backprop_input.argtypes = [shape, p, p, p, i, f, i, p]
        lib.th_cpu_backprop_filter.argtypes = [shape, p, p, p, i, i, f, i, p]

    @staticmethod
    def check(err, what):
        if err:
            raise RuntimeError(f"{what}: {err.decode()}")

    def shape(self, batch, h, w, in_c, k, out_c, stride, dil, padding, pads):
        s = ConvShape(
            batch=batch,
            in_h=h,
            in_w=w,
            in_c=in_c,
            k_h=k,
            k_w=k,
            out_c=out_c,
            stride_h=stride,
            stride_w=stride,
            dil_h=dil,
            dil_w=dil,
        )
        self.check(
            self.lib.th_geometry(PADDING[padding], *(pads or (0, 0, 0, 0)), ctypes.byref(s)),
            "geometry",
        )
        return s

    def device(self, array):
        ptr = ctypes.c_void_p()
        self.check(self.lib.th_malloc(max(array.nbytes, 1), ctypes.byref(ptr)), "cudaMalloc")
        self.check(self.lib.th_to_device(ptr, array.ctypes.data, array.nbytes), "copy to device")
        return ptr

    def host(self, ptr, like):
        out = np.empty_like(like)
        self.check(self.lib.th_to_host(out.ctypes.data, ptr, out.nbytes), "copy to host")
        return out


def max_error(got, want):
    """max |got - want| / (1 + max |want|), as tests/conftest.py."""
    got, want = got.astype(np.float64), want.astype(np.float64)
    return float(
        np.max(np.abs(got - want), initial=0.0) / (1.0 + np.max(np.abs(want), initial=0.0))
    )


def check_case(h, case, spec, dtype_name, rng):
    name, batch, height, width, in_c, k, out_c, stride, dil, padding, pads = case
    binary, act, west, scale, clip = spec
    code, np_dtype, tol = DTYPES[dtype_name]
    s = h.shape(batch, height, width, in_c, k, out_c, stride, dil, padding, pads)
    x = (rng.normal(size=(batch, height, width, in_c)) * 1.2).astype(np_dtype)
    x[rng.random(x.shape) < 0.05] = 0
    w = (rng.normal(size=(k, k, in_c, out_c)) * 0.8).astype(np_dtype)
    w.flat[0] = 0
    dy = rng.normal(size=(batch, s.out_h, s.out_w, out_c)).astype(np_dtype)
    # The reference sees the same (possibly half-rounded) values in float.
    xf, wf, dyf = (np.ascontiguousarray(a, np.float32) for a in (x, w, dy))
    ref_y, ref_dx, ref_dw = np.empty_like(dyf), np.empty_like(xf), np.empty_like(wf)
    act_code = ESTIMATOR[act] if binary else 0
    h.lib.th_cpu_forward(s, xf.ctypes.data, wf.ctypes.data, binary, SCALE[scale], ref_y.ctypes.data)
    h.lib.th_cpu_backprop_input(
        s,
        xf.ctypes.data,
        wf.ctypes.data,
        dyf.ctypes.data,
        act_code,
        clip,
        SCALE[scale],
        ref_dx.ctypes.data,
    )
    h.lib.th_cpu_backprop_filter(
        s,
        xf.ctypes.data,
        wf.ctypes.data,
        dyf.ctypes.data,
        act_code,
        ESTIMATOR[west],
        clip,
        SCALE[scale],
        ref_dw.ctypes.data,
    )

    bufs = [h.device(a) for a in (x, w, dy, np.zeros_like(dy), np.zeros_like(x), np.zeros_like(w))]
    x_d, w_d, dy_d, y_d, dx_d, dw_d = bufs
    errors = {}
    try:
        for op, out_ptr, like, ref in (
            (0, y_d, dy, ref_y),
            (1, dx_d, x, ref_dx),
            (2, dw_d, w, ref_dw),
        ):
            ws = h.device(np.zeros(h.lib.th_workspace_bytes(op, s, binary), np.uint8))
            try:
                if op == 0:
                    err = h.lib.th_cuda_forward(
                        code, s, x_d, w_d, binary, SCALE[scale], out_ptr, ws, None
                    )
                elif op == 1:
                    err = h.lib.th_cuda_backprop_input(
                        code, s, x_d, w_d, dy_d, act_code, clip, SCALE[scale], out_ptr, ws, None
                    )
                else:
                    err = h.lib.th_cuda_backprop_filter(
                        code,
                        s,
                        x_d,
                        w_d,
                        dy_d,
                        act_code,
                        ESTIMATOR[west],
                        clip,
                        SCALE[scale],
                        out_ptr,
                        ws,
                        None,
                    )
                h.check(err, name)
                h.check(h.lib.th_synchronize(), name)
                errors[("forward", "backprop_input", "backprop_filter")[op]] = max_error(
                    h.host(out_ptr, like), ref
                )
            finally:
                h.lib.th_free(ws)
    finally:
        for ptr in bufs:
            h.lib.th_free(ptr)
    return errors, tol


# th_set_tensor_cores levels: the default (bf16 tensor cores, int8 for the
# fully binary forward), bf16 only, the CUDA-core kernels.
FAMILIES = {"tensor_cores": 2, "tensor_cores_bf16": 1, "cuda_cores": 0}


def run_correctness(h, family):
    """Every case on one kernel family (FAMILIES)."""
    h.lib.th_set_tensor_cores(FAMILIES[family])
    rng = np.random.default_rng(0)
    rows, passed = [], True
    print(
        f"{family}:\n{'case':24} {'dtype':8} {'spec':32} {'forward':>9} {'bp_input':>9} "
        f"{'bp_filter':>9}  result"
    )
    for index, case in enumerate(CASES):
        for offset, dtype_name in enumerate(DTYPES):
            spec = SPECS[(index + 2 * offset) % len(SPECS)]
            errors, tol = check_case(h, case, spec, dtype_name, rng)
            ok = all(e <= tol for e in errors.values())
            passed &= ok
            spec_name = f"{'bin' if spec[0] else 'float'} {spec[1]}/{spec[2]} {spec[3]}"
            print(
                f"{case[0]:24} {dtype_name:8} {spec_name:32} "
                + " ".join(
                    f"{errors[k]:9.2e}" for k in ("forward", "backprop_input", "backprop_filter")
                )
                + f"  {'PASS' if ok else 'FAIL'}"
            )
            rows.append(
                {
                    "kernels": family,
                    "case": case[0],
                    "dtype": dtype_name,
                    "spec": spec_name,
                    "errors": errors,
                    "tolerance": tol,
                    "passed": ok,
                }
            )
    print(f"correctness ({family}): {sum(r['passed'] for r in rows)}/{len(rows)} passed")
    h.lib.th_set_tensor_cores(FAMILIES["tensor_cores"])
    return rows, passed


def time_ms(torch, fn, iters=20):
    """Median of per-call times (CUDA events) after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def profile_calls(torch, calls, label):
    """Per-kernel GPU time (CUPTI through torch.profiler; it sees the
    harness library's kernels too) and host time per call, to see where a
    call's time goes."""
    from torch.profiler import ProfilerActivity, profile

    for name, fn in calls.items():
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            fn()
        host_ms = (time.perf_counter() - start) / 10 * 1e3
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        kernels = {}
        for e in prof.events():
            if e.device_type.name == "CUDA":
                kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time / 5e3
        total = sum(kernels.values())
        print(f"profile {label} {name}: host {host_ms:.3f} ms/call, GPU {total:.3f} ms/call")
        for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:6]:
            print(f"    {v:8.4f} ms  {k[:110]}")


def run_bench(h, profile=False):
    import torch
    import torch.nn.functional as F

    rows = []
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    for batch, size, _, in_c, k, out_c in BENCH_SHAPES:
        s = h.shape(batch, size, size, in_c, k, out_c, 1, 1, "SAME", None)
        row = {
            "shape": f"N{batch} {size}x{size} {in_c}->{out_c} k{k}",
            "tf32_allowed": torch.backends.cudnn.allow_tf32,
        }
        for dtype_name, (code, _, _) in DTYPES.items():
            tdt = getattr(torch, dtype_name)
            x = torch.randn(batch, size, size, in_c, device="cuda", dtype=tdt)
            w = torch.randn(k, k, in_c, out_c, device="cuda", dtype=tdt)
            dy = torch.randn(batch, size, size, out_c, device="cuda", dtype=tdt)
            y, dx, dw = torch.empty_like(dy), torch.empty_like(x), torch.empty_like(w)
            ws = torch.empty(
                max(h.lib.th_workspace_bytes(op, s, 1) for op in range(3)),
                dtype=torch.uint8,
                device="cuda",
            )
            ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731

            def ours(op, binary):
                # binary: the input is binarized (ste_sign), as in a fully binary layer.
                act = ESTIMATOR["ste_sign"] if binary else 0

                def call():
                    if op == 0:
                        err = h.lib.th_cuda_forward(
                            code, s, ptr(x), ptr(w), binary, 1, ptr(y), ptr(ws), stream
                        )
                    elif op == 1:
                        err = h.lib.th_cuda_backprop_input(
                            code, s, ptr(x), ptr(w), ptr(dy), act, 1.0, 1, ptr(dx), ptr(ws), stream
                        )
                    else:
                        err = h.lib.th_cuda_backprop_filter(
                            code,
                            s,
                            ptr(x),
                            ptr(w),
                            ptr(dy),
                            act,
                            1,
                            1.0,
                            1,
                            ptr(dw),
                            ptr(ws),
                            stream,
                        )
                    h.check(err, "bench")

                return call

            # cuDNN on the same NHWC memory (channels_last NCHW views).
            xc = x.permute(0, 3, 1, 2)
            wc = w.permute(3, 2, 0, 1).contiguous(memory_format=torch.channels_last)
            dyc = dy.permute(0, 3, 1, 2)
            pad = k // 2
            h.lib.th_set_tensor_cores(FAMILIES["tensor_cores_bf16"])
            bf16_forward = time_ms(torch, ours(0, 1))
            h.lib.th_set_tensor_cores(FAMILIES["tensor_cores"])
            timings = {
                "binary_forward": time_ms(torch, ours(0, 1)),
                "binary_forward_bf16": bf16_forward,
                "float_input_forward": time_ms(torch, ours(0, 0)),
                "backprop_input": time_ms(torch, ours(1, 0)),
                "backprop_filter": time_ms(torch, ours(2, 0)),
                "binary_backprop_input": time_ms(torch, ours(1, 1)),
                "binary_backprop_filter": time_ms(torch, ours(2, 1)),
                "cudnn_forward": time_ms(torch, lambda: F.conv2d(xc, wc, padding=pad)),
                "cudnn_backprop_input": time_ms(
                    torch, lambda: torch.nn.grad.conv2d_input(xc.shape, wc, dyc, padding=pad)
                ),
                "cudnn_backprop_filter": time_ms(
                    torch, lambda: torch.nn.grad.conv2d_weight(xc, wc.shape, dyc, padding=pad)
                ),
            }
            if profile and dtype_name == "float32":
                profile_calls(
                    torch,
                    {
                        "binary_forward": ours(0, 1),
                        "binary_backprop_input": ours(1, 1),
                        "binary_backprop_filter": ours(2, 1),
                        "cudnn_forward": lambda: F.conv2d(xc, wc, padding=pad),
                    },
                    row["shape"],
                )
            row[dtype_name] = {
                "ms": timings,
                "speedup_binary_forward_vs_cudnn": timings["cudnn_forward"]
                / timings["binary_forward"],
                "speedup_backprop_input_vs_cudnn": timings["cudnn_backprop_input"]
                / timings["backprop_input"],
                "speedup_backprop_filter_vs_cudnn": timings["cudnn_backprop_filter"]
                / timings["backprop_filter"],
                "speedup_binary_step_vs_cudnn": (
                    timings["cudnn_forward"]
                    + timings["cudnn_backprop_input"]
                    + timings["cudnn_backprop_filter"]
                )
                / (
                    timings["binary_forward"]
                    + timings["binary_backprop_input"]
                    + timings["binary_backprop_filter"]
                ),
            }
            r = row[dtype_name]
            print(
                f"{row['shape']:26} {dtype_name:8} binary fwd {timings['binary_forward']:7.3f} ms"
                f" (bf16 {timings['binary_forward_bf16']:7.3f})"
                f" vs cuDNN {timings['cudnn_forward']:7.3f} ms"
                f" ({r['speedup_binary_forward_vs_cudnn']:5.2f}x, target >= 5x);"
                f" bp_input {r['speedup_backprop_input_vs_cudnn']:5.2f}x;"
                f" bp_filter {r['speedup_backprop_filter_vs_cudnn']:5.2f}x;"
                f" binary step {r['speedup_binary_step_vs_cudnn']:5.2f}x"
            )
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--archs", nargs="+", default=["90"], help="SASS archs to build for (default: 90, the H200)"
    )
    parser.add_argument(
        "--build-dir", default=str(pathlib.Path(tempfile.gettempdir()) / "tapehook-cuda-harness")
    )
    parser.add_argument("--out", help="JSON results (default bench/results/cuda-<gpu>.json)")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument(
        "--profile", action="store_true", help="per-kernel times of the float32 binary calls"
    )
    args = parser.parse_args()

    h = Harness(build(args.build_dir, args.archs))
    gpu = h.lib.th_device_name().decode()
    print(f"GPU: {gpu}")
    correctness, passed = [], True
    for family in FAMILIES:
        rows, ok = run_correctness(h, family)
        correctness += rows
        passed &= ok
    bench = [] if args.skip_bench else run_bench(h, args.profile)
    out = (
        pathlib.Path(args.out)
        if args.out
        else (
            ROOT
            / "bench"
            / "results"
            / f"cuda-{re.sub(r'[^A-Za-z0-9]+', '-', gpu).strip('-')}.json"
        )
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "gpu": gpu,
                "host": platform.node(),
                "archs": args.archs,
                "correctness_passed": passed,
                "correctness": correctness,
                "bench": bench,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
