"""binary_scope: marks the conv filters created or used inside a block of code."""

import contextlib

import tensorflow as tf

from tapehook import marks
from tapehook.errors import TapehookError


@contextlib.contextmanager
def binary_scope(*, variables=None, activations=False, scale=None,
                 ste="ste_sign", clip=1.0):
    """Marks binary every variable created inside the block that can be a conv
    filter (3-D or 4-D, floating point) and every variable used inside it as a
    Conv2D filter. ``variables=[...]`` restricts marking to exactly those.

    Marks persist after the block. Scopes nest (the innermost spec marks) and
    are per thread. Leaving by exception restores the scope state.
    """
    spec = marks.make_spec(dict(activations=activations, scale=scale, ste=ste, clip=clip))
    allowed = None
    if variables is not None:
        allowed, keep_alive = set(), []
        for var in variables:
            comps = marks.components(var)
            if comps is None:
                raise TapehookError(
                    f"binary_scope(variables=...) takes variables, got "
                    f"{type(var).__name__}")
            keep_alive.append(var)
            allowed.update(id(c.handle) for c in comps)

    def mark_created(next_creator, **kwargs):
        var = next_creator(**kwargs)
        marks.scope_marks_created(var)
        return var

    stack = marks.scope_stack()
    stack.append((spec, allowed))
    try:
        with tf.variable_creator_scope(mark_created):
            yield spec
    finally:
        stack.pop()
