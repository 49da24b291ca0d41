"""TAPEHOOK_PACK_INPUTS=float16 (packing.py): a binary conv with a continuous
input estimator (approx_sign, swish_sign) keeps sign bits and e'(x) rounded
to binary16 instead of its float32 input. dW matches the reference; dX is
the reference's dX_hat times the binary16-rounded e'(x), computed here from
NumPy's own float16 rounding, in every execution mode and in Keras fit."""

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
    run_in_tier,
    run_mode,
    upstream,
)

CONTINUOUS = ("approx_sign", "swish_sign")


def _half_of(values32):
    """e'(x) as NumPy rounds float32 to binary16 (to nearest even)."""
    return np.asarray(values32, np.float32).astype(np.float16)


def _expected_half(name, x32):
    # e'(x) in float64 is exact for approx_sign; one rounding to float32 (as
    # the kernels compute it), then binary16.
    return _half_of(np_estimator_grad(name, np.asarray(x32, np.float64), None).astype(np.float32))


@pytest.fixture
def float16_mode(monkeypatch):
    monkeypatch.setenv("TAPEHOOK_PACK_INPUTS", "float16")


def _inputs_spanning_the_derivative(n, seed):
    """float32 x with e'(x) everywhere in binary16's range: normal values,
    subnormals (|x| within 2^-15 of 1), exact ties of binary16 rounding, 0,
    +-1, beyond 1."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1.6, 1.6, n).astype(np.float32)
    near_one = 1 - rng.uniform(0, 2.0**-15, n // 4).astype(np.float32)
    x[: n // 4] = near_one * rng.choice([-1, 1], n // 4)
    # 2 - 2|x| = 1 + (2k + 1) 2^-11: half-way between two binary16 values.
    k = rng.integers(0, 512, 64)
    x[n // 4 : n // 4 + 64] = (1 - (1 + (2 * k + 1) * 2.0**-11) / 2).astype(np.float32)
    x[-6:] = [0.0, -0.0, 1.0, -1.0, 3.0, np.nextafter(np.float32(1), np.float32(0))]
    return x


_TIER_SCRIPT = """
import sys, numpy as np, tensorflow as tf, tapehook
from tapehook import kernels
x = np.load(sys.argv[1])
lib = kernels.library()
out = {}
for name in ("approx_sign", "swish_sign"):
    h = lib.tapehook_estimator_grad_half(tf.constant(x), activation_estimator=name)
    out[name] = h.numpy().view(np.uint16)
