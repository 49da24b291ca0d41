"""export_bitpacked / load_bitpacked: bit-identical round trips, the documented
layout, sizes, and a TapehookError (with the model untouched) for every corrupt
file and mismatched model."""

import json
import math
import struct

import keras
import numpy as np
import pytest

import tapehook
from tapehook.export import export_bitpacked, load_bitpacked

SPECS = [dict(activations=True, scale="mean_abs"), dict(scale="mean_abs"), dict(ste="approx_sign")]


def _data(n=16, size=10, channels=3, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(n, size, size, channels)).astype("float32"),
        rng.integers(0, 4, size=n),
    )


def _convnet(width=8, middle=keras.layers.Conv2D):
    """A new instance each call: auto-generated layer names differ between them."""
    return keras.Sequential(
        [
            keras.Input((10, 10, 3)),
            keras.layers.Conv2D(8, 3, padding="same"),
            keras.layers.BatchNormalization(),
            middle(width, 3, padding="same", use_bias=False),
            keras.layers.BatchNormalization(),
            keras.layers.Conv2D(width, 3),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(4),
        ]
    )


def _trained(spec, seed=0):
    keras.utils.set_random_seed(seed)
    model = tapehook.binarize(_convnet(), first_and_last_float=True, **spec)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(*_data(seed=seed), batch_size=4, epochs=1, verbose=0)
    return model


def _binary_kernels(model):
    return [
        l.kernel
        for l in model.layers
        if getattr(l, "kernel", None) is not None and tapehook.binary_spec_of(l.kernel)
    ]


def _state(model):
    """Every weight's value and every kernel's mark: to prove nothing changed."""
    return (
        [w.numpy().copy() for w in model.weights],
        [
            tapehook.binary_spec_of(l.kernel)
            for l in model.layers
            if getattr(l, "kernel", None) is not None
        ],
    )


def _assert_same_state(before, after):
    assert all(np.array_equal(a, b) for a, b in zip(before[0], after[0]))
    assert before[1] == after[1]


@pytest.mark.parametrize("spec", SPECS, ids=["act_mean_abs", "mean_abs", "approx"])
def test_round_trip_is_bit_identical(tmp_path, spec):
    original = _trained(spec)
    kernel = _binary_kernels(original)[0]
    w = kernel.numpy()
    w[0, 0, 0, 0], w[0, 0, 1, 0] = 0.0, -0.0  # sign(0) = +1, for -0.0 too
    kernel.assign(w)
    x, _ = _data(n=6, seed=1)
    expected = original(x, training=False).numpy()
    export_bitpacked(original, tmp_path / "m.thb")

    loaded = _convnet()  # a plain model: loading marks its binary kernels
    assert loaded.weights[0].path != original.weights[0].path
    assert load_bitpacked(loaded, tmp_path / "m.thb") is loaded
    tapehook.reset_dispatch_counts()
    assert np.array_equal(loaded(x, training=False).numpy(), expected)
    assert tapehook.dispatch_counts()["compiled"]["forward"] == 2

    stored_spec = tapehook.BinarySpec(**spec)
    assert [tapehook.binary_spec_of(k) for k in _binary_kernels(loaded)] == [stored_spec] * 2
    assert tapehook.binary_spec_of(loaded.layers[0].kernel) is None
    for before, after in zip(_binary_kernels(original), _binary_kernels(loaded)):
        w, v = before.numpy(), after.numpy()
        assert np.array_equal(v >= 0, w >= 0)
        alpha = (
            np.mean(np.abs(w.astype(np.float64)), axis=(0, 1, 2)).astype(np.float32)
            if stored_spec.scale
            else np.ones(w.shape[-1], np.float32)
        )
        assert np.array_equal(np.abs(v), np.broadcast_to(alpha, v.shape))
    v = _binary_kernels(loaded)[0].numpy()
    assert v[0, 0, 0, 0] == v[0, 0, 1, 0] == np.abs(v[..., 0]).max()  # 0 and -0.0: +1
    float_weights = [
        (a, b)
        for a, b in zip(original.weights, loaded.weights)
        if tapehook.binary_spec_of(a) is None
    ]
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in float_weights)


