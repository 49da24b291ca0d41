"""tapehook.layers.MaxPooling2D against Keras 3's MaxPooling2D (stock
MaxPool / MaxPoolGrad: the independent reference): outputs and gradients
bit for bit, ties included, in eager, tf.function, tf.gradients, Keras fit
and MirroredStrategy; that a training graph's backward keeps the argmax
indices, not the pool's float input or output; where it runs Keras's layer."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tapehook
from tapehook import compat, kernels, layers
from tapehook.layers import MaxPooling2D

from conftest import TIERS, fit_mirrored, run_in_tier

POOLS = {
    "stem_3x3_s2_same": dict(pool_size=3, strides=2, padding="same"),
    "2x2_s1_valid": dict(pool_size=2, strides=1),  # QuickNet's transition
    "3x2_s2x1_valid": dict(pool_size=(3, 2), strides=(2, 1), padding="valid"),
    "2x2_default_strides": dict(pool_size=2),
}


def _inputs(kind, shape=(3, 11, 10, 6), seed=0):
    """Gaussian values; or with ties: rounded to integers, or ReLU'd (zeros
    fill whole windows)."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    if kind == "rounded":
        x = np.round(x)
    elif kind == "relu":
        x = np.maximum(x, 0.0)
    return tf.constant(x)


def _step(layer, x, mode):
    """Output and input gradient of a loss through ``layer`` (training call)."""

    def step(x):
        if mode == "gradients":
            y = layer(x, training=True)
            return y, tf.gradients(tf.reduce_sum(y * tf.sin(y + 0.3)), x)[0]
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * tf.sin(y + 0.3))
        return y, tape.gradient(loss, x)

    if mode != "eager":
        step = tf.function(step)
    return [t.numpy() for t in step(x)]


