"""Deployed inference at batch 1: LCE's interpreter on the binary model vs
LiteRT on the same architecture in float, plus tapehook's LiteRT export of
the binary model (stock ops, 1-bit weights unpacked at run time); file sizes.

    python bench/deploy.py            # ~2-4 min (the first LCE export builds its env)
    python bench/deploy.py --quick

The model is a BNN of the usual shape (float stem and head, six binary 3x3
convs with BatchNorm, scale="mean_abs", pad_value=1 as larq's models use,
two stride-2 stages). Weights are random:
latency and size do not depend on training. Each interpreter runs one thread;
the median of N invokes is reported. Results: bench/results/deploy.json and a
table on stdout (and in --notes, a markdown file).
"""

import argparse
import json
import os
import pathlib
import platform
import sys
import tempfile
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default=str(RESULTS / "deploy.json"))
    parser.add_argument("--notes", default=None, help="also write the table here (markdown)")
    args = parser.parse_args(argv)
    repeats = 10 if args.quick else args.repeats

    x = np.random.default_rng(0).normal(0, 1, (4, args.size, args.size, 3)).astype(np.float32)
    binary, floating = build(args.size, args.width, True), build(args.size, args.width, False)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name, model, target in (
            ("LiteRT float", floating, "litert"),
            ("LiteRT binary (tapehook, stock ops)", binary, "litert"),
            ("LCE binary (LceBconv2d)", binary, "lce"),
        ):
            path = pathlib.Path(scratch) / f"{len(rows)}.tflite"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the float model has no binary layer
                report = export_tflite(model, path, target=target)
            outputs, seconds = run_tflite(path, x, target=target, time_repeats=repeats)
            expected = model.predict(x, verbose=0)
            rows.append(
                {
                    "name": name,
                    "target": target,
                    "bytes": report["bytes"],
                    "binary_layers": report["binary_layers"],
                    "bconv": report["ops"].get("LceBconv2d", 0),
                    "ms_batch1": 1e3 * seconds,
                    "max_abs_diff_vs_predict": float(np.abs(outputs - expected).max()),
                }
            )
    base = rows[0]["ms_batch1"]
    result = {
        "machine": platform.processor() or platform.machine(),
        "python": sys.version,
        "size": args.size,
        "width": args.width,
        "repeats": repeats,
        "threads": 1,
        "rows": rows,
    }
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"Batch-1 inference, {args.size}x{args.size}x3 input, width {args.width}, "
        f"one thread, median of {repeats} (bench/deploy.py):",
        "",
        "| file | size | ms / image | vs LiteRT float | max diff vs predict |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['bytes'] / 1024:.1f} KiB | {r['ms_batch1']:.3f} | "
            f"{base / r['ms_batch1']:.2f}x | {r['max_abs_diff_vs_predict']:.1e} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.notes:
        pathlib.Path(args.notes).write_text(table + "\n")


if __name__ == "__main__":
    main()
