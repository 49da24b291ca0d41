"""QuickNet, QuickNetSmall and QuickNetLarge: larq-zoo 2.4's ``sota`` models.

QuickNet (Bannink et al., "Larq Compute Engine", 2021) as larq-zoo's code
builds it:

- stem: float 3x3/2 conv to ``filters[0] / 4`` channels, BN, ReLU; float 3x3/2
  depthwise conv, BN without scale or offset; float 1x1 conv, BN;
- per section, residual blocks ``x + BN(ReLU(bconv3x3(x)))`` whose binary
  conv binarizes input and kernel with ``SteSign(clip_value=1.25)``, keeps
  its latent kernel in ``[-1.25, 1.25]`` and pads the binarized input with
  +1 (``pad_values=1.0``); BN momentum 0.9, epsilon 1e-5;
- before the first block of a section whose width differs, a float
  transition: ReLU, 2x2 max pool with stride 1, a blur pool (a 3x3/2
  depthwise conv with the fixed binomial kernel ``[1, 2, 1]^T [1, 2, 1] / 16``,
  not trainable but a weight of the model, so in larq-zoo's weight files),
  1x1 conv, BN (momentum 0.9, epsilon 1e-5);
- head: ReLU, global average pool, float dense, softmax.

The variants differ only in section widths and depths. Every weight-carrying
layer comes in larq-zoo's order, so its release files load by position.
"""

import keras
import numpy as np

import tapehook.larq as lq
from tapehook.zoo import _common

__all__ = ["QuickNet", "QuickNetLarge", "QuickNetSmall"]

_CLIP = 1.25  # QuickNet's SteSign and WeightClip bound


# (section widths, blocks per section, model name, larq-zoo's release files)
_VARIANTS = {
    "QuickNetSmall": (
        (32, 64, 256, 512),
        (4, 4, 4, 4),
        "quicknet_small",
        _common.release_files(
            "quicknet",
            "v1.0",
            "quicknet_small",
            "1ac3b07df7f5a911dd0b49febb2486428ddf1ca130297c403815dfae5a1c71a2",
            "be8ba657155846be355c5580d1ea56eaf8282616de065ffc39257202f9f164ea",
        ),
    ),
    "QuickNet": (
        (64, 128, 256, 512),
        (4, 4, 4, 4),
        "quicknet",
        _common.release_files(
            "quicknet",
            "v1.0",
            "quicknet",
            "8aba9e4e5f8d342faef04a0b2ae8e562da57dbb7d15162e8b3e091c951ba756c",
            "204414e438373f14f6056a1c098249f505a87dd238e18d3a47a9bd8b66227881",
        ),
    ),
    "QuickNetLarge": (
        (64, 128, 256, 512),
        (6, 8, 12, 6),
        "quicknet_large",
        _common.release_files(
            "quicknet",
            "v1.0",
            "quicknet_large",
            "c5158e8a59147b31370becd937825f4db8a5cdf308314874f678f596629be45c",
            "adcf154a2a8007e81bd6af77c035ffbf54cd6413b89a0ba294e23e76a82a1b78",
        ),
    ),
}


@keras.saving.register_keras_serializable(package="tapehook.zoo")
class BlurPoolInitializer(keras.initializers.Initializer):
    """The anti-aliasing blur of Zhang, "Making Convolutional Networks
    Shift-Invariant Again" (2019), as a depthwise kernel: the outer product of
    a binomial row with itself (``[1, 1]``, ``[1, 2, 1]`` or ``[1, 4, 6, 4, 1]``),
    normalized to sum 1, the same for every channel."""

    _ROWS = {2: (1, 1), 3: (1, 2, 1), 5: (1, 4, 6, 4, 1)}

    def __call__(self, shape, dtype=None):
        size = shape[0]
        if size not in self._ROWS or shape[1] != size:
            raise ValueError(f"a blur pool kernel is 2x2, 3x3 or 5x5, not {shape[:2]}")
        row = np.asarray(self._ROWS[size], dtype=np.float64)
        blur = np.outer(row, row) / np.outer(row, row).sum()
        kernel = np.broadcast_to(blur.reshape(size, size, 1, 1), shape)
        return keras.ops.convert_to_tensor(np.array(kernel), dtype=dtype or "float32")

    def get_config(self):
        return {}


