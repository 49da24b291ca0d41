"""Accuracy of the kept approx_sign derivative: the digits job
(examples/train_digits.py's model and recipe, 25 epochs) with approx_sign
binary inputs, trained with the default fixed-point e'(x)
(TAPEHOOK_PACK_INPUTS=1) and with float32 x kept (float32), three seeds
each. A run's trajectory diverges from the other setting's after the first
differing rounding, so the settings are compared across seeds, not step by
step (tests/test_pack_fixed16.py compares 4 steps). ~3 min on 2 cores.

    python bench/pack_accuracy.py   # -> bench/results/pack_accuracy.json
"""

import json
import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

import keras  # noqa: E402
import train_digits  # noqa: E402

import tapehook  # noqa: E402


def main():
    data = train_digits.load_data(16)
    out = {}
    for setting in ("1", "float32"):
        os.environ["TAPEHOOK_PACK_INPUTS"] = setting  # read when fit traces the convs
        for seed in (0, 1, 2):
            keras.utils.set_random_seed(seed)
            model = train_digits.build_model(16, binary=False)
            tapehook.binarize(model, first_and_last_float=True, activations="approx_sign")
            history, accuracy = train_digits.train(model, data, 25, 0)
            row = dict(seed=seed, test_accuracy=accuracy, final_loss=history["loss"][-1])
            out.setdefault(setting, []).append(row)
            print(setting, row, flush=True)
    (HERE / "results" / "pack_accuracy.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
