"""larq.math on tapehook: the sign and step functions of binary networks.

Both take tensors and, in Keras 3 functional models, symbolic KerasTensors
(through keras.ops).
"""

import keras
import tensorflow as tf


def _symbolic(x):
    return isinstance(x, keras.KerasTensor)


def sign(x):
    """+1 where x >= 0, else -1 (never 0), in x's dtype (larq.math.sign)."""
    if _symbolic(x):
        return keras.ops.where(x >= 0, keras.ops.ones_like(x), -keras.ops.ones_like(x))
    x = tf.convert_to_tensor(x)
    one = tf.ones_like(x)
    return tf.where(x >= 0, one, -one)


def heaviside(x):
    """1 where x > 0, else 0, in x's dtype (larq.math.heaviside)."""
    if _symbolic(x):
        return keras.ops.where(x > 0, keras.ops.ones_like(x), keras.ops.zeros_like(x))
    x = tf.convert_to_tensor(x)
    return tf.where(x > 0, tf.ones_like(x), tf.zeros_like(x))
