"""tapehook.deploy: SavedModel, LiteRT and LCE exports, checked by running the
exported files (LiteRT's interpreter here, LCE's in its side environment, the
SavedModel in a process without tapehook) against model.predict, which the
rest of the suite checks against tapehook.reference.

The LCE tests build the cached side environment on first use (minutes, from
the package registry; docs/deploy.md).
"""

import json
import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tapehook
from tapehook.deploy import export_savedmodel, export_tflite, flatbuffer, run_tflite

LCE_TIMEOUT = 1800  # the first LCE test may build the side environment


def _bn_stats(model, seed=7):
    """Non-trivial BatchNorm statistics so that inference differs from identity."""
    rng = np.random.default_rng(seed)
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.moving_mean.assign(rng.normal(0, 0.5, layer.moving_mean.shape))
            layer.moving_variance.assign(rng.uniform(0.5, 2, layer.moving_variance.shape))
            layer.gamma.assign(rng.uniform(0.5, 1.5, layer.gamma.shape))
            layer.beta.assign(rng.normal(0, 0.3, layer.beta.shape))
    return model


def digits_model(**spec):
    """examples/train_digits.py's architecture: float stem and head, binary
    3x3 SAME convs with MaxPool and BatchNorm between."""
    inputs = keras.Input((16, 16, 1))
    h = keras.layers.Conv2D(32, 3, padding="same", use_bias=False, name="stem")(inputs)
    h = keras.layers.BatchNormalization()(h)
    for i in range(2):
        h = keras.layers.Conv2D(64, 3, padding="same", use_bias=False, name=f"conv{i}")(h)
        h = keras.layers.MaxPooling2D()(h)
        h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Flatten()(h)
    model = keras.Model(inputs, keras.layers.Dense(10, name="head")(h))
    tapehook.binarize(model, first_and_last_float=True, **spec)
    return _bn_stats(model)


def residual_model():
    """Bi-Real-style blocks (approx_sign inputs, mean_abs scale, float
    shortcuts), a strided VALID binary conv with a bias, and a VALID binary conv
    feeding another binary conv through nothing but its sign (LCE writes
    bitpacked activations there)."""
    inputs = keras.Input((12, 12, 3))
    h = keras.layers.Conv2D(32, 3, padding="same", name="stem")(inputs)
    h = keras.layers.BatchNormalization()(h)
    for i in range(2):
        y = keras.layers.Conv2D(32, 3, padding="same", use_bias=False, name=f"res{i}")(h)
        h = keras.layers.Add()([h, keras.layers.BatchNormalization()(y)])
    h = keras.layers.Conv2D(64, 3, strides=2, padding="valid", name="down")(h)
    h = keras.layers.Conv2D(64, 1, padding="valid", use_bias=True, name="bit_out")(h)
    h = keras.layers.Conv2D(64, 3, padding="valid", use_bias=False, name="bit_in")(h)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inputs, keras.layers.Dense(7, name="head")(h))
    tapehook.binarize(model, exclude=["stem", "head"], activations="approx_sign", scale="mean_abs")
    return _bn_stats(model)


def weight_only_model():
    inputs = keras.Input((10, 10, 4))
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="w0")(inputs)
    h = keras.layers.Conv2D(32, 3, strides=2, padding="valid", name="w1")(h)
    h = keras.layers.Flatten()(h)
    model = keras.Model(inputs, keras.layers.Dense(5, name="head")(h))
    tapehook.binarize(model, exclude=["head"], scale="mean_abs")
    return model


def dense_depthwise_model():
    """Binary Dense and DepthwiseConv2D (LCE has no 1-bit op for either) next
    to a binary Conv2D."""
    inputs = keras.Input((8, 8, 8))
    h = keras.layers.Conv2D(32, 3, padding="same", use_bias=False, name="conv")(inputs)
    h = keras.layers.DepthwiseConv2D(3, depth_multiplier=2, padding="same", name="dw")(h)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(32, name="fc")(h)
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(h))
    tapehook.binarize(model, exclude=["head"], activations=True, scale="mean_abs")
    return _bn_stats(model)


