"""The ste_sign mask is exactly 1{|t| <= clip} for t in the input's dtype, on
every dispatch path (auto, kernels, stock) and in every execution mode."""

import numpy as np
import pytest
import tensorflow as tf

import tapehook

from conftest import run_mode, spec_kwargs


def _boundary(dtype, clip):
    """Values at and just around clip, representable in dtype."""
    np_dtype = tf.as_dtype(dtype).as_numpy_dtype
    c = np_dtype(clip)
    return np.array(
        [c, np.nextafter(c, np_dtype(0)), np.nextafter(c, np_dtype(1)), -c, 0.5 * c, 2 * c],
        np_dtype,
    )


@pytest.mark.parametrize("path", ["auto", "kernels", "stock"])
@pytest.mark.parametrize("dtype", [tf.float64, tf.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("mode", ["eager", "tape_in_function", "v1_gradients"])
def test_ste_clip_mask_is_exact_in_the_input_dtype(path, dtype, mode, monkeypatch):
    monkeypatch.setenv("TAPEHOOK_DISPATCH", path)
    clip = 0.1
    vals = _boundary(dtype, clip)
    # 1x1 conv, one input and one output channel: dW = sum(x_hat dy) * e'(W)
    # per tap and dX = W_hat dy * e'(x): the masks show directly.
    x = vals.reshape(1, 1, len(vals), 1).astype(np.float64)
    w0 = np.array(vals[:1]).reshape(1, 1, 1, 1).astype(np.float64)
    g = np.ones((1, 1, len(vals), 1))
    spec = tapehook.BinarySpec(activations=True, clip=clip)

    def forward(x, w):
        return tf.nn.conv2d(tf.cast(x, dtype), w, 1, "VALID")

    def prepare(w):
        tapehook.mark_binary(w, **spec_kwargs(spec))

    x_d = x.astype(tf.as_dtype(dtype).as_numpy_dtype)
    w_d = w0.astype(tf.as_dtype(dtype).as_numpy_dtype)
    y, dx, dw = run_mode(
        mode,
        x_d,
        w_d,
        g.astype(x_d.dtype),
        forward,
        prepare=prepare,
        loss=lambda y, g: tf.reduce_sum(y * g),
    )
    # exact: compare the stored values themselves with the Python double clip
    mask_x = (np.abs(vals.astype(np.float64)) <= clip).astype(float)
    np.testing.assert_array_equal(np.asarray(dx).reshape(-1), mask_x)
    w_mask = float(abs(np.float64(vals[0])) <= clip)
    assert np.asarray(dw).reshape(-1)[0] == w_mask * np.sum(np.where(vals >= 0, 1.0, -1.0))
