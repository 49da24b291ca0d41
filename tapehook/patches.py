"""Every change tapehook makes to TensorFlow, applied and removed in one place.

- the registered "Conv2D" gradient -> gradient.conv2d_grad (registry.py swaps it)
- a gradient for tapehook's own TapehookBinaryConv2D op
- functions wrapped with wrapt, each a signature-exact pass-through
  ``(wrapped, instance, args, kwargs)``: every calling form the original
  accepts still works, introspection (``inspect.signature``, ``__wrapped__``,
  ``__doc__``) is the original's, and a call without a marked operand goes to
  the original unchanged:
  - gen_nn_ops.conv2d, gen_nn_ops.depthwise_conv2d_native,
    gen_math_ops.mat_mul / batch_mat_mul_v2 / v3 -> interpose.py (binary
    Conv2D, DepthwiseConv2D and Dense for marked kernels)
  - nn_ops.convolution_internal, nn_impl.depthwise_conv2d /
    separable_conv2d (and their tf.compat.v1.nn names): a dilated conv with a
    marked filter goes to an op that dilates natively instead of
    SpaceToBatchND, whose zero padding would be binarized to +1
  - variable reads, Identity, Cast and ExpandDims tag their output with the
    variable it holds, so a filter read in Python still leads to its marks
  - execute.record_gradient: op types under tapehook.override_gradient on
    this thread are recorded with their scoped gradient (override.py)
  - Keras: Conv1D.call lets a binary causal Conv1D pad x_hat itself
    (interpose.py); Layer.__call__ keeps the layers being called on a per-thread
    stack (models.py decides binarized models' layers there); Conv layers'
    get_config / from_config carry the layer's BinarySpec, so .keras files
    load back binary

The functions on the path of every op (the gen_* functions, variable reads,
Layer.__call__, the dilated-conv entry points) are wrapped only once the
process first marks something (``marks.arm``): until then importing tapehook
leaves them as TF's own objects, and unmarked code pays nothing
(bench/overhead.py). ``install`` is all or nothing: if any step fails, the
earlier ones are undone; ``uninstall`` puts back the original objects.
"""

import functools
import inspect

import tensorflow as tf
import wrapt

from tapehook import compat, gradient, interpose, kernels, marks, models, override, registry
from tapehook.compat import (
    gen_array_ops,
    gen_math_ops,
    gen_nn_ops,
    nn_impl,
    nn_ops,
    resource_variable_ops,
)
from tapehook.errors import TapehookError

_applied = []  # (owner, attribute name, original), in order of application
_MISSING = object()  # the attribute was inherited, not set on the owner


def _wrap(owner, name, wrapper):
    """Replaces ``owner.name`` by a wrapt FunctionWrapper; returns the original.

    On a class the raw descriptor (function, classmethod) is wrapped, found
    along the MRO, so an inherited method is wrapped for ``owner`` alone.
    """
    if isinstance(owner, type):
        raw = next(vars(c)[name] for c in owner.__mro__ if name in vars(c))
        own = vars(owner).get(name, _MISSING)
    else:
        raw = own = getattr(owner, name)
    setattr(owner, name, wrapt.FunctionWrapper(raw, wrapper))
    _applied.append((owner, name, own))
    return raw


@functools.cache
def _signature(function):
    return inspect.signature(function)


def _bind(wrapped, args, kwargs):
    """The call's arguments by name (defaults left to the callee), or None
    when they do not bind, so that the original raises its own error."""
    try:
        return dict(_signature(wrapped).bind(*args, **kwargs).arguments)
    except TypeError:
        return None


def _operand(args, kwargs, index, name):
    return args[index] if len(args) > index else kwargs.get(name)


def _untagged_tensor(obj) -> bool:
    """A tensor that was not read from a variable tapehook tracks: never a
    binary kernel (marks.source_variable, inlined for every op's sake)."""
    return isinstance(obj, tf.Tensor) and marks.SOURCE_ATTR not in obj.__dict__


