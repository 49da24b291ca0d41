"""The AlexNet-shaped binary networks of larq-zoo 2.4: XNOR-Net, DoReFa-Net
and Binarized Neural Networks' AlexNet, on tapehook.

All three are AlexNet's five convolutions and (with the top) three fully
connected layers, with batch norms without scale (gamma), larq-zoo's layer
sequence, so its weight files load by layer order.

- XNOR-Net (Rastegari et al., arXiv:1603.05279): float first conv; every
  other conv (the fully connected layers as convs) takes sign(input) and
  alpha * sign(W), alpha = mean|W| per output channel, weights clipped to
  [-1, 1]; an L2 penalty of 5e-7 on every kernel. Runs on tapehook's kernels
  (``BinarySpec(scale="mean_abs")``): larq-zoo's forward exactly, since the
  clip keeps |W| <= 1. larq-zoo also back-propagates through alpha itself;
  here alpha is a constant in the backward pass (as ``MagnitudeAwareSign``).
- DoReFa-Net (Zhou et al., arXiv:1606.06160): 2-bit activations (``DoReFa``,
  k_bit=2: round(3 clip(x, 0, 1)) / 3) and binary weights scaled by one
  mean|W| per layer with an identity gradient; float first and last layers.
  2-bit inputs are not binary, so its convs run as plain TF ops.
- Binary AlexNet (Hubara et al., "Binarized Neural Networks", NIPS 2016):
  sign(W) everywhere (float image into the first conv), sign(input) from the
  second conv on, weights clipped to [-1, 1]; no float classifier.
"""

import keras
import tensorflow as tf

import tapehook.larq as lq
from tapehook.zoo import _common

__all__ = ["BinaryAlexNet", "DoReFaNet", "XNORNet"]


def _batch_norm(epsilon):
    # None of the three learns a scale: a sign (or ReLU) follows every norm.
    return keras.layers.BatchNormalization(momentum=0.9, scale=False, epsilon=epsilon)


def _softmax():
    return keras.layers.Activation("softmax", dtype="float32")


# ---------------------------------------------------------------------------
# XNOR-Net
# ---------------------------------------------------------------------------

# The smallest image whose last 6x6 VALID conv still fits: 11x11 stride-4
# SAME conv, three 3x3 stride-2 VALID pools (217 -> 55 -> 27 -> 13 -> 6).
_XNOR_MIN_SIZE = 217

_XNOR_FILES = _common.release_files(
    "xnornet",
    "v0.2.0",
    "xnornet",
    "e6ba24f785655260ae76a2ef1fab520e3528243d9c8fac430299cd81dbeabe10",
    "20a17423090b2c80c6b7a6b62346faa4b2b7dc8d4da99efa792c9351cf86c3d5",
    notop_version="v0.2.1",
)


def _xnor_regularizer():
    return keras.regularizers.L2(5e-7)


def _xnor_conv(filters, kernel_size, padding="same"):
    return lq.layers.QuantConv2D(
        filters,
        kernel_size,
        padding=padding,
        use_bias=False,
        input_quantizer="ste_sign",
        kernel_quantizer=lq.quantizers.MagnitudeAwareSign(clip_value=1.0),
        kernel_constraint="weight_clip",
        kernel_regularizer=_xnor_regularizer(),
    )


