"""x_hat is zero-padded for dilated depthwise convs and dilated Conv1D exactly
as for dilated Conv2D, against NumPy loops in every execution mode. (TF
dilates those with SpaceToBatchND, which pads the float x; binarizing it
would pad with +1.)"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tapehook

from conftest import MODE_NAMES, SPEC_IDS, SPECS, assert_close, run_mode, spec_kwargs
from test_reference import numpy_binary_conv


def _same_pads(k, dil):
    total = (k - 1) * dil
    return total // 2, total - total // 2


def numpy_depthwise(x, w, g, spec, dil, padding):
    """Depthwise conv = one single-channel conv per input channel."""
    kh, kw, cin, mult = w.shape
    (pt, pb), (pl, pr) = (
        (_same_pads(kh, dil), _same_pads(kw, dil)) if padding == "SAME" else ((0, 0), (0, 0))
    )
    parts = [
        numpy_binary_conv(
            x[..., c : c + 1],
            w[:, :, c : c + 1, :],
            g[..., c * mult : (c + 1) * mult],
            spec,
            1,
            (pt, pb, pl, pr),
            dil,
        )
        for c in range(cin)
    ]
    y = np.concatenate([p[0] for p in parts], axis=-1)
    dx = np.concatenate([p[1] for p in parts], axis=-1)
    dw = np.concatenate([p[2] for p in parts], axis=2)
    return y, dx, dw


def numpy_conv1d(x, w, g, spec, dil, padding):
    pl, pr = _same_pads(w.shape[0], dil) if padding == "SAME" else (0, 0)
    y, dx, dw = numpy_binary_conv(x[:, None], w[None], g[:, None], spec, 1, (0, 0, pl, pr), dil)
    return y[:, 0], dx[:, 0], dw[0]


def _inputs(x_shape, w_shape, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=x_shape) * 1.2
    x[rng.random(x_shape) < 0.05] = 0.0
    return x, rng.normal(size=w_shape) * 0.8


# name: (call, x shape, w shape, NumPy reference); all SAME with dilation 2
CALLS = {
    "tf.nn.depthwise_conv2d": (
        lambda x, w: tf.nn.depthwise_conv2d(x, w, [1, 1, 1, 1], "SAME", dilations=[2, 2]),
        (2, 7, 6, 3),
        (3, 3, 3, 2),
        numpy_depthwise,
    ),
    "v1.nn.depthwise_conv2d": (
        lambda x, w: tf.compat.v1.nn.depthwise_conv2d(x, w, [1, 1, 1, 1], "SAME", rate=[2, 2]),
        (2, 7, 6, 3),
        (3, 3, 3, 2),
        numpy_depthwise,
    ),
    "keras.ops.depthwise_conv": (
        lambda x, w: keras.ops.depthwise_conv(x, w, padding="same", dilation_rate=2),
        (2, 7, 6, 3),
        (3, 3, 3, 2),
        numpy_depthwise,
    ),
    "tf.nn.convolution_1d": (
        lambda x, w: tf.nn.convolution(x, w, padding="SAME", dilations=2),
        (2, 9, 3),
        (3, 3, 4),
        numpy_conv1d,
    ),
    "tf.nn.conv1d": (
        lambda x, w: tf.nn.conv1d(x, w, 1, "SAME", dilations=2),
        (2, 9, 3),
        (3, 3, 4),
        numpy_conv1d,
    ),
    "keras.ops.conv_1d": (
        lambda x, w: keras.ops.conv(x, w, padding="same", dilation_rate=2),
        (2, 9, 3),
        (3, 3, 4),
        numpy_conv1d,
    ),
}


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("mode", MODE_NAMES)
@pytest.mark.parametrize("call", sorted(CALLS))
def test_dilated_conv_pads_x_hat_with_zeros(call, mode, spec):
    if call.startswith("keras.ops") and mode.startswith("v1"):
        pytest.skip("keras.ops runs eagerly or in tf.function, not in v1 graphs")
    op, x_shape, w_shape, numpy_reference = CALLS[call]
    x, w0 = _inputs(x_shape, w_shape, seed=3)
    # SAME, stride 1: y has x's pixels and w's output channels
    channels = w_shape[-1] * (w_shape[-2] if numpy_reference is numpy_depthwise else 1)
    g = np.random.default_rng(4).normal(size=x_shape[:-1] + (channels,))
    y, dx, dw = run_mode(
        mode,
        x,
        w0,
        g,
        op,
        prepare=lambda w: tapehook.mark_binary(w, **spec_kwargs(spec)),
        loss=lambda y, g: tf.reduce_sum(y * g),
    )
    ey, edx, edw = numpy_reference(x, w0, g, spec, 2, "SAME")
    assert_close(y, ey, tf.float64, "forward")
    assert_close(dx, edx, tf.float64, "dX")
    assert_close(dw, edw, tf.float64, "dW")


@pytest.mark.parametrize("layer", ["DepthwiseConv2D", "Conv1D"])
def test_keras_dilated_layers_issue_examples(layer):
    """x = -1, W = +1, rate 2, SAME: the issue's numbers."""
    if layer == "Conv1D":
        x = -np.ones((1, 7, 1), np.float32)
        conv = keras.layers.Conv1D(
            1, 3, padding="same", dilation_rate=2, use_bias=False, kernel_initializer="ones"
        )
        expected = [-2, -2, -3, -3, -3, -2, -2]
    else:
        x = -np.ones((1, 5, 5, 1), np.float32)
        conv = keras.layers.DepthwiseConv2D(
            3, padding="same", dilation_rate=2, use_bias=False, depthwise_initializer="ones"
        )
        expected = [-4, -4, -6, -4, -4]
    model = tapehook.binarize(keras.Sequential([keras.Input(x.shape[1:]), conv]), activations=True)
    for y in (model(x), model.predict(x, verbose=0), tf.function(model)(x)):
        first_row = np.asarray(y)[0, 0, :, 0] if layer != "Conv1D" else np.asarray(y)[0, :, 0]
        np.testing.assert_array_equal(first_row, expected)