def _inputs(model, n=32, seed=3):
    shape = (n, *model.inputs[0].shape[1:])
    return np.random.default_rng(seed).normal(0, 1, shape).astype(np.float32)


def _assert_matches(actual, expected):
    """Logits within float tolerance and the same predicted classes."""
    scale = max(float(np.abs(expected).max()), 1.0)
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5 * scale)
    np.testing.assert_array_equal(np.argmax(actual, -1), np.argmax(expected, -1))


def _weights_bytes(model, divisor):
    """Bound on stored weights: float layers at 32 bits, binary kernels at
    1/divisor of 32 bits plus their alpha, plus 2 KiB of small constants."""
    total = 0
    binary = {id(k) for _, k, _ in tapehook.export.binary_kernels(model)}
    for w in model.weights:
        n = int(np.prod(w.shape))
        total += 4 * n / divisor + 4 * w.shape[-1] if id(w) in binary else 4 * n
    return total + 2048


def _stored_bytes(path):
    return sum(c[3] for c in flatbuffer.constants(pathlib.Path(path).read_bytes()))


# ---- LiteRT ----


@pytest.mark.parametrize(
    "make",
    [digits_model, residual_model, weight_only_model, dense_depthwise_model],
    ids=["digits", "residual", "weight_only", "dense_depthwise"],
)
def test_litert_round_trip(make, tmp_path):
    model = make(**({"activations": True} if make is digits_model else {}))
    x = _inputs(model)
    expected = model.predict(x, verbose=0)
    report = export_tflite(model, tmp_path / "m.tflite")
    assert report["path"] == str(tmp_path / "m.tflite") and report["target"] == "litert"
    assert report["bytes"] == (tmp_path / "m.tflite").stat().st_size
    assert report["binary_layers"] == len(tapehook.export.binary_kernels(model)) > 0
    assert report["warnings"] == []
    assert all(op.isupper() for op in report["ops"])  # builtin ops only
    # Binary kernels are stored as bits: at most 1/8 of float32 (here 1/32).
    assert _stored_bytes(tmp_path / "m.tflite") <= _weights_bytes(model, 8)
    _assert_matches(run_tflite(tmp_path / "m.tflite", x), expected)
    # the export leaves the model as it was; eager calls agree with the file too
    np.testing.assert_array_equal(model.predict(x, verbose=0), expected)
    _assert_matches(run_tflite(tmp_path / "m.tflite", x[:4]), model(x[:4]).numpy())


@pytest.mark.parametrize(
    "make", [digits_model, residual_model, dense_depthwise_model], ids=["digits", "residual", "dd"]
)
def test_litert_float_filters(make, tmp_path):
    """filters="float": +-1 filters as float constants (XNNPACK's fast path),
    the same outputs as predict (alpha not folded into the filter, so exact
    zero sums stay zero), a file about float-sized, no run-time unpacking."""
    model = make(**({"activations": True, "scale": "mean_abs"} if make is digits_model else {}))
    x = _inputs(model)
    expected = model.predict(x, verbose=0)
    small = export_tflite(model, tmp_path / "bits.tflite")
    fast = export_tflite(model, tmp_path / "float.tflite", filters="float")
    assert (small["filters"], fast["filters"]) == ("bits", "float")
    assert "BITWISE_XOR" not in fast["ops"] and "GATHER" not in fast["ops"]
    assert fast["bytes"] > 4 * small["bytes"]
    assert _stored_bytes(tmp_path / "float.tflite") >= 0.9 * _weights_bytes(model, 1) - 4096
    binary_rows = [r for r in fast["layers"] if r["binary"]]
    assert all(r["kernel_bytes"] >= r["kernel_float32_bytes"] for r in binary_rows)
    _assert_matches(run_tflite(tmp_path / "float.tflite", x), expected)


