"""Concurrency, misuse and long runs: 8 threads at once, traced functions
and unmark, and resident memory over many eager steps."""

import threading

import numpy as np
import pytest
import tensorflow as tf

import tapehook

from conftest import assert_close, random_inputs, reference_result, upstream

THREAD_SPECS = [
    tapehook.BinarySpec(),
    tapehook.BinarySpec(activations=True),
    tapehook.BinarySpec(scale="mean_abs"),
    tapehook.BinarySpec(activations="approx_sign"),
    tapehook.BinarySpec(ste="swish_sign", activations=True),
    tapehook.BinarySpec(clip=0.5, activations=True),
    tapehook.BinarySpec(ste="approx_sign", scale="mean_abs"),
    tapehook.BinarySpec(activations=True, scale="mean_abs"),
]


def test_eight_threads_marked_and_unmarked_eager_and_function():
    """Each thread trains its own marked and unmarked filter, alternating eager
    and tf.function steps, half of them marking through their own scope."""
    errors, barrier = [], threading.Barrier(8)

    def train(i):
        try:
            spec = THREAD_SPECS[i]
            x, w0 = random_inputs((2, 6, 6, 3), (3, 3, 3, 4), seed=i)
            g = upstream((2, 6, 6, 4), tf.float32, seed=i)
            plain = tf.Variable(w0 * 0.5)
            if i % 2:
                binary = tapehook.mark_binary(tf.Variable(w0), **vars(spec))
            else:
                with tapehook.binary_scope(**vars(spec)):
                    binary = tf.Variable(w0)

            def step(x):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    y = tf.nn.conv2d(x, binary, 1, "SAME")
                    z = tf.nn.conv2d(x, plain, 1, "SAME")
                    loss = tf.reduce_sum(y * g) + tf.reduce_sum(z * g)
                return (y, z, *tape.gradient(loss, [x, binary, plain]))

            traced = tf.function(step)
            barrier.wait()
            for n in range(6):
                wb, wp = tf.convert_to_tensor(binary), tf.convert_to_tensor(plain)
                y, z, dx, dwb, dwp = (traced if n % 2 else step)(x)
                ry, rdx_b, rdw = reference_result(x, wb, spec, g)
                with tf.GradientTape() as tape:
                    tape.watch([x, wp])
                    rz = tf.raw_ops.Conv2D(input=x, filter=wp, strides=[1] * 4, padding="SAME")
                    rl = tf.reduce_sum(rz * g)
                rdx_p, rdwp = tape.gradient(rl, [x, wp])
                assert_close(y, ry, what=f"thread {i} binary forward")
                assert_close(z, rz, what=f"thread {i} float forward")
                assert_close(dx, rdx_b + rdx_p, what=f"thread {i} dX")
                assert_close(dwb, rdw, what=f"thread {i} binary dW")
                assert_close(dwp, rdwp, what=f"thread {i} float dW")
                binary.assign_sub(0.01 * dwb)
                plain.assign_sub(0.01 * dwp)
            assert tapehook.binary_spec_of(binary) == spec
            assert tapehook.binary_spec_of(plain) is None
        except Exception as exc:  # reported by the main thread
            errors.append((i, repr(exc)))

    threads = [threading.Thread(target=train, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors
    assert tapehook.dispatch_counts()["compiled"]["forward"] >= 8 * 3


def test_unmark_during_a_traced_functions_life():
    """Documented: a traced function keeps the spec it was traced with; the next
    trace (new input shape, or a new function) sees the unmark."""
    x, w0 = random_inputs((1, 5, 5, 2), (3, 3, 2, 3))
    w = tapehook.mark_binary(tf.Variable(w0))
    conv = tf.function(lambda x: tf.nn.conv2d(x, w, 1, "SAME"))
    binary = conv(x)
    tapehook.unmark(w)
    np.testing.assert_array_equal(conv(x), binary)  # same trace: still binary
    x2 = tf.concat([x, x], axis=0)  # a new trace: float now
    np.testing.assert_array_equal(conv(x2)[:1], tf.nn.conv2d(x, w0, 1, "SAME"))


def test_integer_filter_cannot_be_marked_and_stays_stock():
    w = tf.Variable(tf.ones([3, 3, 1, 1], tf.int32))
    with pytest.raises(tapehook.TapehookError, match="dtype int32; binary kernels support"):
        tapehook.mark_binary(w)
    with tapehook.binary_scope():  # a scope never marks what cannot be binary
        tf.Variable(tf.ones([3, 3, 1, 1], tf.int32))


def test_marked_keras_conv_with_channels_first_is_an_error():
    import keras

    layer = keras.layers.Conv2D(2, 3, data_format="channels_first")
    layer.build((1, 3, 6, 6))
    tapehook.mark_binary(layer.kernel)
    with pytest.raises(tapehook.TapehookError, match="NHWC only"):
        layer(tf.ones([1, 3, 6, 6]))


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_resident_memory_stops_growing_and_counts_stay_exact():
    """Marks and tags must not pin tensors: after warm-up, 400 more eager steps
    leave resident memory flat (bench/leak_check.py runs 10,000)."""
    x, w0 = random_inputs((4, 16, 16, 8), (3, 3, 8, 16))
    w = tapehook.mark_binary(tf.Variable(w0), activations=True)

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.nn.conv2d(x, w, 1, "SAME") ** 2)
        w.assign_sub(1e-4 * tape.gradient(loss, w))

    for _ in range(300):
        step()
    tapehook.reset_dispatch_counts()
    before = _rss_bytes()
    for _ in range(400):
        step()
    grown = _rss_bytes() - before
    assert grown < 8 * 2**20, f"resident memory grew by {grown / 2**20:.1f} MiB"
    assert tapehook.dispatch_counts()["compiled"] == dict(
        forward=400, backprop_input=0, backprop_filter=400
    )
