"""Unmarked code is stock TensorFlow, bit for bit.

Every public TF / Keras entry point that reaches a function tapehook wraps is
called with NumPy, list, tensor and Variable arguments, eager and inside
tf.function, in three states:

- ``stock``: tapehook uninstalled (TensorFlow's own functions),
- ``quiet``: installed as in a process that never marked anything (the
  per-op wrappers not applied, see patches.py),
- ``armed``: installed while a marked variable exists elsewhere,

and outputs, gradients, and exception types and messages must be identical,
byte for byte. The calling forms come from the APIs' documentation.
"""

import dataclasses
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import gen_array_ops, gen_math_ops, gen_nn_ops, nn_impl, nn_ops

import tapehook
from tapehook import marks, patches

rng = np.random.default_rng(7)


def _a(*shape):
    return rng.normal(size=shape).astype(np.float32)


X1, F1 = _a(2, 9, 3), _a(3, 3, 4)
X2, F2 = _a(2, 8, 8, 3), _a(3, 3, 3, 4)
X3, F3 = _a(1, 6, 6, 6, 2), _a(3, 3, 3, 2, 3)
DW = _a(3, 3, 3, 2)
PW = _a(1, 1, 6, 5)
FT2 = _a(3, 3, 5, 3)  # conv2d_transpose filter [h, w, out, in]
FT1 = _a(3, 5, 3)
M, N, B3 = _a(4, 5), _a(5, 3), _a(2, 4, 5)
B3b = _a(2, 5, 3)


@dataclasses.dataclass
class Case:
    name: str
    fn: object
    arrays: tuple  # array arguments, converted per argument kind
    kinds: tuple = ("numpy", "list", "tensor", "variable")
    make: object = None  # builds an object (a layer) eagerly, passed first to fn


