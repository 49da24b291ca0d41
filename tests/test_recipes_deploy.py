"""tapehook.recipes' layers (RSign, RPReLU, LearnedRescale, EDESign,
SwishSign) around binary convs (tapehook.binarize and a tapehook.larq
QuantConv2D) in whole models: LiteRT and LCE exports give model.predict's
outputs, bit for bit on an all-binary path against a NumPy reference, with
every binary conv an LceBconv2d; tapehook.lite runs the LCE file as LCE's
interpreter does; .keras round trips, mixed_float16 training and export,
and fit under MirroredStrategy. (test_recipes_learnable.py checks each
layer's math.)

The LCE tests build the cached side environment on first use (minutes).
"""

import keras
import numpy as np
import pytest

import tapehook
from tapehook import recipes
from tapehook.deploy import export_tflite, run_tflite
from tapehook.larq import layers as lq
from tapehook.spec import BinarySpec
from test_deploy import LCE_TIMEOUT, _assert_matches, _bn_stats

from conftest import fit_mirrored
from test_reference import numpy_binary_conv

_QUANT = dict(input_quantizer="ste_sign", kernel_quantizer="ste_sign", use_bias=False)


def _randomize(model, seed=1):
    """Every recipes weight and BatchNorm statistic off its initial value, so
    that an export that dropped one would not match; estimators annealed
    halfway."""
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, (recipes.RSign, recipes.RPReLU)):
            for v in layer.weights:
                v.assign(rng.normal(0, 0.5, v.shape))
        elif isinstance(layer, recipes.LearnedRescale):
            for v in layer.weights:
                v.assign(rng.uniform(0.5, 1.5, v.shape))
        elif hasattr(layer, "anneal"):
            layer.anneal(0.5)
    return _bn_stats(model, seed)


def full_model():
    """A ReActNet-style stack: float stem, then RSign, SwishSign and EDESign
    each feeding a binary conv (two binarized Conv2D with mean_abs scale, one
    QuantConv2D), LearnedRescale after a binary conv, RPReLU after BatchNorm."""
    inputs = keras.Input((16, 16, 3))
    h = keras.layers.Conv2D(16, 3, padding="same", use_bias=False, name="stem")(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = recipes.RSign(name="rsign")(h)
    h = keras.layers.Conv2D(32, 3, padding="same", use_bias=False, name="bconv0")(h)
    h = recipes.LearnedRescale(name="rescale")(h)
    h = keras.layers.BatchNormalization()(h)
    h = recipes.RPReLU(name="rprelu0")(h)
    h = recipes.SwishSign(name="swish")(h)
    h = lq.QuantConv2D(32, 3, strides=2, padding="same", name="qconv", **_QUANT)(h)
    h = keras.layers.BatchNormalization()(h)
    h = recipes.EDESign(name="ede")(h)
    h = keras.layers.Conv2D(32, 3, padding="valid", use_bias=False, name="bconv1")(h)
    h = keras.layers.BatchNormalization()(h)
    h = recipes.RPReLU(name="rprelu1")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inputs, keras.layers.Dense(5, name="head")(h))
    tapehook.binarize(model, include="bconv*", activations=True, scale="mean_abs")
    return _randomize(model)


BINARY_CONVS = 3  # bconv0, qconv, bconv1
RECIPE_WEIGHTS = ("rsign", "rescale", "rprelu0", "rprelu1")


def _inputs(shape, n=8, seed=3):
    return np.random.default_rng(seed).normal(0, 1, (n, *shape)).astype(np.float32)


@pytest.fixture(scope="module")
def full():
    """(model, x, predictions, {layer name: predictions with that layer's
    weights at their initial values})."""
    model = full_model()
    x = _inputs((16, 16, 3))
    expected = model.predict(x, verbose=0)
    neutral = {}
    for name in RECIPE_WEIGHTS:
        layer = model.get_layer(name)
        kept = layer.get_weights()
        fresh = type(layer).from_config(layer.get_config())
        fresh.build(layer.input.shape)
        layer.set_weights(fresh.get_weights())
        neutral[name] = model.predict(x, verbose=0)
        layer.set_weights(kept)
    return model, x, expected, neutral


def _assert_recipes_matter(actual, neutral):
    """``actual`` is far from every prediction made with one recipes layer
    left at its initial weights: the export did not drop that layer."""
    for name, other in neutral.items():
        scale = max(float(np.abs(other).max()), 1.0)
        assert np.abs(actual - other).max() > 1e-2 * scale, name


