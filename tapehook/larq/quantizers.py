"""larq.quantizers on Keras 3: the same forward and pseudo-gradient as larq 0.14.

A quantizer maps a tensor to its quantized value in the forward pass and
passes a pseudo-gradient in the backward pass. Used standalone, as an
activation or as a layer's ``input_quantizer`` / ``kernel_quantizer``; in a
layer whose quantizers map onto a ``tapehook.BinarySpec`` (``layers._spec_for``)
tapehook's marks and kernels do the same math instead of these ops.

Estimators (dy: upstream gradient):
- ste_sign: sign(x) (0 -> +1); dy * 1{|x| <= clip_value} (no mask if None)
- approx_sign: sign(x); dy * (2 - 2|x|) 1{|x| <= 1}
- swish_sign: sign(x); dy * beta (2 - beta x tanh(beta x / 2)) / (1 + cosh(beta x))
- magnitude_aware_sign: alpha sign(x), alpha = mean|x| over all axes but the
  last (a constant in the backward pass); dy * alpha * 1{|x| <= clip_value}
- ste_heaviside: 1{x > 0}; dy * 1{|x| <= clip_value}
- ste_tern: +-1 beyond +-threshold, else 0; dy * 1{|x| <= clip_value}
- dorefa: round(x n) / n on [0, 1] (n = 2^k - 1), identity gradient after the
  clip ("activations") or tanh / max-norm preprocessing ("weights").
"""

from collections.abc import Callable

import keras
import tensorflow as tf

from tapehook.larq import context, math, utils
from tapehook.larq import metrics as lq_metrics

__all__ = [
    "ApproxSign",
    "DoReFa",
    "DoReFaQuantizer",
    "MagnitudeAwareSign",
    "NoOp",
    "NoOpQuantizer",
    "Quantizer",
    "SteHeaviside",
    "SteSign",
    "SteTern",
    "SwishSign",
]


def _mask(x, dy, clip_value):
    """dy where |x| <= clip_value (everywhere when clip_value is None)."""
    if clip_value is None:
        return dy
    return tf.where(tf.abs(x) <= tf.cast(clip_value, x.dtype), dy, tf.zeros_like(dy))


def ste_sign(x, clip_value=1.0):
    @tf.custom_gradient
    def _sign(x):
        return math.sign(x), lambda dy: _mask(x, dy, clip_value)

    return _sign(tf.convert_to_tensor(x))


@tf.custom_gradient
def _approx_sign(x):
    def grad(dy):
        ax = tf.abs(x)
        return tf.where(ax <= 1, 2 * (1 - ax) * dy, tf.zeros_like(dy))

    return math.sign(x), grad


def approx_sign(x):
    return _approx_sign(tf.convert_to_tensor(x))


def swish_sign(x, beta=5.0):
    @tf.custom_gradient
    def _swish(x):
        def grad(dy):
            bx = tf.cast(beta, x.dtype) * x
            return dy * beta * (2 - bx * tf.tanh(bx * 0.5)) / (1 + tf.cosh(bx))

        return math.sign(x), grad

    return _swish(tf.convert_to_tensor(x))


def ste_heaviside(x, clip_value=1.0):
    @tf.custom_gradient
    def _step(x):
        return math.heaviside(x), lambda dy: _mask(x, dy, clip_value)

    return _step(tf.convert_to_tensor(x))


def ste_tern(x, threshold_value=0.05, ternary_weight_networks=False, clip_value=1.0):
    @tf.custom_gradient
    def _tern(x):
        if ternary_weight_networks:  # TWN: 0.7 mean|x|
            threshold = 0.7 * tf.reduce_mean(tf.abs(x))
        else:
            threshold = tf.cast(threshold_value, x.dtype)
        # sign(sign(x + t) + sign(x - t)): +-1 at |x| = t > 0 as in larq.
        y = tf.sign(tf.sign(x + threshold) + tf.sign(x - threshold))
        return y, lambda dy: _mask(x, dy, clip_value)

    return _tern(tf.convert_to_tensor(x))


class Quantizer(keras.layers.Layer):
    """Base class of quantizers: an element-wise Keras layer with a ``precision``
    (bits of its output, read by ``models.summary`` and ``Bop.is_binary_variable``)."""

    precision = None

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("autocast", False)  # quantize in the input's own dtype
        super().__init__(*args, **kwargs)

    def compute_output_shape(self, input_shape):
        return input_shape


