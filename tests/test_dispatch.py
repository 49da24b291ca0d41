"""The dispatcher's documented choices (tapehook/dispatch.py) and their results."""

import numpy as np
import pytest
import tensorflow as tf

import tapehook
from tapehook import compat, dispatch, kernels

from conftest import MODES, assert_close, random_inputs, reference_result, upstream

NONE = dict(forward=0, backprop_input=0, backprop_filter=0)
ONE = dict(forward=1, backprop_input=1, backprop_filter=1)


FWD_ONLY = dict(forward=1, backprop_input=0, backprop_filter=0)


@pytest.fixture
def switches():
    """Pins the kernels' TAPEHOOK_NO_* switches (set_switches_for_test), and
    puts the environment's back afterwards."""
    yield kernels.set_switches_for_test
    kernels.set_switches_for_test(None, None, None)


def _complement(compiled):
    return {k: 1 - v for k, v in compiled.items()}


@pytest.mark.parametrize("cpu", ["gemm_only", "avx512", "amx"])
@pytest.mark.parametrize(
    "activations,dilation,stride,gemm_only,avx512,amx",
    [
        # weight-only: a forward on stock takes the whole conv there (the
        # reference route differentiates itself); on AMX (stride 1) all kernels
        (False, 1, 1, NONE, NONE, ONE),
        # bitpacked forward; backprops stock, sign-table or AMX kernels
        (True, 1, 1, FWD_ONLY, ONE, ONE),
        # dilated: kernels
        (True, 2, 1, ONE, ONE, ONE),
        # strided: the AMX kernels take stride 1 only
        (False, 1, 2, NONE, NONE, NONE),
    ],
)
@pytest.mark.parametrize("mode", ["eager", "tape_in_function", "v1_gradients"])
def test_auto_routes_and_matches_reference(
    monkeypatch, switches, mode, activations, dilation, stride, gemm_only, avx512, amx, cpu
):
    """``cpu``: the tiers the kernels may use (the switches take the others
    away): the im2col GEMM only, AVX-512 without AMX, or everything."""
    monkeypatch.setenv("TAPEHOOK_DISPATCH", "auto")
    if cpu == "amx" and not tapehook.kernel_info()["cpu"].get("amx"):
        pytest.skip("this CPU (or build) has no AMX kernels")
    if cpu != "amx":
        switches(no_amx=True, no_avx512=cpu == "gemm_only")
    if cpu == "avx512" and "avx512" not in kernels.conv_capabilities(
        "backprop_input", SAME, "float32", (2, 32, 32, 3), (3, 3, 3, 4)
    ):
        pytest.skip("this CPU has no AVX-512 sign-table backprops")
    compiled = {"gemm_only": gemm_only, "avx512": avx512, "amx": amx}[cpu]
    if cpu == "gemm_only" and compiled["forward"] and not compat.onednn_enabled():
        # plan avx2 beats Eigen's backprops: dX (GEMM), a binary input's dW (sign tables)
        compiled = dict(compiled, backprop_input=1, backprop_filter=int(activations))
    if cpu == "amx" and not activations and stride == 1 and compat.onednn_enabled():
        compiled = dict(ONE, backprop_filter=0)  # the weight-only dW stays on oneDNN
    reference = _complement(compiled)
    spec = tapehook.BinarySpec(activations=activations, scale="mean_abs")
    # 2 x 32 x 32 pixels: big enough for every AMX route
    x, w0 = random_inputs((2, 32, 32, 3), (3, 3, 3, 4))
    out = 32 if stride == 1 else 16
    g = upstream((2, out, out, 4), tf.float32)
    conv = dict(padding="SAME", dilations=dilation, strides=stride)
    y, dx, dw = MODES[mode](
        x, w0, g, conv, lambda w: tapehook.mark_binary(w, activations=activations, scale="mean_abs")
    )
    ry, rdx, rdw = reference_result(
        x, w0, spec, g, strides=[1, stride, stride, 1], dilations=[1, dilation, dilation, 1]
    )
    assert_close(y, ry, what="forward")
    assert_close(dx, rdx, what="dX")
    assert_close(dw, rdw, what="dW")
    counts = tapehook.dispatch_counts()
    assert counts["compiled"] == compiled and counts["reference"] == reference


