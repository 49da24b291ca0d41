"""QuickNet, written with larq's API as larq-zoo writes it, trained on Keras 3.

The only change from larq code is the import: ``import tapehook.larq as lq``.
QuickNet's binary 3x3 convs (ste_sign with clip 1.25 on inputs and kernels,
WeightClip(1.25), one-padding) map onto a tapehook BinarySpec, so they run on
tapehook's kernels; the float stem, transitions and head are stock Keras.
A small QuickNet (two sections) is trained on scikit-learn's bundled digits
(resized to 32x32, the main job's data) and its test accuracy printed.
``--bop`` trains the binary kernels with Bop under CaseOptimizer (Adam for the
rest), as larq's Bop recipe does.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import tapehook  # noqa: E402
import tapehook.larq as lq  # noqa: E402  (was: import larq as lq)


def load_data(size=32):
    digits = load_digits()
    images = digits.images[..., None].astype("float32") / 8.0 - 1.0
    images = tf.image.resize(images, (size, size)).numpy()
    return train_test_split(
        images, digits.target, test_size=0.25, random_state=0, stratify=digits.target
    )


def batch_norm(x):
    return keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5)(x)


def stem_module(filters, x):
    x = keras.layers.Conv2D(filters // 2, 3, strides=2, padding="same", use_bias=False)(x)
    x = keras.layers.Activation("relu")(batch_norm(x))
    x = keras.layers.DepthwiseConv2D(3, padding="same", use_bias=False)(x)
    x = batch_norm(x)
    x = keras.layers.Conv2D(filters, 1, use_bias=False)(x)
    return batch_norm(x)


def residual_block(x):
    """QuickNet's binary block: x + BN(relu(QuantConv2D(x)))."""
    filters = x.shape[-1]
    y = lq.layers.QuantConv2D(
        filters,
        3,
        padding="same",
        pad_values=1.0,
        input_quantizer=lq.quantizers.SteSign(clip_value=1.25),
        kernel_quantizer=lq.quantizers.SteSign(clip_value=1.25),
        kernel_constraint=lq.constraints.WeightClip(clip_value=1.25),
        kernel_initializer="glorot_normal",
        use_bias=False,
    )(x)
    y = keras.layers.Activation("relu")(y)
    return keras.layers.Add()([x, batch_norm(y)])


def transition_block(x, filters, strides):
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.MaxPooling2D(pool_size=strides, strides=1, padding="same")(x)
    x = keras.layers.DepthwiseConv2D(3, padding="same", strides=strides, use_bias=False)(x)
    x = batch_norm(x)
    x = keras.layers.Conv2D(filters, 1, use_bias=False)(x)
    return batch_norm(x)


def quicknet(input_shape, classes, section_filters=(32, 64), section_blocks=(2, 2)):
    inputs = keras.Input(input_shape)
    x = stem_module(section_filters[0], inputs)
    for i, (filters, blocks) in enumerate(zip(section_filters, section_blocks)):
        for _ in range(blocks):
            x = residual_block(x)
        if i < len(section_filters) - 1:
            x = transition_block(x, section_filters[i + 1], strides=2)
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="quicknet")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--bop", action="store_true", help="CaseOptimizer(Bop, Adam)")
    args = parser.parse_args(argv)
    keras.utils.set_random_seed(0)
    x_train, x_test, y_train, y_test = load_data()
    model = quicknet(x_train.shape[1:], 10)
    lq.models.summary(model)
    if args.bop:
        optimizer = lq.optimizers.CaseOptimizer(
            (lq.optimizers.Bop.is_binary_variable, lq.optimizers.Bop(threshold=1e-6, gamma=1e-3)),
            default_optimizer=keras.optimizers.Adam(3e-3),
        )
    else:
        optimizer = keras.optimizers.Adam(3e-3)
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    tapehook.reset_dispatch_counts()
    model.fit(
        x_train,
        y_train,
        batch_size=64,
        epochs=args.epochs,
        verbose=2,
        validation_data=(x_test, y_test),
    )
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    binary = [layer.name for layer in model.layers if getattr(layer, "binary_spec", None)]
    print(f"binary convs on tapehook's kernels: {len(binary)} ({', '.join(binary)})")
    print(f"dispatch counts: {tapehook.dispatch_counts()}")
    print(f"QuickNet test accuracy: {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    main()
