"""BiRealNet, RealToBinaryNet and BinaryResNetE18: larq-zoo 2.4's binary ResNets.

Each as larq-zoo's code builds it, weight-carrying layers in its order (its
release files load by position):

- **BiRealNet** (Liu et al., "Bi-Real Net", 2018): float 7x7/2 stem conv, BN,
  3x3/2 max pool; 16 blocks ``BN(bconv3x3(x)) + shortcut`` in four stages of
  64-512 channels, the conv binarizing its input with ``approx_sign`` and its
  kernel with ``magnitude_aware_sign`` (sign times the mean absolute latent
  weight per output channel), latent kernel clipped to [-1, 1]; where the width
  doubles, the conv has stride 2 and the shortcut is a 2x2/2 average pool, a
  float 1x1 conv and BN. Every BN has momentum 0.8.
- **BinaryResNetE18** (Bethge et al., "Back to Simplicity", 2019): ResNet-18
  with one shortcut per binary conv: float 7x7/2 stem conv, BN, ReLU, 3x3/2 max
  pool, BN (below 50 px a single float 3x3 conv instead), then 16 blocks
  ``BN(bconv3x3(x)) + shortcut`` with ``SteSign(1.25)`` on input and kernel and
  the kernel clipped to 1.25, the shortcut a 2x2/2 average pool (no padding),
  float 1x1 conv and BN where the width doubles; a final ReLU. BN momentum 0.9,
  epsilon 1e-5.
- **RealToBinaryNet** (Martinez et al., "Training binary neural networks with
  real-to-binary convolutions", 2020), the binary (final stage) network: float
  7x7/2 stem conv, BN, PReLU, 3x3/2 max pool; eight blocks of two halves, each
  ``PReLU(bconv3x3(BN(x)) * s(BN(x))) + shortcut`` with ``ste_sign`` input and
  kernel (clip 1), the kernel clipped to 1, and the learned data-dependent
  rescaling ``s``: global average pool of the conv's input, dense to 1/8 of its
  channels with ReLU, dense to the output channels with sigmoid, both without
  bias. Every BN has momentum 0.99. Layer names are larq-zoo's
  (``r2b_bnn_block_<n><a|b>_...``).
"""

import keras

import tapehook.larq as lq
from tapehook.zoo import _common

__all__ = ["BiRealNet", "BinaryResNetE18", "RealToBinaryNet"]


def _softmax_head(x, num_classes, **dense):
    x = _common.global_pool(x)
    x = keras.layers.Dense(num_classes, **dense)(x)
    return keras.layers.Activation("softmax", dtype="float32")(x)


def _downsampling_shortcut(x, filters, batch_norm, padding, names=None):
    """2x2/2 average pool, float 1x1 conv, BN: the shortcut where the width
    doubles. ``names``: the three layers' names, or None (Keras's)."""
    pool, conv, norm = names or (None, None, None)
    x = keras.layers.AveragePooling2D(2, strides=2, padding=padding, name=pool)(x)
    x = keras.layers.Conv2D(
        filters, 1, use_bias=False, kernel_initializer="glorot_normal", name=conv
    )(x)
    return keras.layers.BatchNormalization(name=norm, **batch_norm)(x)


# ---------------------------------------------------------------------------
# Bi-Real Net


_BIREALNET_FILES = _common.release_files(
    "birealnet",
    "v0.3.0",
    "birealnet",
    "6e6efac1584fcd60dd024198c87f42eb53b5ec719a5ca1f527e1fe7e8b997117",
    "5148b61c0c2a1094bdef811f68bf4957d5ba5f83ad26437b7a4a6855441ab46b",
)


def _birealnet_block(x, filters):
    bn = {"momentum": 0.8}
    shortcut = x
    if x.shape[-1] != filters:
        shortcut = _downsampling_shortcut(x, filters, bn, padding="same")
    y = lq.layers.QuantConv2D(
        filters,
        3,
        strides=1 if x.shape[-1] == filters else 2,
        padding="same",
        input_quantizer="approx_sign",
        kernel_quantizer="magnitude_aware_sign",
        kernel_constraint="weight_clip",
        kernel_initializer="glorot_normal",
        use_bias=False,
    )(x)
    y = keras.layers.BatchNormalization(**bn)(y)
    return keras.layers.Add()([y, shortcut])


