"""Learnable binarizers and annealed estimators of the 2020-2021 recipes.

Keras layers, in float32 (float64 for float64 inputs) whatever the dtype
policy, cast back to the layer's compute dtype (each one's docstring has
its math; docs/recipes.md shows them in a model):

- ``RSign`` (ReActNet): sign(x - beta), beta learned per input channel.
- ``RPReLU`` (ReActNet): PReLU(x - gamma; slope) + zeta, per channel.
- ``LearnedRescale`` (XNOR-Net++): the input times scale_h x scale_w x scale_c.
- ``EDESign`` (IR-Net's EDE) and ``SwishSign``: sign with a pseudo-gradient
  whose parameters are non-trainable variables that ``AnnealEstimator``
  moves during ``fit``; traced steps read the variables, so nothing retraces.

Functions: ``ede_sign(x, k, t)`` and ``balanced_weights(w)`` (IR-Net's
Libra-PB standardization; as a binary conv's own option it is
``BinarySpec(balance="std")``, which keeps the conv on tapehook's kernels).
RSign is a layer in front of the conv.
"""

import math

import keras
import numpy as np
import tensorflow as tf

from tapehook import conv2d, reference
from tapehook.errors import TapehookError
from tapehook.spec import ESTIMATORS

_PACKAGE = "tapehook"
_register = keras.saving.register_keras_serializable(package=_PACKAGE)


def _wide_dtype(dtype):
    """Where the binarizers compute: float64 for float64, else float32."""
    return tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32


def _as(value, dtype):
    """A float, tensor or variable as a tensor of dtype (Python floats exactly)."""
    return tf.cast(tf.convert_to_tensor(value, dtype_hint=dtype), dtype)


def _sign_with(t, pseudo_derivative):
    """sign(t) (zero maps to +1); backward dy * pseudo_derivative(t)."""

    @tf.custom_gradient
    def op(t):
        def grad(dy):
            return dy * tf.cast(pseudo_derivative(t), dy.dtype)

        return reference.sign(t), grad

    return op(t)


def ede_sign(x, k, t):
    """IR-Net's Error Decay Estimator: forward sign(x) (sign(0) = +1),
    backward dy * k * t * (1 - tanh(t x)^2).

    ``k`` and ``t`` are floats, tensors or variables (read when called, so a
    traced function follows their assigned values); no gradient flows to
    them. Computed in float32 (float64 for float64 x), returned in x's dtype.
    """
    x = tf.convert_to_tensor(x)
    wide = _wide_dtype(x.dtype)
    k, t = _as(k, wide), _as(t, wide)
    y = _sign_with(tf.cast(x, wide), lambda u: k * t * (1 - tf.square(tf.tanh(t * u))))
    return tf.cast(y, x.dtype)


def ede_schedule(progress, t_min=0.1, t_max=10.0):
    """IR-Net's (t, k) at progress e / E in [0, 1]:
    t = t_min * 10^(progress * log10(t_max / t_min)), k = max(1 / t, 1)."""
    t = t_min * 10 ** (progress * math.log10(t_max / t_min))
    return t, max(1 / t, 1.0)


def balanced_weights(w, epsilon=1e-12):
    """IR-Net's balanced, standardized weights (Libra-PB) per output channel:
    (w - mean) / sqrt(var + epsilon), the mean and (population) variance over
    every axis but the last (a Keras kernel's output channels).

    Differentiable: the gradient flows through the mean and the deviation, as
    in IR-Net. sign() of the result is the binary kernel; IR-Net's code divides
    by the n - 1 deviation, which changes the gradient's scale, not the sign.
    """
    w = tf.convert_to_tensor(w)
    if w.shape.rank is None or w.shape.rank < 2:
        raise TapehookError(
            f"balanced_weights: kernel of shape {w.shape}; pass a kernel of rank >= 2 "
            f"whose last axis is the output channels"
        )
    return reference.balanced_kernel(w, "std", epsilon=epsilon)


