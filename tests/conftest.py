"""Shared test helpers: the reference results and every execution mode.

Every binary result is compared with tapehook.reference (plain TF ops with a
tf.custom_gradient), which is itself checked against a NumPy loop in
test_reference.py.
"""

import contextlib
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


def np_estimator_grad(name, t, clip, beta=5.0):
    """e'(t) written out in NumPy (docs/design.md); clip None: no mask."""
    if name == "ste_sign":
        return np.ones_like(t, float) if clip is None else (np.abs(t) <= clip).astype(float)
    if name == "approx_sign":
        return np.where(np.abs(t) <= 1, 2 - 2 * np.abs(t), 0.0)
    b = beta
    with np.errstate(over="ignore"):
        return b * (2 - b * t * np.tanh(b * t / 2)) / (1 + np.cosh(b * t))


def spec_kwargs(spec):
    """Every field of a BinarySpec, as keywords for mark_binary / binary_scope."""
    return spec.to_config()


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
    conv = {
        "strides": [1, 1, 1, 1],
        "padding": "SAME",
        "explicit_paddings": [],
        "dilations": [1, 1, 1, 1],
        **conv,
    }
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        y = reference.binary_conv2d(x, w, spec, **conv)
        wide = tf.float64 if y.dtype == tf.float64 else tf.float32
        loss = tf.reduce_sum(tf.cast(y, wide) * tf.cast(g, wide))
    dx, dw = tape.gradient(loss, [x, w])
    return y, dx, dw


def _conv(x, w, conv):
    return tf.nn.conv2d(
        x,
        w,
        strides=conv.get("strides", 1),
        padding=conv.get("padding", "SAME"),
        dilations=conv.get("dilations", 1),
    )


def _loss(y, g):
    return tf.reduce_sum(tf.cast(y, tf.float32) * tf.cast(g, tf.float32))


