"""tapehook.distill against the papers' formulas in NumPy: the losses' values
and gradients (finite differences where the gradient is not written out) in
eager and tf.function, and Distiller.fit's step (labels, distribution,
attention; plain and under MirroredStrategy) against an SGD step on the NumPy
loss's finite-difference gradient; several teachers; checkpoints and saving
the student; mixed_float16."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tapehook import distill
from tapehook.errors import TapehookError

MODES = ["eager", "function"]


def in_mode(mode, fn):
    return fn if mode == "eager" else tf.function(fn)


def np_softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def np_distribution(teacher, student, t):
    """ReActNet / Hinton, per example: T^2 * sum -p log q at temperature T."""
    p, q = np_softmax(teacher / t), np_softmax(student / t)
    return t * t * -(p * np.log(q)).sum(-1)


def np_attention(features):
    q = (features**2).sum(-1).reshape(len(features), -1)
    return q / np.linalg.norm(q, axis=-1, keepdims=True)


def np_attention_loss(teacher, student):
    return np.linalg.norm(np_attention(student) - np_attention(teacher), axis=-1)


def finite_differences(f, x, h=1e-6):
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = h
        grad[i] = (f(x + e) - f(x - e)) / (2 * h)
    return grad


@pytest.fixture
def float64():
    # Keras fixes its global dtype policy from floatx at the first layer a
    # process builds, so set both (the policy decides the layers' dtype).
    keras.backend.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    yield
    keras.backend.set_floatx("float32")
    keras.config.set_dtype_policy("float32")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_distribution_loss_against_numpy(mode, temperature):
    rng = np.random.default_rng(0)
    teacher, student = rng.normal(size=(2, 4, 7)) * 3
    losses = {
        "distribution": distill.DistributionLoss(temperature, reduction=None),
        "output_matching": distill.OutputMatchingLoss(temperature, reduction=None),
    }

    def run(teacher, student):
        out = {}
        for name, loss in losses.items():
            with tf.GradientTape(persistent=True) as tape:
                tape.watch([teacher, student])
                value = loss(teacher, student)
                total = tf.reduce_sum(value)
            out[name] = (value, *tape.gradient(total, [student, teacher]))
        return out

    out = in_mode(mode, run)(tf.constant(teacher), tf.constant(student))
    t = temperature
    p = np_softmax(teacher / t)
    expected = np_distribution(teacher, student, t)
    entropy = -(p * np.log(p)).sum(-1)
    for name, want in (("distribution", expected), ("output_matching", expected - t * t * entropy)):
        value, d_student, d_teacher = out[name]
        np.testing.assert_allclose(value, want, rtol=1e-5, err_msg=name)
        # Per example: T (softmax(student / T) - softmax(teacher / T)).
        np.testing.assert_allclose(d_student, t * (np_softmax(student / t) - p), atol=1e-6)
        assert d_teacher is None or not np.any(d_teacher)
    mean = distill.DistributionLoss(t)(teacher, student)
    np.testing.assert_allclose(mean, expected.mean(), rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_attention_loss_against_numpy_and_finite_differences(mode):
    rng = np.random.default_rng(1)
    teacher = rng.normal(size=(3, 4, 5, 6))
    student = rng.normal(size=(3, 4, 5, 2))
    loss = distill.AttentionMatchingLoss(reduction=None, dtype="float64")

    def run(teacher, student):
        with tf.GradientTape() as tape:
            tape.watch(student)
            value = loss(teacher, student)
            total = tf.reduce_sum(value)
        return value, tape.gradient(total, student)

    value, grad = in_mode(mode, run)(tf.constant(teacher), tf.constant(student))
    np.testing.assert_allclose(value, np_attention_loss(teacher, student), rtol=1e-12)
    fd = finite_differences(lambda s: np_attention_loss(teacher, s).sum(), student)
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-8)
    same = loss(tf.constant(teacher), tf.constant(teacher))
    assert not np.any(same)
    with tf.GradientTape() as tape:
        s = tf.constant(teacher)
        tape.watch(s)
        zero = loss(tf.constant(teacher), s)
    assert np.all(np.isfinite(tape.gradient(zero, s)))  # no NaN where the maps agree


SHAPE, CLASSES = (4, 4, 2), 3


def small_net(name, channels, seed):
    inputs = keras.Input(SHAPE)
    x = keras.layers.Conv2D(channels, 1, use_bias=False, name="feat")(inputs)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(CLASSES, name="logits")(x)
    model = keras.Model(inputs, outputs, name=name)
    rng = np.random.default_rng(seed)
    for var in model.weights:
        var.assign(rng.normal(size=var.shape))
    return model


def np_net(weights, x):
    """small_net in NumPy: (logits, the conv's feature map)."""
    kernel, dense, bias = weights
    feat = x @ kernel.reshape(kernel.shape[2:])
    return feat.mean(axis=(1, 2)) @ dense + bias, feat


def np_log_softmax(z):
    shifted = z - z.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


KW = dict(alpha=0.7, beta=1.3, gamma=2.0, temperature=2.0, attention=["feat"])


def np_total(student_weights, teacher_weights, x, y):
    logits, feat = np_net(student_weights, x)
    t_logits, t_feat = np_net(teacher_weights, x)
    label = -np_log_softmax(logits)[np.arange(len(y)), y].mean()
    dist = np_distribution(t_logits, logits, KW["temperature"]).mean()
    att = np_attention_loss(t_feat, feat).mean()
    return KW["alpha"] * label + KW["beta"] * dist + KW["gamma"] * att


@pytest.mark.parametrize("strategy", [None, "mirrored"])
def test_fit_step_matches_numpy(float64, strategy):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(6, *SHAPE))
    y = rng.integers(0, CLASSES, 6)
    scope = tf.distribute.MirroredStrategy(["/cpu:0"]).scope() if strategy else _NoScope()
    with scope:
        student, teacher = small_net("student", 3, 3), small_net("teacher", 5, 4)
        distiller = distill.Distiller(student, teacher, **KW)
        lr = 0.05
        distiller.compile(
            keras.optimizers.SGD(lr), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    s0 = [v.numpy() for v in student.weights]
    t0 = [v.numpy() for v in teacher.weights]
    history = distiller.fit(x, y, batch_size=6, epochs=1, verbose=0, shuffle=False).history
    np.testing.assert_allclose(history["loss"][0], np_total(s0, t0, x, y), rtol=1e-10)
    sizes = [w.size for w in s0]

    def unflat(flat):
        parts = np.split(flat, np.cumsum(sizes)[:-1])
        return [p.reshape(w.shape) for p, w in zip(parts, s0, strict=True)]

    flat = np.concatenate([w.ravel() for w in s0])
    grad = finite_differences(lambda f: np_total(unflat(f), t0, x, y), flat)
    for var, want in zip(student.weights, unflat(flat - lr * grad), strict=True):
        np.testing.assert_allclose(var.numpy(), want, rtol=1e-7, atol=1e-9, err_msg=var.name)
    for var, before in zip(teacher.weights, t0, strict=True):
        np.testing.assert_array_equal(var.numpy(), before)  # frozen


class _NoScope:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("teacher_weights", [None, [0.25, 0.75]])
def test_several_teachers(float64, teacher_weights):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(5, *SHAPE))
    student = small_net("student", 3, 6)
    teachers = [small_net("t0", 4, 7), small_net("t1", 2, 8)]
    distiller = distill.Distiller(student, teachers, alpha=0.0, teacher_weights=teacher_weights)
    distiller.compile("sgd")
    result = distiller.evaluate(x, verbose=0, return_dict=True)
    logits = np_net([w.numpy() for w in student.weights], x)[0]
    t_logits = [np_net([w.numpy() for w in t.weights], x)[0] for t in teachers]
    if teacher_weights is None:
        want = np_distribution((t_logits[0] + t_logits[1]) / 2, logits, 1.0).mean()
    else:
        want = sum(
            w * np_distribution(t, logits, 1.0).mean()
            for w, t in zip(teacher_weights, t_logits, strict=True)
        )
    np.testing.assert_allclose(result["distillation_loss"], want, rtol=1e-10)
    np.testing.assert_allclose(result["loss"], want, rtol=1e-10)
    np.testing.assert_allclose(distiller.predict(x, verbose=0), logits, rtol=1e-10)


