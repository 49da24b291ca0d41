"""What runs where TensorFlow sees a GPU (issue #51): binary convs on stock
cuDNN convolutions of the binarized operands unless TAPEHOOK_DISPATCH=kernels
opts into tapehook's CUDA kernels, and none of the CPU-only kernels (packed
e'(x), the batch-norm gradient and the recomputed conv output it reads, the
max pools, Adam-and-clip, the folded inference forward).

The dispatcher's rule is a table over device x policy. Everything else fakes
the GPU: ``kernels.gpu_visible``, the one check the dispatcher and every
guard ask, answers True, and the ops then run here on the CPU, so each
route's results are checked against the other's too."""

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf

import tapehook
from tapehook import dispatch, kernels
from tapehook.layers import BatchNormalization, MaxPooling2D
from tapehook.optimizers import Adam

from conftest import MODES, assert_close, random_inputs, reference_result, upstream

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="needs the compiled kernels")

# ---------------------------------------------------------------------------
# The rule: (conv, capabilities) x device x policy -> STOCK or a plan.

ALL = frozenset({"amx", "avx512", "avx2", "portable"})
NO_AMX = frozenset({"avx512", "avx2", "portable"})
GEMM = frozenset({"avx2", "portable"})
SAME = dict(strides=[1, 1, 1, 1], padding="SAME", explicit_paddings=[], dilations=[1, 1, 1, 1])
DILATED = dict(SAME, dilations=[1, 2, 2, 1])
BIG, SMALL = (2, 32, 32, 8), (1, 10, 10, 8)
K3 = (3, 3, 8, 16)
FWD, DX, DW = "forward", "backprop_input", "backprop_filter"
COLUMNS = [(d, p) for d in ("cpu", "gpu") for p in ("auto", "kernels", "stock")]
S = "stock"
# (op, attrs, x_shape, w_shape, binary_input, packed, capabilities,
#  spec_supported) -> the route in each COLUMNS column:
#  cpu auto, cpu kernels, cpu stock, gpu auto, gpu kernels, gpu stock.
TABLE = {
    # the bitpacked forward: on the kernels on the CPU under auto, not on a GPU
    "binary_forward": (
        (FWD, SAME, SMALL, K3, True, False, NO_AMX, True),
        ("avx512", "avx512", S, S, "avx512", S),
    ),
    "weight_only_forward_amx": (
        (FWD, SAME, BIG, K3, False, False, ALL, True),
        ("amx", "amx", S, S, "amx", S),
    ),
    "weight_only_forward_unknown_shapes": (
        (FWD, SAME, None, None, False, False, ALL, True),
        ("amx", "amx", S, S, "amx", S),
    ),
    "weight_only_forward_no_amx": (
        (FWD, SAME, BIG, K3, False, False, NO_AMX, True),
        (S, "avx512", S, S, "avx512", S),
    ),
    "packed_dx": (
        (DX, SAME, BIG, K3, True, True, NO_AMX, True),
        ("avx512", "avx512", S, S, "avx512", S),
    ),
    # the CPU's stock backprops reject dilation; a GPU's stock route takes it
    "dilated_dw": (
        (DW, DILATED, SMALL, K3, False, False, GEMM, True),
        ("avx2", "avx2", S, S, "avx2", S),
    ),
    "no_kernels_loaded": (
        (FWD, SAME, SMALL, K3, True, False, frozenset(), True),
        (S, S, S, S, S, S),
    ),
    "spec_the_kernels_do_not_compute": (
        (FWD, SAME, SMALL, K3, True, False, ALL, False),
        (S, S, S, S, S, S),
    ),
}


@pytest.mark.parametrize("column", range(len(COLUMNS)), ids=["-".join(c) for c in COLUMNS])
@pytest.mark.parametrize("case", TABLE)
def test_choose_table(case, column):
    (op, attrs, x_shape, w_shape, binary_input, packed, capabilities, supported), routes = TABLE[
        case
    ]
    device, policy = COLUMNS[column]
    chosen = dispatch.choose(
        op,
        policy=policy,
        capabilities=capabilities,
        attrs=attrs,
        x_shape=x_shape,
        w_shape=w_shape,
        binary_input=binary_input,
        packed=packed,
        onednn=True,
        spec_supported=supported,
        device=device,
    )
    assert chosen == routes[column]


def test_choose_rejects_an_unknown_device():
    with pytest.raises(tapehook.TapehookError, match="device 'tpu'"):
        dispatch.choose(FWD, policy="auto", capabilities=ALL, attrs=SAME, device="tpu")


# ---------------------------------------------------------------------------
# The same rule in a running process, with the GPU faked.


@pytest.fixture
def gpu(monkeypatch):
    """gpu(visible): from now on kernels.gpu_visible answers ``visible``."""

    def fake(visible):
        monkeypatch.setattr(kernels, "gpu_visible", lambda: visible)

    return fake