def XNORNet(  # noqa: N802 (larq-zoo's public names)
    *, input_shape=None, input_tensor=None, weights=None, include_top=True, num_classes=1000
):
    """XNOR-Net (larq-zoo ``literature.XNORNet``): 62,396,768 parameters at 224 px.

    Arguments as ``keras.applications``: ``input_shape`` (default 224 x 224 x 3;
    at least 217 px, the smallest the 6x6 VALID conv after three stride-2
    pools fits; any such size, or ``(None, None, 3)``, without the top),
    ``input_tensor``, ``weights`` (None, ``"imagenet"``: larq-zoo's release
    file, or the path of a larq-zoo weights file), ``include_top``,
    ``num_classes``.
    """
    inputs = _common.model_input(
        input_shape, input_tensor, weights, include_top, num_classes, min_size=_XNOR_MIN_SIZE
    )
    x = keras.layers.Conv2D(
        96,
        11,
        strides=4,
        padding="same",
        use_bias=False,
        kernel_regularizer=_xnor_regularizer(),
    )(inputs)
    x = _batch_norm(1e-5)(x)
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.MaxPooling2D(3, strides=2)(x)
    x = _batch_norm(1e-4)(x)
    x = _xnor_conv(256, 5)(x)
    x = keras.layers.MaxPooling2D(3, strides=2)(x)
    x = _batch_norm(1e-4)(x)
    for filters in (384, 384):
        x = _xnor_conv(filters, 3)(x)
        x = _batch_norm(1e-4)(x)
    x = _xnor_conv(256, 3)(x)
    x = keras.layers.MaxPooling2D(3, strides=2)(x)
    x = _batch_norm(1e-4)(x)
    x = _xnor_conv(4096, 6, padding="valid")(x)  # the first fully connected layer
    x = _batch_norm(1e-4)(x)
    if include_top:
        x = _xnor_conv(4096, 1, padding="valid")(x)
        x = _batch_norm(1e-3)(x)
        x = keras.layers.Activation("relu")(x)
        x = keras.layers.Flatten()(x)
        x = keras.layers.Dense(num_classes, use_bias=False, kernel_regularizer=_xnor_regularizer())(
            x
        )
        x = _softmax()(x)
    return _common.finish(inputs, x, "xnornet", weights, include_top, _XNOR_FILES)


# ---------------------------------------------------------------------------
# DoReFa-Net
# ---------------------------------------------------------------------------


@lq.utils.set_precision(1)
@keras.saving.register_keras_serializable(package="larq_zoo")
def magnitude_aware_sign_unclipped(x):
    """mean|x| * sign(x), one mean over the whole kernel (a constant in the
    backward pass); pseudo-gradient: dy unchanged (no clip, no scale).
    DoReFa-Net's weight quantizer, under larq-zoo's name."""
    x = tf.convert_to_tensor(x)
    scale = tf.stop_gradient(tf.reduce_mean(tf.abs(x)))

    @tf.custom_gradient
    def scaled_sign(x):
        return lq.math.sign(x) * scale, lambda dy: dy

    return scaled_sign(x)


@keras.saving.register_keras_serializable(package="larq_zoo")
def clip_by_value_activation(x):
    """clip(x, 0, 1): DoReFa-Net's activation before its float classifier."""
    return tf.clip_by_value(x, 0.0, 1.0)


_DOREFA_ACTIVATION_BITS = 2
# 12x12 stride-4 VALID conv, two 3x3 stride-2 SAME pools and a VALID one
# (44 -> 9 -> 5 -> 3 -> 1).
_DOREFA_MIN_SIZE = 44

_DOREFA_FILES = _common.release_files(
    "dorefanet",
    "v0.1.0",
    "dorefanet",
    "645d7839d574faa3eeeca28f3115773d75da3ab67ff6876b4de12d10245ecf6a",
    "8650e8a86d8d3968722cf5f20bcebe74d6d7bb45bbf03c4bb8c6486343f37e31",
    notop_version="v0.1.1",
)


def _dorefa_quantized(layer_cls, *args, **kwargs):
    return layer_cls(
        *args,
        input_quantizer=lq.quantizers.DoReFa(k_bit=_DOREFA_ACTIVATION_BITS, mode="activations"),
        kernel_quantizer=magnitude_aware_sign_unclipped,
        use_bias=False,
        **kwargs,
    )


