"""tapehook.recipes' learnable binarizers and annealed estimators against the
papers' formulas written out in NumPy (forward and gradients), in eager,
tf.function and one Keras fit step; balanced weights against finite
differences; .keras round trips; mixed_float16."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tapehook import recipes
from tapehook.errors import TapehookError

from conftest import np_estimator_grad, np_sign

MODES = ["eager", "function"]
B, H, W, C = 3, 4, 5, 6


def in_mode(mode, fn):
    return fn if mode == "eager" else tf.function(fn)


def inputs(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-2, 2, (B, H, W, C)).astype(dtype)
    g = rng.normal(size=(B, H, W, C)).astype(dtype)
    return x, g


def value_and_grads(layer, x, g, mode):
    """layer(x) and the gradients of sum(g * layer(x)) w.r.t. x and the
    layer's trainable weights."""
    layer(x)  # build

    def run(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
            loss = tf.reduce_sum(tf.cast(g, y.dtype) * y)
        return y, tape.gradient(loss, [x, *layer.trainable_weights])

    y, grads = in_mode(mode, run)(tf.constant(x))
    return y.numpy(), [v.numpy() for v in grads]


# NumPy references: the papers' formulas, per channel on the last axis.


def np_rsign(x, beta, g, estimator, clip):
    t = x.astype(np.float64) - beta
    dt = g * np_estimator_grad(estimator, t, clip)
    return np_sign(t), dt, -dt.sum(axis=(0, 1, 2))


def np_rprelu(x, gamma, slope, zeta, g):
    t = x.astype(np.float64) - gamma
    y = np.where(t > 0, t, slope * t) + zeta
    dt = g * np.where(t > 0, 1.0, slope)
    dslope = (g * np.where(t > 0, 0.0, t)).sum(axis=(0, 1, 2))
    return y, dt, -dt.sum(axis=(0, 1, 2)), dslope, g.sum(axis=(0, 1, 2))


def np_rescale(x, sh, sw, sc, g):
    scale = sh.reshape(H, 1, 1) * sw.reshape(1, W, 1) * sc.reshape(1, 1, C)
    gx = g * x
    return (
        x * scale,
        g * scale,
        (gx * sw.reshape(1, W, 1) * sc.reshape(1, 1, C)).sum(axis=(0, 2, 3)).reshape(H, 1, 1),
        (gx * sh.reshape(H, 1, 1) * sc.reshape(1, 1, C)).sum(axis=(0, 1, 3)).reshape(1, W, 1),
        (gx * sh.reshape(H, 1, 1) * sw.reshape(1, W, 1)).sum(axis=(0, 1, 2)).reshape(1, 1, C),
    )


def np_ede_grad(x, k, t):
    return k * t * (1 - np.tanh(t * x) ** 2)


def close(a, e, tol=1e-5, what=""):
    np.testing.assert_allclose(np.asarray(a, np.float64), e, rtol=tol, atol=tol, err_msg=what)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "estimator,clip",
    [("ste_sign", 1.0), ("ste_sign", 0.5), ("approx_sign", 1.0), ("ste_sign", None)],
)
def test_rsign_against_numpy(mode, estimator, clip):
    x, g = inputs()
    layer = recipes.RSign(estimator=estimator, clip=clip)
    layer.build(x.shape)
    beta = np.linspace(-0.7, 0.9, C).astype(np.float32)
    layer.beta.assign(beta)
    x[0, 0, 0] = beta  # x == beta: sign(0) = +1, the estimator at 0
    y, (dx, dbeta) = value_and_grads(layer, x, g, mode)
    ey, edx, edbeta = np_rsign(x, beta, g, estimator, clip)
    close(y, ey, 0, "forward")
    close(dx, edx, what="dx")
    close(dbeta, edbeta, what="dbeta")


