"""override_gradient: a scoped gradient override for any op type.

``with tapehook.override_gradient("Relu", grad_fn):`` (or the same call as a
decorator, whose function body then runs inside the scope) makes
``grad_fn(op, *grads)`` the gradient of every ``Relu`` *executed* inside the
block. ``grad_fn`` has the contract of a tf.RegisterGradient function:
``op.inputs``, ``op.outputs``, ``op.type``, ``op.get_attr(name)``; it returns
one gradient (or None) per input. Ops executed outside any scope keep their
registered gradient.

Scoping is by forward execution, not by when the gradient is built: the choice
is fixed when the op runs (eager) or is created (graph, tf.function trace), so
a gradient built after the block closed still uses ``grad_fn``.

- Eager GradientTape: the op's outputs are recorded again, with ``grad_fn`` as
  their backward function (the tape keeps the later record).
- Tapes inside tf.function and in v1 graphs: the op's tape record is made with
  ``grad_fn`` instead of the registered gradient.
- tf.function under an outer tape, nested tf.functions, v1 ``tf.gradients``:
  the graph op carries ``grad_fn`` as its own gradient function, which
  TensorFlow prefers to the registry.
- A tf.function traced inside the scope keeps the override in its graph,
  wherever and whenever it is called later. One traced outside the scope does
  not get it when called inside: its ops were created without the scope. It
  gets the override only if it is retraced inside the scope (new input
  signature, or a new tf.function). tf.saved_model.save works, but a loaded
  SavedModel has the registered gradient (Python gradient functions are not
  serialized).
- tapehook's binary conv runs as a TapehookBinaryConv2D op that tapes record
  as "Conv2D", so an override of "Conv2D" also applies to binary convs
  executed in the scope (in graphs ``op.type`` reads "Conv2D" too).

Scopes are per thread and nest: the innermost scope for an op type wins,
scopes for different op types all apply. Leaving a scope, also by exception,
restores the previous state.

Mechanism: an op callback on this thread (op_callbacks) sees every op
executed or created while a scope is active, and patches.py wraps
``execute.record_gradient`` (through which the generated op wrappers record
ops on tapes outside the eager fast path) with ``recording_with_overrides``,
which costs one thread-local lookup when no scope is active.
"""

import contextlib
import threading

from tapehook import kernels
from tapehook.compat import backprop, op_callbacks, record
from tapehook.errors import TapehookError

# Ops that tapes record under another type: that type's override applies.
_RECORDED_AS = {kernels.BINARY_OP: "Conv2D"}

_thread = threading.local()  # .overrides: [(op_type, grad_fn)], innermost last


def _active_overrides() -> list:
    if not hasattr(_thread, "overrides"):
        _thread.overrides = []
    return _thread.overrides


def override_for(op_type):
    """The innermost grad_fn for ``op_type`` on this thread, or None."""
    for overridden, grad_fn in reversed(getattr(_thread, "overrides", ())):
        if overridden == op_type:
            return grad_fn
    return None


def _per_input(grads, op_type, num_inputs) -> list:
    grads = list(grads) if isinstance(grads, (list, tuple)) else [grads]
    if len(grads) != num_inputs:
        raise TapehookError(
            f"the override_gradient function for {op_type} returned {len(grads)} "
            f"gradients for an op with {num_inputs} inputs; return one (or None) "
            f"per input"
        )
    return grads


def _record(op_type, grad_fn, inputs, attrs, outputs) -> None:
    """Records ``outputs`` on the active tapes with ``grad_fn`` as backward."""
    inputs, outputs = list(inputs), list(outputs)

    def backward(*grads):
        op = backprop._MockOp(attrs, inputs, outputs, op_type, None)
        return _per_input(grad_fn(op, *grads), op_type, len(inputs))

    record.record_operation(op_type, outputs, inputs, backward)


class _AsConv2D:
    """A TapehookBinaryConv2D graph op as the Conv2D that tapes record it as."""

    type = "Conv2D"

    def __init__(self, op):
        self._op = op

    def __getattr__(self, name):
        return getattr(self._op, name)

    def get_attr(self, name):
        # The one Conv2D attr the binary op lacks; conv2d.py records it as True.
        return True if name == "use_cudnn_on_gpu" else self._op.get_attr(name)


def _graph_gradient(grad_fn, op_type):
    def gradient(op, *grads):
        view = op if op.type == op_type else _AsConv2D(op)
        return _per_input(grad_fn(view, *grads), op_type, len(op.inputs))

    return gradient


def _on_op(op_type, inputs, attrs, outputs, op_name=None, graph=None):
    """Op callback: runs after each op executed or created on this thread."""
    recorded_as = _RECORDED_AS.get(op_type, op_type)
    grad_fn = override_for(recorded_as)
    if grad_fn is None:
        return None
    if graph is None:
        # Eager: the fast path already recorded the registered gradient; this
        # later record wins. (The binary conv runs with recording stopped:
        # conv2d.py records it itself, through record_gradient below.)
        if record.could_possibly_record():
            _record(op_type, grad_fn, inputs, attrs, outputs)
    else:
        graph.get_operation_by_name(op_name)._gradient_function = _graph_gradient(
            grad_fn, recorded_as
        )
    return None


def recording_with_overrides(wrapped, instance, args, kwargs):
    """execute.record_gradient (wrapt wrapper) that records overridden op
    types with their grad_fn.

    In graphs the generated op wrappers record an op on tapes *after* op
    callbacks ran, so a callback's record would be replaced by the registered
    gradient's; the eager fallback path does the same.
    """
    grad_fn = override_for(args[0] if args else kwargs.get("op_name"))
    if grad_fn is None:
        return wrapped(*args, **kwargs)
    op_name, inputs, attrs, outputs = _record_arguments(*args, **kwargs)
    return _record(op_name, grad_fn, inputs, attrs, outputs)


def _record_arguments(op_name, inputs, attrs, outputs):
    return op_name, inputs, attrs, outputs


class override_gradient(contextlib.ContextDecorator):  # noqa: N801 (used like a function)
    """Scope in which ``grad_fn(op, *grads)`` is the gradient of ``op_type``.

    A context manager, or a decorator whose function runs inside the scope.
    Semantics per mode: see this module's docstring.
    """

    def __init__(self, op_type: str, grad_fn):
        if not isinstance(op_type, str) or not op_type:
            raise TapehookError(
                f"override_gradient needs an op type name such as 'Relu', got {op_type!r}"
            )
        if not callable(grad_fn):
            raise TapehookError(
                f"override_gradient({op_type!r}, grad_fn): grad_fn must be callable "
                f"as grad_fn(op, *grads), got {type(grad_fn).__name__}"
            )
        self.op_type = op_type
        self.grad_fn = grad_fn

    def __enter__(self):
        overrides = _active_overrides()
        if not overrides:
            op_callbacks.add_op_callback(_on_op)
        overrides.append((self.op_type, self.grad_fn))
        return self

    def __exit__(self, *exc_info):
        overrides = _active_overrides()
        overrides.pop()
        if not overrides:
            op_callbacks.remove_op_callback(_on_op)
        return False
