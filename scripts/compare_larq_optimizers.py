#!/usr/bin/env python3
"""Train the same tiny BNN for a few steps in larq 0.14 and in tapehook and
compare the final weights: `python scripts/compare_larq_optimizers.py`.

Two recipes, each from identical initial weights and data:

- ``weightclip``: Adam on every variable, binary kernels with WeightClip(1).
- ``bop``: CaseOptimizer(Bop, Adam) (larq: its predicate form with
  ``Bop.is_binary_variable``; tapehook: the marks), binary kernels with
  WeightClip(1) as QuickNet does.

The model: a float stem conv, BatchNorm, two binary 3x3 convs (ste_sign on
inputs and kernels, clip 1: larq QuantConv2D(input_quantizer="ste_sign",
kernel_quantizer="ste_sign") and tapehook's conv marked activations=True,
ste="ste_sign", clip=1.0 compute the same), each with BatchNorm, global
average pooling and a float Dense head; trained with model.fit, batch 16.

larq needs Keras 2: it runs in a side environment (default /tmp/larqenv,
or $LARQ_PYTHON / --larq-python) made with
    python3 -m venv /tmp/larqenv
    /tmp/larqenv/bin/pip install tensorflow-cpu==2.21.0 tf-keras==2.21.0 larq==0.14.0
as a subprocess of this script (with TF_USE_LEGACY_KERAS=1). Exits non-zero
when a final weight differs by more than --rtol (relative to 1 + max|weight|).
"""

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

GLOBAL = {"batch": 16, "classes": 3, "size": 8, "channels": 3, "filters": 8}
RECIPES = ("weightclip", "bop")
# Powers of two: Keras 2 optimizers keep hyperparameters in float32 whatever the
# variables' dtype, so in float64 any other value would differ between the two
# sides by float32 rounding (1 - 0.999 in float32 is 1.2e-5 off).
HYPER = {
    "adam_lr": 2.0**-4,
    "beta_1": 1 - 2.0**-3,
    "beta_2": 1 - 2.0**-10,
    "epsilon": 2.0**-23,
    "bop_threshold": 2.0**-17,
    "bop_gamma": 2.0**-4,
    "bn_momentum": 1 - 2.0**-7,
}


def make_inputs(path, steps, seed=0):
    """Random data and labels plus initial weights, stored in ``path``."""
    rng = np.random.default_rng(seed)
    g = GLOBAL
    n = steps * g["batch"]
    x = rng.normal(size=(n, g["size"], g["size"], g["channels"])).astype("float32")
    y = rng.integers(0, g["classes"], size=n).astype("int32")

    def glorot(*shape):
        fan_in = np.prod(shape[:-1])
        return (rng.normal(size=shape) * np.sqrt(2.0 / (fan_in + shape[-1]))).astype("float32")

    def bn(c):  # gamma, beta, moving mean, moving variance
        return [
            np.ones(c, "float32"),
            np.zeros(c, "float32"),
            np.zeros(c, "float32"),
            np.ones(c, "float32"),
        ]

    f, c = g["filters"], g["channels"]
    weights = [
        glorot(3, 3, c, f),
        *bn(f),
        # binary kernels: latent weights around the clip, some outside it
        (rng.normal(size=(3, 3, f, f)) * 0.7).astype("float32"),
        *bn(f),
        (rng.normal(size=(3, 3, f, f)) * 0.7).astype("float32"),
        *bn(f),
        glorot(f, g["classes"]),
        np.zeros(g["classes"], "float32"),
    ]
    np.savez(path, *weights, x=x, y=y)


def load_inputs(path):
    data = np.load(path)
    weights = [data[f"arr_{i}"] for i in range(len(data.files) - 2)]
    return data["x"], data["y"], weights


def run_larq(inputs, recipe, dtype, out):
    """The larq side (Keras 2, TF_USE_LEGACY_KERAS=1): writes the final weights."""
    import larq as lq
    import tensorflow as tf

    tf.keras.backend.set_floatx(dtype)

    x, y, weights = load_inputs(inputs)
    g = GLOBAL
    layers = tf.keras.layers
    inputs_ = tf.keras.Input((g["size"], g["size"], g["channels"]))
    h = layers.Conv2D(g["filters"], 3, padding="same", use_bias=False)(inputs_)
    # Keras 2's fused BatchNorm updates the moving variance with n/(n-1) times
    # the batch variance; Keras 3 (and the unfused Keras 2 path) with the batch
    # variance itself.
    h = layers.BatchNormalization(momentum=HYPER["bn_momentum"], fused=False)(h)
    for _ in range(2):
        h = lq.layers.QuantConv2D(
            g["filters"],
            3,
            padding="same",
            use_bias=False,
            input_quantizer="ste_sign",
            kernel_quantizer="ste_sign",
            kernel_constraint=lq.constraints.WeightClip(1.0),
        )(h)
        h = layers.BatchNormalization(momentum=HYPER["bn_momentum"], fused=False)(h)
    outputs = layers.Dense(g["classes"])(layers.GlobalAveragePooling2D()(h))
    model = tf.keras.Model(inputs_, outputs)
    model.set_weights(weights)
    adam = tf.keras.optimizers.legacy.Adam(
        HYPER["adam_lr"], HYPER["beta_1"], HYPER["beta_2"], HYPER["epsilon"]
    )
    if recipe == "bop":
        optimizer = lq.optimizers.CaseOptimizer(
            (
                lq.optimizers.Bop.is_binary_variable,
                lq.optimizers.Bop(threshold=HYPER["bop_threshold"], gamma=HYPER["bop_gamma"]),
            ),
            default_optimizer=adam,
        )
    else:
        optimizer = adam
    model.compile(optimizer, tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=g["batch"], epochs=1, shuffle=False, verbose=0)
    np.savez(out, *model.get_weights())


