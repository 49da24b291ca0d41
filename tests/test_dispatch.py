"""The dispatcher's documented choices (tapehook/dispatch.py) and their results."""

import pytest
import tensorflow as tf

import tapehook
from conftest import MODES, assert_close, random_inputs, reference_result, upstream

NONE = dict(forward=0, backprop_input=0, backprop_filter=0)
ONE = dict(forward=1, backprop_input=1, backprop_filter=1)


@pytest.mark.parametrize("activations,dilation,compiled,reference", [
    (False, 1, NONE, ONE),                                             # weight-only: stock
    (True, 1, dict(forward=1, backprop_input=0, backprop_filter=0),
     dict(forward=0, backprop_input=1, backprop_filter=1)),          # bitpacked fwd
    (True, 2, ONE, NONE),                                              # dilated: kernels
])
@pytest.mark.parametrize("mode", ["eager", "tape_in_function", "v1_gradients"])
def test_auto_routes_and_matches_reference(monkeypatch, mode, activations, dilation,
                                           compiled, reference):
    monkeypatch.setenv("TAPEHOOK_DISPATCH", "auto")
    spec = tapehook.BinarySpec(activations=activations, scale="mean_abs")
    x, w0 = random_inputs((2, 7, 7, 3), (3, 3, 3, 4))
    g = upstream((2, 7, 7, 4), tf.float32)
    conv = dict(padding="SAME", dilations=dilation)
    y, dx, dw = MODES[mode](x, w0, g, conv,
                            lambda w: tapehook.mark_binary(w, activations=activations,
                                                           scale="mean_abs"))
    ry, rdx, rdw = reference_result(x, w0, spec, g, dilations=[1, dilation, dilation, 1])
    assert_close(y, ry, what="forward")
    assert_close(dx, rdx, what="dX")
    assert_close(dw, rdw, what="dW")
    counts = tapehook.dispatch_counts()
    assert counts["compiled"] == compiled and counts["reference"] == reference


def test_stock_policy_and_bad_policy(monkeypatch):
    x, w0 = random_inputs((1, 5, 5, 2), (3, 3, 2, 3))
    w = tapehook.mark_binary(tf.Variable(w0), activations=True)
    monkeypatch.setenv("TAPEHOOK_DISPATCH", "stock")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.nn.conv2d(x, w, 1, "SAME") ** 2)
    tape.gradient(loss, w)
    assert tapehook.dispatch_counts()["compiled"] == NONE
    monkeypatch.setenv("TAPEHOOK_DISPATCH", "fastest")
    with pytest.raises(tapehook.TapehookError, match="TAPEHOOK_DISPATCH='fastest'"):
        tf.nn.conv2d(x, w, 1, "SAME")