@pytest.mark.parametrize(
    "activations,x_shape,w_shape,compiled",
    [
        # 1x1: dW on stock (fewer taps than AMX_MIN_TAPS) unless the input was
        # kept packed; the forward and dX on AMX
        (False, (2, 16, 16, 3), (1, 1, 3, 4), dict(ONE, backprop_filter=0)),
        (True, (2, 32, 32, 3), (1, 1, 3, 4), ONE),
        # fewer pixels than AMX_MIN_PIXELS: not AMX; a weight-only conv all
        # stock, a binary-input one's backprops on the sign-table kernels
        # (AMX CPUs have AVX-512)
        (False, (1, 10, 10, 3), (3, 3, 3, 4), NONE),
        (True, (1, 10, 10, 3), (3, 3, 3, 4), ONE),
        # 7x7 images: a dW from float x (approx_sign under
        # TAPEHOOK_PACK_INPUTS=float32 keeps x, not bits) not on
        # AMX but on the sign-table kernels; from packed bits (ste_sign) on AMX
        ("approx_sign", (4, 7, 7, 3), (3, 3, 3, 4), ONE),
        (True, (4, 7, 7, 3), (3, 3, 3, 4), ONE),
    ],
)
def test_auto_keeps_small_float_convs_off_amx(monkeypatch, activations, x_shape, w_shape, compiled):
    monkeypatch.setenv("TAPEHOOK_DISPATCH", "auto")
    monkeypatch.setenv("TAPEHOOK_PACK_INPUTS", "float32" if activations == "approx_sign" else "1")
    if not tapehook.kernel_info()["cpu"].get("amx"):
        pytest.skip("this CPU (or build) has no AMX kernels")
    x, w0 = random_inputs(x_shape, w_shape)
    g = upstream(x_shape[:3] + w_shape[3:], tf.float32)
    spec = tapehook.BinarySpec(activations=activations, scale="mean_abs")
    y, dx, dw = MODES["eager"](
        x,
        w0,
        g,
        dict(padding="SAME"),
        lambda w: tapehook.mark_binary(w, activations=activations, scale="mean_abs"),
    )
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
    for signature in (
        [tf.TensorSpec(None, tf.float32)],
        [tf.TensorSpec([None, 9, 9, 3], tf.float32)],
    ):

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