@pytest.mark.parametrize("mode", MODES)
def test_rprelu_against_numpy(mode):
    x, g = inputs(1)
    layer = recipes.RPReLU()
    layer.build(x.shape)
    close(layer.slope.numpy(), np.full(C, 0.25), 0, "slope init")
    rng = np.random.default_rng(2)
    gamma, slope, zeta = (rng.uniform(-1, 1, C).astype(np.float32) for _ in range(3))
    for var, value in zip(layer.weights, (gamma, slope, zeta), strict=True):
        var.assign(value)
    x[0, 0, 0] = gamma
    y, grads = value_and_grads(layer, x, g, mode)
    expected = np_rprelu(x, gamma, slope, zeta, g)
    for name, got, want in zip(
        ["y", "dx", "dgamma", "dslope", "dzeta"], [y, *grads], expected, strict=True
    ):
        close(got, want, what=name)


@pytest.mark.parametrize("mode", MODES)
def test_learned_rescale_against_numpy(mode):
    x, g = inputs(3)
    layer = recipes.LearnedRescale()
    layer.build(x.shape)
    assert [v.name for v in layer.weights] == ["scale_h", "scale_w", "scale_c"]
    rng = np.random.default_rng(4)
    values = [rng.uniform(0.5, 1.5, v.shape).astype(np.float32) for v in layer.weights]
    for var, value in zip(layer.weights, values, strict=True):
        var.assign(value)
    y, grads = value_and_grads(layer, x, g, mode)
    expected = np_rescale(x, *[v.ravel() for v in values], g)
    for name, got, want in zip(["y", "dx", "dh", "dw", "dc"], [y, *grads], expected, strict=True):
        close(got, want, what=name)


@pytest.mark.parametrize("mode", MODES)
def test_ede_sign_follows_assigned_variables(mode):
    x, g = inputs(5)
    k, t = tf.Variable(1.0), tf.Variable(0.1)
    traces = []

    def run(x):
        traces.append(1)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = recipes.ede_sign(x, k, t)
        return y, tape.gradient(y, x, output_gradients=tf.constant(g))

    fn = in_mode(mode, run)
    for progress in (0.0, 0.5, 1.0):
        tv, kv = recipes.ede_schedule(progress)
        close([tv, kv], [0.1 * 10 ** (2 * progress), max(1 / (0.1 * 10 ** (2 * progress)), 1)])
        t.assign(tv)
        k.assign(kv)
        y, dx = fn(tf.constant(x))
        close(y, np_sign(x), 0, "forward")
        close(dx, g * np_ede_grad(x.astype(np.float64), kv, tv), what=f"dx at {progress}")
    assert len(traces) == (3 if mode == "eager" else 1)  # assignments need no retrace


@pytest.mark.parametrize("mode", MODES)
def test_balanced_weights_against_numpy_and_finite_differences(mode):
    rng = np.random.default_rng(6)
    w = rng.normal(size=(3, 3, 2, 4))
    g = rng.normal(size=w.shape)
    axes = (0, 1, 2)
    centred = w - w.mean(axis=axes, keepdims=True)
    expected = centred / np.sqrt((centred**2).mean(axis=axes, keepdims=True) + 1e-12)

    def run(w):
        with tf.GradientTape() as tape:
            tape.watch(w)
            y = recipes.balanced_weights(w)
            loss = tf.reduce_sum(g * y)
        return y, tape.gradient(loss, w)

    y, dw = in_mode(mode, run)(tf.constant(w))
    close(y, expected, 1e-12, "forward")
    # Zero mean, unit deviation per output channel: sign() is balanced.
    close(y.numpy().mean(axis=axes), np.zeros(4), 1e-12)

    def np_loss(w):
        c = w - w.mean(axis=axes, keepdims=True)
        return np.sum(g * c / np.sqrt((c**2).mean(axis=axes, keepdims=True) + 1e-12))

    fd = np.zeros_like(w)
    h = 1e-6
    for i in np.ndindex(w.shape):
        e = np.zeros_like(w)
        e[i] = h
        fd[i] = (np_loss(w + e) - np_loss(w - e)) / (2 * h)
    close(dw, fd, 1e-6, "gradient vs finite differences")


