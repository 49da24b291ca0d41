"""Whole models: ``tapehook.binarize`` as a class decorator and as a function.

A binarized model carries a policy (spec + include / exclude). Each Keras
layer call is tracked on a per-thread stack (patches.py wraps Layer.__call__),
so a policy reaches layers nested in sub-models and layers built lazily at
their first call: when a Conv-family layer is first called under a binarized
model, the policy decides its spec once (``layer._tapehook_layer_spec``), and
its kernel is marked as soon as it exists - before the conv runs, so even the
first traced step is binary. The layer spec is also written into the layer's
Keras config, so ``.keras`` files load back binary.

Fast layers: in a model tapehook is in charge of (binarized, or holding a
layer with a binary spec or a tapehook.larq layer), Keras's own
BatchNormalization, MaxPooling2D and Add layers become tapehook.layers' (their
instance's class is swapped, at binarize time or at their first call under
the model), and the model's Keras Adam becomes tapehook.optimizers.Adam:
docs/design.md says why and what differs; ``fast_layers`` turns it off.
"""

import fnmatch
import functools
import inspect
import sys
import threading

import tensorflow as tf

from tapehook import marks
from tapehook.errors import TapehookError
from tapehook.spec import BinarySpec

_POLICY = "_tapehook_policy"
_LAYER_SPEC = "_tapehook_layer_spec"
_DECIDED = "_tapehook_decided"
_FAST_DECIDED = "_tapehook_fast_decided"
_STOCK_CLASS = "_tapehook_stock_class"  # what a swapped layer / optimizer was
_MARKED_MODEL = "_tapehook_marked_model"
# Batch norms of fewer channels recompute their input in the backward: the
# early stages, whose outputs are the largest a step keeps, at about the same
# time per step (docs/models.md, "recompute-early").
RECOMPUTE_BELOW_CHANNELS = 256
CONFIG_KEY = "tapehook_binary"

_local = threading.local()


def _keras():
    import keras

    return keras


def layer_stack():
    if not hasattr(_local, "layers"):
        _local.layers = []
    return _local.layers


def binarizable_types():
    """Keras layers whose kernel tapehook can binarize."""
    keras = _keras()
    return (
        keras.layers.Conv1D,
        keras.layers.Conv2D,
        keras.layers.DepthwiseConv2D,
        keras.layers.Dense,
    )


def is_binarizable(layer) -> bool:
    return isinstance(layer, binarizable_types())


def _set(obj, name, value):
    object.__setattr__(obj, name, value)  # bypass Keras attribute tracking


def _matches(patterns, layer) -> bool:
    if callable(patterns):
        return bool(patterns(layer))
    if isinstance(patterns, str):
        patterns = [patterns]
    return any(p(layer) if callable(p) else fnmatch.fnmatchcase(layer.name, p) for p in patterns)


class Policy:
    """Which layers of one model are binary, and with which spec."""

    def __init__(self, spec: BinarySpec, include, exclude, first_and_last_float, fast_layers=None):
        marks.arm()  # layers under this policy decide their spec when called
        self.spec = spec
        self.include, self.exclude = include, exclude
        self.first_and_last_float = first_and_last_float
        self.fast_layers = fast_layers  # None: tapehook.config's fast_layers

    def edge_layers(self, model):
        """ids of the first binarizable layer and of the model's last layer.

        Taken once, from the layers the model has when binarized or first
        called (functional / Sequential: the first conv and the output layer;
        subclassed: in order of assignment in __init__), so layers created
        lazily inside call() are never the "last" one.
        """
        edges = vars(model).get("_tapehook_edges")
        if edges is None:
            layers = [
                l
                for l in model._flatten_layers(include_self=False)
                if not isinstance(l, _keras().Model)
            ]
            first = next((l for l in layers if is_binarizable(l)), None)
            edges = {id(first), id(layers[-1])} if layers else set()
            _set(model, "_tapehook_edges", edges)
        return edges

    def decide(self, layer, model):
        """The spec for ``layer`` inside ``model``, or None to keep it float."""
        if not is_binarizable(layer):
            return None
        if self.first_and_last_float and id(layer) in self.edge_layers(model):
            return None
        if self.include is not None and not _matches(self.include, layer):
            return None
        if self.exclude is not None and _matches(self.exclude, layer):
            return None
        if getattr(layer, "groups", 1) != 1:
            raise TapehookError(
                f"layer {layer.name!r} has groups={layer.groups}: Keras runs grouped "
                f"convolutions under XLA, where tapehook's kernels cannot run; keep it "
                f"float with exclude=[{layer.name!r}] or use groups=1"
            )
        return self.spec


