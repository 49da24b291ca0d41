"""tapehook.optimizers (Bop, CaseOptimizer) and tapehook.constraints.WeightClip
against NumPy references, in eager, tf.function and Keras fit; routing by
marks; checkpoints and .keras files; mixed_float16 loss scaling;
MirroredStrategy; misuse errors. (larq 0.14 itself is compared by
scripts/compare_larq_optimizers.py, outside the suite.)"""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import tapehook
from tapehook.constraints import WeightClip
from tapehook.optimizers import Bop, CaseOptimizer

# ---- NumPy references ----


def np_bop(w, m, g, gamma, threshold):
    """One Bop step as larq 0.14 computes it: m += gamma (g - m);
    w = sign(-sign(w m - threshold) w) with sign(0) = +1."""
    dtype = w.dtype.type
    m = m + dtype(gamma) * (g - m)
    flip = np.sign(w * m - dtype(threshold))
    return np.where(-flip * w >= 0, 1.0, -1.0).astype(w.dtype), m


def paper_bop(w, m, g, gamma, threshold):
    """Helwegen et al. 2019, Algorithm 1, for w in {-1, +1}: flip where
    |m| > threshold and sign(m) == sign(w)."""
    m = (1 - gamma) * m + gamma * g
    flip = (np.abs(m) > threshold) & (np.sign(m) == np.sign(w))
    return np.where(flip, -w, w), m


def np_reference(w0, grads, gamma, threshold, margin=True):
    """Weights and momenta after each step; checks no step sits on the flip
    boundary, where float rounding could decide (the test would be luck)."""
    w, m = w0.copy(), np.zeros_like(w0)
    out = []
    for g in grads:
        m_next = m + w.dtype.type(gamma) * (g - m)
        if margin:
            assert np.min(np.abs(w * m_next - threshold)) > 1e-3 * threshold
        w, m = np_bop(w, m, g, gamma, threshold)
        out.append((w.copy(), m.copy()))
    return out


GAMMA, THRESHOLD, STEPS = 0.25, 1e-3, 6


def _problem(shape=(3, 3, 2, 4), seed=0):
    """Latent float init (first step binarizes) and gradients with a drift, so
    weights flip in both directions over the steps."""
    rng = np.random.default_rng(seed)
    w0 = (rng.uniform(0.1, 0.9, shape) * rng.choice([-1, 1], shape)).astype("float32")
    drift = rng.normal(size=shape) * 4e-3
    grads = [
        (drift * (1 if s < 3 else -1) + rng.normal(size=shape) * 4e-3).astype("float32")
        for s in range(STEPS)
    ]
    return w0, grads


def _assert_flips_both_ways(trajectory, w0):
    signs = [np.sign(w0)] + [w for w, _ in trajectory]
    flips = [int(np.sum(a != b)) for a, b in zip(signs[1:], signs[2:])]
    assert sum(flips) > 10 and all(f < np.size(w0) for f in flips), flips
    up = sum(int(np.sum((a < 0) & (b > 0))) for a, b in zip(signs[1:], signs[2:]))
    down = sum(int(np.sum((a > 0) & (b < 0))) for a, b in zip(signs[1:], signs[2:]))
    assert up > 0 and down > 0


def test_reference_agrees_with_the_paper_on_binary_weights():
    w0, grads = _problem()
    trajectory = np_reference(w0, grads, GAMMA, THRESHOLD)
    _assert_flips_both_ways(trajectory, w0)
    w, m = trajectory[0]
    for g, (w_next, _) in zip(grads[1:], trajectory[1:]):
        paper_w, m = paper_bop(w, m, g, GAMMA, THRESHOLD)
        np.testing.assert_array_equal(paper_w, w_next)
        w = w_next


# ---- Bop in every execution mode ----


def _marked_variable(w0):
    return tapehook.mark_binary(tf.Variable(w0))


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_bop_matches_reference(mode):
    w0, grads = _problem()
    var = _marked_variable(w0)
    opt = Bop(threshold=THRESHOLD, gamma=GAMMA)

    def step(g):
        opt.apply_gradients([(g, var)])

    step = tf.function(step) if mode == "tf_function" else step
    for (w, m), g in zip(np_reference(w0, grads, GAMMA, THRESHOLD), grads):
        step(tf.constant(g))
        np.testing.assert_array_equal(var.numpy(), w)
        np.testing.assert_allclose(opt._momentums[0].numpy(), m, rtol=1e-6, atol=1e-9)
    assert int(opt.iterations) == STEPS
    _assert_flips_both_ways(np_reference(w0, grads, GAMMA, THRESHOLD), w0)