class _BaseQuantizer(Quantizer):
    """Quantizers with larq's training metrics.

    ``metrics=["flip_ratio"]`` (or a ``context.metrics_scope(["flip_ratio"])``
    around the layer, through ``get_kernel_quantizer``) gives the quantizer a
    ``metrics.FlipRatio`` of its output, built with the quantizer and updated
    on every call. Keras 3 has no ``Layer.add_metric``; a metric held by a layer
    is listed in ``layer.metrics`` and the model's, so ``fit`` logs it as
    ``flip_ratio/<quantizer name>`` and resets it each epoch.
    """

    def __init__(self, *args, metrics=None, **kwargs):
        self._custom_metrics = metrics
        super().__init__(*args, **kwargs)

    def build(self, input_shape):
        if self._custom_metrics and "flip_ratio" in self._custom_metrics:
            self.flip_ratio = lq_metrics.FlipRatio(name=f"flip_ratio/{self.name}")
            self.flip_ratio.build(input_shape)
        super().build(input_shape)

    def call(self, inputs):
        if getattr(self, "flip_ratio", None) is not None:
            self.flip_ratio.update_state(inputs)
        return inputs

    def get_config(self):
        config = super().get_config()
        for key in ("autocast",):
            config.pop(key, None)
        return config


class _ClippedQuantizer(_BaseQuantizer):
    """Quantizers with a straight-through estimator masked at ``clip_value``."""

    def __init__(self, clip_value: float | None = 1.0, **kwargs):
        self.clip_value = clip_value
        super().__init__(**kwargs)

    def get_config(self):
        return {**super().get_config(), "clip_value": self.clip_value}


def _register(*aliases):
    def decorate(cls):
        keras.saving.register_keras_serializable(package="larq")(cls)
        utils.register_keras_custom_object(cls)
        for alias in aliases:
            utils.register_alias(alias)(cls)
        return cls

    return decorate


@_register()
class NoOp(_BaseQuantizer):
    """Identity; only tags a variable with ``precision`` (e.g. 1 for Bop)."""

    precision = None

    def __init__(self, precision: int, **kwargs):
        self.precision = precision
        super().__init__(**kwargs)

    def get_config(self):
        return {**super().get_config(), "precision": self.precision}


NoOpQuantizer = NoOp


@_register("ste_sign")
class SteSign(_ClippedQuantizer):
    """sign(x) (0 -> +1), straight-through gradient where |x| <= clip_value."""

    precision = 1

    def call(self, inputs):
        return super().call(ste_sign(inputs, clip_value=self.clip_value))


@_register("approx_sign")
class ApproxSign(_BaseQuantizer):
    """sign(x), gradient (2 - 2|x|) on |x| <= 1 (Bi-Real Net)."""

    precision = 1

    def call(self, inputs):
        return super().call(approx_sign(inputs))


@_register("ste_heaviside")
class SteHeaviside(_ClippedQuantizer):
    """1{x > 0}, straight-through gradient where |x| <= clip_value."""

    precision = 1

    def call(self, inputs):
        return super().call(ste_heaviside(inputs, clip_value=self.clip_value))


@_register("swish_sign")
class SwishSign(_BaseQuantizer):
    """sign(x), SwishSign gradient with slope ``beta`` (BNN+)."""

    precision = 1

    def __init__(self, beta: float = 5.0, **kwargs):
        self.beta = beta
        super().__init__(**kwargs)

    def call(self, inputs):
        return super().call(swish_sign(inputs, beta=self.beta))

    def get_config(self):
        return {**super().get_config(), "beta": self.beta}


@_register("magnitude_aware_sign")
class MagnitudeAwareSign(_ClippedQuantizer):
    """alpha * sign(x), alpha = mean|x| over all axes but the last (Bi-Real Net)."""

    precision = 1

    def call(self, inputs):
        inputs = tf.convert_to_tensor(inputs)
        alpha = tf.stop_gradient(
            tf.reduce_mean(tf.abs(inputs), axis=list(range(inputs.shape.rank - 1)))
        )
        return super().call(alpha * ste_sign(inputs, clip_value=self.clip_value))


@_register("ste_tern")
class SteTern(_BaseQuantizer):
    """Ternary {-1, 0, +1} with threshold (or TWN's 0.7 mean|x|), STE gradient."""

    precision = 2

    def __init__(
        self,
        threshold_value: float = 0.05,
        ternary_weight_networks: bool = False,
        clip_value: float | None = 1.0,
        **kwargs,
    ):
        self.threshold_value = threshold_value
        self.ternary_weight_networks = ternary_weight_networks
        self.clip_value = clip_value
        super().__init__(**kwargs)

    def call(self, inputs):
        return super().call(
            ste_tern(
                inputs,
                threshold_value=self.threshold_value,
                ternary_weight_networks=self.ternary_weight_networks,
                clip_value=self.clip_value,
            )
        )

    def get_config(self):
        return {
            **super().get_config(),
            "threshold_value": self.threshold_value,
            "ternary_weight_networks": self.ternary_weight_networks,
            "clip_value": self.clip_value,
        }


