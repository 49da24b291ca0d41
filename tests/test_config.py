"""tapehook.config: every TAPEHOOK_* setting has its Python counterpart.

Each setting changes what runs in eager, in a tf.function and in Keras fit
(dispatch and kernels: which kernels ran, tapehook.dispatch_counts();
pack_inputs: whether the forward packed its input; backprop_dy: the AMX
backprops' results, and nothing where AMX does not run them); the
environment variable is the default; ``with`` blocks nest and are per
thread, ``set`` is for every thread; bad values are errors naming the
allowed ones; a function traced inside a block keeps its choice."""

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import tapehook
from tapehook import kernels
from tapehook.config import SETTINGS

from conftest import random_inputs, upstream

config = tapehook.config
X_SHAPE, W_SHAPE = (2, 12, 12, 64), (3, 3, 64, 64)  # a shape AMX runs


@pytest.fixture(autouse=True)
def _process_settings_cleared(monkeypatch):
    for setting in SETTINGS.values():
        monkeypatch.delenv(setting.env, raising=False)
    config.set(**dict.fromkeys(SETTINGS))
    yield
    config.set(**dict.fromkeys(SETTINGS))


def _compiled():
    return sum(tapehook.dispatch_counts()["compiled"].values())


def _reference():
    return sum(tapehook.dispatch_counts()["reference"].values())


def _conv_grads(x, w, g):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.nn.conv2d(x, w, 1, "SAME")
        loss = tf.reduce_sum(y * g)
    return tape.gradient(loss, [x, w])


def _run(how, **settings):
    """(dX, dW) of a binary-activation conv run ``how`` ("eager",
    "function", "keras": one SGD step of Model.fit, whose dW is the weight
    change) under ``settings``."""
    x, w0 = random_inputs(X_SHAPE, W_SHAPE, seed=3)
    g = upstream(X_SHAPE[:3] + W_SHAPE[3:], tf.float32, seed=4)
    if how == "keras":
        with tapehook.binary_scope(activations=True, scale="mean_abs"):
            layer = keras.layers.Conv2D(W_SHAPE[3], 3, padding="same", use_bias=False)
            model = keras.Sequential([keras.Input(X_SHAPE[1:]), layer])
        layer.kernel.assign(w0)
        model.compile(optimizer=keras.optimizers.SGD(1.0), loss=lambda t, y: -tf.reduce_sum(y * t))
        with config(**settings):
            model.fit(x, g, batch_size=X_SHAPE[0], epochs=1, shuffle=False, verbose=0)
        return None, np.asarray(layer.kernel) - np.asarray(w0)
    w = tapehook.mark_binary(tf.Variable(w0), activations=True, scale="mean_abs")
    if how == "eager":
        with config(**settings):
            dx, dw = _conv_grads(x, w, g)
    else:
        function = tf.function(_conv_grads)
        with config(**settings):
            function.get_concrete_function(x, w, g)  # traced inside the block
        dx, dw = function(x, w, g)  # run outside it: the traced choice holds
    return np.asarray(dx), np.asarray(dw)


HOWS = ("eager", "function", "keras")


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_environment_is_the_default_python_overrides(name, monkeypatch):
    setting = SETTINGS[name]
    assert config.get(name) == setting.default
    other = next(v for v in setting.allowed if v != setting.default)
    monkeypatch.setenv(setting.env, other)
    assert config.get(name) == other and config.current()[name] == other
    config.set(**{name: setting.default})
    assert config.get(name) == setting.default
    with config(**{name: other}):
        assert config.get(name) == other
    config.set(**{name: None})  # back to the environment's
    assert config.get(name) == other


def test_bad_values_name_the_allowed_ones(monkeypatch):
    with pytest.raises(
        tapehook.TapehookError, match=r"dispatch='fast'.*'auto', 'kernels', 'stock'"
    ):
        config(dispatch="fast")
    with pytest.raises(tapehook.TapehookError, match=r"backprop_dy='bf16'.*'exact', 'bf16x2'"):
        config.set(backprop_dy="bf16")
    with pytest.raises(tapehook.TapehookError, match=r"no setting 'dispath'.*'dispatch'"):
        config.get("dispath")
    monkeypatch.setenv("TAPEHOOK_PACK_INPUTS", "yes")
    with pytest.raises(tapehook.TapehookError, match=r"TAPEHOOK_PACK_INPUTS='yes'.*'float16'"):
        config.get("pack_inputs")
    # A bad environment value fails where the setting is read: at a conv.
    x, w0 = random_inputs((1, 5, 5, 2), (3, 3, 2, 3))
    w = tapehook.mark_binary(tf.Variable(w0), activations=True)
    monkeypatch.setenv("TAPEHOOK_DISPATCH", "fastest")
    with pytest.raises(tapehook.TapehookError, match="TAPEHOOK_DISPATCH='fastest'"):
        tf.nn.conv2d(x, w, 1, "SAME")


