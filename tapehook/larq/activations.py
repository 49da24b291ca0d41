"""larq.activations on Keras 3: hard_tanh and leaky_tanh."""

import keras

from tapehook.larq import utils


@utils.register_keras_custom_object
def hard_tanh(x):
    """clip(x, -1, 1)."""
    return keras.ops.clip(x, -1, 1)


@utils.register_keras_custom_object
def leaky_tanh(x, alpha=0.2):
    """hard_tanh with slope ``alpha`` outside [-1, 1]."""
    ops = keras.ops  # symbolic KerasTensors too
    return ops.clip(x, -1, 1) + (ops.maximum(x, 1) - 1) * alpha + (ops.minimum(x, -1) + 1) * alpha


__all__ = ["hard_tanh", "leaky_tanh"]