# The dispatcher's rule as a table: (op, conv, capabilities, policy / oneDNN)
# -> STOCK or a plan. No kernels or AMX needed: the capabilities are given.
# What the capability query gives: "avx512" for a backprop means the
# sign-table kernels can run it (a ±1 operand, float32, undilated).
AMX = frozenset({"amx", "avx512", "avx2", "portable"})
NO_AMX = frozenset({"avx512", "avx2", "portable"})
GEMM = frozenset({"avx2", "portable"})
AMX_GEMM = frozenset({"amx", "avx2", "portable"})  # e.g. a weight-only dW on AMX
SAME = dict(strides=[1, 1, 1, 1], padding="SAME", explicit_paddings=[], dilations=[1, 1, 1, 1])
DILATED = dict(SAME, dilations=[1, 2, 2, 1])
EXPLICIT = dict(SAME, padding="EXPLICIT", explicit_paddings=[0, 0, 1, 1, 1, 1, 0, 0])
BIG, SMALL, TINY_IMAGE = (2, 32, 32, 8), (1, 10, 10, 8), (16, 4, 4, 8)
STRIDED = dict(SAME, strides=[1, 2, 2, 1])
K3, K1 = (3, 3, 8, 16), (1, 1, 8, 16)
FWD, DX, DW = "forward", "backprop_input", "backprop_filter"
TABLE = [
    # (op, attrs, x_shape, w_shape, binary_input, packed, capabilities, policy,
    #  onednn, expected)
    # policies other than auto
    (FWD, SAME, SMALL, K3, False, False, AMX, "kernels", True, "amx"),
    (FWD, SAME, SMALL, K3, True, False, NO_AMX, "kernels", True, "avx512"),
    (DW, SAME, BIG, K3, False, False, GEMM, "kernels", True, "avx2"),
    (FWD, SAME, BIG, K3, True, False, AMX, "stock", False, "stock"),
    (DX, SAME, BIG, K3, True, True, frozenset({"portable"}), "kernels", False, "portable"),
    # no kernels loaded: stock whatever the policy
    (FWD, SAME, BIG, K3, True, False, frozenset(), "kernels", False, "stock"),
    # the bitpacked forward runs everywhere, at the best tier
    (FWD, SAME, SMALL, K1, True, False, NO_AMX, "auto", True, "avx512"),
    (FWD, SAME, SMALL, K1, True, False, GEMM, "auto", True, "avx2"),
    # float-operand convs: AMX when it can run them and they are big enough
    (FWD, SAME, BIG, K3, False, False, AMX, "auto", True, "amx"),
    (FWD, SAME, BIG, K3, False, False, NO_AMX, "auto", True, "stock"),
    (FWD, SAME, SMALL, K3, False, False, AMX, "auto", True, "stock"),
    (FWD, EXPLICIT, BIG, K3, False, False, AMX, "auto", True, "stock"),
    (FWD, SAME, None, None, False, False, AMX, "auto", True, "amx"),  # unknown: large
    (DX, SAME, BIG, K3, True, False, AMX, "auto", True, "amx"),
    (DX, SAME, BIG, K1, False, False, AMX, "auto", True, "amx"),  # 1x1 dX wins
    # without AMX: backprops with a ±1 operand on the sign-table kernels,
    # whatever the size; without them (no AVX-512): stock
    (DX, SAME, BIG, K3, True, False, NO_AMX, "auto", True, "avx512"),
    (DX, SAME, SMALL, K1, False, False, NO_AMX, "auto", True, "avx512"),
    (DW, SAME, BIG, K3, True, True, NO_AMX, "auto", False, "avx512"),
    (DW, SAME, TINY_IMAGE, K3, True, False, NO_AMX, "auto", True, "avx512"),
    (DX, SAME, BIG, K3, True, False, GEMM, "auto", True, "stock"),
    (DW, SAME, BIG, K3, True, True, GEMM, "auto", True, "stock"),
    # ... unless TF runs Eigen's convolutions (oneDNN off): plan avx2 for dX
    # (its GEMM), binary input or not, and for a binary input's dW (its sign
    # tables), from packed bits or floats; a float input's dW stays stock
    (DX, SAME, BIG, K3, True, False, GEMM, "auto", False, "avx2"),
    (DX, SAME, SMALL, K1, False, False, GEMM, "auto", False, "avx2"),
    (DW, SAME, BIG, K3, True, True, GEMM, "auto", False, "avx2"),
    (DW, SAME, BIG, K3, True, False, GEMM, "auto", False, "avx2"),
    (DW, SAME, TINY_IMAGE, K1, True, True, GEMM, "auto", False, "avx2"),
    (DW, SAME, BIG, K3, False, False, GEMM, "auto", False, "stock"),
    (DX, SAME, BIG, K3, True, False, frozenset({"portable"}), "auto", False, "stock"),
    # ... and where AMX does not pay: AMX too small -> sign-table kernels
    (DX, SAME, SMALL, K3, True, False, AMX, "auto", True, "avx512"),
    (DX, EXPLICIT, BIG, K3, True, False, AMX, "auto", True, "avx512"),
    # dW: 1x1 from floats not on AMX (sign-table), from packed bits on AMX
    (DW, SAME, BIG, K1, True, False, AMX, "auto", True, "avx512"),
    (DW, SAME, BIG, K1, True, True, AMX, "auto", True, "amx"),
    # dX over small images (4x4 dy): the sign-table kernel beats AMX's;
    # a binary-input dW (from floats or packed bits) stays on AMX ...
    (DW, SAME, TINY_IMAGE, K3, True, False, AMX, "auto", True, "amx"),
    (DW, SAME, TINY_IMAGE, K3, True, True, AMX, "auto", True, "amx"),
    (DX, SAME, TINY_IMAGE, K3, True, False, AMX, "auto", True, "avx512"),
    (DX, SAME, TINY_IMAGE, K3, False, False, AMX, "auto", True, "avx512"),
    (DX, SAME, TINY_IMAGE, K3, True, True, AMX, "auto", False, "avx512"),
    # ... where they can run it; else AMX as on larger images
    (DX, SAME, TINY_IMAGE, K3, True, False, AMX_GEMM, "auto", True, "amx"),
    (DW, SAME, TINY_IMAGE, K3, True, True, AMX_GEMM, "auto", True, "amx"),
    # (a weight-only dW has no ±1 operand: not affected)
    (DW, SAME, TINY_IMAGE, K3, False, False, AMX_GEMM, "auto", False, "amx"),
    # from 7x7 pixels of dy on: AMX; a stride-2 dX counts dy's image (7x7
    # x: 4x4 dy, 14x14 x: 7x7 dy); VALID shrinks it (9x9 x, 3x3: 7x7 dy)
    (DX, SAME, (16, 7, 7, 8), K3, True, True, AMX, "auto", True, "amx"),
    (DX, STRIDED, (16, 7, 7, 8), K3, True, True, AMX, "auto", True, "avx512"),
    (DX, STRIDED, (16, 14, 14, 8), K3, True, True, AMX, "auto", True, "amx"),
    (DX, dict(SAME, padding="VALID"), (16, 9, 9, 8), K3, True, True, AMX, "auto", True, "amx"),
    (DX, dict(SAME, padding="VALID"), (16, 8, 8, 8), K3, True, True, AMX, "auto", True, "avx512"),
    (DW, STRIDED, (16, 7, 7, 8), K3, True, True, AMX, "auto", True, "amx"),
    (DW, SAME, (16, 10, 10, 8), K3, True, True, AMX, "auto", True, "amx"),
    (DX, SAME, (16, 10, 10, 8), K3, True, False, AMX, "auto", True, "amx"),
    # weight-only dW (float x float, no sign-table kernel): oneDNN's
    # backprop-filter when TF runs it
    (DW, SAME, BIG, K3, False, False, AMX_GEMM, "auto", True, "stock"),
    (DW, SAME, BIG, K3, False, False, AMX_GEMM, "auto", False, "amx"),
    (DW, SAME, BIG, K3, False, False, GEMM, "auto", True, "stock"),
    # dilated backprops: the kernels (stock CPU backprops reject dilation)
    (DX, DILATED, SMALL, K3, True, False, NO_AMX, "auto", True, "avx512"),
    (DW, DILATED, SMALL, K3, False, False, GEMM, "auto", True, "avx2"),
    (DW, DILATED, BIG, K3, False, False, AMX, "auto", True, "amx"),
]


