"""With binary activations (ste_sign), a binary conv's backward keeps packed
sign and mask bits, not its float input: the input is freed once user code
drops it, and every result still matches the reference."""

import gc
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import tapehook
from tapehook import kernels, packing

from conftest import (
    assert_close,
    conv_gradient_graph,
    random_inputs,
    reference_result,
    run_python_json,
    upstream,
)


def test_float_input_is_not_kept_by_the_tape():
    _, w0 = random_inputs((1, 1, 1, 5), (3, 3, 5, 4))
    w = tapehook.mark_binary(tf.Variable(w0), activations=True, scale="mean_abs")
    x = tf.random.normal([2, 7, 7, 5], seed=3)
    x_copy = tf.identity(x)  # the test's own reference copy
    watched = weakref.ref(x)
    g = upstream((2, 7, 7, 4), tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.nn.conv2d(x, w, 1, "SAME")
        loss = tf.reduce_sum(y * g)
    del x
    gc.collect()
    assert watched() is None, "the tape keeps the float input of a binary conv"
    dw = tape.gradient(loss, w)
    _, _, rdw = reference_result(x_copy, w0, tapehook.binary_spec_of(w), g)
    assert_close(dw, rdw, what="dW from packed bits")


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.float64])
@pytest.mark.parametrize("channels", [1, 3, 4, 5, 13])
def test_pack_round_trip(channels, dtype):
    x = tf.constant(np.random.default_rng(channels).normal(size=(2, 3, channels)), dtype)
    x = tf.where(tf.abs(x) < 0.2, tf.zeros_like(x), x)  # exact zeros map to +1
    spec = tapehook.BinarySpec(activations=True, clip=0.7)
    packed = packing.pack_input(x, spec)
    assert packed.packed.dtype == tf.uint8 and packed.packed.shape[-1] == -(-channels // 4)
    x_hat, mask = packed.unpack()
    assert x_hat.dtype == dtype
    np.testing.assert_array_equal(x_hat, np.where(x >= 0, 1.0, -1.0))
    np.testing.assert_array_equal(
        mask, (np.abs(tf.cast(x, tf.float32)) <= np.float32(0.7)).astype(float)
    )


def test_graph_backward_reads_the_bits_not_the_input():
    _, w0 = random_inputs((1, 1, 1, 3), (3, 3, 3, 4))
    w = tapehook.mark_binary(tf.Variable(w0), activations=True)
    graph = conv_gradient_graph(w, [2, 6, 6, 3])
    x_input = graph.inputs[0]
    backprops = [
        op for op in graph.get_operations() if op.type.startswith("TapehookBinaryConv2DBackprop")
    ]
    assert len(backprops) == 2
    for op in backprops:
        assert op.inputs[0] is not x_input, f"{op.type} reads the float input"


def _stack(activations_spec):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((8, 8, 4))
    h = keras.layers.BatchNormalization()(inputs)
    h = keras.layers.Conv2D(6, 3, padding="same", use_bias=False, name="b1")(h)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Conv2D(6, 3, padding="same", use_bias=False, name="b2")(h)
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    return tapehook.binarize(model, include="b*", **activations_spec)


@pytest.mark.parametrize("run_eagerly", [True, False])
def test_bn_conv_stack_trains_like_the_reference(run_eagerly):
    x, _ = random_inputs((4, 8, 8, 4), (1,))
    y = tf.constant(np.random.default_rng(2).normal(size=(4, 2)), tf.float32)

    def train(reference):
        model = _stack(dict(activations=True))
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", run_eagerly=run_eagerly)
        kernels.force_reference(reference)
        try:
            model.fit(x, y, batch_size=4, epochs=2, verbose=0)
        finally:
            kernels.force_reference(False)
        return model.get_weights()

    for a, b in zip(train(False), train(True)):
        assert_close(a, b, what="weights after two steps")
    assert tapehook.dispatch_counts()["compiled"]["backprop_filter"] == 4


def test_conv2d_override_still_applies_with_binary_activations():
    w = tapehook.mark_binary(tf.Variable(tf.random.normal([3, 3, 2, 4], seed=1)), activations=True)
    x = tf.random.normal([1, 5, 5, 2], seed=2)

    def ones_for_filter(op, grad):
        return tf.zeros_like(op.inputs[0]), tf.ones_like(op.inputs[1])

    with tf.GradientTape() as tape:
        with tapehook.override_gradient("Conv2D", ones_for_filter):
            y = tf.nn.conv2d(x, w, 1, "SAME")
    np.testing.assert_array_equal(tape.gradient(y, w), np.ones([3, 3, 2, 4]))


@pytest.mark.parametrize("estimator", ["approx_sign", "swish_sign"])
def test_one_padded_backward_keeps_the_unpadded_input(monkeypatch, estimator):
    """With TAPEHOOK_PACK_INPUTS=float32 a continuous estimator's backward
    reads float x for e'(x). With one-padding, x is a padded copy of the
    layer's input: the graph's backward pads the input again instead of
    keeping the copy, and its gradients still match the reference."""
    monkeypatch.setenv("TAPEHOOK_PACK_INPUTS", "float32")
    x0, w0 = random_inputs((2, 6, 6, 3), (3, 3, 3, 4))
    w = tapehook.mark_binary(
        tf.Variable(w0), activations=estimator, scale="mean_abs", pad_value=1.0
    )
    g = upstream((2, 6, 6, 4), tf.float32)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.nn.conv2d(x, w, 1, "SAME") * g)
        return tape.gradient(loss, [x, w])

    graph = step.get_concrete_function(tf.TensorSpec(x0.shape)).graph
    pads = [op for op in graph.get_operations() if op.type in ("Pad", "PadV2")]
    forward_pad = pads[0]
    readers = {op.type for op in forward_pad.outputs[0].consumers()}
    assert not any(t.startswith("TapehookBinaryConv2DBackprop") for t in readers), (
        f"a backprop reads the padded copy of x: {sorted(readers)}"
    )
    backprops = [
        op for op in graph.get_operations() if op.type.startswith("TapehookBinaryConv2DBackprop")
    ]
    assert len(backprops) == 2 and all(op.inputs[0].op.type == "PadV2" for op in backprops)
    dx, dw = step(x0)
    _, rdx, rdw = reference_result(x0, w0, tapehook.binary_spec_of(w), g)
    assert_close(dx, rdx, what=f"dX, {estimator}, one-padded")
    assert_close(dw, rdw, what=f"dW, {estimator}, one-padded")


