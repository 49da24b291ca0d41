"""tapehook.zoo against larq-zoo 2.4 itself.

For each of larq-zoo's 14 models, tests/fixtures/zoo/ holds what
scripts/zoo_reference.py recorded in tf-keras with larq-zoo: the skeleton of
the weights file tf-keras wrote (its values come from the seeded generator
in tests/helpers/zoo_h5.py, so the rebuilt file equals that file; the script
checks it), and larq-zoo's outputs on a seeded input with those weights. Here
tapehook.zoo loads the rebuilt file, as it would a larq-zoo release file, and
must give the same outputs in ``predict`` and in a ``tf.function``; its 224 px
parameter counts and headless output shapes must be larq-zoo's.
"""

import dataclasses
import gzip
import importlib
import json
import pathlib

import numpy as np
import pytest
import tensorflow as tf

from tapehook.zoo import _common

from helpers import zoo_h5

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "zoo"
REFERENCE = json.loads((FIXTURES / "reference.json").read_text())["models"]

MODULES = {
    "QuickNetSmall": "quicknet",
    "QuickNet": "quicknet",
    "QuickNetLarge": "quicknet",
    "BiRealNet": "resnets",
    "RealToBinaryNet": "resnets",
    "BinaryResNetE18": "resnets",
    "BinaryDenseNet28": "densenets",
    "BinaryDenseNet37": "densenets",
    "BinaryDenseNet37Dilated": "densenets",
    "BinaryDenseNet45": "densenets",
    "MeliusNet22": "densenets",
    "XNORNet": "classic",
    "DoReFaNet": "classic",
    "BinaryAlexNet": "classic",
}

# One model of each module runs in the fast suite; the others are slow.
FAST = {"QuickNet", "BiRealNet", "BinaryDenseNet28", "BinaryAlexNet"}

# Softmax probabilities and headless features, relative to the largest
# expected magnitude: float rounding, and no binary sign decided differently.
TOLERANCE = {"top": 1e-4, "top1000": 1e-4, "notop": 1e-3}


def zoo_function(name):
    return getattr(importlib.import_module(f"tapehook.zoo.{MODULES[name]}"), name)


def fixture_of(name):
    with gzip.open(FIXTURES / f"{name}.json.gz", "rt") as f:
        return json.load(f)


def fixture_input(spec):
    size = spec["size"]
    rng = np.random.RandomState(spec["seed"])
    return rng.standard_normal((spec["batch"], size, size, 3)).astype("float32")


def assert_matches(actual, expected, tolerance, what):
    actual = np.asarray(actual)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = max(1.0, float(np.max(np.abs(expected))))
    error = float(np.max(np.abs(actual - expected)))
    assert error <= tolerance * scale, (
        f"{what}: max |tapehook.zoo - larq-zoo| = {error:.3g} (largest |output| {scale:.3g}, "
        f"tolerance {tolerance} of it)"
    )
    return error / scale


@pytest.fixture(scope="module")
def outputs():
    with np.load(FIXTURES / "outputs.npz") as f:
        return dict(f)


def fixture_cases():
    for name in MODULES:
        for variant in fixture_of(name)["variants"]:
            marks = () if name in FAST else (pytest.mark.slow,)
            yield pytest.param(name, variant, marks=marks, id=f"{name}-{variant}")


@pytest.mark.parametrize("name, variant", fixture_cases())
def test_outputs_match_larq_zoo(name, variant, outputs, tmp_path):
    build = zoo_function(name)
    fixture = fixture_of(name)
    spec = fixture["variants"][variant]
    weights = zoo_h5.write_h5(
        spec["skeleton"], tmp_path / f"{name}_{variant}.h5", fixture["weights_seed"], spec["scales"]
    )
    model = build(
        input_shape=tuple(spec["input_shape"]),
        include_top=spec["include_top"],
        num_classes=spec["num_classes"],
        weights=str(weights),
    )
    weights.unlink()  # XNOR-Net's is hundreds of MB
    x = fixture_input(fixture["input"])
    expected = outputs[f"{name}/{variant}"]
    tolerance = TOLERANCE[variant]
    predicted = model.predict(x, batch_size=len(x), verbose=0)
    error = assert_matches(predicted, expected, tolerance, f"{name} {variant} predict")
    graph = tf.function(lambda t: model(t, training=False))(tf.constant(x))
    error_graph = assert_matches(graph, expected, tolerance, f"{name} {variant} tf.function")
    print(
        f"{name} {variant}: relative max error predict {error:.2e}, tf.function {error_graph:.2e}"
    )


def param_counts(model):
    trainable = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    non_trainable = sum(int(np.prod(w.shape)) for w in model.non_trainable_weights)
    return {
        "total": trainable + non_trainable,
        "trainable": trainable,
        "non_trainable": non_trainable,
    }


@pytest.mark.parametrize("name", list(MODULES))
def test_224_px_models_and_release_files_match_larq_zoo(name, monkeypatch):
    """Built with weights="imagenet" as larq-zoo's users do, recording the
    release file instead of fetching and loading it."""
    build = zoo_function(name)
    reference = REFERENCE[name]
    requested = []

    def record(entry):
        requested.append(entry)
        return "(not downloaded)"

    monkeypatch.setattr(_common, "download", record)
    monkeypatch.setattr(_common, "load_weights", lambda model, path: None)
    for include_top, key in ((True, "top"), (False, "notop")):
        requested.clear()
        model = build(input_shape=(224, 224, 3), include_top=include_top, weights="imagenet")
        if include_top:
            assert param_counts(model) == reference["params_224"]
            assert list(model.output.shape) == reference["top_output_shape_224"]
        else:
            assert param_counts(model) == reference["headless_params_224"]
            assert list(model.output.shape) == reference["headless_output_shape_224"]
        [entry] = requested
        assert dataclasses.asdict(entry) == reference[f"weights_{key}"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODULES))
def test_headless_without_input_shape_matches_larq_zoo(name):
    model = zoo_function(name)(include_top=False, weights=None)
    assert list(model.output.shape) == REFERENCE[name]["headless_output_shape_any_size"]
