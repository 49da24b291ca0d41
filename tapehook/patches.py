"""Every change tapehook makes to TensorFlow, applied and removed in one place.

- the registered "Conv2D" gradient -> conv2d.conv2d_grad (registry.py swaps it)
- a gradient for tapehook's own TapehookBinaryConv2D op
- gen_nn_ops.conv2d -> conv2d.conv2d (binary forward for marked filters)
- gen_math_ops.mat_mul / batch_mat_mul_v2 / v3 and
  gen_nn_ops.depthwise_conv2d_native -> dense_depthwise (binary Dense and
  DepthwiseConv2D for marked kernels)
- nn_ops.convolution_internal: a dilated conv with a marked filter goes straight
  to Conv2D (the kernels handle dilation natively) instead of SpaceToBatchND,
  whose zero padding would otherwise be binarized to +1
- variable reads, Identity, Cast and ExpandDims tag their output with the
  variable it holds, so a filter read in Python still leads to its marks
- execute.record_gradient: op types under tapehook.override_gradient on this
  thread are recorded with their scoped gradient (override.py)
- Keras: Layer.__call__ keeps the layers being called on a per-thread stack
  (models.py decides binarized models' layers there); Conv layers' get_config
  / from_config carry the layer's BinarySpec, so .keras files load back binary

``install`` is all or nothing: if any step fails, the earlier ones are undone.
"""

import functools

import tensorflow as tf

from tapehook import compat, conv2d, dense_depthwise, marks, models, override, registry
from tapehook.compat import (gen_array_ops, gen_math_ops, gen_nn_ops, nn_ops,
                             resource_variable_ops)

_applied = []  # (owner, attribute name, original), in order of application
_MISSING = object()  # the attribute was inherited, not set on the owner


def _replace(owner, name, make_wrapper):
    original = getattr(owner, name)
    own = vars(owner).get(name, _MISSING) if isinstance(owner, type) else original
    setattr(owner, name, functools.wraps(original)(make_wrapper(original)))
    _applied.append((owner, name, own))
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


def _tracked_layer_call(original):
    """Keras Layer.__call__ with the layer on tapehook's call stack (models.py)."""
    def __call__(self, *args, **kwargs):
        stack = models.layer_stack()
        stack.append(self)
        try:
            models.before_layer_call(self)
            outputs = original(self, *args, **kwargs)
            models.after_layer_call(self, outputs)
            return outputs
        finally:
            stack.pop()
    return __call__


def _config_with_spec(original):
    def get_config(self):
        config = original(self)
        spec = models.layer_config_spec(self)
        if spec is not None:
            config[models.CONFIG_KEY] = models.spec_to_config(spec)
        return config
    return get_config


def _layer_from_config(original):
    def from_config(cls, config):
        config = dict(config)
        saved = config.pop(models.CONFIG_KEY, None)
        layer = original(cls, config)
        if saved is not None:
            models.restore_layer_spec(layer, saved)
        return layer
    return from_config


def _install_keras() -> None:
    try:
        import keras
    except ImportError:  # tapehook works without Keras
        return
    _replace(keras.Layer, "__call__", _tracked_layer_call)
    configured = {next(c for c in layer.__mro__ if "get_config" in vars(c))
                  for layer in models.binarizable_types()}
    for owner in sorted(configured, key=lambda c: c.__name__):
        _replace(owner, "get_config", _config_with_spec)
        own = vars(owner).get("from_config", _MISSING)
        inherited = next(vars(c)["from_config"] for c in owner.__mro__
                         if "from_config" in vars(c))
        owner.from_config = classmethod(functools.wraps(inherited.__func__)(
            _layer_from_config(inherited.__func__)))
        _applied.append((owner, "from_config", own))
    marks.layer_filter_hook[0] = models.spec_for_layer_filter
    _applied.append((marks, "layer_filter_hook", _MISSING))


def install() -> None:
    """Applies every patch once (idempotent); undoes all on any failure."""
    if _applied:
        return
    compat.check()  # before anything is patched
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
        for owner, name in [(gen_math_ops, "mat_mul"), (gen_math_ops, "batch_mat_mul_v2"),
                            (gen_math_ops, "batch_mat_mul_v3"),
                            (gen_nn_ops, "depthwise_conv2d_native")]:
            dense_depthwise.stock[name] = _replace(
                owner, name, lambda _, name=name: getattr(dense_depthwise, name))
        # Tapes in graphs record after op callbacks run; override.py picks the
        # gradient of op types overridden on this thread at recording time.
        _replace(compat.execute, "record_gradient", override._recording_with_overrides)
        _install_keras()
    except Exception:
        uninstall()
        raise


def uninstall() -> None:
    """Restores TensorFlow exactly as it was before ``install``."""
    while _applied:
        owner, name, original = _applied.pop()
        if owner is registry:
            registry.swap_gradient(name, original)
        elif owner is marks and name == "layer_filter_hook":
            marks.layer_filter_hook[0] = None
        elif original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


def installed() -> bool:
    return bool(_applied)
