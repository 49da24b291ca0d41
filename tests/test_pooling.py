"""tapehook.layers.MaxPooling2D against Keras 3's MaxPooling2D (stock
MaxPool / MaxPoolGrad: the independent reference): outputs and gradients
bit for bit, ties included, in eager, tf.function, tf.gradients, Keras fit
and MirroredStrategy, also after a ReLU (whose gradient the pool then
computes); that a training graph's backward keeps one byte per output (the
window's tap), not the pool's float input or output nor the ReLU's; where it
runs Keras's layer."""

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
@pytest.mark.parametrize("relu", [False, True])
def test_second_derivatives_match_keras(mode, relu):
    """A gradient of a gradient through the pool (the incoming gradient
    depends on the input), also through a ReLU before it (fuse_relu: fused
    in a graph): the stock layers', bit for bit."""
    x = _inputs("rounded")
    pool = dict(pool_size=2, strides=1) if relu else dict(pool_size=3, strides=2, padding="same")

    def second(layer):
        def run(x):
            with tf.GradientTape() as outer:
                outer.watch(x)
                with tf.GradientTape() as inner:
                    inner.watch(x)
                    y = layer(tf.nn.relu(x * x - 1.0) if relu else x * x, training=True)
                    loss = tf.reduce_sum(y * tf.sin(y))
                g = inner.gradient(loss, x)
                penalty = tf.reduce_sum(g * g)
            return g, outer.gradient(penalty, x)

        return [t.numpy() for t in (tf.function(run) if mode == "function" else run)(x)]

    got = second(MaxPooling2D(**pool, fuse_relu=relu))
    want = second(keras.layers.MaxPooling2D(**pool))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(np.signbit(a), np.signbit(b))
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


def test_backward_keeps_one_byte_not_the_floats():
    """Stock: MaxPoolGrad reads the pool's input and output. Ours: the
    backward reads neither, only the int8 taps (tapehook's kernels) or int32
    indices (TF's MaxPoolWithArgmax), and the input's shape."""
    x = _inputs("gaussian", (2, 16, 16, 8))
    stock = _pool_graph(keras.layers.MaxPooling2D(3, strides=2, padding="same"), x)
    assert len(_backward_float_reads(stock, "MaxPool")) >= 2
    graph = _pool_graph(MaxPooling2D(3, strides=2, padding="same"), x)
    types = [op.type for op in graph.get_operations()]
    assert "MaxPoolGrad" not in types
    if kernels.library() is None:
        assert _backward_float_reads(graph, "MaxPoolWithArgmax") == []
        grad = next(op for op in graph.get_operations() if op.type == "MaxPoolGradWithArgmax")
        kept = grad.inputs[2].op  # the int64 argmax, cast back from the kept int32
        assert kept.type == "Cast" and kept.inputs[0].dtype == tf.int32
        return
    assert _backward_float_reads(graph, "TapehookMaxPoolTaps") == []
    grad = next(op for op in graph.get_operations() if op.type == "TapehookMaxPoolTapsGrad")
    assert grad.inputs[1].dtype == tf.int8 and grad.inputs[1].op.type == "TapehookMaxPoolTaps"


def _relu_pool_graph(relu, pool):
    """A tf.gradients graph through relu then pool (training calls)."""

    @tf.function
    def step(x):
        y = pool(relu(x), training=True)
        return tf.gradients(tf.reduce_sum(y * y), x)[0]

    return step.get_concrete_function(_inputs("gaussian", (2, 16, 16, 8))).graph


def test_after_a_relu_the_backward_keeps_no_float():
    """ReLU then pool: stock keeps the ReLU's output (ReluGrad reads it) and
    MaxPoolGrad's floats; ours with fuse_relu runs no ReluGrad and keeps the
    taps only (without it, the taps and the stock ReluGrad)."""
    if kernels.library() is None:
        pytest.skip("compiled kernels not loaded")
    default = _relu_pool_graph(keras.layers.ReLU(), MaxPooling2D(2, strides=1))
    types = [op.type for op in default.get_operations()]
    assert "ReluGrad" in types and "MaxPoolGrad" not in types
    (taps,) = [op for op in default.get_operations() if op.type == "TapehookMaxPoolTaps"]
    assert taps.get_attr("relu") is False
    pool = MaxPooling2D(2, strides=1, fuse_relu=True)
    graph = _relu_pool_graph(keras.layers.ReLU(), pool)
    types = [op.type for op in graph.get_operations()]
    assert "ReluGrad" not in types and "MaxPoolGrad" not in types
    (taps,) = [op for op in graph.get_operations() if op.type == "TapehookMaxPoolTaps"]
    assert taps.get_attr("relu") is True
    relu = [op for op in graph.get_operations() if op.type == "Relu"]
    assert [
        r.name
        for op in graph.get_operations()
        if op.name.startswith("gradients/")
        for r in relu
        if any(t.op is r for t in op.inputs)
    ] == []
    stock = _relu_pool_graph(keras.layers.ReLU(), keras.layers.MaxPooling2D(2, strides=1))
    assert "ReluGrad" in [op.type for op in stock.get_operations()]
    # Not a ReLU (a BN output, say): a plain pool.
    graph = _relu_pool_graph(tf.nn.relu6, pool)
    (taps,) = [op for op in graph.get_operations() if op.type == "TapehookMaxPoolTaps"]
    assert taps.get_attr("relu") is False