def _on_marked_operand(index, name, binary, mark=True, left=None):
    """Wrapper: calls with a marked operand ``name`` (positional ``index``) go
    to ``binary(spec, **arguments)``; a None from it means "TF's own function
    runs". ``left``: (index, name) of an operand that must not be marked."""

    def wrapper(wrapped, instance, args, kwargs):
        operand = args[index] if len(args) > index else kwargs.get(name)
        if _untagged_tensor(operand) and (
            left is None or _untagged_tensor(_operand(args, kwargs, *left))
        ):
            return wrapped(*args, **kwargs)  # the common case, kept short
        spec = marks.spec_for_use(operand, mark=mark)
        if spec is None and models.layer_stack():
            # a binarized Keras layer's kernel, built in this very call: the
            # layer's spec marks it now (also before a dilated-conv redirect)
            spec = models.spec_for_layer_filter(marks.source_variable(operand))
        if spec is None:
            if left is not None and marks.binary_spec_of(_operand(args, kwargs, *left)) is not None:
                raise TapehookError(
                    "a marked binary kernel is the left operand of a MatMul; binary "
                    "Dense supports x @ W with the marked W on the right"
                )
            return wrapped(*args, **kwargs)
        arguments = _bind(wrapped, args, kwargs)
        if arguments is None:
            return wrapped(*args, **kwargs)
        result = binary(spec, **arguments)
        return wrapped(*args, **kwargs) if result is None else result

    return wrapper


def _tagging_read(wrapped, instance, args, kwargs):
    """A variable read whose result leads back to the variable when it matters."""
    result = wrapped(*args, **kwargs)
    if marks.read_is_tagged(instance):
        marks.tag(result, instance)
    return result


def _tag_passing(name):
    """Wrapper of an op whose output holds the same values as its input ``name``."""

    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        source = marks.source_variable(_operand(args, kwargs, 0, name))
        if source is not None:
            marks.tag(result, source)
        return result

    return wrapper


def _tracked_layer_call(wrapped, instance, args, kwargs):
    """Keras Layer.__call__ with the layer on tapehook's call stack (models.py)."""
    stack = models.layer_stack()
    stack.append(instance)
    try:
        models.before_layer_call(instance)
        outputs = wrapped(*args, **kwargs)
        models.after_layer_call(instance, outputs)
        return outputs
    finally:
        stack.pop()


def _config_with_spec(wrapped, instance, args, kwargs):
    config = wrapped(*args, **kwargs)
    spec = models.layer_config_spec(instance)
    if spec is not None:
        config[models.CONFIG_KEY] = models.spec_to_config(spec)
    return config


def _layer_from_config(wrapped, instance, args, kwargs):
    arguments = _bind(wrapped, args, kwargs)
    if (
        arguments is None
        or not isinstance(arguments.get("config"), dict)
        or (models.CONFIG_KEY not in arguments["config"])
    ):
        return wrapped(*args, **kwargs)
    config = dict(arguments.pop("config"))
    saved = config.pop(models.CONFIG_KEY)
    layer = wrapped(config, **arguments)
    models.restore_layer_spec(layer, saved)
    return layer


def _keras():
    try:
        import keras
    except ImportError:  # tapehook works without Keras
        return None
    return keras


def _install_keras_config() -> None:
    """Binarizable layers' get_config / from_config carry the spec: loading a
    .keras file must find them before anything is marked."""
    keras = _keras()
    if keras is None:
        return
    configured = {
        next(c for c in layer.__mro__ if "get_config" in vars(c))
        for layer in models.binarizable_types()
    }
    for owner in sorted(configured, key=lambda c: c.__name__):
        _wrap(owner, "get_config", _config_with_spec)
        _wrap(owner, "from_config", _layer_from_config)


def _wrap_with_v1_name(owner, name, wrapper):
    """Wraps ``owner.name`` and tf.compat.v1.nn's export of the same function
    (an alias bound at TF's import, which a module patch does not reach)."""
    original = _wrap(owner, name, wrapper)
    if getattr(tf.compat.v1.nn, name, None) is original:
        _wrap(tf.compat.v1.nn, name, wrapper)


