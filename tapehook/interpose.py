"""What a patched TensorFlow function does when a marked kernel reaches it.

patches.py wraps each function so that its unmarked calls go to TensorFlow
untouched; only a call whose kernel operand is a marked variable (or a tensor
read from one) comes here, with the call's arguments bound to the original's
signature. Each function below takes the kernel's spec and those arguments.

The dilated cases exist because TF implements dilation for some entry points
with SpaceToBatchND, which zero-pads the *float* input before the conv op
sees it; binarizing that input would turn the padding into +1. A marked
kernel therefore goes to an op that dilates natively, so x_hat is padded
with zeros exactly as for an undilated conv (docs/design.md).
"""

import threading

import numpy as np
import tensorflow as tf

from tapehook import conv2d, counts, marks, models, reference
from tapehook.compat import nn_ops
from tapehook.errors import TapehookError


def static_ints(value):
    """``value`` (int, list, tuple, ndarray) as a list of ints; None if it is
    not static (e.g. a symbolic tensor), then TF's own function decides."""
    if value is None:
        return None
    try:
        return [int(v) for v in np.ravel(value)]
    except (TypeError, ValueError, NotImplementedError):
        return None


def _dilated(dilations):
    ints = static_ints(dilations)
    return ints is not None and any(d != 1 for d in ints), ints


def conv2d_call(spec, **call):
    """gen_nn_ops.conv2d with a marked filter."""
    call["padding"], call["explicit_paddings"] = causal_padding(
        call.get("padding"), call.get("explicit_paddings", ())
    )
    return conv2d.conv2d(spec, **call)


def convolution_internal(
    spec,
    input,
    filters,
    strides=None,
    padding="VALID",  # noqa: A002
    data_format=None,
    dilations=None,
    name=None,
    **_,
):
    """nn_ops.convolution_internal with a marked filter and dilation: Conv2D
    (4-D filter) or Conv1D (3-D filter) with native dilations; None to let
    TF's function run (undilated: it reaches gen_nn_ops.conv2d directly)."""
    dilated, ints = _dilated(dilations)
    if not dilated or not isinstance(padding, str):
        return None
    rank = filters.shape.rank
    stride = static_ints(strides) if strides is not None else [1]
    if stride is None:
        return None
    if rank == 4 and data_format in (None, "NHWC"):
        return nn_ops.conv2d_v2(
            input,
            filters,
            strides=stride,
            padding=padding,
            data_format="NHWC",
            dilations=ints,
            name=name,
        )
    if rank == 3 and data_format in (None, "NWC"):
        return nn_ops.conv1d_v2(
            input,
            filters,
            stride=stride,
            padding=padding,
            data_format="NWC",
            dilations=ints,
            name=name,
        )
    return None


def _require_nhwc(data_format):
    if (data_format or "NHWC") != "NHWC":
        raise TapehookError(
            f"a marked depthwise filter was used with data_format {data_format}; "
            f"binary kernels support NHWC only (Keras: data_format='channels_last')"
        )


def _depthwise_dilations(rate, data_format, padding):
    dilated, ints = _dilated(rate)
    if not dilated or not isinstance(padding, str):
        return None
    _require_nhwc(data_format)
    ints = ints * 2 if len(ints) == 1 else ints
    return [1, ints[0], ints[1], 1]


def depthwise_conv2d(
    spec,
    input,
    filter,
    strides,
    padding,
    rate=None,
    name=None,  # noqa: A002
    data_format=None,
    dilations=None,
):
    """nn_impl.depthwise_conv2d (tf.nn.depthwise_conv2d, Keras DepthwiseConv2D)
    with a marked filter and dilation: DepthwiseConv2dNative with dilations."""
    native = _depthwise_dilations(rate if rate is not None else dilations, data_format, padding)
    if native is None:
        return None
    return nn_ops.depthwise_conv2d_native(
        input, filter, strides, padding, data_format="NHWC", dilations=native, name=name
    )


