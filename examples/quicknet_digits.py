"""Two BNN training recipes on scikit-learn's digits, on a QuickNet-style network.

The network: a float stem conv, then residual stages of binary 3x3 convs
(ste_sign on their inputs and kernels, one-padding as QuickNet and Larq
Compute Engine use; each block adds BN(ReLU(conv(x))) to x), a float
transition (max-pooling, 1x1 conv) between stages, global average pooling
and a float classifier. Binary kernels have WeightClip(1.0).

- ``quicknet``: as larq-zoo trains QuickNet: binary kernels trained by Bop,
  everything float by Adam, through one CaseOptimizer.
- ``two_stage``: Real-to-Binary / ReActNet style: first binary activations
  with float weights (``weights=False``, the BAN stage) trained by Adam, then
  the same weights made binary and trained on with CaseOptimizer(Bop, Adam).

Prints each recipe's test accuracy and how many binary weights Bop flipped
in the last epoch.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tapehook  # noqa: E402
import tapehook.optimizers  # noqa: E402
from tapehook.constraints import WeightClip  # noqa: E402
from tapehook.optimizers import Bop, CaseOptimizer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_digits import load_data  # noqa: E402

BATCH = 64


def build_model(size, widths=(32, 64), blocks=2):
    inputs = keras.Input((size, size, 1))
    x = keras.layers.Conv2D(widths[0], 3, padding="same", use_bias=False, name="stem")(inputs)
    x = keras.layers.BatchNormalization(momentum=0.9)(x)
    for stage, width in enumerate(widths):
        if stage:  # float transition: downsample and widen
            x = keras.layers.MaxPooling2D()(x)
            x = keras.layers.Conv2D(width, 1, use_bias=False, name=f"transition{stage}")(x)
            x = keras.layers.BatchNormalization(momentum=0.9)(x)
        for block in range(blocks):
            y = keras.layers.Conv2D(
                width,
                3,
                padding="same",
                use_bias=False,
                kernel_constraint=WeightClip(1.0),
                name=f"binary{stage}_{block}",
            )(x)
            y = keras.layers.ReLU()(y)
            y = keras.layers.BatchNormalization(momentum=0.9)(y)
            x = keras.layers.Add()([x, y])
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(x))


def binarize(model, weights):
    """Only the residual blocks' convs are binary: their inputs, and their
    kernels unless ``weights=False``. A new spec replaces the old marks."""
    for layer in model.layers:
        if layer.name.startswith("binary") and tapehook.binary_spec_of(layer.kernel):
            tapehook.unmark(layer.kernel)
    return tapehook.binarize(
        model, include="binary*", activations=True, pad_value=1.0, weights=weights
    )


def binary_signs(model):
    return [
        np.sign(v.numpy())
        for v in model.trainable_variables
        if tapehook.optimizers.is_binary_variable(v)
    ]


def adam(steps):
    return keras.optimizers.Adam(keras.optimizers.schedules.CosineDecay(3e-3, steps))


def train(model, optimizer, data, epochs, verbose):
    """Compiles (a new trace, so new marks take effect) and fits; returns the
    test accuracy and the binary weights flipped in the last epoch."""
    x_train, x_test, y_train, y_test = data
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    signs = {}

    class LastEpochSigns(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            signs["before"] = binary_signs(model)

    model.fit(
        x_train,
        y_train,
        batch_size=BATCH,
        epochs=epochs,
        validation_data=(x_test, y_test),
        callbacks=[LastEpochSigns()],
        verbose=verbose,
    )
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    flipped = sum(int(np.sum(a != b)) for a, b in zip(binary_signs(model), signs["before"]))
    return accuracy, flipped


def bop_and_adam(args, steps):
    return CaseOptimizer(Bop(threshold=args.threshold, gamma=args.gamma), adam(steps))


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=12, help="per recipe")
    parser.add_argument("--recipes", default="quicknet,two_stage")
    parser.add_argument("--size", type=int, default=16, help="image side after resizing")
    parser.add_argument("--gamma", type=float, default=1e-3, help="Bop's adaptivity rate")
    parser.add_argument("--threshold", type=float, default=1e-6, help="Bop's flip threshold")
    parser.add_argument("--verbose", type=int, default=2)
    args = parser.parse_args(argv)

    data = load_data(args.size)
    steps_per_epoch = -(-len(data[0]) // BATCH)
    results = {}
    for recipe in args.recipes.split(","):
        keras.utils.set_random_seed(0)
        model = build_model(args.size)
        if recipe == "quicknet":
            binarize(model, weights=True)
            tapehook.summary(model)
            optimizer = bop_and_adam(args, args.epochs * steps_per_epoch)
            accuracy, flipped = train(model, optimizer, data, args.epochs, args.verbose)
        elif recipe == "two_stage":
            first = max(1, args.epochs // 2)
            binarize(model, weights=False)  # BAN: binary inputs, float kernels
            accuracy, _ = train(model, adam(first * steps_per_epoch), data, first, args.verbose)
            print(
                f"two_stage, stage 1 (binary activations, float weights): test "
                f"accuracy {accuracy:.4f}"
            )
            binarize(model, weights=True)  # stage 2 starts from stage 1's weights
            second = args.epochs - first
            optimizer = bop_and_adam(args, max(1, second) * steps_per_epoch)
            accuracy, flipped = train(model, optimizer, data, second, args.verbose)
        else:
            raise SystemExit(f"unknown recipe {recipe!r}: use quicknet or two_stage")
        trained = optimizer.binary._trainable_variables
        print(
            f"{recipe}: {len(trained)} binary kernels ({sum(int(np.size(v)) for v in trained)} "
            f"weights, values {np.unique(np.concatenate([np.ravel(v) for v in trained])).tolist()}) "
            f"trained by Bop, {len(optimizer.default._trainable_variables)} float variables "
            f"by Adam; Bop flipped {flipped} binary weights in the last epoch"
        )
        print(f"{recipe}: test accuracy {accuracy:.4f}")
        results[recipe] = accuracy, flipped
    return results


if __name__ == "__main__":
    main()
