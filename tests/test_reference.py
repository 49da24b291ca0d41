"""The reference itself against a direct NumPy transcription of the math, and
the forced reference path (what runs when the kernels are unavailable)."""

import numpy as np
import pytest
import tensorflow as tf

import tapehook
from tapehook import kernels, reference

from conftest import (
    MODES,
    SPEC_IDS,
    SPECS,
    assert_close,
    np_estimator_grad,
    np_sign,
    random_inputs,
    reference_result,
    spec_kwargs,
    upstream,
)


def numpy_binary_conv(x, w, g, spec, stride, pads, dil):
    """y, dx, dw by explicit loops over output pixels and taps; a tap in the
    padding reads x_hat = spec.pad_value."""
    n, h, wd, cin = x.shape
    kh, kw, _, cout = w.shape
    pt, pb, pl, pr = pads
    oh = (h + pt + pb - (kh - 1) * dil - 1) // stride + 1
    ow = (wd + pl + pr - (kw - 1) * dil - 1) // stride + 1
    act = spec.activation_estimator
    xh = np_sign(x) if act else x
    alpha = np.abs(w).mean(axis=(0, 1, 2)) if spec.scale == "mean_abs" else np.ones(cout)
    what = np_sign(w) * alpha if spec.weights else w
    pad = np.full(cin, spec.pad_value)
    y = np.zeros((n, oh, ow, cout))
    dxh = np.zeros_like(x)
    dwh = np.zeros_like(w)
    for b in range(n):
        for i in range(oh):
            for j in range(ow):
                for a in range(kh):
                    for c in range(kw):
                        r, s = i * stride - pt + a * dil, j * stride - pl + c * dil
                        if 0 <= r < h and 0 <= s < wd:
                            y[b, i, j] += xh[b, r, s] @ what[a, c]
                            dxh[b, r, s] += what[a, c] @ g[b, i, j]
                            dwh[a, c] += np.outer(xh[b, r, s], g[b, i, j])
                        else:  # a padded tap
                            y[b, i, j] += pad @ what[a, c]
                            dwh[a, c] += np.outer(pad, g[b, i, j])
    dx = dxh * np_estimator_grad(act, x, spec.activation_clip, spec.beta) if act else dxh
    dw = dwh * alpha * np_estimator_grad(spec.ste, w, spec.clip, spec.beta) if spec.weights else dwh
    return y, dx, dw


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize(
    "stride,pads,dil",
    [(1, (1, 1, 1, 1), 1), (2, (0, 2, 1, 0), 1), (1, (2, 2, 2, 2), 2), (2, (0, 0, 0, 0), 1)],
)
def test_reference_matches_numpy(spec, stride, pads, dil):
    x, w = random_inputs((2, 6, 7, 3), (3, 2, 3, 4), tf.float64, seed=stride + dil)
    conv = dict(
        padding="EXPLICIT",
        explicit_paddings=[0, 0, *pads, 0, 0],
        strides=[1, stride, stride, 1],
        dilations=[1, dil, dil, 1],
    )
    y0 = reference.binary_conv2d(x, w, spec, **conv)
    g = upstream(y0.shape, tf.float64)
    y, dx, dw = reference_result(x, w, spec, g, **conv)
    ny, ndx, ndw = numpy_binary_conv(x.numpy(), w.numpy(), g.numpy(), spec, stride, pads, dil)
    assert_close(y, ny, tf.float64, "forward")
    assert_close(dx, ndx, tf.float64, "dX")
    assert_close(dw, ndw, tf.float64, "dW")


@pytest.mark.parametrize("spec", SPECS[:4], ids=SPEC_IDS[:4])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_forced_reference_path(mode, spec):
    kernels.force_reference(True)
    x, w0 = random_inputs((2, 5, 5, 3), (3, 3, 3, 4))
    g = upstream((2, 5, 5, 4), tf.float32)
    y, dx, dw = MODES[mode](x, w0, g, {}, lambda w: tapehook.mark_binary(w, **spec_kwargs(spec)))
    ry, rdx, rdw = reference_result(x, w0, spec, g)
    assert_close(y, ry, what="forward")
    assert_close(dx, rdx, what="dX")
    assert_close(dw, rdw, what="dW")
    counts = tapehook.dispatch_counts()
    assert counts["compiled"] == dict(forward=0, backprop_input=0, backprop_filter=0)
    assert counts["reference"]["forward"] >= 1 and counts["reference"]["backprop_filter"] >= 1
    assert tapehook.kernel_info()["cpu"]["forced_reference"] is True
