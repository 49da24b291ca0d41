"""tapehook.zoo's QuickNets, Bi-Real Net, Real-to-Binary Net and Binary
ResNet-E 18: arguments, what runs on tapehook's kernels, one-padding, the
frozen blur pool and Real-to-Binary's rescaling, each against its definition
written out here. (Architecture and weights against larq-zoo's own models:
test_zoo_reference.py.)"""

import functools

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.legacy.saving import legacy_h5_format

import tapehook
from tapehook import layers as th
from tapehook.errors import TapehookError
from tapehook.zoo import quicknet, resnets

from conftest import recomputed_binary_convs

SIZE = 64


def quicknet_facts(binary_convs):
    """A QuickNet's spec, binary convs and BN settings (the stem's defaults,
    the blocks' and transitions' 0.9 / 1e-5)."""
    spec = tapehook.BinarySpec(activations=True, clip=1.25, pad_value=1.0)
    return spec, binary_convs, {(0.99, 1e-3), (0.9, 1e-5)}


# name: (function, larq-zoo's parameter count (any image size), its binary conv
# spec, binary convs, {(BN momentum, epsilon)})
MODELS = {
    "QuickNetSmall": (quicknet.QuickNetSmall, 12_664_344, *quicknet_facts(16)),
    "QuickNet": (quicknet.QuickNet, 13_243_720, *quicknet_facts(16)),
    "QuickNetLarge": (quicknet.QuickNetLarge, 23_359_304, *quicknet_facts(32)),
    "BiRealNet": (
        resnets.BiRealNet,
        11_699_112,
        tapehook.BinarySpec(activations="approx_sign", scale="mean_abs", clip=1.0),
        16,
        {(0.8, 1e-3)},
    ),
    "RealToBinaryNet": (
        resnets.RealToBinaryNet,
        11_995_624,
        tapehook.BinarySpec(activations=True, clip=1.0),
        16,
        {(0.99, 1e-3)},
    ),
    "BinaryResNetE18": (
        resnets.BinaryResNetE18,
        11_699_368,
        tapehook.BinarySpec(activations=True, clip=1.25),
        16,
        {(0.9, 1e-5)},
    ),
}


INPUTS = {}


@functools.cache
def model_of(name):
    """``name`` on a 64 px ``input_tensor`` with larq-zoo's 1000 classes,
    built once per run."""
    INPUTS[name] = keras.Input((SIZE, SIZE, 3))
    return MODELS[name][0](input_tensor=INPUTS[name])


def binary_convs(model):
    return [layer for layer in model.layers if getattr(layer, "input_quantizer", None)]


def images(n, size=SIZE, seed=0):
    return np.random.default_rng(seed).normal(size=(n, size, size, 3)).astype("float32")


def sign(t):
    return np.where(t >= 0, 1.0, -1.0).astype("float32")


@pytest.mark.parametrize("name", list(MODELS))
def test_architecture_facts(name):
    # Parameter counts do not depend on the image size here (every dense
    # layer follows a global pool), so 64 px gives larq-zoo's 224 px count.
    _, params, spec, n_binary, batch_norms = MODELS[name]
    model = model_of(name)
    assert model.inputs[0] is INPUTS[name] and model.output.shape == (None, 1000)
    assert model.count_params() == params
    convs = binary_convs(model)
    assert len(convs) == n_binary
    assert all(conv.binary_spec == spec for conv in convs)
    assert all(type(conv.kernel_constraint).__name__ == "WeightClip" for conv in convs)
    assert {conv.kernel_constraint.clip_value for conv in convs} == {spec.clip}
    found = {
        (layer.momentum, layer.epsilon)
        for layer in model.layers
        if isinstance(layer, keras.layers.BatchNormalization)
    }
    assert found == batch_norms
    assert all(
        isinstance(layer, th.BatchNormalization)
        for layer in model.layers
        if isinstance(layer, keras.layers.BatchNormalization)
    )