@pytest.mark.parametrize(
    "op,attrs,x_shape,w_shape,binary_input,packed,capabilities,policy,onednn,expected", TABLE
)
def test_choose_table(
    op, attrs, x_shape, w_shape, binary_input, packed, capabilities, policy, onednn, expected
):
    assert (
        dispatch.choose(
            op,
            policy=policy,
            capabilities=capabilities,
            attrs=attrs,
            x_shape=x_shape,
            w_shape=w_shape,
            binary_input=binary_input,
            packed=packed,
            onednn=onednn,
        )
        == expected
    )


def test_capability_query_follows_switches_and_scope(switches):
    """The C++ query (kernels.conv_capabilities) on this CPU: the switches
    take tiers away; AMX never runs float64 convs nor a strided forward, and
    runs strided backprops (by phases) where it runs the stride-1 ones."""
    features = tapehook.kernel_info()["cpu"]
    full = kernels.conv_capabilities(FWD, SAME, "float32", BIG, K3, binary_input=True)
    assert "portable" in full and "amx" not in full
    switches(no_avx512=True)
    assert "avx512" not in kernels.conv_capabilities(
        FWD, SAME, "float32", BIG, K3, binary_input=True
    )
    switches(no_avx2=True)
    for op in (FWD, DX, DW):
        assert kernels.conv_capabilities(op, SAME, "float32", BIG, K3) == {"portable"}
    switches(None, None, None)
    strided = dict(SAME, strides=[1, 2, 2, 1])
    assert "amx" not in kernels.conv_capabilities(FWD, strided, "float32", BIG, K3)
    for op in (FWD, DX, DW):
        assert "amx" not in kernels.conv_capabilities(op, SAME, "float64", BIG, K3)
        if op != FWD:
            assert ("amx" in kernels.conv_capabilities(op, strided, "float32", BIG, K3)) == bool(
                features.get("amx")
            )
        assert ("amx" in kernels.conv_capabilities(op, SAME, "float32", BIG, K3)) == bool(
            features.get("amx")
        )
    # dX of AMX needs pad_top <= (k - 1) * dil: 3 leading rows of a 3x3 do not fit
    wide_pad = dict(EXPLICIT, explicit_paddings=[0, 0, 3, 0, 0, 0, 0, 0])
    assert "amx" not in kernels.conv_capabilities(DX, wide_pad, "float32", BIG, K3)
    # ... and so do a strided conv's phases, for dW too
    wide_strided = dict(wide_pad, strides=[1, 2, 2, 1])
    for op in (DX, DW):
        assert "amx" not in kernels.conv_capabilities(op, wide_strided, "float32", BIG, K3)


def _op_attrs(spec, op="forward", **extra):
    return dict(
        strides=[1, 1, 1, 1],
        padding="SAME",
        explicit_paddings=[],
        data_format="NHWC",
        dilations=[1, 1, 1, 1],
        **spec.op_attrs(op),
        **extra,
    )