def test_bop_ties_and_zeros_follow_larq():
    """w m == threshold and w == 0 both give +1 (larq's sign(0) = +1)."""
    threshold = 2.0**-10
    w0 = np.array([[1.0, -1.0, 0.0, 1.0]], "float32")
    g = np.array([[2 * threshold, -2 * threshold, 5.0, 4 * threshold]], "float32")
    var = _marked_variable(w0)
    Bop(threshold=threshold, gamma=0.5).apply_gradients([(tf.constant(g), var)])
    # w m: threshold (tie: +1), threshold (tie: +1), 0 (w = 0: +1), 2 threshold (flip)
    np.testing.assert_array_equal(var.numpy(), [[1.0, 1.0, 1.0, -1.0]])
    np.testing.assert_array_equal(var.numpy(), np_bop(w0, 0 * w0, g, 0.5, threshold)[0])


def test_bop_float64_and_schedules():
    w0, grads = _problem(seed=3)
    w0 = w0.astype("float64")
    grads = [g.astype("float64") for g in grads]
    gamma = keras.optimizers.schedules.ExponentialDecay(GAMMA, 1, 0.8)
    threshold = keras.optimizers.schedules.ExponentialDecay(THRESHOLD, 1, 1.5)
    var = _marked_variable(w0)
    opt = Bop(threshold=threshold, gamma=gamma)
    w, m = w0, np.zeros_like(w0)
    for step, g in enumerate(grads):
        # Keras evaluates schedules at the step count before the update, in float32.
        gamma_t = float(np.float32(GAMMA * 0.8**step))
        threshold_t = float(np.float32(THRESHOLD * 1.5**step))
        w, m = np_bop(w, m, g, gamma_t, threshold_t)
        opt.apply_gradients([(tf.constant(g), var)])
        np.testing.assert_array_equal(var.numpy(), w)
        # the schedules compute in float32: gamma_t is within float32 rounding
        np.testing.assert_allclose(
            opt._momentums[0].numpy(), m, rtol=0, atol=2e-6 * np.abs(m).max()
        )
    assert var.dtype == tf.float64


def _dense_problem(batches=STEPS, batch=8, units=(6, 5), seed=1):
    """A binary Dense kernel under loss = mean_b sum(y_b * t_b): its gradient
    is x^T t / batch (ste_sign passes all of it while |W| <= clip = 1)."""
    rng = np.random.default_rng(seed)
    n_in, n_out = units
    x = rng.normal(size=(batches * batch, n_in)).astype("float32")
    t = (
        rng.normal(size=(batches * batch, n_out)) * 0.05
        + np.where(np.arange(batches * batch)[:, None] < 3 * batch, 0.03, -0.03)
    ).astype("float32")
    w0 = (rng.uniform(0.1, 0.9, units) * rng.choice([-1, 1], units)).astype("float32")
    grads = [
        x[s * batch : (s + 1) * batch].T @ t[s * batch : (s + 1) * batch] / batch
        for s in range(batches)
    ]
    return x, t, w0, grads, batch


@keras.saving.register_keras_serializable(package="tapehook_tests")
def _linear_loss(y_true, y_pred):
    return keras.ops.sum(y_true * y_pred, axis=-1)