@pytest.mark.parametrize("name", ["QuickNetSmall", "BiRealNet", "RealToBinaryNet"])
def test_fit_step_runs_every_binary_conv_on_kernels(name):
    model = model_of(name)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    tapehook.reset_dispatch_counts()
    model.fit(images(2), np.array([0, 1]), batch_size=2, epochs=1, verbose=0)
    counts = tapehook.dispatch_counts()
    n = len(binary_convs(model))
    # A batch norm that recomputes runs its binary conv's forward again.
    rebuilt = len(recomputed_binary_convs(model))
    assert counts["compiled"] == {
        "forward": n + rebuilt,
        "backprop_input": n,
        "backprop_filter": n,
    }
    assert not any(counts["reference"].values())


@pytest.mark.parametrize("name", list(MODELS))
def test_fast_layers_decide_the_zoo_models_layers(name):
    """The zoo writes Keras's own batch norms, pools and adds; as in any model
    tapehook is in charge of, they are tapehook's, batch norms of fewer than
    256 channels recomputing, and stay Keras's with fast_layers off."""
    model = model_of(name)
    kinds = (keras.layers.BatchNormalization, keras.layers.MaxPooling2D, keras.layers.Add)
    layers = [l for l in model.layers if isinstance(l, kinds)]
    assert layers and all(type(l).__module__ == "tapehook.layers" for l in layers)
    norms = [l for l in layers if isinstance(l, keras.layers.BatchNormalization)]
    assert [l.recompute for l in norms] == [l.input.shape[-1] < 256 for l in norms]
    with tapehook.config(fast_layers=False):
        stock = MODELS[name][0](input_shape=(SIZE, SIZE, 3))
    layers = [l for l in stock.layers if isinstance(l, kinds)]
    assert len(layers) == len([l for l in model.layers if isinstance(l, kinds)])
    assert all(type(l).__module__.startswith("keras.") for l in layers)
    x = images(2)
    stock.set_weights(model.get_weights())
    np.testing.assert_allclose(
        model.predict(x, verbose=0), stock.predict(x, verbose=0), rtol=1e-4, atol=1e-6
    )


def test_quicknet_pads_binarized_input_with_plus_one():
    conv = binary_convs(model_of("QuickNetSmall"))[0]
    x = tf.constant(np.random.default_rng(1).normal(size=(1, 8, 8, 32)).astype("float32"))
    kernel = sign(conv.kernel.numpy())

    def expected(pad):
        padded = np.pad(sign(x.numpy()), ((0, 0), (1, 1), (1, 1), (0, 0)), constant_values=pad)
        return tf.nn.relu(tf.nn.conv2d(padded, kernel, 1, "VALID")).numpy()

    for out in (conv(x), tf.function(lambda t: conv(t))(x)):
        np.testing.assert_allclose(out.numpy(), expected(1.0), atol=1e-4)
    # Zero padding gives other borders, so the check above sees the padding.
    assert not np.allclose(expected(0.0), expected(1.0), atol=1e-4)


def test_blur_pool_is_frozen_binomial_and_kept_in_the_weights(tmp_path):
    model = quicknet.QuickNetSmall(input_shape=(SIZE, SIZE, 3), num_classes=3)
    blurs = [layer for layer in model.layers if type(layer) is keras.layers.DepthwiseConv2D]
    assert len(blurs) == 3  # one per width change: 32 -> 64 -> 256 -> 512
    binomial = np.outer([1, 2, 1], [1, 2, 1]) / 16
    for blur in blurs:
        assert not blur.trainable and blur.strides == (2, 2)
        kernel = blur.kernel.numpy()
        np.testing.assert_allclose(kernel, np.broadcast_to(binomial[..., None, None], kernel.shape))
        assert any(w is blur.kernel for w in model.non_trainable_weights)
    before = [blur.kernel.numpy() for blur in blurs]
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy")
    model.fit(images(2), np.array([0, 1]), epochs=1, verbose=0)
    for blur, kernel in zip(blurs, before):
        np.testing.assert_array_equal(blur.kernel.numpy(), kernel)

    # A Keras 2 HDF5 weights file (what larq-zoo releases) carries the blur
    # kernels: changed ones load back into a fresh model.
    for blur in blurs:
        blur.kernel.assign(blur.kernel * 3.0)
    path = tmp_path / "quicknet_small.h5"
    with h5py.File(path, "w") as f:
        legacy_h5_format.save_weights_to_hdf5_group(f, model)
    fresh = quicknet.QuickNetSmall(input_shape=(SIZE, SIZE, 3), num_classes=3, weights=str(path))
    fresh_blurs = [layer for layer in fresh.layers if type(layer) is keras.layers.DepthwiseConv2D]
    for blur, kernel in zip(fresh_blurs, before):
        np.testing.assert_allclose(blur.kernel.numpy(), kernel * 3.0)