RELUS = {
    "keras_relu": lambda: keras.layers.ReLU(),
    "activation_relu": lambda: keras.layers.Activation("relu"),
    "tf_nn_relu": lambda: tf.nn.relu,
}


@pytest.mark.parametrize("mode", ["eager", "function", "gradients"])
@pytest.mark.parametrize("values", ["gaussian", "rounded"])
@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("relu", list(RELUS))
def test_after_a_relu_matches_keras_bit_for_bit(relu, pool, values, mode):
    """ReLU then pool (QuickNet's transitions): the stock ReLU and pool's
    output and input gradient, bit for bit (zero signs included: ReluGrad
    multiplies by 0, so a negative gradient sum at a dead position is -0.0);
    whole windows of zeros, ties, negative maxima."""
    x = _inputs(values)
    make = RELUS[relu]

    def chain(pool_layer):
        relu_layer = make()

        class Chain:
            def __call__(self, x, training=None):
                # - 0.6: the loss's gradient is negative at dead windows (y = 0)
                return pool_layer(relu_layer(x), training=training) - 0.6

        return Chain()

    got = _step(chain(MaxPooling2D(**POOLS[pool], fuse_relu=True)), x, mode)
    want = _step(chain(keras.layers.MaxPooling2D(**POOLS[pool])), x, mode)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(np.signbit(a), np.signbit(b))
    assert np.any(got[1] != 0) and np.any(np.signbit(got[1]) & (got[1] == 0))


def _relu_grads(x, mode, loss_of):
    """In a tf.function, the gradients of loss_of(r), r = relu(x), with
    respect to x and to r (both watched), by the tape or by tf.gradients
    (mode); None where there is none."""

    @tf.function
    def f(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            r = tf.nn.relu(x)
            tape.watch(r)
            loss = loss_of(r)
        if mode == "gradients":
            return tf.gradients(loss, [x, r])
        return tape.gradient(loss, [x, r])

    return [None if t is None else t.numpy() for t in f(x)]


@pytest.mark.parametrize("mode", ["function", "gradients"])
@pytest.mark.parametrize("reader", ["ops", "pool"])
def test_relu_read_elsewhere_is_stock_bit_for_bit(reader, mode):
    """The ReLU's output also read by other ops (three gradient paths) or a
    second pool: no pool fuses, the pools' gradients go to the ReLU's output
    and the stock ReluGrad adds all of them before its product, as stock
    does (a fused gradient would add after it: other roundings and zero
    signs). Gradients of the ReLU's input and output, bit for bit."""
    x = _inputs("rounded")

    def run(make):
        def loss_of(r):
            y = make(3, strides=2, padding="same")(r, training=True)
            if reader == "ops":
                other = r * tf.cos(r)
            else:
                z = make(2, strides=1)(r, training=True)
                other = z * z
            return tf.reduce_sum(y * tf.sin(y + 0.3)) - tf.reduce_sum(other)

        return _relu_grads(x, mode, loss_of)

    got = run(lambda *a, **k: MaxPooling2D(*a, fuse_relu=True, **k))
    want = run(keras.layers.MaxPooling2D)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(np.signbit(a), np.signbit(b))
    if reader == "ops":  # dead positions whose gradient sum is negative
        assert np.any(np.signbit(got[0]) & (got[0] == 0))


def test_windows_beyond_one_byte_keep_int32_indices():
    """A window of more than 127 taps (12x12) keeps int32 indices (the taps
    would not fit a byte), with the same results."""
    x = _inputs("rounded", (2, 24, 24, 3))
    pool = dict(pool_size=12, strides=6, padding="same")
    for mode in ("function", "gradients"):
        got = _step(MaxPooling2D(**pool), x, mode)
        want = _step(keras.layers.MaxPooling2D(**pool), x, mode)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    graph = _pool_graph(MaxPooling2D(**pool), x)
    types = {op.type for op in graph.get_operations()}
    assert "TapehookMaxPoolTaps" not in types and "MaxPoolGradWithArgmax" in types


def test_tap_ops_reject_bad_shapes():
    """The taps ops' errors name the mismatch (a clear error, not a crash)."""
    library = kernels.library()
    if library is None:
        pytest.skip("compiled kernels not loaded")
    attrs = dict(ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1], padding="VALID")
    x = _inputs("gaussian", (1, 8, 8, 4))
    y, taps = library.tapehook_max_pool_taps(x, **attrs)
    with pytest.raises(tf.errors.InvalidArgumentError, match="the pool's output is"):
        library.tapehook_max_pool_taps_grad(y[:, :3], taps, tf.shape(x), **attrs)
    with pytest.raises(tf.errors.InvalidArgumentError, match="one byte cannot name them"):
        big = dict(ksize=[1, 12, 12, 1], strides=[1, 1, 1, 1], padding="SAME")
        library.tapehook_max_pool_taps(x, **big)
    with pytest.raises(tf.errors.InvalidArgumentError, match="4 values"):
        library.tapehook_max_pool_taps_grad(y, taps, [1, 8, 8], **attrs)
    with pytest.raises(tf.errors.InvalidArgumentError, match="NHWC"):
        library.tapehook_max_pool_taps_gather(x[0], taps, **attrs)
    # Taps beyond their window (4 of a 2x2 window, -5 its dead form) or, in
    # a SAME pool, in the padding: an error, not a write outside dx.
    same = dict(ksize=[1, 3, 3, 1], strides=[1, 2, 2, 1], padding="SAME")
    _, same_taps = library.tapehook_max_pool_taps(x[:, :7, :7], **same)
    for bad, at in ((taps, 4), (taps, -5), (taps, 127), (same_taps, 8)):
        index = (0, bad.shape[1] - 1, bad.shape[2] - 1, 0)
        wrong = tf.tensor_scatter_nd_update(bad, [index], tf.constant([at], tf.int8))
        a = attrs if bad is taps else same
        shape = tf.shape(x) if bad is taps else tf.shape(x[:, :7, :7])
        for relu in (False, True):
            with pytest.raises(tf.errors.InvalidArgumentError, match="outside their window"):
                library.tapehook_max_pool_taps_grad(
                    tf.ones(bad.shape), wrong, shape, relu=relu, **a
                )
            with pytest.raises(tf.errors.InvalidArgumentError, match="outside their window"):
                library.tapehook_max_pool_taps_gather(tf.ones(shape), wrong, relu=relu, **a)


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


