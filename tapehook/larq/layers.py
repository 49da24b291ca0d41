"""larq.layers on Keras 3: quantized layers that run on tapehook's marks.

Each layer is the Keras 3 layer of the same name with larq's extra arguments
(``input_quantizer``, ``kernel_quantizer`` / ``depthwise_quantizer`` /
``pointwise_quantizer``, ``pad_values``). When a layer is built, ``_spec_for``
maps its quantizers onto a ``tapehook.BinarySpec``:

- it can: the kernel variable is marked with that spec and the layer runs
  Keras's own call; tapehook binarizes the kernel (and the input) inside the
  conv / matmul with its kernels, forward and backward.
- it cannot (a quantizer tapehook has no estimator for, ``pad_values=1.0``
  today, Conv3D, transposed and separable convs, channels_first, ...): the
  quantizers run as plain TF ops (``tapehook.larq.quantizers``) on the input
  and on the kernel read, then the float Keras op, as larq does.

Both give larq's forward and pseudo-gradients. ``layer.kernel`` reads the
latent float kernel, or its quantized value inside
``larq.context.quantized_scope(True)`` (as larq's QuantizedVariable).
"""

import dataclasses
import inspect
import logging
import threading

import keras
import tensorflow as tf

from tapehook import marks
from tapehook.errors import TapehookError
from tapehook.larq import context, quantizers
from tapehook.spec import BinarySpec

log = logging.getLogger("tapehook.larq")

__all__ = [
    "QuantConv1D",
    "QuantConv2D",
    "QuantConv3D",
    "QuantConv2DTranspose",
    "QuantConv3DTranspose",
    "QuantDense",
    "QuantDepthwiseConv2D",
    "QuantLocallyConnected1D",
    "QuantLocallyConnected2D",
    "QuantSeparableConv1D",
    "QuantSeparableConv2D",
]

# ---------------------------------------------------------------------------
# Quantizers -> BinarySpec: the one place that decides what tapehook runs.
# ---------------------------------------------------------------------------

_SPEC_FIELDS = frozenset(f.name for f in dataclasses.fields(BinarySpec))
_DEFAULT_BETA = 5.0  # tapehook's SwishSign beta while BinarySpec has no `beta`


@dataclasses.dataclass(frozen=True)
class _Estimator:
    name: str  # tapehook estimator (BinarySpec.ste names)
    clip: object = None  # ste_sign's clip (None: no mask); unused by the others
    beta: object = None  # swish_sign's beta
    scale: object = None  # "mean_abs" for MagnitudeAwareSign


def _estimator_of(quantizer):
    """The tapehook estimator doing exactly what ``quantizer`` does, or None.

    Only larq's own classes (not subclasses, which may change ``call``).
    MagnitudeAwareSign is alpha * ste_sign(W) with alpha = mean|W| over all
    axes but the last, a constant in the backward pass: dW = alpha * mask * g,
    which is BinarySpec(scale="mean_abs") for Dense / Conv kernels.
    """
    kind = type(quantizer)
    if kind is quantizers.SteSign:
        return _Estimator("ste_sign", clip=quantizer.clip_value)
    if kind is quantizers.ApproxSign:
        return _Estimator("approx_sign")
    if kind is quantizers.SwishSign:
        return _Estimator("swish_sign", beta=float(quantizer.beta))
    if kind is quantizers.MagnitudeAwareSign:
        return _Estimator("ste_sign", clip=quantizer.clip_value, scale="mean_abs")
    return None


