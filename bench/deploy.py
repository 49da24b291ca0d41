"""Deployed inference at batch 1: LCE's interpreter on the binary model vs
LiteRT on the same architecture in float, plus tapehook's LiteRT export of
the binary model (stock ops, 1-bit weights unpacked at run time), and the LCE
file in LiteRT's interpreter with LCE's ops on tapehook's kernels
(tapehook.lite); file sizes.

    python bench/deploy.py            # ~2-4 min (the first LCE export builds its env)
    python bench/deploy.py --quick
    python bench/deploy.py --zoo QuickNetSmall,BiRealNet --size 224

With --zoo, the models are tapehook.zoo's (random weights) and the float row
is each model's float twin: the same layers with their quantizers removed.

The model is a BNN of the usual shape (float stem and head, six binary 3x3
convs with BatchNorm, scale="mean_abs", pad_value=1 as larq's models use,
two stride-2 stages). Weights are random:
latency and size do not depend on training. Each interpreter runs one thread
(tapehook.lite also two, for its scaling);
the median of N invokes is reported. Results: bench/results/deploy.json and a
table on stdout (and in --notes, a markdown file).
"""

import argparse
import json
import os
import pathlib
import sys
import tempfile
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from run import cpu_model  # noqa: E402  (bench/ is on sys.path)

import tapehook  # noqa: E402
from tapehook.deploy import export_tflite, run_tflite  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def build(size, width, binary):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((size, size, 3))
    h = keras.layers.Conv2D(width, 3, padding="same", use_bias=False, name="stem")(inputs)
    h = keras.layers.BatchNormalization()(h)
    channels = width
    for stage in range(3):
        for block in range(2):
            stride = 2 if block == 0 and stage > 0 else 1
            if stride == 2:
                channels *= 2
            h = keras.layers.Conv2D(
                channels, 3, strides=stride, padding="same", use_bias=False, name=f"b{stage}{block}"
            )(h)
            h = keras.layers.BatchNormalization()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inputs, keras.layers.Dense(10, name="head")(h))
    if binary:
        tapehook.binarize(
            model, first_and_last_float=True, activations=True, scale="mean_abs", pad_value=1.0
        )
    return model


def float_twin(model):
    """model with each tapehook.larq layer as its stock Keras base layer
    (quantizers dropped), the same shapes and padding."""
    import inspect

    from tapehook.larq import layers as lq_layers

    def clone(layer):
        if not isinstance(layer, tuple(getattr(lq_layers, n) for n in lq_layers.__all__)):
            return layer.__class__.from_config(layer.get_config())
        base = next(c for c in type(layer).__mro__ if c.__module__.startswith("keras."))
        accepted = set(inspect.signature(base.__init__).parameters) | {"name", "dtype"}
        config = {k: v for k, v in layer.get_config().items() if k in accepted}
        return base.from_config(config)

    return keras.models.clone_model(model, clone_function=clone)


def time_lite(path, x, repeats, threads=1):
    """(outputs of x, median seconds of one batch-1 invoke) in tapehook.lite."""
    import timeit

    from tapehook import lite

    interpreter = lite.Interpreter(path, num_threads=threads)
    detail = interpreter.get_input_details()[0]
    out = interpreter.get_output_details()[0]["index"]
    interpreter.allocate_tensors()
    outputs = []
    for sample in x:
        interpreter.set_tensor(detail["index"], sample[None])
        interpreter.invoke()
        outputs.append(interpreter.get_tensor(out)[0])
    interpreter.set_tensor(detail["index"], x[:1])
    times = timeit.repeat(interpreter.invoke, number=1, repeat=repeats + 3)[3:]
    return np.stack(outputs), float(np.median(times))


