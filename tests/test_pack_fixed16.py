"""The default compact input of a continuous input estimator (packing.py,
TAPEHOOK_PACK_INPUTS=1): a binary conv with approx_sign / swish_sign inputs
of float32 keeps sign bits and e'(x) in 16-bit fixed point,
e' = (q - offset) * step, instead of x. The format is checked against NumPy's
own rounding of the documented map; dW matches the reference, dX is the
reference's dX_hat times the quantized e'(x), within the documented bound of
the exact dX (and, for these inputs, the suite's float32 tolerance of it),
in every execution mode, on the stock route and in Keras fit."""

import numpy as np
import pytest
import tensorflow as tf

import pack_models
import tapehook
from tapehook import kernels

from conftest import (
    MODE_NAMES,
    TIERS,
    assert_close,
    conv_gradient_graph,
    fit_mirrored,
    np_estimator_grad,
    random_inputs,
    reference_result,
    run_in_tier,
    run_mode,
    upstream,
)

CONTINUOUS = ("approx_sign", "swish_sign")
# The documented map (core/pack_input.h): (offset, step) per estimator.
FORMAT = {"approx_sign": (0, np.float32(2 / 65535)), "swish_sign": (4520, np.float32(5 / 61015))}
# |quantized e' - e'| at most half a step plus float32 roundings.
BOUND = {"approx_sign": 1.55e-5, "swish_sign": 4.15e-5}


def _expected_q(name, x32):
    """q as the documented map rounds it, in NumPy."""
    exact = np_estimator_grad(name, np.asarray(x32, np.float64), None)
    if name == "approx_sign":
        # e' in float32 (one rounding of the exact value), times 32767.5 in
        # float32, to nearest even.
        return np.rint(exact.astype(np.float32) * np.float32(32767.5)).astype(np.uint16)
    exact = np.where(np.isnan(exact), 0.0, exact)
    return np.clip(np.rint(exact * (61015 / 5.0)) + 4520, 0, 65535).astype(np.uint16)


def _dequantized(name, q):
    offset, step = FORMAT[name]
    return (q.astype(np.int32) - offset).astype(np.float32) * step


def _inputs_spanning_the_derivative(n, seed):
    """float32 x over e'(x)'s whole range: both signs, |x| beyond 1, near 0
    and near 1, swish_sign's minimum near |x| = 0.687, exact ties of
    approx_sign's rounding, NaN."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1.6, 1.6, n).astype(np.float32)
    x[: n // 8] = rng.uniform(0.6, 0.8, n // 8) * rng.choice([-1, 1], n // 8)
    x[n // 8 : n // 4] = (1 - rng.uniform(0, 2.0**-14, n // 8)) * rng.choice([-1, 1], n // 8)
    # (2 - 2|x|) * 32767.5 = k + 1/2 exactly: |x| = 1 - (2k + 1) / 131070,
    # where that is a float32 value.
    k = rng.integers(0, 65535, 4096)
    ties = (1 - (2 * k + 1) / 131070).astype(np.float32)
    exact_tie = (2 - 2 * ties.astype(np.float64)) * 32767.5 % 1 == 0.5
    x[n // 4 : n // 4 + exact_tie.sum()] = ties[exact_tie]
    x[-7:] = [0.0, -0.0, 1.0, -1.0, 3.0, np.nan, np.nextafter(np.float32(1), np.float32(0))]
    return x


_TIER_SCRIPT = """
import sys, numpy as np, tensorflow as tf, tapehook
from tapehook import kernels
x = np.load(sys.argv[1])
lib = kernels.library()
out = {}
q = np.arange(65536, dtype=np.uint16)
grad = np.linspace(-3, 3, 65536).astype(np.float32)
for name in ("approx_sign", "swish_sign"):
    out[name] = lib.tapehook_estimator_grad_fixed(
        tf.constant(x), activation_estimator=name).numpy()
    out["scaled_" + name] = lib.tapehook_scale_by_fixed(
        tf.constant(grad), tf.constant(q), activation_estimator=name).numpy()
