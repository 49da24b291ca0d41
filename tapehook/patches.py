"""Every change tapehook makes to TensorFlow, applied and removed in one place.

- the registered "Conv2D" gradient -> conv2d.conv2d_grad (registry.py swaps it)
- a gradient for tapehook's own TapehookBinaryConv2D op
- gen_nn_ops.conv2d -> conv2d.conv2d (binary forward for marked filters)
- nn_ops.convolution_internal: a dilated conv with a marked filter goes straight
  to Conv2D (the kernels handle dilation natively) instead of SpaceToBatchND,
  whose zero padding would otherwise be binarized to +1
- variable reads, Identity, Cast and ExpandDims tag their output with the
  variable it holds, so a filter read in Python still leads to its marks

``install`` is all or nothing: if any step fails, the earlier ones are undone.
"""

import functools

import tensorflow as tf
from tensorflow.python.ops import (gen_array_ops, gen_math_ops, gen_nn_ops,
                                   nn_ops, resource_variable_ops)

from tapehook import conv2d, marks, registry

_applied = []  # (owner, attribute name, original), in order of application


def _replace(owner, name, make_wrapper):
    original = getattr(owner, name)
    wrapper = functools.wraps(original)(make_wrapper(original))
    wrapper.__tapehook_original__ = original
    setattr(owner, name, wrapper)
    _applied.append((owner, name, original))
    return original


def _tagging_read(original):
    def read(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if marks.scope_active() or marks.binary_spec_of(self) is not None:
            marks.tag(result, self)
        return result
    return read


def _tag_passing(original):
    """Wraps an op whose output holds the same values as its first input."""
    def op(value, *args, **kwargs):
        result = original(value, *args, **kwargs)
        source = marks.source_variable(value)
        if source is not None:
            marks.tag(result, source)
        return result
    return op


def _dilated_to_conv2d(original):
    def convolution_internal(input, filters, strides=None, padding="VALID",  # noqa: A002
                             data_format=None, dilations=None, name=None,
                             call_from_convolution=True, num_spatial_dims=None):
        dilated = dilations is not None and any(
            d != 1 for d in tf.nest.flatten(dilations))
        if (dilated and isinstance(padding, str) and filters.shape.rank == 4
                and data_format in (None, "NHWC")
                and marks.spec_for_use(filters, mark=False) is not None):
            return nn_ops.conv2d_v2(input, filters, strides=strides or 1,
                                    padding=padding, data_format="NHWC",
                                    dilations=dilations, name=name)
        return original(input, filters, strides=strides, padding=padding,
                        data_format=data_format, dilations=dilations, name=name,
                        call_from_convolution=call_from_convolution,
                        num_spatial_dims=num_spatial_dims)
    return convolution_internal


def install() -> None:
    """Applies every patch once (idempotent); undoes all on any failure."""
    if _applied:
        return
    try:
        registry.register_gradient(conv2d.BINARY_OP, conv2d.binary_conv2d_op_grad)
        conv2d.stock["conv2d_grad"] = registry.swap_gradient("Conv2D", conv2d.conv2d_grad)
        _applied.append((registry, "Conv2D", conv2d.stock["conv2d_grad"]))
        conv2d.stock["conv2d"] = _replace(gen_nn_ops, "conv2d", lambda _: conv2d.conv2d)
        _replace(nn_ops, "convolution_internal", _dilated_to_conv2d)
        _replace(resource_variable_ops.BaseResourceVariable, "_read_variable_op",
                 _tagging_read)
        _replace(gen_array_ops, "identity", _tag_passing)
        _replace(gen_array_ops, "expand_dims", _tag_passing)
        _replace(gen_math_ops, "cast", _tag_passing)
    except Exception:
        uninstall()
        raise


def uninstall() -> None:
    """Restores TensorFlow exactly as it was before ``install``."""
    while _applied:
        owner, name, original = _applied.pop()
        if owner is registry:
            registry.swap_gradient(name, original)
        else:
            setattr(owner, name, original)


def installed() -> bool:
    return bool(_applied)