def _sum_loss(y_true, y_pred):
    """Per example sum(y_true * y_pred): the upstream gradient is y_true / batch."""
    return keras.ops.sum(y_true * y_pred, axis=[1, 2, 3])


def test_fit_step_matches_manual_update():
    """One SGD step of fit through RSign -> RPReLU -> LearnedRescale equals
    the update computed by the chain rule in NumPy."""
    x, g = inputs(7)
    model = keras.Sequential(
        [keras.Input((H, W, C)), recipes.RSign(), recipes.RPReLU(), recipes.LearnedRescale()]
    )
    rng = np.random.default_rng(8)
    start = [
        rng.uniform(0.3, 1.2, v.shape).astype(np.float32)
        * (1 if "scale" in v.name else rng.choice([-1, 1], v.shape))
        for v in model.weights
    ]
    for var, value in zip(model.weights, start, strict=True):
        var.assign(value)
    lr = 0.1
    model.compile(keras.optimizers.SGD(lr), loss=_sum_loss)
    model.fit(x, g, batch_size=B, epochs=1, verbose=0, shuffle=False)

    beta, gamma, slope, zeta, sh, sw, sc = [v.astype(np.float64) for v in start]
    s, dt1, _ = np_rsign(x, beta, np.ones_like(x), "ste_sign", 1.0)
    r, _, _, _, _ = np_rprelu(s, gamma, slope, zeta, np.ones_like(x))
    dout = g.astype(np.float64) / B
    _, dr, dsh, dsw, dsc = np_rescale(r, sh.ravel(), sw.ravel(), sc.ravel(), dout)
    _, ds, dgamma, dslope, dzeta = np_rprelu(s, gamma, slope, zeta, dr)
    _, _, dbeta = np_rsign(x, beta, ds, "ste_sign", 1.0)
    grads = [dbeta, dgamma, dslope, dzeta, dsh, dsw, dsc]
    for var, value, grad in zip(model.weights, start, grads, strict=True):
        close(var.numpy(), value - lr * grad, 1e-5, var.name)


def test_anneal_ede_per_epoch_in_fit():
    """AnnealEstimator sets IR-Net's t, k at each epoch start, and the traced
    train step uses them: each epoch's update equals NumPy's with that t, k."""
    rng = np.random.default_rng(9)
    x = rng.uniform(-1, 1, (4, 3)).astype(np.float32)
    g = rng.normal(size=(4, 2)).astype(np.float32)
    dense = keras.layers.Dense(2, use_bias=False)
    ede = recipes.EDESign(t_min=0.1, t_max=10.0)
    model = keras.Sequential([keras.Input((3,)), dense, ede])
    lr, epochs = 0.5, 3
    model.compile(keras.optimizers.SGD(lr), loss=lambda y, p: keras.ops.sum(y * p, axis=-1))
    anneal = recipes.AnnealEstimator()
    kernels = []
    keep = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: kernels.append(
            (dense.kernel.numpy(), ede.t.numpy(), ede.k.numpy())
        )
    )
    w = dense.kernel.numpy().astype(np.float64)
    model.fit(x, g, batch_size=4, epochs=epochs, verbose=0, callbacks=[anneal, keep])
    for epoch, (kernel, t_now, k_now) in enumerate(kernels):
        t = 0.1 * 10 ** (epoch / epochs * np.log10(100))
        k = max(1 / t, 1.0)
        close([t_now, k_now], [t, k], 1e-6, f"t, k at epoch {epoch}")
        dy = g / 4 * np_ede_grad(x @ w, k, t)
        w = w - lr * x.T @ dy
        close(kernel, w, 1e-5, f"kernel after epoch {epoch}")
    assert anneal.history[0][0] == 0.0