def run_mode(mode, x, w0, g, forward, prepare=lambda w: None, scope=None, loss=_loss):
    """(y, dL/dx, dL/dw) for L = loss(forward(x, w), g) with w = tf.Variable(w0)
    passed to ``prepare`` first, in one of the execution modes of MODE_NAMES.
    ``forward`` runs inside ``scope`` (a context manager, entered where the
    forward is built) and the gradient is built after the scope closed."""
    scope = scope if scope is not None else contextlib.nullcontext()

    if mode in ("v1_gradients", "v1_tape"):
        graph = tf.Graph()
        with graph.as_default():
            w = tf.Variable(np.asarray(w0))
            prepare(w)
            xg = tf.constant(np.asarray(x))
            # v1_gradients builds no tape at all: graph gradients only
            with tf.GradientTape() if mode == "v1_tape" else contextlib.nullcontext() as tape:
                if tape is not None:
                    tape.watch(xg)
                with scope:
                    y = forward(xg, w)
                value = loss(y, np.asarray(g))
            if mode == "v1_tape":
                dx, dw = tape.gradient(value, [xg, w])
            else:
                dx, dw = tf.compat.v1.gradients(value, [xg, w])
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                return sess.run([y, dx, dw])

    w = tf.Variable(w0)
    prepare(w)
    x = tf.convert_to_tensor(x)

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            with scope:
                y = forward(x, w)  # a tf.Variable goes straight to the op
            value = loss(y, g)
        return (y, *tape.gradient(value, [x, w]))

    if mode == "eager":
        return step(x)
    if mode == "tape_in_function":
        return tf.function(step)(x)
    if mode == "function_under_tape":
        function = tf.function(lambda x: forward(x, w))
        with scope:
            function.get_concrete_function(x)  # traced inside the scope
        with tf.GradientTape() as tape:  # called and differentiated outside it
            tape.watch(x)
            y = function(x)
            value = loss(y, g)
        return (y, *tape.gradient(value, [x, w]))
    if mode == "nested_functions":
        inner = tf.function(lambda x: tf.identity(forward(x, w)))

        @tf.function
        def outer(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                with scope:
                    y = tf.function(lambda x: inner(x))(x)
                value = loss(y, g)
            return (y, *tape.gradient(value, [x, w]))

        return outer(x)
    raise ValueError(f"unknown mode {mode!r}")


MODE_NAMES = (
    "eager",
    "tape_in_function",
    "function_under_tape",
    "nested_functions",
    "v1_gradients",
    "v1_tape",
)


def _conv_mode(mode):
    def run(x, w0, g, conv, mark):
        return run_mode(mode, x, w0, g, lambda x, w: _conv(x, w, conv), prepare=mark)

    return run


# MODES[mode](x, w0, g, conv, mark): a conv through tf.nn.conv2d in that mode.
MODES = {mode: _conv_mode(mode) for mode in MODE_NAMES}


@pytest.fixture(autouse=True)
def _fresh_state():
    """Each test starts with zeroed counters and the compiled path."""
    tapehook.reset_dispatch_counts()
    yield
    from tapehook import kernels

    kernels.force_reference(False)


def run_python_json(*args):
    """The JSON a fresh ``python *args`` prints on its last line (TF's logs
    off); fails with the end of its stderr if it exits non-zero."""
    import json
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, *args],
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def fit_mirrored(module):
    """{name: weights} of ``module``'s mirrored_variants() each fitted under
    MirroredStrategy over 2 logical CPUs, in a fresh process
    (tests/helpers/mirrored_fit.py)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers", "mirrored_fit.py")
    out = run_python_json(script, module)
    return {name: [np.array(w) for w in weights] for name, weights in out.items()}


def conv_gradient_graph(w, x_shape):
    """The graph of a tf.function taking d/d(x, w) of sum(conv2d(x, w)^2)
    (stride 1, SAME) for a float32 x of ``x_shape`` (its graph.inputs[0])."""

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.nn.conv2d(x, w, 1, "SAME") ** 2)
        return tape.gradient(loss, [x, w])

    return step.get_concrete_function(tf.TensorSpec(x_shape)).graph


TIERS = ("best", "no_avx512", "portable")


def run_in_tier(tier, script, *args):
    """Runs ``python -c script *args`` in a process whose kernels use one
    vector tier (cpu.h reads the TAPEHOOK_NO_* switches once per process):
    "best" (what this CPU has), "no_avx512" (AVX2 at most) or "portable"."""
    import subprocess
    import sys

    env = dict(os.environ)
    env["TAPEHOOK_NO_AVX512"] = "1" if tier != "best" else "0"
    env["TAPEHOOK_NO_AVX2"] = "1" if tier == "portable" else "0"
    subprocess.run(
        [sys.executable, "-c", script, *map(str, args)], env=env, check=True, capture_output=True
    )


def taped_inference_op_types(net, x):
    """The op types of a tf.function that calls ``net(x, training=False)``
    under a GradientTape and asks for the gradient to x (a graph built with
    a tape recording: nothing may be folded for inference there)."""
    import tensorflow as tf

    @tf.function
    def taped(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            y = net(t, training=False)
        return tape.gradient(y, t)

    return [op.type for op in taped.get_concrete_function(x).graph.get_operations()]


def inference_gradients(net, x, variables):
    """tf.gradients (no tape, so inference folding happens) of a function of
    ``net(x, training=False)`` with respect to x and ``variables``, and the
    op types of its graph."""
    import tensorflow as tf

    @tf.function
    def g(t):
        y = net(t, training=False)
        return tf.gradients(tf.reduce_sum(y * tf.cos(y)), [t, *variables])

    types = [op.type for op in g.get_concrete_function(x).graph.get_operations()]
    return g(x), types


def recomputed_binary_convs(model):
    """The binary convs (tapehook.larq layers) of a functional model whose
    output a recomputing batch norm rebuilds: each runs its forward again in
    a training step's backward."""
    return [
        norm.input._keras_history.operation
        for norm in model.layers
        if getattr(norm, "recompute", False)
        and getattr(norm.input._keras_history.operation, "input_quantizer", None)
    ]
