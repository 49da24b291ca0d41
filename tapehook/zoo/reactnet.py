"""ReActNet-A (Liu et al., "ReActNet: Towards Precise Binary Neural Network
with Generalized Activation Functions", ECCV 2020), as its paper and public
code describe it; :func:`ReActNetA` has the architecture."""

import keras

import tapehook.larq as lq
from tapehook.errors import TapehookError
from tapehook.recipes import RPReLU, RSign
from tapehook.zoo import _common

__all__ = ["ReActNetA"]

STEM_WIDTH = 32
# (input width, output width, stride) of each block; MobileNet-v1's widths.
BLOCKS = (
    (32, 64, 1),
    (64, 128, 2),
    (128, 128, 1),
    (128, 256, 2),
    (256, 256, 1),
    (256, 512, 2),
    *((512, 512, 1),) * 5,
    (512, 1024, 2),
    (1024, 1024, 1),
)
_BN = {"momentum": 0.9, "epsilon": 1e-5}


def _binary_conv(filters, kernel_size, strides, name):
    return lq.layers.QuantConv2D(
        filters,
        kernel_size,
        strides=strides,
        padding="same",
        use_bias=False,
        input_quantizer="ste_sign",
        kernel_quantizer="magnitude_aware_sign",
        kernel_constraint="weight_clip",
        name=name,
    )


def _half(x, shortcut, kernel_size, strides, copies, name):
    """RPReLU(concat over ``copies`` of BN(bconv(RSign(x))) + shortcut)."""
    channels = x.shape[-1]
    signs = RSign(estimator="approx_sign", name=f"{name}_rsign")(x)
    sums = []
    for copy in range(copies):
        part = f"{name}_{copy + 1}" if copies > 1 else name
        y = _binary_conv(channels, kernel_size, strides, f"{part}_conv")(signs)
        y = keras.layers.BatchNormalization(name=f"{part}_bn", **_BN)(y)
        sums.append(keras.layers.Add(name=f"{part}_add")([y, shortcut]))
    y = sums[0] if copies == 1 else keras.layers.Concatenate(name=f"{name}_concat")(sums)
    return RPReLU(name=f"{name}_rprelu")(y)


def _block(x, filters, strides, name):
    shortcut = x
    if strides == 2:
        shortcut = keras.layers.AveragePooling2D(2, strides=2, padding="same", name=f"{name}_pool")(
            x
        )
    x = _half(x, shortcut, 3, strides, 1, f"{name}_3x3")
    # The width doubles (two convs) or stays (one).
    return _half(x, x, 1, 1, filters // x.shape[-1], f"{name}_1x1")


def ReActNetA(  # noqa: N802 (the zoo's public names)
    *, input_shape=None, input_tensor=None, weights=None, include_top=True, num_classes=1000
):
    """ReActNet-A (Liu et al., ECCV 2020): a MobileNet-v1 whose
    depthwise-separable layers become binary blocks.

    - stem: float 3x3/2 conv to 32 channels, BN (no activation);
    - 13 blocks of widths 32 -> 64 -> 128 -> 128 -> 256 -> 256 -> 512 (x6) ->
      1024 -> 1024, a 2x stride where MobileNet-v1 has one (into 128, 256,
      512 and 1024 channels). A block from C to O channels is two halves,
      each ``RPReLU(BN(bconv(RSign(x))) + shortcut)``: a C -> C binary 3x3
      conv with the block's stride, whose shortcut is the input (a 2x2/2
      average pool of it at stride 2); then a C -> C binary 1x1 conv whose
      shortcut is the 3x3 half's output; where O = 2C, two such convs (each
      with its BN, the same shortcut) read the same binarized input and their
      sums are concatenated;
    - head: global average pool, float dense, softmax.

    RSign is sign(x - beta) with Bi-Real-Net's ``approx_sign``
    pseudo-gradient, RPReLU is PReLU(x - gamma) + zeta, both per channel
    (``tapehook.recipes``). A binary conv's kernel is sign(W) times the mean
    |W| of its output channel (``magnitude_aware_sign``), its gradient passed
    where |W| <= 1; its input, +-1 from RSign already, goes through
    ``ste_sign``, which leaves values and gradient unchanged and keeps the
    conv on tapehook's binary kernels. BN: momentum 0.9, epsilon 1e-5
    (PyTorch's defaults, which ReActNet's code uses).

    The paper: 69.4 % ImageNet top-1 with 4.82e9 BOPs and 0.12e8 FLOPs
    (0.87e8 OPs); ReActNet's code builds these layers, about 29 million
    parameters (this model's counts: docs/guides/zoo.md).

    Where this differs from ReActNet's code:

    - padding ``"same"``: a 3x3/2 conv on an even-sized map pads one row and
      column at the bottom and right only, where PyTorch pads one on every
      side (same output size, the sampling grid half a pixel apart); the
      average pools pad the same way, so odd sizes work;
    - ``magnitude_aware_sign`` multiplies the kernel's gradient by the
      per-channel scale, which ReActNet's code leaves out (Adam's per-weight
      normalization makes the two nearly alike);
    - the latent kernel is clipped to [-1, 1] after each step (``weight_clip``,
      as larq-zoo's Bi-Real Net); ReActNet's code leaves weights that pass 1,
      whose gradient is then zero for good;
    - initializers are Keras's defaults, not PyTorch's.

    Args:
        input_shape: ``(height, width, 3)``; default (224, 224, 3), or any size
            (None) with ``include_top=False``.
        input_tensor: a tensor to build the model on instead of a new input.
        weights: None (random initialization) or the path of a weights file
            saved by this model's ``save_weights`` (same ``include_top``).
            No ImageNet weights exist for it in Keras: ``"imagenet"`` raises.
        include_top: whether to end with the pooled dense classifier; without
            it the model returns the last block's feature map.
        num_classes: the classifier's width.
    """
    if weights == "imagenet":
        raise TapehookError(
            "no ImageNet weights are released for ReActNetA in Keras (ReActNet's "
            "authors published PyTorch checkpoints; larq-zoo has no ReActNet); train it "
            "(examples/train_zoo.py --model ReActNetA) or pass a weights file saved by "
            "its save_weights as weights=..."
        )
    inputs = _common.model_input(input_shape, input_tensor, weights, include_top, num_classes)
    x = keras.layers.Conv2D(
        STEM_WIDTH, 3, strides=2, padding="same", use_bias=False, name="stem_conv"
    )(inputs)
    x = keras.layers.BatchNormalization(name="stem_bn", **_BN)(x)
    for index, (_, filters, strides) in enumerate(BLOCKS, start=1):
        x = _block(x, filters, strides, f"block_{index}")
    if include_top:
        x = _common.global_pool(x, name="head")
        x = keras.layers.Dense(num_classes, name="head_logits")(x)
        x = keras.layers.Activation("softmax", dtype="float32", name="head_softmax")(x)
    return _common.finish(inputs, x, "reactnet_a", weights, include_top, {})
