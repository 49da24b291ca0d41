"""tapehook.optimizers.Adam (TF's fused ResourceApplyAdam) against Keras 3's
Adam (the independent reference: the same formula on other ops) and a NumPy
reference: eager, tf.function, Keras fit, float64, schedules, amsgrad and
sparse gradients (Keras's own update), weight decay, loss scaling under
mixed_float16, saving, MirroredStrategy; and that the fused op runs.

Variables constrained by a WeightClip take tapehook's Adam-and-clip kernel:
bit for bit TF's ResourceApplyAdam then tf.clip_by_value, in every vector
tier and execution mode, and where it does not apply the separate update
and constraint."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tapehook
from tapehook import kernels
from tapehook.larq import constraints as larq_constraints
from tapehook.optimizers import Adam

from conftest import TIERS, fit_mirrored, run_in_tier

STEPS = 4


def np_adam(w, grads, lr, b1=0.9, b2=0.999, eps=1e-7):
    """Keras 3's Adam in float64."""
    w, m, v = w.astype(np.float64), np.zeros_like(w, np.float64), np.zeros_like(w, np.float64)
    for t, g in enumerate(grads, start=1):
        alpha = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
        m += (g - m) * (1 - b1)
        v += (g * g - v) * (1 - b2)
        w -= alpha * m / (np.sqrt(v) + eps)
    return w


def _grads(shape, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(STEPS)]


def _run(optimizer, w0, grads, mode):
    var = keras.Variable(w0)

    def step(g):
        optimizer.apply([g], [var])

    step = tf.function(step) if mode == "function" else step
    for g in grads:
        step(tf.constant(g))
    return var.numpy()


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(learning_rate=1e-2),
        dict(learning_rate=3e-3, beta_1=0.8, beta_2=0.95, epsilon=1e-4),
    ],
)
def test_matches_keras_and_numpy(kwargs, mode):
    w0 = np.random.default_rng(1).standard_normal((5, 7)).astype(np.float32)
    grads = _grads(w0.shape)
    ours = _run(Adam(**kwargs), w0, grads, mode)
    keras_w = _run(keras.optimizers.Adam(**kwargs), w0, grads, mode)
    np.testing.assert_allclose(ours, keras_w, rtol=1e-6, atol=1e-6)
    reference = np_adam(
        w0,
        grads,
        kwargs["learning_rate"],
        kwargs.get("beta_1", 0.9),
        kwargs.get("beta_2", 0.999),
        kwargs.get("epsilon", 1e-7),
    )
    np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-6)


def test_runs_the_fused_op_and_float64():
    var = keras.Variable(np.ones((3, 2), np.float64), dtype="float64")
    opt = Adam(1e-2)

    @tf.function
    def step(g):
        opt.apply([g], [var])

    g = tf.constant(np.full((3, 2), 0.5))
    types = {op.type for op in step.get_concrete_function(g).graph.get_operations()}
    assert "ResourceApplyAdam" in types and "Sqrt" not in types
    step(g)
    np.testing.assert_allclose(var.numpy(), np_adam(np.ones((3, 2)), [np.full((3, 2), 0.5)], 1e-2))


def test_schedule_weight_decay_and_clipnorm():
    w0 = np.random.default_rng(2).standard_normal((4, 4)).astype(np.float32)
    grads = _grads(w0.shape, seed=3)

    def kwargs():
        return dict(
            learning_rate=keras.optimizers.schedules.ExponentialDecay(1e-2, 2, 0.5),
            weight_decay=0.1,
            clipnorm=1.0,
        )

    ours = _run(Adam(**kwargs()), w0, grads, "function")
    keras_w = _run(keras.optimizers.Adam(**kwargs()), w0, grads, "function")
    np.testing.assert_allclose(ours, keras_w, rtol=1e-6, atol=1e-6)


