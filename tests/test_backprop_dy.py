"""tapehook.config(backprop_dy="bf16x2") (default: TAPEHOOK_BACKPROP_DY):
the AMX backprops split dy into two bf16 parts instead of three
(cc_kernels/core/amx_conv.h), told so by the backprop ops' backprop_dy attr. dX and dW against the
float64 reference within the documented bound (2^-16 of the sum of the
absolute products, plus fp32 accumulation) in every execution mode; that the
setting changes the results where AMX runs them and nothing elsewhere; that
a bad value is an error naming the valid ones. tests/cc/test_amx_conv.cc
holds single products to the two-part split's model bit for bit."""

import numpy as np
import pytest
import tensorflow as tf

import tapehook
from tapehook import kernels

from conftest import MODES, random_inputs, reference_result, spec_kwargs, upstream

# A stride-1 layer the AMX backprops take (a Bi-Real-Net block's, narrower).
X_SHAPE, W_SHAPE = (2, 12, 12, 64), (3, 3, 64, 64)
SPEC = tapehook.BinarySpec(activations=True, scale="mean_abs")
CONV = {"strides": 1, "padding": "SAME"}


def _run(mode, monkeypatch, setting, env=None):
    """The conv's (x, w0, g, dX, dW) in ``mode`` with ``setting`` in a
    tapehook.config block (None: no block) and ``env`` as
    TAPEHOOK_BACKPROP_DY (None: unset)."""
    if env is None:
        monkeypatch.delenv("TAPEHOOK_BACKPROP_DY", raising=False)
    else:
        monkeypatch.setenv("TAPEHOOK_BACKPROP_DY", env)
    x, w0 = random_inputs(X_SHAPE, W_SHAPE, seed=3)
    g = upstream(X_SHAPE[:3] + W_SHAPE[3:], tf.float32, seed=4)
    settings = {"dispatch": "kernels"}
    if setting is not None:
        settings["backprop_dy"] = setting
    with tapehook.config(**settings):
        _, dx, dw = MODES[mode](
            x, w0, g, CONV, lambda w: tapehook.mark_binary(w, **spec_kwargs(SPEC))
        )
    return x, w0, g, np.asarray(dx), np.asarray(dw)


def _within_bound(got, expected, abs_sum, terms, what):
    # The two-part split: 2^-16 of each product; fp32 accumulation of
    # `terms` products: terms * 2^-24 of their absolute sum (the worst case).
    bound = (2.0**-16 + terms * 2.0**-24) * abs_sum + 1e-30
    excess = np.abs(got - expected) - bound
    assert np.max(excess) <= 0, f"{what}: exceeds its bound by {np.max(excess)}"


@pytest.mark.parametrize("mode", sorted(MODES))
def test_bf16x2_backprops_within_bound(mode, monkeypatch):
    x, w0, g, dx, dw = _run(mode, monkeypatch, "bf16x2")
    x64, w64, g64 = (tf.cast(t, tf.float64) for t in (x, w0, g))
    _, rdx, rdw = reference_result(x64, w64, SPEC, g64)
    # Sums of the absolute products: sign(w) -> +1 (|w|, the same alpha) with
    # |g| for dX; sign(x) -> +1 (|x|) with |g| for dW (e'(W) and alpha >= 0).
    _, sdx, _ = reference_result(x64, tf.abs(w64), SPEC, tf.abs(g64))
    _, _, sdw = reference_result(tf.abs(x64), w64, SPEC, tf.abs(g64))
    taps_out = W_SHAPE[0] * W_SHAPE[1] * W_SHAPE[3]
    _within_bound(dx, rdx.numpy(), np.abs(sdx.numpy()), taps_out, "dX")
    _within_bound(dw, rdw.numpy(), np.abs(sdw.numpy()), X_SHAPE[0] * X_SHAPE[1] * X_SHAPE[2], "dW")
    assert tapehook.dispatch_counts()["compiled"]["backprop_input"] >= 1


def test_bf16x2_changes_only_the_amx_backprops(monkeypatch):
    _, _, _, dx2, dw2 = _run("tape_in_function", monkeypatch, "bf16x2")
    _, _, _, dx3, dw3 = _run("tape_in_function", monkeypatch, None)
    _, _, _, dxe, dwe = _run("tape_in_function", monkeypatch, "exact")
    np.testing.assert_array_equal(dx3, dxe)  # unset is "exact"
    np.testing.assert_array_equal(dw3, dwe)
    if kernels.amx_usable():
        assert not np.array_equal(dx2, dx3) and not np.array_equal(dw2, dw3)
    else:  # the sign-table and GEMM kernels are exact fp32: no setting to honour
        np.testing.assert_array_equal(dx2, dx3)
        np.testing.assert_array_equal(dw2, dw3)


def test_environment_is_the_default(monkeypatch):
    _, _, _, dx_env, dw_env = _run("tape_in_function", monkeypatch, None, env="bf16x2")
    _, _, _, dx2, dw2 = _run("tape_in_function", monkeypatch, "bf16x2")
    _, _, _, dx3, dw3 = _run("tape_in_function", monkeypatch, "exact", env="bf16x2")
    np.testing.assert_array_equal(dx_env, dx2)
    np.testing.assert_array_equal(dw_env, dw2)
    _, _, _, dxe, dwe = _run("tape_in_function", monkeypatch, None)
    np.testing.assert_array_equal(dx3, dxe)  # Python's setting wins
    np.testing.assert_array_equal(dw3, dwe)


def test_bad_setting_is_an_error(monkeypatch):
    with pytest.raises(tapehook.TapehookError, match="backprop_dy='bf16'.*bf16x2"):
        _run("eager", monkeypatch, "bf16")
    with pytest.raises(tapehook.TapehookError, match="TAPEHOOK_BACKPROP_DY='bf16'.*bf16x2"):
        _run("eager", monkeypatch, None, env="bf16")
