"""Public API: BinarySpec, marks, scopes, errors that name the fix, threads,
the registry tapehook relies on, kernel_info and the build cache."""

import json
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import ops

import tapehook
from tapehook import compat, gradient, kernels, patches, registry

from conftest import assert_close, random_inputs, reference_result, upstream

# ---- BinarySpec ----


def test_spec_is_immutable_and_comparable():
    a = tapehook.BinarySpec(activations=True, scale="mean_abs", clip=0.5)
    assert a == tapehook.BinarySpec(activations=True, scale="mean_abs", clip=0.5)
    assert a != tapehook.BinarySpec()
    assert len({a, tapehook.BinarySpec(activations=True, scale="mean_abs", clip=0.5)}) == 1
    with pytest.raises(AttributeError):
        a.clip = 2.0
    assert a.activation_estimator == "ste_sign"
    assert tapehook.BinarySpec(activations="approx_sign").activation_estimator == "approx_sign"
    assert tapehook.BinarySpec().activation_estimator is None


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(ste="sign"), "unknown estimator"),
        (dict(clip=0), "clip must be > 0"),
        (dict(clip=-1.0), "clip must be > 0"),
        (dict(clip="1"), "positive number"),
        (dict(scale="max"), "unknown scale"),
        (dict(activations="relu"), "activations="),
    ],
)
def test_spec_rejects_bad_values(kwargs, needle):
    with pytest.raises(tapehook.TapehookError, match=needle):
        tapehook.BinarySpec(**kwargs)


# ---- marks ----


def test_mark_unmark_and_spec_of():
    w = tf.Variable(tf.ones([3, 3, 2, 4]))
    assert tapehook.binary_spec_of(w) is None
    assert tapehook.mark_binary(w, scale="mean_abs") is w
    assert tapehook.binary_spec_of(w) == tapehook.BinarySpec(scale="mean_abs")
    tapehook.unmark(w)
    assert tapehook.binary_spec_of(w) is None


def test_keras_variable_is_accepted():
    kv = keras.Variable(np.ones([3, 3, 2, 4], np.float32))
    tapehook.mark_binary(kv, activations=True)
    assert tapehook.binary_spec_of(kv) == tapehook.BinarySpec(activations=True)
    assert tapehook.binary_spec_of(kv._value) == tapehook.BinarySpec(activations=True)


@pytest.mark.parametrize(
    "obj,needle",
    [
        (tf.ones([3, 3, 2, 4]), "needs a tf.Variable"),
        (np.ones([3, 3, 2, 4]), "needs a tf.Variable"),
        (tf.Variable(tf.ones([4])), "only kernels can be marked"),
        (tf.Variable(tf.ones([1, 2, 2, 2, 2])), "only kernels can be marked"),
        (tf.Variable(tf.ones([3, 3, 2, 4], tf.int32)), "dtype int32"),
    ],
)
def test_mark_rejects_what_cannot_be_a_binary_filter(obj, needle):
    with pytest.raises(tapehook.TapehookError, match=needle):
        tapehook.mark_binary(obj)


def test_mark_rejects_unknown_spec_keys():
    with pytest.raises(tapehook.TapehookError, match="takes activations, scale, ste, clip"):
        tapehook.mark_binary(tf.Variable(tf.ones([1, 1, 1, 1])), estimator="ste_sign")


def test_marked_filter_with_nchw_is_an_error():
    w = tapehook.mark_binary(tf.Variable(tf.ones([3, 3, 2, 4])))
    with pytest.raises(tapehook.TapehookError, match="NHWC only"):
        tf.nn.conv2d(tf.ones([1, 2, 5, 5]), w, 1, "SAME", data_format="NCHW")


def test_marked_filter_with_dtype_mismatch_is_an_error():
    w = tapehook.mark_binary(tf.Variable(tf.ones([3, 3, 2, 4])))
    with pytest.raises(tapehook.TapehookError, match="cast the input to float32"):
        tf.nn.conv2d(tf.ones([1, 5, 5, 2], tf.float64), w, 1, "SAME")


