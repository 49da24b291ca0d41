"""Benchmarks tapehook's binary Conv2D kernels against stock TensorFlow.

    python bench/run.py            # full run, oneDNN off and on (~5-8 min on 2 cores)
    python bench/run.py --quick    # fewer reps and shapes (~2 min)
    python bench/run.py --onednn off --reps 5

Each oneDNN setting runs in its own subprocess (TF_ENABLE_ONEDNN_OPTS is read
when TensorFlow is imported). Within one process every comparison times ours
and stock interleaved, rep by rep, so a noisy neighbour hits both alike:
compare the ratios, not the milliseconds across runs. Writes
bench/results/latest.json and bench/results/latest.png. See bench/README.md.
"""

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"

# (name, batch, height/width, in_c, out_c, kernel); all NHWC, SAME, stride 1.
SHAPES = [
    ("56x56 64->64 3x3", 16, 56, 64, 64, 3),
    ("28x28 128->128 3x3", 16, 28, 128, 128, 3),
    ("14x14 256->256 3x3", 16, 14, 256, 256, 3),
    ("7x7 512->512 3x3", 16, 7, 512, 512, 3),
    ("28x28 256->256 1x1", 16, 28, 256, 256, 1),
    ("b1 14x14 256->256 3x3", 1, 14, 256, 256, 3),
]
QUICK_SHAPES = (0, 2, 3, 5)

# Comparison -> (ours, stock). Steps return the forward output (else Grappler
# prunes the forward conv and the step looks 25-40 % faster).
COMPARISONS = {
    "forward_binary": ("tapehook fully binary forward", "tf.nn.conv2d on +-1 floats"),
    "forward_binary_graph": (
        "tapehook fully binary forward, per conv of a graph",
        "tf.nn.conv2d on +-1 floats, per conv of a graph",
    ),
    "forward_weight_only": (
        "tapehook weight-only forward (inference)",
        "larq-style: conv on sign(W) * mean|W|",
    ),
    "step_binary": ("tapehook fully binary step", "larq-style step (STE on x and W)"),
    "step_weight_only": ("tapehook weight-only step", "larq-style step (STE on W)"),
    "kernel_forward_binary": ("raw TapehookBinaryConv2D (binary x)", "raw Conv2D"),
    "kernel_forward_weight_only": ("raw TapehookBinaryConv2D (float x)", "raw Conv2D"),
    "kernel_backprop_input": ("raw TapehookBinaryConv2DBackpropInput", "raw Conv2DBackpropInput"),
    "kernel_backprop_filter": (
        "raw TapehookBinaryConv2DBackpropFilter",
        "raw Conv2DBackpropFilter",
    ),
    "eager_step_overhead": (
        "eager tapehook step (interposer)",
        "eager tf.custom_gradient step, same raw kernels",
    ),
}


def cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def onednn_setting():
    """TF_ENABLE_ONEDNN_OPTS as set ("default" when unset) and whether TF
    runs its CPU convolutions on oneDNN here: TF's default depends on the
    CPU (on with AVX-512 VNNI / AMX, off on an AVX2 EPYC). Imports TF."""
    from tapehook import compat

    setting = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default")
    return f"{setting} ({'on' if compat.onednn_enabled() else 'off'})"


def cpu_flags():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return sorted(
                    flags
                    & {
                        "avx2",
                        "fma",
                        "popcnt",
                        "avx512f",
                        "avx512bw",
                        "avx512_vpopcntdq",
                        "amx_tile",
                        "amx_bf16",
                    }
                )
    except OSError:
        pass
    return []


# ---------------------------------------------------------------------------
# Worker: one oneDNN setting, in its own process.


