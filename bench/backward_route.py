"""A binary conv's whole backward (dX and dW, what ``gradient.binary_backward``
builds) on the kernels against the stock route, per shape and batch.

bench/backprops.py times the kernel ops against bare stock backprops on
ready ±1 operands. A training step that takes the stock route pays more: the
binarized filter alpha * sign(W), the unpacked input bits, the estimator
masks. This bench traces ``gradient.binary_backward`` twice per case, under
``TAPEHOOK_DISPATCH=stock`` and under ``auto`` (or ``kernels``), with the
inputs a Bi-Real-Net training step gives it (ste_sign: the packed input bits;
approx_sign: x), and times both, alternating (min and median over repeats,
best of ``--calls`` each), at bench/backprops.py's Bi-Real-Net / QuickNet
shapes. On the 2-core AMX Xeon of bench/results/backward_route.json the
auto route was 1.18-2.7x faster than the stock route in every case (batch
1-32), so the dispatcher has no rule sending small backprops to stock; a
bare stock backprop on ready operands (bench/backprops.py) does beat the
kernels at batch 1, but that is not what the stock route runs.

    python bench/backward_route.py                       # writes bench/results/backward_route.json
    python bench/backward_route.py --batches 1,4 --policy kernels   # the best plan everywhere
"""

import argparse
import json
import os
import pathlib

# bench/backprops.py's model shapes, conv attrs and alternating timing
from backprops import conv_attrs, select_shapes, time_alternating

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _backward(gradient, tf, source, wt, dy, spec, attrs):
    return lambda: gradient.binary_backward(source, tf.convert_to_tensor(wt), dy, spec, attrs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,8,32")
    parser.add_argument("--estimators", default="ste_sign,approx_sign")
    parser.add_argument("--policy", default="auto", help="auto or kernels, against stock")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", default="112,224", help="model sizes whose shapes run")
    parser.add_argument("--only", default="")
    parser.add_argument(
        "--out", default=str(pathlib.Path(__file__).parent / "results" / "backward_route.json")
    )
    args = parser.parse_args()

    import tensorflow as tf

    import tapehook
    from tapehook import gradient, packing

    tf.config.threading.set_intra_op_parallelism_threads(2)
    rows = []
    print(
        f"{'shape':30} {'b':>3} {'estimator':12} {'MMAC':>6} {'stock ms':>13} "
        f"{args.policy + ' ms':>13} {'x min/med':>10}"
    )
    for batch in [int(b) for b in args.batches.split(",")]:
        for name, h, w, ci, co, s in select_shapes(args.sizes, args.only):
            oh, ow = -(-h // s), -(-w // s)
            rng = tf.random.Generator.from_seed(0)
            x = rng.normal([batch, h, w, ci])
            wt = tf.Variable(rng.normal([3, 3, ci, co]) * 0.1)
            dy = rng.normal([batch, oh, ow, co])
            attrs = conv_attrs(s)
            for est in args.estimators.split(","):
                spec = tapehook.BinarySpec(
                    activations=True if est == "ste_sign" else est, scale="mean_abs"
                )
                source = packing.pack_input(x, spec) if est == "ste_sign" else x
                fns = {}
                for policy in ("stock", args.policy):
                    os.environ["TAPEHOOK_DISPATCH"] = policy
                    fn = tf.function(_backward(gradient, tf, source, wt, dy, spec, attrs))
                    fn()  # traced under this policy
                    fns[policy] = fn
                os.environ.pop("TAPEHOOK_DISPATCH")
                ms = time_alternating(fns, args.repeats, args.calls)
                a, b = ms["stock"], ms[args.policy]
                ratio = (a["min"] / b["min"], a["median"] / b["median"])
                macs = batch * oh * ow * 9 * ci * co
                rows.append(dict(shape=name, batch=batch, estimator=est, macs=macs, ms=ms, x=ratio))
                print(
                    f"{name:30} {batch:3d} {est:12} {macs / 1e6:6.0f} "
                    f"{a['min']:6.2f}/{a['median']:6.2f} {b['min']:6.2f}/{b['median']:6.2f} "
                    f"{ratio[0]:4.2f}/{ratio[1]:4.2f}",
                    flush=True,
                )
    result = {"policy": args.policy, "calls": args.calls, "repeats": args.repeats, "rows": rows}
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
