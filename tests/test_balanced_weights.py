"""BinarySpec(balance=...): IR-Net's balanced weights inside the binary ops.

The reference is written here in NumPy: B = W - mean(W) (balance "mean") or
(W - mean(W)) / sqrt(var(W) + eps) ("std") per output channel; the conv is
the reference binary conv of B, and W's gradient is the balancing's own
Jacobian (transposed) applied to B's gradient:
"mean": g - mean(g); "std": (g - mean(g) - B * mean(g * B)) / sqrt(var + eps).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tapehook
from tapehook import recipes
from tapehook.errors import TapehookError

from conftest import MODE_NAMES, assert_close, random_inputs, reference_result, run_mode, upstream

EPS = 1e-12
X_SHAPE, W_SHAPE = (2, 7, 6, 3), (3, 3, 3, 5)


def np_balance(w, balance, output_axes=1):
    w = np.asarray(w, np.float64)
    axes = tuple(range(w.ndim - output_axes))
    centred = w - w.mean(axis=axes, keepdims=True)
    if balance == "mean":
        return centred, None
    deviation = np.sqrt((centred**2).mean(axis=axes, keepdims=True) + EPS)
    return centred / deviation, deviation


def np_balance_grad(g_balanced, balanced, deviation, balance, output_axes=1):
    g = np.asarray(g_balanced, np.float64)
    axes = tuple(range(g.ndim - output_axes))
    centred_g = g - g.mean(axis=axes, keepdims=True)
    if balance == "mean":
        return centred_g
    return (centred_g - balanced * (g * balanced).mean(axis=axes, keepdims=True)) / deviation


def test_spec_checks():
    assert tapehook.BinarySpec(balance="std").unbalanced() == tapehook.BinarySpec()
    with pytest.raises(TapehookError, match="'mean'.*'std'"):
        tapehook.BinarySpec(balance="l2")
    with pytest.raises(TapehookError, match="weights=False"):
        tapehook.BinarySpec(activations=True, weights=False, balance="mean")


@pytest.mark.parametrize("balance", ["mean", "std"])
@pytest.mark.parametrize("mode", MODE_NAMES)
def test_conv2d_matches_numpy_reference(mode, balance):
    spec = tapehook.BinarySpec(activations=True, scale="mean_abs", clip=1.3, balance=balance)
    x, w0 = random_inputs(X_SHAPE, W_SHAPE, seed=3)
    w0 = w0 + 0.4  # an offset per channel the balancing removes
    g = upstream((2, 4, 3, 5), tf.float32)
    conv = {"strides": 2, "padding": "SAME"}
    tapehook.reset_dispatch_counts()
    y, dx, dw = run_mode(
        mode,
        x,
        w0,
        g,
        lambda x, w: tf.nn.conv2d(x, w, **conv),
        prepare=lambda w: tapehook.mark_binary(w, **spec.to_config()),
    )
    balanced, deviation = np_balance(w0, balance)
    ry, rdx, rdb = reference_result(
        x, tf.constant(balanced, tf.float32), spec.unbalanced(), g, strides=[1, 2, 2, 1]
    )
    assert_close(y, ry, what="forward")
    assert_close(dx, rdx, what="dX")
    assert_close(dw, np_balance_grad(rdb, balanced, deviation, balance), what="dW")
    if mode not in ("v1_gradients", "v1_tape"):  # (graph-mode counts are taken when traced)
        assert tapehook.dispatch_counts()["reference"]["forward"] == 0


def test_balancing_changes_the_signs():
    """The option is not a no-op: W with a per-channel offset binarizes to
    other signs balanced than raw."""
    x, w0 = random_inputs(X_SHAPE, W_SHAPE, seed=4)
    w = tf.Variable(w0 + 0.5)
    raw = tf.Variable(w0 + 0.5)
    tapehook.mark_binary(w, activations=True, balance="mean")
    tapehook.mark_binary(raw, activations=True)
    y, y_raw = tf.nn.conv2d(x, w, 1, "SAME"), tf.nn.conv2d(x, raw, 1, "SAME")
    assert np.max(np.abs(y - y_raw)) > 1.0


def _layer_model(layer, input_shape):
    inputs = keras.Input(input_shape)
    model = keras.Model(inputs, layer(inputs))
    tapehook.binarize(model, activations=True, scale="mean_abs", balance="std")
    return model


@pytest.mark.parametrize(
    "kind,input_shape",
    [("dense", (6,)), ("depthwise", (5, 5, 3)), ("conv1d", (7, 3)), ("conv2d", (5, 5, 3))],
)
def test_keras_layers_forward_and_gradient(kind, input_shape):
    """Dense, DepthwiseConv2D, Conv1D and Conv2D (Keras, binarized) against
    stock TF ops on NumPy's balanced alpha * sign(B), and W's gradient
    against the Jacobian formula applied to the stock gradient of B_hat
    times the straight-through mask."""
    rng = np.random.default_rng(5)
    make = {
        "dense": lambda: keras.layers.Dense(4, use_bias=False),
        "depthwise": lambda: keras.layers.DepthwiseConv2D(3, depth_multiplier=2, use_bias=False),
        "conv1d": lambda: keras.layers.Conv1D(4, 3, use_bias=False),
        "conv2d": lambda: keras.layers.Conv2D(4, 3, use_bias=False),
    }[kind]
    layer = make()
    model = _layer_model(layer, input_shape)
    kernel = layer.kernel
    w0 = rng.normal(size=kernel.shape) + 0.3
    kernel.assign(w0)
    x = tf.constant(rng.normal(size=(2, *input_shape)), tf.float32)
    with tf.GradientTape() as tape:
        y = model(x)
        loss = tf.reduce_sum(y * y)
    dw = tape.gradient(loss, kernel)

    out_axes = 2 if kind == "depthwise" else 1
    balanced, deviation = np_balance(w0, "std", out_axes)
    axes = tuple(range(balanced.ndim - out_axes))
    alpha = np.abs(balanced).mean(axis=axes, keepdims=True)
    w_hat = tf.constant(np.where(balanced >= 0, 1.0, -1.0) * alpha, tf.float32)
    x_hat = tf.where(x >= 0, 1.0, -1.0)
    with tf.GradientTape() as tape:
        tape.watch(w_hat)  # an unmarked tensor: stock ops
        ry = {
            "dense": lambda: tf.matmul(x_hat, w_hat),
            "depthwise": lambda: tf.nn.depthwise_conv2d(x_hat, w_hat, [1, 1, 1, 1], "VALID"),
            "conv1d": lambda: tf.nn.conv1d(x_hat, w_hat, 1, "VALID"),
            "conv2d": lambda: tf.nn.conv2d(x_hat, w_hat, 1, "VALID"),
        }[kind]()
        rloss = tf.reduce_sum(ry * ry)
    g_hat = tape.gradient(rloss, w_hat).numpy()
    g_balanced = g_hat * alpha * (np.abs(balanced) <= 1.0)  # ste_sign, clip 1, alpha constant
    assert_close(y, ry, what="forward")
    assert_close(dw, np_balance_grad(g_balanced, balanced, deviation, "std", out_axes), what="dW")


def _conv_net(balance="std"):
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", name="stem")(inputs)
    h = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="binary_a")(h)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="binary_b")(h)
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inputs, outputs)
    tapehook.binarize(model, include="binary*", activations=True, scale="mean_abs", balance=balance)
    return model


def _data(n=16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8, 8, 3)).astype("float32"), rng.integers(0, 3, n)


def _fit_on_kernels(model):
    """One epoch of fit; returns the compiled counts after checking that the
    binary convs ran there (forward and dW) and never on the reference path."""
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data()
    tapehook.reset_dispatch_counts()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    counts = tapehook.dispatch_counts()
    assert counts["compiled"]["forward"] >= 2 and counts["compiled"]["backprop_filter"] >= 2
    assert counts["reference"] == dict(forward=0, backprop_input=0, backprop_filter=0)
    return counts["compiled"]


def test_fit_runs_compiled_and_keras_file_keeps_balance(tmp_path):
    model = _conv_net()
    _fit_on_kernels(model)
    x, _ = _data()
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    spec = tapehook.binary_spec_of(loaded.get_layer("binary_a").kernel)
    assert spec is not None and spec.balance == "std"
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


def _offset_kernels(model):
    """Kernels with a per-channel offset, so balanced and raw signs differ."""
    rng = np.random.default_rng(7)
    for name in ("binary_a", "binary_b"):
        kernel = model.get_layer(name).kernel
        kernel.assign(rng.normal(size=kernel.shape) * 0.3 + rng.normal(size=kernel.shape[-1]))


def test_litert_export_and_bitpacked_equal_predict(tmp_path):
    model = _conv_net()
    _offset_kernels(model)
    x, _ = _data(4, seed=1)
    expected = model.predict(x, verbose=0)
    raw = _conv_net(balance=None)
    raw.set_weights(model.get_weights())
    assert np.max(np.abs(raw.predict(x, verbose=0) - expected)) > 1e-3  # balancing matters

    tapehook.export_tflite(model, str(tmp_path / "m.tflite"), target="litert")
    out = tapehook.deploy.run_tflite(str(tmp_path / "m.tflite"), x, target="litert")
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)

    tapehook.export_bitpacked(model, str(tmp_path / "m.thbits"))
    fresh = _conv_net()
    tapehook.load_bitpacked(fresh, str(tmp_path / "m.thbits"))
    assert tapehook.binary_spec_of(fresh.get_layer("binary_a").kernel).balance is None
    np.testing.assert_allclose(fresh.predict(x, verbose=0), expected, rtol=1e-5, atol=1e-5)


def test_rsign_and_balanced_weights_stay_on_the_kernels():
    """ReActNet / IR-Net's pieces together: an RSign in front of a conv with
    balanced weights trains on tapehook's kernels, and RSign's beta learns."""
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", name="stem")(inputs)
    h = recipes.RSign(estimator="approx_sign")(h)
    h = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="binary")(h)
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inputs, outputs)
    tapehook.binarize(model, include="binary", activations=True, scale="mean_abs", balance="std")
    assert _fit_on_kernels(model)["backprop_input"] >= 2
    beta = [w for w in model.weights if w.path.endswith("beta")][0]
    assert np.any(beta.numpy() != 0)


def _balance_attrs(model, x):
    """The balance attr of each binary conv in the model's inference graph."""
    graph = tf.function(lambda t: model(t, training=False)).get_concrete_function(x).graph
    return sorted(
        {
            op.get_attr("balance").decode()
            for op in graph.get_operations()
            if op.type.startswith("TapehookBinaryConv2D")
        }
    )


