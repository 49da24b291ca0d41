"""tapehook.zoo.ReActNetA against ReActNet-A as written out here: its
parameter and operation counts from the architecture table, each half block
against a NumPy forward of the paper's definition, its arguments, saving and
loading, and its binary convs on tapehook's compiled kernels."""

import functools

import keras
import numpy as np
import pytest

import tapehook
from tapehook import zoo
from tapehook.errors import TapehookError
from test_zoo_models import binary_convs, images

from conftest import recomputed_binary_convs
from test_reference import numpy_binary_conv

SIZE = 32
CLASSES = 3
# ReActNet-A's blocks, (input width, output width, stride): MobileNet-v1's
# widths, a 2x stride where the width grows past 64.
TABLE = [(32, 64, 1), (64, 128, 2), (128, 128, 1), (128, 256, 2), (256, 256, 1), (256, 512, 2)]
TABLE += [(512, 512, 1)] * 5 + [(512, 1024, 2), (1024, 1024, 1)]


def _randomize(model, seed=1):
    """Non-trivial thresholds, RPReLU shifts and slopes, BN statistics."""
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, (tapehook.recipes.RSign, tapehook.recipes.RPReLU)):
            layer.set_weights([rng.normal(0, 0.3, w.shape) for w in layer.get_weights()])
        elif isinstance(layer, keras.layers.BatchNormalization):
            gamma, beta, mean, var = layer.get_weights()
            layer.set_weights(
                [
                    rng.uniform(0.5, 1.5, gamma.shape),
                    rng.normal(0, 0.5, beta.shape),
                    rng.normal(0, 2, mean.shape),
                    rng.uniform(5, 20, var.shape),
                ]
            )


@functools.cache
def small_model():
    model = zoo.ReActNetA(input_shape=(SIZE, SIZE, 3), num_classes=CLASSES)
    _randomize(model)
    return model


