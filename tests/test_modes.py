"""Binary forward, dX and dW agree with the reference in every execution mode;
unmarked convs equal stock TF bit for bit in every mode."""

import numpy as np
import pytest
import tensorflow as tf

import tapehook
from tapehook import patches, registry

from conftest import (
    MODES,
    SPEC_IDS,
    SPECS,
    assert_close,
    random_inputs,
    reference_result,
    spec_kwargs,
    upstream,
)

X_SHAPE, W_SHAPE = (2, 7, 6, 3), (3, 3, 3, 5)


@pytest.mark.parametrize("policy", ["auto", "kernels"])
@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_binary_matches_reference(mode, spec, policy, monkeypatch):
    """Under "auto" (what users run: the dispatcher's choices, stock routes
    included) and "kernels" (tapehook's kernels everywhere)."""
    monkeypatch.setenv("TAPEHOOK_DISPATCH", policy)
    x, w0 = random_inputs(X_SHAPE, W_SHAPE, seed=len(mode))
    g = upstream((2, 4, 3, 5), tf.float32)
    conv = {"strides": 2, "padding": "SAME"}
    y, dx, dw = MODES[mode](x, w0, g, conv, lambda w: tapehook.mark_binary(w, **spec_kwargs(spec)))
    ry, rdx, rdw = reference_result(x, w0, spec, g, strides=[1, 2, 2, 1])
    assert_close(y, ry, what="forward")
    assert_close(dx, rdx, what="dX")
    assert_close(dw, rdw, what="dW")


@pytest.mark.parametrize("mode", sorted(MODES))
def test_binary_in_mode_runs_compiled_kernels(mode):
    x, w0 = random_inputs(X_SHAPE, W_SHAPE)
    g = upstream((2, 7, 6, 5), tf.float32)
    MODES[mode](x, w0, g, {}, tapehook.mark_binary)
    counts = tapehook.dispatch_counts()
    assert counts["compiled"]["forward"] >= 1
    assert counts["compiled"]["backprop_filter"] >= 1
    assert counts["compiled"]["backprop_input"] >= 1
    assert counts["reference"] == dict(forward=0, backprop_input=0, backprop_filter=0)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_unmarked_is_stock_bit_for_bit(mode):
    """Same mode, same inputs, with tapehook installed and with TF untouched."""
    x, w0 = random_inputs(X_SHAPE, W_SHAPE)
    g = upstream((2, 4, 3, 5), tf.float32)
    conv = {"strides": 2, "padding": "SAME"}
    ours = MODES[mode](x, w0, g, conv, lambda w: None)
    patches.uninstall()
    try:
        assert registry.registered_gradient("Conv2D") is not tapehook.gradient.conv2d_grad
        stock = MODES[mode](x, w0, g, conv, lambda w: None)
    finally:
        patches.install()
    for name, a, b in zip(("forward", "dX", "dW"), ours, stock):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert tapehook.dispatch_counts()["compiled"]["forward"] == 0


def test_gradient_built_after_scope_closed():
    """The issue's example: the tape's gradient is built outside the block."""
    x, w0 = random_inputs((1, 5, 5, 2), (3, 3, 2, 4))
    w = tf.Variable(w0)
    with tf.GradientTape() as tape:
        with tapehook.binary_scope():
            y = tf.nn.conv2d(x, w, strides=1, padding="SAME")
        loss = tf.reduce_sum(y**2)
    dw = tape.gradient(loss, w)
    spec = tapehook.binary_spec_of(w)
    assert spec == tapehook.BinarySpec()
    with tf.GradientTape() as tape:
        tape.watch(w0)
        ry = tapehook.reference.binary_conv2d(x, w0, spec)
        rloss = tf.reduce_sum(ry**2)
    assert_close(y, ry)
    assert_close(dw, tape.gradient(rloss, w0))


def test_unwatched_input_skips_backprop_input():
    x, w0 = random_inputs((1, 5, 5, 2), (3, 3, 2, 4))
    w = tapehook.mark_binary(tf.Variable(w0))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.nn.conv2d(x, w, 1, "SAME"))
    tape.gradient(loss, w)
    counts = tapehook.dispatch_counts()["compiled"]
    assert counts == dict(forward=1, backprop_input=0, backprop_filter=1)
