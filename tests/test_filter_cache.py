"""Inference keeps a binary conv's packed filter between calls while the
filter tensor's buffer is unchanged (TapehookBinaryConv2D's cache_filter): the
bitpacked signs of a fully binary conv, the AMX GEMM's sign(W) of a
weight-only one. Every write to the variable, by any TF path, must still show
in the next forward, and a kept filter must give the same bits as a fresh one."""

import numpy as np
import pytest
import tensorflow as tf

import tapehook
from tapehook import kernels, reference

from conftest import assert_close, random_inputs

# activations: True (fully binary, bitpacked) or False (weight-only, AMX).
KINDS = pytest.mark.parametrize("activations", [True, False], ids=["binary", "weight_only"])


def _needs_kept_filter(activations):
    """Weight-only convs keep their filter on the AMX path only."""
    if not activations and not tapehook.kernel_info()["cpu"].get("amx"):
        pytest.skip("no AMX kernels: a float-input forward keeps no filter")


def _spec(activations):
    return tapehook.BinarySpec(activations=activations, scale="mean_abs")


def _expected(x, w_value, activations=True):
    return reference.binary_conv2d(
        x, tf.constant(w_value), _spec(activations), [1, 1, 1, 1], "SAME", [], [1, 1, 1, 1]
    )


def _raw(x, w, cache, activations=True):
    return kernels.library().tapehook_binary_conv2d(
        x,
        w,
        cache_filter=cache,
        strides=[1, 1, 1, 1],
        padding="SAME",
        scale="mean_abs",
        activation_estimator="ste_sign" if activations else "none",
    )


def _writes(w, rng):
    """Each way a program changes a variable between two inference calls; a
    write that keeps every sign would hide a stale filter, so each flips some."""
    shape = w.shape.as_list()
    sgd = tf.keras.optimizers.SGD(learning_rate=10.0)
    return [
        ("assign", lambda: w.assign(-w)),
        ("assign_sub", lambda: w.assign_sub(2.0 * w)),
        ("assign_add", lambda: w.assign_add(rng.normal(size=shape).astype(np.float32))),
        (
            "scatter_nd_update",
            lambda: w.scatter_nd_update([[0, 0, 0, 0], [1, 1, 2, 3]], [-5.0, 7.0]),
        ),
        (
            "keras_optimizer",
            lambda: sgd.apply_gradients([(tf.constant(rng.normal(size=shape), tf.float32), w)]),
        ),
    ]


@KINDS
@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_inference_sees_every_write(mode, activations):
    _needs_kept_filter(activations)
    rng = np.random.default_rng(7)
    x, w0 = random_inputs((2, 7, 6, 33), (3, 3, 33, 17), seed=3)
    w = tapehook.mark_binary(tf.Variable(w0), activations=activations, scale="mean_abs")
    forward = lambda: tf.nn.conv2d(x, w, 1, "SAME")  # noqa: E731
    if mode == "tf_function":
        forward = tf.function(forward)
    first = forward()
    assert_close(first, _expected(x, w.numpy(), activations), what="first call")
    np.testing.assert_array_equal(forward(), first)  # kept filter, same bits
    for name, write in _writes(w, rng):
        before = forward()
        write()
        after = forward()
        assert_close(after, _expected(x, w.numpy(), activations), what=f"after {name}")
        assert not np.array_equal(after, before), f"{name} changed no output"


@KINDS
def test_kept_filter_gives_the_same_bits_as_a_fresh_one(activations):
    _needs_kept_filter(activations)
    x, w0 = random_inputs((1, 9, 9, 70), (3, 3, 70, 40), seed=5)
    w = tf.Variable(w0)
    fresh = _raw(x, w, cache=False, activations=activations)
    for _ in range(3):
        np.testing.assert_array_equal(_raw(x, w, cache=True, activations=activations), fresh)


@KINDS
def test_one_eager_kernel_serves_several_filters(activations):
    """Eager reuses one kernel object for ops with equal attrs: alternating
    filters of one shape must each get their own packed signs."""
    _needs_kept_filter(activations)
    x, w0 = random_inputs((1, 5, 5, 8), (3, 3, 8, 4), seed=1)
    filters = [tf.Variable(w0), tf.Variable(-w0), tf.Variable(w0 * 0.5 + 0.3)]
    for _ in range(2):
        for v in filters:
            assert_close(
                _raw(x, v, cache=True, activations=activations),
                _expected(x, v.numpy(), activations),
            )