@_register("dorefa_quantizer")
class DoReFa(_BaseQuantizer):
    """k-bit DoReFa quantizer; ``mode`` "activations" ([0, 1]) or "weights" ([-1, 1])."""

    precision = None

    def __init__(self, k_bit: int = 2, mode: str = "activations", **kwargs):
        self.precision = k_bit
        if mode not in ("activations", "weights"):
            raise ValueError(
                f"Invalid DoReFa quantizer mode {mode}. Valid values are "
                f"'activations' and 'weights'."
            )
        self.mode = mode
        super().__init__(**kwargs)

    def weight_preprocess(self, inputs):
        limited = tf.tanh(inputs)
        # The max-norm divisor is a constant for the gradient (x / max|x|
        # would otherwise get a non-identity gradient at the maximum).
        divisor = tf.stop_gradient(tf.reduce_max(tf.abs(limited)))
        return tf.math.divide_no_nan(limited, 2.0 * divisor) + 0.5

    def call(self, inputs):
        if self.mode == "activations":
            inputs = tf.clip_by_value(inputs, 0.0, 1.0)
        elif self.mode == "weights":
            inputs = self.weight_preprocess(tf.convert_to_tensor(inputs))
        else:
            raise ValueError(
                f"Invalid DoReFa quantizer mode {self.mode}. Valid values "
                f"are 'activations' and 'weights'."
            )
        levels = 2**self.precision - 1

        @tf.custom_gradient
        def _round(x):
            return tf.round(x * levels) / levels, lambda dy: dy

        outputs = _round(inputs)
        if self.mode == "weights":
            outputs = 2.0 * outputs - 1.0
        return super().call(outputs)

    def get_config(self):
        return {**super().get_config(), "k_bit": self.precision, "mode": self.mode}


DoReFaQuantizer = DoReFa

QuantizerType = Quantizer | Callable

_BY_NAME = {
    cls.__name__: cls
    for cls in (
        NoOp,
        SteSign,
        ApproxSign,
        SteHeaviside,
        SwishSign,
        MagnitudeAwareSign,
        SteTern,
        DoReFa,
    )
}
_BY_NAME.update(
    {
        "NoOpQuantizer": NoOp,
        "DoReFaQuantizer": DoReFa,
        "ste_sign": SteSign,
        "approx_sign": ApproxSign,
        "ste_heaviside": SteHeaviside,
        "swish_sign": SwishSign,
        "magnitude_aware_sign": MagnitudeAwareSign,
        "ste_tern": SteTern,
        "dorefa_quantizer": DoReFa,
    }
)


def serialize(quantizer, use_legacy_format=False):
    return keras.saving.serialize_keras_object(quantizer)


def deserialize(name, custom_objects=None, use_legacy_format=False):
    if isinstance(name, dict) and "module" not in name:
        # larq / tf-keras legacy form {"class_name": ..., "config": {...}}
        cls = (custom_objects or {}).get(name.get("class_name")) or _BY_NAME.get(
            name.get("class_name")
        )
        if cls is None:
            raise ValueError(f"Unknown quantizer: {name.get('class_name')!r}")
        config = dict(name.get("config") or {})
        return cls.from_config(config) if config else cls()
    if isinstance(name, str):
        if name not in _BY_NAME:
            raise ValueError(f"Unknown quantizer: {name!r}; use one of {sorted(_BY_NAME)}")
        return _BY_NAME[name]()
    return keras.saving.deserialize_keras_object(
        name, custom_objects={**_BY_NAME, **(custom_objects or {})}
    )


def get(identifier):
    """A quantizer from a name, a config dict or a callable; None stays None."""
    if identifier is None:
        return None
    if isinstance(identifier, (dict, str)):
        return deserialize(identifier)
    if callable(identifier):
        return identifier
    raise ValueError(f"Could not interpret quantization function identifier: {identifier}")


def get_kernel_quantizer(identifier):
    """``get`` plus the training metrics of the current ``metrics_scope``."""
    quantizer = get(identifier)
    if isinstance(quantizer, _BaseQuantizer) and not quantizer._custom_metrics:
        quantizer._custom_metrics = list(context.get_training_metrics())
    return quantizer
