"""Keras 3 layers: Conv2D, Conv1D (ExpandDims), mixed_float16 (Cast),
dilation_rate, and Model.fit, each against the reference."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tapehook

from conftest import assert_close, random_inputs, reference_result, upstream


def _layer_grads(layer, x, g):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * g)
    dx, dw = tape.gradient(loss, [x, layer.kernel.value])
    return y, dx, dw


@pytest.mark.parametrize("dilation", [1, 2])
@pytest.mark.parametrize("activations", [False, True])
def test_conv2d_layer(activations, dilation):
    x, _ = random_inputs((2, 9, 8, 3), (1, 1, 1, 1))
    with tapehook.binary_scope(activations=activations, scale="mean_abs"):
        layer = keras.layers.Conv2D(4, 3, padding="same", use_bias=False, dilation_rate=dilation)
        layer.build(x.shape)
    spec = tapehook.binary_spec_of(layer.kernel)
    assert spec == tapehook.BinarySpec(activations=activations, scale="mean_abs")
    g = upstream((2, 9, 8, 4), tf.float32)
    y, dx, dw = _layer_grads(layer, x, g)
    ry, rdx, rdw = reference_result(
        x, tf.convert_to_tensor(layer.kernel), spec, g, dilations=[1, dilation, dilation, 1]
    )
    assert_close(y, ry, what="forward")
    assert_close(dx, rdx, what="dX")
    assert_close(dw, rdw, what="dW")
    assert tapehook.dispatch_counts()["compiled"]["forward"] == 1


def test_only_kernels_are_marked_in_a_scope():
    with tapehook.binary_scope():
        model = keras.Sequential(
            [
                keras.Input((8, 8, 3)),
                keras.layers.Conv2D(4, 3),
                keras.layers.BatchNormalization(),
                keras.layers.Flatten(),
                keras.layers.Dense(2),
            ]
        )
    marked = [v.path for v in model.weights if tapehook.binary_spec_of(v)]
    assert marked == [model.layers[0].kernel.path, model.layers[3].kernel.path]


def test_conv1d_layer_through_expand_dims():
    x, _ = random_inputs((2, 11, 3), (1,))
    layer = keras.layers.Conv1D(5, 3, strides=2, padding="same", use_bias=False)
    layer.build(x.shape)
    tapehook.mark_binary(layer.kernel, activations=True)
    g = upstream((2, 6, 5), tf.float32)
    y, dx, dw = _layer_grads(layer, x, g)
    w4 = tf.convert_to_tensor(layer.kernel)[None]
    ry, rdx, rdw = reference_result(
        x[:, None], w4, tapehook.binary_spec_of(layer.kernel), g[:, None], strides=[1, 1, 2, 1]
    )
    assert_close(y, ry[:, 0], what="forward")
    assert_close(dx, rdx[:, 0], what="dX")
    assert_close(dw, rdw[0], what="dW")
    assert tapehook.dispatch_counts()["compiled"]["forward"] == 1


def test_mixed_float16_through_cast():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        layer = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)
        x16, _ = random_inputs((2, 6, 6, 3), (1,), dtype=tf.float16)
        layer.build(x16.shape)
        tapehook.mark_binary(layer.kernel)
        g = upstream((2, 6, 6, 4), tf.float32)
        y, dx, dw = _layer_grads(layer, x16, g)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert y.dtype == tf.float16 and dw.dtype == tf.float32
    w16 = tf.cast(tf.convert_to_tensor(layer.kernel), tf.float16)
    ry, rdx, rdw = reference_result(x16, w16, tapehook.binary_spec_of(layer.kernel), g)
    assert_close(y, ry, tf.float16, "forward")
    assert_close(dx, rdx, tf.float16, "dX")
    assert_close(dw, rdw, tf.float16, "dW")
    assert tapehook.dispatch_counts()["compiled"]["forward"] == 1


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_fit_step_matches_reference_update(run_eagerly):
    x, _ = random_inputs((4, 6, 6, 2), (1,))
    y_true = tf.constant(np.random.default_rng(3).normal(size=(4, 6, 6, 3)), tf.float32)
    with tapehook.binary_scope(activations=True):
        model = keras.Sequential(
            [keras.Input((6, 6, 2)), keras.layers.Conv2D(3, 3, padding="same", use_bias=False)]
        )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", run_eagerly=run_eagerly)
    w_before = tf.convert_to_tensor(model.layers[0].kernel)
    spec = tapehook.binary_spec_of(model.layers[0].kernel)
    model.fit(x, y_true, batch_size=4, epochs=1, verbose=0, shuffle=False)

    with tf.GradientTape() as tape:
        tape.watch(w_before)
        y = tapehook.reference.binary_conv2d(x, w_before, spec)
        loss = tf.reduce_mean(tf.square(y - y_true))
    expected = w_before - 0.1 * tape.gradient(loss, w_before)
    assert_close(model.layers[0].kernel, expected, what="weights after one step")
    counts = tapehook.dispatch_counts()["compiled"]
    assert counts["forward"] >= 1 and counts["backprop_filter"] == 1


def test_unmarked_model_fit_is_stock_bit_for_bit():
    """Same float model trained with tapehook installed and with TF untouched."""
    from tapehook import patches

    x, _ = random_inputs((8, 6, 6, 2), (1,))
    y_true = tf.constant(np.random.default_rng(5).normal(size=(8, 6, 6, 3)), tf.float32)

    def train():
        keras.utils.set_random_seed(7)
        model = keras.Sequential(
            [
                keras.Input((6, 6, 2)),
                keras.layers.Conv2D(3, 3, padding="same"),
                keras.layers.Activation("relu"),
                keras.layers.Conv2D(3, 3, padding="same", dilation_rate=2),
            ]
        )
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y_true, batch_size=4, epochs=2, verbose=0, shuffle=False)
        return [v.numpy() for v in model.weights]

    ours = train()
    patches.uninstall()
    try:
        stock = train()
    finally:
        patches.install()
    for a, b in zip(ours, stock):
        np.testing.assert_array_equal(a, b)
    assert tapehook.dispatch_counts()["compiled"]["forward"] == 0
