"""The one place that reads and swaps TensorFlow's registered gradient functions.

``ops._gradient_registry._registry`` maps an op type to
``{"type": fn, "location": ...}``; the eager tape (backprop._gradient_function)
and graph gradients (ops.get_gradient_function) both look it up by op type at
the moment a gradient is built. tf.RegisterGradient refuses a second
registration, so an override replaces the entry's function in place.
"""

from tensorflow.python.framework import ops

from tapehook.errors import TapehookError


def _entries():
    registry = getattr(ops, "_gradient_registry", None)
    entries = getattr(registry, "_registry", None)
    if not isinstance(entries, dict) or not callable(getattr(registry, "lookup", None)):
        import tensorflow as tf
        raise TapehookError(
            f"TensorFlow {tf.__version__} has no ops._gradient_registry._registry "
            f"dict; tapehook cannot install its Conv2D gradient on this version")
    return entries


def check_entry(op_type: str) -> dict:
    """The registry entry of ``op_type``, checked to have the expected shape."""
    entry = _entries().get(op_type)
    if not isinstance(entry, dict) or not callable(entry.get("type")):
        import tensorflow as tf
        raise TapehookError(
            f"TensorFlow {tf.__version__}: the gradient registry entry for "
            f"{op_type!r} is {entry!r}, not {{'type': fn, ...}}; tapehook "
            f"cannot override it")
    return entry


def registered_gradient(op_type: str):
    """The gradient function TensorFlow would call now for ``op_type``."""
    return check_entry(op_type)["type"]


def swap_gradient(op_type: str, fn):
    """Makes ``fn`` the registered gradient of ``op_type``; returns the old one."""
    entry = check_entry(op_type)
    previous = entry["type"]
    entry["type"] = fn
    return previous


def register_gradient(op_type: str, fn) -> None:
    """Registers ``fn`` for an op type tapehook owns (once per process)."""
    entries = _entries()
    if op_type in entries:
        entries[op_type]["type"] = fn
    else:
        ops.RegisterGradient(op_type)(fn)
