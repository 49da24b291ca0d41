"""binary_scope: marks the conv filters created or used inside a block of code."""

import contextlib

import tensorflow as tf

from tapehook import marks
from tapehook.errors import TapehookError
from tapehook.spec import SAME_AS_CLIP


@contextlib.contextmanager
def binary_scope(
    *,
    variables=None,
    activations=False,
    scale=None,
    ste="ste_sign",
    clip=1.0,
    pad_value=0.0,
    weights=True,
    beta=5.0,
    activation_clip=SAME_AS_CLIP,
    balance=None,
):
    """Marks binary every variable created inside the block that can be a
    kernel (2-D Dense, 3-D Conv1D, 4-D Conv2D / DepthwiseConv2D; floating
    point) and every variable used inside it as a kernel. ``variables=[...]``
    restricts marking to exactly those. The other keywords are BinarySpec's.

    Marks persist after the block. Scopes nest (the innermost spec marks) and
    are per thread. Leaving by exception restores the scope state.
    """
    spec = marks.make_spec(
        dict(
            activations=activations,
            scale=scale,
            ste=ste,
            clip=clip,
            pad_value=pad_value,
            weights=weights,
            beta=beta,
            activation_clip=activation_clip,
            balance=balance,
        )
    )
    allowed = None
    if variables is not None:
        handles = []  # kept alive by this closure, so their ids stay unique
        for var in variables:
            comps = marks.components(var)
            if comps is None:
                raise TapehookError(
                    f"binary_scope(variables=...) takes variables, got {type(var).__name__}"
                )
            handles.extend(c.handle for c in comps)
        ids = {id(h) for h in handles}

        def allowed(var):
            return any(id(c.handle) in ids for c in marks.components(var))

    def mark_created(next_creator, **kwargs):
        var = next_creator(**kwargs)
        marks.scope_marks_created(var)
        return var

    marks.push_scope(spec, allowed)
    try:
        with tf.variable_creator_scope(mark_created):
            yield spec
    finally:
        marks.pop_scope()