def run_worker(args):
    import numpy as np
    import tensorflow as tf

    import tapehook
    from tapehook import kernels

    lib = kernels.library()
    if lib is None:
        raise SystemExit(f"tapehook kernels unavailable: {kernels.kernel_info()}")

    @tf.custom_gradient
    def ste_sign(t):
        def grad(dy):
            return dy * tf.cast(tf.abs(t) <= 1.0, dy.dtype)

        return tf.where(t >= 0, 1.0, -1.0), grad

    def mean_abs(w):
        return tf.stop_gradient(tf.reduce_mean(tf.abs(w), axis=[0, 1, 2]))

    def in_graph(conv, repeats):
        """One call runs `conv` `repeats` times in a tf.while_loop, as a
        model's forward runs its layers: the Python-to-TF call (0.2-0.45 ms
        here, the same for both sides) is paid once per call, not once per
        conv. Each turn adds its output's first value to the loop's result,
        so no conv is pruned (nor hoisted: TF's loop optimizer leaves
        loop-invariant nodes in place by default)."""

        @tf.function
        def fn():
            def body(i, total):
                return i + 1, total + conv()[0, 0, 0, 0]

            return tf.while_loop(lambda i, _: i < repeats, body, (0, 0.0))[1]

        return fn

    def timed(fns, warmup, reps):
        """Interleaved timing of {name: fn}; returns {name: [seconds]}. The
        order flips every rep: a call inherits the aftermath of the one before
        it (a 0.3 ms batch-1 call takes ~0.1 ms longer right after stock's
        conv), so each side follows the other half the time."""
        for fn in fns.values():
            for _ in range(warmup):
                fn()
        times = {name: [] for name in fns}
        order = list(fns.items())
        for _ in range(reps):
            for name, fn in order:
                start = time.perf_counter()
                fn()  # CPU eager execution is synchronous
                times[name].append(time.perf_counter() - start)
            order.reverse()
        return times

    shapes = [SHAPES[i] for i in QUICK_SHAPES] if args.quick else SHAPES
    rng = np.random.default_rng(0)
    rows = []
    conv = dict(strides=[1, 1, 1, 1], padding="SAME")
    binary_attrs = dict(conv, scale="mean_abs", activation_estimator="ste_sign")
    weight_attrs = dict(conv, scale="mean_abs")
    for name, n, hw, cin, cout, k in shapes:
        if args.only and args.only not in name:
            continue
        x = tf.constant(rng.standard_normal((n, hw, hw, cin), dtype=np.float32))
        w0 = rng.standard_normal((k, k, cin, cout), dtype=np.float32)
        dy = tf.constant(rng.standard_normal((n, hw, hw, cout), dtype=np.float32))
        x_pm1 = tf.sign(x) + tf.cast(x == 0, tf.float32)
        w_pm1 = tf.constant(np.where(w0 >= 0, 1.0, -1.0).astype(np.float32))
        w_bin = tapehook.mark_binary(tf.Variable(w0), activations=True, scale="mean_abs")
        w_wo = tapehook.mark_binary(tf.Variable(w0), scale="mean_abs")
        w_stock = tf.Variable(w0)
        x_sizes = tf.constant([n, hw, hw, cin])
        w_sizes = tf.constant([k, k, cin, cout])
        flops = 2.0 * n * hw * hw * k * k * cin * cout
        repeats = 32 if n == 1 else 16  # convs per call in forward_binary_graph

        def step(w, larq_x, larq_w):
            @tf.function
            def fn():
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    xi = ste_sign(x) if larq_x else x
                    wi = ste_sign(w) * mean_abs(w) if larq_w else w
                    y = tf.nn.conv2d(xi, wi, **conv)
                dx, dw = tape.gradient(y, [x, w], output_gradients=dy)
                return y, dx, dw

            return fn

        cases = {
            "forward_binary": {
                "ours": tf.function(lambda: tf.nn.conv2d(x, w_bin, **conv)),
                "stock": tf.function(lambda: tf.nn.conv2d(x_pm1, w_pm1, **conv)),
            },
            "forward_binary_graph": {
                "ours": in_graph(lambda: tf.nn.conv2d(x, w_bin, **conv), repeats),
                "stock": in_graph(lambda: tf.nn.conv2d(x_pm1, w_pm1, **conv), repeats),
            },
            "forward_weight_only": {
                "ours": tf.function(lambda: tf.nn.conv2d(x, w_wo, **conv)),
                "stock": tf.function(
                    lambda: tf.nn.conv2d(x, ste_sign(w_stock) * mean_abs(w_stock), **conv)
                ),
            },
            "step_binary": {"ours": step(w_bin, False, False), "stock": step(w_stock, True, True)},
            "step_weight_only": {
                "ours": step(w_wo, False, False),
                "stock": step(w_stock, False, True),
            },
            "kernel_forward_binary": {
                "ours": tf.function(lambda: lib.tapehook_binary_conv2d(x, w_bin, **binary_attrs)),
                "stock": tf.function(lambda: tf.raw_ops.Conv2D(input=x_pm1, filter=w_pm1, **conv)),
            },
            "kernel_forward_weight_only": {
                "ours": tf.function(lambda: lib.tapehook_binary_conv2d(x, w_wo, **weight_attrs)),
                "stock": tf.function(lambda: tf.raw_ops.Conv2D(input=x, filter=w_pm1, **conv)),
            },
            "kernel_backprop_input": {
                "ours": tf.function(
                    lambda: lib.tapehook_binary_conv2d_backprop_input(x, w_bin, dy, **binary_attrs)
                ),
                "stock": tf.function(
                    lambda: tf.raw_ops.Conv2DBackpropInput(
                        input_sizes=x_sizes, filter=w_pm1, out_backprop=dy, **conv
                    )
                ),
            },
            "kernel_backprop_filter": {
                "ours": tf.function(
                    lambda: lib.tapehook_binary_conv2d_backprop_filter(x, w_bin, dy, **binary_attrs)
                ),
                "stock": tf.function(
                    lambda: tf.raw_ops.Conv2DBackpropFilter(
                        input=x_pm1, filter_sizes=w_sizes, out_backprop=dy, **conv
                    )
                ),
            },
        }
        if n == 1:  # the interposer's cost shows on small eager steps
            cases["eager_step_overhead"] = eager_overhead_case(
                tf, tapehook, lib, x, w_bin, dy, binary_attrs, conv
            )
        for comparison, fns in cases.items():
            times = timed(fns, args.warmup, args.reps)
            if comparison == "forward_binary_graph":
                times = {who: [t / repeats for t in ts] for who, ts in times.items()}
            row = {"shape": name, "comparison": comparison, "gflop": flops / 1e9}
            for who in ("ours", "stock"):
                ts = times[who]
                row[who] = {
                    "min_ms": 1e3 * min(ts),
                    "median_ms": 1e3 * statistics.median(ts),
                    "gflops_at_min": flops / min(ts) / 1e9,
                }
            row["speedup_min"] = row["stock"]["min_ms"] / row["ours"]["min_ms"]
            row["speedup_median"] = row["stock"]["median_ms"] / row["ours"]["median_ms"]
            rows.append(row)
            print(
                f"  [{args.onednn}] {name:24s} {comparison:28s} {row['speedup_min']:5.2f}x",
                file=sys.stderr,
                flush=True,
            )
    return {
        "onednn": args.onednn,
        "tf_version": tf.__version__,
        "tf_enable_onednn_opts": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
        "tapehook_no_avx2": os.environ.get("TAPEHOOK_NO_AVX2"),
        "tapehook_no_avx512": os.environ.get("TAPEHOOK_NO_AVX512"),
        "tapehook_no_amx": os.environ.get("TAPEHOOK_NO_AMX"),
        "amx_kernels": kernels.amx_usable(),
        "kernel_library": kernels.kernel_info()["cpu"].get("path"),
        "rows": rows,
    }