def test_marks_persist_until_unmarked():
    x, w0 = random_inputs((1, 5, 5, 2), (3, 3, 2, 3))
    w = tf.Variable(w0)
    stock = tf.nn.conv2d(x, w, 1, "SAME")
    with tapehook.binary_scope():
        binary_inside = tf.nn.conv2d(x, w, 1, "SAME")
    binary_after = tf.nn.conv2d(x, w, 1, "SAME")
    np.testing.assert_array_equal(binary_inside, binary_after)
    assert not np.allclose(binary_after, stock)
    tapehook.unmark(w)
    np.testing.assert_array_equal(tf.nn.conv2d(x, w, 1, "SAME"), stock)


# ---- scopes ----


def test_scope_marks_created_and_used_variables():
    used = tf.Variable(tf.ones([3, 3, 2, 2]))
    with tapehook.binary_scope(scale="mean_abs") as spec:
        created = tf.Variable(tf.ones([3, 3, 2, 2]))
        bias = tf.Variable(tf.ones([2]))
        tf.nn.conv2d(tf.ones([1, 4, 4, 2]), used, 1, "SAME")
    assert tapehook.binary_spec_of(created) == spec == tapehook.BinarySpec(scale="mean_abs")
    assert tapehook.binary_spec_of(used) == spec
    assert tapehook.binary_spec_of(bias) is None


def test_scopes_nest_innermost_marks():
    with tapehook.binary_scope():
        outer = tf.Variable(tf.ones([1, 1, 1, 1]))
        with tapehook.binary_scope(activations=True):
            inner = tf.Variable(tf.ones([1, 1, 1, 1]))
        after = tf.Variable(tf.ones([1, 1, 1, 1]))
    assert tapehook.binary_spec_of(outer) == tapehook.BinarySpec()
    assert tapehook.binary_spec_of(inner) == tapehook.BinarySpec(activations=True)
    assert tapehook.binary_spec_of(after) == tapehook.BinarySpec()


def test_exception_inside_scope_restores_state():
    with pytest.raises(RuntimeError):
        with tapehook.binary_scope():
            with tapehook.binary_scope(activations=True):
                raise RuntimeError("boom")
    w = tf.Variable(tf.ones([3, 3, 1, 1]))
    tf.nn.conv2d(tf.ones([1, 3, 3, 1]), w, 1, "SAME")
    assert tapehook.binary_spec_of(w) is None


def test_scope_variables_restricts_marking():
    a = tf.Variable(tf.ones([3, 3, 2, 2]))
    b = tf.Variable(tf.ones([3, 3, 2, 2]))
    with tapehook.binary_scope(variables=[a]):
        created = tf.Variable(tf.ones([3, 3, 2, 2]))
        for w in (a, b, created):
            tf.nn.conv2d(tf.ones([1, 4, 4, 2]), w, 1, "SAME")
    assert tapehook.binary_spec_of(a) == tapehook.BinarySpec()
    assert tapehook.binary_spec_of(b) is None
    assert tapehook.binary_spec_of(created) is None


def test_scope_rejects_non_variables_and_bad_spec():
    with pytest.raises(tapehook.TapehookError, match="takes variables"):
        with tapehook.binary_scope(variables=[tf.ones([1])]):
            pass
    with pytest.raises(tapehook.TapehookError, match="unknown scale"):
        with tapehook.binary_scope(scale="l2"):
            pass