def test_amsgrad_and_sparse_gradients_are_keras_updates():
    w0 = np.random.default_rng(4).standard_normal((6, 3)).astype(np.float32)
    grads = _grads(w0.shape, seed=5)
    np.testing.assert_array_equal(
        _run(Adam(1e-2, amsgrad=True), w0, grads, "function"),
        _run(keras.optimizers.Adam(1e-2, amsgrad=True), w0, grads, "function"),
    )
    results = []
    for opt in (Adam(1e-2), keras.optimizers.Adam(1e-2)):
        var = keras.Variable(w0)
        for g in grads:
            sparse = tf.IndexedSlices(tf.constant(g[[0, 4]]), tf.constant([0, 4]), w0.shape)
            opt.apply([sparse], [var])
        results.append(var.numpy())
    np.testing.assert_array_equal(*results)


def _model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    # No conv bias: before a batch norm its gradient is rounding noise, which
    # Adam's m / sqrt(v) turns into lr-sized steps of either sign.
    # The clip binds from the first steps (glorot's limit here is 0.25), so
    # the fits below compare the fused Adam-and-clip with Keras's constraint.
    x = keras.layers.Conv2D(
        8,
        3,
        padding="same",
        use_bias=False,
        name="binary",
        kernel_constraint=tapehook.WeightClip(0.2),
    )(inputs)
    x = tapehook.layers.BatchNormalization()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    net = keras.Model(inputs, keras.layers.Dense(4, activation="softmax")(x))
    return tapehook.binarize(net, include="binary", activations=True)


def _data():
    rng = np.random.default_rng(6)
    return rng.standard_normal((16, 8, 8, 3)).astype(np.float32), rng.integers(0, 4, 16)


def test_fit_matches_keras_and_saves(tmp_path):
    x, y = _data()
    weights = []
    for opt in (Adam(1e-2), keras.optimizers.Adam(1e-2)):
        net = _model()
        net.compile(opt, "sparse_categorical_crossentropy")
        net.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        weights.append(net.get_weights())
        if isinstance(opt, Adam):
            net.save(tmp_path / "net.keras")
            loaded = keras.models.load_model(tmp_path / "net.keras")
            assert type(loaded.optimizer) is Adam
            assert loaded.optimizer.iterations.numpy() == 4
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_mixed_float16_loss_scaling():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = _data()
        weights = []
        for opt in (Adam(1e-2), keras.optimizers.Adam(1e-2)):
            net = _model()
            net.compile(opt, "sparse_categorical_crossentropy")
            assert isinstance(net.optimizer, keras.optimizers.LossScaleOptimizer)
            net.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
            weights.append(net.get_weights())
        for a, b in zip(*weights):
            np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def mirrored_variants():
    """For tests/helpers/mirrored_fit.py: the small model with each Adam."""

    def build(adam):
        net = _model()
        net.compile(adam(1e-2), "sparse_categorical_crossentropy")
        return net

    return {"ours": lambda: build(Adam), "keras": lambda: build(keras.optimizers.Adam)}


