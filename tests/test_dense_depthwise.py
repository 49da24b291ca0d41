"""Binary Dense (MatMul / BatchMatMul) and DepthwiseConv2dNative through the
same marks, scopes and decorator, in eager and graph modes, against the math
written out independently here (NumPy for Dense, stock TF ops for depthwise)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tapehook

from conftest import (
    SPEC_IDS,
    SPECS,
    assert_close,
    np_estimator_grad,
    np_sign,
    run_mode,
    spec_kwargs,
)

GRAPH_MODES = ["eager", "tape_in_function", "function_under_tape", "v1_gradients"]


def _run(mode, x, w0, g, op, mark):
    """(y, dx, dw) of loss = sum(op(x, w) * g) in one of conftest's modes."""
    return run_mode(mode, x, w0, g, op, prepare=mark, loss=lambda y, g: tf.reduce_sum(y * g))


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("mode", GRAPH_MODES)
@pytest.mark.parametrize("rank", [2, 3])
def test_dense_matches_written_out_math(mode, spec, rank):
    rng = np.random.default_rng(rank)
    x = (rng.normal(size=(3, 4, 7) if rank == 3 else (5, 7)) * 1.2).astype(np.float64)
    w0 = rng.normal(size=(7, 6)).astype(np.float64)
    g = rng.normal(size=x.shape[:-1] + (6,))
    y, dx, dw = _run(
        mode, x, w0, g, tf.matmul, lambda w: tapehook.mark_binary(w, **spec_kwargs(spec))
    )
    act = spec.activation_estimator
    x_hat = np_sign(x) if act else x
    alpha = np.abs(w0).mean(axis=0) if spec.scale else np.ones(6)
    w_hat = np_sign(w0) * alpha
    assert_close(y, x_hat @ w_hat, tf.float64, "forward")
    ex_dx = (g @ w_hat.T) * (np_estimator_grad(act, x, spec.clip) if act else 1)
    assert_close(dx, ex_dx, tf.float64, "dX")
    ex_dw = (
        x_hat.reshape(-1, 7).T
        @ g.reshape(-1, 6)
        * alpha
        * np_estimator_grad(spec.ste, w0, spec.clip)
    )
    assert_close(dw, ex_dw, tf.float64, "dW")
    if mode == "eager":
        assert tapehook.dispatch_counts()["reference"]["backprop_filter"] == 1


def _depthwise_expected(x, w0, g, spec, strides, padding):
    act = spec.activation_estimator
    x_hat = tf.constant(np_sign(x) if act else x)
    alpha = np.abs(w0).mean(axis=(0, 1)) if spec.scale else np.ones(w0.shape[2:])
    w_hat = tf.constant(np_sign(w0) * alpha)
    with tf.GradientTape() as tape:
        tape.watch([x_hat, w_hat])
        y = tf.nn.depthwise_conv2d(x_hat, w_hat, strides, padding)
        loss = tf.reduce_sum(y * g)
    dx, dw_hat = tape.gradient(loss, [x_hat, w_hat])
    dx = dx * (np_estimator_grad(act, x, spec.clip) if act else 1)
    return y, dx, dw_hat * alpha * np_estimator_grad(spec.ste, w0, spec.clip)


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_depthwise_matches_stock_ops_on_binarized_operands(mode, spec):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 7, 6, 3)) * 1.2
    w0 = rng.normal(size=(3, 3, 3, 2))
    strides, padding = [1, 2, 2, 1], "SAME"
    g = rng.normal(size=(2, 4, 3, 6))
    op = lambda x, w: tf.nn.depthwise_conv2d(x, w, strides, padding)  # noqa: E731
    y, dx, dw = _run(mode, x, w0, g, op, lambda w: tapehook.mark_binary(w, **spec_kwargs(spec)))
    ey, edx, edw = _depthwise_expected(x, w0, g, spec, strides, padding)
    assert_close(y, ey, tf.float64, "forward")
    assert_close(dx, edx, tf.float64, "dX")
    assert_close(dw, edw, tf.float64, "dW")


def test_unmarked_matmul_and_depthwise_are_stock():
    a = tf.random.normal([4, 5], seed=1)
    b = tf.Variable(tf.random.normal([5, 3], seed=2))
    np.testing.assert_array_equal(
        tf.matmul(a, b), tf.raw_ops.MatMul(a=a, b=tf.convert_to_tensor(b))
    )
    assert tapehook.dispatch_counts()["reference"]["forward"] == 0


def test_marked_kernel_on_the_left_or_transposed_is_an_error():
    w = tapehook.mark_binary(tf.Variable(tf.ones([3, 3])))
    with pytest.raises(tapehook.TapehookError, match="left operand"):
        tf.matmul(w, tf.ones([3, 2]))
    with pytest.raises(tapehook.TapehookError, match="without transposes"):
        tf.matmul(tf.ones([2, 3]), w, transpose_b=True)


def test_keras_model_with_dense_and_depthwise(tmp_path):
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, padding="same", name="stem")(inputs)
    h = keras.layers.DepthwiseConv2D(3, padding="same", depth_multiplier=2, name="dw")(h)
    h = keras.layers.Dense(5, name="mid")(keras.layers.Flatten()(h))
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(h))
    tapehook.binarize(model, first_and_last_float=True, scale="mean_abs", activations=True)
    binary = [
        l.name
        for l in model.layers
        if getattr(l, "kernel", None) is not None and tapehook.binary_spec_of(l.kernel)
    ]
    assert binary == ["dw", "mid"]
    x = np.random.default_rng(0).normal(size=(4, 8, 8, 3)).astype("float32")
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, np.zeros((4, 3), "float32"), epochs=1, verbose=0)
    counts = tapehook.dispatch_counts()["reference"]
    assert counts["forward"] >= 2 and counts["backprop_filter"] >= 2
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert [
        l.name
        for l in loaded.layers
        if getattr(l, "kernel", None) is not None and tapehook.binary_spec_of(l.kernel)
    ] == ["dw", "mid"]
    np.testing.assert_array_equal(loaded(x), model(x))
    report = tapehook.export_bitpacked(model, tmp_path / "m.thbits")
    assert report["binary_kernels"] == 2
    fresh = keras.models.clone_model(model)
    tapehook.load_bitpacked(fresh, tmp_path / "m.thbits")
    for layer in ("dw", "mid"):
        w = fresh.get_layer(layer).kernel.numpy()
        original = model.get_layer(layer).kernel.numpy()
        axes = (0, 1) if layer == "dw" else (0,)
        np.testing.assert_array_equal(np.sign(w) >= 0, original >= 0)
        np.testing.assert_allclose(
            np.abs(w).mean(axis=axes), np.abs(original).mean(axis=axes), rtol=2e-5
        )
    assert_close(fresh(x), model(x), what="bitpacked round trip")


def test_dense_dtype_mismatch_names_the_fix():
    w = tapehook.mark_binary(tf.Variable(tf.ones([3, 2])))
    with pytest.raises(tapehook.TapehookError, match="binary Dense input has dtype float64"):
        tf.matmul(tf.ones([4, 3], tf.float64), w)