def test_checkpoints_and_save_student(tmp_path):
    rng = np.random.default_rng(9)
    x = rng.normal(size=(8, *SHAPE)).astype(np.float32)
    y = rng.integers(0, CLASSES, 8)
    distiller = distill.Distiller(small_net("student", 3, 10), small_net("teacher", 5, 11), **KW)
    distiller.compile(
        keras.optimizers.Adam(1e-2),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    callbacks = [
        keras.callbacks.ModelCheckpoint(tmp_path / "distiller.keras"),
        distill.StudentCheckpoint(
            tmp_path / "student.keras", monitor="val_loss", save_best_only=True
        ),
        keras.callbacks.ModelCheckpoint(tmp_path / "d.weights.h5", save_weights_only=True),
    ]
    history = distiller.fit(
        x, y, batch_size=4, epochs=2, verbose=0, validation_data=(x, y), callbacks=callbacks
    )
    assert {"label_loss", "distillation_loss", "attention_loss", "accuracy", "val_loss"} <= set(
        history.history
    )
    want = distiller.predict(x, verbose=0)
    student = keras.models.load_model(tmp_path / "student.keras")
    assert [layer.name for layer in student.layers] == [
        layer.name for layer in distiller.student.layers
    ]
    assert not isinstance(student, distill.Distiller)
    np.testing.assert_allclose(student.predict(x, verbose=0), want, rtol=1e-6)
    loaded = keras.models.load_model(tmp_path / "distiller.keras")
    assert isinstance(loaded, distill.Distiller) and loaded.attention == [("feat", "feat")]
    np.testing.assert_allclose(loaded.predict(x, verbose=0), want, rtol=1e-6)
    np.testing.assert_allclose(
        loaded.evaluate(x, y, verbose=0), distiller.evaluate(x, y, verbose=0), rtol=1e-5
    )
    distiller.save_student(tmp_path / "s.keras")
    distiller.save_student(tmp_path / "s.weights.h5")
    fresh = small_net("student", 3, 12)
    fresh.load_weights(tmp_path / "s.weights.h5")
    np.testing.assert_allclose(fresh.predict(x, verbose=0), want, rtol=1e-6)
    np.testing.assert_allclose(
        keras.models.load_model(tmp_path / "s.keras").predict(x, verbose=0), want, rtol=1e-6
    )
    with pytest.raises(TapehookError, match="export_savedmodel"):
        distiller.save_student(tmp_path / "student")


def test_mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        student = small_net("student", 3, 13)
        distiller = distill.Distiller(student, small_net("teacher", 5, 14), **KW)
        distiller.compile(
            keras.optimizers.SGD(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")
    rng = np.random.default_rng(15)
    x = rng.normal(size=(4, *SHAPE)).astype(np.float32)
    y = rng.integers(0, CLASSES, 4)
    logits = distiller.predict(x, verbose=0)
    assert logits.dtype == np.float16
    result = distiller.evaluate(x, y, verbose=0, return_dict=True)
    t_logits = distiller.teacher.predict(x, verbose=0).astype(np.float64)
    want = np_distribution(t_logits, logits.astype(np.float64), KW["temperature"]).mean()
    np.testing.assert_allclose(result["distillation_loss"], want, rtol=1e-4)
    history = distiller.fit(x, y, epochs=2, verbose=0).history
    assert all(np.isfinite(v).all() for v in history.values())
    assert all(v.dtype == "float32" for v in student.weights)


def test_bad_arguments():
    student, teacher = small_net("s", 3, 0), small_net("t", 3, 1)
    with pytest.raises(TapehookError, match="one weight per teacher"):
        distill.Distiller(student, [teacher, teacher], teacher_weights=[1.0])
    with pytest.raises(TapehookError, match="one teacher"):
        distill.Distiller(student, [teacher, teacher], attention=["feat"])
    with pytest.raises(TapehookError, match="layer names among"):
        distill.Distiller(student, teacher, attention=[("feat", "nope")])
    with pytest.raises(TapehookError, match="Keras model"):
        distill.Distiller(student, lambda x: x)
    with pytest.raises(TapehookError, match="temperature"):
        distill.DistributionLoss(0.0)
