"""Runs inside the LCE side environment (TF 2.16.1 + larq-compute-engine 0.16),
never in tapehook's own process, and imports nothing from tapehook.

    python lce_worker.py check
    python lce_worker.py convert SAVED_MODEL_DIR OUT.tflite
    python lce_worker.py run MODEL.tflite INPUTS.npz OUTPUTS.npz [--time N]

``run`` feeds the arrays of INPUTS.npz (x0, x1, ... with a batch axis) to
LCE's interpreter one sample at a time and writes y0, y1, ... (and, with
--time N, the median seconds of N batch-1 invokes as "seconds").
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def check():
    import larq_compute_engine as lce
    import tensorflow as tf

    print(f"tensorflow {tf.__version__} larq-compute-engine {lce.__version__}")


def convert(saved_model_dir, out_path):
    import larq_compute_engine as lce

    # "arm" (LCE's default) is the target whose converter also accepts
    # zero-padded SAME binary convolutions; its files run on x86 too.
    flatbuffer = lce.convert_saved_model(saved_model_dir, target="arm")
    with open(out_path, "wb") as f:
        f.write(flatbuffer)


def run(model_path, inputs_path, outputs_path, repeats=0):
    import numpy as np
    from larq_compute_engine.tflite.python.interpreter import Interpreter

    with open(model_path, "rb") as f:
        interpreter = Interpreter(f.read(), num_threads=1)
    with np.load(inputs_path) as data:
        inputs = [data[f"x{i}"] for i in range(len(data.files))]
    outputs = interpreter.predict(inputs if len(inputs) > 1 else inputs[0])
    outputs = outputs if isinstance(outputs, list) else [outputs]
    result = {f"y{i}": y for i, y in enumerate(outputs)}
    if repeats:
        sample = [x[:1] for x in inputs]
        one = sample if len(sample) > 1 else sample[0]
        for _ in range(3):
            interpreter.predict(one)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            interpreter.predict(one)
            times.append(time.perf_counter() - start)
        result["seconds"] = np.median(times)
    np.savez(outputs_path, **result)


def main(argv):
    command, args = argv[0], argv[1:]
    if command == "check":
        check()
    elif command == "convert":
        convert(*args)
    elif command == "run":
        repeats = 0
        if "--time" in args:
            i = args.index("--time")
            repeats = int(args[i + 1])
            args = args[:i] + args[i + 2 :]
        run(*args, repeats=repeats)
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