def DoReFaNet(  # noqa: N802 (larq-zoo's public names)
    *, input_shape=None, input_tensor=None, weights=None, include_top=True, num_classes=1000
):
    """DoReFa-Net, 2-bit activations (larq-zoo ``literature.DoReFaNet``):
    62,403,912 parameters at 224 px.

    Arguments as ``XNORNet`` (at least 44 px).
    """
    inputs = _common.model_input(
        input_shape, input_tensor, weights, include_top, num_classes, min_size=_DOREFA_MIN_SIZE
    )
    x = keras.layers.Conv2D(96, 12, strides=4, padding="valid")(inputs)
    for filters, kernel_size, pool_padding in (
        (256, 5, "same"),
        (384, 3, "same"),
        (384, 3, None),
        (256, 3, "valid"),
    ):
        x = _dorefa_quantized(lq.layers.QuantConv2D, filters, kernel_size, padding="same")(x)
        x = _batch_norm(1e-4)(x)
        if pool_padding:
            x = keras.layers.MaxPooling2D(3, strides=2, padding=pool_padding)(x)
    if include_top:
        x = keras.layers.Flatten()(x)
        for _ in range(2):
            x = _dorefa_quantized(lq.layers.QuantDense, 4096)(x)
            x = _batch_norm(1e-4)(x)
        x = keras.layers.Activation(clip_by_value_activation)(x)
        x = keras.layers.Dense(num_classes)(x)
        x = _softmax()(x)
    return _common.finish(inputs, x, "dorefanet", weights, include_top, _DOREFA_FILES)


# ---------------------------------------------------------------------------
# Binary AlexNet
# ---------------------------------------------------------------------------

# 11x11 stride-4 SAME conv, three 3x3 stride-2 VALID pools (57 -> 15 -> 7 -> 3 -> 1).
_ALEXNET_MIN_SIZE = 57

_ALEXNET_FILES = _common.release_files(
    "binary_alexnet",
    "v0.3.0",
    "binary_alexnet",
    "7fc065c47c5c1d92389e0bb988ce6df6a4fa09d803b866e2ba648069d6652d63",
    "1d41b33ff39cd28d13679392641bf7711174a96d182417f91df45d0548f5bb47",
    notop_version="v0.2.1",
)


def _alexnet_conv(filters, kernel_size, strides=1, binary_input=True):
    return lq.layers.QuantConv2D(
        filters,
        kernel_size,
        strides=strides,
        padding="same",
        use_bias=False,
        input_quantizer="ste_sign" if binary_input else None,
        kernel_quantizer="ste_sign",
        kernel_constraint="weight_clip",
    )


def BinaryAlexNet(  # noqa: N802 (larq-zoo's public names)
    *, input_shape=None, input_tensor=None, weights=None, include_top=True, num_classes=1000
):
    """Binarized Neural Networks' AlexNet (larq-zoo ``literature.BinaryAlexNet``):
    61,859,192 parameters at 224 px.

    Arguments as ``XNORNet`` (at least 57 px).
    """
    inputs = _common.model_input(
        input_shape, input_tensor, weights, include_top, num_classes, min_size=_ALEXNET_MIN_SIZE
    )
    x = inputs
    for filters, kernel_size, strides, pool in (
        (64, 11, 4, True),
        (192, 5, 1, True),
        (384, 3, 1, False),
        (384, 3, 1, False),
        (256, 3, 1, True),
    ):
        x = _alexnet_conv(filters, kernel_size, strides, binary_input=x is not inputs)(x)
        if pool:
            x = keras.layers.MaxPooling2D(3, strides=2)(x)
        x = _batch_norm(1e-3)(x)
    if include_top:
        # The fully connected layers as 1x1 convs on the flattened features.
        x = keras.layers.Reshape((1, 1, x.shape[1] * x.shape[2] * x.shape[3]))(x)
        for units in (4096, 4096, num_classes):
            x = _alexnet_conv(units, 1)(x)
            x = _batch_norm(1e-3)(x)
        x = keras.layers.Flatten()(x)
        x = _softmax()(x)
    return _common.finish(inputs, x, "binary_alexnet", weights, include_top, _ALEXNET_FILES)
