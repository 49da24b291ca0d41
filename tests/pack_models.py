"""Shared by the tests of TAPEHOOK_PACK_INPUTS's settings (test_pack_fixed16,
test_pack_float16): a small Keras model with one approx_sign binary conv
fitted under a setting, and the stock route's check."""

import os

import keras
import numpy as np
import tensorflow as tf

import tapehook
from tapehook import dispatch, reference

from conftest import random_inputs, reference_result, run_mode, upstream


def conv(x, w):
    return tf.nn.conv2d(x, w, [1, 2, 1, 1] if x.shape[1] == 9 else 1, "SAME")


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 8, 8, 4)).astype(np.float32), rng.integers(0, 3, 16)


def compiled_model(pack_mode):
    """A float stem, one approx_sign binary conv, a head; SGD. Sets
    TAPEHOOK_PACK_INPUTS, which the binary conv reads when fit traces it."""
    os.environ["TAPEHOOK_PACK_INPUTS"] = pack_mode
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8, 8, 4))
    h = keras.layers.Conv2D(8, 3, padding="same", name="float_stem")(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="binary1")(h)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    tapehook.binarize(model, include="binary*", activations="approx_sign", scale="mean_abs")
    model.compile(
        keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def mirrored_variants(modes):
    """For tests/helpers/mirrored_fit.py: the model under each setting."""
    return {mode: lambda mode=mode: compiled_model(mode) for mode in modes}


def fit_weights(monkeypatch, pack_mode):
    """(losses, trainable weights) after fitting the model 2 epochs of 2
    steps under ``pack_mode``."""
    monkeypatch.setenv("TAPEHOOK_PACK_INPUTS", pack_mode)  # restored after the test
    model = compiled_model(pack_mode)
    images, labels = data()
    history = model.fit(images, labels, batch_size=8, epochs=2, verbose=0, shuffle=False)
    return history.history["loss"], [v.numpy() for v in model.trainable_variables]


def stock_route_gradients(monkeypatch, mode):
    """(x, w0, g, dx, dw) of an approx_sign conv whose backprops the
    dispatcher sends to stock ops (the forward on the kernels): the reference
    backward on the unpacked signs with the kept e'(x) as the mask."""

    monkeypatch.setattr(dispatch, "backprop_path", lambda *a, **k: dispatch.STOCK)
    x, w0 = random_inputs((2, 6, 6, 5), (3, 3, 5, 4))
    spec = tapehook.BinarySpec(activations="approx_sign")
    g = upstream((2, 6, 6, 4), tf.float32).numpy()
    tapehook.reset_dispatch_counts()
    _, dx, dw = run_mode(
        mode, x, w0, g, conv, prepare=lambda w: tapehook.mark_binary(w, **spec.to_config())
    )
    counts = tapehook.dispatch_counts()
    assert counts["reference"]["backprop_input"] == 1 and counts["compiled"]["forward"] == 1
    return x, w0, g, dx, dw


def references(x, w0, spec, g, strides, masks):
    """The reference's (dx exact, dw exact) of a SAME conv, loss sum(y * g),
    followed by its dx with e'(x) replaced by each of ``masks`` (float32
    arrays shaped like x): the kept derivative's effect, computed by the
    reference backward on sign(x)."""
    x = tf.constant(x)
    _, dx_exact, dw = [
        t.numpy()
        for t in reference_result(x, tf.constant(w0), spec, tf.constant(g), strides=strides)
    ]
    masked = []
    for mask in masks:
        dx, _ = reference.binary_conv2d_backward(
            reference.sign(x),
            tf.constant(w0),
            tf.constant(g),
            spec,
            strides,
            "SAME",
            [],
            [1, 1, 1, 1],
            need_dx=True,
            need_dw=False,
            input_mask=tf.constant(mask),
        )
        masked.append(dx.numpy())
    return dx_exact, dw, *masked


def assert_near_float32(got, float32, rtol, atol):
    """Weights trained under a setting within (rtol, atol) of those trained
    keeping float32 x, and not equal to them (the setting took effect)."""
    assert len(got) == len(float32) > 0
    for a, b in zip(got, float32):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
    assert any(not np.array_equal(a, b) for a, b in zip(got, float32))


def assert_fit_near_float32(monkeypatch, setting, rtol, atol):
    """Keras fit of the model, 4 SGD steps, under ``setting`` against
    ``float32``: losses within rtol, weights as assert_near_float32, the
    binary conv's dX on the kernels."""
    loss32, weights32 = fit_weights(monkeypatch, "float32")
    tapehook.reset_dispatch_counts()
    loss, weights = fit_weights(monkeypatch, setting)
    assert tapehook.dispatch_counts()["compiled"]["backprop_input"] >= 4
    np.testing.assert_allclose(loss, loss32, rtol=rtol)
    assert_near_float32(weights, weights32, rtol, atol)


GRADIENT_SHAPES = {"stride2": (2, 9, 9, 12), "odd_ch": (3, 6, 6, 5)}


def gradients_in_mode(mode, estimator, shape):
    """(x, w0, spec, g, strides, dx, dw) of a mean_abs binary conv with
    ``estimator`` inputs, 7 output channels (stride 2 for 9x9 inputs), run
    through tapehook in execution ``mode``; its dX ran on the kernels."""
    x, w0 = random_inputs(shape, (3, 3, shape[-1], 7))
    x = x.numpy() * 0.7  # most |x| < 1: e'(x) mostly nonzero
    w0 = w0.numpy()
    spec = tapehook.BinarySpec(activations=estimator, scale="mean_abs")
    strides = [1, 2, 1, 1] if shape[1] == 9 else [1, 1, 1, 1]
    g = upstream(conv(tf.constant(x), tf.constant(w0)).shape, tf.float32).numpy()
    tapehook.reset_dispatch_counts()
    _, dx, dw = run_mode(
        mode, x, w0, g, conv, prepare=lambda w: tapehook.mark_binary(w, **spec.to_config())
    )
    counts = tapehook.dispatch_counts()
    assert counts["reference"]["backprop_input"] == 0, counts
    return x, w0, spec, g, strides, np.asarray(dx), dw