np.savez(sys.argv[2], **out)
"""


@pytest.mark.parametrize("tier", TIERS)
def test_the_ops_round_as_numpy_in_every_tier(tmp_path, tier):
    """Each vector tier (AVX-512F, AVX2, portable) and its scalar tail: q bit
    for bit NumPy's rounding of the documented map (approx_sign; swish_sign
    within one step, its transcendental functions being libm's), and grad
    times every one of the 65536 values e' can take."""
    if kernels.library() is None:
        pytest.skip("compiled kernels not loaded")
    x = _inputs_spanning_the_derivative(20011, seed=1)  # odd length: the tails
    np.save(tmp_path / "x.npy", x)
    run_in_tier(tier, _TIER_SCRIPT, tmp_path / "x.npy", tmp_path / "out.npz")
    out = np.load(tmp_path / "out.npz")
    want = _expected_q("approx_sign", x)
    np.testing.assert_array_equal(out["approx_sign"], want)
    assert np.count_nonzero(want % 2 == 0) > np.count_nonzero(want % 2 == 1)  # ties went even
    swish = out["swish_sign"].astype(np.int64)
    assert np.abs(swish - _expected_q("swish_sign", x)).max() <= 1
    q = np.arange(65536, dtype=np.uint16)
    grad = np.linspace(-3, 3, 65536).astype(np.float32)
    for name in CONTINUOUS:
        np.testing.assert_array_equal(out["scaled_" + name], grad * _dequantized(name, q))


@pytest.mark.parametrize("name", CONTINUOUS)
def test_the_kept_derivative_is_within_its_bound(name):
    """What the backward multiplies by is within the documented absolute
    bound of the exact e'(x), over the whole range, and covers it (e' = 0
    and the maximum are represented exactly)."""
    if kernels.library() is None:
        pytest.skip("compiled kernels not loaded")
    x = _inputs_spanning_the_derivative(50000, seed=2)
    lib = kernels.library()
    q = lib.tapehook_estimator_grad_fixed(tf.constant(x), activation_estimator=name)
    got = lib.tapehook_scale_by_fixed(tf.ones_like(x), q, activation_estimator=name).numpy()
    exact = np_estimator_grad(name, x.astype(np.float64), None)
    exact = np.where(np.isnan(exact), 0.0, exact)
    err = np.abs(got - exact)
    assert err.max() <= BOUND[name], err.max()
    assert err.max() > BOUND[name] / 2  # the bound is the step's, not loose
    assert got[x == 3.0][0] == 0.0 and got[x == 0.0][0] == (2.0 if name == "approx_sign" else 5.0)


def _references(x, w0, spec, g, strides):
    """(dx with e'(x) quantized as NumPy does, dX_hat, exact dx, exact dw)."""
    name = spec.activation_estimator
    fixed = _dequantized(name, _expected_q(name, x))
    dx_exact, dw, dx_fixed, dx_hat = pack_models.references(
        x, w0, spec, g, strides, [fixed, np.ones_like(fixed)]
    )
    return dx_fixed, dx_hat, dx_exact, dw


@pytest.mark.parametrize("mode", MODE_NAMES)
@pytest.mark.parametrize("estimator", CONTINUOUS)
@pytest.mark.parametrize("shape", pack_models.GRADIENT_SHAPES)
def test_gradients_in_every_mode(mode, estimator, shape):
    x, w0, spec, g, strides, dx, dw = pack_models.gradients_in_mode(
        mode, estimator, pack_models.GRADIENT_SHAPES[shape]
    )
    dx_fixed, dx_hat, dx_exact, want_dw = _references(x, w0, spec, g, strides)
    scale = np.abs(dx_exact).max()
    # Per element, the kept e'(x) is what the format says ...
    np.testing.assert_allclose(dx, dx_fixed, rtol=1e-5, atol=1e-6 * scale)
    # ... which is not the exact e'(x) (the setting took effect), within the
    # format's bound of it and within the suite's float32 tolerance.
    assert np.abs(dx_exact - dx_fixed).max() > 1e-7 * scale
    bound = BOUND[estimator] * np.abs(dx_hat) + 1e-6 * scale
    assert np.all(np.abs(dx - dx_exact) <= bound)
    assert_close(dx, dx_exact, what="dX")
    assert_close(dw, want_dw, what="dW")