@pytest.mark.parametrize("balance", ["mean", "std"])
def test_inference_balances_the_kept_filter(balance):
    """predict (no tape) gives the op W itself and its balance: the op
    balances W as it packs the filter it keeps. Its outputs equal the
    NumPy-balanced kernels' conv, computed under a tape (where TF ops
    balance W), and follow a new W (the kept filter is W's buffer's)."""
    model = _conv_net(balance)
    _offset_kernels(model)
    x, _ = _data(4, seed=2)
    assert _balance_attrs(model, tf.constant(x)) == [balance]
    for _ in range(2):
        with tf.GradientTape():  # recording: TF ops balance W
            taped = model(x, training=False)
        assert_close(model.predict(x, verbose=0), taped, what="predict")
        assert_close(model(x, training=False), taped, what="eager inference")
        raw = _conv_net(balance=None)  # the reference: NumPy-balanced kernels
        raw.set_weights(model.get_weights())
        for name in ("binary_a", "binary_b"):
            kernel = model.get_layer(name).kernel.numpy()
            raw.get_layer(name).kernel.assign(np_balance(kernel, balance)[0].astype("float32"))
        assert_close(model.predict(x, verbose=0), raw.predict(x, verbose=0), what="vs NumPy")
        _offset_kernels(model)  # new values, new buffers
        model.get_layer("binary_a").kernel.assign_add(tf.ones([3, 3, 8, 8]) * 0.5)


def test_balance_attr_needs_the_kept_fully_binary_forward():
    lib = tapehook.kernels.library()
    if lib is None:
        pytest.skip("compiled kernels not loaded")
    x, w = tf.ones([1, 5, 5, 8]), tf.ones([3, 3, 8, 4])
    attrs = dict(strides=[1, 1, 1, 1], padding="SAME", balance="std")
    with pytest.raises(tf.errors.InvalidArgumentError, match="balance runs in the fully binary"):
        lib.tapehook_binary_conv2d(x, w, activation_estimator="ste_sign", **attrs)
    with pytest.raises(tf.errors.InvalidArgumentError, match="balance runs in the fully binary"):
        lib.tapehook_binary_conv2d(x, w, cache_filter=True, **attrs)