def _dense_model(w0, extra_float=False):
    inputs = keras.Input((w0.shape[0],))
    y = keras.layers.Dense(w0.shape[1], use_bias=False, name="binary")(inputs)
    if extra_float:
        y = keras.layers.Dense(w0.shape[1], name="head")(y)
    model = keras.Model(inputs, y)
    tapehook.binarize(model, include="binary")
    model.get_layer("binary").kernel.assign(w0)
    return model


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_bop_in_fit_matches_reference(run_eagerly):
    x, t, w0, grads, batch = _dense_problem()
    model = _dense_model(w0)
    assert tapehook.binary_spec_of(model.get_layer("binary").kernel) is not None
    opt = Bop(threshold=THRESHOLD, gamma=GAMMA)
    model.compile(opt, _linear_loss, run_eagerly=run_eagerly)
    model.fit(x, t, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    trajectory = np_reference(w0, grads, GAMMA, THRESHOLD)
    _assert_flips_both_ways(trajectory, w0)
    w, m = trajectory[-1]
    np.testing.assert_array_equal(model.get_layer("binary").kernel.numpy(), w)
    np.testing.assert_allclose(opt._momentums[0].numpy(), m, rtol=1e-5, atol=1e-8)
    assert int(opt.iterations) == STEPS


# ---- CaseOptimizer ----


def _np_sgd(w, grads, lr):
    for g in grads:
        w = w - np.float32(lr) * g
    return w


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_case_optimizer_routes_by_marks(mode):
    """A marked tf.Variable goes to Bop; an unmarked tf.Variable and a
    keras.Variable go to SGD."""
    w0, grads = _problem()
    rng = np.random.default_rng(5)
    f0 = rng.normal(size=(3, 3, 2, 4)).astype("float32")
    b0 = rng.normal(size=(4,)).astype("float32")
    binary, float_kernel, bias = _marked_variable(w0), tf.Variable(f0), keras.Variable(b0)
    float_grads = [rng.normal(size=f0.shape).astype("float32") for _ in grads]
    bias_grads = [rng.normal(size=b0.shape).astype("float32") for _ in grads]
    opt = CaseOptimizer(Bop(threshold=THRESHOLD, gamma=GAMMA), keras.optimizers.SGD(0.1))
    variables = [float_kernel, binary, bias]

    def step(gf, gb, gbias):
        opt.apply_gradients(zip([gf, gb, gbias], variables))

    step = tf.function(step) if mode == "tf_function" else step
    for gf, gb, gbias in zip(float_grads, grads, bias_grads):
        step(tf.constant(gf), tf.constant(gb), tf.constant(gbias))
    w, m = np_reference(w0, grads, GAMMA, THRESHOLD)[-1]
    np.testing.assert_array_equal(binary.numpy(), w)
    np.testing.assert_allclose(opt.binary._momentums[0].numpy(), m, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(float_kernel.numpy(), _np_sgd(f0, float_grads, 0.1), rtol=1e-6)
    np.testing.assert_allclose(bias.numpy(), _np_sgd(b0, bias_grads, 0.1), rtol=1e-6)
    assert int(opt.iterations) == int(opt.binary.iterations) == int(opt.default.iterations) == STEPS
    assert len(opt.binary._trainable_variables) == 1
    assert len(opt.default._trainable_variables) == 2


def test_each_optimizer_counts_its_own_steps():
    w0, grads = _problem()
    binary, floating = _marked_variable(w0), tf.Variable(np.ones((2, 2), "float32"))
    opt = CaseOptimizer(Bop(threshold=THRESHOLD, gamma=GAMMA), keras.optimizers.SGD(0.1))
    opt.apply_gradients([(tf.constant(grads[0]), binary), (tf.ones((2, 2)), floating)])
    opt.apply_gradients([(tf.constant(grads[1]), binary), (None, floating)])
    opt.apply_gradients([(None, binary), (tf.ones((2, 2)), floating)])
    assert (int(opt.iterations), int(opt.binary.iterations), int(opt.default.iterations)) == (
        3,
        2,
        2,
    )
    np.testing.assert_allclose(floating.numpy(), 1 - 0.2)
    np.testing.assert_array_equal(
        binary.numpy(), np_reference(w0, grads[:2], GAMMA, THRESHOLD)[-1][0]
    )


def test_weights_false_kernels_go_to_the_default_optimizer():
    """A spec whose weights stay float (the BAN stage) is not Bop's."""
    w0, grads = _problem()
    ban = tapehook.mark_binary(tf.Variable(w0), activations=True, weights=False)
    binary = _marked_variable(w0)
    opt = CaseOptimizer(Bop(threshold=THRESHOLD, gamma=GAMMA), keras.optimizers.SGD(0.5))
    opt.apply_gradients([(tf.constant(grads[0]), ban), (tf.constant(grads[0]), binary)])
    np.testing.assert_allclose(ban.numpy(), w0 - 0.5 * grads[0], rtol=1e-6)
    assert set(np.unique(binary.numpy())) <= {-1.0, 1.0}
    with pytest.raises(tapehook.TapehookError, match="weights=False.*CaseOptimizer"):
        Bop().apply_gradients([(tf.constant(grads[0]), ban)])


def test_larq_form_with_predicates():
    w0, grads = _problem()
    a = tf.Variable(np.ones((2, 2), "float32"), name="a")
    b = tf.Variable(np.ones((3,), "float32"), name="b")
    binary = tapehook.mark_binary(tf.Variable(w0, name="binary"))
    opt = CaseOptimizer(
        (lambda v: v.shape.rank == 4, Bop(threshold=THRESHOLD, gamma=GAMMA)),
        (lambda v: v.shape.rank == 1, keras.optimizers.SGD(1.0)),
        default_optimizer=keras.optimizers.SGD(0.5),
    )
    opt.apply_gradients([(tf.constant(grads[0]), binary), (tf.ones((2, 2)), a), (tf.ones((3,)), b)])
    np.testing.assert_allclose(a.numpy(), 0.5)
    np.testing.assert_allclose(b.numpy(), 0.0)
    np.testing.assert_array_equal(
        binary.numpy(), np_reference(w0, grads[:1], GAMMA, THRESHOLD)[0][0]
    )
    config = opt.get_config()
    assert config["routing"] == {"binary:0": 0, "b:0": 1, "a:0": 2}
    restored = CaseOptimizer.from_config(json.loads(json.dumps(config)))
    restored.build([binary, a, b])
    assert [o._trainable_variables for o in restored.optimizers] == [[binary], [b], [a]]
    with pytest.raises(tapehook.TapehookError, match="not in the routing"):
        CaseOptimizer.from_config(config).build([tf.Variable(1.0, name="c")])
    twins = CaseOptimizer(
        (lambda v: v.shape.rank == 0, keras.optimizers.SGD()),
        default_optimizer=keras.optimizers.SGD(),
    )
    twins.build([tf.Variable(1.0, name="x"), tf.Variable([1.0], name="x")])
    with pytest.raises(tapehook.TapehookError, match="distinct names"):
        twins.get_config()


def test_case_optimizer_in_fit_with_float_layers():
    x, t, w0, grads, batch = _dense_problem()
    model = _dense_model(w0, extra_float=True)
    opt = CaseOptimizer(Bop(threshold=THRESHOLD, gamma=GAMMA), keras.optimizers.Adam(1e-2))
    model.compile(opt, "mse")
    head0 = model.get_layer("head").kernel.numpy()
    model.fit(x, t, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    kernel = model.get_layer("binary").kernel
    assert set(np.unique(kernel.numpy())) == {-1.0, 1.0}
    assert opt.binary._trainable_variables[0] is kernel
    assert {v.path for v in opt.default._trainable_variables} == {
        v.path for v in model.get_layer("head").trainable_variables
    }
    assert not np.array_equal(model.get_layer("head").kernel.numpy(), head0)
    assert int(opt.binary.iterations) == int(opt.default.iterations) == STEPS


def test_lazily_marked_subclassed_model():
    """@binarize marks kernels at the layers' first call: before Keras builds
    the optimizer in fit."""

    @tapehook.binarize(include="binary*")
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.binary = keras.layers.Dense(4, use_bias=False, name="binary_dense")
            self.head = keras.layers.Dense(2, name="head")

        def call(self, x):
            return self.head(self.binary(x))

    model = Net()
    opt = CaseOptimizer(Bop(), keras.optimizers.SGD(0.1))
    model.compile(opt, "mse")
    rng = np.random.default_rng(0)
    model.fit(
        rng.normal(size=(16, 3)).astype("float32"),
        rng.normal(size=(16, 2)).astype("float32"),
        batch_size=8,
        verbose=0,
    )
    assert [v.path for v in opt.binary._trainable_variables] == [model.binary.kernel.path]
    assert len(opt.default._trainable_variables) == 2
    assert set(np.unique(model.binary.kernel.numpy())) <= {-1.0, 1.0}


# ---- saving and restoring ----


def _trained(steps_x, extra_float=True, optimizer=None):
    x, t, w0, grads, batch = _dense_problem()
    model = _dense_model(w0, extra_float=extra_float)
    model.compile(
        optimizer
        or CaseOptimizer(Bop(threshold=THRESHOLD, gamma=GAMMA), keras.optimizers.Adam(1e-2)),
        "mse",
    )
    model.fit(x[:steps_x], t[:steps_x], batch_size=batch, shuffle=False, verbose=0)
    return model, x, t, batch


def _continue(model, x, t, batch):
    model.fit(x[16:], t[16:], batch_size=batch, shuffle=False, verbose=0)
    return model.get_weights(), [np.asarray(v) for v in model.optimizer.variables]


def _assert_same_state(a, b):
    for wa, wb in zip(a[0], b[0]):
        np.testing.assert_array_equal(wa, wb)
    assert len(a[1]) == len(b[1])
    for va, vb in zip(a[1], b[1]):
        np.testing.assert_array_equal(va, vb)


@pytest.mark.parametrize("build_first", [True, False])
def test_tf_train_checkpoint_round_trip(build_first, tmp_path):
    """Restored into a built optimizer, or before it is built (TF restores
    the variables when fit creates them)."""
    model, x, t, batch = _trained(16)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(str(tmp_path / "ckpt"))
    expected = _continue(model, x, t, batch)

    fresh = _dense_model(np.zeros((6, 5), "float32") + 0.5, extra_float=True)
    fresh.compile(
        CaseOptimizer(Bop(threshold=THRESHOLD, gamma=GAMMA), keras.optimizers.Adam(1e-2)), "mse"
    )
    if build_first:
        fresh.optimizer.build(fresh.trainable_variables)
    status = tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(path)
    if build_first:
        status.assert_consumed()
        assert int(fresh.optimizer.binary.iterations) == 2
        assert np.any(fresh.optimizer.binary._momentums[0].numpy() != 0)
    _assert_same_state(_continue(fresh, x, t, batch), expected)


def test_keras_file_round_trip(tmp_path):
    model, x, t, batch = _trained(16)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    opt = loaded.optimizer
    assert isinstance(opt, CaseOptimizer) and isinstance(opt.binary, Bop)
    assert opt.binary.get_config()["threshold"] == pytest.approx(THRESHOLD)
    assert int(opt.binary.iterations) == 2
    _assert_same_state(_continue(loaded, x, t, batch), _continue(model, x, t, batch))


def test_configs_round_trip():
    gamma = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    bop = Bop(threshold=1e-6, gamma=gamma, clipvalue=1.0, name="b")
    config = json.loads(json.dumps(keras.saving.serialize_keras_object(bop)))
    again = keras.saving.deserialize_keras_object(config)
    assert isinstance(again, Bop) and again.clipvalue == 1.0 and again.name == "b"
    assert float(again.threshold) == pytest.approx(1e-6)
    assert isinstance(again._learning_rate, keras.optimizers.schedules.ExponentialDecay)
    case = CaseOptimizer(Bop(gamma=0.01), keras.optimizers.Adam(3e-3))
    config = json.loads(json.dumps(keras.saving.serialize_keras_object(case)))
    again = keras.saving.deserialize_keras_object(config)
    assert float(again.binary.gamma) == pytest.approx(0.01)
    assert float(again.learning_rate) == pytest.approx(3e-3)


def test_learning_rate_is_the_default_optimizers():
    case = CaseOptimizer(Bop(gamma=0.01), keras.optimizers.Adam(3e-3))
    case.learning_rate = 1e-3
    assert float(case.default.learning_rate) == pytest.approx(1e-3)
    assert float(case.binary.gamma) == pytest.approx(0.01)
    bop = Bop(gamma=0.01)
    bop.gamma = 0.02
    bop.threshold = 1e-5
    assert float(bop.learning_rate) == pytest.approx(0.02)
    assert float(bop.threshold) == pytest.approx(1e-5)


# ---- mixed precision ----


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def test_fit_under_mixed_float16_wraps_in_loss_scaling(mixed_float16):
    x, t, w0, grads, batch = _dense_problem()
    model = _dense_model(w0)
    opt = CaseOptimizer(Bop(threshold=THRESHOLD, gamma=GAMMA), keras.optimizers.SGD(0.1))
    model.compile(opt, _linear_loss)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert model.optimizer.inner_optimizer is opt
    model.fit(x, t, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    kernel = model.get_layer("binary").kernel
    assert kernel.dtype == "float32"
    # float16 products and a scaled loss round the gradient; the reference's
    # margin check keeps every flip decision far from the boundary.
    trajectory = np_reference(w0, grads, GAMMA, THRESHOLD)
    np.testing.assert_array_equal(kernel.numpy(), trajectory[-1][0])
    np.testing.assert_allclose(
        opt.binary._momentums[0].numpy(), trajectory[-1][1], rtol=2e-2, atol=2e-4
    )
    assert int(opt.binary.iterations) == STEPS


def test_loss_scale_optimizer_skips_nonfinite_steps():
    w0, grads = _problem()
    binary, floating = _marked_variable(w0), tf.Variable(np.ones((2,), "float32"))
    case = CaseOptimizer(Bop(threshold=THRESHOLD, gamma=GAMMA), keras.optimizers.SGD(0.5))
    opt = keras.optimizers.LossScaleOptimizer(case, initial_scale=8.0)
    opt.apply_gradients([(tf.constant(grads[0]) * 8.0, binary), (tf.ones((2,)) * 8.0, floating)])
    after_one = binary.numpy().copy()
    np.testing.assert_array_equal(after_one, np_reference(w0, grads[:1], GAMMA, THRESHOLD)[0][0])
    np.testing.assert_allclose(floating.numpy(), 0.5)
    opt.apply_gradients([(tf.constant(grads[1]) * np.inf, binary), (tf.ones((2,)), floating)])
    np.testing.assert_array_equal(binary.numpy(), after_one)
    np.testing.assert_allclose(floating.numpy(), 0.5)
    assert float(opt.dynamic_scale) == 4.0 and int(case.binary.iterations) == 1


# ---- MirroredStrategy over 2 logical CPUs (fresh processes) ----

_DISTRIBUTED = textwrap.dedent("""
    import os, sys
    import numpy as np
    import tensorflow as tf
    mode, out = sys.argv[1], sys.argv[2]
    if mode != "single":  # before TF runs anything
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    import tapehook
    from tapehook.optimizers import Bop, CaseOptimizer

    strategy = (tf.distribute.get_strategy() if mode == "single"
                else tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6, 6, 2)).astype("float32")
    y = rng.normal(size=(32, 2)).astype("float32")
    with strategy.scope():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((6, 6, 2))
        h = keras.layers.Conv2D(4, 3, padding="same", name="stem")(inputs)
        h = keras.layers.Conv2D(4, 3, padding="same", use_bias=False, name="binary")(h)
        outputs = keras.layers.Dense(2)(keras.layers.Flatten()(h))
        model = tapehook.binarize(keras.Model(inputs, outputs), include="binary",
                                  activations=True)
        opt = CaseOptimizer(Bop(threshold=1e-4, gamma=0.2), keras.optimizers.SGD(0.05))
        model.compile(opt, "mse")
    initial_signs = np.sign(model.get_layer("binary").kernel.numpy())
    if mode == "mirrored_loop":
        # Keras optimizers cannot create their variables inside strategy.run
        # in a tf.function (Keras's SGD(momentum=0.9) fails the same way):
        # build first, as fit does.
        with strategy.scope():
            opt.build(model.trainable_variables)
        dataset = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(8))

        @tf.function
        def step(xb, yb):
            def replica(xb, yb):
                with tf.GradientTape() as tape:
                    per_example = tf.reduce_mean(tf.square(model(xb, training=True) - yb), 1)
                    loss = tf.nn.compute_average_loss(per_example, global_batch_size=8)
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
            strategy.run(replica, args=(xb, yb))

        for xb, yb in dataset:
            step(xb, yb)
    else:
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    kernel = model.get_layer("binary").kernel
    momentum = opt.binary._momentums[0]
    np.savez(out, *model.get_weights(), momentum=np.asarray(momentum),
             flips=np.sum(np.asarray(kernel) != initial_signs),
             replicas=len(getattr(kernel.value, "values", [0])),
             momentum_replicas=len(getattr(momentum.value, "values", [0])),
             steps=[int(opt.binary.iterations.numpy()), int(opt.default.iterations.numpy())])
""")


def _distributed(mode, tmp_path):
    script = tmp_path / f"train_{mode}.py"
    script.write_text(_DISTRIBUTED)
    out = tmp_path / f"{mode}.npz"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("TF_CONFIG", None)
    run = subprocess.run(
        [sys.executable, str(script), mode, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return np.load(out)


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    return _distributed("single", tmp_path_factory.mktemp("single"))


@pytest.mark.parametrize("mode", ["mirrored_fit", "mirrored_loop"])
def test_mirrored_strategy_matches_single_device(mode, single_device, tmp_path):
    single, mirrored = single_device, _distributed(mode, tmp_path)
    assert int(single["flips"]) > 0
    assert int(mirrored["replicas"]) == 2 and int(mirrored["momentum_replicas"]) == 2
    assert list(mirrored["steps"]) == list(single["steps"]) == [4, 4]
    weights = sorted((k for k in single.files if k.startswith("arr_")), key=lambda k: int(k[4:]))
    np.testing.assert_array_equal(mirrored["arr_2"], single["arr_2"])  # binary kernel
    assert set(np.unique(single["arr_2"])) == {-1.0, 1.0}
    for key in weights + ["momentum"]:
        # replicas sum gradients in another order: float rounding
        np.testing.assert_allclose(
            mirrored[key], single[key], rtol=0, atol=1e-5 * (1 + np.abs(single[key]).max())
        )


# ---- misuse ----


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"threshold": -1e-8}, "threshold must be"),
        ({"threshold": float("nan")}, "threshold must be"),
        ({"threshold": "1e-8"}, "threshold must be"),
        ({"gamma": 0.0}, r"gamma .* \(0, 1\]"),
        ({"gamma": 1.5}, r"gamma .* \(0, 1\]"),
        ({"gamma": -1e-4}, r"gamma .* \(0, 1\]"),
        ({"gamma": True}, r"gamma .* \(0, 1\]"),
        ({"learning_rate": 0.1}, "step size is gamma"),
        ({"weight_decay": 1e-4}, "CaseOptimizer"),
        ({"use_ema": True}, "CaseOptimizer"),
    ],
)
def test_bop_bad_arguments(kwargs, match):
    with pytest.raises(tapehook.TapehookError, match=match):
        Bop(**kwargs)


def test_bop_edges_are_accepted():
    Bop(threshold=0.0, gamma=1.0)


def test_bop_on_a_float_variable_names_case_optimizer():
    var = tf.Variable(np.ones((3, 3, 2, 2), "float32"), name="float_kernel")
    with pytest.raises(
        tapehook.TapehookError, match="float_kernel.*not marked binary.*CaseOptimizer"
    ):
        Bop().apply_gradients([(tf.ones((3, 3, 2, 2)), var)])
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(Bop(), "mse")
    with pytest.raises(tapehook.TapehookError, match="CaseOptimizer"):
        model.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0)


def test_case_optimizer_bad_arguments():
    with pytest.raises(tapehook.TapehookError, match="Keras 3 optimizer"):
        CaseOptimizer(Bop(), "adam")
    with pytest.raises(tapehook.TapehookError, match="wrap the CaseOptimizer"):
        CaseOptimizer(Bop(), keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
    with pytest.raises(tapehook.TapehookError, match="CaseOptimizer takes"):
        CaseOptimizer(Bop())
    with pytest.raises(tapehook.TapehookError, match="does not take"):
        CaseOptimizer(Bop(), keras.optimizers.SGD(), clipnorm=1.0)
    sgd = keras.optimizers.SGD()
    with pytest.raises(tapehook.TapehookError, match="distinct optimizer"):
        CaseOptimizer(sgd, sgd)
    with pytest.raises(tapehook.TapehookError, match="pair 0 must be a Keras 3"):
        CaseOptimizer((lambda v: True, "sgd"), default_optimizer=sgd)
    with pytest.warns(UserWarning, match="lost.*not trained"):
        CaseOptimizer((lambda v: v.shape.rank == 1, sgd)).build(
            [tf.Variable([1.0], name="kept"), tf.Variable(1.0, name="lost")]
        )


def test_case_optimizer_needs_a_binary_variable():
    opt = CaseOptimizer(Bop(), keras.optimizers.SGD())
    with pytest.raises(tapehook.TapehookError, match="no variable is marked binary"):
        opt.apply_gradients([(tf.ones((2, 2)), tf.Variable(np.ones((2, 2), "float32")))])


def test_predicates_claiming_one_variable_twice():
    opt = CaseOptimizer(
        (lambda v: True, keras.optimizers.SGD()), (lambda v: True, keras.optimizers.SGD())
    )
    with pytest.raises(tapehook.TapehookError, match="claimed by the predicates"):
        opt.build([tf.Variable(1.0)])


def test_marks_changed_after_build_are_refused():
    w0, grads = _problem()
    binary, floating = _marked_variable(w0), tf.Variable(w0)
    opt = CaseOptimizer(Bop(), keras.optimizers.SGD())
    opt.apply_gradients([(tf.constant(grads[0]), binary), (tf.constant(grads[0]), floating)])
    tapehook.mark_binary(floating)
    with pytest.raises(tapehook.TapehookError, match="became binary after.*built"):
        opt.apply_gradients([(tf.constant(grads[1]), binary), (tf.constant(grads[1]), floating)])
    with pytest.raises(tapehook.TapehookError, match="not among the variables"):
        opt.apply_gradients([(tf.constant(grads[1]), tf.Variable(w0))])


# ---- WeightClip ----


@pytest.mark.parametrize("clip", [1.0, 0.5, 2])
def test_weight_clip_matches_numpy(clip):
    w = np.random.default_rng(0).normal(size=(3, 3, 2, 4)).astype("float32") * 2
    np.testing.assert_array_equal(
        np.asarray(WeightClip(clip)(tf.constant(w))), np.clip(w, -clip, clip)
    )
    assert WeightClip(clip).get_config() == {"clip_value": float(clip)}


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_weight_clip_in_fit(run_eagerly, tmp_path):
    x, t, w0, grads, batch = _dense_problem()
    inputs = keras.Input((6,))
    layer = keras.layers.Dense(5, use_bias=False, kernel_constraint=WeightClip(0.5))
    model = keras.Model(inputs, layer(inputs))
    layer.kernel.assign(w0)
    model.compile(keras.optimizers.SGD(20.0), _linear_loss, run_eagerly=run_eagerly)
    model.fit(x, t, batch_size=batch, shuffle=False, verbose=0)
    w = w0
    for g in grads:  # float layer: the gradient is x^T t / batch
        w = np.clip(w - np.float32(20.0) * g, -0.5, 0.5)
    np.testing.assert_allclose(layer.kernel.numpy(), w, rtol=1e-5, atol=1e-6)
    assert np.sum(np.abs(w) == 0.5) > 5  # the clip was active
    model.save(tmp_path / "clip.keras")
    loaded = keras.models.load_model(tmp_path / "clip.keras")
    constraint = loaded.layers[-1].kernel.constraint
    assert isinstance(constraint, WeightClip) and constraint.clip_value == 0.5


@pytest.mark.parametrize("clip", [0, -1.0, float("nan"), float("inf"), "1", True, None])
def test_weight_clip_bad_values(clip):
    with pytest.raises(tapehook.TapehookError, match="clip_value must be a positive"):
        WeightClip(clip)


# ---- the example ----


@pytest.mark.parametrize("recipe", ["quicknet", "two_stage"])
@pytest.mark.slow
def test_quicknet_digits_example(recipe, capsys):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "quicknet_digits.py"
    spec = importlib.util.spec_from_file_location("quicknet_digits", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(["--recipes", recipe, "--epochs", "2", "--size", "8", "--verbose", "0"])
    accuracy, flipped = results[recipe]
    out = capsys.readouterr().out
    assert accuracy > 0.5 and flipped > 0
    assert f"{recipe}: 4 binary kernels" in out and "values [-1.0, 1.0]" in out
    assert f"{recipe}: test accuracy" in out
    assert tapehook.dispatch_counts()["compiled"]["backprop_filter"] > 0