@pytest.mark.parametrize("mode", ["eager", "function", "gradients"])
@pytest.mark.parametrize("values", ["gaussian", "rounded", "relu"])
@pytest.mark.parametrize("pool", list(POOLS))
def test_matches_keras_bit_for_bit(pool, values, mode):
    x = _inputs(values)
    got = _step(MaxPooling2D(**POOLS[pool]), x, mode)
    want = _step(keras.layers.MaxPooling2D(**POOLS[pool]), x, mode)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    assert np.any(got[1] != 0)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_second_derivatives_match_keras(mode):
    """A gradient of a gradient through the pool (the incoming gradient
    depends on the input): the stock layer's, bit for bit."""
    x = _inputs("rounded")

    def second(layer):
        def run(x):
            with tf.GradientTape() as outer:
                outer.watch(x)
                with tf.GradientTape() as inner:
                    inner.watch(x)
                    y = layer(x * x, training=True)
                    loss = tf.reduce_sum(y * tf.sin(y))
                g = inner.gradient(loss, x)
                penalty = tf.reduce_sum(g * g)
            return g, outer.gradient(penalty, x)

        return [t.numpy() for t in (tf.function(run) if mode == "function" else run)(x)]

    got = second(MaxPooling2D(3, strides=2, padding="same"))
    want = second(keras.layers.MaxPooling2D(3, strides=2, padding="same"))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert np.any(got[1] != 0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_other_float_dtypes(dtype):
    x = tf.cast(_inputs("rounded"), dtype)
    for mode in ("eager", "function"):
        pool = dict(pool_size=3, strides=2, padding="same", dtype=dtype)
        got = _step(MaxPooling2D(**pool), x, mode)
        want = _step(keras.layers.MaxPooling2D(**pool), x, mode)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype == np.dtype(tf.as_dtype(dtype).as_numpy_dtype)
            np.testing.assert_array_equal(a, b)


def _pool_graph(layer, x):
    """The tf.gradients graph of a training call through ``layer``."""

    @tf.function
    def step(x):
        y = layer(x, training=True)
        return tf.gradients(tf.reduce_sum(y * y), x)[0]

    return step.get_concrete_function(x).graph


def _backward_float_reads(graph, pool_type):
    """Float tensors of the forward pool (its input, its outputs) that an op
    of the backward (the ``gradients`` name scope) reads."""
    pool = [op for op in graph.get_operations() if op.type == pool_type]
    assert len(pool) == 1
    tensors = [t for t in [*pool[0].inputs, *pool[0].outputs] if t.dtype.is_floating]
    return [
        t.name
        for t in tensors
        for reader in t.consumers()
        if reader.name.startswith("gradients/") and reader.type != "Shape"
    ]


def test_backward_keeps_the_argmax_not_the_floats():
    """Stock: MaxPoolGrad reads the pool's input and output. Ours: the
    backward reads neither, only the int32 indices (and the input's shape)."""
    x = _inputs("gaussian", (2, 16, 16, 8))
    stock = _pool_graph(keras.layers.MaxPooling2D(3, strides=2, padding="same"), x)
    assert len(_backward_float_reads(stock, "MaxPool")) >= 2
    graph = _pool_graph(MaxPooling2D(3, strides=2, padding="same"), x)
    pool_type = "TapehookMaxPoolArgmax" if kernels.library() is not None else "MaxPoolWithArgmax"
    assert _backward_float_reads(graph, pool_type) == []
    types = [op.type for op in graph.get_operations()]
    assert "MaxPoolGradWithArgmax" in types and "MaxPoolGrad" not in types
    grad = next(op for op in graph.get_operations() if op.type == "MaxPoolGradWithArgmax")
    kept = grad.inputs[2].op  # the int64 argmax, cast back from the kept int32
    assert kept.type == "Cast" and kept.inputs[0].dtype == tf.int32


def test_inference_xla_and_switched_off_are_keras():
    """Inference calls, XLA-compiled graphs and save_argmax=False run the
    stock MaxPool (and still match Keras's layer)."""
    x = _inputs("gaussian")
    want = _step(keras.layers.MaxPooling2D(3, strides=2, padding="same"), x, "function")
    for layer, jit in (
        (MaxPooling2D(3, strides=2, padding="same", save_argmax=False), False),
        (MaxPooling2D(3, strides=2, padding="same"), True),
    ):

        @tf.function(jit_compile=jit)
        def step(x, layer=layer):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x, training=True)
                loss = tf.reduce_sum(y * tf.sin(y + 0.3))
            return y, tape.gradient(loss, x)

        for a, b in zip(step(x), want):
            np.testing.assert_allclose(a.numpy(), b, rtol=1e-6, atol=1e-6)
        if not jit:
            types = [op.type for op in step.get_concrete_function(x).graph.get_operations()]
            assert "MaxPool" in types and "MaxPoolWithArgmax" not in types
            assert "TapehookMaxPoolArgmax" not in types

    layer = MaxPooling2D(3, strides=2, padding="same")
    infer = tf.function(lambda x: layer(x, training=False))
    types = [op.type for op in infer.get_concrete_function(x).graph.get_operations()]
    assert "MaxPool" in types and "MaxPoolWithArgmax" not in types
    np.testing.assert_array_equal(infer(x).numpy(), want[0])


def _small_model(pool):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((12, 12, 3))
    x = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    x = pool(3, strides=2, padding="same")(x)
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(x))


def _data():
    rng = np.random.default_rng(5)
    return rng.standard_normal((8, 12, 12, 3)).astype(np.float32), rng.integers(0, 3, 8)


def test_fit_matches_keras_and_saves(tmp_path, monkeypatch):
    """Keras fit (two SGD steps) runs the argmax pool and ends at the same
    weights as with Keras's layer; the .keras round trip keeps the layer
    and its setting."""
    x, y = _data()
    traced = []
    argmax_pool = layers._max_pool_keeping_argmax
    monkeypatch.setattr(
        layers, "_max_pool_keeping_argmax", lambda *a: traced.append(1) or argmax_pool(*a)
    )
    weights = {}
    for name, pool in (("keras", keras.layers.MaxPooling2D), ("ours", MaxPooling2D)):
        net = _small_model(pool)
        net.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
        net.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        weights[name] = net.get_weights()
    assert traced  # fit's training calls took the argmax path
    # With oneDNN on, TF rewrites fit's MaxPoolGrad to oneDNN's, which adds
    # the gradients of overlapping windows in another order: equal to float
    # rounding there, bit for bit against TF's own kernel.
    exact = not compat.onednn_enabled()
    for a, b in zip(weights["ours"], weights["keras"]):
        if exact:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    path = tmp_path / "net.keras"
    net.save(path)
    loaded = keras.models.load_model(path)
    pool = loaded.layers[2]
    assert type(pool) is MaxPooling2D and pool.save_argmax is True
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), net.predict(x, verbose=0))
    off = MaxPooling2D.from_config(MaxPooling2D(2, save_argmax=False).get_config())
    assert off.save_argmax is False