@pytest.mark.parametrize("pad_value", [0.0, 1.0])
@pytest.mark.parametrize("dilation", [1, 2])
def test_causal_conv1d_pads_x_hat_not_x(dilation, pad_value):
    """Keras pads a causal Conv1D's float input with zeros; a binary one pads
    x_hat with pad_value (larq quantizes before the layer pads)."""
    x = np.random.default_rng(8).normal(size=(2, 7, 3)).astype(np.float32)
    conv = keras.layers.Conv1D(4, 3, padding="causal", dilation_rate=dilation, use_bias=False)
    model = tapehook.binarize(
        keras.Sequential([keras.Input((7, 3)), conv]), activations=True, pad_value=pad_value
    )
    w0 = conv.kernel.numpy().astype(np.float64)
    g = np.ones((2, 7, 4))
    spec = tapehook.binary_spec_of(conv.kernel)
    ey, edx, _ = numpy_binary_conv(
        x[:, None].astype(np.float64),
        w0[None],
        g[:, None],
        spec,
        1,
        (0, 0, 2 * dilation, 0),
        dilation,
    )
    for run in (lambda t: model(t), tf.function(lambda t: model(t))):
        xt = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = run(xt)
        assert_close(y, ey[:, 0], tf.float32, "forward")
        assert_close(tape.gradient(y, xt), edx[:, 0], tf.float32, "dX")
    np.testing.assert_allclose(model.predict(x, verbose=0), ey[:, 0], atol=1e-4)
    assert conv.padding == "causal"


@pytest.mark.parametrize("layer", ["Conv1D", "DepthwiseConv2D"])
def test_lazily_built_dilated_layer_is_binary_from_its_first_call(layer):
    """A decorated subclassed model builds its layers in its first call: the
    dilated conv must already pad x_hat with zeros then."""
    if layer == "Conv1D":
        x = -np.ones((1, 7, 1), np.float32)
        make = lambda: keras.layers.Conv1D(  # noqa: E731
            1, 3, padding="same", dilation_rate=2, use_bias=False, kernel_initializer="ones"
        )
        expected = [-2, -2, -3, -3, -3, -2, -2]
    else:
        x = -np.ones((1, 5, 5, 1), np.float32)
        make = lambda: keras.layers.DepthwiseConv2D(  # noqa: E731
            3, padding="same", dilation_rate=2, use_bias=False, depthwise_initializer="ones"
        )
        expected = [-4, -4, -6, -4, -4]

    @tapehook.binarize(activations=True)
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.conv = make()

        def call(self, x):
            return self.conv(x)

    model = Net()
    for _ in range(2):  # the first call builds and marks; both are binary
        y = np.asarray(model(x))
        first_row = y[0, :, 0] if layer == "Conv1D" else y[0, 0, :, 0]
        np.testing.assert_array_equal(first_row, expected)
