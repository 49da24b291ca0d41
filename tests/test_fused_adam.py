"""tapehook.optimizers.Adam (TF's fused ResourceApplyAdam) against Keras 3's
Adam (the independent reference: the same formula on other ops) and a NumPy
reference: eager, tf.function, Keras fit, float64, schedules, amsgrad and
sparse gradients (Keras's own update), weight decay, loss scaling under
mixed_float16, saving, MirroredStrategy; and that the fused op runs."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tapehook
from tapehook.optimizers import Adam

from conftest import fit_mirrored

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
    x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="binary")(inputs)
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