halves = np.arange(65536, dtype=np.uint16).view(np.float16)
grad = np.linspace(-3, 3, 65536).astype(np.float32)
out["scaled"] = lib.tapehook_scale_by_half(tf.constant(grad), tf.constant(halves)).numpy()
np.savez(sys.argv[2], **out)
"""


@pytest.mark.parametrize("tier", TIERS)
def test_the_ops_round_as_numpy_in_every_tier(tmp_path, tier):
    """Each vector tier (AVX-512F, F16C, portable) and its scalar tail: e'(x)
    bit for bit NumPy's binary16 rounding (approx_sign; swish_sign within one
    binary16 step, its transcendental functions being libm's), and grad *
    every binary16 value widened exactly."""
    if kernels.library() is None:
        pytest.skip("compiled kernels not loaded")
    x = _inputs_spanning_the_derivative(20011, seed=1)  # odd length: the tails
    np.save(tmp_path / "x.npy", x)
    run_in_tier(tier, _TIER_SCRIPT, tmp_path / "x.npy", tmp_path / "out.npz")
    out = np.load(tmp_path / "out.npz")
    want = _expected_half("approx_sign", x).view(np.uint16)
    np.testing.assert_array_equal(out["approx_sign"], want)
    assert np.count_nonzero(want & 0x7C00 == 0) > 1000  # subnormals were covered
    swish = out["swish_sign"].view(np.float16).astype(np.float64)
    want_swish = _expected_half("swish_sign", x).astype(np.float64)
    np.testing.assert_allclose(swish, want_swish, rtol=2.0**-10, atol=2.0**-24)
    halves = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    grad = np.linspace(-3, 3, 65536).astype(np.float32)
    with np.errstate(invalid="ignore"):  # grad 0 times inf
        np.testing.assert_array_equal(out["scaled"], grad * halves)


def _reference(x, w0, spec, g, strides):
    """(dx with e'(x) rounded to binary16 as NumPy does, exact dx, exact dw)."""
    half = _expected_half(spec.activation_estimator, x).astype(np.float32)
    dx_exact, dw, dx16 = pack_models.references(x, w0, spec, g, strides, [half])
    return dx16, dx_exact, dw


def _reference_result(x, w0, spec, g, strides):
    from conftest import reference_result

    return reference_result(x, tf.constant(w0), spec, tf.constant(g), strides=strides)


@pytest.mark.parametrize("mode", MODE_NAMES)
@pytest.mark.parametrize("estimator", CONTINUOUS)
@pytest.mark.parametrize("shape", pack_models.GRADIENT_SHAPES)
def test_gradients_in_every_mode(float16_mode, mode, estimator, shape):
    x, w0, spec, g, strides, dx, dw = pack_models.gradients_in_mode(
        mode, estimator, pack_models.GRADIENT_SHAPES[shape]
    )
    dx16, dx_exact, want_dw = _reference(x, w0, spec, g, strides)
    # Tight, per element: the rounding of e'(x) is what it should be ...
    scale = np.abs(dx16).max()
    np.testing.assert_allclose(dx, dx16, rtol=1e-5, atol=1e-6 * scale)
    # ... which the exact dX would fail, and within 2^-11 of it.
    assert np.abs(dx_exact - dx16).max() > 1e-5 * scale
    bound = 2.0**-11 * np.abs(dx_exact) + 2.0**-24 * scale
    assert np.all(np.abs(dx - dx_exact) <= bound + 1e-6 * scale)
    assert_close(dw, want_dw, what="dW")


def test_the_backward_reads_no_float_input(float16_mode):
    """In a graph the backprops read the packed bits and the binary16 e'(x):
    the only readers of x are the forward, the packing and e'(x)."""
    _, w0 = random_inputs((1, 1, 1, 6), (3, 3, 6, 4))
    w = tapehook.mark_binary(tf.Variable(w0), activations="approx_sign")
    graph = conv_gradient_graph(w, [2, 6, 6, 6])
    readers = {op.type for op in graph.inputs[0].consumers()}
    assert readers == {"TapehookBinaryConv2D", "TapehookPackInput", "TapehookEstimatorGradHalf"}
    types = {op.type for op in graph.get_operations()}
    assert {"TapehookBinaryConv2DBackpropInputPacked", "TapehookScaleByHalf"} <= types


def test_other_dtypes_keep_x_and_stay_exact(float16_mode):
    """float64 inputs keep x (binary16 would drop 42 bits of e'(x)): their
    gradients are the reference's to float64 precision."""
    x, w0 = random_inputs((2, 5, 5, 3), (3, 3, 3, 4), dtype=tf.float64)
    spec = tapehook.BinarySpec(activations="approx_sign")
    g = upstream((2, 5, 5, 4), tf.float64)
    _, dx, dw = run_mode(
        "eager",
        x,
        w0,
        g,
        pack_models.conv,
        prepare=lambda w: tapehook.mark_binary(w, **spec.to_config()),
        loss=lambda y, g: tf.reduce_sum(y * tf.cast(g, y.dtype)),
    )
    _, want_dx, want_dw = _reference_result(x, w0.numpy(), spec, g.numpy(), [1, 1, 1, 1])
    assert_close(dx, want_dx, tf.float64, what="dX")
    assert_close(dw, want_dw, tf.float64, what="dW")


def test_an_unknown_setting_says_the_choices(monkeypatch):
    monkeypatch.setenv("TAPEHOOK_PACK_INPUTS", "fp16")
    w = tapehook.mark_binary(tf.Variable(tf.ones([3, 3, 2, 2])), activations="approx_sign")
    with pytest.raises(
        tapehook.TapehookError, match=r"TAPEHOOK_PACK_INPUTS='fp16'.*float16.*float32"
    ):
        with tf.GradientTape() as tape:
            x = tf.ones([1, 4, 4, 2])
            tape.watch(x)
            tf.nn.conv2d(x, w, 1, "SAME")


_data = pack_models.data  # for tests/helpers/mirrored_fit.py


def mirrored_variants():
    """For tests/helpers/mirrored_fit.py."""
    return pack_models.mirrored_variants(("float32", "float16"))


def test_fit_trains_as_with_float32_inputs(monkeypatch):
    """Keras fit, 4 SGD steps: the trajectory stays within binary16's
    rounding of e'(x) of the float32 one (and the stem, the only layer below
    the binary conv, receives the rounded dX)."""
    pack_models.assert_fit_near_float32(monkeypatch, "float16", rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("mode", ["eager", "tape_in_function"])
def test_the_stock_route_widens_the_kept_derivative(float16_mode, monkeypatch, mode):
    """Where the dispatcher sends the backprops to stock ops (the forward on
    the kernels), they run the reference backward on the unpacked signs with
    the widened binary16 e'(x) as the mask: the same dX."""
    x, w0, g, dx, dw = pack_models.stock_route_gradients(monkeypatch, mode)
    spec = tapehook.BinarySpec(activations="approx_sign")
    dx16, _, want_dw = _reference(x.numpy(), w0.numpy(), spec, g, [1, 1, 1, 1])
    np.testing.assert_allclose(dx, dx16, rtol=1e-5, atol=1e-6 * np.abs(dx16).max())
    assert_close(dw, want_dw, what="dW")


@pytest.mark.slow
def test_mirrored_fit_trains_as_with_float32_inputs():
    """Keras fit under MirroredStrategy (2 logical CPUs, a fresh process):
    the binary16 setting's weights within its rounding of the float32 ones,
    and not equal to them (the setting took effect in the replicas)."""
    out = fit_mirrored("test_pack_float16")
    pack_models.assert_near_float32(out["float16"], out["float32"], rtol=1e-3, atol=1e-4)