def _mark_layer(layer, spec, replace=False):
    """Gives a layer its spec and marks its kernel if it exists already
    (``replace``: also over a mark it has, as ``binarize(model)`` does)."""
    _set(layer, _LAYER_SPEC, spec)
    _set(layer, _DECIDED, True)
    if spec is not None:
        marks.arm()
        layer.supports_jit = False  # Keras "auto" must not XLA-compile our ops
        kernel = getattr(layer, "kernel", None) if layer.built else None
        if kernel is not None and (replace or marks.binary_spec_of(kernel) is None):
            marks.set_mark(kernel, spec)


@functools.cache
def _fast_classes():
    """Keras's layer classes and optimizer -> tapehook's (exact classes only:
    a user's subclass may override what tapehook's replaces)."""
    keras = _keras()
    from tapehook import layers, optimizers

    return {
        keras.layers.BatchNormalization: layers.BatchNormalization,
        keras.layers.MaxPooling2D: layers.MaxPooling2D,
        keras.layers.Add: layers.Add,
        keras.optimizers.Adam: optimizers.Adam,
    }


def fast_layers_on(choice=None) -> bool:
    """A model's ``fast_layers`` (True / False), or tapehook.config's if None."""
    if choice is None:
        from tapehook.config import config

        return config.get("fast_layers") == "1"
    return choice


def _refresh_call_signature(layer):
    """Keras caches ``call``'s signature at __init__ (whether to pass
    ``training`` / ``mask``); a swapped class's call may take more (tapehook's
    MaxPooling2D takes ``training``)."""
    signature = inspect.signature(layer.call)
    names = [p.name for p in signature.parameters.values()]
    cached = {
        "_call_signature": signature,
        "call_signature_parameters": names,
        "_call_has_training_arg": "training" in names,
        "_call_has_mask_arg": "mask" in names,
    }
    if isinstance(getattr(layer, "_call_has_context_arg", None), dict):
        cached["_call_has_context_arg"] = {a: a in names for a in layer._call_context_args}
    for name, value in cached.items():
        if hasattr(layer, name):
            setattr(layer, name, value)


def _channels(layer, inputs):
    """A batch norm's channel count, from its weights or the call's input."""
    if layer.built and getattr(layer, "moving_mean", None) is not None:
        return layer.moving_mean.shape[-1]
    shape = getattr(inputs, "shape", None)
    if shape is None or len(shape) == 0:
        return None
    return shape[layer.axis]


def _make_fast(obj, inputs=None):
    """Swaps a Keras BatchNormalization / MaxPooling2D / Add layer or Adam
    optimizer for tapehook's subclass (same weights, arguments and state;
    only the computation differs) with the defaults that equal Keras's
    results to float rounding."""
    fast = _fast_classes()[type(obj)]
    _set(obj, _STOCK_CLASS, type(obj))
    _set(obj, "__class__", fast)
    from tapehook import layers

    if fast is layers.BatchNormalization:
        channels = _channels(obj, inputs)
        obj.fused = None
        obj.recompute = channels is not None and channels < RECOMPUTE_BELOW_CHANNELS
    elif fast is layers.MaxPooling2D:
        # fuse_relu stays off: it leaves no gradient for the ReLU's output.
        obj.save_argmax, obj.fuse_relu = True, False
    if isinstance(obj, _keras().Layer):
        _refresh_call_signature(obj)


def _make_stock(obj):
    """Undoes _make_fast: the object is Keras's class again, as it was."""
    _set(obj, "__class__", vars(obj).pop(_STOCK_CLASS))
    for name in ("fused", "recompute", "save_argmax", "fuse_relu"):
        vars(obj).pop(name, None)
    if isinstance(obj, _keras().Layer):
        _refresh_call_signature(obj)


def _set_fast(obj, on, inputs=None):
    """Makes a stock layer / optimizer fast (``on``) or a swapped one stock again."""
    if on and type(obj) in _fast_classes():
        _make_fast(obj, inputs)
    elif not on and _STOCK_CLASS in vars(obj):
        _make_stock(obj)


def _optimizers_of(model):
    optimizer = getattr(model, "optimizer", None)
    inner = getattr(optimizer, "inner_optimizer", None)  # LossScaleOptimizer's
    return [o for o in (optimizer, inner) if o is not None]