def _spec_for(input_quantizer, kernel_quantizer, pad_values=0.0):
    """BinarySpec keyword arguments doing what these quantizers do, or None.

    None means tapehook's marks cannot express it and the layer runs the
    quantizers as plain TF ops. Fields the installed BinarySpec does not have
    yet (``weights``, ``pad_value``, ``activation_clip``, ``beta``) are only
    used when it has them, so newer specs widen what maps without changes here.
    """
    weights = _estimator_of(kernel_quantizer) if kernel_quantizer is not None else None
    inputs = _estimator_of(input_quantizer) if input_quantizer is not None else None
    if (kernel_quantizer is not None and weights is None) or (
        input_quantizer is not None and inputs is None
    ):
        return None  # a quantizer tapehook has no estimator for
    if weights is None and inputs is None:
        return None  # nothing binary: the stock float layer
    if inputs is not None and inputs.scale is not None:
        return None  # a scaled input (MagnitudeAwareSign on activations)
    kwargs = {}
    if weights is None:  # float weights, binary input: the BAN stage
        if "weights" not in _SPEC_FIELDS:
            return None
        kwargs.update(weights=False, ste=inputs.name, activations=True)
    else:
        kwargs.update(ste=weights.name, scale=weights.scale)
        if inputs is not None:
            kwargs["activations"] = True if inputs.name == weights.name else inputs.name

    # ste_sign clips: one `clip` for the weights, `activation_clip` for the input.
    weight_clip = weights.clip if weights is not None and weights.name == "ste_sign" else ...
    input_clip = inputs.clip if inputs is not None and inputs.name == "ste_sign" else ...
    if weight_clip is not ...:
        kwargs["clip"] = weight_clip
    if input_clip is not ...:
        if weight_clip is ...:
            kwargs["clip"] = input_clip  # the weights' estimator has no clip
        elif input_clip != weight_clip:
            if "activation_clip" not in _SPEC_FIELDS:
                return None
            kwargs["activation_clip"] = input_clip
    if weights is None:  # BAN: the input's estimator is the spec's
        kwargs.pop("activation_clip", None)
        kwargs["clip"] = input_clip if input_clip is not ... else 1.0

    betas = {e.beta for e in (weights, inputs) if e is not None and e.name == "swish_sign"}
    if len(betas) > 1:
        return None  # one beta for weights and input
    if betas:
        (beta,) = betas
        if "beta" in _SPEC_FIELDS:
            kwargs["beta"] = beta
        elif beta != _DEFAULT_BETA:
            return None

    if pad_values != 0.0:
        # larq pads the layer's (quantized or float) input: x_hat, as pad_value does.
        if "pad_value" not in _SPEC_FIELDS or pad_values != 1.0:
            return None
        kwargs["pad_value"] = 1.0
    try:
        BinarySpec(**kwargs)
    except (TapehookError, TypeError):
        return None  # e.g. clip_value=None before BinarySpec accepts clip=None
    return kwargs


# ---------------------------------------------------------------------------
# Shared layer machinery
# ---------------------------------------------------------------------------

_raw_reads = threading.local()  # set while a marked layer runs Keras's call


class _Shape(tuple):
    """A shape tuple that also answers tf.TensorShape's ``as_list()``."""

    def as_list(self):
        return list(self)


def _kernel_property(name, base_cls):
    """``name`` reads the latent variable, quantized inside quantized_scope(True)."""
    base = inspect.getattr_static(base_cls, name, None)
    slot = f"_lq_latent_{name}"
    if isinstance(base, property):

        def latent(self):
            return base.fget(self)

        setter = None
    else:

        def latent(self):
            try:
                return self.__dict__[slot]
            except KeyError:
                raise AttributeError(name) from None

        def setter(self, value):
            self.__dict__[slot] = value  # Layer.__setattr__ has tracked it already

    def getter(self):
        value = latent(self)
        quantizer = self._lq_quantizers().get(name)
        if quantizer is None or getattr(_raw_reads, "on", False) or (not context.should_quantize()):
            return value
        if isinstance(value, keras.Variable):
            # Read here, so mixed precision's autocast applies before quantizing (as
            # larq's QuantizedVariable did); quantizers do not autocast themselves.
            value = value.value
        return quantizer(value)

    return property(getter, setter)


