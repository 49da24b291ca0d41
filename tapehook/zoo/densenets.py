"""BinaryDenseNet 28 / 37 / 37-dilated / 45 and MeliusNet22 on tapehook.

Both families grow a feature map by concatenation: each block normalizes the
map, runs a binary 3x3 conv (sign of input and weights, straight-through
estimator clipped at 1.3, weights clipped to [-1.3, 1.3]) to 64 new channels
and appends them. Between stages a float transition (batch norm, max pool,
ReLU, 1x1 conv) shrinks the channels. The layer sequence, widths and batch
norm settings are larq-zoo 2.4's, so its weight files load by layer order.

- BinaryDenseNet (Bethge et al., "Back to Simplicity: How to Train Accurate
  BNNs from Scratch?", arXiv:1906.08637): the transition keeps
  ``reduction``-th of the channels, rounded to a multiple of 32. The dilated
  variant replaces the last two stages' pooling by dilated convolutions.
- MeliusNet (Bethge et al., arXiv:2001.05936): each dense block is followed by
  an improvement block, whose binary conv's 64 outputs are added to the 64
  channels the dense block just appended; a grouped-conv stem.
"""

import dataclasses

import keras

import tapehook.larq as lq
from tapehook.zoo import _common

__all__ = [
    "BinaryDenseNet28",
    "BinaryDenseNet37",
    "BinaryDenseNet37Dilated",
    "BinaryDenseNet45",
    "MeliusNet22",
]

_CLIP = 1.3  # both families' sign clip and weight clip
_GROWTH = 64  # channels each binary conv appends (or improves)


def _binary_conv(filters, *, dilation_rate=1, name=None):
    """A binary 3x3 conv of both families: sign of input and weights, clipped at 1.3."""
    return lq.layers.QuantConv2D(
        filters,
        3,
        dilation_rate=dilation_rate,
        padding="same",
        use_bias=False,
        input_quantizer=lq.quantizers.SteSign(clip_value=_CLIP),
        kernel_quantizer=lq.quantizers.SteSign(clip_value=_CLIP),
        kernel_constraint=lq.constraints.WeightClip(_CLIP),
        kernel_initializer="glorot_normal",
        name=name,
    )


def _batch_norm(name=None):
    return keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5, name=name)


def _relu(name=None):
    return keras.layers.Activation("relu", name=name)


def _classifier(x, num_classes, kernel_initializer, names=(None, None, None)):
    """Global average pool, dense logits, softmax in float32 (mixed precision)."""
    pool, dense, softmax = names
    x = _common.global_pool(x, name=pool)
    x = keras.layers.Dense(num_classes, kernel_initializer=kernel_initializer, name=dense)(x)
    return keras.layers.Activation("softmax", dtype="float32", name=softmax)(x)


# ---------------------------------------------------------------------------
# BinaryDenseNet
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _DenseNetConfig:
    name: str
    blocks: tuple  # binary convs per stage
    reduction: tuple  # each transition keeps channels / reduction (rounded to 32)
    dilation: tuple  # per stage; a stage with dilation > 1 is not pooled into
    files: dict