CASES = [
    Case("nn.conv1d", lambda x, f: tf.nn.conv1d(x, f, 1, "SAME"), (X1, F1)),
    Case("nn.conv1d_dilated", lambda x, f: tf.nn.conv1d(x, f, 1, "SAME", dilations=2), (X1, F1)),
    Case("nn.conv2d", lambda x, f: tf.nn.conv2d(x, f, 2, "VALID"), (X2, F2)),
    Case(
        "nn.conv2d_kw",
        lambda x, f: tf.nn.conv2d(
            input=x, filters=f, strides=[1, 1], padding=[[0, 0], [1, 2], [0, 1], [0, 0]]
        ),
        (X2, F2),
    ),
    Case("nn.conv2d_dilated", lambda x, f: tf.nn.conv2d(x, f, 1, "SAME", dilations=2), (X2, F2)),
    Case("nn.conv3d", lambda x, f: tf.nn.conv3d(x, f, [1, 1, 1, 1, 1], "SAME"), (X3, F3)),
    Case("nn.convolution", lambda x, f: tf.nn.convolution(x, f, padding="SAME"), (X2, F2)),
    Case(
        "nn.convolution_dil_int",
        lambda x, f: tf.nn.convolution(x, f, padding="SAME", dilations=2),
        (X2, F2),
    ),
    Case(
        "nn.convolution_dil_ndarray",
        lambda x, f: tf.nn.convolution(x, f, padding="VALID", dilations=np.array([1, 1])),
        (X2, F2),
    ),
    Case(
        "nn.convolution_dil_ndarray2",
        lambda x, f: tf.nn.convolution(x, f, padding="SAME", dilations=np.array([2, 1])),
        (X2, F2),
    ),
    Case(
        "nn.convolution_1d_dil",
        lambda x, f: tf.nn.convolution(x, f, padding="SAME", dilations=[2]),
        (X1, F1),
    ),
    Case(
        "nn.convolution_3d_dil",
        lambda x, f: tf.nn.convolution(x, f, padding="SAME", dilations=2),
        (X3, F3),
    ),
    Case(
        "v1.nn.convolution",
        lambda x, f: tf.compat.v1.nn.convolution(x, f, "SAME", dilation_rate=(2, 2)),
        (X2, F2),
    ),
    Case(
        "nn.atrous_conv2d", lambda x, f: tf.nn.atrous_conv2d(x, f, rate=2, padding="SAME"), (X2, F2)
    ),
    Case("nn.atrous_conv2d_rate1", lambda x, f: tf.nn.atrous_conv2d(x, f, 1, "VALID"), (X2, F2)),
    Case(
        "nn.depthwise_conv2d",
        lambda x, f: tf.nn.depthwise_conv2d(x, f, [1, 1, 1, 1], "SAME"),
        (X2, DW),
    ),
    Case(
        "nn.depthwise_conv2d_dil",
        lambda x, f: tf.nn.depthwise_conv2d(x, f, [1, 1, 1, 1], "SAME", dilations=[2, 2]),
        (X2, DW),
    ),
    Case(
        "v1.nn.depthwise_conv2d_rate",
        lambda x, f: tf.compat.v1.nn.depthwise_conv2d(x, f, [1, 1, 1, 1], "VALID", rate=[2, 1]),
        (X2, DW),
    ),
    Case(
        "nn.separable_conv2d",
        lambda x, d, p: tf.nn.separable_conv2d(x, d, p, [1, 1, 1, 1], "SAME"),
        (X2, DW, PW),
    ),
    Case(
        "nn.separable_conv2d_dil",
        lambda x, d, p: tf.nn.separable_conv2d(x, d, p, [1, 1, 1, 1], "SAME", dilations=[2, 2]),
        (X2, DW, PW),
    ),
    Case(
        "v1.nn.separable_conv2d",
        lambda x, d, p: tf.compat.v1.nn.separable_conv2d(
            x, d, p, [1, 1, 1, 1], "VALID", rate=[2, 2]
        ),
        (X2, DW, PW),
    ),
    Case(
        "nn.conv2d_transpose",
        lambda x, f: tf.nn.conv2d_transpose(x, f, [2, 16, 16, 5], 2, "SAME"),
        (X2, FT2),
    ),
    Case(
        "nn.conv1d_transpose",
        lambda x, f: tf.nn.conv1d_transpose(x, f, [2, 9, 5], 1, "SAME"),
        (X1, FT1),
    ),
    Case("ops.conv", lambda x, f: keras.ops.conv(x, f, dilation_rate=2), (X2, F2)),
    Case("ops.conv_same", lambda x, f: keras.ops.conv(x, f, 2, "same"), (X2, F2)),
    Case("ops.conv_1d", lambda x, f: keras.ops.conv(x, f, dilation_rate=2), (X1, F1)),
    Case(
        "ops.depthwise_conv",
        lambda x, f: keras.ops.depthwise_conv(x, f, padding="same", dilation_rate=2),
        (X2, DW),
    ),
    Case(
        "ops.separable_conv",
        lambda x, d, p: keras.ops.separable_conv(x, d, p, padding="same"),
        (X2, DW, PW),
    ),
    Case("ops.conv_transpose", lambda x, f: keras.ops.conv_transpose(x, f, 2, "same"), (X2, FT2)),
    Case("matmul", tf.matmul, (M, N)),
    Case("linalg.matmul_t", lambda a, b: tf.linalg.matmul(a, b, transpose_a=True), (M.T.copy(), N)),
    Case("matmul_batched", tf.matmul, (B3, B3b)),
    Case(
        "matmul_adjoint",
        lambda a, b: tf.matmul(a, b, adjoint_b=True),
        (B3, B3b.transpose(0, 2, 1).copy()),
    ),
    Case("einsum", lambda a, b: tf.einsum("bij,bjk->bik", a, b), (B3, B3b)),
    Case("einsum_2d", lambda a, b: tf.einsum("ij,jk->ik", a, b), (M, N)),
    Case("identity", tf.identity, (M,)),
    Case("cast", lambda a: tf.cast(a, tf.float64), (M,)),
    Case("expand_dims", lambda a: tf.expand_dims(a, 1), (M,)),
    Case(
        "gen.conv2d_pos",
        lambda x, f: gen_nn_ops.conv2d(x, f, [1, 1, 1, 1], "SAME", True, [], "NHWC", [1, 1, 1, 1]),
        (X2, F2),
    ),
    Case(
        "gen.conv2d_kw",
        lambda x, f: gen_nn_ops.conv2d(input=x, filter=f, strides=[1, 1, 1, 1], padding="VALID"),
        (X2, F2),
    ),
    Case(
        "gen.depthwise_pos",
        lambda x, f: gen_nn_ops.depthwise_conv2d_native(
            x, f, [1, 1, 1, 1], "SAME", [], "NHWC", [1, 1, 1, 1]
        ),
        (X2, DW),
    ),
    Case(
        "gen.depthwise_kw",
        lambda x, f: gen_nn_ops.depthwise_conv2d_native(
            input=x, filter=f, strides=[1, 1, 1, 1], padding="VALID"
        ),
        (X2, DW),
    ),
    Case("gen.mat_mul_pos", lambda a, b: gen_math_ops.mat_mul(a, b, False, False), (M, N)),
    Case("gen.mat_mul_kw", lambda a, b: gen_math_ops.mat_mul(a=a, b=b, transpose_b=False), (M, N)),
    Case(
        "gen.bmm_v2_pos", lambda a, b: gen_math_ops.batch_mat_mul_v2(a, a, True, False), (B3, B3b)
    ),
    Case(
        "gen.bmm_v2_kw",
        lambda a, b: gen_math_ops.batch_mat_mul_v2(x=a, y=b, adj_y=False),
        (B3, B3b),
    ),
    Case(
        "gen.bmm_v3_pos",
        lambda a, b: gen_math_ops.batch_mat_mul_v3(a, b, tf.float32, False, False),
        (B3, B3b),
    ),
    Case(
        "gen.bmm_v3_kw",
        lambda a, b: gen_math_ops.batch_mat_mul_v3(x=a, y=b, Tout=tf.float32, adj_x=False),
        (B3, B3b),
    ),
    Case("gen.identity_pos", lambda a: gen_array_ops.identity(a), (M,)),
    Case("gen.identity_kw", lambda a: gen_array_ops.identity(input=a), (M,)),
    Case("gen.cast_pos", lambda a: gen_math_ops.cast(a, tf.float64), (M,)),
    Case("gen.cast_kw", lambda a: gen_math_ops.cast(x=a, DstT=tf.float64, Truncate=False), (M,)),
    Case("gen.expand_dims_pos", lambda a: gen_array_ops.expand_dims(a, 0), (M,)),
    Case("gen.expand_dims_kw", lambda a: gen_array_ops.expand_dims(input=a, axis=0), (M,)),
    Case(
        "nn_ops.convolution_internal_kw",
        lambda x, f: nn_ops.convolution_internal(
            input=x, filters=f, strides=[1, 1], padding="SAME", dilations=[2, 2]
        ),
        (X2, F2),
    ),
    Case(
        "nn_impl.depthwise_conv2d_kw",
        lambda x, f: nn_impl.depthwise_conv2d(
            input=x, filter=f, strides=[1, 1, 1, 1], padding="SAME", dilations=[2, 2]
        ),
        (X2, DW),
    ),
    # Calls that fail: TF's exception, type and message, must come through.
    Case("err.conv2d_channels", lambda x, f: tf.nn.conv2d(x, f, 1, "SAME"), (X2, _a(3, 3, 5, 4))),
    Case("err.conv2d_padding", lambda x, f: tf.nn.conv2d(x, f, 1, "FULL"), (X2, F2)),
    Case(
        "err.convolution_strided_dilated",
        lambda x, f: tf.nn.convolution(x, f, strides=2, padding="SAME", dilations=2),
        (X2, F2),
    ),
    Case("err.matmul_shapes", tf.matmul, (M, M)),
    Case("err.cast_missing", lambda a: gen_math_ops.cast(a), (M,)),
    Case("err.identity_extra", lambda a: gen_array_ops.identity(a, "n", 3), (M,)),
    Case("err.expand_dims_unknown_kw", lambda a: gen_array_ops.expand_dims(a, 0, axes=1), (M,)),
    Case(
        "err.depthwise_channels",
        lambda x, f: tf.nn.depthwise_conv2d(x, f, [1, 1, 1, 1], "SAME", dilations=[2, 2]),
        (X2, _a(3, 3, 5, 2)),
    ),
]


