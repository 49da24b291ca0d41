"""tapehook.zoo's shared machinery: larq-zoo's preprocessing, input rules and
the weights= paths (a local file; "imagenet" from a release URL, here a
server on 127.0.0.1, never the internet) with their failure modes."""

import functools
import hashlib
import http.server
import json
import pathlib
import threading

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.legacy.saving import legacy_h5_format

import tapehook
from tapehook import zoo
from tapehook.zoo import _common

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


# ---- preprocess_input against larq-zoo's own (scripts/zoo_preprocess_reference.py) ----


def _reference_images():
    rng = np.random.RandomState(0)  # the script's images, regenerated
    return {
        "wide": rng.randint(0, 256, size=(50, 70, 3)).astype(np.uint8),
        "tall": rng.randint(0, 256, size=(300, 231, 3)).astype(np.uint8),
    }


@pytest.mark.parametrize("name", ["wide", "tall"])
@pytest.mark.parametrize("kind", ["numpy", "tensor", "tf.function"])
def test_preprocess_input_matches_larq_zoo(name, kind):
    expected = np.load(FIXTURES / "zoo_preprocess.npz")[name]
    image = _reference_images()[name]
    if kind == "numpy":
        out = zoo.preprocess_input(image)
        assert isinstance(out, np.ndarray)
    elif kind == "tensor":
        out = zoo.preprocess_input(tf.constant(image)).numpy()
    else:
        out = tf.function(zoo.preprocess_input)(tf.constant(image)).numpy()
    assert out.shape == (224, 224, 3) and out.dtype == np.float32
    np.testing.assert_allclose(out[::4, ::4], expected, rtol=1e-5, atol=1e-4)


def test_preprocess_input_rejects_batches():
    with pytest.raises(tapehook.TapehookError, match="one image"):
        zoo.preprocess_input(np.zeros((2, 32, 32, 3), np.uint8))


def test_training_crop_is_normalized_and_sized():
    # A flat image stays flat through any crop, resize and flip: the output is
    # exactly its normalized colour.
    color = np.array([10, 128, 250], np.uint8)
    flat = tf.constant(np.broadcast_to(color, (120, 90, 3)))
    out = zoo.preprocessing.training_input(flat, size=64, seed=3).numpy()
    expected = (color - np.array(zoo.preprocessing.MEAN_RGB)) / zoo.preprocessing.STDDEV_RGB
    assert out.shape == (64, 64, 3)
    np.testing.assert_allclose(out, np.broadcast_to(expected, out.shape), rtol=1e-5, atol=1e-5)
    # A textured image gives different crops, not always the centre one.
    image = tf.constant(_reference_images()["tall"])
    crops = [zoo.preprocessing.training_input(image, size=64).numpy() for _ in range(4)]
    assert any(not np.allclose(crops[0], c) for c in crops[1:])


# ---- input rules ----


@pytest.mark.parametrize(
    "input_shape, weights, include_top, expected",
    [
        (None, None, True, (224, 224, 3)),
        (None, None, False, (None, None, 3)),
        ((96, 128, 3), None, True, (96, 128, 3)),
        ((96, 128, 3), "imagenet", False, (96, 128, 3)),
        (None, "imagenet", True, (224, 224, 3)),
    ],
)
def test_input_shape_rules(input_shape, weights, include_top, expected):
    assert _common.input_shape_for(input_shape, weights, include_top) == expected


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(input_shape=(96, 96, 3), weights="imagenet", include_top=True), "224, 224, 3"),
        (dict(input_shape=(None, None, 3), weights=None, include_top=True), "fixed input_shape"),
        (dict(input_shape=(8, 8, 3), weights=None, include_top=False), "at least 32"),
        (dict(input_shape=(8, 3), weights=None, include_top=False), "height, width, channels"),
    ],
)
def test_input_shape_errors(kwargs, match):
    with pytest.raises(tapehook.TapehookError, match=match):
        _common.input_shape_for(**kwargs)


def test_model_input_checks_weights_and_classes(tmp_path):
    with pytest.raises(tapehook.TapehookError, match="existing weights file"):
        _common.model_input(None, None, str(tmp_path / "missing.h5"), True, 1000)
    with pytest.raises(tapehook.TapehookError, match="include_top=False"):
        _common.model_input(None, None, "imagenet", True, 10)


# ---- weights= ----


def _tiny(weights=None, files=None, name="tiny"):
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    x = keras.layers.BatchNormalization()(x)
    outputs = _common.global_pool(x)
    return _common.finish(inputs, outputs, name, weights, True, files or {})