@pytest.mark.parametrize(
    "policy,visible,compiled",
    [("auto", True, False), ("auto", False, True), ("kernels", True, True), ("stock", True, False)],
)
@pytest.mark.parametrize("mode", ["eager", "tape_in_function"])
def test_binary_conv_route_follows_the_device(monkeypatch, gpu, mode, policy, visible, compiled):
    """A fully binary conv: the compiled forward on the CPU under auto, stock
    ops on a GPU unless TAPEHOOK_DISPATCH=kernels; the reference's results on
    every route."""
    monkeypatch.setenv("TAPEHOOK_DISPATCH", policy)
    gpu(visible)
    spec = tapehook.BinarySpec(activations=True, scale="mean_abs")
    x, w0 = random_inputs((2, 8, 8, 3), (3, 3, 3, 4))
    g = upstream((2, 8, 8, 4), tf.float32)
    y, dx, dw = MODES[mode](
        x, w0, g, dict(padding="SAME"), lambda w: tapehook.mark_binary(w, **spec.to_config())
    )
    ry, rdx, rdw = reference_result(x, w0, spec, g)
    assert_close(y, ry, what="forward")
    assert_close(dx, rdx, what="dX")
    assert_close(dw, rdw, what="dW")
    counts = tapehook.dispatch_counts()
    assert counts["compiled"]["forward"] == int(compiled)
    if not compiled:
        assert counts["compiled"] == dict(forward=0, backprop_input=0, backprop_filter=0)
        assert counts["reference"] == dict(forward=1, backprop_input=1, backprop_filter=1)


@pytest.mark.parametrize("policy,route", [("auto", "stock"), ("kernels", "kernels"), ("stock", S)])
def test_kernel_info_says_what_runs_on_a_gpu(monkeypatch, policy, route):
    monkeypatch.setenv("TAPEHOOK_DISPATCH", policy)
    assert dispatch.gpu_route() == route
    info = tapehook.kernel_info()["gpu"]
    assert info["binary_convs"] == route
    assert f"dispatch='{policy}'" in info["why"]
    if policy == "auto":
        assert "bench/CUDA.md" in info["why"] and "dispatch='kernels'" in info["why"]
    if policy == "kernels":
        # this TF is a CPU build: the opt-in runs the CPU kernels
        assert "no CUDA kernels" in info["why"]


# ---------------------------------------------------------------------------
# The guards of the CPU-only kernels, under TAPEHOOK_DISPATCH=kernels (the
# binary conv compiled either way, so only the guard decides).

X = tf.constant(np.random.default_rng(3).normal(size=(2, 8, 8, 6)), tf.float32)


def _op_types(fn, *args):
    ops = fn.get_concrete_function(*args).graph.get_operations()
    return collections.Counter(op.type for op in ops)


def _conv_net(norm=None, pool=False, constraint=None, binary=True):
    """Input -> Conv2D (``binary``: with ste_sign inputs) -> ``norm`` ->
    tapehook's MaxPooling2D (``pool``) -> Dense, with the same weights every
    call."""
    keras.utils.set_random_seed(5)
    inputs = keras.Input(X.shape[1:])
    y = keras.layers.Conv2D(
        8, 3, padding="same", use_bias=False, kernel_constraint=constraint, name="binary"
    )(inputs)
    if norm is not None:
        y = norm(y)
    if pool:
        y = MaxPooling2D(2)(y)
    y = keras.layers.Dense(3)(keras.layers.Flatten()(y))
    net = keras.Model(inputs, y)
    return tapehook.binarize(net, include="binary", activations=True) if binary else net


def _gradients(net):
    @tf.function
    def step(x):
        y = net(x, training=True)
        return tf.gradients(tf.reduce_sum(y * tf.sin(y)), [x, *net.trainable_variables])

    return _op_types(step, X), step(X)


def _packed_derivative():
    """approx_sign inputs keep e'(x) in fixed point (a CPU kernel)."""
    x, w0 = random_inputs((2, 8, 8, 6), (3, 3, 6, 4))
    w = tapehook.mark_binary(tf.Variable(w0), activations="approx_sign")

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.nn.conv2d(x, w, 1, "SAME") ** 2)
        return tape.gradient(loss, [x, w])

    return _op_types(step, x), step(x)


def _recomputed_batch_norm():
    return _gradients(_conv_net(norm=BatchNormalization(recompute=True)))


def _float_conv_batch_norm():
    """A float conv's output is rebuilt on any device (stock ops); only the
    batch-norm gradient is a CPU kernel."""
    return _gradients(_conv_net(norm=BatchNormalization(recompute=True), binary=False))


def _max_pool():
    return _gradients(_conv_net(pool=True))