def BiRealNet(  # noqa: N802 (larq-zoo's public names)
    *, input_shape=None, input_tensor=None, weights=None, include_top=True, num_classes=1000
):
    """larq-zoo's Bi-Real Net (18 layers). Arguments as
    :func:`tapehook.zoo.quicknet.QuickNetSmall`."""
    inputs = _common.model_input(input_shape, input_tensor, weights, include_top, num_classes)
    x = keras.layers.Conv2D(
        64, 7, strides=2, padding="same", use_bias=False, kernel_initializer="glorot_normal"
    )(inputs)
    x = keras.layers.BatchNormalization(momentum=0.8)(x)
    x = keras.layers.MaxPooling2D(3, strides=2, padding="same")(x)
    for filters in (64, 128, 256, 512):
        for _ in range(4):
            x = _birealnet_block(x, filters)
    if include_top:
        x = _softmax_head(x, num_classes)
    return _common.finish(inputs, x, "birealnet18", weights, include_top, _BIREALNET_FILES)


# ---------------------------------------------------------------------------
# Binary ResNet-E 18


_RESNET_E_FILES = _common.release_files(
    "resnet_e",
    "v0.1.0",
    "resnet_e_18",
    "bde4a64d42c164a7b10a28debbe1ad5b287c499bc0247ecb00449e6e89f3bf5b",
    "14cb037e47d223827a8d09db88ec73d60e4153a4464dca847e5ae1a155e7f525",
)
_RESNET_E_BN = {"momentum": 0.9, "epsilon": 1e-5}
_RESNET_E_SMALL = 50  # images below this size get the small, unstrided stem


def _resnet_e_block(x, filters, strides):
    shortcut = x
    if x.shape[-1] != filters:
        shortcut = _downsampling_shortcut(x, filters, _RESNET_E_BN, padding="valid")
    y = lq.layers.QuantConv2D(
        filters,
        3,
        strides=strides,
        padding="same",
        input_quantizer=lq.quantizers.SteSign(clip_value=1.25),
        kernel_quantizer=lq.quantizers.SteSign(clip_value=1.25),
        kernel_constraint=lq.constraints.WeightClip(clip_value=1.25),
        kernel_initializer="glorot_normal",
        use_bias=False,
    )(x)
    y = keras.layers.BatchNormalization(**_RESNET_E_BN)(y)
    return keras.layers.Add()([y, shortcut])


def BinaryResNetE18(  # noqa: N802 (larq-zoo's public names)
    *, input_shape=None, input_tensor=None, weights=None, include_top=True, num_classes=1000
):
    """larq-zoo's Binary ResNet-E 18. Arguments as :func:`BiRealNet`; images
    smaller than 50 px get larq-zoo's CIFAR-style stem (one float 3x3 conv)."""
    inputs = _common.model_input(input_shape, input_tensor, weights, include_top, num_classes)
    stem = {"use_bias": False, "kernel_initializer": "he_normal", "padding": "same"}
    height = inputs.shape[1]
    if height is not None and height < _RESNET_E_SMALL:
        x = keras.layers.Conv2D(64, 3, **stem)(inputs)
    else:
        x = keras.layers.Conv2D(64, 7, strides=2, **stem)(inputs)
        x = keras.layers.BatchNormalization(**_RESNET_E_BN)(x)
        x = keras.layers.Activation("relu")(x)
        x = keras.layers.MaxPooling2D(3, strides=2, padding="same")(x)
        x = keras.layers.BatchNormalization(**_RESNET_E_BN)(x)
    for stage, filters in enumerate((64, 128, 256, 512)):
        # ResNet-18's two blocks of two convs per stage, a shortcut around each conv.
        for block in range(4):
            x = _resnet_e_block(x, filters, strides=2 if stage and not block else 1)
    x = keras.layers.Activation("relu")(x)
    if include_top:
        x = _softmax_head(x, num_classes, kernel_initializer="glorot_normal")
    return _common.finish(inputs, x, "binary_resnet_e_18", weights, include_top, _RESNET_E_FILES)


# ---------------------------------------------------------------------------
# Real-to-Binary Net


