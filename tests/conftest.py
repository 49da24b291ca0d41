"""Shared test helpers: the reference results and every execution mode.

Every binary result is compared with tapehook.reference (plain TF ops with a
tf.custom_gradient), which is itself checked against a NumPy loop in
test_reference.py.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The suite checks tapehook's kernels against the reference; the dispatcher's
# "auto" routing to stock convolutions is tested on its own (test_dispatch.py).
os.environ.setdefault("TAPEHOOK_DISPATCH", "kernels")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tapehook  # noqa: E402
from tapehook import reference  # noqa: E402

# Every BinarySpec option, each at least once.
SPECS = [
    tapehook.BinarySpec(),
    tapehook.BinarySpec(scale="mean_abs"),
    tapehook.BinarySpec(activations=True),
    tapehook.BinarySpec(activations="approx_sign", ste="ste_sign"),
    tapehook.BinarySpec(activations=True, ste="swish_sign", scale="mean_abs"),
    tapehook.BinarySpec(ste="approx_sign"),
    tapehook.BinarySpec(activations=True, clip=0.5),
]
SPEC_IDS = ["ste", "mean_abs", "act", "bireal", "swish_act_scaled", "approx", "clip05"]

TOLERANCE = {tf.float64: 1e-9, tf.float32: 2e-5, tf.float16: 2e-2, tf.bfloat16: 5e-2}


def np_sign(t):
    """sign with zero mapping to +1, in NumPy."""
    return np.where(t >= 0, 1.0, -1.0)


def np_estimator_grad(name, t, clip):
    """e'(t) written out in NumPy (docs/design.md)."""
    if name == "ste_sign":
        return (np.abs(t) <= clip).astype(float)
    if name == "approx_sign":
        return np.where(np.abs(t) <= 1, 2 - 2 * np.abs(t), 0.0)
    b = 5.0
    return b * (2 - b * t * np.tanh(b * t / 2)) / (1 + np.cosh(b * t))


def spec_kwargs(spec):
    return dict(activations=spec.activations, scale=spec.scale, ste=spec.ste, clip=spec.clip)


def assert_close(actual, expected, dtype=tf.float32, what=""):
    """|a - e| <= tol * (1 + max|e|): relative to the tensor's scale."""
    actual = np.asarray(tf.cast(actual, tf.float64))
    expected = np.asarray(tf.cast(expected, tf.float64))
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    scale = 1.0 + np.max(np.abs(expected), initial=0.0)
    err = np.max(np.abs(actual - expected), initial=0.0)
    assert err <= TOLERANCE[dtype] * scale, f"{what}: max error {err} (scale {scale})"


def random_inputs(x_shape, w_shape, dtype=tf.float32, seed=0):
    """x, latent w and an upstream gradient g, with exact zeros sprinkled in."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=x_shape) * 1.2
    x[rng.random(x_shape) < 0.05] = 0.0
    w = rng.normal(size=w_shape) * 0.8
    w.flat[0] = 0.0
    return tf.constant(x, dtype), tf.constant(w, dtype)


def upstream(y_shape, dtype, seed=1):
    return tf.constant(np.random.default_rng(seed).normal(size=y_shape), dtype)


def reference_result(x, w, spec, g, **conv):
    """(y, dx, dw) of the reference binary conv, loss = sum(y * g)."""
    conv = {"strides": [1, 1, 1, 1], "padding": "SAME", "explicit_paddings": [],
            "dilations": [1, 1, 1, 1], **conv}
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        y = reference.binary_conv2d(x, w, spec, **conv)
        wide = tf.float64 if y.dtype == tf.float64 else tf.float32
        loss = tf.reduce_sum(tf.cast(y, wide) * tf.cast(g, wide))
    dx, dw = tape.gradient(loss, [x, w])
    return y, dx, dw


def _conv(x, w, conv):
    return tf.nn.conv2d(x, w, strides=conv.get("strides", 1),
                        padding=conv.get("padding", "SAME"),
                        dilations=conv.get("dilations", 1))


def _loss(y, g):
    return tf.reduce_sum(tf.cast(y, tf.float32) * tf.cast(g, tf.float32))


def run_eager(x, w0, g, conv, mark):
    w = tf.Variable(w0)
    mark(w)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = _conv(x, w, conv)  # the tf.Variable goes straight to tf.nn.conv2d
        loss = _loss(y, g)
    return (y, *tape.gradient(loss, [x, w]))


def run_tape_in_function(x, w0, g, conv, mark):
    w = tf.Variable(w0)
    mark(w)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = _conv(x, w, conv)
            loss = _loss(y, g)
        return (y, *tape.gradient(loss, [x, w]))

    return step(x)


def run_function_under_tape(x, w0, g, conv, mark):
    w = tf.Variable(w0)
    mark(w)
    forward = tf.function(lambda x: _conv(x, w, conv))
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = forward(x)
        loss = _loss(y, g)
    return (y, *tape.gradient(loss, [x, w]))


def run_nested_functions(x, w0, g, conv, mark):
    w = tf.Variable(w0)
    mark(w)
    inner = tf.function(lambda x: tf.identity(_conv(x, w, conv)))

    @tf.function
    def outer(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.function(lambda x: inner(x))(x)
            loss = _loss(y, g)
        return (y, *tape.gradient(loss, [x, w]))

    return outer(x)


def _run_v1(x, w0, g, conv, mark, use_tape):
    graph = tf.Graph()
    with graph.as_default():
        w = tf.Variable(w0.numpy())
        mark(w)
        xg = tf.constant(x.numpy())
        if use_tape:
            with tf.GradientTape() as tape:
                tape.watch(xg)
                y = _conv(xg, w, conv)
                loss = _loss(y, g.numpy())
            dx, dw = tape.gradient(loss, [xg, w])
        else:
            y = _conv(xg, w, conv)
            dx, dw = tf.compat.v1.gradients(_loss(y, g.numpy()), [xg, w])
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            return sess.run([y, dx, dw])


def run_v1_gradients(x, w0, g, conv, mark):
    return _run_v1(x, w0, g, conv, mark, use_tape=False)


def run_v1_tape(x, w0, g, conv, mark):
    return _run_v1(x, w0, g, conv, mark, use_tape=True)


MODES = {
    "eager": run_eager,
    "tape_in_function": run_tape_in_function,
    "function_under_tape": run_function_under_tape,
    "nested_functions": run_nested_functions,
    "v1_gradients": run_v1_gradients,
    "v1_tape": run_v1_tape,
}


@pytest.fixture(autouse=True)
def _fresh_state():
    """Each test starts with zeroed counters and the compiled path."""
    tapehook.reset_dispatch_counts()
    yield
    from tapehook import kernels
    kernels.force_reference(False)