def _install_hot() -> None:
    """The wrappers on the path of every op, applied when the process is armed."""
    _wrap(gen_nn_ops, "conv2d", _on_marked_operand(1, "filter", interpose.conv2d_call))
    _wrap(
        nn_ops,
        "convolution_internal",
        _on_marked_operand(1, "filters", interpose.convolution_internal, mark=False),
    )
    _wrap_with_v1_name(
        nn_impl,
        "depthwise_conv2d",
        _on_marked_operand(1, "filter", interpose.depthwise_conv2d, mark=False),
    )
    _wrap_with_v1_name(
        nn_impl,
        "separable_conv2d",
        _on_marked_operand(1, "depthwise_filter", interpose.separable_conv2d, mark=False),
    )
    _wrap(resource_variable_ops.BaseResourceVariable, "_read_variable_op", _tagging_read)
    _wrap(gen_array_ops, "identity", _tag_passing("input"))
    _wrap(gen_array_ops, "expand_dims", _tag_passing("input"))
    _wrap(gen_math_ops, "cast", _tag_passing("x"))
    _wrap(gen_math_ops, "mat_mul", _on_marked_operand(1, "b", interpose.mat_mul, left=(0, "a")))
    for version in ("batch_mat_mul_v2", "batch_mat_mul_v3"):
        _wrap(gen_math_ops, version, _on_marked_operand(1, "y", interpose.batch_mat_mul))
    _wrap(
        gen_nn_ops,
        "depthwise_conv2d_native",
        _on_marked_operand(1, "filter", interpose.depthwise_conv2d_native),
    )
    keras = _keras()
    if keras is not None:
        _wrap(keras.Layer, "__call__", _tracked_layer_call)
        _wrap(keras.layers.Conv1D, "call", interpose.causal_conv1d_call)


_hot = [False]  # whether _install_hot's wrappers are applied


def _arm_hook() -> None:
    """marks.arm calls this when the process first marks something."""
    if _applied and not _hot[0]:
        _apply(_install_hot)
        _hot[0] = True


def _apply(step) -> None:
    """Runs one install step; on failure undoes everything and re-raises."""
    try:
        step()
    except Exception:
        uninstall()
        raise


def _install_base() -> None:
    registry.register_gradient(kernels.BINARY_OP, gradient.binary_conv2d_op_grad)
    _applied.append((registry, "Conv2D", registry.swap_gradient("Conv2D", gradient.conv2d_grad)))
    # Tapes in graphs record after op callbacks run; override.py picks the
    # gradient of op types overridden on this thread at recording time.
    _wrap(compat.execute, "record_gradient", override.recording_with_overrides)
    _install_keras_config()
    compat.hide_from_tracebacks(__file__, True)
    _applied.append((compat, "hide_from_tracebacks", _MISSING))


def install(hot=None) -> None:
    """Applies every patch once (idempotent); undoes all on any failure.

    ``hot``: apply the per-op wrappers now (default: if the process is
    armed; otherwise marks.arm applies them when it is).
    """
    if _applied:
        return
    compat.check()  # before anything is patched
    if _arm_hook not in marks._on_arm:
        marks._on_arm.append(_arm_hook)
    _apply(_install_base)
    if marks.ARMED if hot is None else hot:
        _apply(_install_hot)
        _hot[0] = True


def uninstall() -> None:
    """Restores TensorFlow exactly as it was before ``install``."""
    _hot[0] = False
    while _applied:
        owner, name, original = _applied.pop()
        if owner is registry:
            registry.swap_gradient(name, original)
        elif owner is compat:
            compat.hide_from_tracebacks(__file__, False)
        elif original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


def installed() -> bool:
    return bool(_applied)


def patched_functions():
    """(owner, attribute name) of every wrapped function, for tests and docs."""
    return [(owner, name) for owner, name, _ in _applied if owner not in (registry, compat)]