def separable_conv2d(
    spec,
    input,
    depthwise_filter,
    pointwise_filter,
    strides,
    padding,  # noqa: A002
    rate=None,
    name=None,
    data_format=None,
    dilations=None,
):
    """nn_impl.separable_conv2d with a marked depthwise filter and dilation:
    the depthwise part dilates natively, then the 1x1 pointwise conv."""
    native = _depthwise_dilations(rate if rate is not None else dilations, data_format, padding)
    if native is None:
        return None
    depthwise = nn_ops.depthwise_conv2d_native(
        input, depthwise_filter, strides, padding, data_format="NHWC", dilations=native
    )
    return nn_ops.conv2d(
        depthwise, pointwise_filter, [1, 1, 1, 1], "VALID", data_format="NHWC", name=name
    )


def _checked(x, w, what):
    x, w = tf.convert_to_tensor(x), tf.convert_to_tensor(w)
    marks.check_operands(x, w, what)
    counts.count_reference(forward=1)
    return x, w


def _count_backward():
    counts.count_reference(backprop_input=1, backprop_filter=1)


def mat_mul(spec, a, b, transpose_a=False, transpose_b=False, **_):
    """gen_math_ops.mat_mul with a marked right operand: binary Dense."""
    if transpose_a or transpose_b:
        raise TapehookError("binary Dense supports x @ W without transposes")
    spec, b = reference.balance(spec, b)
    x, w = _checked(a, b, "Dense")
    return reference.binary_matmul(x, w, spec, _count_backward)


def batch_mat_mul(spec, x, y, adj_x=False, adj_y=False, **_):
    """gen_math_ops.batch_mat_mul_v2 / v3 with a marked right operand."""
    if adj_x or adj_y or y.shape.rank != 2:
        raise TapehookError("binary Dense supports x @ W with a 2-D marked W and no adjoints")
    spec, y = reference.balance(spec, y)
    xt, w = _checked(x, y, "Dense")
    return reference.binary_matmul(xt, w, spec, _count_backward)


def depthwise_conv2d_native(
    spec,
    input,
    filter,
    strides,
    padding,  # noqa: A002
    explicit_paddings=(),
    data_format="NHWC",
    dilations=(1, 1, 1, 1),
    name=None,
):
    """gen_nn_ops.depthwise_conv2d_native with a marked filter."""
    _require_nhwc(data_format)
    spec, filter = reference.balance(spec, filter, output_axes=2)  # noqa: A001
    x, w = _checked(input, filter, "DepthwiseConv2D")
    return reference.binary_depthwise_conv2d(
        x, w, spec, strides, padding, explicit_paddings, dilations, _count_backward
    )


# ---- Keras Conv1D(padding="causal") ----
# Keras pads the float input with zeros and runs a VALID conv; binarizing
# that input would pad x_hat with +1. For a binary Conv1D the layer runs its
# conv unpadded instead, and the conv pads x_hat itself (EXPLICIT, on the
# left): with zeros, or with pad_value.

_causal = threading.local()


def causal_conv1d_call(wrapped, instance, args, kwargs):
    """Wrapper of keras.layers.Conv1D.call (patches.py)."""
    spec = models.layer_config_spec(instance)
    if instance.padding != "causal" or spec is None or instance.data_format != "channels_last":
        return wrapped(*args, **kwargs)
    left = instance.dilation_rate[0] * (instance.kernel_size[0] - 1)
    instance.padding = "valid"
    pending = getattr(_causal, "left", None)
    _causal.left = left
    try:
        return wrapped(*args, **kwargs)
    finally:
        _causal.left = pending
        instance.padding = "causal"


def causal_padding(padding, explicit_paddings):
    """(padding, explicit_paddings) of a binary conv inside a causal Conv1D's
    call: the VALID conv becomes EXPLICIT with the causal left padding on W
    (Conv1D runs as Conv2D with H = 1)."""
    left = getattr(_causal, "left", None)
    if left is None or padding != "VALID":
        return padding, explicit_paddings
    _causal.left = None  # one conv per call
    return "EXPLICIT", [0, 0, 0, 0, left, 0, 0, 0]