def eager_overhead_case(tf, tapehook, lib, x, w_bin, dy, attrs, conv):
    """Eager step through tapehook vs tf.custom_gradient on the same raw ops."""

    @tf.custom_gradient
    def by_hand(xi, wi):
        y = lib.tapehook_binary_conv2d(xi, wi, **attrs)

        def grad(g):
            return (
                lib.tapehook_binary_conv2d_backprop_input(xi, wi, g, **attrs),
                lib.tapehook_binary_conv2d_backprop_filter(xi, wi, g, **attrs),
            )

        return y, grad

    def ours():
        # The same kernels as by_hand, so only the interposer differs.
        previous = os.environ.get("TAPEHOOK_DISPATCH")
        os.environ["TAPEHOOK_DISPATCH"] = "kernels"
        try:
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = tf.nn.conv2d(x, w_bin, **conv)
            return y, tape.gradient(y, [x, w_bin], output_gradients=dy)
        finally:
            if previous is None:
                del os.environ["TAPEHOOK_DISPATCH"]
            else:
                os.environ["TAPEHOOK_DISPATCH"] = previous

    def stock():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = by_hand(x, w_bin)
        return y, tape.gradient(y, [x, w_bin], output_gradients=dy)

    return {"ours": ours, "stock": stock}


# ---------------------------------------------------------------------------
# Driver.


