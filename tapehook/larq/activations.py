"""larq.activations on Keras 3: hard_tanh and leaky_tanh.

Both resolve by name through ``keras.activations.get`` and round-trip through
Keras serialization.
"""

import keras

from tapehook.larq import utils

# clip(x, -1, 1): larq's hard_tanh is Keras 3's own built-in of that name (the
# same op), so "hard_tanh" resolves to one function everywhere.
hard_tanh = keras.activations.hard_tanh


@utils.register_keras_custom_object
@keras.saving.register_keras_serializable(package="larq")
def leaky_tanh(x, alpha=0.2):
    """hard_tanh with slope ``alpha`` outside [-1, 1]."""
    ops = keras.ops  # symbolic KerasTensors too
    return ops.clip(x, -1, 1) + (ops.maximum(x, 1) - 1) * alpha + (ops.minimum(x, -1) + 1) * alpha


utils.register_keras_name("activations", "leaky_tanh", leaky_tanh)

__all__ = ["hard_tanh", "leaky_tanh"]
