"""One-padding (pad_value=1.0) against zero padding, fully binary convs.

A one-padded conv runs as a VALID conv of the input padded with 1
(conv2d.py), so it pays one pad copy of x and skips the bitpacked kernel's
border correction. Per layer shape: the forward (tf.function, no tape) and a
training step (y, dX, dW under a tape in a tf.function), timed interleaved rep
by rep; ratios are zero-padding time / one-padding time (> 1: one-padding
faster), min and median over reps.

    python bench/padding.py          # writes bench/results/padding.json
"""

import argparse
import json
import pathlib
import statistics
import time

import numpy as np
import tensorflow as tf

import tapehook

SHAPES = [  # (name, batch, size, in_c, out_c)
    ("56x56 64->64 3x3", 16, 56, 64, 64),
    ("28x28 128->128 3x3", 16, 28, 128, 128),
    ("14x14 256->256 3x3", 16, 14, 256, 256),
    ("b1 14x14 256->256 3x3", 1, 14, 256, 256),
]


def _functions(batch, size, cin, cout, pad_value):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(batch, size, size, cin)), tf.float32)
    w = tapehook.mark_binary(
        tf.Variable(rng.normal(size=(3, 3, cin, cout)).astype(np.float32)),
        activations=True,
        pad_value=pad_value,
    )

    @tf.function
    def forward():
        return tf.nn.conv2d(x, w, 1, "SAME")

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.nn.conv2d(x, w, 1, "SAME")
            loss = tf.reduce_sum(y * y)
        return y, tape.gradient(loss, [x, w])

    return forward, step


def _time(fn):
    start = time.perf_counter()
    tf.nest.map_structure(lambda t: t.numpy(), fn())
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument(
        "--out", default=str(pathlib.Path(__file__).parent / "results" / "padding.json")
    )
    args = parser.parse_args()
    rows = []
    for name, batch, size, cin, cout in SHAPES:
        zero = _functions(batch, size, cin, cout, 0.0)
        one = _functions(batch, size, cin, cout, 1.0)
        for kind, index in (("forward", 0), ("step", 1)):
            times = {"zero": [], "one": []}
            for fn in (zero[index], one[index]):
                fn()  # trace and warm up
            for rep in range(args.reps):
                order = ("zero", "one") if rep % 2 == 0 else ("one", "zero")
                for side in order:
                    times[side].append(_time((zero if side == "zero" else one)[index]))
            ratios = [z / o for z, o in zip(times["zero"], times["one"])]
            row = {
                "shape": name,
                "kind": kind,
                "zero_ms_min": 1e3 * min(times["zero"]),
                "one_ms_min": 1e3 * min(times["one"]),
                "ratio_min": min(times["zero"]) / min(times["one"]),
                "ratio_median": statistics.median(ratios),
            }
            rows.append(row)
            print(
                f"{name:24} {kind:8} zero {row['zero_ms_min']:7.2f} ms  one "
                f"{row['one_ms_min']:7.2f} ms  zero/one min {row['ratio_min']:.2f}x "
                f"median {row['ratio_median']:.2f}x"
            )
    pathlib.Path(args.out).write_text(json.dumps({"reps": args.reps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
