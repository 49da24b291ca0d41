"""override_gradient: the scoped gradient replaces the registered one for the
ops executed inside the scope, in every mode, and only for those.

Expected gradients are written out in NumPy (elementwise ops) or come from
tapehook.reference / stock convolutions on plain tensors.
"""

import threading

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context

import tapehook
from tapehook import override, reference, registry
from tapehook.compat import execute
from tapehook.override import override_gradient

from conftest import MODE_NAMES, assert_close, run_mode

RNG = np.random.default_rng(7)
U_SHAPE = (4, 5)
X0 = tf.constant(RNG.normal(size=U_SHAPE) * 1.5, tf.float32)
W0 = tf.constant(RNG.normal(size=U_SHAPE), tf.float32)
G = tf.constant(RNG.normal(size=U_SHAPE), tf.float32)

CONV_X = tf.constant(RNG.normal(size=(2, 6, 5, 3)) * 1.2, tf.float32)
CONV_W = tf.constant(RNG.normal(size=(3, 3, 3, 4)) * 0.8, tf.float32)
CONV_G = tf.constant(RNG.normal(size=(2, 6, 5, 4)), tf.float32)


def sigmoid(t):
    return 1 / (1 + np.exp(-t))


def soft_relu_grad(op, grad):
    """An override that reads the op's input, output and attrs."""
    assert op.type == "Relu" and op.get_attr("T") == tf.float32
    return grad * tf.sigmoid(op.inputs[0]) * (1 + op.outputs[0])


def expected_soft_relu(u, g):
    """dL/du for y = relu(u) under soft_relu_grad, L = sum(y * g)."""
    return g * sigmoid(u) * (1 + np.maximum(u, 0))


def scaled(factor):
    return lambda op, grad: grad * factor


# --- every mode (conftest.run_mode): run `forward(x, w)` inside `scope`,
# return (y, dL/dx, dL/dw) for L = sum(y * g), with the gradient built after
# the scope closed.


def _loss(y, g):
    return tf.reduce_sum(y * g)


def _override_mode(mode):
    def run(forward, scope, x, w0, g, prepare):
        return run_mode(mode, x, w0, g, forward, prepare=prepare, scope=scope, loss=_loss)

    return run


MODES = {mode: _override_mode(mode) for mode in MODE_NAMES}


def no_mark(w):
    return None


def relu_of_product(x, w):
    return tf.nn.relu(x * w)


def binary_conv(x, w):
    return tf.nn.conv2d(x, w, strides=1, padding="SAME")


@pytest.fixture(autouse=True)
def _no_scope_left():
    """Every test leaves TF as it found it: no callback, record_gradient unwrapped."""
    record_gradient = execute.record_gradient
    yield
    assert execute.record_gradient is record_gradient
    assert getattr(override._thread, "overrides", []) == []
    assert override._on_op not in context.context().op_callbacks


# --- the override in every mode


@pytest.mark.parametrize("mode", sorted(MODES))
def test_relu_override_in_every_mode(mode):
    y, dx, dw = MODES[mode](
        relu_of_product, override_gradient("Relu", soft_relu_grad), X0, W0, G, no_mark
    )
    x, w, g = X0.numpy(), W0.numpy(), G.numpy()
    u = x * w
    du = expected_soft_relu(u, g)
    assert_close(y, np.maximum(u, 0))
    assert_close(dx, du * w)
    assert_close(dw, du * x)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_registered_gradient_without_scope(mode):
    """The same runs with no scope give TF's Relu gradient (the control)."""
    _, dx, dw = MODES[mode](
        relu_of_product, override_gradient("Tanh", scaled(9.0)), X0, W0, G, no_mark
    )
    x, w, g = X0.numpy(), W0.numpy(), G.numpy()
    du = g * (x * w > 0)
    assert_close(dx, du * w)
    assert_close(dw, du * x)


# --- composition with tapehook's binary Conv2D


def reference_binary_grads(dy_of_y):
    """(y, dx, dw) of the reference binary conv with upstream dy_of_y(y)."""
    spec = tapehook.BinarySpec()
    with tf.GradientTape() as tape:
        tape.watch([CONV_X, CONV_W])
        y = reference.binary_conv2d(CONV_X, CONV_W, spec)
    dx, dw = tape.gradient(
        y, [CONV_X, CONV_W], output_gradients=tf.constant(dy_of_y(y.numpy()), tf.float32)
    )
    return y, dx, dw