def test_litert_matches_predict(full, tmp_path):
    model, x, expected, neutral = full
    report = export_tflite(model, tmp_path / "m.tflite", target="litert")
    assert report["binary_layers"] == BINARY_CONVS
    # Each recipes sign is taken once: the binary conv does not sign its ±1 input again.
    assert report["ops"]["GREATER_EQUAL"] == 3
    actual = run_tflite(tmp_path / "m.tflite", x)
    _assert_matches(actual, expected)
    _assert_recipes_matter(actual, neutral)


@pytest.mark.slow
@pytest.mark.timeout(LCE_TIMEOUT)
def test_lce_matches_predict_and_tapehook_lite(full, tmp_path):
    model, x, expected, neutral = full
    path = tmp_path / "m.tflite"
    report = export_tflite(model, path, target="lce")
    ops = report["ops"]
    assert ops["LceBconv2d"] == BINARY_CONVS and ops.get("CONV_2D", 0) == 1  # the stem
    # One LceQuantize per recipes sign, feeding its bconv directly.
    assert ops["LceQuantize"] == 3 and "LceDequantize" not in ops
    assert report["warnings"] == []
    actual = run_tflite(path, x, target="lce")
    _assert_matches(actual, expected)
    _assert_recipes_matter(actual, neutral)

    lite = pytest.importorskip("tapehook.lite")
    interpreter = lite.Interpreter(path)
    interpreter.resize_tensor_input(interpreter.get_input_details()[0]["index"], x.shape)
    interpreter.allocate_tensors()
    interpreter.set_tensor(interpreter.get_input_details()[0]["index"], x)
    interpreter.invoke()
    ours = interpreter.get_tensor(interpreter.get_output_details()[0]["index"])
    np.testing.assert_allclose(ours, actual, rtol=1e-5, atol=1e-5)


# ---- an all-binary path: integers, so every target agrees bit for bit ----


def binary_path_model():
    """RSign -> binary conv (SAME, zero padding) -> EDESign -> binary conv
    (VALID) -> SwishSign -> binary conv (1x1): the output is integer counts
    of ±1 products."""
    inputs = keras.Input((8, 8, 5))
    h = recipes.RSign(name="rsign")(inputs)
    h = keras.layers.Conv2D(16, 3, padding="same", use_bias=False, name="b0")(h)
    h = recipes.EDESign(name="ede")(h)
    h = keras.layers.Conv2D(8, 3, padding="valid", use_bias=False, name="b1")(h)
    h = recipes.SwishSign(name="swish")(h)
    h = keras.layers.Conv2D(8, 1, padding="valid", use_bias=False, name="b2")(h)
    model = keras.Model(inputs, h)
    tapehook.binarize(model, activations=True)
    return _randomize(model)


def _numpy_binary_path(x, beta, w0, w1, w2):
    spec = BinarySpec(activations=True)

    def conv(x, w, pads):
        n, h, wd, _ = x.shape
        kh, kw, _, cout = w.shape
        out = (n, h + pads[0] + pads[1] - kh + 1, wd + pads[2] + pads[3] - kw + 1, cout)
        return numpy_binary_conv(x, w, np.zeros(out), spec, 1, pads, 1)[0]

    h = conv(x - beta, w0, (1, 1, 1, 1))
    return conv(conv(h, w1, (0, 0, 0, 0)), w2, (0, 0, 0, 0))


@pytest.mark.parametrize("target", ["litert", pytest.param("lce", marks=pytest.mark.slow)])
@pytest.mark.timeout(LCE_TIMEOUT)
def test_binary_path_exact(target, tmp_path):
    model = binary_path_model()
    beta = model.get_layer("rsign").beta.numpy()
    kernels = [model.get_layer(n).kernel.numpy().astype(np.float64) for n in ("b0", "b1", "b2")]
    x = _inputs((8, 8, 5), n=4)
    x[0, 0, 0] = beta  # x - beta = 0 there: sign(0) = +1
    # NumPy takes x - beta in float32 as the models do, then counts in float64.
    reference = _numpy_binary_path(x - beta, 0, *kernels)
    np.testing.assert_array_equal(model.predict(x, verbose=0), reference)
    report = export_tflite(model, tmp_path / "m.tflite", target=target)
    if target == "lce":
        # b1 writes bitpacked output (SwishSign's sign as its threshold) for b2;
        # b0 corrects its zero padding in float, so its output is quantized.
        assert report["ops"] == {"SUB": 1, "LceQuantize": 2, "LceBconv2d": 3}
    np.testing.assert_array_equal(run_tflite(tmp_path / "m.tflite", x, target=target), reference)
    # The threshold matters: without beta, many counts differ.
    unshifted = _numpy_binary_path(x, 0, *kernels)
    assert np.mean(unshifted != reference) > 0.1


