"""Binary Dense (MatMul / BatchMatMulV2 / V3) and DepthwiseConv2dNative.

Same marks, scopes, decorator and estimators as the conv; the math is
reference.binary_matmul / reference.binary_depthwise_conv2d (plain TF ops with
a tf.custom_gradient, so every execution mode and XLA work). No compiled
kernels yet: Dense and depthwise layers are a small share of a BNN's MACs.
The wrappers replace the gen_* functions in patches.py; an operand that is not
a marked variable (or a tensor read from one) goes to TF untouched.
"""

import tensorflow as tf

from tapehook import conv2d, marks, reference
from tapehook.errors import TapehookError

stock = {}  # set by patches.install(): TF's own gen_* functions


def _check(x, w, what):
    x, w = tf.convert_to_tensor(x), tf.convert_to_tensor(w)
    marks.check_operands(x, w, what)
    conv2d._count_reference(forward=1)
    return x, w


def _count_backward():
    conv2d._count_reference(backprop_input=1, backprop_filter=1)


def mat_mul(a, b, transpose_a=False, transpose_b=False, grad_a=False, grad_b=False,
            name=None):
    spec = marks.spec_for_use(b)
    if spec is None:
        if marks.binary_spec_of(a) is not None:
            raise TapehookError(
                "a marked binary kernel is the left operand of a MatMul; binary "
                "Dense supports x @ W with the marked W on the right")
        return stock["mat_mul"](a, b, transpose_a=transpose_a, transpose_b=transpose_b,
                                grad_a=grad_a, grad_b=grad_b, name=name)
    if transpose_a or transpose_b:
        raise TapehookError("binary Dense supports x @ W without transposes")
    x, w = _check(a, b, "Dense")
    return reference.binary_matmul(x, w, spec, _count_backward)


def _batch_mat_mul(version):
    def batch_mat_mul(x, y, *args, adj_x=False, adj_y=False, **kwargs):
        spec = marks.spec_for_use(y)
        if spec is None:
            return stock[version](x, y, *args, adj_x=adj_x, adj_y=adj_y, **kwargs)
        if adj_x or adj_y or y.shape.rank != 2:
            raise TapehookError(
                "binary Dense supports x @ W with a 2-D marked W and no adjoints")
        xt, w = _check(x, y, "Dense")
        return reference.binary_matmul(xt, w, spec, _count_backward)
    return batch_mat_mul


batch_mat_mul_v2 = _batch_mat_mul("batch_mat_mul_v2")
batch_mat_mul_v3 = _batch_mat_mul("batch_mat_mul_v3")


def depthwise_conv2d_native(input, filter, strides, padding, explicit_paddings=(),  # noqa: A002
                            data_format="NHWC", dilations=(1, 1, 1, 1), name=None):
    spec = marks.spec_for_use(filter)
    if spec is None:
        return stock["depthwise_conv2d_native"](
            input, filter, strides, padding, explicit_paddings=explicit_paddings,
            data_format=data_format, dilations=dilations, name=name)
    if (data_format or "NHWC") != "NHWC":
        raise TapehookError(
            f"a marked depthwise filter was used with data_format {data_format}; "
            f"binary kernels support NHWC only (Keras: data_format='channels_last')")
    x, w = _check(input, filter, "DepthwiseConv2D")
    return reference.binary_depthwise_conv2d(x, w, spec, strides, padding,
                                             explicit_paddings, dilations, _count_backward)