_DENSENET28 = _DenseNetConfig(
    name="binary_densenet28",
    blocks=(6, 6, 6, 5),
    reduction=(2.7, 2.7, 2.2),
    dilation=(1, 1, 1, 1),
    files=_common.release_files(
        "binary_densenet",
        "v0.1.0",
        "binary_densenet_28",
        top="21fe3ca03eed244df9c41a2219876fcf03e73800932ec96a3e2a76af4747ac53",
        notop="a376df1e41772c4427edd1856072b934a89bf293bf911438bf6f751a9b2a28f5",
    ),
)
_DENSENET37 = _DenseNetConfig(
    name="binary_densenet37",
    blocks=(6, 8, 12, 6),
    reduction=(3.3, 3.3, 4),
    dilation=(1, 1, 1, 1),
    files=_common.release_files(
        "binary_densenet",
        "v0.1.0",
        "binary_densenet_37",
        top="8056a5d52c3ed86a934893987d09a06f59a5166aa9bddcaedb050f111d0a7d76",
        notop="4e12bca9fd27580a5b833241c4eb35d6cc332878c406048e6ca8dbbc78d59175",
    ),
)
_DENSENET37_DILATED = _DenseNetConfig(
    name="binary_densenet37_dilated",
    blocks=(6, 8, 12, 6),
    reduction=(3.3, 3.3, 4),
    dilation=(1, 1, 2, 4),
    files=_common.release_files(
        "binary_densenet",
        "v0.1.0",
        "binary_densenet_37_dilated",
        top="15c1bcd79b8dc22971382fbf79acf364a3f51049d0e584a11533e6fdbb7363d3",
        notop="8b31fbfdc8de08a46c6adcda1ced48ace0a2ff0ce45a05c72b2acc27901dd88b",
        notop_version="v0.1.1",
    ),
)
_DENSENET45 = _DenseNetConfig(
    name="binary_densenet45",
    blocks=(6, 12, 14, 8),
    reduction=(2.7, 3.3, 4),
    dilation=(1, 1, 1, 1),
    files=_common.release_files(
        "binary_densenet",
        "v0.1.0",
        "binary_densenet_45",
        top="d00a0d26fbd2dba1bfba8c0306c770f3aeea5c370e99f963bb239bd916f72c37",
        notop="e72d5cc6b0afe4612f8be7b1f9bb48a53ba2c8468b57bf1266d2900c99fd2adf",
    ),
)

# Images smaller than this (static height) get a single stride-1 3x3 stem
# conv instead of the ImageNet stem's 7x7 stride-2 conv and max pool.
_DENSENET_SMALL_IMAGE = 50