def test_anneal_swish_per_batch():
    rng = np.random.default_rng(10)
    x = rng.uniform(-1, 1, (6, 4)).astype(np.float32)
    swish = recipes.SwishSign(beta=2.0, beta_end=8.0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), swish])
    model.compile("sgd", loss="mse")
    anneal = recipes.AnnealEstimator(every="batch")
    model.fit(x, x, batch_size=2, epochs=2, verbose=0, callbacks=[anneal])
    progress = [p for p, _ in anneal.history]
    close(progress, np.arange(6) / 6, 1e-12)
    close([v[swish.name][0] for _, v in anneal.history], 2.0 + 6.0 * np.arange(6) / 6, 1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_swish_sign_gradient_follows_beta(mode):
    x, g = inputs(11)
    layer = recipes.SwishSign(beta=3.0, beta_end=7.0)
    layer.build(x.shape)
    for progress, beta in ((0.0, 3.0), (0.5, 5.0)):
        layer.anneal(progress)
        y, (dx,) = value_and_grads(layer, x, g, mode)
        close(y, np_sign(x), 0)
        close(dx, g * np_estimator_grad("swish_sign", x.astype(np.float64), None, beta), 1e-5)


def _all_layers_model():
    inputs = keras.Input((H, W, C))
    x = recipes.RSign(estimator="approx_sign", name="rsign")(inputs)
    x = recipes.RPReLU(name="rprelu")(x)
    x = recipes.LearnedRescale(name="rescale")(x)
    x = recipes.EDESign(t_min=0.2, t_max=5.0, name="ede")(x)
    x = recipes.SwishSign(beta=4.0, beta_end=6.0, name="swish")(x)
    return keras.Model(inputs, x)


def test_keras_round_trip(tmp_path):
    model = _all_layers_model()
    rng = np.random.default_rng(12)
    for var in model.weights:
        var.assign(rng.uniform(0.2, 1.0, var.shape))
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    for a, b in zip(model.layers[1:], loaded.layers[1:], strict=True):
        assert type(a) is type(b) and a.get_config() == b.get_config()
    for a, b in zip(model.weights, loaded.weights, strict=True):
        close(b.numpy(), a.numpy(), 0, a.name)
    x, _ = inputs(13)
    close(loaded(x), model(x).numpy(), 0)


def test_mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _all_layers_model()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert all(v.dtype == "float32" for v in model.weights)
    rsign = model.get_layer("rsign")
    # A threshold float16 cannot hold: x - beta is taken in float32.
    # beta just above a float16 number: in float16, x - beta would be 0 (+1).
    x16 = np.float16(1e-4)
    beta = np.full(C, np.float32(x16) * np.float32(1 + 1e-6), np.float32)
    assert np.float16(beta[0]) == x16
    rsign.beta.assign(beta)
    x, g = inputs(14)
    x[0, 0, 0] = x16
    x, g = x.astype(np.float16), g.astype(np.float16)
    y, (dx, dbeta) = value_and_grads(rsign, x, g, "function")
    assert y.dtype == np.float16 and np.all(y[0, 0, 0] == -1)
    ey, edx, edbeta = np_rsign(x, beta.astype(np.float64), g.astype(np.float64), "approx_sign", 1.0)
    close(y, ey, 0)
    close(dx, edx, 1e-3)
    close(dbeta, edbeta, 2e-2)
    out = model(x.astype(np.float16))
    assert out.dtype == "float16" and np.all(np.isfinite(out.numpy()))


def test_bad_arguments():
    with pytest.raises(TapehookError, match="estimator"):
        recipes.RSign(estimator="sign")
    with pytest.raises(TapehookError, match="t_min"):
        recipes.EDESign(t_min=1.0, t_max=0.5)
    with pytest.raises(TapehookError, match="NHWC"):
        recipes.LearnedRescale()(keras.Input((4, 3)))
    with pytest.raises(TapehookError, match="every"):
        recipes.AnnealEstimator(every="step")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    with pytest.raises(TapehookError, match="EDESign"):
        model.fit(
            np.zeros((2, 2)), np.zeros((2, 1)), verbose=0, callbacks=[recipes.AnnealEstimator()]
        )