@pytest.mark.parametrize("mode", ["function", "gradients"])
def test_gradient_at_the_relu_output(mode):
    """A gradient requested at the ReLU's output itself (the pool its only
    reader): stock's bit for bit by default; with fuse_relu, None, as the
    layer documents (the ReLU's input still gets stock's)."""
    x = _inputs("rounded")

    def run(pool):
        def loss_of(r):
            y = pool(r, training=True)
            return tf.reduce_sum(y * tf.sin(y + 0.3))

        return _relu_grads(x, mode, loss_of)

    want = run(keras.layers.MaxPooling2D(3, strides=2, padding="same"))
    got = run(MaxPooling2D(3, strides=2, padding="same"))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(np.signbit(a), np.signbit(b))
    fused = run(MaxPooling2D(3, strides=2, padding="same", fuse_relu=True))
    np.testing.assert_array_equal(fused[0], want[0])
    if kernels.library() is not None:
        assert fused[1] is None


def _small_model(pool, relu=False):
    """Conv, pool (after a ReLU layer: QuickNet's transitions), conv, dense."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((12, 12, 3))
    x = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    if relu:
        x = keras.layers.Activation("relu")(x)
    x = pool(3, strides=2, padding="same")(x)
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(x))


def _data():
    rng = np.random.default_rng(5)
    return rng.standard_normal((8, 12, 12, 3)).astype(np.float32), rng.integers(0, 3, 8)


@pytest.mark.parametrize("relu", [False, True])
def test_fit_matches_keras_and_saves(tmp_path, monkeypatch, relu):
    """Keras fit (two SGD steps) runs the one-byte pool (after a ReLU layer:
    fused with the ReLU's backward) and ends at the same weights as with
    Keras's layer; the .keras round trip keeps the layer and its setting."""
    x, y = _data()
    traced, fused = [], []
    argmax_pool = layers._max_pool_keeping_argmax
    monkeypatch.setattr(
        layers, "_max_pool_keeping_argmax", lambda *a: traced.append(1) or argmax_pool(*a)
    )
    library = kernels.library()
    if library is not None:
        grad = library.tapehook_max_pool_taps_grad
        monkeypatch.setattr(
            library,
            "tapehook_max_pool_taps_grad",
            lambda *a, relu, **k: fused.append(relu) or grad(*a, relu=relu, **k),
        )
    weights = {}

    def ours(*a, **k):
        return MaxPooling2D(*a, fuse_relu=True, **k)

    for name, pool in (("keras", keras.layers.MaxPooling2D), ("ours", ours)):
        net = _small_model(pool, relu)
        net.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
        net.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        weights[name] = net.get_weights()
    assert traced  # fit's training calls took the argmax path
    if library is not None:
        assert fused and set(fused) == {relu}
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
    pool = loaded.layers[3 if relu else 2]
    assert type(pool) is MaxPooling2D and pool.save_argmax is True and pool.fuse_relu is True
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
    with pytest.raises(tapehook.TapehookError, match="fuse_relu is True or False"):
        MaxPooling2D(2, fuse_relu=1)


_TIER_SCRIPT = """
import sys, numpy as np, tensorflow as tf
from tapehook import kernels
cases = np.load(sys.argv[1], allow_pickle=True)
out = {}
for i, (x, k, s, pad) in enumerate(cases):
    lib, attrs = kernels.library(), dict(ksize=[1, *k, 1], strides=[1, *s, 1], padding=pad)
    x = tf.constant(x)
    y, a = lib.tapehook_max_pool_argmax(x, **attrs)
    out[f"y{i}"], out[f"a{i}"] = y.numpy(), a.numpy()
    for relu in (False, True):
        src = tf.nn.relu(x) if relu else x
        y, t = lib.tapehook_max_pool_taps(src, relu=relu, **attrs)
        dy = tf.constant(np.random.default_rng(i).normal(size=y.shape).astype(np.float32))
        v = tf.constant(np.random.default_rng(i + 1).normal(size=x.shape).astype(np.float32))
        out[f"ty{i}{relu}"], out[f"t{i}{relu}"] = y.numpy(), t.numpy()
        # fused: relu for the backward too; else the taps' plain gradient
        for fused in {False, relu}:
            grad = lib.tapehook_max_pool_taps_grad(dy, t, tf.shape(x), relu=fused, **attrs)
            gather = lib.tapehook_max_pool_taps_gather(v, t, relu=fused, **attrs)
            out[f"dx{i}{relu}{fused}"], out[f"g{i}{relu}{fused}"] = grad.numpy(), gather.numpy()
np.savez(sys.argv[2], **out)
"""


@pytest.mark.parametrize("tier", TIERS)
def test_the_argmax_kernel_is_tf_max_pool_with_argmax(tmp_path, tier):
    """tapehook's max pool with argmax (each vector tier and the channel
    tails) gives TF's MaxPoolWithArgmax outputs and indices bit for bit, and
    its one-byte taps (plain and after a ReLU) the stock backward's dx and
    second derivative:
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
        # The one-byte taps, through what the backward computes from them:
        # dx as MaxPoolGradWithArgmax gives it (then ReluGrad, fused after a
        # ReLU), the gather as v at the argmax (of ReluGrad(v), fused).
        for relu in (False, True):
            src = tf.nn.relu(x) if relu else tf.constant(x)
            y, a = tf.nn.max_pool_with_argmax(src, k, s, pad, include_batch_in_index=False)
            dy = np.random.default_rng(i).normal(size=y.shape).astype(np.float32)
            v = np.random.default_rng(i + 1).normal(size=x.shape).astype(np.float32)
            what = f"case {i}, relu={relu}"
            np.testing.assert_array_equal(out[f"ty{i}{relu}"], y.numpy(), err_msg=what)
            assert out[f"t{i}{relu}"].dtype == np.int8
            for fused in {False, relu}:
                dx = tf.raw_ops.MaxPoolGradWithArgmax(
                    input=src,
                    grad=dy,
                    argmax=a,
                    ksize=[1, *k, 1],
                    strides=[1, *s, 1],
                    padding=pad,
                    include_batch_in_index=False,
                )
                read = v
                if fused:
                    dx = tf.raw_ops.ReluGrad(gradients=dx, features=src)
                    read = tf.raw_ops.ReluGrad(gradients=v, features=src)
                flat = tf.reshape(read, [x.shape[0], -1])
                gather = tf.gather(flat, tf.reshape(a, [x.shape[0], -1]), batch_dims=1)
                for name, want in (("dx", dx), ("g", tf.reshape(gather, y.shape))):
                    got = out[f"{name}{i}{relu}{fused}"]
                    message = f"{name} {what}, fused={fused}"
                    np.testing.assert_array_equal(got, want.numpy(), err_msg=message)
                    np.testing.assert_array_equal(np.signbit(got), np.signbit(want.numpy()))