def test_pack_inputs_accepts_booleans():
    with config(pack_inputs=False):
        assert config.get("pack_inputs") == "0"
        with config(pack_inputs=True):
            assert config.get("pack_inputs") == "1"


def test_blocks_nest_and_restore_also_on_error():
    with config(dispatch="stock", backprop_dy="bf16x2"):
        with config(dispatch="kernels"):
            assert config.get("dispatch") == "kernels"
            assert config.get("backprop_dy") == "bf16x2"  # the outer block's
        assert config.get("dispatch") == "stock"
        with pytest.raises(RuntimeError), config(dispatch="auto"):
            raise RuntimeError("leaves the block")
        assert config.get("dispatch") == "stock"
    assert config.current() == {name: s.default for name, s in SETTINGS.items()}


def test_blocks_are_per_thread_and_set_is_for_all():
    barrier = threading.Barrier(2)
    seen = {}

    def worker(policy):
        with config(dispatch=policy):
            barrier.wait()  # both blocks open at once
            seen[policy] = config.get("dispatch")
            barrier.wait()

    threads = [threading.Thread(target=worker, args=(p,)) for p in ("stock", "kernels")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {"stock": "stock", "kernels": "kernels"}

    def read():
        seen["other"] = config.get("dispatch")

    with config(dispatch="stock"):  # this thread's only
        config.set(pack_inputs="0")  # every thread's
        thread = threading.Thread(target=read)
        thread.start()
        thread.join()
        assert seen["other"] == "auto"
    thread = threading.Thread(target=lambda: seen.update(pack=config.get("pack_inputs")))
    thread.start()
    thread.join()
    assert seen["pack"] == "0"


@pytest.mark.parametrize("how", HOWS)
def test_dispatch_chooses_what_runs(how):
    if kernels.library() is None:
        pytest.skip("compiled kernels not loaded")
    _run(how, dispatch="stock")
    assert _compiled() == 0 and _reference() > 0
    tapehook.reset_dispatch_counts()
    _run(how, dispatch="kernels")
    assert _compiled() > 0 and _reference() == 0


@pytest.mark.parametrize("how", HOWS)
def test_kernels_reference_runs_the_reference_path(how):
    if kernels.library() is None:
        pytest.skip("compiled kernels not loaded")
    with config(kernels="reference"):
        assert tapehook.kernel_info()["settings"]["kernels"] == "reference"
        assert kernels.library() is None
    _run(how, kernels="reference", dispatch="kernels")
    assert _compiled() == 0 and _reference() > 0
    tapehook.reset_dispatch_counts()
    _run(how, kernels="compiled", dispatch="kernels")
    assert _compiled() > 0


@pytest.mark.parametrize("how", HOWS)
def test_pack_inputs_chooses_what_the_backward_keeps(how, monkeypatch):
    library = kernels.library()
    if library is None:
        pytest.skip("compiled kernels not loaded")
    packs = []
    real = library.tapehook_pack_input

    def spy(*args, **kwargs):
        packs.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(library, "tapehook_pack_input", spy)
    kept_x = _run(how, pack_inputs="0", dispatch="kernels")
    assert not packs
    kept_bits = _run(how, pack_inputs="1", dispatch="kernels")
    assert packs
    # ste_sign inputs: the bits hold all the backward reads, so the same math.
    for a, b in zip(kept_x, kept_bits):
        if a is not None:
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("how", HOWS)
def test_backprop_dy_changes_only_the_amx_backprops(how):
    if kernels.library() is None:
        pytest.skip("compiled kernels not loaded")
    two = _run(how, dispatch="kernels", backprop_dy="bf16x2")
    exact = _run(how, dispatch="kernels", backprop_dy="exact")
    default = _run(how, dispatch="kernels")
    for a, b in zip(exact, default):
        if a is not None:
            np.testing.assert_array_equal(a, b)  # unset is "exact"
    differs = [not np.array_equal(a, b) for a, b in zip(two, exact) if a is not None]
    assert all(differs) if kernels.amx_usable() else not any(differs)


def test_kernel_info_reports_the_settings():
    with config(dispatch="stock", backprop_dy="bf16x2"):
        settings = tapehook.kernel_info()["settings"]
    assert settings == {**config.current(), "dispatch": "stock", "backprop_dy": "bf16x2"}
    config.set(pack_inputs="float32")
    assert tapehook.kernel_info()["settings"]["pack_inputs"] == "float32"


def test_summary_ends_with_the_settings():
    with tapehook.binary_scope():
        model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3)])
    with config(dispatch="stock", pack_inputs="0"):
        result = tapehook.summary(model, print_fn=None)
    assert result.settings == {**config.current(), "dispatch": "stock", "pack_inputs": "0"}
    last = str(result).splitlines()[-1]
    assert last.startswith("settings (tapehook.config): dispatch='stock'")
    assert "pack_inputs='0'" in last and "backprop_dy='exact'" in last