def _layer_case(name, make, x, kinds=("numpy", "tensor")):
    """A Keras layer built fresh per run (eagerly) with seeded initializers."""

    def build():
        layer = make()
        layer.build(x.shape)
        return layer

    return Case(name, lambda layer, x: layer(x), (x,), kinds, build)


def _init(seed):
    return keras.initializers.RandomNormal(seed=seed)


LAYER_CASES = [
    _layer_case(
        "keras.Conv1D",
        lambda: keras.layers.Conv1D(
            4, 3, padding="same", dilation_rate=2, kernel_initializer=_init(1)
        ),
        X1,
    ),
    _layer_case(
        "keras.Conv1D_causal",
        lambda: keras.layers.Conv1D(
            4, 3, padding="causal", dilation_rate=2, kernel_initializer=_init(11)
        ),
        X1,
    ),
    _layer_case(
        "keras.Conv2D",
        lambda: keras.layers.Conv2D(
            4, 3, strides=2, padding="same", kernel_initializer=_init(2), bias_initializer=_init(3)
        ),
        X2,
    ),
    _layer_case(
        "keras.Conv2D_dilated",
        lambda: keras.layers.Conv2D(
            4, 3, padding="same", dilation_rate=2, kernel_initializer=_init(4)
        ),
        X2,
    ),
    _layer_case(
        "keras.Conv3D",
        lambda: keras.layers.Conv3D(3, 3, padding="same", kernel_initializer=_init(5)),
        X3,
    ),
    _layer_case(
        "keras.DepthwiseConv2D",
        lambda: keras.layers.DepthwiseConv2D(
            3, padding="same", dilation_rate=2, depthwise_initializer=_init(6)
        ),
        X2,
    ),
    _layer_case(
        "keras.SeparableConv2D",
        lambda: keras.layers.SeparableConv2D(
            5, 3, padding="same", depthwise_initializer=_init(7), pointwise_initializer=_init(8)
        ),
        X2,
    ),
    _layer_case(
        "keras.Conv2DTranspose",
        lambda: keras.layers.Conv2DTranspose(
            5, 3, strides=2, padding="same", kernel_initializer=_init(9)
        ),
        X2,
    ),
    _layer_case("keras.Dense", lambda: keras.layers.Dense(3, kernel_initializer=_init(10)), B3),
]

