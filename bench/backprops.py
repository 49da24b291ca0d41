"""Both backprops of a binary 3x3 conv at whole-model shapes: tapehook's ops
on a plan against stock TF's oneDNN backprops, float32, 2 threads.

What a training step of Bi-Real-Net-18 / QuickNet-small at 112 px, batch 32,
spends most of its time in (docs/models.md). Per shape and backprop:

- ``stock``: tf.raw_ops.Conv2DBackpropInput / Conv2DBackpropFilter on ready
  ±1 operands (alpha * sign W; sign x), masks not applied: what the larq-style
  composite and tapehook's stock route run, less their elementwise ops;
- ``tapehook``: the library's op on each plan of ``--plans`` (default
  ``avx512``, the AVX-512 sign-table kernels; ``amx,avx512`` compares the
  AMX GEMMs with them where both run, which is what the dispatcher's choice
  between them on an AMX host rests on), from the latent W and x (dX: sign,
  alpha and the ste_sign mask inside; dW: sign x, alpha and the weight mask
  inside), and dW also from the packed input bits the forward keeps (``dW
  packed``). A plan that cannot run a shape (AMX: stride 2) is left out there.

Each tf.function is timed as the best of ``--calls`` calls; the candidates
alternate, ``--repeats`` times; the table gives min and median, and
stock / tapehook ratios of min and of median (above 1: tapehook faster).

    python bench/backprops.py            # writes bench/results/backprops.json
    python bench/backprops.py --plans amx,avx512 --sizes 112,224 --out ...
"""

import argparse
import json
import os
import pathlib
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

BATCH = 32
# (name, h, w, in_c, out_c, stride): the binary 3x3 convs at 112 px
SHAPES_112 = [
    ("birealnet 28x28x64->64 s1", 28, 28, 64, 64, 1),
    ("birealnet 28x28x64->128 s2", 28, 28, 64, 128, 2),
    ("birealnet 14x14x128->128 s1", 14, 14, 128, 128, 1),
    ("birealnet 14x14x128->256 s2", 14, 14, 128, 256, 2),
    ("birealnet 7x7x256->256 s1", 7, 7, 256, 256, 1),
    ("birealnet 7x7x256->512 s2", 7, 7, 256, 512, 2),
    ("birealnet 4x4x512->512 s1", 4, 4, 512, 512, 1),
    ("quicknet 28x28x32->32 s1", 28, 28, 32, 32, 1),
    ("quicknet 14x14x64->64 s1", 14, 14, 64, 64, 1),
]
# ... and at 224 px (Bi-Real-Net's binary convs, QuickNet-small's first two
# stages; their other stages are the 112-px shapes above)
SHAPES_224 = [
    ("birealnet 56x56x64->64 s1", 56, 56, 64, 64, 1),
    ("birealnet 28x28x128->128 s1", 28, 28, 128, 128, 1),
    ("birealnet 14x14x256->256 s1", 14, 14, 256, 256, 1),
    ("birealnet 7x7x512->512 s1", 7, 7, 512, 512, 1),
    ("birealnet 56x56x64->128 s2", 56, 56, 64, 128, 2),
    ("birealnet 28x28x128->256 s2", 28, 28, 128, 256, 2),
    ("birealnet 14x14x256->512 s2", 14, 14, 256, 512, 2),
    ("quicknet 56x56x32->32 s1", 56, 56, 32, 32, 1),
    ("quicknet 28x28x64->64 s1", 28, 28, 64, 64, 1),
]
SHAPES = {"112": SHAPES_112, "224": SHAPES_224}


def select_shapes(sizes, only=""):
    """The shapes of the model sizes ``sizes`` ("112,224") whose name contains ``only``."""
    return [shape for size in sizes.split(",") for shape in SHAPES[size] if only in shape[0]]


def conv_attrs(stride):
    """The attrs of the benched convs: 3x3 SAME, NHWC, undilated."""
    return dict(
        strides=[1, stride, stride, 1],
        padding="SAME",
        explicit_paddings=[],
        data_format="NHWC",
        dilations=[1, 1, 1, 1],
    )


def _time(fn, calls):
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def time_alternating(fns, repeats, calls):
    """{name: {"min", "median"}} in ms of each (traced) function: the best of
    ``calls`` calls, ``repeats`` times, the functions alternating in order
    and reversed."""
    times = {name: [] for name in fns}
    for repeat in range(repeats):
        order = list(fns.items())
        for name, fn in order if repeat % 2 == 0 else order[::-1]:
            times[name].append(_time(fn, calls))
    return {name: {"min": min(v), "median": statistics.median(v)} for name, v in times.items()}