def run_tapehook(inputs, recipe, dtype, out):
    """The tapehook side (Keras 3): writes the final weights."""
    import keras

    keras.config.set_floatx(dtype)

    import tapehook
    from tapehook.constraints import WeightClip
    from tapehook.optimizers import Bop, CaseOptimizer

    x, y, weights = load_inputs(inputs)
    g = GLOBAL
    layers = keras.layers
    inputs_ = keras.Input((g["size"], g["size"], g["channels"]))
    h = layers.Conv2D(g["filters"], 3, padding="same", use_bias=False)(inputs_)
    h = layers.BatchNormalization(momentum=HYPER["bn_momentum"])(h)
    for i in range(2):
        h = layers.Conv2D(
            g["filters"],
            3,
            padding="same",
            use_bias=False,
            kernel_constraint=WeightClip(1.0),
            name=f"binary{i}",
        )(h)
        h = layers.BatchNormalization(momentum=HYPER["bn_momentum"])(h)
    outputs = layers.Dense(g["classes"])(layers.GlobalAveragePooling2D()(h))
    model = tapehook.binarize(
        keras.Model(inputs_, outputs), include="binary*", activations=True, ste="ste_sign", clip=1.0
    )
    model.set_weights(weights)
    adam = keras.optimizers.Adam(
        HYPER["adam_lr"], HYPER["beta_1"], HYPER["beta_2"], HYPER["epsilon"]
    )
    if recipe == "bop":
        optimizer = CaseOptimizer(
            Bop(threshold=HYPER["bop_threshold"], gamma=HYPER["bop_gamma"]), adam
        )
    else:
        optimizer = adam
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=g["batch"], epochs=1, shuffle=False, verbose=0)
    np.savez(out, *model.get_weights())


BINARY = (5, 10)  # the binary kernels' positions in get_weights()
MOVING = (3, 4, 8, 9, 13, 14)  # BatchNorm moving statistics (not trained)


def compare(ours, larq, initial):
    """Report lines and the worst difference relative to each weight's scale."""
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(ours, larq)]
    relative = max(d / (1.0 + float(np.max(np.abs(b)))) for d, b in zip(diffs, larq))
    trained = [d for i, d in enumerate(diffs) if i not in MOVING]
    flips = sum(int(np.sum(np.sign(larq[i]) != np.sign(initial[i]))) for i in BINARY)
    kernels = np.concatenate([ours[i].ravel() for i in BINARY])
    values = np.unique(kernels)
    lines = [
        f"max |tapehook - larq|: trained weights {max(trained):.3g}, BatchNorm moving "
        f"statistics {max(diffs[i] for i in MOVING):.3g}",
        f"per weight: {', '.join(f'{d:.2g}' for d in diffs)}",
        f"binary kernel signs changed from the initial weights: {flips}; "
        f"{len(values)} distinct binary kernel values, {int(np.sum(np.abs(kernels) == 1))} "
        f"of {kernels.size} at the clip +-1" + (f" {values.tolist()}" if len(values) <= 2 else ""),
    ]
    return lines, relative


def run_side(side, python, inputs, recipe, dtype, tmp):
    out = os.path.join(tmp, f"{side}_{recipe}_{dtype}.npz")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    if side == "larq":
        env["TF_USE_LEGACY_KERAS"] = "1"
    run = subprocess.run(
        [python, os.path.abspath(__file__), "--side", side, inputs, recipe, dtype, out],
        env=env,
        capture_output=True,
        text=True,
    )
    if run.returncode:
        sys.exit(f"{side} side failed ({recipe}, {dtype}):\n{run.stderr[-4000:]}")
    weights = np.load(out)
    return [weights[f"arr_{i}"] for i in range(len(weights.files))]


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="data and initial weights")
    parser.add_argument("--dtypes", default="float32,float64")
    parser.add_argument(
        "--rtol",
        type=float,
        default=1e-6,
        help="largest difference allowed, relative to 1 + max|weight|",
    )
    parser.add_argument(
        "--larq-python", default=os.environ.get("LARQ_PYTHON", "/tmp/larqenv/bin/python")
    )
    # A subprocess's role: each run is a fresh process (floatx is global).
    parser.add_argument("--side", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:
        side, *rest = args.side
        (run_larq if side == "larq" else run_tapehook)(*rest)
        return 0

    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        inputs = os.path.join(tmp, "inputs.npz")
        make_inputs(inputs, args.steps, args.seed)
        initial = load_inputs(inputs)[2]
        for dtype in args.dtypes.split(","):
            for recipe in RECIPES:
                larq, ours = (
                    run_side(side, python, inputs, recipe, dtype, tmp)
                    for side, python in (("larq", args.larq_python), ("tapehook", sys.executable))
                )
                lines, relative = compare(ours, larq, initial)
                print(f"{recipe}, {dtype}, {args.steps} steps, seed {args.seed}:")
                for line in lines:
                    print("  " + line)
                worst = max(worst, relative)
    print(f"worst difference relative to 1 + max|weight|: {worst:.3g} (allowed {args.rtol})")
    return 0 if worst <= args.rtol else 1


if __name__ == "__main__":
    sys.exit(main())