@pytest.mark.parametrize("mode", sorted(MODES))
def test_relu_override_around_binary_conv(mode):
    """A Relu override leaves the binary conv's gradient binary."""
    y, dx, dw = MODES[mode](
        lambda x, w: tf.nn.relu(binary_conv(x, w)),
        override_gradient("Relu", soft_relu_grad),
        CONV_X,
        CONV_W,
        CONV_G,
        tapehook.mark_binary,
    )
    g = CONV_G.numpy()
    ry, rdx, rdw = reference_binary_grads(lambda yc: expected_soft_relu(yc, g))
    assert_close(y, np.maximum(ry, 0))
    assert_close(dx, rdx)
    assert_close(dw, rdw)
    assert tapehook.dispatch_counts()["compiled"]["backprop_filter"] >= 1


def stock_conv2d_grad(op, grad):
    assert op.type == "Conv2D" and list(op.get_attr("strides")) == [1, 1, 1, 1]
    return registry.original_gradient("Conv2D")(op, grad)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_conv2d_override_wins_over_binary_gradient(mode):
    """Overriding Conv2D itself: the binary forward keeps, the gradient is the
    override's (here TF's float gradient through the latent weights)."""
    y, dx, dw = MODES[mode](
        binary_conv,
        override_gradient("Conv2D", stock_conv2d_grad),
        CONV_X,
        CONV_W,
        CONV_G,
        tapehook.mark_binary,
    )
    with tf.GradientTape() as tape:
        tape.watch([CONV_X, CONV_W])
        float_y = tf.nn.conv2d(CONV_X, CONV_W, strides=1, padding="SAME")
    fdx, fdw = tape.gradient(float_y, [CONV_X, CONV_W], output_gradients=CONV_G)
    ry, rdx, rdw = reference_binary_grads(lambda _: CONV_G.numpy())
    assert_close(y, ry)
    assert_close(dx, fdx)
    assert_close(dw, fdw)
    assert np.max(np.abs(np.asarray(dw) - rdw.numpy())) > 1e-2  # not the binary one


def test_binary_conv_outside_the_conv2d_scope_stays_binary():
    w = tapehook.mark_binary(tf.Variable(CONV_W))
    with tf.GradientTape(persistent=True) as tape:
        with override_gradient("Conv2D", lambda op, grad: (None, 0.0 * op.inputs[1])):
            inside = binary_conv(CONV_X, w)
        outside = binary_conv(CONV_X, w)
    np.testing.assert_array_equal(tape.gradient(inside, w, output_gradients=CONV_G), 0.0)
    _, _, rdw = reference_binary_grads(lambda _: CONV_G.numpy())
    assert_close(tape.gradient(outside, w, output_gradients=CONV_G), rdw)


# --- nesting, op types outside the scope, decorator


def nested_forward(x, w):
    """Outer Relu x2 scope (the harness's); inner scopes inside the forward."""
    u = x * w
    with override_gradient("Square", lambda op, grad: grad * op.inputs[0] * 10.0):
        a = tf.nn.relu(u)  # outer Relu scope: x2
        s = tf.square(u)  # x10 u
    with override_gradient("Relu", scaled(3.0)):
        r = tf.nn.relu(u)  # innermost wins: x3
    return a + s + r + tf.square(u) + tf.nn.relu(u)  # registered 2u; outer x2


@pytest.mark.parametrize("mode", sorted(MODES))
def test_nested_scopes(mode):
    _, dx, dw = MODES[mode](
        nested_forward, override_gradient("Relu", scaled(2.0)), X0, W0, G, no_mark
    )
    x, w, g = X0.numpy(), W0.numpy(), G.numpy()
    u = x * w
    du = g * (2 + 10 * u + 3 + 2 * u + 2)
    assert_close(dx, du * w)
    assert_close(dw, du * x)


def test_ops_outside_the_scope_keep_the_registered_gradient_bit_for_bit():
    def run(with_scope):
        u = X0 * W0
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(u)
            if with_scope:
                with override_gradient("Relu", scaled(5.0)):
                    inside = tf.nn.relu(u)
            outside = tf.nn.relu(u) + tf.tanh(u)
        return (
            tape.gradient(outside, u, output_gradients=G),
            tape.gradient(inside, u, output_gradients=G) if with_scope else None,
        )

    plain, _ = run(with_scope=False)
    outside, inside = run(with_scope=True)
    np.testing.assert_array_equal(outside, plain)
    assert_close(inside, 5.0 * G.numpy())
    u, g = (X0 * W0).numpy(), G.numpy()
    assert_close(plain, g * (u > 0) + g * (1 - np.tanh(u) ** 2))