def test_only_inference_keeps_the_filter():
    """A forward a tape records (training) would only pay a variable copy per
    update for a kept filter, so it does not keep one."""
    x, w0 = random_inputs((1, 5, 5, 8), (3, 3, 8, 4))
    w = tapehook.mark_binary(tf.Variable(w0), activations=True)
    weight_only = tapehook.mark_binary(tf.Variable(w0))

    def attr_of(fn):
        graph = tf.function(fn).get_concrete_function().graph
        ops = [op for op in graph.get_operations() if op.type == "TapehookBinaryConv2D"]
        assert len(ops) == 1
        return ops[0].get_attr("cache_filter")

    def training():
        with tf.GradientTape() as tape:
            y = tf.nn.conv2d(x, w, 1, "SAME")
        return tape.gradient(y, w)

    def training_weight_only():
        with tf.GradientTape() as tape:
            y = tf.nn.conv2d(x, weight_only, 1, "SAME")
        return tape.gradient(y, weight_only)

    assert attr_of(lambda: tf.nn.conv2d(x, w, 1, "SAME")) is True
    assert attr_of(training) is False
    assert attr_of(lambda: tf.nn.conv2d(x, weight_only, 1, "SAME")) is True
    assert attr_of(training_weight_only) is False


@KINDS
def test_v1_graph_session_sees_assign(activations):
    _needs_kept_filter(activations)
    x_value, w0 = (t.numpy() for t in random_inputs((1, 6, 6, 16), (3, 3, 16, 8), seed=2))
    with tf.Graph().as_default():
        x = tf.constant(x_value)
        w = tapehook.mark_binary(tf.Variable(w0), activations=activations, scale="mean_abs")
        y = tf.nn.conv2d(x, w, 1, "SAME")
        flip = w.assign(-w)
        with tf.compat.v1.Session() as sess:
            sess.run(w.initializer)
            before = sess.run(y)
            np.testing.assert_array_equal(sess.run(y), before)
            sess.run(flip)
            after = sess.run(y)
    assert_close(before, _expected(tf.constant(x_value), w0, activations))
    assert_close(after, _expected(tf.constant(x_value), -w0, activations))


@KINDS
def test_keras_predict_after_fit(activations):
    _needs_kept_filter(activations)
    keras = tf.keras
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6, 6, 8)).astype(np.float32)
    target = rng.normal(size=(16, 6, 6, 4)).astype(np.float32)
    with tapehook.binary_scope(activations=activations, scale="mean_abs"):
        model = keras.Sequential(
            [keras.Input((6, 6, 8)), keras.layers.Conv2D(4, 3, padding="same", use_bias=False)]
        )
    model.compile(keras.optimizers.SGD(5.0), "mse")
    kernel = model.layers[0].kernel
    before = model.predict(x, verbose=0)
    assert_close(before, _expected(tf.constant(x), kernel.numpy(), activations), what="before fit")
    model.fit(x, target, epochs=2, batch_size=8, verbose=0)
    after = model.predict(x, verbose=0)
    assert_close(after, _expected(tf.constant(x), kernel.numpy(), activations), what="after fit")
    assert not np.array_equal(after, before)


@KINDS
def test_concurrent_inference_calls(activations):
    """One tf.function run from several threads at once: the kernel's kept
    filter is shared under a lock; every call gets the right output."""
    import concurrent.futures

    _needs_kept_filter(activations)
    x, w0 = random_inputs((1, 8, 8, 48), (3, 3, 48, 24), seed=4)
    w = tapehook.mark_binary(tf.Variable(w0), activations=activations, scale="mean_abs")
    forward = tf.function(lambda: tf.nn.conv2d(x, w, 1, "SAME"))
    expected = _expected(x, w0.numpy(), activations)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(lambda _: forward().numpy(), range(32)))
    for y in outputs:
        assert_close(y, expected)
        np.testing.assert_array_equal(y, outputs[0])