def _same_padding(size, stride, dilation, kernel):
    """(before, after) of SAME padding along one axis (static or dynamic size)."""
    effective = (kernel - 1) * dilation + 1
    out = (size + stride - 1) // stride
    total = (out - 1) * stride + effective - size
    if tf.is_tensor(total):
        total = tf.maximum(total, 0)
    else:
        total = max(total, 0)
    return [total // 2, total - total // 2]


class _QuantMixin:
    """What every tapehook.larq layer shares; ``_kernels`` maps attr -> quantizer attr."""

    _kernels: dict = {}
    _pads = False  # whether the layer takes larq's pad_values

    def _lq_init(self, input_quantizer, kernel_quantizers, pad_values):
        self.input_quantizer = quantizers.get(input_quantizer)
        for attr, value in kernel_quantizers.items():
            setattr(self, attr, quantizers.get_kernel_quantizer(value))
        self.pad_values = pad_values
        self._lq_spec = None

    def _lq_post_init(self):
        if self._pads:
            zero = not tf.is_tensor(self.pad_values) and self.pad_values == 0.0
            if self.padding == "causal" and not zero:
                raise ValueError("Causal padding with `pad_values != 0` is not supported.")
        for kernel, quantizer_attr in self._kernels.items():
            constraint_attr = quantizer_attr.replace("_quantizer", "_constraint")
            quantizer = getattr(self, quantizer_attr)
            if (
                getattr(quantizer, "precision", None) == 1
                and not isinstance(quantizer, quantizers.NoOp)
                and not getattr(self, constraint_attr, None)
            ):
                log.warning(
                    "Using a binary `%s` without setting `%s` may result in starved "
                    "weights (where the gradient is always zero).",
                    quantizer_attr,
                    constraint_attr,
                )

    def _lq_quantizers(self):
        return {k: getattr(self, q, None) for k, q in self._kernels.items()}

    def _lq_native_padding(self):
        zero = not tf.is_tensor(self.pad_values) and self.pad_values == 0.0
        return not self._pads or self.padding != "same" or zero

    # -- marks --

    def _lq_markable(self, input_shape):
        """Layer geometry tapehook's marks cover (the quantizers are _spec_for's)."""
        return False

    def _lq_mark(self, input_shape):
        if len(self._kernels) != 1 or not self._lq_markable(input_shape):
            return
        ((kernel_attr, quantizer_attr),) = self._kernels.items()
        pad = 0.0 if self._lq_native_padding() else self.pad_values
        if tf.is_tensor(pad):
            return
        spec = _spec_for(self.input_quantizer, getattr(self, quantizer_attr), pad_values=pad)
        if spec is None:
            return
        marks.mark_binary(self._lq_latent(kernel_attr), **spec)
        self._lq_spec = marks.binary_spec_of(self._lq_latent(kernel_attr))

    def _lq_latent(self, name):
        with context.quantized_scope(False):
            return getattr(self, name)

    def _lq_tag_precision(self):
        for kernel, quantizer in self._lq_quantizers().items():
            precision = getattr(quantizer, "precision", None)
            if precision is not None:
                try:
                    self._lq_latent(kernel).precision = precision
                except AttributeError:
                    pass

    @property
    def binary_spec(self):
        """The tapehook BinarySpec this layer's kernel runs with, or None (plain ops)."""
        return self._lq_spec

    def _lq_build_metrics(self):
        """Builds kernel quantizers that keep training metrics on their kernels'
        shapes, as calling them on the kernel would, so the metrics exist once
        the layer is built (a marked layer never calls its quantizers)."""
        for kernel, quantizer in self._lq_quantizers().items():
            if getattr(quantizer, "_custom_metrics", None) and not quantizer.built:
                quantizer.build(tuple(self._lq_latent(kernel).shape))

    def _lq_update_metrics(self):
        """A marked layer binarizes its kernel inside the op; a kernel quantizer
        with a training metric runs on the kernel only to update it."""
        for kernel, quantizer in self._lq_quantizers().items():
            if getattr(quantizer, "flip_ratio", None) is not None:
                quantizer(self._lq_latent(kernel).value)

    def build(self, input_shape):
        super().build(input_shape)
        self._lq_tag_precision()
        self._lq_build_metrics()
        self._lq_mark(input_shape)

    def call(self, inputs):
        if self._lq_spec is not None:
            self._lq_update_metrics()
            # tapehook binarizes the input and the marked kernel inside the op.
            previous = getattr(_raw_reads, "on", False)
            _raw_reads.on = True
            try:
                return super().call(inputs)
            finally:
                _raw_reads.on = previous
        if self.input_quantizer:
            inputs = self.input_quantizer(inputs)
        with context.quantized_scope(True):
            if self._lq_native_padding():
                return super().call(inputs)
            inputs = tf.pad(inputs, self._lq_same_padding(inputs), constant_values=self.pad_values)
            padding = self.padding
            self.padding = "valid"
            try:
                return super().call(inputs)
            finally:
                self.padding = padding

    def _lq_same_padding(self, inputs):
        shape = inputs.shape
        if not shape[1:].is_fully_defined():
            shape = tf.shape(inputs)
        first = self.data_format == "channels_first"
        spatial = [shape[i] for i in range(2 if first else 1, (2 if first else 1) + self.rank)]
        pads = [
            _same_padding(size, s, d, k)
            for size, s, d, k in zip(spatial, self.strides, self.dilation_rate, self.kernel_size)
        ]
        return [[0, 0], [0, 0], *pads] if first else [[0, 0], *pads, [0, 0]]

    def compute_output_shape(self, input_shape):
        shape = super().compute_output_shape(input_shape)
        return _Shape(shape) if isinstance(shape, (tuple, list)) else shape

    @property
    def output_shape(self):
        """The output shape of the layer's (single) output, as tf-keras had it."""
        return _Shape(self.output.shape)

    def get_weights(self):
        values = super().get_weights()
        if not context.should_quantize() or not self.built:
            return values
        kernels = {
            id(self._lq_latent(k)): k for k, q in self._lq_quantizers().items() if q is not None
        }
        return [
            keras.ops.convert_to_numpy(getattr(self, kernels[id(var)]))
            if id(var) in kernels
            else value
            for var, value in zip(self.weights, values)
        ]

    def get_config(self):
        config = super().get_config()
        config["input_quantizer"] = quantizers.serialize(self.input_quantizer)
        for quantizer_attr in self._kernels.values():
            config[quantizer_attr] = quantizers.serialize(getattr(self, quantizer_attr))
        if self._pads:
            config["pad_values"] = (
                keras.ops.convert_to_numpy(self.pad_values).item()
                if tf.is_tensor(self.pad_values)
                else self.pad_values
            )
        return config


# Keys tf-keras's Depthwise / SeparableConv configs carry from its Conv base
# that those layers never use; Keras 3's versions do not take them.
_TF_KERAS_UNUSED = ("groups", "kernel_initializer", "kernel_regularizer", "kernel_constraint")


def _legacy_config(base_cls, kwargs):
    """Drops tf-keras config keys a Keras 3 layer does not take and tf-keras's
    layer ignored (legacy .h5 models saved by larq)."""
    params = inspect.signature(base_cls.__init__).parameters
    return {k: v for k, v in kwargs.items() if k in params or k not in _TF_KERAS_UNUSED}


def _larq_names(kwargs):
    """Resolves larq's string names Keras 3 does not know ("weight_clip" as a
    constraint, "ste_sign" or "hard_tanh" as an activation)."""
    from tapehook.larq import activations, constraints

    names = {
        "weight_clip": constraints.WeightClip,
        "WeightClip": constraints.WeightClip,
        "hard_tanh": activations.hard_tanh,
        "leaky_tanh": activations.leaky_tanh,
    }
    resolved = dict(kwargs)
    if "batch_input_shape" in resolved:  # tf-keras / legacy .h5 configs
        batch_shape = resolved.pop("batch_input_shape")
        resolved.setdefault("input_shape", tuple(batch_shape)[1:])
    for key, value in kwargs.items():
        if not isinstance(value, str):
            continue
        if key.endswith("_constraint") and value in names:
            resolved[key] = names[value]()
        elif key == "activation":
            if value in names:
                resolved[key] = names[value]
            elif value in quantizers._BY_NAME:
                resolved[key] = quantizers.get(value)
    return resolved


def _signature(base_cls, extra):
    """The base layer's signature plus larq's keyword-only arguments."""
    params = list(inspect.signature(base_cls.__init__).parameters.values())[1:]
    var_kw = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
    params = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
        for name, default in extra
    ]
    return inspect.Signature(params + var_kw)