def test_parameter_and_operation_counts_follow_the_table():
    params = 3 * 3 * 3 * 32 + 4 * 32  # stem conv, BN (4 numbers per channel)
    binary_macs, side = 0, 112  # the stem halves 224 px
    for c, o, stride in TABLE:
        params += c + 9 * c * c + 4 * c + 3 * c  # RSign, 3x3 conv, BN, RPReLU
        params += c + (o // c) * (c * c + 4 * c) + 3 * o  # RSign, 1x1 conv(s), BN(s), RPReLU
        side //= stride
        binary_macs += side * side * (9 * c * c + c * o)
    params += 1024 * 1000 + 1000
    float_macs = 112 * 112 * 27 * 32 + 1024 * 1000

    model = zoo.ReActNetA()
    assert model.input.shape == (None, 224, 224, 3) and model.output.shape == (None, 1000)
    assert model.count_params() == params
    totals = tapehook.summary(model, print_fn=None).totals
    assert (totals["binary_macs"], totals["float_macs"]) == (binary_macs, float_macs)
    assert totals["binary_layers"] == len(binary_convs(model)) == 31
    # The paper: 4.82e9 BOPs, 0.12e8 FLOPs, 0.87e8 OPs (FLOPs + BOPs / 64).
    assert f"{binary_macs:.2e}" == "4.82e+09" and round(float_macs / 1e8, 2) == 0.12
    assert round(totals["ops"] / 1e8, 2) == 0.87


def test_binary_convs_and_layers():
    model = small_model()
    spec = tapehook.BinarySpec(activations=True, scale="mean_abs", clip=1.0)
    assert all(conv.binary_spec == spec for conv in binary_convs(model))
    signs = [layer for layer in model.layers if isinstance(layer, tapehook.recipes.RSign)]
    assert len(signs) == 2 * len(TABLE) and {s.estimator for s in signs} == {"approx_sign"}
    norms = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    assert {(n.momentum, n.epsilon) for n in norms} == {(0.9, 1e-5)}


def _same_pads(size, kernel, stride):
    """TF's "same" padding of one axis: (before, after), the extra one after."""
    total = max((-(-size // stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def _half_reference(model, name, x, shortcut, stride, copies):
    """ReActNet's half block: move, sign, binary conv (sign(W) * mean|W| per
    output channel, zero padding), BN, + shortcut; concatenated copies; move,
    PReLU, move."""
    (beta,) = model.get_layer(f"{name}_rsign").get_weights()
    signs = np.where(x - beta >= 0, 1.0, -1.0)
    spec = tapehook.BinarySpec(activations=True, scale="mean_abs")
    parts = []
    for copy in range(copies):
        part = f"{name}_{copy + 1}" if copies > 1 else name
        (w,) = model.get_layer(f"{part}_conv").get_weights()
        pads = _same_pads(x.shape[1], w.shape[0], stride) * 2
        out = -(-x.shape[1] // stride)
        g = np.zeros((x.shape[0], out, out, w.shape[-1]))
        y, _, _ = numpy_binary_conv(signs, w.astype("float64"), g, spec, stride, pads, 1)
        gamma, offset, mean, var = model.get_layer(f"{part}_bn").get_weights()
        parts.append(gamma * (y - mean) / np.sqrt(var + 1e-5) + offset + shortcut)
    y = np.concatenate(parts, axis=-1)
    gamma, slope, zeta = model.get_layer(f"{name}_rprelu").get_weights()
    moved = y - gamma
    return np.where(moved > 0, moved, slope * moved) + zeta


@pytest.mark.parametrize("block", [1, 2, 13])
def test_blocks_match_the_definition(block):
    """Block 1 doubles its width at stride 1, block 2 at stride 2 (the pooled
    shortcut), block 13 keeps it; each half from the model's own input to it."""
    model = small_model()
    c, o, stride = TABLE[block - 1]
    name = f"block_{block}"
    entry = model.get_layer(f"{name}_3x3_rsign").input
    probe = keras.Model(
        model.inputs[0], [entry, model.get_layer(f"{name}_3x3_rprelu").output,
                       model.get_layer(f"{name}_1x1_rprelu").output],
    )  # fmt: skip
    x, middle, out = (t.numpy() for t in probe(images(2, SIZE), training=False))
    shortcut = x
    if stride == 2:
        n = x.shape[1] // 2
        shortcut = x.reshape(2, n, 2, n, 2, c).mean(axis=(2, 4))
    expected = _half_reference(model, f"{name}_3x3", x, shortcut, stride, 1)
    np.testing.assert_allclose(middle, expected, rtol=1e-4, atol=1e-4)
    expected = _half_reference(model, f"{name}_1x1", middle, middle, 1, o // c)
    assert out.shape[-1] == o
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def test_outputs_headless_and_input_tensor():
    model = small_model()
    assert model.output.shape == (None, CLASSES)
    probabilities = model.predict(images(2, SIZE), verbose=0)
    np.testing.assert_allclose(probabilities.sum(-1), 1.0, rtol=1e-5)
    tensor = keras.Input((64, 64, 3))
    headless = zoo.ReActNetA(input_tensor=tensor, include_top=False)
    assert headless.inputs[0] is tensor and headless.output.shape == (None, 2, 2, 1024)
    assert zoo.ReActNetA(include_top=False).output.shape == (None, None, None, 1024)


def test_fit_step_runs_every_binary_conv_on_kernels():
    model = small_model()
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="sparse_categorical_crossentropy")
    tapehook.reset_dispatch_counts()
    model.fit(images(2, SIZE), np.array([0, 1]), batch_size=2, epochs=1, verbose=0)
    counts = tapehook.dispatch_counts()
    n = len(binary_convs(model))
    # The batch norms of fewer than 256 channels recompute (fast layers):
    # their binary convs' forwards run again, RSign's shift included.
    rebuilt = len(recomputed_binary_convs(model))
    assert rebuilt
    assert counts["compiled"] == {
        "forward": n + rebuilt,
        "backprop_input": n,
        "backprop_filter": n,
    }
    assert not any(counts["reference"].values())


def test_keras_file_and_weights_file_round_trip(tmp_path):
    model = small_model()
    x = images(2, SIZE, seed=3)
    expected = model.predict(x, verbose=0)
    model.save(tmp_path / "reactnet.keras")
    loaded = keras.models.load_model(tmp_path / "reactnet.keras")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), expected, rtol=1e-6, atol=1e-7)
    model.save_weights(tmp_path / "reactnet.weights.h5")
    fresh = zoo.ReActNetA(
        input_shape=(SIZE, SIZE, 3),
        num_classes=CLASSES,
        weights=str(tmp_path / "reactnet.weights.h5"),
    )
    np.testing.assert_allclose(fresh.predict(x, verbose=0), expected, rtol=1e-6, atol=1e-7)


def test_weights_errors(tmp_path):
    for include_top in (True, False):
        with pytest.raises(TapehookError, match="no ImageNet weights.*weights=") as info:
            zoo.ReActNetA(weights="imagenet", include_top=include_top)
        assert "save_weights" in str(info.value)
    with pytest.raises(TapehookError, match="weights="):
        zoo.ReActNetA(weights=str(tmp_path / "missing.weights.h5"))
    with pytest.raises(TypeError):
        zoo.ReActNetA((SIZE, SIZE, 3))  # keyword arguments only
