"""Reference material for tapehook.zoo, made with larq-zoo 2.4 itself.

Runs in a side environment with Keras 2 (TF_USE_LEGACY_KERAS=1):

    python3 -m venv /tmp/larqenv
    /tmp/larqenv/bin/pip install tensorflow-cpu==2.21.0 tf-keras==2.21.0 \
        larq==0.14.0 larq-zoo==2.4.0
    TF_USE_LEGACY_KERAS=1 /tmp/larqenv/bin/python scripts/zoo_reference.py MODE

Modes:

- ``describe [--out DIR]``: for every model at 224 px (top, 1000 classes),
  DIR/<Model>/config.json, layers.txt (one line per layer: shapes, weights,
  quantizers) and summary.json (parameter counts, headless output shape).
- ``fixtures [--out tests/fixtures/zoo]``: the committed fixtures that
  tests/test_zoo_reference.py compares tapehook.zoo against. For each model
  and variant (top / headless): the skeleton of the h5 file tf-keras's
  ``save_weights`` writes (groups, attributes, dataset names / shapes / dtypes;
  the datasets' values come from tests/helpers/zoo_h5.py's generator), the
  input and larq-zoo's outputs with those weights. Every fixture's h5 file is
  rebuilt from its skeleton and checked against the file tf-keras wrote, and
  larq-zoo loads the rebuilt file to reproduce the recorded outputs, so the
  skeleton stands in honestly for a larq-zoo weights file.
- ``reference [--out tests/fixtures/zoo]``: reference.json, each model's
  parameter counts and output shapes at 224 px and the release files larq-zoo
  downloads for ``weights="imagenet"``.

``--models`` limits any mode to some of larq-zoo's models.
"""

import argparse
import gzip
import json
import os
import pathlib
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

# Layer config keys that decide what a quantized layer computes.
QUANT_KEYS = (
    "input_quantizer",
    "kernel_quantizer",
    "depthwise_quantizer",
    "kernel_constraint",
    "depthwise_constraint",
    "pad_values",
    "padding",
    "strides",
    "dilation_rate",
    "use_bias",
    "groups",
    "activation",
    "metrics",
)


def zoo_models():
    """larq-zoo's models by name: what its sota and literature modules export."""
    import larq_zoo

    return {
        name: getattr(module, name)
        for module in (larq_zoo.sota, larq_zoo.literature)
        for name in module.__all__
    }


def zoo_model(name):
    return zoo_models()[name]


def build(name, *, input_shape=(224, 224, 3), include_top=True, num_classes=1000, weights=None):
    import tensorflow as tf

    tf.keras.backend.clear_session()
    return zoo_model(name)(
        input_shape=input_shape, weights=weights, include_top=include_top, num_classes=num_classes
    )


def short(value):
    """A quantizer / constraint config as a short string."""
    if isinstance(value, dict) and "class_name" in value:
        inner = value.get("config") or {}
        if isinstance(inner, dict):
            inner = {k: v for k, v in inner.items() if k != "name"}
        return (
            f"{value['class_name']}{json.dumps(inner, sort_keys=True)}"
            if inner
            else value["class_name"]
        )
    return json.dumps(value)


def layer_line(index, layer):
    try:
        shape = layer.output_shape
    except AttributeError:
        shape = "?"
    weights = layer.weights
    parts = [
        f"{index}",
        layer.name,
        type(layer).__name__,
        f"out={shape}",
        f"n_weights={len(weights)}",
        "weights=[" + ", ".join(f"{w.name.split('/')[-1]}{tuple(w.shape)}" for w in weights) + "]",
    ]
    config = layer.get_config()
    for key in QUANT_KEYS:
        if key in config and (
            "quantizer" in key
            or "constraint" in key
            or key == "pad_values"
            or type(layer).__name__.startswith("Quant")
        ):
            parts.append(f"{key}={short(config[key])}")
    if type(layer).__name__ in ("BatchNormalization",):
        parts.append(
            f"epsilon={config['epsilon']} momentum={config['momentum']} scale={config['scale']} center={config['center']}"
        )
    if "Pooling" in type(layer).__name__ and "pool_size" in config:
        parts.append(
            f"pool_size={config['pool_size']} strides={config['strides']} padding={config['padding']}"
        )
    if type(layer).__name__ in ("Activation", "Dense", "Conv2D", "DepthwiseConv2D"):
        parts.append(f"activation={config.get('activation')}")
    return " | ".join(parts)


def param_counts(model):
    trainable = int(sum(np.prod(w.shape) for w in model.trainable_weights))
    non_trainable = int(sum(np.prod(w.shape) for w in model.non_trainable_weights))
    return {
        "total": trainable + non_trainable,
        "trainable": trainable,
        "non_trainable": non_trainable,
    }