def _quant_layer(name, base_cls, kernels, pads, markable=None, doc=""):
    """A tapehook.larq layer class on ``base_cls``."""
    extra = [("input_quantizer", None)] + [(q, None) for q in kernels.values()]
    if pads:
        extra.append(("pad_values", 0.0))

    def __init__(self, *args, input_quantizer=None, pad_values=0.0, **kwargs):
        kernel_quantizers = {q: kwargs.pop(q, None) for q in kernels.values()}
        if not pads and pad_values != 0.0:
            raise TypeError(f"{name} does not take pad_values")
        self._lq_init(input_quantizer, kernel_quantizers, pad_values)
        base_cls.__init__(self, *args, **_larq_names(_legacy_config(base_cls, kwargs)))
        self._lq_post_init()

    namespace = {
        "__init__": __init__,
        "__signature__": _signature(base_cls, extra),
        "__doc__": (
            f"larq's ``{name}`` on Keras 3: ``keras.layers.{base_cls.__name__}`` "
            f"with {', '.join(n for n, _ in extra)}.{doc}"
        ),
        "__module__": __name__,
        "_kernels": dict(kernels),
        "_pads": pads,
    }
    if markable is not None:
        namespace["_lq_markable"] = markable
    for attr in kernels:
        namespace[attr] = _kernel_property(attr, base_cls)
    cls = type(name, (_QuantMixin, base_cls), namespace)
    keras.saving.register_keras_serializable(package="larq")(cls)
    keras.saving.get_custom_objects()[name] = cls
    return cls


