"""The dispatcher's documented choices (tapehook/dispatch.py) and their results."""

import pytest
import tensorflow as tf

import tapehook
from tapehook import compat
from conftest import MODES, assert_close, random_inputs, reference_result, upstream

NONE = dict(forward=0, backprop_input=0, backprop_filter=0)
ONE = dict(forward=1, backprop_input=1, backprop_filter=1)


FWD_ONLY = dict(forward=1, backprop_input=0, backprop_filter=0)
BACKPROPS = dict(forward=0, backprop_input=1, backprop_filter=1)


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("activations,dilation,stride,without_amx,with_amx", [
    # weight-only: stock; on AMX (stride 1) all kernels
    (False, 1, 1, (NONE, ONE), (ONE, NONE)),
    # bitpacked forward; backprops stock, or AMX kernels
    (True, 1, 1, (FWD_ONLY, BACKPROPS), (ONE, NONE)),
    # dilated: kernels
    (True, 2, 1, (ONE, NONE), (ONE, NONE)),
    # strided: the AMX kernels take stride 1 only
    (False, 1, 2, (NONE, ONE), (NONE, ONE)),
])
@pytest.mark.parametrize("mode", ["eager", "tape_in_function", "v1_gradients"])
def test_auto_routes_and_matches_reference(monkeypatch, mode, activations, dilation,
                                           stride, without_amx, with_amx, amx):
    monkeypatch.setenv("TAPEHOOK_DISPATCH", "auto")
    if amx and not tapehook.kernel_info()["cpu"].get("amx"):
        pytest.skip("this CPU (or build) has no AMX kernels")
    if not amx:
        monkeypatch.setenv("TAPEHOOK_NO_AMX", "1")
    compiled, reference = with_amx if amx else without_amx
    if amx and not activations and stride == 1 and compat.onednn_enabled():
        # the weight-only dW stays on oneDNN's backprop-filter
        compiled, reference = (dict(ONE, backprop_filter=0),
                               dict(NONE, backprop_filter=1))
    spec = tapehook.BinarySpec(activations=activations, scale="mean_abs")
    # 2 x 32 x 32 pixels: big enough for every AMX route
    x, w0 = random_inputs((2, 32, 32, 3), (3, 3, 3, 4))
    out = 32 if stride == 1 else 16
    g = upstream((2, out, out, 4), tf.float32)
    conv = dict(padding="SAME", dilations=dilation, strides=stride)
    y, dx, dw = MODES[mode](x, w0, g, conv,
                            lambda w: tapehook.mark_binary(w, activations=activations,
                                                           scale="mean_abs"))
    ry, rdx, rdw = reference_result(x, w0, spec, g, strides=[1, stride, stride, 1],
                                    dilations=[1, dilation, dilation, 1])
    assert_close(y, ry, what="forward")
    assert_close(dx, rdx, what="dX")
    assert_close(dw, rdw, what="dW")
    counts = tapehook.dispatch_counts()
    assert counts["compiled"] == compiled and counts["reference"] == reference


@pytest.mark.parametrize("activations,x_shape,w_shape,compiled", [
    # 1x1: dW on stock (fewer taps than AMX_MIN_TAPS) unless the input was
    # kept packed; the forward and dX on AMX
    (False, (2, 16, 16, 3), (1, 1, 3, 4), dict(ONE, backprop_filter=0)),
    (True, (2, 32, 32, 3), (1, 1, 3, 4), ONE),
    # fewer pixels than AMX_MIN_PIXELS: stock (the bitpacked forward aside)
    (False, (1, 10, 10, 3), (3, 3, 3, 4), NONE),
    (True, (1, 10, 10, 3), (3, 3, 3, 4), dict(NONE, forward=1)),
    # 7x7 images: a dW from float x (approx_sign keeps x, not bits) on stock,
    # from packed bits (ste_sign) on the kernels
    ("approx_sign", (4, 7, 7, 3), (3, 3, 3, 4), dict(ONE, backprop_filter=0)),
    (True, (4, 7, 7, 3), (3, 3, 3, 4), ONE),
])
def test_auto_keeps_small_float_convs_on_stock(monkeypatch, activations, x_shape,
                                               w_shape, compiled):
    monkeypatch.setenv("TAPEHOOK_DISPATCH", "auto")
    if not tapehook.kernel_info()["cpu"].get("amx"):
        pytest.skip("this CPU (or build) has no AMX kernels")
    x, w0 = random_inputs(x_shape, w_shape)
    g = upstream(x_shape[:3] + w_shape[3:], tf.float32)
    spec = tapehook.BinarySpec(activations=activations, scale="mean_abs")
    y, dx, dw = MODES["eager"](x, w0, g, dict(padding="SAME"),
                               lambda w: tapehook.mark_binary(
                                   w, activations=activations, scale="mean_abs"))
    ry, rdx, rdw = reference_result(x, w0, spec, g)
    assert_close(y, ry, what="forward")
    assert_close(dx, rdx, what="dX")
    assert_close(dw, rdw, what="dW")
    counts = tapehook.dispatch_counts()
    reference = {k: 1 - v for k, v in compiled.items()}
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


@pytest.mark.parametrize("activations", [False, True])
def test_auto_with_unknown_static_shapes(monkeypatch, activations):
    """A traced input of unknown rank / batch goes through the dispatcher (unknown
    dims count as large) and still matches the reference."""
    monkeypatch.setenv("TAPEHOOK_DISPATCH", "auto")
    spec = tapehook.BinarySpec(activations=activations, scale="mean_abs")
    x, w0 = random_inputs((2, 9, 9, 3), (3, 3, 3, 4))
    g = upstream((2, 9, 9, 4), tf.float32)
    w = tapehook.mark_binary(tf.Variable(w0), activations=activations, scale="mean_abs")
    for signature in ([tf.TensorSpec(None, tf.float32)],
                      [tf.TensorSpec([None, 9, 9, 3], tf.float32)]):
        @tf.function(input_signature=signature)
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = tf.nn.conv2d(x, w, 1, "SAME")
            return (y,) + tuple(tape.gradient(y, [x, w], output_gradients=g))

        y, dx, dw = step(x)
        ry, rdx, rdw = reference_result(x, w0, spec, g)
        assert_close(y, ry, what="forward")
        assert_close(dx, rdx, what="dX")
        assert_close(dw, rdw, what="dW")