ALL_CASES = CASES + LAYER_CASES


def _convert(array, kind):
    if kind == "numpy":
        return array
    if kind == "list":
        return array.tolist()
    if kind == "tensor":
        return tf.constant(array)
    return tf.Variable(array)


def _bytes(value):
    array = np.asarray(value)
    return array.dtype.str, array.shape, array.tobytes()


def _error_text(message):
    """An error's message without what differs between any two runs of the
    same failing graph: the traceback of where its node was defined (a
    Python stack, in which the registered Conv2D gradient tapehook installs
    is one more frame) and the traced function's unique name."""
    kept = [line for line in message.splitlines() if line and not line.startswith("  File ")]
    return re.sub(r"__inference_\w+?_\d+", "__inference_", "\n".join(kept))


def _run(case, kind, mode):
    """('ok', outputs, gradients) or ('error', type name, message)."""
    inputs = [_convert(a, kind) for a in case.arrays]
    watched = [i for i in inputs if isinstance(i, (tf.Tensor, tf.Variable))]
    if case.make is not None:
        inputs.insert(0, case.make())

    def body():
        with tf.GradientTape(persistent=True) as tape:
            for i in watched:
                tape.watch(i)
            out = case.fn(*inputs)
            loss = tf.reduce_sum(tf.cast(out, tf.float64) ** 2)
        sources = watched + [v for v in tape.watched_variables() if v not in watched]
        grads = tape.gradient(loss, sources) if sources else []
        return out, grads

    try:
        out, grads = tf.function(body)() if mode == "function" else body()
    except Exception as exc:  # noqa: BLE001 - the exception itself is compared
        return ("error", type(exc).__name__, _error_text(str(exc)))
    return ("ok", _bytes(out), [None if g is None else _bytes(g) for g in grads])


@pytest.fixture(scope="module")
def marked_elsewhere():
    """A marked variable that none of the cases uses."""
    var = tf.Variable(np.ones([3, 3, 3, 4], np.float32))
    tapehook.mark_binary(var, activations=True)
    return var