def test_filters_argument_checked(tmp_path):
    model = digits_model(activations=True)
    with pytest.raises(tapehook.TapehookError, match="'bits'.*'float'"):
        export_tflite(model, tmp_path / "m.tflite", filters="int8")
    with pytest.raises(tapehook.TapehookError, match="LCE's converter always packs"):
        export_tflite(model, tmp_path / "m.tflite", target="lce", filters="float")
    assert not (tmp_path / "m.tflite").exists()


def test_litert_after_fit_and_scale_none(tmp_path):
    """A model trained with fit (optimizer state, updated BatchNorm) exports
    what predict computes; scale=None has no multiply."""
    model = digits_model(activations=True)
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (64, 16, 16, 1)).astype(np.float32)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, rng.integers(0, 10, 64), epochs=1, batch_size=16, verbose=0)
    report = export_tflite(model, tmp_path / "m.tflite")
    assert report["ops"]["CONV_2D"] == 3
    _assert_matches(run_tflite(tmp_path / "m.tflite", x), model.predict(x, verbose=0))


class SubclassedNet(keras.Model):
    def __init__(self):
        super().__init__()
        self.a = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)
        self.norm = keras.layers.BatchNormalization()
        self.b = keras.layers.Conv2D(16, 3, strides=2, padding="valid")
        self.head = keras.layers.Dense(3)

    def call(self, x, training=False):
        h = self.b(self.norm(self.a(x), training=training))
        return self.head(keras.ops.mean(h, axis=(1, 2)))


@pytest.mark.parametrize("kind", ["sequential", "subclassed"])
def test_litert_sequential_and_subclassed(kind, tmp_path):
    if kind == "sequential":
        model = keras.Sequential(
            [
                keras.Input((9, 9, 2)),
                keras.layers.Conv2D(16, 3, use_bias=False),
                keras.layers.BatchNormalization(),
                keras.layers.Conv2D(8, 3, padding="same"),
                keras.layers.Flatten(),
                keras.layers.Dense(3),
            ]
        )
        tapehook.binarize(
            model,
            exclude=lambda l: isinstance(l, keras.layers.Dense),
            activations=True,
            scale="mean_abs",
        )
    else:
        model = SubclassedNet()
        tapehook.binarize(
            model, exclude=lambda l: isinstance(l, keras.layers.Dense), activations="swish_sign"
        )
    x = np.random.default_rng(5).normal(0, 1, (16, 9, 9, 2)).astype(np.float32)
    if kind == "subclassed":
        model.build((None, 9, 9, 2))  # where Keras records a subclassed model's input
        model(x[:1])
    _bn_stats(model)
    expected = model.predict(x, verbose=0)
    report = export_tflite(model, tmp_path / "m.tflite")
    assert report["binary_layers"] == 2
    _assert_matches(run_tflite(tmp_path / "m.tflite", x), expected)


@pytest.mark.parametrize("filters", ["bits", "float"])
def test_binary_sum_zero_keeps_sign(filters, tmp_path):
    """A sign right after a binary conv whose integer sum is often exactly 0
    (even fan-in, no bias): the exported file must give +1 there, as tapehook,
    with packed and with float filters (where alpha must stay out of them)."""
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(16, 3, padding="valid", use_bias=False, name="a")(inputs)
    h = keras.layers.Conv2D(8, 1, padding="valid", use_bias=False, name="b")(h)
    model = keras.Model(inputs, h)
    tapehook.binarize(model, activations=True, scale="mean_abs")
    x = _inputs(model, n=64)
    expected = model.predict(x, verbose=0)
    export_tflite(model, tmp_path / "m.tflite", filters=filters)
    np.testing.assert_allclose(run_tflite(tmp_path / "m.tflite", x), expected, rtol=1e-6)


