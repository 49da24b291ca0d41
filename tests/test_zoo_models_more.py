"""tapehook.zoo's BinaryDenseNets, MeliusNet22, XNOR-Net, DoReFa-Net and
Binary AlexNet: arguments, shapes, what runs on tapehook's kernels, and their
quantizers against NumPy. (Architecture and weights against larq-zoo's own
models: test_zoo_reference.py.)"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tapehook
from tapehook.errors import TapehookError
from tapehook.zoo import classic, densenets

from conftest import recomputed_binary_convs


def _binary_convs(model):
    return [layer for layer in model.layers if type(layer).__name__ == "QuantConv2D"]


def _fit_one_step(model, images):
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    labels = np.arange(len(images)) % model.output_shape[-1]
    tapehook.reset_dispatch_counts()
    model.fit(images, labels, batch_size=len(images), epochs=1, verbose=0)
    return tapehook.dispatch_counts()["compiled"]


def _images(n, size, seed=0):
    return np.random.default_rng(seed).normal(size=(n, size, size, 3)).astype("float32")


def test_fit_step_runs_binary_convs_on_kernels():
    model = densenets.BinaryDenseNet28(input_shape=(32, 32, 3), num_classes=5)
    convs = _binary_convs(model)
    spec = tapehook.BinarySpec(activations=True, clip=1.3)
    # MeliusNet's binary convs are the same layer (its fit step is as slow as this one).
    melius = _binary_convs(densenets.MeliusNet22(input_shape=(32, 32, 3), include_top=False))
    assert len(convs) == 23 and len(melius) == 34
    assert all(conv.binary_spec == spec for conv in convs + melius)
    counts = _fit_one_step(model, _images(2, 32))
    n = len(convs)
    # A recomputing batch norm runs its binary conv's forward again (none
    # here: DenseNet's batch norms come before its convs).
    assert counts["forward"] == n + len(recomputed_binary_convs(model))
    assert counts["backprop_filter"] == n and counts["backprop_input"] == n


def test_alexnet_first_conv_binarizes_weights_only():
    model = classic.BinaryAlexNet(input_shape=(64, 64, 3), num_classes=3)
    first, *rest = _binary_convs(model)
    assert first.binary_spec == tapehook.BinarySpec(activations=False)
    assert all(conv.binary_spec == tapehook.BinarySpec(activations=True) for conv in rest)
    bns = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    assert bns and not any(bn.scale for bn in bns)
    counts = _fit_one_step(model, _images(2, 64))
    rebuilt = recomputed_binary_convs(model)
    assert rebuilt
    assert counts["forward"] == len(rest) + 1 + len(rebuilt)
    assert counts["backprop_filter"] == len(rest) + 1


def test_small_images_get_densenets_small_stem():
    # Under 50 px: one stride-1 3x3 conv, no pooling before the first stage.
    small = densenets.BinaryDenseNet28(input_shape=(48, 48, 3), include_top=False)
    large = densenets.BinaryDenseNet28(input_shape=(56, 56, 3), include_top=False)
    assert small.output_shape == (None, 6, 6, 576)
    assert large.output_shape == (None, 1, 1, 576)
    assert small.layers[1].kernel.shape == (3, 3, 3, 64)
    assert large.layers[1].kernel.shape == (7, 7, 3, 64)


@pytest.mark.parametrize(
    "build, channels, size, expect",
    [
        (densenets.BinaryDenseNet28, 576, (64, 96), (2, 3)),
        (densenets.BinaryDenseNet37Dilated, 640, (64, 96), (8, 12)),  # one pool after the stem
        (densenets.MeliusNet22, 512, (40, 72), (2, 3)),
    ],
    ids=["densenet28", "densenet37_dilated", "meliusnet22"],
)
def test_headless_takes_any_size(build, channels, size, expect):
    model = build(include_top=False)
    assert model.input_shape == (None, None, None, 3)
    assert model.output_shape == (None, None, None, channels)
    y = model(np.zeros((1, *size, 3), "float32"))
    assert y.shape == (1, *expect, channels)


def test_xnornet_minimum_size():
    with pytest.raises(TapehookError, match="at least 217 px"):
        classic.XNORNet(input_shape=(216, 216, 3))
    with pytest.raises(TapehookError, match="at least 217 px"):
        classic.XNORNet(input_shape=(300, 200, 3), include_top=False)
    # The headless model takes any size, the smallest included.
    model = classic.XNORNet(include_top=False)
    assert model.output_shape == (None, None, None, 4096)
    assert model.compute_output_shape((1, 217, 217, 3)) == (1, 1, 1, 4096)


def test_xnornet_convs_scale_sign_by_mean_abs_weight():
    """A binary conv of XNOR-Net computes sign(x) * (alpha sign(W)) with
    alpha = mean|W| per output channel (larq-zoo's xnor_weight_scale for
    |W| <= 1), against tf.nn.conv2d on the quantized operands."""
    model = classic.XNORNet(include_top=False)
    conv = _binary_convs(model)[0]  # 5x5, 96 -> 256
    assert conv.binary_spec == tapehook.BinarySpec(activations=True, scale="mean_abs")
    assert isinstance(conv.kernel_constraint, tapehook.larq.constraints.WeightClip)
    assert conv.kernel_constraint.clip_value == 1.0
    rng = np.random.default_rng(1)
    w = rng.uniform(-1, 1, conv.kernel.shape).astype("float32")
    conv.kernel.assign(w)
    x = rng.normal(size=(1, 9, 9, conv.kernel.shape[2])).astype("float32")
    alpha = np.abs(w).mean(axis=(0, 1, 2))
    sign = lambda t: np.where(t >= 0, 1.0, -1.0).astype("float32")  # noqa: E731
    expected = tf.nn.conv2d(sign(x), sign(w) * alpha, 1, "SAME").numpy()
    np.testing.assert_allclose(conv(x).numpy(), expected, rtol=1e-5, atol=1e-4)
    assert len(model.losses) == len(_binary_convs(model)) + 1  # L2 on every kernel


def test_dorefa_activations_are_two_bit():
    model = classic.DoReFaNet(input_shape=(44, 44, 3), num_classes=4)
    quantized = [
        layer for layer in model.layers if type(layer).__name__ in ("QuantConv2D", "QuantDense")
    ]
    assert len(quantized) == 6
    quantizer = quantized[0].input_quantizer
    x = tf.constant(np.linspace(-0.5, 1.5, 201, dtype="float32"))
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = quantizer(x)
    expected = np.round(np.clip(x.numpy(), 0, 1) * 3) / 3
    np.testing.assert_allclose(y.numpy(), expected, atol=1e-7)
    assert set(np.round(y.numpy() * 3).astype(int)) == {0, 1, 2, 3}
    # Identity gradient inside [0, 1], none outside (the clip's).
    inside = (x.numpy() >= 0) & (x.numpy() <= 1)
    np.testing.assert_array_equal(tape.gradient(y, x).numpy(), inside.astype("float32"))
    # 2-bit inputs are not binary: DoReFa's layers run as plain TF ops.
    assert all(layer.binary_spec is None for layer in quantized)


def test_dorefa_weights_scaled_sign_with_identity_gradient():
    rng = np.random.default_rng(2)
    w = tf.constant(rng.normal(size=(3, 3, 4, 5)).astype("float32"))
    g = tf.constant(rng.normal(size=(3, 3, 4, 5)).astype("float32"))
    with tf.GradientTape() as tape:
        tape.watch(w)
        q = classic.magnitude_aware_sign_unclipped(w)
        loss = tf.reduce_sum(q * g)
    # One mean|W| for the whole kernel; the gradient passes unchanged (no clip, no scale).
    expected = np.abs(w.numpy()).mean() * np.where(w.numpy() >= 0, 1, -1)
    np.testing.assert_allclose(q.numpy(), expected, rtol=1e-6)
    np.testing.assert_array_equal(tape.gradient(loss, w).numpy(), g.numpy())
    assert classic.magnitude_aware_sign_unclipped.precision == 1


def test_dorefa_minimum_size_and_top():
    with pytest.raises(TapehookError, match="at least 44 px"):
        classic.DoReFaNet(input_shape=(43, 43, 3))
    model = classic.DoReFaNet(input_shape=(44, 44, 3), num_classes=4)
    assert model.output_shape == (None, 4)
    y = model.predict(_images(2, 44), verbose=0)
    np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=1e-5)


def test_meliusnet_improvement_adds_to_appended_channels():
    model = densenets.MeliusNet22(input_shape=(32, 32, 3), num_classes=7)
    for name in (
        "stem_s1_groupconv_split",
        "stem_s2_groupconv_conv7",
        "section_0_block_0_dense_binconv",
        "section_3_block_3_improve_merge",
        "section_2_transition_pw",
        "head_globalpool_pool",
        "head_dense",
    ):
        model.get_layer(name)
    merge = model.get_layer("section_0_block_0_improve_merge")
    rng = np.random.default_rng(3)
    x = rng.normal(size=(1, 2, 2, 192)).astype("float32")
    y = rng.normal(size=(1, 2, 2, 64)).astype("float32")
    expected = x + np.pad(y, [(0, 0), (0, 0), (0, 0), (128, 0)])
    np.testing.assert_array_equal(merge([x, y]).numpy(), expected)
    split = model.get_layer("stem_s2_groupconv_split")
    parts = split(x[..., :64])
    np.testing.assert_array_equal(np.concatenate(parts, axis=-1), x[..., :64])
    assert [p.shape[-1] for p in parts] == [8] * 8


def test_config_round_trip():
    model = densenets.MeliusNet22(input_shape=(32, 32, 3), num_classes=3)
    clone = keras.Model.from_config(model.get_config())
    clone.set_weights(model.get_weights())
    x = _images(1, 32)
    np.testing.assert_allclose(clone(x).numpy(), model(x).numpy(), atol=1e-6)


def test_arguments():
    with pytest.raises(TypeError):
        densenets.BinaryDenseNet28((32, 32, 3))  # keyword arguments only
    with pytest.raises(TapehookError, match="num_classes"):
        classic.BinaryAlexNet(weights="imagenet", num_classes=10)
    with pytest.raises(TapehookError, match="weights="):
        densenets.MeliusNet22(weights="/no/such/file.h5")
    with pytest.raises(TapehookError, match="fixed input_shape"):
        densenets.BinaryDenseNet45(input_shape=(None, None, 3))
    inputs = keras.Input((64, 64, 3))
    model = classic.BinaryAlexNet(input_tensor=inputs, include_top=False)
    assert model.inputs[0] is inputs and model.output_shape == (None, 1, 1, 256)
    assert model.name == "binary_alexnet"
