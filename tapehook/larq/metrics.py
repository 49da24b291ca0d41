"""larq.metrics on Keras 3: FlipRatio, the fraction of values that changed.

A quantizer created under ``context.metrics_scope(["flip_ratio"])`` holds one
of these on its output (``quantizers._BaseQuantizer``); ``tapehook.FlipRatio``,
a Keras callback, logs the flip ratio of every binary kernel without it.
"""

import keras
import numpy as np
import tensorflow as tf

from tapehook.larq import utils

__all__ = ["FlipRatio"]


@utils.register_alias("flip_ratio")
@utils.register_keras_custom_object
@keras.saving.register_keras_serializable(package="larq")
class FlipRatio(keras.metrics.Metric):
    """Mean fraction of changed values between consecutive ``update_state`` calls.

    The first update only records the values; ``result()`` is the mean over
    the following updates of the fraction of elements that differ from the
    previous update (larq's definition).
    """

    stateful = True  # tf-keras's Metric attribute, kept for larq code

    def __init__(self, values_dtype="int8", name="flip_ratio", dtype=None):
        super().__init__(name=name, dtype=dtype)
        self.values_dtype = tf.as_dtype(values_dtype)
        self.built = False

    def build(self, input_shape):
        shape = tuple(input_shape)
        self._previous_values = self.add_variable(
            shape=shape,
            initializer="zeros",
            dtype=self.values_dtype.name,
            aggregation="only_first_replica",
            name="previous_values",
        )
        self.total = self.add_variable(
            shape=(),
            initializer="zeros",
            dtype=self.dtype,
            aggregation="only_first_replica",
            name="total",
        )
        self.count = self.add_variable(
            shape=(),
            initializer="zeros",
            dtype=self.dtype,
            aggregation="only_first_replica",
            name="count",
        )
        self._size = float(np.prod(shape))
        self.built = True

    def update_state(self, values, sample_weight=None):
        values = tf.cast(values, self.values_dtype)
        if not self.built:
            with tf.init_scope():  # variables outside any tf.function
                self.build(values.shape)
        prev = tf.convert_to_tensor(self._previous_values)
        if values.shape.is_fully_defined() and prev.shape != values.shape:
            raise ValueError(
                f"FlipRatio was built for shape {prev.shape}, got values of shape {values.shape}"
            )
        unchanged = tf.math.count_nonzero(tf.equal(prev, values))
        ratio = 1 - tf.cast(unchanged, self.dtype) / tf.cast(self._size, self.dtype)
        # The first update only records values: sign(count) is 0 then.
        total = self.total.assign_add(ratio * tf.sign(tf.convert_to_tensor(self.count)))
        with tf.control_dependencies([total]):
            count = self.count.assign_add(tf.ones([], self.dtype))
            with tf.control_dependencies([count]):
                return self._previous_values.assign(values)

    def result(self):
        return tf.math.divide_no_nan(
            tf.convert_to_tensor(self.total), tf.convert_to_tensor(self.count) - 1
        )

    def reset_state(self):
        if self.built:
            self.total.assign(0)
            self.count.assign(0)

    def reset_states(self):
        self.reset_state()

    def get_config(self):
        return {**super().get_config(), "values_dtype": self.values_dtype.name}