def test_conv1d_round_trip(tmp_path):
    def make():
        return keras.Sequential(
            [
                keras.Input((20, 5)),
                keras.layers.Conv1D(12, 3),
                keras.layers.Conv1D(6, 5, padding="same"),
            ]
        )

    original = tapehook.binarize(make(), scale="mean_abs")
    x = np.random.default_rng(0).normal(size=(3, 20, 5)).astype("float32")
    expected = original(x).numpy()
    export_bitpacked(original, tmp_path / "m.thb")
    loaded = load_bitpacked(make(), tmp_path / "m.thb")
    assert np.array_equal(loaded(x).numpy(), expected)


def _read_documented(path):
    """An independent reader of docs/bitpacked_format.md: header, manifest, data."""
    raw = (path).read_bytes()
    magic, version, size, _ = struct.unpack_from("<8sIII", raw)
    manifest = json.loads(raw[20 : 20 + size])
    return magic, version, manifest, raw[20 + size :]


def test_layout_is_the_documented_one(tmp_path):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((6, 6, 3)), keras.layers.Conv2D(5, 3)])
    tapehook.mark_binary(model.layers[0].kernel, scale="mean_abs", activations=True)
    export_bitpacked(model, tmp_path / "m.thb")
    magic, version, manifest, data = _read_documented(tmp_path / "m.thb")
    assert (magic, version) == (b"\x89TAPEHK\n", 1)
    assert (manifest["format"], manifest["version"]) == ("tapehook-bitpacked", 1)
    kernel, bias = manifest["weights"]
    assert kernel["kind"] == "binary" and kernel["shape"] == [3, 3, 3, 5]
    assert kernel["spec"] == {
        "activations": True,
        "scale": "mean_abs",
        "ste": "ste_sign",
        "clip": 1.0,
        "pad_value": 0.0,
        "weights": True,
        "beta": 5.0,
        "activation_clip": 1.0,
    }
    w = model.layers[0].kernel.numpy()
    bits = kernel["bits"]
    assert bits["shape"] == [5, 4] and bits["dtype"] == "uint8"  # 27 bits -> 4 bytes
    stored = np.frombuffer(data, np.uint8, 20, bits["offset"]).reshape(5, 4)
    for o in range(5):  # row o: w[..., o] in C order, MSB first, 1 for w >= 0
        flat = w[..., o].ravel()
        expected = [
            sum(int(flat[8 * b + i] >= 0) << (7 - i) for i in range(8) if 8 * b + i < 27)
            for b in range(4)
        ]
        assert list(stored[o]) == expected
    alpha = np.frombuffer(data, "<f4", 5, kernel["alpha"]["offset"])
    assert np.array_equal(
        alpha, np.mean(np.abs(w.astype(np.float64)), axis=(0, 1, 2)).astype(np.float32)
    )
    assert bias["kind"] == "float"
    assert np.array_equal(
        np.frombuffer(data, "<f4", 5, bias["value"]["offset"]), model.layers[0].bias.numpy()
    )


def test_binary_kernels_take_a_32nd_of_float(tmp_path):
    model = keras.Sequential(
        [keras.Input((4, 4, 256)), keras.layers.Conv2D(128, 3, use_bias=False)]
    )
    tapehook.binarize(model, scale="mean_abs")
    report = export_bitpacked(model, tmp_path / "m.thb")
    weights = 3 * 3 * 256 * 128
    assert report == dict(
        binary_kernels=1,
        binary_weights=weights,
        binary_bytes=weights // 8 + 4 * 128,
        binary_float32_bytes=4 * weights,
        other_bytes=0,
        file_bytes=(tmp_path / "m.thb").stat().st_size,
    )
    assert report["file_bytes"] <= report["binary_float32_bytes"] / 30


def test_report_counts_float_weights(tmp_path):
    model = _trained(SPECS[0])
    report = export_bitpacked(model, tmp_path / "m.thb")
    binary = sum(k.numpy().size for k in _binary_kernels(model))
    assert report["binary_weights"] == binary and report["binary_kernels"] == 2
    assert report["other_bytes"] == 4 * (sum(w.numpy().size for w in model.weights) - binary)
    assert report["file_bytes"] > report["binary_bytes"] + report["other_bytes"]


