"""10,000 eager training steps of a small binarized model: resident memory per
1,000 steps, and the dispatch counters. `python bench/leak_check.py`."""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Measures tapehook's own kernels and bookkeeping, not the stock routing.
os.environ.setdefault("TAPEHOOK_DISPATCH", "kernels")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tapehook  # noqa: E402


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10_000)
    args = parser.parse_args()
    model = keras.Sequential(
        [
            keras.Input((16, 16, 3)),
            keras.layers.Conv2D(16, 3, padding="same", use_bias=False),
            keras.layers.BatchNormalization(),
            keras.layers.Conv2D(16, 3, padding="same", use_bias=False),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )
    tapehook.binarize(model, first_and_last_float=True, activations=True)
    optimizer = keras.optimizers.SGD(0.01)
    x = tf.random.normal([8, 16, 16, 3])
    y = tf.random.uniform([8], 0, 10, tf.int32)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    samples = []
    for step in range(1, args.steps + 1):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if step % 1000 == 0:
            samples.append((step, round(rss_mib(), 1)))
            print(f"step {step:6d}  rss {samples[-1][1]:8.1f} MiB", flush=True)
    counts = tapehook.dispatch_counts()["compiled"]
    growth = samples[-1][1] - samples[0][1]
    print(
        json.dumps(
            {
                "steps": args.steps,
                "rss_mib": samples,
                "growth_after_first_1000_mib": round(growth, 1),
                "counts": counts,
            }
        )
    )
    assert counts["backprop_filter"] == args.steps, counts


if __name__ == "__main__":
    np.set_printoptions(precision=2)
    main()