def mirrored_variants():
    """For tests/helpers/mirrored_fit.py: the small model with each layer."""

    def build(pool):
        net = _small_model(pool)
        net.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
        return net

    return {
        "keras": lambda: build(keras.layers.MaxPooling2D),
        "ours": lambda: build(MaxPooling2D),
    }


@pytest.mark.slow
def test_mirrored_strategy_matches_keras():
    out = fit_mirrored("test_pooling")
    assert len(out["ours"]) == len(out["keras"]) == 6
    for a, b in zip(out["ours"], out["keras"]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_bad_value():
    with pytest.raises(tapehook.TapehookError, match="save_argmax is True or False"):
        MaxPooling2D(2, save_argmax="yes")


_TIER_SCRIPT = """
import sys, numpy as np, tensorflow as tf
from tapehook import kernels
cases = np.load(sys.argv[1], allow_pickle=True)
out = {}
for i, (x, k, s, pad) in enumerate(cases):
    y, a = kernels.library().tapehook_max_pool_argmax(
        tf.constant(x), ksize=[1, *k, 1], strides=[1, *s, 1], padding=pad)
    out[f"y{i}"], out[f"a{i}"] = y.numpy(), a.numpy()
np.savez(sys.argv[2], **out)
"""


@pytest.mark.parametrize("tier", TIERS)
def test_the_argmax_kernel_is_tf_max_pool_with_argmax(tmp_path, tier):
    """tapehook's max pool with argmax (each vector tier and the channel
    tails) gives TF's MaxPoolWithArgmax outputs and indices bit for bit:
    SAME / VALID, square and not, windows beyond the image, ties (rounded
    inputs: the first tap in row-major order wins), NaN and -inf."""
    if kernels.library() is None:
        pytest.skip("compiled kernels not loaded")
    rng = np.random.default_rng(7)
    cases = []
    for shape, k, s, pad in [
        ((2, 13, 11, 37), (3, 3), (2, 2), "SAME"),
        ((1, 12, 12, 16), (2, 2), (2, 2), "VALID"),
        ((2, 9, 10, 5), (3, 2), (1, 2), "SAME"),
        ((1, 7, 8, 23), (4, 4), (3, 3), "SAME"),
        ((3, 5, 5, 8), (5, 5), (1, 1), "VALID"),
        ((1, 6, 6, 1), (1, 1), (2, 2), "SAME"),
    ]:
        x = np.round(rng.normal(size=shape) * 2).astype(np.float32) / 2
        x.flat[rng.integers(0, x.size, 5)] = np.nan
        x.flat[rng.integers(0, x.size, 5)] = -np.inf
        cases.append((x, k, s, pad))
    np.save(tmp_path / "cases.npy", np.array(cases, dtype=object), allow_pickle=True)
    run_in_tier(tier, _TIER_SCRIPT, tmp_path / "cases.npy", tmp_path / "o.npz")
    out = np.load(tmp_path / "o.npz")
    for i, (x, k, s, pad) in enumerate(cases):
        y, a = tf.nn.max_pool_with_argmax(x, k, s, pad, include_batch_in_index=False)
        np.testing.assert_array_equal(out[f"y{i}"], y.numpy(), err_msg=f"case {i}")
        np.testing.assert_array_equal(out[f"a{i}"], a.numpy(), err_msg=f"case {i}")
