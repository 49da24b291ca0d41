"""Train a binary convnet on scikit-learn's bundled 8x8 digits (no download).

The first conv and the classifier stay float (the usual BNN recipe); the two
middle convs have binary weights (alpha = mean |W|) and binary activations,
trained through tapehook's binary kernels. Prints test accuracy and proves
binarization was active with tapehook.dispatch_counts().
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import tapehook  # noqa: E402


def build_model():
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(32, 3, padding="same", use_bias=False)(inputs)
    h = keras.layers.BatchNormalization()(h)
    with tapehook.binary_scope(activations=True, scale="mean_abs"):
        for filters in (64, 128):
            h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(h)
            h = keras.layers.BatchNormalization()(h)
            h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    outputs = keras.layers.Dense(10)(h)
    return keras.Model(inputs, outputs)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()

    keras.utils.set_random_seed(0)
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, random_state=0, stratify=digits.target)

    model = build_model()
    binary = [l.name for l in model.layers if getattr(l, "kernel", None) is not None
              and tapehook.binary_spec_of(l.kernel)]
    print("binary layers:", binary)
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(x_train, y_train, batch_size=64, epochs=args.epochs,
              validation_split=0.1, verbose=2)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    counts = tapehook.dispatch_counts()
    print(f"test accuracy: {accuracy:.4f} on {len(x_test)} held-out digits")
    print("binary kernel runs:", counts["compiled"], "reference path:", counts["reference"])
    print("kernels:", {k: v for k, v in tapehook.kernel_info()["cpu"].items()
                       if k in ("loaded", "path", "tf_version", "reason")})
    if counts["compiled"]["backprop_filter"] + counts["reference"]["backprop_filter"] == 0:
        raise SystemExit("binary gradients never ran: binarization was not active")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