def test_every_runnable_plan_matches_and_others_are_refused(switches):
    """Each plan the query offers runs and matches the reference (the bitpacked
    tiers bit for bit); a plan the CPU (or the switches) cannot run is refused
    with an error naming it, and an unknown plan is rejected."""
    lib = kernels.library()
    spec = tapehook.BinarySpec(activations=True, scale="mean_abs")
    x, w0 = random_inputs((2, 9, 9, 70), (3, 3, 70, 5))
    g = upstream((2, 9, 9, 5), tf.float32)
    ry, rdx, rdw = reference_result(x, w0, spec, g)
    shapes = dict(x_shape=x.shape, w_shape=w0.shape)
    forward = kernels.conv_capabilities(FWD, SAME, "float32", binary_input=True, **shapes)
    outputs = {
        plan: lib.tapehook_binary_conv2d(x, w0, **_op_attrs(spec, plan=plan)) for plan in forward
    }
    for plan, y in outputs.items():
        assert_close(y, ry, what=f"forward [{plan}]")
        np.testing.assert_array_equal(y.numpy(), outputs["portable"].numpy())
    for plan in kernels.conv_capabilities(DX, SAME, "float32", binary_input=True, **shapes):
        assert_close(
            lib.tapehook_binary_conv2d_backprop_input(
                x, w0, g, **_op_attrs(spec, "backprop_input", plan=plan)
            ),
            rdx,
            what=f"dX [{plan}]",
        )
    for plan in kernels.conv_capabilities(DW, SAME, "float32", binary_input=True, **shapes):
        assert_close(
            lib.tapehook_binary_conv2d_backprop_filter(
                x, w0, g, **_op_attrs(spec, "backprop_filter", plan=plan)
            ),
            rdw,
            what=f"dW [{plan}]",
        )
    # the default plan ('') is the best one
    np.testing.assert_array_equal(
        lib.tapehook_binary_conv2d(x, w0, **_op_attrs(spec)).numpy(),
        outputs[dispatch.choose(FWD, policy="kernels", capabilities=forward, attrs=SAME)].numpy(),
    )
    switches(no_avx2=True)
    for plan in ("avx2", "avx512", "amx"):
        with pytest.raises(
            tf.errors.FailedPreconditionError,
            match=f"plan '{plan}' cannot run.*it can run: portable",
        ):
            lib.tapehook_binary_conv2d(x, w0, **_op_attrs(spec, plan=plan))
        with pytest.raises(tf.errors.FailedPreconditionError, match=f"plan '{plan}'"):
            lib.tapehook_binary_conv2d_backprop_filter(
                x, w0, g, **_op_attrs(spec, "backprop_filter", plan=plan)
            )
    with pytest.raises(tf.errors.InvalidArgumentError, match="unknown plan 'fastest'"):
        lib.tapehook_binary_conv2d(x, w0, **_op_attrs(spec, plan="fastest"))


@pytest.mark.parametrize("padding", ["SAME", "VALID"])
@pytest.mark.parametrize("activations", [False, True])
def test_strided_backprops_match_on_every_plan(activations, padding):
    """A stride-2 conv's backprops (AMX runs them by phases, cc_kernels/core/
    amx_conv.cc) on each plan the query offers, from a float input and, with
    binary activations, from packed bits: the reference's gradients. Odd
    sizes give the phases images of unequal size; 40 -> 33 channels give
    partial tiles."""
    lib = kernels.library()
    spec = tapehook.BinarySpec(activations=activations, scale="mean_abs")
    x, w0 = random_inputs((2, 11, 10, 40), (3, 3, 40, 33))
    conv = dict(SAME, strides=[1, 2, 2, 1], padding=padding)
    out_shape = tf.nn.conv2d(x, w0, 2, padding).shape
    g = upstream(out_shape, tf.float32)
    _, rdx, rdw = reference_result(x, w0, spec, g, **conv)
    dx_attrs = dict(conv, data_format="NHWC", **spec.op_attrs("backprop_input"))
    dw_attrs = dict(conv, data_format="NHWC", **spec.op_attrs("backprop_filter"))
    shapes = dict(x_shape=x.shape, w_shape=w0.shape, binary_input=activations)
    dx_plans = kernels.conv_capabilities(DX, conv, "float32", **shapes)
    dw_plans = kernels.conv_capabilities(DW, conv, "float32", **shapes)
    if tapehook.kernel_info()["cpu"].get("amx"):
        assert "amx" in dx_plans and "amx" in dw_plans
    for plan in dx_plans:
        dx = lib.tapehook_binary_conv2d_backprop_input(x, w0, g, **dx_attrs, plan=plan)
        assert_close(dx, rdx, what=f"dX [{plan}]")
    for plan in dw_plans:
        dw = lib.tapehook_binary_conv2d_backprop_filter(x, w0, g, **dw_attrs, plan=plan)
        assert_close(dw, rdw, what=f"dW [{plan}]")
    if not activations:
        return
    bits = lib.tapehook_pack_input(x, **spec.pack_attrs())
    packed = dict(shapes, packed=True)
    for plan in kernels.conv_capabilities(DX, conv, "float32", **packed):
        dx = lib.tapehook_binary_conv2d_backprop_input_packed(
            bits, w0, g, channels=40, **dx_attrs, plan=plan
        )
        assert_close(dx, rdx, what=f"packed dX [{plan}]")
    for plan in kernels.conv_capabilities(DW, conv, "float32", **packed):
        dw = lib.tapehook_binary_conv2d_backprop_filter_packed(
            bits, w0, g, channels=40, **dw_attrs, plan=plan
        )
        assert_close(dw, rdw, what=f"packed dW [{plan}]")