def test_decorator_runs_the_body_inside_the_scope():
    @override_gradient("Relu", soft_relu_grad)
    def activation(u):
        return tf.nn.relu(u)

    u = X0 * W0
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(u)
        decorated = activation(u)
        plain = tf.nn.relu(u)
    traced = tf.function(activation)
    with tf.GradientTape() as function_tape:
        function_tape.watch(u)
        in_function = traced(u)
    expected = expected_soft_relu(u.numpy(), G.numpy())
    assert_close(tape.gradient(decorated, u, output_gradients=G), expected)
    assert_close(function_tape.gradient(in_function, u, output_gradients=G), expected)
    assert_close(tape.gradient(plain, u, output_gradients=G), G.numpy() * (u.numpy() > 0))


# --- tracing: the scope is a forward-time (trace-time) property of graphs


def test_function_traced_outside_the_scope_keeps_the_registered_gradient():
    function = tf.function(tf.nn.relu)
    u = X0 * W0
    function.get_concrete_function(u)
    with tf.GradientTape() as tape:
        tape.watch(u)
        with override_gradient("Relu", scaled(5.0)):
            y = function(u)
    assert_close(tape.gradient(y, u, output_gradients=G), G.numpy() * (u.numpy() > 0))
    retraced = tf.function(tf.nn.relu)
    with tf.GradientTape() as tape:
        tape.watch(u)
        with override_gradient("Relu", scaled(5.0)):
            y = retraced(u)
    assert_close(tape.gradient(y, u, output_gradients=G), 5.0 * G.numpy())


# --- exceptions, threads, misuse


def test_leaving_by_exception_restores_every_state():
    outer = override_gradient("Relu", scaled(2.0))
    u = X0 * W0
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(u)
        with outer:
            with pytest.raises(RuntimeError):
                with override_gradient("Relu", scaled(3.0)):
                    raise RuntimeError("inner")
            still_outer = tf.nn.relu(u)
        with pytest.raises(RuntimeError):
            with outer:
                raise RuntimeError("outer")
        plain = tf.nn.relu(u)
    assert_close(tape.gradient(still_outer, u, output_gradients=G), 2.0 * G.numpy())
    assert_close(tape.gradient(plain, u, output_gradients=G), G.numpy() * (u.numpy() > 0))


def test_scopes_are_per_thread():
    """Another thread's relu, eager and traced, while this thread holds a scope."""
    u = X0 * W0
    entered, done = threading.Event(), threading.Event()
    results = {}

    def other_thread():
        entered.wait()
        with tf.GradientTape() as tape:
            tape.watch(u)
            y = tf.nn.relu(u)
        results["eager"] = tape.gradient(y, u, output_gradients=G)

        @tf.function
        def step(u):
            with tf.GradientTape() as tape:
                tape.watch(u)
                y = tf.nn.relu(u)
            return tape.gradient(y, u, output_gradients=G)

        results["function"] = step(u)
        done.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with tf.GradientTape() as tape:
        tape.watch(u)
        with override_gradient("Relu", scaled(5.0)):
            entered.set()
            assert done.wait(60)
            y = tf.nn.relu(u)
    thread.join()
    registered = G.numpy() * (u.numpy() > 0)
    assert_close(results["eager"], registered)
    assert_close(results["function"], registered)
    assert_close(tape.gradient(y, u, output_gradients=G), 5.0 * G.numpy())


def test_wrong_number_of_gradients_raises():
    u = X0 * W0
    with tf.GradientTape() as tape:
        tape.watch(u)
        with override_gradient("Relu", lambda op, grad: (grad, grad)):
            y = tf.nn.relu(u)
    with pytest.raises(tapehook.TapehookError, match="returned 2 gradients.*1 inputs"):
        tape.gradient(y, u)


@pytest.mark.parametrize(
    "op_type, grad_fn", [("", scaled(1.0)), (None, scaled(1.0)), ("Relu", "not callable")]
)
def test_bad_arguments_raise(op_type, grad_fn):
    with pytest.raises(tapehook.TapehookError, match="override_gradient"):
        override_gradient(op_type, grad_fn)