def _in_state(state, case, kind, mode):
    if state == "armed":  # the marked_elsewhere fixture armed the process
        return _run(case, kind, mode)
    patches.uninstall()
    try:
        if state == "quiet":  # what a process that never marked anything has
            patches.install(hot=False)
        return _run(case, kind, mode)
    finally:
        patches.uninstall()
        patches.install()


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("case", ALL_CASES, ids=[c.name for c in ALL_CASES])
def test_unmarked_calls_are_stock(case, mode, marked_elsewhere):
    assert marks.ARMED
    for kind in case.kinds:
        stock = _in_state("stock", case, kind, mode)
        for state in ("quiet", "armed"):
            ours = _in_state(state, case, kind, mode)
            assert ours == stock, (case.name, kind, mode, state, stock[:2], ours[:2])


def test_the_error_cases_do_fail():
    """The error cases above test something: TF rejects each of them."""
    for case in CASES:
        if case.name.startswith("err."):
            assert _run(case, "tensor", "eager")[0] == "error", case.name


def test_a_variable_read_is_stock():
    var = tf.Variable(_a(3, 4))
    patches.uninstall()
    try:
        stock = [_bytes(var.read_value()), _bytes(var.value()), _bytes(tf.identity(var))]
    finally:
        patches.install()
    assert [_bytes(var.read_value()), _bytes(var.value()), _bytes(tf.identity(var))] == stock


def test_wrappers_keep_the_originals_introspection():
    import inspect

    wrapped = patches.patched_functions()
    assert len(wrapped) >= 13
    for owner, name in wrapped:
        current = vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)
        original = current.__wrapped__
        if isinstance(original, (classmethod, staticmethod)):
            original = original.__func__
        assert getattr(current, "__doc__", None) == getattr(original, "__doc__", None), name
        if callable(original) and not isinstance(owner, type):
            assert inspect.signature(current) == inspect.signature(original), name


def test_uninstall_restores_the_original_objects():
    before = {
        (id(owner), name): (
            vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)
        ).__wrapped__
        for owner, name in patches.patched_functions()
    }
    owners = {(id(owner), name): owner for owner, name in patches.patched_functions()}
    patches.uninstall()
    try:
        for key, original in before.items():
            owner, name = owners[key], key[1]
            if isinstance(owner, type):
                now = next(vars(c)[name] for c in owner.__mro__ if name in vars(c))
            else:
                now = getattr(owner, name)
            assert now is original, name
    finally:
        patches.install()


