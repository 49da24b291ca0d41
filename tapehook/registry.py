"""The one place that reads and swaps TensorFlow's registered gradient functions.

``ops._gradient_registry._registry`` maps an op type to
``{"type": fn, "location": ...}``; the eager tape (backprop._gradient_function)
and graph gradients (ops.get_gradient_function) both look it up by op type at
the moment a gradient is built. tf.RegisterGradient refuses a second
registration, so an override replaces the entry's function in place.
"""

from tapehook.compat import gradient_registry_entries, gradient_registry_entry, ops

_originals = {}  # op type -> TF's own gradient, while tapehook's is registered


def registered_gradient(op_type: str):
    """The gradient function TensorFlow would call now for ``op_type``."""
    return gradient_registry_entry(op_type)["type"]


def swap_gradient(op_type: str, fn):
    """Makes ``fn`` the registered gradient of ``op_type``; returns the old one.
    The first swap keeps TF's own function (``original_gradient``); swapping
    it back forgets it."""
    entry = gradient_registry_entry(op_type)
    previous = entry["type"]
    entry["type"] = fn
    if op_type not in _originals:
        _originals[op_type] = previous
    elif fn is _originals[op_type]:
        del _originals[op_type]
    return previous


def original_gradient(op_type: str):
    """TF's own gradient function for ``op_type``, swapped or not."""
    return _originals.get(op_type) or registered_gradient(op_type)


def register_gradient(op_type: str, fn) -> None:
    """Registers ``fn`` for an op type tapehook owns (once per process)."""
    entries = gradient_registry_entries()
    if op_type in entries:
        entries[op_type]["type"] = fn
    else:
        ops.RegisterGradient(op_type)(fn)