def _transition_width(channels, reduction):
    # larq-zoo's rule, kept exactly (float floor division, then Python's
    # round-half-to-even) so that its widths, and weight files, match.
    return round(channels // reduction / 32) * 32


def _densenet(config, input_shape, input_tensor, weights, include_top, num_classes):
    inputs = _common.model_input(input_shape, input_tensor, weights, include_top, num_classes)
    height = inputs.shape[1]
    conv = {"use_bias": False, "kernel_initializer": "he_normal"}
    if height is not None and height < _DENSENET_SMALL_IMAGE:
        x = keras.layers.Conv2D(64, 3, padding="same", **conv)(inputs)
    else:
        x = keras.layers.Conv2D(64, 7, strides=2, padding="same", **conv)(inputs)
        x = _batch_norm()(x)
        x = _relu()(x)
        x = keras.layers.MaxPooling2D(3, strides=2, padding="same")(x)

    last = len(config.blocks) - 1
    for stage, convs in enumerate(config.blocks):
        for _ in range(convs):
            y = _batch_norm()(x)
            y = _binary_conv(_GROWTH, dilation_rate=config.dilation[stage])(y)
            x = keras.layers.Concatenate()([x, y])
        if stage == last:
            break
        x = _batch_norm()(x)
        if config.dilation[stage + 1] == 1:
            x = keras.layers.MaxPooling2D(2, strides=2)(x)
        x = _relu()(x)
        width = _transition_width(x.shape[-1], config.reduction[stage])
        x = keras.layers.Conv2D(width, 1, **conv)(x)

    x = _batch_norm()(x)
    x = _relu()(x)
    if include_top:
        x = _classifier(x, num_classes, "he_normal")
    return _common.finish(inputs, x, config.name, weights, include_top, config.files)


def BinaryDenseNet28(  # noqa: N802 (larq-zoo's public names)
    *, input_shape=None, input_tensor=None, weights=None, include_top=True, num_classes=1000
):
    """BinaryDenseNet-28 (larq-zoo ``literature.BinaryDenseNet28``): 5,150,504
    parameters at 224 px.

    Arguments as ``keras.applications``: ``input_shape`` (default 224 x 224 x 3;
    any size, or ``(None, None, 3)``, without the top; images under 50 px high
    get a 3x3 stride-1 stem), ``input_tensor``, ``weights`` (None, ``"imagenet"``:
    larq-zoo's release file, or the path of a larq-zoo weights file),
    ``include_top``, ``num_classes``.
    """
    return _densenet(_DENSENET28, input_shape, input_tensor, weights, include_top, num_classes)


def BinaryDenseNet37(  # noqa: N802 (larq-zoo's public names)
    *, input_shape=None, input_tensor=None, weights=None, include_top=True, num_classes=1000
):
    """BinaryDenseNet-37 (larq-zoo ``literature.BinaryDenseNet37``): 8,734,120
    parameters at 224 px. Arguments as ``BinaryDenseNet28``."""
    return _densenet(_DENSENET37, input_shape, input_tensor, weights, include_top, num_classes)


def BinaryDenseNet37Dilated(  # noqa: N802 (larq-zoo's public names)
    *, input_shape=None, input_tensor=None, weights=None, include_top=True, num_classes=1000
):
    """BinaryDenseNet-37 with dilated last stages (larq-zoo
    ``literature.BinaryDenseNet37Dilated``): the third and fourth stages keep
    the second's resolution and dilate their binary convs by 2 and 4;
    8,734,120 parameters at 224 px. Arguments as ``BinaryDenseNet28``."""
    return _densenet(
        _DENSENET37_DILATED, input_shape, input_tensor, weights, include_top, num_classes
    )


def BinaryDenseNet45(  # noqa: N802 (larq-zoo's public names)
    *, input_shape=None, input_tensor=None, weights=None, include_top=True, num_classes=1000
):
    """BinaryDenseNet-45 (larq-zoo ``literature.BinaryDenseNet45``): 13,939,240
    parameters at 224 px. Arguments as ``BinaryDenseNet28``."""
    return _densenet(_DENSENET45, input_shape, input_tensor, weights, include_top, num_classes)


# ---------------------------------------------------------------------------
# MeliusNet
# ---------------------------------------------------------------------------


@keras.saving.register_keras_serializable(package="tapehook.zoo")
class ChannelSplit(keras.layers.Layer):
    """Splits the channels (last axis) into ``groups`` equal parts."""

    def __init__(self, groups, **kwargs):
        super().__init__(**kwargs)
        self.groups = groups

    def call(self, inputs):
        return keras.ops.split(inputs, self.groups, axis=-1)

    def compute_output_shape(self, input_shape):
        part = (*input_shape[:-1], input_shape[-1] // self.groups)
        return [part] * self.groups

    def get_config(self):
        return {**super().get_config(), "groups": self.groups}


@keras.saving.register_keras_serializable(package="tapehook.zoo")
class AddToLastChannels(keras.layers.Layer):
    """``[x, y]`` -> x with y added to its last ``y.shape[-1]`` channels
    (MeliusNet's improvement block: y improves the channels just appended)."""

    def call(self, inputs):
        x, y = inputs
        keep = x.shape[-1] - y.shape[-1]
        return keras.ops.concatenate([x[..., :keep], x[..., keep:] + y], axis=-1)

    def compute_output_shape(self, input_shape):
        return input_shape[0]


_MELIUS_INIT = "glorot_normal"


def _melius_pool(name):
    return keras.layers.MaxPooling2D(2, strides=2, padding="same", name=name)


def _melius_conv(filters, kernel_size, name, strides=1):
    return keras.layers.Conv2D(
        filters,
        kernel_size,
        strides=strides,
        padding="same",
        use_bias=False,
        kernel_initializer=_MELIUS_INIT,
        name=name,
    )


def _grouped_conv(x, filters, groups, name):
    """A float 3x3 conv in ``groups`` independent channel groups, one Conv2D
    per group (the layout of larq-zoo's weight files)."""
    parts = ChannelSplit(groups, name=f"{name}_split")(x)
    parts = [
        _melius_conv(filters // groups, 3, name=f"{name}_conv{i}")(part)
        for i, part in enumerate(parts)
    ]
    return keras.layers.Concatenate(name=f"{name}_concat")(parts)


def _melius_stem(x):
    x = _melius_conv(32, 3, strides=2, name="stem_s0_conv")(x)
    x = _batch_norm("stem_s0_bn")(x)
    x = _relu("stem_s0_relu")(x)
    for step, (filters, groups) in enumerate(((32, 4), (64, 8)), start=1):
        x = _grouped_conv(x, filters, groups, name=f"stem_s{step}_groupconv")
        x = _batch_norm(f"stem_s{step}_bn")(x)
        x = _relu(f"stem_s{step}_relu")(x)
    return _melius_pool("stem_pool")(x)


def _melius_block(x, name):
    y = _batch_norm(f"{name}_dense_bn")(x)
    y = _binary_conv(_GROWTH, name=f"{name}_dense_binconv")(y)
    x = keras.layers.Concatenate(name=f"{name}_dense_concat")([x, y])
    y = _batch_norm(f"{name}_improve_bn")(x)
    y = _binary_conv(_GROWTH, name=f"{name}_improve_binconv")(y)
    return AddToLastChannels(name=f"{name}_improve_merge")([x, y])


def _melius_transition(x, filters, name):
    x = _batch_norm(f"{name}_bn")(x)
    x = _melius_pool(f"{name}_maxpool")(x)
    x = _relu(f"{name}_relu")(x)
    return keras.layers.Conv2D(
        filters, 1, use_bias=False, kernel_initializer=_MELIUS_INIT, name=f"{name}_pw"
    )(x)


_MELIUS22_BLOCKS = (4, 5, 4, 4)
_MELIUS22_TRANSITIONS = (160, 224, 256, None)  # 1x1 conv widths after each section
_MELIUS22_FILES = _common.release_files(
    "meliusnet22",
    "v0.1.0",
    "meliusnet22",
    "c1ba85e8389ae326009665ec13331e49fc3df4d0f925fa8553e224f7362c18ed",
    "abfc5c50049d72a14e44df0c1cb73896ece2a1ab4bf9bb48fede6cc2f5e0b58f",
    notop_version="v0.1.1",
)


def MeliusNet22(  # noqa: N802 (larq-zoo's public names)
    *, input_shape=None, input_tensor=None, weights=None, include_top=True, num_classes=1000
):
    """MeliusNet-22 (larq-zoo ``literature.MeliusNet22``): 6,969,672 parameters
    at 224 px (larq-zoo's docs say 6,944,584; its code builds this many).

    Layer names are larq-zoo's (``stem_*``, ``section_{i}_block_{j}_*``,
    ``section_{i}_transition_*``, ``head_*``). Arguments as
    ``BinaryDenseNet28`` (no small-image stem).
    """
    inputs = _common.model_input(input_shape, input_tensor, weights, include_top, num_classes)
    x = _melius_stem(inputs)
    for section, (blocks, width) in enumerate(
        zip(_MELIUS22_BLOCKS, _MELIUS22_TRANSITIONS, strict=True)
    ):
        for block in range(blocks):
            x = _melius_block(x, f"section_{section}_block_{block}")
        if width:
            x = _melius_transition(x, width, f"section_{section}_transition")
    x = _batch_norm("head_bn")(x)
    x = _relu("head_relu")(x)
    if include_top:
        x = _classifier(
            x, num_classes, _MELIUS_INIT, names=("head_globalpool", "head_dense", "head_softmax")
        )
    return _common.finish(inputs, x, "meliusnet22", weights, include_top, _MELIUS22_FILES)