def _corrupt(raw, how):
    manifest_end = 20 + struct.unpack_from("<I", raw, 12)[0]
    raw = bytearray(raw)
    if how == "empty":
        return b""
    if how == "in_header":
        return bytes(raw[:11])
    if how == "in_manifest":
        return bytes(raw[: manifest_end - 5])
    if how == "in_data":
        return bytes(raw[:-3])
    if how == "trailing":
        return bytes(raw) + b"\0"
    if how == "magic":
        raw[0:8] = b"PK\x03\x04\0\0\0\0"
    elif how == "version":
        raw[8:12] = struct.pack("<I", 2)
    elif how == "manifest":
        raw[manifest_end - 40] ^= 0x01
    elif how == "last_array":  # the last weight: everything before it is valid
        raw[-1] ^= 0x80
    elif how == "first_bits":
        raw[manifest_end] ^= 0x01
    return bytes(raw)


@pytest.mark.parametrize(
    "how,message",
    [
        ("empty", "truncated"),
        ("in_header", "truncated"),
        ("in_manifest", "truncated inside the manifest"),
        ("in_data", "truncated"),
        ("trailing", "trailing bytes"),
        ("magic", "bad magic"),
        ("version", "format version 2; this tapehook reads version 1"),
        ("manifest", "manifest checksum mismatch"),
        ("last_array", "dense.*/bias: checksum mismatch"),
        ("first_bits", "conv2d.*/kernel: checksum mismatch"),
    ],
)
def test_corrupt_file_raises_and_leaves_model_untouched(tmp_path, how, message):
    original = _trained(SPECS[0])
    export_bitpacked(original, tmp_path / "m.thb")
    path = tmp_path / "bad.thb"
    path.write_bytes(_corrupt((tmp_path / "m.thb").read_bytes(), how))
    target = _trained(SPECS[0], seed=1)
    before = _state(target)
    with pytest.raises(tapehook.TapehookError, match=message):
        load_bitpacked(target, path)
    _assert_same_state(before, _state(target))


def _without_last_bias():
    model = _convnet()
    model.pop()
    model.add(keras.layers.Dense(4, use_bias=False))
    return model


def _with_extra_layer():
    model = _convnet()
    model.add(keras.layers.Dense(2))
    return model


def _transpose_instead_of_conv():
    """Same weight names, shapes and dtypes, but the first binary kernel's layer
    is a Conv2DTranspose, which tapehook cannot binarize."""
    return _convnet(middle=keras.layers.Conv2DTranspose)


def _marked_first_conv():
    model = _convnet()
    tapehook.mark_binary(model.layers[0].kernel)
    return model


@pytest.mark.parametrize(
    "make,message",
    [
        (
            _without_last_bias,
            r"15 weights, the model 14; weight 14 is .*dense.*/bias \(4,\) "
            r"float32 in the file and missing in the model",
        ),
        (
            _with_extra_layer,
            r"15 weights, the model 17; weight 15 is missing in the file and "
            r".*dense.*/kernel \(4, 2\) float32 in the model",
        ),
        (
            lambda: _convnet(width=12),
            r"weight 6 is .*/kernel \(3, 3, 8, 8\) float32 in the "
            r"file and .*/kernel \(3, 3, 8, 12\) float32",
        ),
        (
            _transpose_instead_of_conv,
            r"stored binary, but the model's .*/kernel is a "
            r"Conv2DTranspose kernel",
        ),
        (_marked_first_conv, r"conv2d.*/kernel is stored float, but the model marks"),
        (lambda: keras.Sequential([keras.layers.Conv2D(8, 3)]), "has no weights yet"),
    ],
)
def test_mismatched_model_raises_and_is_left_untouched(tmp_path, make, message):
    export_bitpacked(_trained(SPECS[0]), tmp_path / "m.thb")
    target = make()
    before = _state(target)
    with pytest.raises(tapehook.TapehookError, match=message):
        load_bitpacked(target, tmp_path / "m.thb")
    _assert_same_state(before, _state(target))


def test_non_finite_binary_kernel_is_refused(tmp_path):
    model = _trained(SPECS[1])
    kernel = _binary_kernels(model)[0]
    kernel.assign(
        np.where(
            np.arange(math.prod(kernel.shape)).reshape(kernel.shape) == 7, np.nan, kernel.numpy()
        )
    )
    with pytest.raises(tapehook.TapehookError, match="inf or NaN"):
        export_bitpacked(model, tmp_path / "m.thb")
    assert not (tmp_path / "m.thb").exists()