def _tapehook_model(model) -> bool:
    """Whether tapehook is in charge of a Keras model without a policy: it
    holds a layer with a binary spec (a loaded binarized model), a marked
    kernel or a tapehook.larq layer. Decided once, at the model's first call."""
    decided = vars(model).get(_MARKED_MODEL)
    if decided is None:
        larq = sys.modules.get("tapehook.larq.layers")
        quant = larq._QuantMixin if larq is not None else ()
        decided = any(
            getattr(l, _LAYER_SPEC, None) is not None
            or isinstance(l, quant)
            or (
                getattr(l, "built", False)
                and getattr(l, "kernel", None) is not None
                and marks.binary_spec_of(l.kernel) is not None
            )
            for l in model._flatten_layers(include_self=False)
        )
        _set(model, _MARKED_MODEL, decided)
    return decided


def _fast_choice(owners):
    """fast_layers (True / False) of the nearest model in charge among
    ``owners`` (innermost last), or None where tapehook is in charge of none."""
    keras = _keras()
    for owner in reversed(owners):
        policy = getattr(owner, _POLICY, None)
        if policy is not None:
            return fast_layers_on(policy.fast_layers)
        if isinstance(owner, keras.Model) and _tapehook_model(owner):
            return fast_layers_on()
    return None


def _undecided_stock(layer) -> bool:
    """A stock BatchNormalization / MaxPooling2D / Add layer whose fast
    layer is not decided yet."""
    return type(layer) in _fast_classes() and not getattr(layer, _FAST_DECIDED, False)


def _decide(obj, on, inputs=None):
    """Decides once whether a layer / optimizer runs tapehook's version."""
    _set(obj, _FAST_DECIDED, True)
    _set_fast(obj, on, inputs)


def _decide_fast(layer, inputs):
    """At a call: a stock BatchNormalization / MaxPooling2D / Add layer
    under a model tapehook is in charge of becomes tapehook's (once), and
    such a model's Keras Adam becomes tapehook's."""
    if _undecided_stock(layer):
        on = _fast_choice(layer_stack()[:-1])
        if on is not None:
            _decide(layer, on, inputs)
    elif isinstance(layer, _keras().Model):
        optimizers = _optimizers_of(layer)
        if optimizers and any(type(o) in _fast_classes() for o in optimizers):
            on = _fast_choice([layer])
            for optimizer in optimizers:
                if on and not getattr(optimizer, _FAST_DECIDED, False):
                    _decide(optimizer, True)


def decide_fast_layers(model):
    """Decides now, for a built model tapehook is in charge of, what its
    layers' first calls would: its stock BatchNormalization, MaxPooling2D and
    Add layers become tapehook's (or stay Keras's, fast_layers off). For
    models built to be tapehook's (tapehook.zoo), so that ``summary()`` and
    the layers' classes say so before the first call."""
    on = _fast_choice([model])
    if on is None:
        return model
    for layer in model._flatten_layers(include_self=False):
        if layer.built and _undecided_stock(layer):
            _decide(layer, on)
    return model


def before_layer_call(layer, inputs=None):
    """Decides a layer's spec under the nearest binarized model on the stack
    (and whether it runs tapehook's fast layer: _decide_fast)."""
    policy = getattr(layer, _POLICY, None)
    if policy is not None and policy.first_and_last_float:
        policy.edge_layers(layer)  # fixed before call() creates lazy layers
    _decide_fast(layer, inputs)
    if getattr(layer, _DECIDED, False) or not is_binarizable(layer):
        return
    for owner in reversed(layer_stack()):
        policy = getattr(owner, _POLICY, None)
        if policy is not None:
            _mark_layer(layer, policy.decide(layer, owner))
            return


def after_layer_call(layer, outputs):
    spec = getattr(layer, _LAYER_SPEC, None)
    if spec is not None:
        _mark_layer(layer, spec)
    if getattr(layer, "kernel", None) is not None and hasattr(outputs, "shape"):
        _set(layer, "_tapehook_output_shape", tuple(outputs.shape))


def output_shape_of(layer):
    """A layer's output shape from its last call (functional or subclassed)."""
    shape = getattr(layer, "_tapehook_output_shape", None)
    if shape is None:
        try:
            shape = tuple(layer.output.shape)
        except (AttributeError, ValueError):
            return None
    return shape


def spec_for_layer_filter(var):
    """Spec for an unmarked filter used by the innermost layer being called
    (marking the layer's kernel), or None."""
    stack = layer_stack()
    if not stack or var is None:
        return None
    layer = stack[-1]
    spec = getattr(layer, _LAYER_SPEC, None)
    kernel = getattr(layer, "kernel", None) if spec is not None else None
    if kernel is None:
        return None
    mine = {id(c.handle) for c in marks.components(kernel) or ()}
    if any(id(c.handle) in mine for c in marks.components(var) or ()):
        marks.set_mark(kernel, spec)
        return spec
    return None