def write_alternating_result(path, rows, repeats, calls):
    """Writes ``rows`` of a time_alternating benchmark as JSON with the
    machine, versions and timing settings they were measured under."""
    import keras
    import tensorflow as tf
    from run import cpu_model, onednn_setting

    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": cpu_model(),
        "cpu_count": os.cpu_count(),
        "tf_version": tf.__version__,
        "keras_version": keras.__version__,
        "onednn": onednn_setting(),
        "repeats": repeats,
        "calls": calls,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "rows": rows,
    }
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


def _candidates(tf, tapehook, shape, plans, batch):
    from tapehook import kernels, packing

    _, h, w, ci, co, s = shape
    oh, ow = -(-h // s), -(-w // s)
    rng = tf.random.Generator.from_seed(0)
    x = rng.normal([batch, h, w, ci])
    wt = rng.normal([3, 3, ci, co])
    dy = rng.normal([batch, oh, ow, co])
    spec = tapehook.BinarySpec(activations=True, scale="mean_abs")
    alpha = tf.reduce_mean(tf.abs(wt), axis=[0, 1, 2])
    w_hat, x_hat = alpha * tf.sign(wt), tf.where(x >= 0, 1.0, -1.0)
    attrs = conv_attrs(s)
    lib = kernels.library()
    packed = packing.pack_input(x, spec)
    stride = [1, s, s, 1]
    fns = {
        "dX stock": tf.function(
            lambda: tf.raw_ops.Conv2DBackpropInput(
                input_sizes=x.shape, filter=w_hat, out_backprop=dy, strides=stride, padding="SAME"
            )
        ),
        "dW stock": tf.function(
            lambda: tf.raw_ops.Conv2DBackpropFilter(
                input=x_hat, filter_sizes=wt.shape, out_backprop=dy, strides=stride, padding="SAME"
            )
        ),
    }
    for plan in plans:
        runs = {
            op: plan in kernels.conv_capabilities(op, attrs, "float32", x.shape, wt.shape, True, p)
            for op, p in (("backprop_input", False), ("backprop_filter", True))
        }
        a = dict(attrs, plan=plan)
        if runs["backprop_input"]:
            fns[f"dX {plan}"] = tf.function(
                lambda a=a: lib.tapehook_binary_conv2d_backprop_input(
                    x, wt, dy, **a, **spec.op_attrs("backprop_input")
                )
            )
        if runs["backprop_filter"]:
            fns[f"dW {plan}"] = tf.function(
                lambda a=a: lib.tapehook_binary_conv2d_backprop_filter(
                    x, wt, dy, **a, **spec.op_attrs("backprop_filter")
                )
            )
            fns[f"dW packed {plan}"] = tf.function(
                lambda a=a: lib.tapehook_binary_conv2d_backprop_filter_packed(
                    packed.packed, wt, dy, **a, **spec.op_attrs("backprop_filter"), channels=ci
                )
            )
    return fns


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", default="avx512", help="comma-separated plans")
    parser.add_argument("--sizes", default="112", help="model sizes whose shapes run: 112,224")
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--only", default="", help="run the shapes whose name contains this")
    parser.add_argument(
        "--out", default=str(pathlib.Path(__file__).parent / "results" / "backprops.json")
    )
    args = parser.parse_args()

    import tensorflow as tf

    import tapehook

    tf.config.threading.set_intra_op_parallelism_threads(2)
    plans = args.plans.split(",")
    rows = []
    print(
        f"{'shape':30} {'backprop':10} {'plan':8} {'stock ms':>15} {'tapehook ms':>15} {'x min/med':>11}"
    )
    for shape in select_shapes(args.sizes, args.only):
        fns = _candidates(tf, tapehook, shape, plans, args.batch)
        for fn in fns.values():
            fn()  # trace and warm up
        row = {"shape": shape[0], "batch": args.batch, "plans": plans}
        row["ms"] = time_alternating(fns, args.repeats, args.calls)
        for what in ("dX", "dW", "dW packed"):
            a = row["ms"][f"{what.split()[0]} stock"]
            for plan in plans:
                b = row["ms"].get(f"{what} {plan}")
                if b is None:
                    continue
                ratio = (a["min"] / b["min"], a["median"] / b["median"])
                row[f"{what} {plan} x"] = ratio
                print(
                    f"{shape[0]:30} {what:10} {plan:8} {a['min']:6.2f}/{a['median']:6.2f}   "
                    f"{b['min']:6.2f}/{b['median']:6.2f}   {ratio[0]:4.2f}/{ratio[1]:4.2f}",
                    flush=True,
                )
        rows.append(row)
    result = {
        "batch": args.batch,
        "plans": plans,
        "calls": args.calls,
        "repeats": args.repeats,
        "rows": rows,
    }
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