def _binary_conv_kwargs():
    return {
        "input_quantizer": lq.quantizers.SteSign(clip_value=_CLIP),
        "kernel_quantizer": lq.quantizers.SteSign(clip_value=_CLIP),
        "kernel_constraint": lq.constraints.WeightClip(clip_value=_CLIP),
    }


def _stem(x, filters):
    x = lq.layers.QuantConv2D(
        filters // 4,
        3,
        strides=2,
        padding="same",
        use_bias=False,
        kernel_initializer="he_normal",
    )(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Activation("relu")(x)
    x = lq.layers.QuantDepthwiseConv2D(3, strides=2, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization(scale=False, center=False)(x)
    x = lq.layers.QuantConv2D(filters, 1, use_bias=False, kernel_initializer="he_normal")(x)
    return keras.layers.BatchNormalization()(x)


def _residual_block(x):
    y = lq.layers.QuantConv2D(
        x.shape[-1],
        3,
        padding="same",
        pad_values=1.0,
        activation="relu",
        use_bias=False,
        kernel_initializer="glorot_normal",
        **_binary_conv_kwargs(),
    )(x)
    y = keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5)(y)
    return keras.layers.Add()([y, x])


def _transition(x, filters):
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.MaxPooling2D(pool_size=2, strides=1)(x)
    x = keras.layers.DepthwiseConv2D(
        3,
        strides=2,
        padding="same",
        use_bias=False,
        depthwise_initializer=BlurPoolInitializer(),
        trainable=False,
    )(x)
    x = lq.layers.QuantConv2D(filters, 1, use_bias=False, kernel_initializer="glorot_normal")(x)
    return keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5)(x)


def _quicknet(variant, input_shape, input_tensor, weights, include_top, num_classes):
    widths, depths, name, files = _VARIANTS[variant]
    inputs = _common.model_input(input_shape, input_tensor, weights, include_top, num_classes)
    x = _stem(inputs, widths[0])
    for width, depth in zip(widths, depths):
        for _ in range(depth):
            if x.shape[-1] != width:
                x = _transition(x, width)
            x = _residual_block(x)
    if include_top:
        x = keras.layers.Activation("relu")(x)
        x = _common.global_pool(x)
        x = lq.layers.QuantDense(num_classes, kernel_initializer="glorot_normal")(x)
        x = keras.layers.Activation("softmax", dtype="float32")(x)
    return _common.finish(inputs, x, name, weights, include_top, files)


def QuickNetSmall(  # noqa: N802 (larq-zoo's public names)
    *, input_shape=None, input_tensor=None, weights=None, include_top=True, num_classes=1000
):
    """larq-zoo's QuickNetSmall: sections of 32, 64, 256 and 512 channels,
    4 blocks each.

    Args:
        input_shape: ``(height, width, 3)``; default (224, 224, 3), or any size
            (None) with ``include_top=False``.
        input_tensor: a tensor to build the model on instead of a new input.
        weights: None (random initialization), ``"imagenet"`` (larq-zoo's
            release file, downloaded once) or the path of a weights file saved
            from larq-zoo's model or this one.
        include_top: whether to end with the pooled dense classifier.
        num_classes: the classifier's width (1000 with ImageNet weights).
    """
    return _quicknet("QuickNetSmall", input_shape, input_tensor, weights, include_top, num_classes)


def QuickNet(  # noqa: N802 (larq-zoo's public names)
    *, input_shape=None, input_tensor=None, weights=None, include_top=True, num_classes=1000
):
    """larq-zoo's QuickNet: sections of 64, 128, 256 and 512 channels, 4 blocks
    each. Arguments as :func:`QuickNetSmall`."""
    return _quicknet("QuickNet", input_shape, input_tensor, weights, include_top, num_classes)


def QuickNetLarge(  # noqa: N802 (larq-zoo's public names)
    *, input_shape=None, input_tensor=None, weights=None, include_top=True, num_classes=1000
):
    """larq-zoo's QuickNetLarge: sections of 64, 128, 256 and 512 channels with
    6, 8, 12 and 6 blocks. Arguments as :func:`QuickNetSmall`."""
    return _quicknet("QuickNetLarge", input_shape, input_tensor, weights, include_top, num_classes)