def _channels_last_ungrouped(self, input_shape):
    return self.data_format == "channels_last" and getattr(self, "groups", 1) == 1


def _markable_conv1d(self, input_shape):
    # Keras pads causal convs with zeros before the conv; larq pads the
    # quantized input, tapehook would pad before binarizing: plain ops.
    return _channels_last_ungrouped(self, input_shape) and self.padding != "causal"


def _markable_dense(self, input_shape):
    return len(input_shape) == 2  # x @ W with x 2-D; higher ranks run plain ops


def _markable_depthwise(self, input_shape):
    # tapehook's mean_abs alpha for depthwise is per (in, multiplier); larq's
    # MagnitudeAwareSign averages over all axes but the last (per multiplier).
    return self.data_format == "channels_last" and not isinstance(
        self.depthwise_quantizer, quantizers.MagnitudeAwareSign
    )


_K = {"kernel": "kernel_quantizer"}

QuantDense = _quant_layer("QuantDense", keras.layers.Dense, _K, False, _markable_dense)
QuantConv1D = _quant_layer("QuantConv1D", keras.layers.Conv1D, _K, True, _markable_conv1d)
QuantConv2D = _quant_layer("QuantConv2D", keras.layers.Conv2D, _K, True, _channels_last_ungrouped)
QuantConv3D = _quant_layer("QuantConv3D", keras.layers.Conv3D, _K, True)
QuantConv2DTranspose = _quant_layer("QuantConv2DTranspose", keras.layers.Conv2DTranspose, _K, False)
QuantConv3DTranspose = _quant_layer("QuantConv3DTranspose", keras.layers.Conv3DTranspose, _K, False)
QuantDepthwiseConv2D = _quant_layer(
    "QuantDepthwiseConv2D",
    keras.layers.DepthwiseConv2D,
    {"kernel": "depthwise_quantizer"},
    True,
    _markable_depthwise,
)
_SEP = {"depthwise_kernel": "depthwise_quantizer", "pointwise_kernel": "pointwise_quantizer"}
QuantSeparableConv1D = _quant_layer(
    "QuantSeparableConv1D", keras.layers.SeparableConv1D, _SEP, True
)
QuantSeparableConv2D = _quant_layer(
    "QuantSeparableConv2D", keras.layers.SeparableConv2D, _SEP, True
)


class _NoLocallyConnected:
    """Keras 3 has no LocallyConnected layers; constructing one raises TapehookError."""

    def __init__(self, *args, **kwargs):
        raise TapehookError(
            f"{type(self).__name__} is not available: Keras 3 has no LocallyConnected1D / "
            f"LocallyConnected2D layer to quantize (removed in Keras 3). Use a QuantConv1D "
            f"/ QuantConv2D, or keep this model on larq with tf-keras "
            f"(TF_USE_LEGACY_KERAS=1)"
        )


class QuantLocallyConnected1D(_NoLocallyConnected):
    __doc__ = _NoLocallyConnected.__doc__


class QuantLocallyConnected2D(_NoLocallyConnected):
    __doc__ = _NoLocallyConnected.__doc__
