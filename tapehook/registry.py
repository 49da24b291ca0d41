"""The one place that reads and swaps TensorFlow's registered gradient functions.

``ops._gradient_registry._registry`` maps an op type to
``{"type": fn, "location": ...}``; the eager tape (backprop._gradient_function)
and graph gradients (ops.get_gradient_function) both look it up by op type at
the moment a gradient is built. tf.RegisterGradient refuses a second
registration, so an override replaces the entry's function in place.
"""

from tapehook.compat import gradient_registry_entries, gradient_registry_entry, ops


def registered_gradient(op_type: str):
    """The gradient function TensorFlow would call now for ``op_type``."""
    return gradient_registry_entry(op_type)["type"]


def swap_gradient(op_type: str, fn):
    """Makes ``fn`` the registered gradient of ``op_type``; returns the old one."""
    entry = gradient_registry_entry(op_type)
    previous = entry["type"]
    entry["type"] = fn
    return previous


def register_gradient(op_type: str, fn) -> None:
    """Registers ``fn`` for an op type tapehook owns (once per process)."""
    entries = gradient_registry_entries()
    if op_type in entries:
        entries[op_type]["type"] = fn
    else:
        ops.RegisterGradient(op_type)(fn)