def _keras2_h5(path, seed):
    """A Keras-2-layout weights file (what tf-keras's save_weights writes)."""
    model = _tiny()
    rng = np.random.RandomState(seed)
    for w in model.weights:
        w.assign(rng.uniform(0.5, 1.5, w.shape).astype("float32"))
    with h5py.File(path, "w") as f:
        legacy_h5_format.save_weights_to_hdf5_group(f, model)
    return [w.numpy() for w in model.weights]


def test_local_weights_file_loads_by_order(tmp_path):
    path = tmp_path / "w.h5"
    expected = _keras2_h5(path, 1)
    model = _tiny(weights=str(path))
    for w, value in zip(model.weights, expected):
        np.testing.assert_array_equal(w.numpy(), value)


def test_wrong_weights_file_names_the_fix(tmp_path):
    path = tmp_path / "other.h5"
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with h5py.File(path, "w") as f:
        legacy_h5_format.save_weights_to_hdf5_group(f, other)
    with pytest.raises(tapehook.TapehookError, match="does not fit"):
        _tiny(weights=str(path))


class _Server:
    """Serves a folder on 127.0.0.1 and records the paths asked for."""

    def __init__(self, root):
        self.requests = []
        outer = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def do_GET(self):
                outer.requests.append(self.path)
                super().do_GET()

            def log_message(self, *args):
                pass

        handler = functools.partial(Handler, directory=str(root))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(tmp_path, monkeypatch):
    root = tmp_path / "releases"
    root.mkdir()
    srv = _Server(root)
    monkeypatch.setattr(_common, "RELEASES_URL", srv.url)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    srv.root = root
    yield srv
    srv.close()


def _publish(server, seed, model="tiny", version="v1.0", file="tiny_weights.h5"):
    folder = server.root / f"{model}-{version}"
    folder.mkdir(exist_ok=True)
    values = _keras2_h5(folder / file, seed)
    sha = hashlib.sha256((folder / file).read_bytes()).hexdigest()
    return _common.WeightsFile(model, version, file, sha), values


def test_imagenet_downloads_checks_and_caches(server, tmp_path):
    entry, values = _publish(server, 2)
    model = _tiny("imagenet", {"top": entry})
    for w, value in zip(model.weights, values):
        np.testing.assert_array_equal(w.numpy(), value)
    assert server.requests == ["/tiny-v1.0/tiny_weights.h5"]
    cached = tmp_path / "keras_home" / "larq" / "models" / "tiny" / "tiny_weights.h5"
    assert cached.exists()
    server.close()  # offline now: the cached file is used
    again = _tiny("imagenet", {"top": entry})
    np.testing.assert_array_equal(again.weights[0].numpy(), values[0])


def test_imagenet_bad_hash(server, tmp_path):
    entry, _ = _publish(server, 3)
    wrong = _common.WeightsFile(entry.model, entry.version, entry.file, "0" * 64)
    with pytest.raises(tapehook.TapehookError) as info:
        _tiny("imagenet", {"top": wrong})
    assert entry.url in str(info.value) and "weights=" in str(info.value)
    cached = tmp_path / "keras_home" / "larq" / "models" / "tiny" / "tiny_weights.h5"
    assert not cached.exists()


def test_imagenet_offline(server):
    entry, _ = _publish(server, 4)
    server.close()
    with pytest.raises(tapehook.TapehookError) as info:
        _tiny("imagenet", {"top": entry})
    assert entry.url in str(info.value) and "pass its path as weights=" in str(info.value)


def test_imagenet_not_released(server):
    with pytest.raises(tapehook.TapehookError, match="no ImageNet weights"):
        _tiny("imagenet", {})


def _release_table():
    path = FIXTURES / "zoo" / "reference.json"
    if not path.exists():
        return {}
    return json.loads(path.read_text())["models"]


@pytest.mark.parametrize("name", zoo.MODELS)
def test_every_model_asks_larq_zoos_release_url(name, server):
    """weights='imagenet' asks for larq-zoo's own file (release name, version,
    file name from larq-zoo's code, via the fixture), top and headless; here
    the server has none, so the error names that URL."""
    table = _release_table()[name]
    for include_top, key in ((True, "weights_top"), (False, "weights_notop")):
        expected = table.get(key)
        server.requests.clear()
        with pytest.raises(tapehook.TapehookError) as info:
            getattr(zoo, name)(weights="imagenet", include_top=include_top)
        if expected is None:
            assert "no ImageNet weights" in str(info.value)
            assert server.requests == []
        else:
            path = f"/{expected['model']}-{expected['version']}/{expected['file']}"
            assert server.requests == [path]
            assert server.url + path in str(info.value)


@pytest.mark.slow
def test_cost_table_in_the_guide_is_current():
    """docs/guides/zoo.md's cost table is what tapehook.summary counts now."""
    import importlib.util

    path = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "zoo_costs.py"
    spec = importlib.util.spec_from_file_location("zoo_costs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--check"])
