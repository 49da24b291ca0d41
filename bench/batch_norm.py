"""tapehook.layers.BatchNormalization (fused training) against Keras 3's
BatchNormalization, one layer at the shapes of Bi-Real-Net-18's batch norms:
a training call with its backward (output, gradients of x, gamma and beta,
moving-statistics update) and an inference call, as tf.functions, alternating
(bench/backprops.py's timing: best of ``--calls`` calls, ``--repeats`` times).

    python bench/batch_norm.py                     # 112 and 224 px shapes, batch 1 and 32
    python bench/batch_norm.py --batches 32 --repeats 3

Prints and writes bench/results/batch_norm.json: per shape and batch, ms of
each and Keras's time over tapehook's (min and median over repeats).
"""

import argparse
import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
# (image side, channels) of Bi-Real-Net-18's batch norms at 112 and 224 px.
SHAPES = {
    112: [(28, 64), (14, 128), (7, 256), (4, 512)],
    224: [(56, 64), (28, 128), (14, 256), (7, 512)],
}


def functions(tf, keras, layers, batch, side, channels):
    x = tf.random.stateless_normal([batch, side, side, channels], seed=[1, 2])
    fns = {}
    for name, cls in (
        ("keras", keras.layers.BatchNormalization),
        ("tapehook", layers.BatchNormalization),
    ):
        layer = cls(momentum=0.8)
        layer.build(x.shape)

        def train(layer=layer):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x, training=True)
            return tape.gradient(y, [x, *layer.trainable_variables], output_gradients=y)

        fns[f"train {name}"] = tf.function(train)
        fns[f"infer {name}"] = tf.function(lambda layer=layer: layer(x, training=False))
    return fns


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="112,224")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", default=str(HERE / "results" / "batch_norm.json"))
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import tensorflow as tf

    from tapehook import layers

    sys.path.insert(0, str(HERE))
    from backprops import time_alternating, write_alternating_result

    rows = []
    print(
        f"{'px':>3s} {'shape':>16s} {'b':>2s} {'train keras/ours ms':>20s} {'x':>11s} {'infer keras/ours ms':>20s} {'x':>11s}"
    )
    for size in [int(s) for s in args.sizes.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            for side, channels in SHAPES[size]:
                fns = functions(tf, keras, layers, batch, side, channels)
                for fn in fns.values():  # trace and warm up
                    fn()
                t = time_alternating(fns, args.repeats, args.calls)
                row = dict(size=size, batch=batch, side=side, channels=channels, ms=t)
                for what in ("train", "infer"):
                    k, o = t[f"{what} keras"], t[f"{what} tapehook"]
                    row[f"{what}_x"] = {
                        "min": k["min"] / o["min"],
                        "median": k["median"] / o["median"],
                    }
                rows.append(row)
                print(
                    f"{size:3d} {f'{side}x{side}x{channels}':>16s} {batch:2d} "
                    + " ".join(
                        f"{t[f'{w} keras']['median']:9.3f}/{t[f'{w} tapehook']['median']:<9.3f} "
                        f"{row[f'{w}_x']['min']:4.2f}/{row[f'{w}_x']['median']:4.2f}x"
                        for w in ("train", "infer")
                    ),
                    flush=True,
                )
    write_alternating_result(args.out, rows, args.repeats, args.calls)


if __name__ == "__main__":
    main()
