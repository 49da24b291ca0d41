"""A binary conv reading RSign's output binarizes x - beta itself
(conv2d._fold_shifted_sign): the same forward and gradients as RSign's sign
followed by the conv, checked against plain TF ops written here, in eager,
tf.function, a function differentiated from outside and Keras fit."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tapehook
from tapehook import recipes

from conftest import assert_close

SHAPE = (4, 8, 8, 16)


def _e(name, t, clip):
    if name == "approx_sign":
        return tf.where(tf.abs(t) <= 1, 2 - 2 * tf.abs(t), 0.0)
    return tf.cast(tf.abs(t) <= clip, tf.float32)


def _straight_through(value, t, slope):
    """value forward, d/dt = slope (a constant) backward."""
    slope = tf.stop_gradient(slope)
    return tf.stop_gradient(value) + t * slope - tf.stop_gradient(t * slope)


def reference(x, beta, w, estimator, clip):
    """(y, [dx, dbeta, dw]) for loss sum(y^2), y = conv(sign(x - beta), alpha sign(W)):
    RSign's estimator at x - beta, the conv's ste_sign (clip 1) at W."""
    with tf.GradientTape() as tape:
        tape.watch([x, beta, w])
        t = x - beta
        x_hat = _straight_through(tf.where(t >= 0, 1.0, -1.0), t, _e(estimator, t, clip))
        alpha = tf.stop_gradient(tf.reduce_mean(tf.abs(w), axis=[0, 1, 2]))
        mask = tf.cast(tf.abs(w) <= 1, tf.float32) * alpha
        w_hat = _straight_through(tf.where(w >= 0, alpha, -alpha), w, mask)
        y = tf.raw_ops.Conv2D(input=x_hat, filter=w_hat, strides=[1] * 4, padding="SAME")
        loss = tf.reduce_sum(y * y)
    return y, tape.gradient(loss, [x, beta, w])


def _setup(estimator, clip, seed=0):
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(size=SHAPE).astype("float32"))
    w = tf.Variable(rng.normal(size=(3, 3, SHAPE[-1], 8)).astype("float32") * 0.8)
    tapehook.mark_binary(w, activations=True, scale="mean_abs")
    rsign = recipes.RSign(estimator=estimator, clip=clip)
    rsign.build(x.shape)
    rsign.beta.assign(rng.normal(size=SHAPE[-1]).astype("float32") * 0.3)
    return x, w, rsign


def _step(x, w, rsign):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.nn.conv2d(rsign(x), w, 1, "SAME")
        loss = tf.reduce_sum(y * y)
    return y, tape.gradient(loss, [x, rsign.beta, w])


@pytest.mark.parametrize("estimator,clip", [("approx_sign", 1.0), ("ste_sign", 0.7)])
@pytest.mark.parametrize("mode", ["eager", "function", "function_under_tape"])
def test_matches_reference(mode, estimator, clip):
    x, w, rsign = _setup(estimator, clip)
    if mode == "eager":
        y, grads = _step(x, w, rsign)
    elif mode == "function":
        y, grads = tf.function(_step)(x, w, rsign)
    else:
        forward = tf.function(lambda x: tf.nn.conv2d(rsign(x), w, 1, "SAME"))
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = forward(x)
            loss = tf.reduce_sum(y * y)
        grads = tape.gradient(loss, [x, rsign.beta, w])
    ry, rgrads = reference(
        x, tf.convert_to_tensor(rsign.beta), tf.convert_to_tensor(w), estimator, clip
    )
    # (approx_sign inputs keep e'(t) in 16-bit fixed point: within the tolerance)
    assert_close(y, ry, what="forward")
    for name, ours, ref in zip(["dx", "dbeta", "dw"], grads, rgrads):
        assert_close(ours, ref, what=name)


def _binary_op_estimators(graph):
    return [
        op.get_attr("activation_estimator").decode()
        for op in graph.get_operations()
        if op.type == "TapehookBinaryConv2D"
    ]


def test_the_conv_binarizes_the_shifted_input():
    """The graph's binary conv takes RSign's estimator: the fold happened."""
    x, w, rsign = _setup("approx_sign", 1.0)
    graph = tf.function(_step).get_concrete_function(x, w, rsign).graph
    assert _binary_op_estimators(graph) == ["approx_sign"]


def test_no_fold_where_the_conv_would_change_the_gradient():
    """A conv whose own input estimator would not pass +-1 through (approx_sign
    has e'(+-1) = 0) keeps RSign's sign as its input, as written."""
    x, w, rsign = _setup("ste_sign", 1.0)
    tapehook.mark_binary(w, activations="approx_sign", scale="mean_abs")
    graph = tf.function(_step).get_concrete_function(x, w, rsign).graph
    assert _binary_op_estimators(graph) == ["approx_sign"]
    _, grads = tf.function(_step)(x, w, rsign)
    assert float(tf.reduce_max(tf.abs(grads[1]))) == 0.0  # e'(+-1) = 0, as without the fold


def test_keras_fit_folds_and_trains():
    inputs = keras.Input(SHAPE[1:])
    h = recipes.RSign(estimator="approx_sign")(inputs)
    h = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="binary")(h)
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(h)))
    tapehook.binarize(model, include="binary", activations=True, scale="mean_abs")
    x = np.random.default_rng(1).normal(size=(16, *SHAPE[1:])).astype("float32")

    @tf.function
    def logits(x):
        return model(x, training=True)

    graph = logits.get_concrete_function(tf.constant(x)).graph
    assert _binary_op_estimators(graph) == ["approx_sign"]
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    tapehook.reset_dispatch_counts()
    model.fit(x, np.arange(16) % 3, batch_size=8, epochs=1, verbose=0)
    counts = tapehook.dispatch_counts()
    # dX of the shifted input, for beta's gradient
    assert counts["compiled"]["backprop_input"] == counts["compiled"]["backprop_filter"] == 2
    assert counts["reference"] == dict(forward=0, backprop_input=0, backprop_filter=0)
    beta = model.layers[1].beta.numpy()
    assert np.all(beta != 0)  # dbeta reached RSign through the fold
