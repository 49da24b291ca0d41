"""Binary marks on variables, and how a Conv2D filter leads back to its variable.

A mark is a BinarySpec stored on the resource handle of every component
variable (one for a plain tf.Variable, one per replica for a MirroredVariable),
so it lives exactly as long as the variable and never depends on id() reuse.

A filter reaches Conv2D either as the variable object itself (tf.nn.conv2d and
Keras Conv2D pass it through) or as a tensor read from it, possibly through
Cast (mixed precision) or ExpandDims (Conv1D). Reads of marked variables (and
any read inside a binary_scope) and those ops are patched (tapehook/patches.py)
to tag their output tensor with the variable it came from, in eager and in
graphs alike.
"""

import threading
import weakref

import numpy as np
import tensorflow as tf

from tapehook.compat import keras_variable_base, resource_variable_ops
from tapehook.errors import TapehookError
from tapehook.spec import FIELDS, BinarySpec

_SPEC_ATTR = "_tapehook_spec"  # on a component variable's handle
SOURCE_ATTR = "_tapehook_variable"  # on a tensor: the variable it was read from
SUPPORTED_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
KERNEL_RANKS = (2, 3, 4)  # Dense, Conv1D, Conv2D / DepthwiseConv2D
_SUPPORTED_NAMES = "half, bfloat16, float32, float64"

# False until this process first marks a variable, opens a binary_scope or
# binarizes a model. Until then the TF functions on the path of every op are
# not wrapped at all (patches.py wraps them when armed), so unmarked code in a
# process that never marks anything runs TF's own functions. Never reset:
# marks can outlive any object.
ARMED = False
_on_arm = []  # callables run once, when the process is first armed
_arm_lock = threading.Lock()

# Reads that must tag their result: a marked variable's, and any variable's
# while a binary_scope is open on its thread. patches.py hooks them where
# they happen, so that other reads stay TF's own: ``_on_mark(component,
# marked)`` when a component variable is marked or unmarked (its own read
# method), ``_on_scopes(any_open)`` when the process's first binary_scope
# opens and its last one closes (the class's read method, for every thread).
_on_mark = []
_on_scopes = []
_marked = {}  # id(component) -> weakref, every marked component alive
_open_scopes = [0]  # binary_scopes open on all threads together

# Objects that are never variables nor tensors read from one: the operand
# check returns at once for them (NumPy / Python inputs to TF functions).
_PLAIN_TYPES = (
    np.ndarray,
    np.generic,
    list,
    tuple,
    dict,
    int,
    float,
    complex,
    bool,
    str,
    bytes,
    type(None),
)


def arm() -> None:
    """Called before anything that can make a conv binary exists."""
    global ARMED
    if ARMED:
        return
    with _arm_lock:
        if not ARMED:
            for callback in _on_arm:
                callback()
            ARMED = True


def components(obj):
    """The tf ResourceVariables behind a variable-like object, else None.

    Accepts tf.Variable, Keras 3 Variable, distributed (Mirrored) variables and
    their per-replica components.
    """
    if isinstance(obj, _PLAIN_TYPES) or isinstance(obj, tf.Tensor):
        return None
    keras_variable = keras_variable_base()
    if keras_variable and isinstance(obj, keras_variable):
        obj = obj._value  # the backing tf.Variable (read without autocast)
    container = getattr(obj, "_distributed_container", None)
    if container is not None and container() is not None:
        obj = container()
    if (
        hasattr(obj, "values")
        and isinstance(obj, tf.Variable)
        and not isinstance(obj, resource_variable_ops.BaseResourceVariable)
    ):
        return [c for v in obj.values for c in components(v)]
    if isinstance(obj, resource_variable_ops.BaseResourceVariable):
        return [obj]
    return None


def is_variable(obj) -> bool:
    return components(obj) is not None


def _check_markable(var):
    comps = components(var)
    if comps is None:
        raise TapehookError(
            f"mark_binary needs a tf.Variable or keras.Variable holding a Conv2D "
            f"filter, got {type(var).__name__}; create the filter with tf.Variable "
            f"(or a Keras layer) and mark that"
        )
    first = comps[0]
    if first.dtype not in SUPPORTED_DTYPES:
        raise TapehookError(
            f"variable {first.name} has dtype {first.dtype.name}; binary kernels "
            f"support {_SUPPORTED_NAMES}"
        )
    rank = first.shape.rank
    if rank not in KERNEL_RANKS:
        raise TapehookError(
            f"variable {first.name} has shape {first.shape}; only kernels can be "
            f"marked binary: Conv2D / DepthwiseConv2D [h, w, in, out] (4-D), Conv1D "
            f"[w, in, out] (3-D) and Dense [in, out] (2-D)"
        )
    return comps


def check_operands(x, w, what: str) -> None:
    """A binary op's input and marked kernel must share one supported dtype."""
    if w.dtype not in SUPPORTED_DTYPES:
        raise TapehookError(
            f"{what} kernel marked binary has dtype {w.dtype.name}; binary kernels "
            f"support {_SUPPORTED_NAMES}"
        )
    if x.dtype != w.dtype:
        raise TapehookError(
            f"binary {what} input has dtype {x.dtype.name} but the marked kernel "
            f"has {w.dtype.name}; cast the input to {w.dtype.name}"
        )