def test_four_threads_train_different_variables():
    """Marked and unmarked variables trained at once, each against its reference."""
    specs = [
        tapehook.BinarySpec(),
        tapehook.BinarySpec(activations=True),
        None,
        tapehook.BinarySpec(scale="mean_abs", ste="swish_sign"),
    ]
    errors, barrier = [], threading.Barrier(4, timeout=120)  # a failed thread fails the others

    def train(i):
        try:
            x, w0 = random_inputs((2, 6, 6, 3), (3, 3, 3, 4), seed=i)
            g = upstream((2, 6, 6, 4), tf.float32, seed=i)
            w = tf.Variable(w0)
            scope = tapehook.binary_scope(**vars(specs[i])) if specs[i] else None
            barrier.wait()
            for step in range(5):
                w0 = tf.convert_to_tensor(w)
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    if scope is not None and step == 0:
                        with scope:
                            y = tf.nn.conv2d(x, w, 1, "SAME")
                    else:
                        y = tf.nn.conv2d(x, w, 1, "SAME")
                    loss = tf.reduce_sum(y * g)
                dx, dw = tape.gradient(loss, [x, w])
                if specs[i] is None:
                    with tf.GradientTape() as t2:
                        t2.watch([x, w0])
                        ry = tf.raw_ops.Conv2D(input=x, filter=w0, strides=[1] * 4, padding="SAME")
                        rl = tf.reduce_sum(ry * g)
                    rdx, rdw = t2.gradient(rl, [x, w0])
                else:
                    ry, rdx, rdw = reference_result(x, w0, specs[i], g)
                assert_close(y, ry, what=f"thread {i} forward")
                assert_close(dx, rdx, what=f"thread {i} dX")
                assert_close(dw, rdw, what=f"thread {i} dW")
                w.assign_sub(0.01 * dw)
            assert tapehook.binary_spec_of(w) == specs[i]
        except Exception as exc:  # reported in the main thread
            errors.append((i, exc))

    threads = [threading.Thread(target=train, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors


# ---- the TF internals tapehook relies on ----


def test_registry_structure_is_there_and_overridden():
    entry = ops._gradient_registry._registry["Conv2D"]
    assert set(entry) >= {"type", "location"}
    assert entry["type"] is gradient.conv2d_grad
    assert ops._gradient_registry.lookup("Conv2D") is gradient.conv2d_grad
    assert ops._gradient_registry.lookup(kernels.BINARY_OP) is gradient.binary_conv2d_op_grad


def test_missing_registry_structure_fails_loudly(monkeypatch):
    monkeypatch.setattr(ops._gradient_registry, "_registry", None)
    with pytest.raises(tapehook.TapehookError, match="_gradient_registry"):
        registry.registered_gradient("Conv2D")


@pytest.mark.parametrize(
    "owner,name,replacement,needle",
    [
        (
            "backprop",
            "_MockOp",
            type("_MockOp", (), {"__init__": lambda self, attrs: None}),
            "skip_input_indices",
        ),
        ("execute", "record_gradient", None, "record_gradient"),
        (
            "gen_nn_ops",
            "conv2d",
            lambda input, filter, strides, padding, name=None: None,
            "gen_nn_ops.conv2d",
        ),
        (
            "resource_variable_ops.BaseResourceVariable",
            "_read_variable_op",
            None,
            "_read_variable_op",
        ),
    ],
)
def test_changed_tf_internals_fail_at_import_with_nothing_patched(
    monkeypatch, owner, name, replacement, needle
):
    """What `import tapehook` does on a TF whose internals moved: a clear error
    naming the version and the piece, before any patch is applied."""
    target = compat
    for part in owner.split("."):
        target = getattr(target, part)
    patches.uninstall()
    try:
        monkeypatch.setattr(target, name, replacement)
        with pytest.raises(tapehook.TapehookError, match=f"TensorFlow {tf.__version__}.*{needle}"):
            patches.install()
        assert not patches.installed()
        assert registry.registered_gradient("Conv2D") is not gradient.conv2d_grad
    finally:
        monkeypatch.undo()
        patches.install()
    assert registry.registered_gradient("Conv2D") is gradient.conv2d_grad


def test_kernel_info_reports_loaded_library():
    info = tapehook.kernel_info()
    assert info["cpu"]["loaded"] is True, info
    assert info["cpu"]["tf_version"] == tf.__version__
    assert "-std=c++17" in info["cpu"]["compile_flags"]
    assert info["gpu"]["loaded"] is False and "CPU-only build" in info["gpu"]["reason"]


def test_cached_library_is_reused_and_version_checked(tmp_path, monkeypatch):
    record = kernels.build()
    assert record["fresh_build"] is False
    build_json = tmp_path / "build.json"
    build_json.write_text(
        json.dumps(
            {
                **json.loads(
                    (kernels.pathlib.Path(record["path"]).parent / "build.json").read_text()
                ),
                "tf_version": "0.0.1",
            }
        )
    )
    monkeypatch.setattr(kernels, "cache_root", lambda: tmp_path / "cache")
    key_dir = (
        tmp_path
        / "cache"
        / kernels._cache_key(
            kernels.source_dir(), *kernels.build_flags(kernels.source_dir()), False
        )
    )
    key_dir.mkdir(parents=True)
    (key_dir / kernels.LIBRARY_NAME).write_bytes(b"")
    (key_dir / "build.json").write_text(build_json.read_text())
    with pytest.raises(tapehook.TapehookError, match="built for TF 0.0.1"):
        kernels.build()


def test_no_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(tapehook.TapehookError, match="no C\\+\\+ compiler"):
        kernels.build()