class _Float32Layer(keras.layers.Layer):
    """A layer whose variables are read in their own dtype: thresholds and
    scales stay float32 under mixed_float16. (Per variable: Keras 3 autocasts
    a mixed-policy layer's variables even when the layer says autocast=False.)"""

    def add_weight(self, *args, **kwargs):
        return super().add_weight(*args, autocast=False, **kwargs)

    def _wide(self, inputs):
        return tf.cast(inputs, _wide_dtype(self.variable_dtype))

    def _back(self, y):
        return tf.cast(y, self.compute_dtype)

    def compute_output_shape(self, input_shape):
        return input_shape


def _channels(layer, input_shape):
    channels = input_shape[-1]
    if channels is None:
        raise TapehookError(
            f"{type(layer).__name__} {layer.name!r}: the input's last axis (channels) must "
            f"be known when the layer is built; got shape {tuple(input_shape)}"
        )
    return channels


@_register
class RSign(_Float32Layer):
    """ReActNet's RSign: y = sign(x - beta) (sign(0) = +1), beta learned per
    input channel (the last axis), initialized to 0.

    Pseudo-gradient at t = x - beta: dx = dy * e'(t) and
    dbeta = -sum over every other axis of dy * e'(t), with e' the estimator's
    (``"ste_sign"``: 1{|t| <= clip}, clip None: no mask; ``"approx_sign"``:
    (2 - 2|t|) 1{|t| <= 1}; ``"swish_sign"``: beta 5, as BinarySpec).

    A binary Conv2D reading y whose input estimator passes +-1 through
    (``ste_sign`` with a clip of at least 1) binarizes x - beta itself, with
    this estimator: the same results without a pass for the sign.
    """

    def __init__(
        self,
        estimator="ste_sign",
        clip=1.0,
        beta_initializer="zeros",
        beta_regularizer=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if estimator not in ESTIMATORS:
            raise TapehookError(f"RSign(estimator={estimator!r}): use one of {ESTIMATORS}")
        if clip is not None and not clip > 0:
            raise TapehookError(f"RSign(clip={clip!r}): use a positive number, or None (no mask)")
        self.estimator, self.clip = estimator, clip
        self.beta_initializer = keras.initializers.get(beta_initializer)
        self.beta_regularizer = keras.regularizers.get(beta_regularizer)

    def build(self, input_shape):
        self.beta = self.add_weight(
            name="beta",
            shape=(_channels(self, input_shape),),
            initializer=self.beta_initializer,
            regularizer=self.beta_regularizer,
        )

    def call(self, inputs):
        x = self._wide(inputs)
        beta = tf.cast(self.beta, x.dtype)
        t = x - beta
        y = self._back(
            _sign_with(t, lambda u: reference.estimator_grad(self.estimator, u, self.clip))
        )
        # A binary conv reading y binarizes t itself (conv2d._fold_shifted_sign).
        conv2d.tag_shifted_sign(y, x, beta, t, self.estimator, self.clip)
        return y

    def get_config(self):
        return {
            **super().get_config(),
            "estimator": self.estimator,
            "clip": self.clip,
            "beta_initializer": keras.initializers.serialize(self.beta_initializer),
            "beta_regularizer": keras.regularizers.serialize(self.beta_regularizer),
        }


@_register
class RPReLU(_Float32Layer):
    """ReActNet's RPReLU, per channel (the last axis):
    y = (x - gamma) + zeta where x > gamma, slope * (x - gamma) + zeta elsewhere.

    ReActNet writes the slope beta; here it is ``slope`` (init 0.25), gamma
    and zeta init 0. Gradients are the function's own (x = gamma takes the
    slope side).
    """

    def __init__(self, slope_initializer=0.25, **kwargs):
        super().__init__(**kwargs)
        if isinstance(slope_initializer, (int, float)):
            slope_initializer = keras.initializers.Constant(float(slope_initializer))
        self.slope_initializer = keras.initializers.get(slope_initializer)

    def build(self, input_shape):
        channels = _channels(self, input_shape)
        self.gamma = self.add_weight(name="gamma", shape=(channels,), initializer="zeros")
        self.slope = self.add_weight(
            name="slope", shape=(channels,), initializer=self.slope_initializer
        )
        self.zeta = self.add_weight(name="zeta", shape=(channels,), initializer="zeros")

    def call(self, inputs):
        x = self._wide(inputs)
        t = x - tf.cast(self.gamma, x.dtype)
        y = tf.where(t > 0, t, tf.cast(self.slope, x.dtype) * t)
        return self._back(y + tf.cast(self.zeta, x.dtype))

    def get_config(self):
        return {
            **super().get_config(),
            "slope_initializer": keras.initializers.serialize(self.slope_initializer),
        }


@_register
class LearnedRescale(_Float32Layer):
    """XNOR-Net++'s learned output scale: y[b, h, w, c] = x[b, h, w, c] *
    scale_h[h] * scale_w[w] * scale_c[c] (the outer product of three vectors,
    initialized to ones), for a conv's NHWC output of a fixed image size.

    The weights (``scale_h``, ``scale_w``, ``scale_c``, in this order, shaped
    (H, 1, 1), (1, W, 1), (1, 1, C)) are larq-zoo's LearnedRescaleLayer's.
    """

    def __init__(self, regularizer=None, **kwargs):
        super().__init__(**kwargs)
        self.regularizer = keras.regularizers.get(regularizer)

    def build(self, input_shape):
        if len(input_shape) != 4 or None in tuple(input_shape[1:]):
            raise TapehookError(
                f"LearnedRescale {self.name!r}: input shape {tuple(input_shape)}; it needs "
                f"an NHWC input whose height, width and channels are known"
            )
        _, h, w, c = input_shape
        for name, shape in (("scale_h", (h, 1, 1)), ("scale_w", (1, w, 1)), ("scale_c", (1, 1, c))):
            setattr(
                self,
                name,
                self.add_weight(
                    name=name, shape=shape, initializer="ones", regularizer=self.regularizer
                ),
            )

    def call(self, inputs):
        x = self._wide(inputs)
        scale = self.scale_h * self.scale_w * self.scale_c
        return self._back(x * tf.cast(scale, x.dtype))

    def get_config(self):
        return {
            **super().get_config(),
            "regularizer": keras.regularizers.serialize(self.regularizer),
        }


@_register
class EDESign(_Float32Layer):
    """sign(x) with IR-Net's EDE pseudo-gradient k t (1 - tanh(t x)^2) (see
    ``ede_sign``). t and k are non-trainable variables (saved with the
    model), set from ``ede_schedule`` by ``anneal(progress)``, which
    ``AnnealEstimator`` calls; they start at progress 0.
    """

    def __init__(self, t_min=0.1, t_max=10.0, **kwargs):
        super().__init__(**kwargs)
        if not 0 < t_min <= t_max:
            raise TapehookError(
                f"EDESign(t_min={t_min!r}, t_max={t_max!r}): use 0 < t_min <= t_max "
                f"(IR-Net: 0.1 and 10)"
            )
        self.t_min, self.t_max = float(t_min), float(t_max)

    def build(self, input_shape):
        t, k = ede_schedule(0.0, self.t_min, self.t_max)
        self.t = self.add_weight(
            name="t",
            shape=(),
            initializer=keras.initializers.Constant(t),
            trainable=False,
            dtype="float32",
        )
        self.k = self.add_weight(
            name="k",
            shape=(),
            initializer=keras.initializers.Constant(k),
            trainable=False,
            dtype="float32",
        )

    def anneal(self, progress):
        t, k = ede_schedule(progress, self.t_min, self.t_max)
        self.t.assign(t)
        self.k.assign(k)

    def call(self, inputs):
        return ede_sign(inputs, self.k, self.t)

    def get_config(self):
        return {**super().get_config(), "t_min": self.t_min, "t_max": self.t_max}


@_register
class SwishSign(_Float32Layer):
    """sign(x) with swish_sign's pseudo-gradient
    beta (2 - beta x tanh(beta x / 2)) / (1 + cosh(beta x)), beta a
    non-trainable variable: ``beta`` at progress 0, moved linearly to
    ``beta_end`` by ``anneal(progress)`` (``AnnealEstimator``); fixed when
    ``beta_end`` is None.
    """

    def __init__(self, beta=reference.SWISH_BETA, beta_end=None, **kwargs):
        super().__init__(**kwargs)
        if not beta > 0 or (beta_end is not None and not beta_end > 0):
            raise TapehookError(
                f"SwishSign(beta={beta!r}, beta_end={beta_end!r}): use positive numbers"
            )
        self.beta, self.beta_end = float(beta), None if beta_end is None else float(beta_end)

    def build(self, input_shape):
        self.swish_beta = self.add_weight(
            name="swish_beta",
            shape=(),
            initializer=keras.initializers.Constant(self.beta),
            trainable=False,
            dtype="float32",
        )

    def anneal(self, progress):
        if self.beta_end is not None:
            self.swish_beta.assign(self.beta + (self.beta_end - self.beta) * progress)

    def call(self, inputs):
        x = self._wide(inputs)
        beta = self.swish_beta
        return self._back(
            _sign_with(x, lambda u: reference.estimator_grad("swish_sign", u, None, beta=beta))
        )

    def get_config(self):
        return {**super().get_config(), "beta": self.beta, "beta_end": self.beta_end}


EVERY = ("epoch", "batch")


def annealed_layers(model):
    """Every layer in model (nested models included) that has ``anneal``."""
    found, stack, seen = [], list(model.layers), set()
    while stack:
        layer = stack.pop(0)
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        if callable(getattr(layer, "anneal", None)):
            found.append(layer)
        stack.extend(getattr(layer, "layers", ()))
    return found


class AnnealEstimator(keras.callbacks.Callback):
    """Moves estimator parameters during ``fit``: calls ``anneal(progress)``
    on ``layers`` (default: every ``EDESign`` / ``SwishSign`` in the model,
    nested models and a Distiller's student included) with progress = e / E
    at the start of epoch e of E (``every="epoch"``, IR-Net's schedule), or
    s / S before step s of S (``every="batch"``; once per
    ``steps_per_execution`` steps when that is > 1).

    E is fit's ``epochs`` unless ``epochs`` is given (for training split over
    several ``fit`` calls with ``initial_epoch``). The parameters are
    variables read inside the traced step, so no recompilation is needed.
    ``history`` records (progress, {layer name: parameter values}).
    """

    def __init__(self, every="epoch", layers=None, epochs=None):
        if every not in EVERY:
            raise TapehookError(f"AnnealEstimator(every={every!r}): use one of {EVERY}")
        super().__init__()
        self.every, self.epochs, self._given = every, epochs, layers
        self.history = []

    def on_train_begin(self, logs=None):
        self._layers = list(self._given) if self._given is not None else annealed_layers(self.model)
        if not self._layers:
            raise TapehookError(
                f"AnnealEstimator: model {self.model.name!r} has no EDESign / SwishSign "
                f"layers (nothing with anneal()); add one or pass layers="
            )
        self._total_epochs = self.epochs or self.params.get("epochs")
        self._steps = self.params.get("steps")
        if self.every == "batch" and not self._steps:
            raise TapehookError(
                "AnnealEstimator(every='batch'): fit does not know the steps per epoch; "
                "pass steps_per_epoch to fit, or use every='epoch'"
            )
        self._epoch = 0

    def _anneal(self, progress):
        progress = float(np.clip(progress, 0.0, 1.0))
        for layer in self._layers:
            layer.anneal(progress)
        self.history.append(
            (
                progress,
                {
                    layer.name: [float(v.numpy()) for v in layer.non_trainable_weights]
                    for layer in self._layers
                },
            )
        )

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if self.every == "epoch":
            self._anneal(epoch / self._total_epochs)

    def on_train_batch_begin(self, batch, logs=None):
        if self.every == "batch":
            self._anneal((self._epoch * self._steps + batch) / (self._total_epochs * self._steps))