def test_real_to_binary_rescales_by_its_input():
    model = model_of("RealToBinaryNet")
    block = "r2b_bnn_block_4a"  # a downsampling half block: 64 -> 128 channels
    probe = keras.Model(
        model.inputs[0],
        [
            model.get_layer(f"{block}_batch_norm").output,
            model.get_layer(f"{block}_conv2d").output,
            model.get_layer(f"{block}_scaling_multiplication").output,
        ],
    )
    conv_input, conv_output, scaled = (t.numpy() for t in probe(images(2), training=False))
    (reduce,) = model.get_layer(f"{block}_scaling_dense_reduce").get_weights()
    (expand,) = model.get_layer(f"{block}_scaling_dense_expand").get_weights()
    assert reduce.shape == (64, 8) and expand.shape == (8, 128)
    hidden = np.maximum(conv_input.mean(axis=(1, 2)) @ reduce, 0)
    scales = 1 / (1 + np.exp(-(hidden @ expand)))
    np.testing.assert_allclose(scaled, conv_output * scales[:, None, None, :], rtol=1e-5, atol=1e-5)
    # larq-zoo's layer names, which its attention-matching training refers to.
    for layer in ("block_1_prelu", "block_4a_shortcut_conv2d", "block_9_out", "block_10_logits"):
        model.get_layer(f"r2b_bnn_{layer}")


@pytest.mark.parametrize("build", [quicknet.QuickNetSmall, resnets.RealToBinaryNet])
def test_headless_takes_any_size(build):
    model = build(include_top=False)
    assert model.input.shape == (None, None, None, 3)
    for size in (64, 96):
        assert model(images(1, size), training=False).shape == (1, size // 32, size // 32, 512)


def test_resnet_e_small_images_get_the_unstrided_stem():
    model = resnets.BinaryResNetE18(input_shape=(32, 32, 3), include_top=False)
    first = model.layers[1]
    assert first.kernel_size == (3, 3) and first.strides == (1, 1)
    assert not any(isinstance(layer, keras.layers.MaxPooling2D) for layer in model.layers)
    assert model.output.shape == (None, 4, 4, 512)
    wide = resnets.BinaryResNetE18(input_shape=(SIZE, SIZE, 3), include_top=False)
    assert wide.layers[1].kernel_size == (7, 7) and wide.output.shape == (None, 2, 2, 512)


def test_config_round_trip():
    # The blur pool's initializer and Real-to-Binary's layers deserialize.
    for name in ("QuickNetSmall", "RealToBinaryNet"):
        model = model_of(name)
        clone = keras.Model.from_config(model.get_config())
        clone.set_weights(model.get_weights())
        x = images(1)
        np.testing.assert_allclose(
            clone(x, training=False), model(x, training=False), rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("name", list(MODELS))
def test_argument_errors(name, tmp_path):
    build = MODELS[name][0]
    with pytest.raises(TypeError):
        build((SIZE, SIZE, 3))  # keyword arguments only
    with pytest.raises(TapehookError, match="num_classes"):
        build(weights="imagenet", num_classes=10)
    with pytest.raises(TapehookError, match="weights="):
        build(weights=str(tmp_path / "missing.h5"))
    with pytest.raises(TapehookError, match="fixed input_shape"):
        build(input_shape=(None, None, 3))
    with pytest.raises(TapehookError, match="include_top=False"):
        build(weights="imagenet", input_shape=(SIZE, SIZE, 3))


def test_weights_of_another_model_name_the_fix(tmp_path):
    path = tmp_path / "birealnet.h5"
    with h5py.File(path, "w") as f:
        legacy_h5_format.save_weights_to_hdf5_group(f, model_of("BiRealNet"))
    with pytest.raises(TapehookError, match="does not fit"):
        resnets.BinaryResNetE18(input_shape=(SIZE, SIZE, 3), weights=str(path))