# ---- .keras, mixed_float16, tf.distribute ----


def test_keras_round_trip_then_export(full, tmp_path):
    """A saved and loaded model keeps its binary marks and recipes weights:
    the same predictions, and its LiteRT file gives them too."""
    model, x, expected, _ = full
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert type(loaded.get_layer("qconv")) is lq.QuantConv2D
    for name in ("bconv0", "qconv", "bconv1"):
        assert tapehook.binary_spec_of(loaded.get_layer(name).kernel).activations
    assert loaded.get_layer("ede").t.numpy() == model.get_layer("ede").t.numpy() != 0.1
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), expected)
    export_tflite(loaded, tmp_path / "m.tflite")
    _assert_matches(run_tflite(tmp_path / "m.tflite", x), expected)


def test_mixed_float16_fit_and_export(full, tmp_path):
    """Under mixed_float16 the recipes weights stay float32 and train; the
    export computes in float32 (LiteRT and LCE take float32), giving the
    predictions of the float32 model with the same weights."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = full_model()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    twin = full[0]
    model.set_weights(twin.get_weights())
    recipe_vars = [v for n in RECIPE_WEIGHTS for v in model.get_layer(n).weights]
    assert all(v.dtype == "float32" for v in recipe_vars)
    x = full[1]
    assert model.predict(x, verbose=0).dtype == np.float16

    export_tflite(model, tmp_path / "m.tflite")
    _assert_matches(run_tflite(tmp_path / "m.tflite", x), full[2])

    before = [v.numpy() for v in recipe_vars]
    model.compile(keras.optimizers.SGD(0.1), keras.losses.MeanSquaredError())
    # Two steps: the loss scale's first try overflows float16 and skips its step.
    loss = model.fit(x, np.ones((len(x), 5)), batch_size=4, verbose=0).history["loss"][0]
    assert np.isfinite(loss)
    for v, old in zip(recipe_vars, before, strict=True):
        assert v.dtype == "float32" and np.all(np.isfinite(v.numpy()))
        assert np.any(v.numpy() != old), v.path  # each got a gradient


def _distributed_model():
    """No BatchNorm (replicas would normalize over their own half batch)."""
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="stem")(inputs)
    h = recipes.RSign(name="rsign")(h)
    h = keras.layers.Conv2D(16, 3, padding="same", use_bias=False, name="bconv")(h)
    h = recipes.LearnedRescale(name="rescale")(h)
    h = recipes.RPReLU(name="rprelu")(h)
    h = recipes.EDESign(name="ede")(h)
    h = lq.QuantConv2D(16, 3, padding="valid", name="qconv", **_QUANT)(h)
    h = recipes.SwishSign(beta=3.0, name="swish")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(h))
    tapehook.binarize(model, include="bconv", activations=True, scale="mean_abs")
    rng = np.random.default_rng(5)
    for v in model.trainable_weights:
        v.assign(rng.uniform(0.5, 1.5, v.shape) * rng.choice([-1, 1], v.shape))
    _randomize(model)
    model.compile(
        keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def _data():
    """For tests/helpers/mirrored_fit.py (batch 8: two steps)."""
    rng = np.random.default_rng(6)
    return rng.normal(size=(16, 8, 8, 3)).astype(np.float32), rng.integers(0, 4, 16)


def mirrored_variants():
    """For tests/helpers/mirrored_fit.py."""
    return {"recipes": _distributed_model}


@pytest.mark.slow
def test_mirrored_strategy_matches_single_device():
    """fit over 2 logical CPUs gives the weights of fit on one device,
    the recipes weights included."""
    mirrored = fit_mirrored("test_recipes_deploy")["recipes"]
    model = _distributed_model()
    start = [w.copy() for w in model.get_weights()]
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    single = model.get_weights()
    assert len(mirrored) == len(single)
    for a, b, s in zip(mirrored, single, start, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * (1 + np.abs(b).max()))
    beta = [v.path for v in model.weights].index("rsign/beta")
    assert np.abs(single[beta] - start[beta]).max() > 1e-4  # training moved it