@pytest.mark.parametrize("estimator", CONTINUOUS)
def test_the_backward_reads_no_float_input(estimator):
    """In a graph the backprops read the packed bits and the fixed-point
    e'(x): the only readers of x are the forward, the packing and e'(x)."""
    _, w0 = random_inputs((1, 1, 1, 6), (3, 3, 6, 4))
    w = tapehook.mark_binary(tf.Variable(w0), activations=estimator)
    graph = conv_gradient_graph(w, [2, 6, 6, 6])
    readers = {op.type for op in graph.inputs[0].consumers()}
    assert readers == {"TapehookBinaryConv2D", "TapehookPackInput", "TapehookEstimatorGradFixed"}
    types = {op.type for op in graph.get_operations()}
    assert {"TapehookBinaryConv2DBackpropInputPacked", "TapehookScaleByFixed"} <= types


@pytest.mark.parametrize("setting", ["float32", "gpu"])
def test_float32_setting_and_gpu_machines_keep_x(monkeypatch, setting):
    """TAPEHOOK_PACK_INPUTS=float32, or a machine with a GPU (the fixed-point
    ops are CPU kernels), keeps x: the backprops read it and dX is the
    reference's float32 math."""
    if setting == "float32":
        monkeypatch.setenv("TAPEHOOK_PACK_INPUTS", "float32")
    else:
        real = tf.config.list_logical_devices
        fake = tf.config.LogicalDevice("/device:GPU:0", "GPU")
        monkeypatch.setattr(
            tf.config,
            "list_logical_devices",
            lambda kind=None: [fake] if kind == "GPU" else real(kind),
        )
    _, w0 = random_inputs((1, 1, 1, 6), (3, 3, 6, 4))
    w = tapehook.mark_binary(tf.Variable(w0), activations="approx_sign")
    graph = conv_gradient_graph(w, [2, 6, 6, 6])
    readers = {op.type for op in graph.inputs[0].consumers()}
    assert "TapehookPackInput" not in readers and "TapehookBinaryConv2DBackpropInput" in readers
    if setting == "float32":
        x, w0 = random_inputs((2, 6, 6, 5), (3, 3, 5, 4))
        spec = tapehook.BinarySpec(activations="approx_sign")
        g = upstream((2, 6, 6, 4), tf.float32).numpy()
        _, dx, _ = run_mode(
            "tape_in_function",
            x,
            w0,
            g,
            pack_models.conv,
            prepare=lambda w: tapehook.mark_binary(w, **spec.to_config()),
        )
        _, want_dx, _ = reference_result(x, w0, spec, tf.constant(g))
        np.testing.assert_allclose(dx, want_dx, rtol=1e-6, atol=1e-6 * np.abs(want_dx).max())


@pytest.mark.parametrize("mode", ["eager", "tape_in_function"])
def test_the_stock_route_widens_the_kept_derivative(monkeypatch, mode):
    """Where the dispatcher sends the backprops to stock ops (the forward on
    the kernels), they run the reference backward on the unpacked signs with
    the dequantized e'(x) as the mask: the same dX."""
    x, w0, g, dx, dw = pack_models.stock_route_gradients(monkeypatch, mode)
    spec = tapehook.BinarySpec(activations="approx_sign")
    dx_fixed, _, _, want_dw = _references(x.numpy(), w0.numpy(), spec, g, [1, 1, 1, 1])
    np.testing.assert_allclose(dx, dx_fixed, rtol=1e-5, atol=1e-6 * np.abs(dx_fixed).max())
    assert_close(dw, want_dw, what="dW")


_data = pack_models.data  # for tests/helpers/mirrored_fit.py


def mirrored_variants():
    """For tests/helpers/mirrored_fit.py."""
    return pack_models.mirrored_variants(("float32", "1"))


def test_fit_trains_as_with_float32_inputs(monkeypatch):
    """Keras fit, 4 SGD steps: the default setting's trajectory stays within
    float32 rounding-noise distance of the exact one (tighter than binary16's,
    tests/test_pack_float16.py) and is not bit-identical to it."""
    pack_models.assert_fit_near_float32(monkeypatch, "1", rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_mirrored_fit_trains_as_with_float32_inputs():
    """Keras fit under MirroredStrategy (2 logical CPUs, a fresh process):
    the default setting's weights within its rounding of the float32 ones,
    and not equal to them (the setting took effect in the replicas)."""
    out = fit_mirrored("test_pack_fixed16")
    pack_models.assert_near_float32(out["1"], out["float32"], rtol=1e-4, atol=1e-5)