def measure(name, binary, floating, x, repeats, scratch):
    """Rows of one model: LiteRT float, tapehook's LiteRT binary (small models
    only; with float filters always), LCE's interpreter and tapehook.lite on
    the LCE file."""
    rows, files = [], {}
    runs = [("LiteRT float", floating, "litert", "litert", "bits")]
    if name is None:
        runs.append(("LiteRT binary (tapehook, stock ops)", binary, "litert", "litert", "bits"))
    runs += [
        ("LiteRT binary, filters='float' (XNNPACK)", binary, "litert", "litert", "float"),
        ("LCE binary (LceBconv2d), LCE's interpreter", binary, "lce", "lce", "bits"),
        ("LCE binary, tapehook.lite (tapehook kernels)", binary, "lce", "lite", "bits"),
        ("LCE binary, tapehook.lite, 2 threads", binary, "lce", "lite2", "bits"),
    ]
    lce_outputs = None
    for label, model, target, runner, filters in runs:
        key = (id(model), target, filters)
        if key not in files:
            path = pathlib.Path(scratch) / f"{len(files)}.tflite"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the float model has no binary layer
                files[key] = (path, export_tflite(model, path, target=target, filters=filters))
        path, report = files[key]
        if runner in ("lite", "lite2"):
            outputs, seconds = time_lite(path, x, repeats, threads=2 if runner == "lite2" else 1)
        else:
            outputs, seconds = run_tflite(path, x, target=target, time_repeats=repeats)
        if runner == "lce":
            lce_outputs = outputs
        expected = model.predict(x, verbose=0)
        rows.append(
            {
                "model": name or "small BNN",
                "name": label,
                "target": target,
                "bytes": report["bytes"],
                "binary_layers": report["binary_layers"],
                "bconv": report["ops"].get("LceBconv2d", 0),
                "ms_batch1": 1e3 * seconds,
                "max_abs_diff_vs_predict": float(np.abs(outputs - expected).max()),
                "max_abs_diff_vs_lce": (
                    float(np.abs(outputs - lce_outputs).max())
                    if runner in ("lite", "lite2")
                    else None
                ),
            }
        )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default=str(RESULTS / "deploy.json"))
    parser.add_argument("--notes", default=None, help="also write the table here (markdown)")
    parser.add_argument(
        "--zoo", default=None, help="comma-separated tapehook.zoo models instead (e.g. 224 px)"
    )
    args = parser.parse_args(argv)
    repeats = 10 if args.quick else args.repeats

    x = np.random.default_rng(0).normal(0, 1, (2, args.size, args.size, 3)).astype(np.float32)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        if args.zoo:
            from tapehook import zoo

            for name in args.zoo.split(","):
                keras.utils.set_random_seed(0)
                binary = getattr(zoo, name)(input_shape=(args.size, args.size, 3))
                rows += measure(name, binary, float_twin(binary), x, repeats, scratch)
        else:
            binary = build(args.size, args.width, True)
            floating = build(args.size, args.width, False)
            rows += measure(None, binary, floating, x, repeats, scratch)
    from tapehook import lite

    result = {
        # The tier tapehook.lite's kernels ran on (avx512, avx2, portable).
        "machine": f"{cpu_model()}, tapehook.lite on {lite.kernel_impl()}",
        "python": sys.version,
        "size": args.size,
        "width": None if args.zoo else args.width,
        "repeats": repeats,
        "threads": "1 (tapehook.lite: 1 and 2)",
        "rows": rows,
    }
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"Batch-1 inference, {args.size}x{args.size}x3 input, one thread, median of "
        f"{repeats} (bench/deploy.py):",
        "",
        "| model | file | size | ms / image | vs LiteRT float | max diff vs predict |",
        "|---|---|---|---|---|---|",
    ]
    base = {}
    for r in rows:
        base.setdefault(r["model"], r["ms_batch1"])
        lines.append(
            f"| {r['model']} | {r['name']} | {r['bytes'] / 1024:.1f} KiB | "
            f"{r['ms_batch1']:.3f} | {base[r['model']] / r['ms_batch1']:.2f}x | "
            f"{r['max_abs_diff_vs_predict']:.1e} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.notes:
        pathlib.Path(args.notes).write_text(table + "\n")


if __name__ == "__main__":
    main()