def make_spec(spec_kwargs) -> BinarySpec:
    try:
        return BinarySpec(**spec_kwargs)
    except TypeError as exc:
        raise TapehookError(f"{exc}; a binary spec takes {', '.join(FIELDS)}") from None


def mark_binary(var, **spec):
    """Marks ``var`` binary with ``BinarySpec(**spec)``; returns ``var``."""
    set_mark(var, make_spec(spec))
    return var


def set_mark(var, spec: BinarySpec) -> None:
    comps = _check_markable(var)
    arm()
    for comp in comps:
        setattr(comp.handle, _SPEC_ATTR, spec)
        _track(comp, True)


def unmark(var) -> None:
    """Removes the binary mark; ``var`` is a float filter again."""
    comps = components(var)
    if comps is None:
        raise TapehookError(f"unmark needs a variable, got {type(var).__name__}")
    for comp in comps:
        if hasattr(comp.handle, _SPEC_ATTR):
            delattr(comp.handle, _SPEC_ATTR)
        _track(comp, False)


def _track(comp, marked: bool) -> None:
    key = id(comp)
    if marked and key not in _marked:
        _marked[key] = weakref.ref(comp, lambda _, key=key: _marked.pop(key, None))
    elif not marked:
        _marked.pop(key, None)
    for callback in _on_mark:
        callback(comp, marked)


def marked_components():
    """Every marked component variable alive (patches.py hooks their reads)."""
    return [c for c in (ref() for ref in list(_marked.values())) if c is not None]


def any_scope_open() -> bool:
    return _open_scopes[0] > 0


def binary_spec_of(obj):
    """The BinarySpec of a variable (or of a tensor read from one), or None."""
    var = source_variable(obj)
    if var is None:
        return None
    comps = components(var)
    return tensor_attribute(comps[0].handle, _SPEC_ATTR) if comps else None


def source_variable(obj):
    """The variable a filter object is, or was read from; None for anything else.

    Never raises: TF functions are called with NumPy arrays, lists, numbers and
    tensors of unknown shape, and those must reach TF unchanged.
    """
    if isinstance(obj, _PLAIN_TYPES):
        return None
    if isinstance(obj, tf.Tensor):
        return tensor_attribute(obj, SOURCE_ATTR)
    return obj if is_variable(obj) else None


def tensor_attribute(tensor, name):
    """``getattr(tensor, name, None)`` for the attributes tapehook sets on
    tensors, from the instance dict: a miss through tf.Tensor.__getattr__
    raises and catches an AttributeError, and every op of a process with marks
    asks (bench/overhead.py; docs/performance.md)."""
    try:
        return tensor.__dict__.get(name)
    except AttributeError:  # no instance dict: nothing was set on it
        return None


def tag(tensor, variable) -> None:
    """Records on ``tensor`` that it holds the value of ``variable``."""
    try:
        setattr(tensor, SOURCE_ATTR, variable)
    except AttributeError:  # e.g. a composite tensor without a __dict__
        pass


# ---- binary_scope state (per thread: a scope is a lexical block of code) ----

_local = threading.local()


def scope_stack():
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def scope_active() -> bool:
    return bool(getattr(_local, "stack", None))


def push_scope(spec: BinarySpec, allowed=None) -> None:
    """Makes ``spec`` the innermost scope on this thread.

    ``allowed``: None (every filter used, and every variable created) or a
    predicate on a variable (only filters it accepts, decided when used).
    """
    arm()
    scope_stack().append((spec, allowed))
    _count_scopes(+1)


def pop_scope() -> None:
    scope_stack().pop()
    _count_scopes(-1)


def _count_scopes(step: int) -> None:
    with _arm_lock:
        before = _open_scopes[0]
        _open_scopes[0] = before + step
        if (before == 0) != (_open_scopes[0] == 0):
            for callback in _on_scopes:
                callback(_open_scopes[0] > 0)


def spec_for_use(filter_obj, mark=True):
    """The spec a Conv2D filter is binarized with, marking it if a scope asks to.

    Returns None for float convs. With ``mark=False`` nothing is changed.
    """
    var = source_variable(filter_obj)
    if var is None:
        return None
    spec = binary_spec_of(var)
    if spec is None and scope_active():
        spec, allowed = scope_stack()[-1]
        if allowed is not None and not allowed(var):
            return None
        if mark:
            set_mark(var, spec)
    return spec


def scope_marks_created(var) -> None:
    """Marks a variable created inside a binary_scope if it can be a conv filter."""
    if not scope_active():
        return
    spec, allowed = scope_stack()[-1]
    comps = components(var)
    if not comps or allowed is not None:
        return
    first = comps[0]
    if first.shape.rank in KERNEL_RANKS and first.dtype in SUPPORTED_DTYPES:
        set_mark(var, spec)