def test_nothing_binary_warns(tmp_path):
    inputs = keras.Input((8, 8, 3))
    model = keras.Model(inputs, keras.layers.Conv2D(4, 3)(inputs))
    x = _inputs(model)
    with pytest.warns(UserWarning, match="no binary layer"):
        report = export_tflite(model, tmp_path / "m.tflite")
    assert report["binary_layers"] == 0 and report["warnings"]
    _assert_matches(run_tflite(tmp_path / "m.tflite", x), model.predict(x, verbose=0))


# ---- SavedModel ----

_LOADER = """
import json, sys
import numpy as np
import tensorflow as tf
loaded = tf.saved_model.load(sys.argv[1])
serve = loaded.signatures["serving_default"]
x = np.load(sys.argv[2])
y = serve(input_0=tf.constant(x))["output_0"].numpy()
np.save(sys.argv[3], y)
print(json.dumps({"tapehook": [m for m in sys.modules if m.startswith("tapehook")]}))
"""


def test_savedmodel_loads_without_tapehook(tmp_path):
    model = residual_model()
    x = _inputs(model)
    report = export_savedmodel(model, tmp_path / "sm")
    assert report["binary_layers"] == 5
    np.save(tmp_path / "x.npy", x)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _LOADER,
            str(tmp_path / "sm"),
            str(tmp_path / "x.npy"),
            str(tmp_path / "y.npy"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"tapehook": []}
    _assert_matches(np.load(tmp_path / "y.npy"), model.predict(x, verbose=0))
    # an earlier SavedModel is replaced whole; a directory of other files is not
    export_savedmodel(digits_model(activations=True), tmp_path / "sm")
    assert tf.saved_model.load(str(tmp_path / "sm")).signatures["serving_default"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(tapehook.TapehookError, match="holding other files"):
        export_savedmodel(model, tmp_path / "other")
    assert [p.name for p in (tmp_path / "other").iterdir()] == ["notes.txt"]


# ---- LCE ----


@pytest.mark.slow
@pytest.mark.timeout(LCE_TIMEOUT)
@pytest.mark.parametrize(
    "make",
    [digits_model, residual_model, dense_depthwise_model],
    ids=["digits", "residual", "dense_depthwise"],
)
def test_lce_round_trip(make, tmp_path):
    model = make(**({"activations": True, "scale": "mean_abs"} if make is digits_model else {}))
    x = _inputs(model)
    expected = model.predict(x, verbose=0)
    report = export_tflite(model, tmp_path / "m.tflite", target="lce")
    convs = [
        l for l, _, _ in tapehook.export.binary_kernels(model) if type(l) is keras.layers.Conv2D
    ]
    ops = flatbuffer.op_counts((tmp_path / "m.tflite").read_bytes())
    assert ops == report["ops"] and ops["LceBconv2d"] == len(convs) > 0
    # the float convs (stem) stay CONV_2D; no binary conv is left as one
    float_convs = [
        l
        for l in model.layers
        if type(l) is keras.layers.Conv2D and tapehook.binary_spec_of(l.kernel) is None
    ]
    assert ops.get("CONV_2D", 0) == len(float_convs)
    others = report["binary_layers"] - len(convs)
    assert sum("no 1-bit op" in w for w in report["warnings"]) == others
    if others == 0:
        assert _stored_bytes(tmp_path / "m.tflite") <= _weights_bytes(model, 24)
    _assert_matches(run_tflite(tmp_path / "m.tflite", x, target="lce"), expected)


@pytest.mark.slow
@pytest.mark.timeout(LCE_TIMEOUT)
def test_lce_bitpacked_chain_and_sign_of_zero(tmp_path):
    """VALID binary convs feeding each other through a sign: LCE writes
    bitpacked activations (thresholds, no float in between), and an integer
    sum of exactly 0 must still give +1."""
    inputs = keras.Input((8, 8, 32))
    h = keras.layers.Conv2D(32, 3, padding="valid", use_bias=False, name="a")(inputs)
    h = keras.layers.Conv2D(32, 3, padding="valid", use_bias=False, name="b")(h)
    h = keras.layers.Conv2D(32, 1, padding="valid", use_bias=False, name="c")(h)
    model = keras.Model(inputs, h)
    tapehook.binarize(model, activations=True, scale="mean_abs")
    x = _inputs(model, n=16)
    expected = model.predict(x, verbose=0)
    report = export_tflite(model, tmp_path / "m.tflite", target="lce")
    assert report["ops"] == {"LceQuantize": 1, "LceBconv2d": 3}
    assert report["warnings"] == []
    # each bconv's filter: one int32 word per 32 input channels per tap
    words = sorted(
        c[3]
        for c in flatbuffer.constants((tmp_path / "m.tflite").read_bytes())
        if c[1] == "INT32" and len(c[2]) == 4
    )
    assert words == sorted(r["kernel_bytes"] - 4 * 32 for r in report["layers"])
    assert words == sorted([32 * 9 * 4, 32 * 9 * 4, 32 * 1 * 4])
    np.testing.assert_allclose(
        run_tflite(tmp_path / "m.tflite", x, target="lce"), expected, rtol=1e-6
    )


@pytest.mark.slow
@pytest.mark.timeout(LCE_TIMEOUT)
def test_lce_refuses_weight_only(tmp_path):
    target = tmp_path / "m.tflite"
    with pytest.raises(tapehook.TapehookError, match="target='litert'"):
        export_tflite(weight_only_model(), target, target="lce")
    assert not target.exists()


# ---- one-padding (pad_value=1.0) and float kernels (weights=False) ----


def one_padding_model():
    """larq's pad_values=1 recipe: SAME binary convs whose x_hat is padded
    with +1, a strided one, and a one-padded binary DepthwiseConv2D."""
    inputs = keras.Input((7, 7, 32))
    h = keras.layers.Conv2D(32, 3, padding="same", use_bias=False, name="a")(inputs)
    h = keras.layers.Conv2D(32, 3, padding="same", use_bias=False, name="b")(h)
    h = keras.layers.Conv2D(32, 3, strides=2, padding="same", use_bias=False, name="c")(h)
    h = keras.layers.DepthwiseConv2D(3, padding="same", name="dw")(h)
    model = keras.Model(inputs, h)
    tapehook.binarize(model, activations=True, scale="mean_abs", pad_value=1.0)
    return model


def _one_padded_reference(layer, x):
    """tf.pad(sign(x), 1) then a VALID conv with alpha sign(W): the math of
    pad_value=1 written out without tapehook or the deploy graph."""
    w = layer.kernel.numpy()
    alpha = np.abs(w.astype(np.float64)).mean(axis=(0, 1, 2)).astype(np.float32)
    padded = tf.pad(
        np.where(x >= 0, 1.0, -1.0).astype(np.float32),
        [(0, 0), (1, 1), (1, 1), (0, 0)],
        constant_values=1.0,
    )
    return (
        tf.nn.conv2d(padded, np.where(w >= 0, 1.0, -1.0).astype(np.float32), 1, "VALID").numpy()
        * alpha
    )


@pytest.mark.slow
@pytest.mark.timeout(LCE_TIMEOUT)
@pytest.mark.parametrize("target", ["litert", "lce"])
def test_one_padding(target, tmp_path):
    model = one_padding_model()
    x = _inputs(model, n=8)
    expected = model.predict(x, verbose=0)
    report = export_tflite(model, tmp_path / "m.tflite", target=target)
    if target == "lce":
        # one-padded binary convs keep activations bitpacked between them
        assert report["ops"]["LceBconv2d"] == 3 and "CONV_2D" not in report["ops"]
    else:
        assert report["ops"]["PADV2"] == 4
    _assert_matches(run_tflite(tmp_path / "m.tflite", x, target=target), expected)
    # the first layer alone against the written-out math
    first = keras.Model(model.inputs, model.get_layer("a").output)
    export_tflite(first, tmp_path / "a.tflite", target=target)
    np.testing.assert_allclose(
        run_tflite(tmp_path / "a.tflite", x, target=target),
        _one_padded_reference(model.get_layer("a"), x),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.slow
@pytest.mark.timeout(LCE_TIMEOUT)
def test_float_kernel_binary_input(tmp_path):
    """weights=False (binary input, float kernel, no alpha): LiteRT exports it,
    checked against the math written out with the layers' weights; LCE has no
    bconv for it and refuses, naming target='litert'."""
    inputs = keras.Input((8, 8, 4))
    first = keras.layers.Conv2D(16, 3, padding="same", name="a")
    second = keras.layers.Conv2D(8, 3, strides=2, padding="valid", name="b")
    model = keras.Model(inputs, second(first(inputs)))
    tapehook.binarize(model, activations=True, weights=False)
    x = _inputs(model)

    def sign(t):
        return np.where(t >= 0, 1.0, -1.0).astype(np.float32)

    h = tf.nn.conv2d(sign(x), first.kernel.numpy(), 1, "SAME") + first.bias.numpy()
    expected = (
        tf.nn.conv2d(sign(h.numpy()), second.kernel.numpy(), 2, "VALID").numpy()
        + second.bias.numpy()
    )
    report = export_tflite(model, tmp_path / "m.tflite")
    assert report["binary_layers"] == 2 and "BITWISE_XOR" not in report["ops"]
    np.testing.assert_allclose(run_tflite(tmp_path / "m.tflite", x), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(tapehook.TapehookError, match="weights=False.*target='litert'"):
        export_tflite(model, tmp_path / "lce.tflite", target="lce")
    assert not (tmp_path / "lce.tflite").exists()


# ---- bad input ----


def test_unbuilt_model():
    model = keras.Sequential([keras.layers.Conv2D(4, 3)])
    with pytest.raises(tapehook.TapehookError, match="not built"):
        export_tflite(model, "/tmp/never.tflite")
    with pytest.raises(tapehook.TapehookError, match="not built"):
        export_savedmodel(model, "/tmp/never_sm")


def test_unwritable_path(tmp_path):
    model = digits_model(activations=True)
    with pytest.raises(tapehook.TapehookError, match="writable"):
        export_tflite(model, tmp_path / "missing" / "m.tflite")
    with pytest.raises(tapehook.TapehookError, match="directory"):
        export_tflite(model, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_unsupported_layer_and_target(tmp_path):
    class MyConv(keras.layers.Conv2D):
        def call(self, inputs):
            return super().call(inputs) * 2.0

    inputs = keras.Input((6, 6, 3))
    model = keras.Model(inputs, MyConv(8, 3, name="mine")(inputs))
    tapehook.binarize(model, activations=True)
    model.predict(_inputs(model), verbose=0)
    with pytest.raises(tapehook.TapehookError, match="'mine'.*overrides call"):
        export_tflite(model, tmp_path / "m.tflite")
    with pytest.raises(tapehook.TapehookError, match="unknown target"):
        export_tflite(model, tmp_path / "m.tflite", target="tflm")
    assert list(tmp_path.iterdir()) == []


def test_no_lce_environment(tmp_path, monkeypatch):
    """No Python 3.11 for the side environment: TapehookError naming the fix,
    nothing at path, an existing file there untouched."""
    monkeypatch.setenv("TAPEHOOK_LCE_ENV", str(tmp_path / "env"))
    monkeypatch.setenv("TAPEHOOK_LCE_PYTHON", str(tmp_path / "no-python3.11"))
    target = tmp_path / "m.tflite"
    target.write_bytes(b"previous")
    with pytest.raises(tapehook.TapehookError, match="TAPEHOOK_LCE_ENV"):
        export_tflite(digits_model(activations=True), target, target="lce")
    assert target.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["m.tflite"]