@pytest.mark.slow
def test_mirrored_strategy_matches_keras():
    """fit under MirroredStrategy (2 logical CPUs): the fused update runs on
    each replica's variables (in strategy.extended.update) and gives Keras's
    weights."""
    out = fit_mirrored("test_fused_adam")
    assert len(out["ours"]) == len(out["keras"]) > 0
    for a, b in zip(out["ours"], out["keras"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# ---- Adam and a WeightClip in one kernel ----


def _needs_kernels():
    if kernels.library() is None:
        pytest.skip("compiled kernels not loaded")


def _adam_problem(n, seed):
    """var (some past the clip, one NaN where there is room), m, v, and 3
    steps of gradients."""
    rng = np.random.default_rng(seed)
    var = rng.uniform(-1.3, 1.3, n).astype(np.float32)
    if n > 20:
        var[n // 2] = np.nan
    m = (0.1 * rng.standard_normal(n)).astype(np.float32)
    v = np.abs(0.01 * rng.standard_normal(n)).astype(np.float32)
    return var, m, v, rng.standard_normal((3, n)).astype(np.float32)


def _adam_scalars(t, lr=0.05, b1=0.9, b2=0.999, eps=1e-7):
    f = np.float32
    return dict(
        beta1_power=f(b1) ** f(t),
        beta2_power=f(b2) ** f(t),
        lr=f(lr),
        beta1=f(b1),
        beta2=f(b2),
        epsilon=f(eps),
    )


def _stock_adam_then_clip(var, m, v, grads, clip):
    """TF's own ops, as Keras runs them for tapehook's Adam without the
    fusion: ResourceApplyAdam, then the constraint's tf.clip_by_value."""
    state = [tf.Variable(a) for a in (var, m, v)]
    for t, g in enumerate(grads, start=1):
        tf.raw_ops.ResourceApplyAdam(
            var=state[0].handle,
            m=state[1].handle,
            v=state[2].handle,
            grad=tf.constant(g),
            **_adam_scalars(t),
        )
        state[0].assign(tf.clip_by_value(state[0], -clip, clip))
    return [s.numpy() for s in state]


_ADAM_TIER_SCRIPT = """
import sys
import numpy as np
import tensorflow as tf
from tapehook import kernels
sys.path.insert(0, sys.argv[3])
from test_fused_adam import _adam_problem, _adam_scalars
lib = kernels.library()
out = {}
for n in map(int, sys.argv[2].split(",")):
    var, m, v, grads = _adam_problem(n, seed=n)
    state = [tf.Variable(a) for a in (var, m, v)]
    for t, g in enumerate(grads, start=1):
        lib.tapehook_resource_apply_adam_clip(
            var=state[0].handle, m=state[1].handle, v=state[2].handle,
            grad=tf.constant(g), clip=0.75, **_adam_scalars(t))
    for name, s in zip(("var", "m", "v"), state):
        out[f"{name}_{n}"] = s.numpy()
np.savez(sys.argv[1], **out)
"""

_SIZES = (1, 7, 15, 16, 17, 40001)  # below, at and past one vector; many blocks


@pytest.mark.parametrize("tier", TIERS)
def test_adam_clip_kernel_is_stock_adam_then_clip_bit_for_bit(tmp_path, tier):
    """Each vector tier (AVX-512F, AVX2, portable) and its scalar tail: var,
    m and v after 3 steps equal TF's ResourceApplyAdam followed by
    tf.clip_by_value, bit for bit, NaN included."""
    _needs_kernels()
    import pathlib

    here = pathlib.Path(__file__).parent
    run_in_tier(tier, _ADAM_TIER_SCRIPT, tmp_path / "out.npz", ",".join(map(str, _SIZES)), here)
    out = np.load(tmp_path / "out.npz")
    for n in _SIZES:
        var, m, v, grads = _adam_problem(n, seed=n)
        want = _stock_adam_then_clip(var, m, v, grads, 0.75)
        for name, w in zip(("var", "m", "v"), want):
            np.testing.assert_array_equal(out[f"{name}_{n}"], w, err_msg=f"{name}, n={n}")
        if n > 20:  # the clip bound reached, and the NaN kept
            assert np.nanmax(np.abs(want[0])) == np.float32(0.75)
            assert np.isnan(want[0][n // 2])


def _clip_constrained(w0, constraint):
    var = keras.Variable(w0)
    var.constraint = constraint
    return var


class _OwnClip(tapehook.WeightClip):
    """A WeightClip subclass with its own __call__: Keras's constraint path,
    the reference for the fused one (same ops as the kernel's stock twin)."""

    def __call__(self, w):
        return tf.clip_by_value(w, -self.clip_value, self.clip_value)


def _stepper(opt, var, sparse_rows=None):
    def step(g):
        if sparse_rows is not None:
            g = tf.IndexedSlices(tf.gather(g, sparse_rows), tf.constant(sparse_rows), var.shape)
        opt.apply([g], [var])

    return step


def _op_types(step, *args):
    return {op.type for op in step.get_concrete_function(*args).graph.get_operations()}


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize(
    "clip_cls", [tapehook.WeightClip, larq_constraints.WeightClip, larq_constraints.weight_clip]
)
def test_weight_clip_is_fused_and_matches_the_constraint(mode, clip_cls):
    """With a WeightClip (tapehook's, or tapehook.larq's) the update is one
    kernel: the same bits as ResourceApplyAdam then Keras's constraint, and
    Keras's Adam with the constraint to float rounding; the constraint is
    the variable's again afterwards."""
    _needs_kernels()
    w0 = np.random.default_rng(7).uniform(-1.2, 1.2, (6, 9)).astype(np.float32)
    grads = _grads(w0.shape, seed=8)
    results = {}
    for name, opt, constraint in (
        ("fused", Adam(0.05), clip_cls(0.9)),
        ("separate", Adam(0.05), _OwnClip(0.9)),
        ("keras", keras.optimizers.Adam(0.05), clip_cls(0.9)),
    ):
        var = _clip_constrained(w0, constraint)
        step = _stepper(opt, var)
        if mode == "function":
            step = tf.function(step)
            types = _op_types(step, tf.constant(grads[0]))
            fused = "TapehookResourceApplyAdamClip" in types
            assert fused == (name == "fused"), (name, types)
            if fused:
                assert not types & {"ResourceApplyAdam", "ClipByValue", "Minimum", "Maximum"}
        for g in grads:
            step(tf.constant(g))
        assert var.constraint is constraint
        results[name] = var.numpy()
    np.testing.assert_array_equal(results["fused"], results["separate"])
    np.testing.assert_allclose(results["fused"], results["keras"], rtol=1e-5, atol=5e-6)
    assert np.abs(results["fused"]).max() == np.float32(0.9)


@pytest.mark.parametrize(
    "case", ["amsgrad", "ema", "accumulation", "sparse", "float64", "reference_kernels", "xla"]
)
def test_where_the_fusion_does_not_apply_the_constraint_still_clips(case, monkeypatch):
    """amsgrad, EMA, gradient accumulation, sparse gradients, float64
    variables, unloaded kernels and XLA-compiled steps (the op has no XLA
    kernel) take the separate update and Keras's constraint: Keras's Adam's
    result, clipped."""
    dtype = np.float64 if case == "float64" else np.float32
    w0 = np.random.default_rng(9).uniform(-1.2, 1.2, (6, 3)).astype(dtype)
    grads = _grads(w0.shape, dtype=dtype, seed=10)
    kwargs = dict(
        amsgrad=dict(amsgrad=True),
        ema=dict(use_ema=True),
        accumulation=dict(gradient_accumulation_steps=2),
    ).get(case, {})
    if case == "reference_kernels":
        monkeypatch.setattr(kernels, "library", lambda: None)
    results = []
    for opt in (Adam(0.05, **kwargs), keras.optimizers.Adam(0.05, **kwargs)):
        var = _clip_constrained(w0, tapehook.WeightClip(0.9))
        if case == "float64":
            var = keras.Variable(w0, dtype="float64")
            var.constraint = tapehook.WeightClip(0.9)

        step = tf.function(
            _stepper(opt, var, sparse_rows=[0, 4] if case == "sparse" else None),
            jit_compile=case == "xla",
        )
        assert "TapehookResourceApplyAdamClip" not in _op_types(step, tf.constant(grads[0]))
        for g in grads:
            step(tf.constant(g))
        results.append(var.numpy())
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6, atol=1e-6)
    assert np.abs(results[0]).max() <= 0.9


def test_adam_clip_op_rejects_bad_input_with_clear_errors():
    """Wrong variable dtype, mismatched shapes and a non-positive clip are
    InvalidArgument errors that say what is wrong, not a crash."""
    _needs_kernels()
    lib = kernels.library()
    scalars = _adam_scalars(1)

    def call(dtype=tf.float32, grad_shape=(3,), clip=1.0):
        state = [tf.Variable(tf.zeros([3], dtype)) for _ in range(3)]
        lib.tapehook_resource_apply_adam_clip(
            var=state[0].handle,
            m=state[1].handle,
            v=state[2].handle,
            grad=tf.zeros(grad_shape),
            clip=clip,
            **scalars,
        )

    call()  # the good call runs
    for kwargs, message in (
        (dict(dtype=tf.float64), "must be float32 variables; input 0 is double"),
        (dict(grad_shape=(4,)), "must have one shape"),
        (dict(clip=0.0), "clip must be positive and finite"),
        (dict(clip=float("nan")), "clip must be positive and finite"),
    ):
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            call(**kwargs)