def _adam_clip():
    var = keras.Variable(np.random.default_rng(4).uniform(-1.2, 1.2, (6, 5)).astype(np.float32))
    var.constraint = tapehook.WeightClip(0.9)
    optimizer = Adam(0.05)

    @tf.function
    def step(g):
        optimizer.apply([g], [var])
        return tf.identity(var)

    g = tf.constant(np.random.default_rng(5).normal(size=(6, 5)), tf.float32)
    types = _op_types(step, g)
    for _ in range(3):
        step(g)
    return types, [var]


def _folded_inference():
    net = _conv_net(norm=BatchNormalization())
    step = tf.function(lambda x: net(x, training=False))
    return _op_types(step, X), [step(X)]


# guard -> (build, op counts without a GPU, op counts with one)
GUARDS = {
    # packing.packable
    "packed_derivative": (
        _packed_derivative,
        {"TapehookEstimatorGradFixed": 1, "TapehookBinaryConv2DBackpropInput": 0},
        {"TapehookEstimatorGradFixed": 0, "TapehookBinaryConv2DBackpropInput": 1},
    ),
    # kernels.cpu_library (the batch-norm gradient)
    "float_conv_batch_norm": (
        _float_conv_batch_norm,
        {"TapehookBatchNormGrad": 1, "FusedBatchNormGradV3": 0},
        {"TapehookBatchNormGrad": 0, "FusedBatchNormGradV3": 1},
    ),
    # conv2d.recompute_output (the binary conv's output rebuilt: a second
    # forward), then as above
    "recomputed_batch_norm": (
        _recomputed_batch_norm,
        {"TapehookBatchNormGrad": 1, "TapehookBinaryConv2D": 2, "FusedBatchNormGradV3": 0},
        {"TapehookBatchNormGrad": 0, "TapehookBinaryConv2D": 1, "FusedBatchNormGradV3": 1},
    ),
    # kernels.cpu_library (the max pools)
    "max_pool": (
        _max_pool,
        {"TapehookMaxPoolTaps": 1, "MaxPoolWithArgmax": 0},
        {"TapehookMaxPoolTaps": 0, "MaxPoolWithArgmax": 1},
    ),
    # kernels.cpu_library (Adam-and-clip)
    "adam_clip": (
        _adam_clip,
        {"TapehookResourceApplyAdamClip": 1, "ResourceApplyAdam": 0},
        {"TapehookResourceApplyAdamClip": 0, "ResourceApplyAdam": 1},
    ),
    # conv2d.fold_output_affine
    "folded_inference": (
        _folded_inference,
        {"TapehookBinaryConv2DAffine": 1},
        {"TapehookBinaryConv2DAffine": 0, "TapehookBinaryConv2D": 1},
    ),
}


@pytest.mark.parametrize("guard", GUARDS)
def test_cpu_only_kernels_stay_off_a_gpu(monkeypatch, gpu, guard):
    monkeypatch.setenv("TAPEHOOK_DISPATCH", "kernels")
    build, without_gpu, with_gpu = GUARDS[guard]
    results = []
    for visible, expected in ((False, without_gpu), (True, with_gpu)):
        gpu(visible)
        types, values = build()
        assert {t: types[t] for t in expected} == expected, (visible, sorted(types))
        results.append(values)
    for compiled, stock in zip(*results):
        assert_close(compiled, stock, what=guard)


def test_cpu_library_is_none_where_a_gpu_is_visible(gpu):
    gpu(True)
    assert kernels.cpu_library() is None
    gpu(False)
    assert kernels.cpu_library() is kernels.library()


def _training_step():
    """(tapehook op types, weights after one step) of a binary conv, a
    recomputed batch norm, tapehook's max pool and Adam with a WeightClip,
    from the same initial weights every call."""
    net = _conv_net(
        norm=BatchNormalization(recompute=True), pool=True, constraint=tapehook.WeightClip(1.0)
    )
    optimizer = Adam(0.01)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            y = net(x, training=True)
            loss = tf.reduce_sum(y * tf.sin(y))
        optimizer.apply(tape.gradient(loss, net.trainable_variables), net.trainable_variables)
        return loss

    types = {t for t in _op_types(step, X) if t.startswith("Tapehook")}
    step(X)
    return types, net.get_weights()


def test_a_gpu_model_runs_no_tapehook_op_by_default(monkeypatch, gpu):
    """Under the default policy a training step runs tapehook's kernels on
    the CPU, and on a GPU not one tapehook op: the same step."""
    monkeypatch.setenv("TAPEHOOK_DISPATCH", "auto")
    gpu(False)
    types, weights = _training_step()
    assert {
        "TapehookBinaryConv2D",
        "TapehookBatchNormGrad",
        "TapehookMaxPoolTaps",
        "TapehookResourceApplyAdamClip",
    } <= types
    gpu(True)
    stock_types, stock_weights = _training_step()
    assert stock_types == set()
    for a, b in zip(weights, stock_weights, strict=True):
        assert_close(a, b, what="weights after one step")
