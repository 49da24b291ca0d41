"""What ReActNet's RSign and IR-Net's balanced weights cost per binary conv.

Per layer shape, three blocks with the same binary 3x3 conv (binary
activations, ``scale="mean_abs"``), timed interleaved rep by rep in
tf.function: ``plain`` binarizes its input itself (approx_sign);
``rsign`` puts a ``tapehook.recipes.RSign`` (approx_sign at x - beta) in front
of it, the conv's input estimator ste_sign (which passes +-1 through), so the
conv binarizes x - beta itself and x - beta is never stored
(conv2d._fold_shifted_sign, the ops' threshold input); ``balanced`` is plain
with ``balance="std"`` (in the forward, balanced as the kept filter is
packed). Forward (no tape) and a training step (y, dX, dW and the RSign's
dbeta, a sum over dX, under a tape).
Ratios are variant time / plain time (> 1: the variant costs that much more),
min and median over reps.

    python bench/rsign.py          # writes bench/results/rsign.json
"""

import argparse
import json
import pathlib
import statistics

import numpy as np
import tensorflow as tf
from padding import _time  # one timed call, outputs fetched (bench/ is on sys.path)
from run import cpu_model

import tapehook
from tapehook import recipes

SHAPES = [  # (name, batch, size, channels): Bi-Real-Net-18's 3x3 convs at 112 px
    ("28x28x64", 32, 28, 64),
    ("14x14x128", 32, 14, 128),
    ("7x7x256", 32, 7, 256),
    ("4x4x512", 32, 4, 512),
]
VARIANTS = ("plain", "rsign", "balanced")


def _block(variant, batch, size, channels):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(batch, size, size, channels)), tf.float32)
    kernel = rng.normal(size=(3, 3, channels, channels)).astype(np.float32)
    w = tf.Variable(kernel)
    spec = dict(scale="mean_abs", activations="approx_sign")
    rsign = None
    if variant == "rsign":
        rsign = recipes.RSign(estimator="approx_sign")
        rsign.build(x.shape)
        rsign.beta.assign(rng.normal(size=channels).astype(np.float32) * 0.1)
        spec["activations"] = "ste_sign"
    if variant == "balanced":
        spec["balance"] = "std"
    tapehook.mark_binary(w, **spec)
    variables = [w] + ([rsign.beta] if rsign is not None else [])

    def conv(x):
        return tf.nn.conv2d(rsign(x) if rsign is not None else x, w, 1, "SAME")

    @tf.function(autograph=False)
    def forward():
        return conv(x)

    @tf.function(autograph=False)
    def step():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = conv(x)
            loss = tf.reduce_sum(y * y)
        return y, tape.gradient(loss, [x, *variables])

    return {"forward": forward, "step": step}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument(
        "--out", default=str(pathlib.Path(__file__).parent / "results" / "rsign.json")
    )
    args = parser.parse_args()
    rows = []
    for name, batch, size, channels in SHAPES:
        blocks = {v: _block(v, batch, size, channels) for v in VARIANTS}
        for kind in ("forward", "step"):
            times = {v: [] for v in VARIANTS}
            for v in VARIANTS:
                blocks[v][kind]()  # trace and warm up
            tapehook.reset_dispatch_counts()
            for rep in range(args.reps):
                order = VARIANTS[rep % 3 :] + VARIANTS[: rep % 3]
                for v in order:
                    times[v].append(_time(blocks[v][kind]))
            counts = tapehook.dispatch_counts()
            row = {
                "shape": name,
                "batch": batch,
                "kind": kind,
                "reference_runs": counts["reference"],
            }
            row["plain_ms_min"] = 1e3 * min(times["plain"])
            for v in VARIANTS[1:]:
                per_rep = [a / b for a, b in zip(times[v], times["plain"])]
                row[f"{v}_ms_min"] = 1e3 * min(times[v])
                row[f"{v}_x_min"] = min(times[v]) / min(times["plain"])
                row[f"{v}_x_median"] = statistics.median(per_rep)
            rows.append(row)
            print(
                f"{name:10} {kind:8} plain {row['plain_ms_min']:7.2f} ms  "
                + "  ".join(
                    f"{v} {row[f'{v}_x_min']:.2f}x (median {row[f'{v}_x_median']:.2f}x)"
                    for v in VARIANTS[1:]
                )
            )
    pathlib.Path(args.out).write_text(
        json.dumps(
            {
                "machine": cpu_model(),
                "tf": tf.__version__,
                "amx_kernels": tapehook.kernel_info()["cpu"].get("amx"),
                "reps": args.reps,
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