def layer_config_spec(layer):
    """The spec to save in a layer's config, or None."""
    spec = getattr(layer, _LAYER_SPEC, None)
    kernel = getattr(layer, "kernel", None) if getattr(layer, "built", False) else None
    if kernel is not None:
        spec = marks.binary_spec_of(kernel) or spec
    return spec


def spec_to_config(spec: BinarySpec) -> dict:
    return spec.to_config()


def restore_layer_spec(layer, config_value):
    _mark_layer(layer, BinarySpec(**config_value))


def _binarize_class(cls, policy):
    keras = _keras()
    if issubclass(cls, keras.Layer):
        # A class attribute: every instance (and subclass) carries the policy,
        # and Keras's introspection of __init__ stays untouched.
        setattr(cls, _POLICY, policy)
        return cls
    if issubclass(cls, tf.Module):
        if policy.first_and_last_float:
            raise TapehookError(
                "first_and_last_float needs Keras layers; on a tf.Module use "
                "exclude=[variable name patterns]"
            )
        original_call = cls.__call__

        @functools.wraps(original_call)
        def __call__(self, *args, **kwargs):
            marks.push_scope(policy.spec, functools.partial(_module_owns, self, policy))
            try:
                return original_call(self, *args, **kwargs)
            finally:
                marks.pop_scope()

        cls.__call__ = __call__
        return cls
    raise TapehookError(
        f"binarize decorates keras.Model or tf.Module subclasses, got {cls.__name__}"
    )


def _variable_matches(patterns, var) -> bool:
    if callable(patterns):
        return bool(patterns(var))
    name = var.name.split(":")[0]
    return any(
        p(var) if callable(p) else fnmatch.fnmatchcase(name, p)
        for p in ([patterns] if isinstance(patterns, str) else patterns)
    )


def _module_owns(module, policy, var) -> bool:
    """Is ``var`` one of ``module``'s variables that the policy binarizes?"""
    ids = {id(c.handle) for v in module.variables for c in marks.components(v)}
    return (
        any(id(c.handle) in ids for c in marks.components(var))
        and (policy.include is None or _variable_matches(policy.include, var))
        and (policy.exclude is None or not _variable_matches(policy.exclude, var))
    )


def binarize(
    target=None,
    /,
    *,
    include=None,
    exclude=None,
    first_and_last_float=False,
    fast_layers=None,
    **spec,
):
    """Binarize the Conv1D / Conv2D / DepthwiseConv2D / Dense kernels of a model.

    As a decorator on a keras.Model (or tf.Module) subclass, or called on an
    existing model (marked in place and returned). ``include`` / ``exclude``:
    layer-name glob patterns, a list of them, or a predicate on the layer.
    ``first_and_last_float=True`` keeps the first conv layer and the model's
    last layer in float, the usual BNN recipe. ``spec``: BinarySpec fields.

    ``fast_layers``: whether the model's Keras ``BatchNormalization``,
    ``MaxPooling2D``, ``Add`` layers and ``Adam`` optimizer run tapehook's
    implementations (tapehook.layers, tapehook.optimizers; the same results to
    float rounding); None (default) takes ``tapehook.config``'s
    ``fast_layers`` (on unless set off).
    """
    if fast_layers not in (None, True, False):
        raise TapehookError(
            f"binarize(fast_layers={fast_layers!r}): fast_layers is True, False or None "
            "(tapehook.config's fast_layers)"
        )
    policy = Policy(marks.make_spec(spec), include, exclude, first_and_last_float, fast_layers)
    if target is None:
        return lambda t: _binarize_target(t, policy)
    return _binarize_target(target, policy)


def _binarize_target(target, policy):
    if isinstance(target, type):
        return _binarize_class(target, policy)
    keras = _keras()
    if isinstance(target, keras.Layer):
        _set(target, _POLICY, policy)
        fast = fast_layers_on(policy.fast_layers)
        for layer in target._flatten_layers(include_self=False):
            if is_binarizable(layer):
                # Called on a model, binarize states the model's spec now: it
                # replaces earlier marks (stage 2 of a two-stage recipe).
                _mark_layer(layer, policy.decide(layer, target), replace=True)
            elif layer.built or not fast:
                # Built layers now (a batch norm's channels are known); the
                # others at their first call under the model.
                _decide(layer, fast)
        for optimizer in _optimizers_of(target):
            _decide(optimizer, fast)
        return target
    if isinstance(target, tf.Module):
        for var in target.variables:
            if var.shape.rank in marks.KERNEL_RANKS and _module_owns(target, policy, var):
                marks.set_mark(var, policy.spec)
        return target
    raise TapehookError(
        f"binarize takes a keras.Model, a tf.Module or a subclass of either, got "
        f"{type(target).__name__}"
    )