def print_table(result):
    print(f"\n== oneDNN {result['onednn']} (TF {result['tf_version']}) ==")
    print(
        f"{'shape':24s} {'comparison':28s} {'ours min/med ms':>17s} "
        f"{'stock min/med ms':>17s} {'ours GF/s':>9s} {'stock GF/s':>10s} {'x (min)':>7s} {'x (med)':>7s}"
    )
    for r in result["rows"]:
        o, s = r["ours"], r["stock"]
        print(
            f"{r['shape']:24s} {r['comparison']:28s} "
            f"{o['min_ms']:8.2f}/{o['median_ms']:8.2f} {s['min_ms']:8.2f}/{s['median_ms']:8.2f} "
            f"{o['gflops_at_min']:9.0f} {s['gflops_at_min']:10.0f} "
            f"{r['speedup_min']:7.2f} {r['speedup_median']:7.2f}"
        )


def recommendations(results):
    """Per oneDNN setting, kernel and shape: which implementation to route to."""
    out = {}
    for res in results:
        per = {}
        for r in res["rows"]:
            per.setdefault(r["comparison"], {})[r["shape"]] = {
                "faster": "tapehook" if r["speedup_median"] > 1.0 else "stock",
                "speedup_median": round(r["speedup_median"], 3),
                "speedup_min": round(r["speedup_min"], 3),
            }
        out[res["onednn"]] = per
    return out


def plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no chart (pip install matplotlib)", file=sys.stderr)
        return None
    fig, axes = plt.subplots(len(results), 1, figsize=(13, 4.5 * len(results)), squeeze=False)
    for ax, res in zip(axes[:, 0], results):
        comps = [c for c in COMPARISONS if any(r["comparison"] == c for r in res["rows"])]
        shapes = list(dict.fromkeys(r["shape"] for r in res["rows"]))
        width = 0.8 / len(shapes)
        for i, shape in enumerate(shapes):
            vals = [
                next(
                    (
                        r["speedup_median"]
                        for r in res["rows"]
                        if r["shape"] == shape and r["comparison"] == c
                    ),
                    0.0,
                )
                for c in comps
            ]
            ax.bar([j + i * width for j in range(len(comps))], vals, width, label=shape)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(comps))])
        ax.set_xticklabels([c.replace("_", "\n", 1) for c in comps], fontsize=8)
        ax.set_ylabel("speedup vs stock (median)")
        ax.set_title(f"tapehook vs stock TF {res['tf_version']}, oneDNN {res['onednn']}")
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="4 shapes, 3 reps")
    parser.add_argument("--reps", type=int, default=None, help="timed reps (default 7, quick 3)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--onednn", choices=("off", "on", "both"), default="both")
    parser.add_argument("--only", default="", help="run shapes whose name contains this")
    parser.add_argument("--out", default=str(RESULTS / "latest.json"))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reps is None:
        args.reps = 3 if args.quick else 7

    if args.worker:
        result = run_worker(args)
        pathlib.Path(args.worker).write_text(json.dumps(result))
        return

    settings = ("off", "on") if args.onednn == "both" else (args.onednn,)
    results = []
    started = time.time()
    for setting in settings:
        env = dict(
            os.environ,
            TF_ENABLE_ONEDNN_OPTS="1" if setting == "on" else "0",
            TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
        )
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                tmp.name,
                "--onednn",
                setting,
                "--reps",
                str(args.reps),
                "--warmup",
                str(args.warmup),
            ]
            cmd += ["--quick"] if args.quick else []
            cmd += ["--only", args.only] if args.only else []
            subprocess.run(cmd, env=env, check=True)
            results.append(json.loads(pathlib.Path(tmp.name).read_text()))
        print_table(results[-1])

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    chart = plot(results, out.with_suffix(".png"))
    report = {
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_seconds": round(time.time() - started, 1),
        "args": {"quick": args.quick, "reps": args.reps, "warmup": args.warmup},
        "comparisons": {k: {"ours": v[0], "stock": v[1]} for k, v in COMPARISONS.items()},
        "results": results,
        "recommendation": recommendations(results),
        "chart": chart,
    }
    out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out}" + (f" and {chart}" if chart else ""))


if __name__ == "__main__":
    main()