@pytest.mark.slow
def test_a_process_that_marks_nothing_runs_tf_functions_unwrapped():
    import subprocess
    import sys

    code = (
        "import tapehook, tensorflow as tf\n"
        "from tensorflow.python.ops import gen_math_ops, gen_nn_ops\n"
        "from tapehook import marks\n"
        "assert not marks.ARMED\n"
        "assert not hasattr(gen_math_ops.mat_mul, '__wrapped__')\n"
        "assert not hasattr(gen_nn_ops.conv2d, '__wrapped__')\n"
        "tapehook.mark_binary(tf.Variable(tf.ones([3, 3, 2, 2])))\n"
        "assert marks.ARMED and hasattr(gen_nn_ops.conv2d, '__wrapped__')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- what a process with marks pays on unmarked ops (issue #15) ----

_READ = "_read_variable_op"
_FRONTED = [
    (gen_nn_ops, "conv2d"),
    (gen_nn_ops, "depthwise_conv2d_native"),
    (gen_math_ops, "mat_mul"),
    (gen_math_ops, "batch_mat_mul_v2"),
    (gen_math_ops, "batch_mat_mul_v3"),
    (gen_math_ops, "cast"),
    (gen_array_ops, "identity"),
    (gen_array_ops, "expand_dims"),
]


def _class_read():
    return vars(tf.Variable(0.0).__class__.__mro__[1])[_READ]


def test_only_marked_variables_have_a_read_hook(marked_elsewhere):
    from tapehook.compat import resource_variable_ops

    plain = tf.Variable(_a(3, 3, 2, 2))
    marked = tapehook.mark_binary(tf.Variable(_a(3, 3, 2, 2)))
    original = vars(resource_variable_ops.BaseResourceVariable)[_READ]
    assert not hasattr(original, "__wrapped__")  # the class's read is TF's own
    assert _READ not in vars(plain) and _READ in vars(marked)
    assert marks.source_variable(plain.read_value()) is None
    assert marks.source_variable(marked.read_value()) is marked
    assert marks.source_variable(tf.identity(marked.value())) is marked
    tapehook.unmark(marked)
    assert _READ not in vars(marked)
    assert marks.source_variable(marked.read_value()) is None


def test_a_scope_wraps_every_read_while_open_on_any_thread(marked_elsewhere):
    import threading

    from tapehook.compat import resource_variable_ops

    owner = resource_variable_ops.BaseResourceVariable
    plain = tf.Variable(_a(3, 3, 2, 2))
    inside, outside = threading.Event(), threading.Event()
    seen = {}

    def other_thread():
        inside.wait()
        seen["wrapped"] = hasattr(vars(owner)[_READ], "__wrapped__")
        seen["source"] = marks.source_variable(plain.read_value())  # no scope here
        outside.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with tapehook.binary_scope(activations=True):
        assert marks.source_variable(plain.read_value()) is plain
        inside.set()
        outside.wait()
    thread.join()
    assert seen == {"wrapped": True, "source": None}
    assert not hasattr(vars(owner)[_READ], "__wrapped__")
    assert marks.source_variable(plain.read_value()) is None


def test_a_marked_variable_is_freed_when_dropped(marked_elsewhere):
    import gc
    import weakref

    gc.disable()  # a reference cycle through the read hook would keep it
    try:
        var = tapehook.mark_binary(tf.Variable(_a(3, 3, 2, 2)))
        var.read_value()
        ref = weakref.ref(var)
        del var
        assert ref() is None
    finally:
        gc.enable()


def test_uninstall_removes_read_hooks_and_install_restores_them(marked_elsewhere):
    marked = tapehook.mark_binary(tf.Variable(_a(3, 3, 2, 2)))
    patches.uninstall()
    try:
        assert _READ not in vars(marked)
        assert marks.source_variable(marked.read_value()) is None
    finally:
        patches.install()
    assert _READ in vars(marked)
    assert marks.source_variable(marked.read_value()) is marked


@pytest.mark.parametrize("owner,name", _FRONTED, ids=[n for _, n in _FRONTED])
def test_fronts_fail_wrong_calls_as_the_originals_do(owner, name, marked_elsewhere):
    """The signature-exact fronts raise the original's TypeError, word for word."""
    import inspect

    front = getattr(owner, name)
    original = front.__wrapped__
    assert front is not original and inspect.signature(front) == inspect.signature(original)
    arity = len(inspect.signature(original).parameters)
    calls = [(), (tf.ones([2, 2]),) * (arity + 1), (tf.ones([2, 2]),)]
    for args in calls:
        messages = []
        for function in (original, front):
            with pytest.raises(TypeError) as error:
                function(*args, not_a_parameter=1)
            messages.append(str(error.value))
        assert messages[0] == messages[1], args


def test_fronts_send_marked_operands_to_tapehook(marked_elsewhere):
    """The fronts' fast path must not swallow a marked operand, in any form."""
    w = tapehook.mark_binary(tf.Variable(_a(3, 3, 3, 4)), activations=True)
    x = tf.constant(X2)
    want = tf.nn.conv2d(tf.sign(x), tf.sign(w), 1, "SAME")
    read = w.read_value()
    forms = [
        lambda: gen_nn_ops.conv2d(x, read, [1, 1, 1, 1], "SAME"),
        lambda: gen_nn_ops.conv2d(input=x, filter=read, strides=[1, 1, 1, 1], padding="SAME"),
        lambda: gen_nn_ops.conv2d(x, tf.identity(read), [1, 1, 1, 1], "SAME"),
        lambda: gen_nn_ops.conv2d(x, w, [1, 1, 1, 1], "SAME"),
    ]
    for form in forms:
        np.testing.assert_array_equal(form().numpy(), want.numpy())
    d = tapehook.mark_binary(tf.Variable(_a(5, 3)), activations=True)
    m = tf.constant(M)
    np.testing.assert_array_equal(
        gen_math_ops.mat_mul(m, d.read_value()).numpy(),
        tf.matmul(tf.sign(m), tf.sign(d)).numpy(),
    )
    with pytest.raises(tapehook.TapehookError, match="left operand"):
        gen_math_ops.mat_mul(d.read_value(), tf.ones([3, 2]))