@pytest.mark.parametrize("activations", [False, True])
def test_traced_ops_carry_the_chosen_plan(activations):
    """A tf.function records the dispatcher's choice on its ops, made once at
    trace time: the best implementation under TAPEHOOK_DISPATCH=kernels."""
    x, w0 = random_inputs((2, 9, 9, 3), (3, 3, 3, 4))
    w = tapehook.mark_binary(tf.Variable(w0), activations=activations)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.nn.conv2d(x, w, 1, "SAME")
        return tape.gradient(y, [x, w])

    graph = step.get_concrete_function(x).graph
    plans = {}
    for op in graph.get_operations():
        if op.type.startswith("TapehookBinaryConv2D"):
            plans[op.type] = op.get_attr("plan").decode()
    assert len(plans) == 3, plans
    for op_type, plan in plans.items():
        kind = FWD if op_type == "TapehookBinaryConv2D" else DX if "Input" in op_type else DW
        best = dispatch.choose(
            kind,
            policy="kernels",
            attrs=SAME,
            capabilities=(
                kernels.conv_capabilities(
                    kind, SAME, "float32", x.shape, w0.shape, binary_input=activations
                )
            ),
        )
        assert plan == best, (op_type, plan, best)


def test_graphs_without_plan_or_clip_bits_still_run():
    """A graph written before the plan and clip_f64_bits attrs existed (its
    NodeDefs lack them) loads with their defaults and runs as before."""
    spec = tapehook.BinarySpec(activations=True, scale="mean_abs")
    x, w0 = random_inputs((2, 9, 9, 3), (3, 3, 3, 4))
    g = upstream((2, 9, 9, 4), tf.float32)
    ry, rdx, rdw = reference_result(x, w0, spec, g)
    lib = kernels.library()
    attrs = _op_attrs(spec)
    with tf.Graph().as_default() as graph:
        xs, ws, gs = (tf.compat.v1.placeholder(tf.float32, t.shape) for t in (x, w0, g))
        lib.tapehook_binary_conv2d(xs, ws, **attrs, name="y")
        lib.tapehook_binary_conv2d_backprop_input(
            xs, ws, gs, **_op_attrs(spec, "backprop_input"), name="dx"
        )
        lib.tapehook_binary_conv2d_backprop_filter(
            xs, ws, gs, **_op_attrs(spec, "backprop_filter"), name="dw"
        )
    old = graph.as_graph_def()
    for node in old.node:
        for name in ("plan", "clip_f64_bits"):
            if name in node.attr:
                del node.attr[name]
    assert not any("plan" in n.attr for n in old.node)
    with tf.Graph().as_default() as loaded:
        tf.graph_util.import_graph_def(old, name="")
        feeds = {
            loaded.get_tensor_by_name(f"{n}:0"): v.numpy()
            for n, v in zip(["Placeholder", "Placeholder_1", "Placeholder_2"], (x, w0, g))
        }
        with tf.compat.v1.Session(graph=loaded) as session:
            y, dx, dw = session.run(["y:0", "dx:0", "dw:0"], feeds)
    assert_close(y, ry, what="forward")
    assert_close(dx, rdx, what="dX")
    assert_close(dw, rdw, what="dW")