def describe(out, names):
    out = pathlib.Path(out)
    for name in names:
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        model = build(name)
        (d / "config.json").write_text(json.dumps(model.get_config(), indent=1, default=str))
        (d / "layers.txt").write_text(
            "\n".join(layer_line(i, layer) for i, layer in enumerate(model.layers)) + "\n"
        )
        counts = param_counts(model)
        output_shape = list(model.output_shape)
        headless = build(name, include_top=False)
        summary = {
            "params_224_top_1000": counts,
            "top_output_shape": output_shape,
            "headless_output_shape_224": list(headless.output_shape),
            "headless_params_224": param_counts(headless),
            "n_layers": len(model.layers),
        }
        (d / "summary.json").write_text(json.dumps(summary, indent=1))
        print(name, summary, flush=True)
    (out / "READY").write_text("describe done\n")


# Smallest image size each model runs at (XNOR-Net's 6x6 "fc" conv needs
# 224 px); 64 px still leaves 2x2 features for the pooled head.
FIXTURE_SIZE = {"XNORNet": 224}
DEFAULT_FIXTURE_SIZE = 64
FIXTURE_VARIANTS = {
    "top": dict(include_top=True, num_classes=10),
    "notop": dict(include_top=False, num_classes=10),
}
# The top with ImageNet's 1000 classes where its classifier is part of the
# binary body (a binary 1x1 conv and batch norm).
EXTRA_VARIANTS = {"BinaryAlexNet": {"top1000": dict(include_top=True, num_classes=1000)}}
WEIGHTS_SEED = 46
INPUT_SEED = 1
BATCH = 2


def fixture_input(size):
    return (
        np.random.RandomState(INPUT_SEED).standard_normal((BATCH, size, size, 3)).astype("float32")
    )


def fixture(name, variant, out, tmp):
    """One model / variant's skeleton and outputs, checked as the module
    docstring says; returns (entry for <Model>.json, outputs)."""
    import tensorflow as tf
    import zoo_h5

    size = FIXTURE_SIZE.get(name, DEFAULT_FIXTURE_SIZE)
    variants = FIXTURE_VARIANTS | EXTRA_VARIANTS.get(name, {})
    kwargs = dict(input_shape=(size, size, 3), **variants[variant])
    model = build(name, **kwargs)
    first = tmp / f"{name}_{variant}_init.h5"
    model.save_weights(str(first))
    skeleton = zoo_h5.skeleton_of(first)
    x = fixture_input(size)

    def assign(scales):
        values = zoo_h5.weight_values(skeleton, WEIGHTS_SEED, scales)
        # By name, not by position, so that the file tf-keras writes back
        # checks the generator's order against tf-keras's own.
        for layer in model.layers:
            for w in layer.weights:
                w.assign(values.pop(f"{layer.name}/{w.name}"))
        assert not values, f"{name}: weights in the file but not the model: {list(values)[:5]}"

    scales = {}
    assign(scales)
    if kwargs["include_top"]:
        # Logits of spread ~2: the softmax then tells classes apart without
        # saturating. The classifier's last kernel or variance scales them.
        logits = tf.keras.Model(model.input, model.layers[-2].output).predict(x, verbose=0)
        spread = float(np.std(logits))
        last = [
            p
            for p in zoo_h5.weight_order(skeleton)
            if p.endswith(("/kernel:0", "/moving_variance:0"))
        ][-1]
        target = 2.0 / spread
        scales = {last: target if last.endswith("kernel:0") else 1.0 / target**2}
        assign(scales)
    written = tmp / f"{name}_{variant}_written.h5"
    model.save_weights(str(written))
    rebuilt = zoo_h5.write_h5(skeleton, tmp / f"{name}_{variant}_rebuilt.h5", WEIGHTS_SEED, scales)
    diff = zoo_h5.differences(written, rebuilt)
    assert not diff, f"{name} {variant}: the rebuilt file differs from tf-keras's: {diff[:5]}"
    expected = model.predict(x, batch_size=BATCH, verbose=0)
    loaded = build(name, weights=str(rebuilt), **kwargs)
    again = loaded.predict(x, batch_size=BATCH, verbose=0)
    assert np.array_equal(again, expected), (
        f"{name} {variant}: the rebuilt file gives other outputs"
    )
    graph = tf.function(lambda t: loaded(t, training=False))(tf.constant(x)).numpy()
    entry = {
        "input_shape": list(kwargs["input_shape"]),
        "include_top": kwargs["include_top"],
        "num_classes": kwargs["num_classes"],
        "output_shape": list(expected.shape),
        "predict_vs_tf_function_max_abs": float(np.max(np.abs(graph - expected))),
        "scales": scales,
        "skeleton": skeleton,
    }
    return entry, expected.astype("float32")


