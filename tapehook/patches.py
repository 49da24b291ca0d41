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
  - Identity, Cast and ExpandDims pass a tensor's tag (the variable it holds)
    on, so a filter read in Python still leads to its marks; reads tag their
    output only where needed: a marked variable's own read (_MarkedRead in
    its instance dict) and, while a binary_scope is open, the class's read
  - the gen_* functions on the path of every op have a signature-exact front
    (_front) before their FunctionWrapper, so the common untagged call skips
    the wrapper's generic argument handling (bench/overhead.py)
  - execute.record_gradient: op types under tapehook.override_gradient on
    this thread are recorded with their scoped gradient (override.py)
  - Keras: Conv1D.call lets a binary causal Conv1D pad x_hat itself
    (interpose.py); Layer.__call__ keeps the layers being called on a per-thread
    stack (models.py decides binarized models' layers there); Conv layers'
    get_config / from_config carry the layer's BinarySpec, so .keras files
    load back binary

The functions on the path of every op (the gen_* functions, Layer.__call__,
the dilated-conv entry points) are wrapped only once the
process first marks something (``marks.arm``): until then importing tapehook
leaves them as TF's own objects, and unmarked code pays nothing
(bench/overhead.py). ``install`` is all or nothing: if any step fails, the
earlier ones are undone; ``uninstall`` puts back the original objects.
"""

import functools
import inspect
import weakref

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


def _wrap(owner, name, wrapper, kind=wrapt.FunctionWrapper):
    """Replaces ``owner.name`` by ``kind(original, wrapper)``: a wrapt
    FunctionWrapper, or a _front before one; returns the original.

    On a class the raw descriptor (function, classmethod) is wrapped, found
    along the MRO, so an inherited method is wrapped for ``owner`` alone.
    """
    if isinstance(owner, type):
        raw = next(vars(c)[name] for c in owner.__mro__ if name in vars(c))
        own = vars(owner).get(name, _MISSING)
    else:
        raw = own = getattr(owner, name)
    setattr(owner, name, kind(raw, wrapper))
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


def _front(original, wrapper, test):
    """A function with ``original``'s exact signature in front of its wrapt
    FunctionWrapper, for the gen_* functions on the path of every op.

    ``test`` names the operand(s) the common case is decided on:
    ``("untagged", names)`` -- those operands are tensors no marked variable
    was read into, so ``original`` runs; ``("tag", name)`` -- a tensor
    ``name`` runs ``original`` and its tag, if any, goes to the output. Any
    other call goes to the FunctionWrapper, whose (wrapped, instance, args,
    kwargs) wrapper decides it in full. The front binds the call as the
    original would (same parameters and defaults, so every calling form works
    and a wrong one raises the original's TypeError) and passes every argument
    on by position: no dict is built, which is what keeps an untagged call
    close to stock where the FunctionWrapper alone would add a visible cost
    to every TF op (bench/overhead.py). Its frames count as patches.py's, hidden
    from TF's "in user code" frames like the wrappers'.
    """
    params = list(inspect.signature(original).parameters.values())
    if any(p.kind is not p.POSITIONAL_OR_KEYWORD or p.name.startswith("_th_") for p in params):
        return wrapt.FunctionWrapper(original, wrapper)  # no front for this signature
    names = [p.name for p in params]
    head = ", ".join(
        n if p.default is p.empty else f"{n}=_th_default_{n}" for n, p in zip(names, params)
    )
    every = ", ".join(names)
    kind, operands = test
    if kind == "untagged":
        untagged = " and ".join(
            f"isinstance({n}, _th_Tensor) and _th_SOURCE not in getattr({n}, '__dict__', _th_NO_DICT)"
            for n in operands
        )
        body = f"    if {untagged}:\n        return _th_original({every})\n"
    else:
        body = (
            f"    if isinstance({operands}, _th_Tensor):\n"
            f"        _th_variable = getattr({operands}, '__dict__', _th_NO_DICT).get(_th_SOURCE)\n"
            f"        _th_result = _th_original({every})\n"
            f"        if _th_variable is not None:\n"
            f"            _th_tag(_th_result, _th_variable)\n"
            f"        return _th_result\n"
        )
    source = f"def front({head}):\n{body}    return _th_wrapped({every})\n"
    namespace = {
        "_th_Tensor": tf.Tensor,
        "_th_SOURCE": marks.SOURCE_ATTR,
        "_th_NO_DICT": {},
        "_th_tag": marks.tag,
        "_th_original": original,
        "_th_wrapped": wrapt.FunctionWrapper(original, wrapper),
        **{f"_th_default_{p.name}": p.default for p in params if p.default is not p.empty},
    }
    exec(compile(source, __file__, "exec"), namespace)  # noqa: S102 (our own source)
    return functools.update_wrapper(namespace["front"], original)


def _untagged(*names):
    return lambda original, wrapper: _front(original, wrapper, ("untagged", names))


def _passes_tag(name):
    return lambda original, wrapper: _front(original, wrapper, ("tag", name))


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
    """The class's variable read while a binary_scope is open somewhere: a
    read on a thread inside a scope leads back to its variable."""
    result = wrapped(*args, **kwargs)
    if marks.scope_active():
        marks.tag(result, instance)
    return result


class _MarkedRead:
    """A marked component variable's own ``_read_variable_op``, set in its
    instance dict (so reads of every other variable stay TF's own): the read
    tags its result with the variable. Holds the variable weakly (no cycle
    through its ``__dict__``) and calls the class's method, whatever it is."""

    __slots__ = ("_variable", "__weakref__")

    def __init__(self, variable):
        self._variable = weakref.ref(variable)

    def __call__(self, *args, **kwargs):
        variable = self._variable()
        result = type(variable)._read_variable_op(variable, *args, **kwargs)
        marks.tag(result, variable)
        return result


_READ = "_read_variable_op"


def _hook_reads(component, marked: bool) -> None:
    """marks._on_mark: a marked component's reads tag their result."""
    own = vars(component)
    if marked and _hot[0]:
        if not isinstance(own.get(_READ), _MarkedRead):
            own[_READ] = _MarkedRead(component)
    elif isinstance(own.get(_READ), _MarkedRead):
        del own[_READ]


_scoped_read = []  # the class's original read, while the scope wrapper is on


def _scoped_reads(any_open: bool) -> None:
    """marks._on_scopes: every variable's reads are wrapped (_tagging_read)
    while a binary_scope is open on any thread, and TF's own otherwise."""
    owner = resource_variable_ops.BaseResourceVariable
    if any_open and _hot[0] and not _scoped_read:
        _scoped_read.append(vars(owner)[_READ])
        setattr(owner, _READ, wrapt.FunctionWrapper(_scoped_read[0], _tagging_read))
    elif not any_open and _scoped_read:
        setattr(owner, _READ, _scoped_read.pop())


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
        models.before_layer_call(instance, args[0] if args else None)
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
    _wrap(
        gen_nn_ops,
        "conv2d",
        _on_marked_operand(1, "filter", interpose.conv2d_call),
        _untagged("filter"),
    )
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
    for owner, name, operand in [
        (gen_array_ops, "identity", "input"),
        (gen_array_ops, "expand_dims", "input"),
        (gen_math_ops, "cast", "x"),
    ]:
        _wrap(owner, name, _tag_passing(operand), _passes_tag(operand))
    _wrap(
        gen_math_ops,
        "mat_mul",
        _on_marked_operand(1, "b", interpose.mat_mul, left=(0, "a")),
        _untagged("b", "a"),
    )
    for version in ("batch_mat_mul_v2", "batch_mat_mul_v3"):
        _wrap(
            gen_math_ops,
            version,
            _on_marked_operand(1, "y", interpose.batch_mat_mul),
            _untagged("y"),
        )
    _wrap(
        gen_nn_ops,
        "depthwise_conv2d_native",
        _on_marked_operand(1, "filter", interpose.depthwise_conv2d_native),
        _untagged("filter"),
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
        _apply(_hook_marked_reads)


def _hook_marked_reads() -> None:
    """Reads of the variables marked (or in scopes) now tag their result."""
    _hot[0] = True
    for component in marks.marked_components():
        _hook_reads(component, True)
    _scoped_reads(marks.any_scope_open())


def _apply(step) -> None:
    """Runs one install step; on failure undoes everything and re-raises."""
    try:
        step()
    except Exception:
        uninstall()
        raise


def _install_base() -> None:
    registry.register_gradient(kernels.BINARY_OP, gradient.binary_conv2d_op_grad)
    registry.register_gradient(kernels.AFFINE_OP, gradient.binary_conv2d_affine_op_grad)
    registry.register_gradient(kernels.AFFINE_ADD_OP, gradient.binary_conv2d_affine_add_op_grad)
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
    for hooks, hook in [
        (marks._on_arm, _arm_hook),
        (marks._on_mark, _hook_reads),
        (marks._on_scopes, _scoped_reads),
    ]:
        if hook not in hooks:
            hooks.append(hook)
    _apply(_install_base)
    if marks.ARMED if hot is None else hot:
        _apply(_install_hot)
        _apply(_hook_marked_reads)


def uninstall() -> None:
    """Restores TensorFlow exactly as it was before ``install``."""
    _hot[0] = False
    _scoped_reads(False)
    for component in marks.marked_components():
        _hook_reads(component, False)
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