_R2B_NAME = "r2b_bnn"
_R2B_BN = {"momentum": 0.99}
_R2B_SCALING_REDUCTION = 8  # the rescaling's bottleneck: input channels / 8
_R2B_FILES = _common.release_files(
    "r2b",
    "v0.1.0",
    "r2b",
    "e8fd16ca1ab9810ac3835f24f5c62758a57bc32a615f73aaa50d382d2b9617e1",
    "4ec47abf1a4da5c65f4908076257e8d5c812673891089a88c9d9e84e949d1dab",
)


def _r2b_rescaling(conv_input, conv_output, name):
    """Real-to-Binary's data-dependent scale of the binary conv's output, from
    its (real) input, squeeze-and-excitation style."""
    out_channels = conv_output.shape[-1]
    s = _common.global_pool(conv_input, name=f"{name}_scaling_pool")
    s = keras.layers.Dense(
        conv_input.shape[-1] // _R2B_SCALING_REDUCTION,
        activation="relu",
        use_bias=False,
        kernel_initializer="he_normal",
        name=f"{name}_scaling_dense_reduce",
    )(s)
    s = keras.layers.Dense(
        out_channels,
        activation="sigmoid",
        use_bias=False,
        kernel_initializer="he_normal",
        name=f"{name}_scaling_dense_expand",
    )(s)
    s = keras.layers.Reshape((1, 1, out_channels), name=f"{name}_scaling_reshape")(s)
    return keras.layers.Multiply(name=f"{name}_scaling_multiplication")([conv_output, s])


def _r2b_half_block(x, downsample, name):
    in_channels = x.shape[-1]
    out_channels = 2 * in_channels if downsample else in_channels
    shortcut = x
    if downsample:
        shortcut = _downsampling_shortcut(
            x,
            out_channels,
            _R2B_BN,
            padding="same",
            names=tuple(f"{name}_shortcut_{s}" for s in ("pool", "conv2d", "batch_norm")),
        )
    conv_input = keras.layers.BatchNormalization(name=f"{name}_batch_norm", **_R2B_BN)(x)
    y = lq.layers.QuantConv2D(
        out_channels,
        3,
        strides=2 if downsample else 1,
        padding="same",
        input_quantizer="ste_sign",
        kernel_quantizer="ste_sign",
        kernel_constraint="weight_clip",
        kernel_initializer="glorot_normal",
        use_bias=False,
        name=f"{name}_conv2d",
    )(conv_input)
    y = _r2b_rescaling(conv_input, y, name)
    y = keras.layers.PReLU(shared_axes=[1, 2], name=f"{name}_prelu")(y)
    return keras.layers.Add(name=f"{name}_skip_add")([y, shortcut])


def RealToBinaryNet(  # noqa: N802 (larq-zoo's public names)
    *, input_shape=None, input_tensor=None, weights=None, include_top=True, num_classes=1000
):
    """larq-zoo's Real-to-Binary Net, the binary network of its final training
    stage. Arguments as :func:`BiRealNet`."""
    inputs = _common.model_input(input_shape, input_tensor, weights, include_top, num_classes)
    stem = f"{_R2B_NAME}_block_1"
    x = keras.layers.Conv2D(
        64,
        7,
        strides=2,
        padding="same",
        use_bias=False,
        kernel_initializer="glorot_normal",
        name=f"{stem}_conv2d",
    )(inputs)
    x = keras.layers.BatchNormalization(name=f"{stem}_batch_norm", **_R2B_BN)(x)
    x = keras.layers.PReLU(shared_axes=[1, 2], name=f"{stem}_prelu")(x)
    x = keras.layers.MaxPooling2D(3, strides=2, padding="same", name=f"{stem}_pool")(x)
    for block in range(2, 10):
        name = f"{_R2B_NAME}_block_{block}"
        x = _r2b_half_block(x, downsample=block in (4, 6, 8), name=f"{name}a")
        x = _r2b_half_block(x, downsample=False, name=f"{name}b")
        # larq-zoo names each block's output (its attention-matching points).
        x = keras.layers.Identity(name=f"{name}_out")(x)
    if include_top:
        head = f"{_R2B_NAME}_block_10"
        x = _common.global_pool(x, name=f"{head}_global_pool")
        x = keras.layers.Dense(num_classes, name=f"{head}_logits")(x)
        x = keras.layers.Softmax(name=f"{head}_probs", dtype="float32")(x)
    return _common.finish(inputs, x, _R2B_NAME, weights, include_top, _R2B_FILES)
