"""The recipe knobs of BinarySpec (issue #17) against NumPy loops, in every
execution mode and on every dispatch path: pad_value (one-padding), weights=False
(the BAN stage), swish_sign's beta, a separate activation_clip, clip=None."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tapehook

from conftest import MODE_NAMES, assert_close, np_estimator_grad, np_sign, run_mode, spec_kwargs
from test_reference import numpy_binary_conv

RECIPES = {
    "pad1": tapehook.BinarySpec(pad_value=1.0),
    "pad1_act": tapehook.BinarySpec(activations=True, pad_value=1.0, scale="mean_abs"),
    "pad1_bireal": tapehook.BinarySpec(activations="approx_sign", pad_value=1.0),
    "ban": tapehook.BinarySpec(activations=True, weights=False),
    "ban_pad1": tapehook.BinarySpec(activations="swish_sign", weights=False, pad_value=1.0),
    "beta2": tapehook.BinarySpec(activations=True, ste="swish_sign", beta=2.0),
    "act_clip": tapehook.BinarySpec(activations=True, clip=1.5, activation_clip=0.5),
    "no_clip": tapehook.BinarySpec(activations=True, clip=None),
    "no_act_clip": tapehook.BinarySpec(activations=True, clip=0.7, activation_clip=None),
}

# (strides, padding as tf.nn.conv2d takes it, (top, bottom, left, right), dilation)
GEOMETRIES = {
    "same": (1, "SAME", (1, 1, 1, 1), 1),
    "same_s2": (2, "SAME", (1, 1, 0, 1), 1),
    "explicit": (1, [[0, 0], [2, 0], [1, 3], [0, 0]], (2, 0, 1, 3), 1),
    "same_dil2": (1, "SAME", (2, 2, 2, 2), 2),
}


def _inputs(x_shape, w_shape, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=x_shape) * 1.2
    x[rng.random(x_shape) < 0.05] = 0.0
    return x, rng.normal(size=w_shape) * 0.8


@pytest.mark.parametrize("path", ["kernels", "auto", "stock"])
@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_conv2d_recipes_match_numpy(recipe, geometry, path, monkeypatch):
    monkeypatch.setenv("TAPEHOOK_DISPATCH", path)
    spec = RECIPES[recipe]
    stride, padding, pads, dil = GEOMETRIES[geometry]
    x, w0 = _inputs((2, 7, 6, 5), (3, 3, 5, 4))
    pt, pb, pl, pr = pads
    y_shape = (
        2,
        (7 + pt + pb - 2 * dil - 1) // stride + 1,
        (6 + pl + pr - 2 * dil - 1) // stride + 1,
        4,
    )
    g = np.random.default_rng(2).normal(size=y_shape)
    ey, edx, edw = numpy_binary_conv(x, w0, g, spec, stride, pads, dil)
    for mode in ("eager", "tape_in_function", "v1_gradients"):
        y, dx, dw = run_mode(
            mode,
            x,
            w0,
            g,
            lambda x, w: tf.nn.conv2d(x, w, stride, padding, dilations=dil),
            prepare=lambda w: tapehook.mark_binary(w, **spec_kwargs(spec)),
            loss=lambda y, g: tf.reduce_sum(y * g),
        )
        assert_close(y, ey, tf.float64, f"{mode} forward")
        assert_close(dx, edx, tf.float64, f"{mode} dX")
        assert_close(dw, edw, tf.float64, f"{mode} dW")


@pytest.mark.parametrize("mode", MODE_NAMES)
@pytest.mark.parametrize("recipe", ["pad1_act", "ban_pad1", "beta2", "no_act_clip"])
def test_recipes_in_every_mode(mode, recipe):
    spec = RECIPES[recipe]
    x, w0 = _inputs((1, 6, 5, 3), (3, 3, 3, 2), seed=3)
    g = np.random.default_rng(4).normal(size=(1, 6, 5, 2))
    y, dx, dw = run_mode(
        mode,
        x,
        w0,
        g,
        lambda x, w: tf.nn.conv2d(x, w, 1, "SAME"),
        prepare=lambda w: tapehook.mark_binary(w, **spec_kwargs(spec)),
        loss=lambda y, g: tf.reduce_sum(y * g),
    )
    ey, edx, edw = numpy_binary_conv(x, w0, g, spec, 1, (1, 1, 1, 1), 1)
    assert_close(y, ey, tf.float64, "forward")
    assert_close(dx, edx, tf.float64, "dX")
    assert_close(dw, edw, tf.float64, "dW")


def test_one_padding_example():
    """x = -1, W = +1, one-padded 3x3: corners see 5 padded taps of +1."""
    w = tapehook.mark_binary(tf.Variable(tf.ones([3, 3, 1, 1])), activations=True, pad_value=1.0)
    y = tf.nn.conv2d(-tf.ones([1, 4, 4, 1]), w, 1, "SAME")
    np.testing.assert_array_equal(y[0, 0, :, 0], [1, -3, -3, 1])


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_dense_depthwise_conv1d_recipes(recipe):
    """The same knobs through Dense, DepthwiseConv2D and Conv1D (eager and
    tf.function), against NumPy."""
    spec = RECIPES[recipe]
    rng = np.random.default_rng(5)
    # Dense: x_hat @ W_hat
    x, w0 = rng.normal(size=(4, 6)), rng.normal(size=(6, 3))
    g = rng.normal(size=(4, 3))
    act = spec.activation_estimator
    x_hat = np_sign(x) if act else x
    alpha = np.abs(w0).mean(axis=0) if spec.scale else np.ones(3)
    w_hat = np_sign(w0) * alpha if spec.weights else w0
    ex_dx = (g @ w_hat.T) * (
        np_estimator_grad(act, x, spec.activation_clip, spec.beta) if act else 1
    )
    ex_dw = x_hat.T @ g
    if spec.weights:
        ex_dw = ex_dw * alpha * np_estimator_grad(spec.ste, w0, spec.clip, spec.beta)
    for mode in ("eager", "tape_in_function"):
        y, dx, dw = run_mode(
            mode,
            x,
            w0,
            g,
            tf.matmul,
            prepare=lambda w: tapehook.mark_binary(w, **spec_kwargs(spec)),
            loss=lambda y, g: tf.reduce_sum(y * g),
        )
        assert_close(y, x_hat @ w_hat, tf.float64, "dense forward")
        assert_close(dx, ex_dx, tf.float64, "dense dX")
        assert_close(dw, ex_dw, tf.float64, "dense dW")
    # Conv1D through tf.nn.conv1d (SAME, dilation 2)
    x, w0 = _inputs((2, 9, 3), (3, 3, 4), seed=6)
    g = rng.normal(size=(2, 9, 4))
    ey, edx, edw = numpy_binary_conv(x[:, None], w0[None], g[:, None], spec, 1, (0, 0, 2, 2), 2)
    for mode in ("eager", "tape_in_function"):
        y, dx, dw = run_mode(
            mode,
            x,
            w0,
            g,
            lambda x, w: tf.nn.conv1d(x, w, 1, "SAME", dilations=2),
            prepare=lambda w: tapehook.mark_binary(w, **spec_kwargs(spec)),
            loss=lambda y, g: tf.reduce_sum(y * g),
        )
        assert_close(y, ey[:, 0], tf.float64, "conv1d forward")
        assert_close(dx, edx[:, 0], tf.float64, "conv1d dX")
        assert_close(dw, edw[0], tf.float64, "conv1d dW")
    # Depthwise, multiplier 1: one single-channel conv per channel
    x, w0 = _inputs((1, 5, 6, 3), (3, 3, 3, 1), seed=7)
    g = rng.normal(size=(1, 5, 6, 3))
    parts = [
        numpy_binary_conv(
            x[..., c : c + 1], w0[:, :, c : c + 1], g[..., c : c + 1], spec, 1, (1, 1, 1, 1), 1
        )
        for c in range(3)
    ]
    for mode in ("eager", "tape_in_function"):
        y, dx, dw = run_mode(
            mode,
            x,
            w0,
            g,
            lambda x, w: tf.nn.depthwise_conv2d(x, w, [1, 1, 1, 1], "SAME"),
            prepare=lambda w: tapehook.mark_binary(w, **spec_kwargs(spec)),
            loss=lambda y, g: tf.reduce_sum(y * g),
        )
        assert_close(y, np.concatenate([p[0] for p in parts], -1), tf.float64, "dw forward")
        assert_close(dx, np.concatenate([p[1] for p in parts], -1), tf.float64, "dw dX")
        assert_close(dw, np.concatenate([p[2] for p in parts], 2), tf.float64, "dw dW")


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(pad_value=0.5), "pad_value must be 0.0"),
        (dict(pad_value=-1.0), "pad_value must be 0.0"),
        (dict(beta=0.0), "beta"),
        (dict(beta=-2), "beta"),
        (dict(clip=-0.5), "clip must be > 0"),
        (dict(activations=True, activation_clip=0), "activation_clip must be"),
        (dict(weights=False), "weights=False keeps the kernel float"),
        (dict(weights="no", activations=True), "weights must be True"),
        (dict(weights=False, activations=True, scale="mean_abs"), "use scale=None"),
    ],
)
def test_bad_recipe_values_name_the_fix(bad, message):
    for make in (
        lambda: tapehook.BinarySpec(**bad),
        lambda: tapehook.mark_binary(tf.Variable(tf.ones([3, 3, 1, 1])), **bad),
        lambda: tapehook.binarize(keras.Sequential([keras.layers.Dense(2)]), **bad),
    ):
        with pytest.raises(tapehook.TapehookError, match=message):
            make()
    with pytest.raises(tapehook.TapehookError, match=message):
        with tapehook.binary_scope(**bad):
            pass


def test_recipe_fields_survive_keras_saving_and_summary(tmp_path):
    spec = tapehook.BinarySpec(
        activations="swish_sign",
        weights=False,
        pad_value=1.0,
        beta=3.0,
        clip=None,
        activation_clip=0.25,
    )
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(4, 3, padding="same", name="binary")(inputs)
    model = keras.Model(inputs, keras.layers.Conv2D(2, 1, name="last")(h))
    tapehook.binarize(model, include="binary", **spec_kwargs(spec))
    x = np.random.default_rng(0).normal(size=(2, 6, 6, 2)).astype(np.float32)
    y = model(x)
    assert tapehook.binary_spec_of(model.get_layer("binary").kernel) == spec
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert tapehook.binary_spec_of(loaded.get_layer("binary").kernel) == spec
    np.testing.assert_array_equal(loaded(x), y)
    lines = []
    tapehook.summary(model, print_fn=lines.append)
    text = "\n".join(lines)
    assert "float-weights" in text and "beta=3" in text and "pad=1" in text
    tapehook.export_bitpacked(model, tmp_path / "m.thbits")
    fresh = keras.models.clone_model(model)
    tapehook.load_bitpacked(fresh, tmp_path / "m.thbits")
    assert tapehook.binary_spec_of(fresh.get_layer("binary").kernel) == spec
    np.testing.assert_array_equal(fresh(x), y)


def test_binarize_again_replaces_the_marks_two_stage():
    """Stage 1 (BAN: float kernels, binary input) then stage 2 (binary)."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(3, 3, padding="same", use_bias=False, name="binary")(inputs)
    model = keras.Model(inputs, h)
    x = np.random.default_rng(0).normal(size=(2, 6, 6, 2)).astype(np.float32)
    w = model.get_layer("binary").kernel
    tapehook.binarize(model, activations=True, weights=False)
    assert tapehook.binary_spec_of(w) == tapehook.BinarySpec(activations=True, weights=False)
    stage1 = model(x)
    expected1, _, _ = numpy_binary_conv(
        x.astype(np.float64),
        w.numpy().astype(np.float64),
        np.zeros((2, 6, 6, 3)),
        tapehook.binary_spec_of(w),
        1,
        (1, 1, 1, 1),
        1,
    )
    assert_close(stage1, expected1, tf.float32, "stage 1")
    assert_close(model.predict(x, verbose=0), expected1, tf.float32, "stage 1 predict")
    tapehook.binarize(model, activations=True)
    assert tapehook.binary_spec_of(w) == tapehook.BinarySpec(activations=True)
    expected2, _, _ = numpy_binary_conv(
        x.astype(np.float64),
        w.numpy().astype(np.float64),
        np.zeros((2, 6, 6, 3)),
        tapehook.binary_spec_of(w),
        1,
        (1, 1, 1, 1),
        1,
    )
    assert_close(model(x), expected2, tf.float32, "stage 2")
