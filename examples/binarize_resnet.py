"""Binarize an unmodified keras.applications model and train it.

ResNet50's model code is untouched: ``tapehook.binarize`` marks every conv but
the first (and the float classifier), and one fit step runs 52 binary convs
forward and backward.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tapehook  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args(argv)

    model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)
    tapehook.binarize(model, first_and_last_float=True, scale="mean_abs")
    totals = tapehook.summary(model, print_fn=None).totals
    print(
        f"{totals['binary_layers']} binary conv layers; "
        f"{totals['float32_bytes'] / 2**20:.1f} MiB at 32 bits, "
        f"{totals['binarized_bytes'] / 2**20:.1f} MiB with 1-bit kernels"
    )
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * args.steps, 64, 64, 3)).astype("float32")
    y = rng.integers(0, 10, size=len(x))
    tapehook.reset_dispatch_counts()
    model.fit(x, y, batch_size=args.batch, epochs=1, verbose=2)
    counts = tapehook.dispatch_counts()["compiled"]
    print("binary kernel runs:", counts)
    return totals["binary_layers"], counts


if __name__ == "__main__":
    main()