def fixtures(out, names):
    import tempfile

    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    outputs_path = out / "outputs.npz"
    outputs = dict(np.load(outputs_path)) if outputs_path.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            entry = {
                "model": name,
                "larq_zoo": f"{zoo_model(name).__module__}.{name}",
                "weights_seed": WEIGHTS_SEED,
                "input": {
                    "rule": "np.random.RandomState(seed).standard_normal((batch, size, size, 3)).astype('float32')",
                    "seed": INPUT_SEED,
                    "batch": BATCH,
                    "size": FIXTURE_SIZE.get(name, DEFAULT_FIXTURE_SIZE),
                },
                "variants": {},
            }
            for variant in FIXTURE_VARIANTS | EXTRA_VARIANTS.get(name, {}):
                entry["variants"][variant], outputs[f"{name}/{variant}"] = fixture(
                    name, variant, out, pathlib.Path(tmp)
                )
                y = outputs[f"{name}/{variant}"]
                print(
                    name,
                    variant,
                    y.shape,
                    "max",
                    float(y.max()),
                    "mean|y|",
                    float(np.abs(y).mean()),
                    flush=True,
                )
                for f in pathlib.Path(tmp).iterdir():
                    f.unlink()
            # Gzipped: the skeletons repeat every layer's name many times.
            with gzip.GzipFile(out / f"{name}.json.gz", "wb", mtime=0) as f:
                f.write((json.dumps(entry, indent=0) + "\n").encode())
            np.savez_compressed(outputs_path, **outputs)


def reference(out, names):
    """reference.json: 224 px parameter counts and headless shapes, and
    larq-zoo's release files, found by building each model with
    weights="imagenet" while recording what it asks to download (nothing is
    downloaded or loaded)."""
    import larq_zoo.core.utils
    import tensorflow as tf

    requested = []

    def record(model, version, file, file_hash, cache_dir=None):
        requested.append({"model": model, "version": version, "file": file, "sha256": file_hash})
        return "(not downloaded)"

    larq_zoo.core.utils.download_pretrained_model = record
    tf.keras.Model.load_weights = lambda self, path, *args, **kwargs: None
    models = {}
    for name in names:
        entry = {}
        for key, include_top in (("top", True), ("notop", False)):
            requested.clear()
            tf.keras.backend.clear_session()
            try:
                model = zoo_model(name)(
                    input_shape=(224, 224, 3), weights="imagenet", include_top=include_top
                )
            except Exception as e:  # noqa: BLE001 - recorded: larq-zoo released no file
                entry[f"weights_{key}"] = None
                entry[f"weights_{key}_error"] = f"{type(e).__name__}: {e}"
                model = build(name, include_top=include_top)
            else:
                assert len(requested) == 1, requested
                entry[f"weights_{key}"] = dict(requested[0])
            shape = list(model.output_shape)
            if include_top:
                entry["params_224"] = param_counts(model)
                entry["top_output_shape_224"] = shape
            else:
                entry["headless_output_shape_224"] = shape
                entry["headless_params_224"] = param_counts(model)
                tf.keras.backend.clear_session()
                try:
                    any_size = build(name, input_shape=None, include_top=False)
                except ValueError as e:
                    entry["headless_output_shape_any_size"] = f"ValueError: {e}"
                else:
                    entry["headless_output_shape_any_size"] = list(any_size.output_shape)
        models[name] = entry
        print(name, json.dumps(entry), flush=True)
    path = pathlib.Path(out) / "reference.json"
    document = {
        "about": "larq-zoo 2.4.0 (tf-keras 2.21, larq 0.14), made by scripts/zoo_reference.py "
        "reference: params_224 at 224 px with the top and 1000 classes; "
        "headless_output_shape_224 with include_top=False at 224 px, "
        "headless_output_shape_any_size with no input_shape; weights_top / "
        "weights_notop: the release file larq-zoo downloads for weights='imagenet' "
        "({RELEASES}/{model}-{version}/{file}), null where it has none",
        "releases_url": "https://github.com/larq/zoo/releases/download",
        "models": models,
    }
    path.write_text(json.dumps(document, indent=1) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["describe", "fixtures", "reference"])
    parser.add_argument("--out")
    parser.add_argument("--models", nargs="*", help="larq-zoo model names (default: all)")
    args = parser.parse_args()
    args.models = args.models or list(zoo_models())
    if args.mode == "describe":
        describe(args.out or "/tmp/zoo_ref", args.models)
    elif args.mode == "reference":
        reference(args.out or ROOT / "tests" / "fixtures" / "zoo", args.models)
    else:
        fixtures(args.out or ROOT / "tests" / "fixtures" / "zoo", args.models)


if __name__ == "__main__":
    main()
