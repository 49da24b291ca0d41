"""Train a binary convnet on scikit-learn's bundled digits (real data, no download).

The usual BNN recipe: a float stem conv, then two binary 3x3 convs (ste_sign on
their inputs and kernels) with max-pooling and BatchNorm, and a float dense
head, trained with Adam on a cosine schedule. The same architecture is also trained in float for comparison. Prints
tapehook.summary, both test accuracies, the time per epoch and the dispatch
counts (proof that the binary kernels ran), and writes a PNG of the curves.
Then deploys the binary model: a .tflite for LiteRT and one for Larq Compute
Engine (every binary conv an LceBconv2d), each run on the test set by its own
interpreter to print the accuracy of the file itself. The first LCE export
builds LCE's side environment (minutes, once; docs/deploy.md).
"""

import argparse
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tapehook  # noqa: E402
import tapehook.deploy  # noqa: E402

BATCH = 64


def load_data(size):
    """Digits scaled to [-1, 1] and resized to size x size, 25 % held out."""
    # Imported here: train_zoo.py uses this file's deploy without scikit-learn.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = digits.images[..., None].astype("float32") / 8.0 - 1.0
    images = tf.image.resize(images, (size, size)).numpy()
    return train_test_split(
        images, digits.target, test_size=0.25, random_state=0, stratify=digits.target
    )


def build_model(size, binary):
    inputs = keras.Input((size, size, 1))
    h = keras.layers.Conv2D(32, 3, padding="same", use_bias=False, name="stem")(inputs)
    h = keras.layers.BatchNormalization(momentum=0.9)(h)
    for i, filters in enumerate((64, 64)):
        h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"conv{i + 1}")(h)
        h = keras.layers.MaxPooling2D()(h)
        h = keras.layers.BatchNormalization(momentum=0.9)(h)
    h = keras.layers.Dropout(0.3)(keras.layers.Flatten()(h))
    model = keras.Model(inputs, keras.layers.Dense(10, name="head")(h))
    if binary:
        # Float stem and head, binary convs with binary inputs.
        tapehook.binarize(model, first_and_last_float=True, activations=True)
    return model


class EpochTimer(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        logs["seconds"] = time.perf_counter() - self.start


def train(model, data, epochs, verbose):
    x_train, x_test, y_train, y_test = data
    steps = epochs * -(-len(x_train) // BATCH)
    model.compile(
        optimizer=keras.optimizers.Adam(keras.optimizers.schedules.CosineDecay(3e-3, steps)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(
        x_train,
        y_train,
        batch_size=BATCH,
        epochs=epochs,
        validation_data=(x_test, y_test),
        callbacks=[EpochTimer()],
        verbose=verbose,
    )
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    return history.history, accuracy


def file_size(nbytes):
    return f"{nbytes / 1024:.1f} KiB" if nbytes < 2**20 else f"{nbytes / 2**20:.2f} MiB"


def deploy(model, images, labels, prefix, targets, split="test"):
    """Exports ``model`` for each target to ``<prefix>_<target>.tflite`` and
    measures the file's own accuracy on ``images`` with that target's
    interpreter (``split`` names the images in what it prints)."""
    accuracies = {}
    for target in targets:
        path = f"{prefix}_{target}.tflite"
        report = tapehook.deploy.export_tflite(model, path, target=target)
        outputs = tapehook.deploy.run_tflite(path, images, target=target)
        accuracies[target] = float(np.mean(np.argmax(outputs, -1) == labels))
        bconv = report["ops"].get("LceBconv2d")
        print(
            f"{target:6s} {path}: {file_size(report['bytes'])}"
            + (f", {bconv} LceBconv2d" if bconv is not None else "")
            + f", {split} accuracy {accuracies[target]:.4f} (run from the file)"
        )
    return accuracies


def plot(histories, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, history in histories.items():
        axes[0].plot(history["loss"], label=f"{name} train")
        axes[0].plot(history["val_loss"], "--", label=f"{name} test")
        axes[1].plot(history["val_accuracy"], label=f"{name} test")
    axes[0].set(title="loss", xlabel="epoch")
    axes[1].set(title="accuracy", xlabel="epoch", ylim=(0.8, 1.0))
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--size", type=int, default=16, help="image side after resizing")
    parser.add_argument("--plot", default="digits_training.png")
    parser.add_argument("--verbose", type=int, default=2)
    parser.add_argument(
        "--deploy", default="litert,lce", help="targets to export the binary model to ('' for none)"
    )
    parser.add_argument(
        "--deploy-dir",
        default=None,
        help="where the .tflite files go (default: a new temporary directory)",
    )
    args = parser.parse_args(argv)

    data = load_data(args.size)
    keras.utils.set_random_seed(0)
    binary_model = build_model(args.size, binary=True)
    tapehook.summary(binary_model)
    tapehook.reset_dispatch_counts()
    binary_history, binary_accuracy = train(binary_model, data, args.epochs, args.verbose)
    counts = tapehook.dispatch_counts()

    keras.utils.set_random_seed(0)
    float_history, float_accuracy = train(
        build_model(args.size, binary=False), data, args.epochs, verbose=0
    )
    # Epoch 1 includes tracing; the steady state is what a user waits for.
    per_epoch = np.median(binary_history["seconds"][1:] or binary_history["seconds"])
    print(f"binary model: test accuracy {binary_accuracy:.4f}, {per_epoch:.2f} s/epoch")
    print(
        f"float model:  test accuracy {float_accuracy:.4f}, "
        f"{np.median(float_history['seconds'][1:] or float_history['seconds']):.2f} s/epoch"
    )
    print("binary kernel runs:", counts["compiled"], "reference path:", counts["reference"])
    if args.plot:
        plot({"binary": binary_history, "float": float_history}, args.plot)
        print("curves written to", args.plot)
    if counts["compiled"]["backprop_filter"] + counts["reference"]["backprop_filter"] == 0:
        raise SystemExit("binary gradients never ran: binarization was not active")
    targets = [t for t in args.deploy.split(",") if t]
    if targets:
        directory = args.deploy_dir or tempfile.mkdtemp(prefix="digits-deploy-")
        _, x_test, _, y_test = data
        deploy(binary_model, x_test, y_test, os.path.join(directory, "digits_binary"), targets)
    return binary_accuracy, float_accuracy


if __name__ == "__main__":
    main()