_UNPACK_SCRIPT = """
import os
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # allocation statistics
import json, numpy as np, tensorflow as tf
from tapehook import kernels
lib = kernels.library()
x = tf.constant(np.random.default_rng(0).normal(size=(16, 32, 32, 64)).astype(np.float32))
packed = lib.tapehook_pack_input(x, clip=1.0, clip_f64_bits=int(np.float64(1.0).view(np.int64)))
unpack = lambda p: lib.tapehook_unpack_input(p, channels=64, T=tf.float32)
out = {}
for name, f in (("signs", lambda p: [unpack(p)[0]]), ("both", unpack)):
    fn = tf.function(lambda p: [tf.reduce_sum(t) for t in f(p)])
    fn(packed)
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    sums = [float(v) for v in fn(packed)]
    out[name] = dict(peak=tf.config.experimental.get_memory_info("CPU:0")["peak"] - before, sums=sums)
s, m = unpack(packed)
out["eager"] = [float(tf.reduce_sum(s)), float(tf.reduce_sum(m))]
out["want"] = [float(np.sum(np.where(x.numpy() >= 0, 1.0, -1.0))), float(np.sum(np.abs(x.numpy()) <= 1))]
print(json.dumps(out))
"""


def test_a_graph_reading_only_the_signs_allocates_no_mask():
    """TapehookUnpackInput in a graph whose only reader takes x_hat (a batch
    norm's rebuild of a conv output) neither allocates nor writes the mask
    output: the step's peak holds one unpacked tensor, not two (BFC
    statistics, a fresh process); both outputs stay right where read."""
    if kernels.library() is None:
        pytest.skip("compiled kernels not loaded")
    out = run_python_json("-c", _UNPACK_SCRIPT)
    size = 16 * 32 * 32 * 64 * 4
    assert size <= out["signs"]["peak"] < 1.5 * size, out
    assert out["both"]["peak"] >= 2 * size, out
    assert out["signs"]["sums"] == out["want"][:1]
    assert out["both"]["sums"] == out["want"] == out["eager"]
