"""ReActNet's recipe, piece by piece, on scikit-learn's digits (no download).

A float teacher (four ReLU convs) is trained first. Then a binary student,
ReActNet-style: a float stem conv, four residual blocks of one binary 3x3
conv each (x + BN(conv(sign(x)))), average pooling after the second, global
average pooling and a float classifier. Each variant adds pieces to the
plain binary network:

- ``baseline``: the conv's own ste_sign on its input, no RPReLU, trained on
  the labels in one stage, fully binary from the start;
- ``rsign``: RSign in front of each binary conv, RPReLU after each block;
- ``distill``: trained by ``Distiller`` on ReActNet's ``DistributionLoss``
  against the teacher's logits alone (no label loss);
- ``two_stage``: binary activations with float weights first, then fully
  binary from stage 1's weights, each stage half of the epochs;
- ``balanced``: IR-Net's balanced weights (``balance="std"``);
- ``reactnet``: rsign, distill and two_stage; ``reactnet-<piece>``: those
  three but one; ``reactnet+balanced``: all four.

Every variant trains for the same number of epochs (Adam, cosine decay) on
the same split; only the seed of initialization and shuffling changes.
Prints a Markdown table of test accuracy over the seeds and the binary
kernel runs of each variant's last stage (proof that the binary convs ran on
tapehook's kernels).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tapehook  # noqa: E402
from tapehook import distill, recipes  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_digits import load_data  # noqa: E402

BATCH = 64
PIECES = ("rsign", "distill", "two_stage")  # ReActNet's
VARIANTS = {
    "baseline": (),
    **{piece: (piece,) for piece in (*PIECES, "balanced")},
    "reactnet": PIECES,
    **{f"reactnet-{piece}": tuple(p for p in PIECES if p != piece) for piece in PIECES},
    "reactnet+balanced": (*PIECES, "balanced"),
}


def build_teacher(size, width):
    inputs = keras.Input((size, size, 1))
    x = inputs
    for i in range(4):
        if i == 2:
            x = keras.layers.MaxPooling2D()(x)
        x = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(x)
        x = keras.layers.BatchNormalization(momentum=0.9)(x)
        x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x), name="teacher")


def build_student(size, width, react):
    """``react``: RSign before each binary conv and RPReLU after each block
    (ReActNet); otherwise the binary conv's own sign and no activation."""
    inputs = keras.Input((size, size, 1))
    x = keras.layers.Conv2D(width, 3, padding="same", use_bias=False, name="stem")(inputs)
    x = keras.layers.BatchNormalization(momentum=0.9)(x)
    for i in range(4):
        if i == 2:
            x = keras.layers.AveragePooling2D(2)(x)
        y = recipes.RSign()(x) if react else x
        y = keras.layers.Conv2D(width, 3, padding="same", use_bias=False, name=f"binary{i}")(y)
        y = keras.layers.BatchNormalization(momentum=0.9)(y)
        x = keras.layers.Add()([x, y])
        if react:
            x = recipes.RPReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(x), name="student")


def held_out_accuracy(model, data):
    _, x_test, _, y_test = data
    return float(np.mean(np.argmax(model(x_test, training=False), -1) == y_test))


def fit(model, data, epochs, lr, teacher=None):
    """Adam on a cosine schedule; with a teacher, through a Distiller on
    ReActNet's distribution loss alone (alpha 0: the labels only reach the
    student through the teacher). Compiling traces anew, so marks set since
    the last stage take effect. Returns the student's test accuracy."""
    x_train, _, y_train, _ = data
    steps = epochs * -(-len(x_train) // BATCH)
    trainer = model if teacher is None else distill.Distiller(model, teacher, alpha=0.0, beta=1.0)
    trainer.compile(
        keras.optimizers.Adam(keras.optimizers.schedules.CosineDecay(lr, steps)),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    trainer.fit(x_train, y_train, batch_size=BATCH, epochs=epochs, verbose=0)
    return held_out_accuracy(model, data)


def train_student(pieces, args, data, teacher, seed):
    """One variant, one seed: (test accuracy, dispatch counts of the last stage)."""
    keras.utils.set_random_seed(seed)
    student = build_student(args.size, args.width, "rsign" in pieces)
    teacher = teacher if "distill" in pieces else None
    # Only the residual convs are binary; stem and head stay float.
    if "two_stage" in pieces:
        tapehook.binarize(student, include="binary*", activations=True, weights=False)
        fit(student, data, args.epochs, args.lr, teacher)
    balance = "std" if "balanced" in pieces else None
    tapehook.binarize(student, include="binary*", activations=True, balance=balance)
    tapehook.reset_dispatch_counts()
    epochs = args.epochs if "two_stage" in pieces else 2 * args.epochs
    accuracy = fit(student, data, epochs, args.lr, teacher)
    return accuracy, tapehook.dispatch_counts()


def table(results, teacher_accuracies):
    rows = ["| variant | mean | std | min | max |", "|---|---|---|---|---|"]
    for name, accuracies in {"float teacher": teacher_accuracies, **results}.items():
        if accuracies:
            a = 100 * np.asarray(accuracies)
            std = a.std(ddof=1) if len(a) > 1 else 0.0
            rows.append(
                f"| {name} | {a.mean():.1f} % | {std:.1f} | {a.min():.1f} | {a.max():.1f} |"
            )
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0 .. N-1")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--epochs", type=int, default=6, help="per stage (one-stage variants train twice as many)"
    )
    parser.add_argument("--teacher-epochs", type=int, default=10)
    parser.add_argument("--size", type=int, default=8, help="image side (digits are 8 x 8)")
    parser.add_argument("--width", type=int, default=32, help="channels of every conv")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--json", default=None, help="also write the accuracies here")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}: use some of {list(VARIANTS)}")

    data = load_data(args.size)
    results = {name: [] for name in variants}
    teacher_accuracies, kernel_runs = [], {}
    for seed in range(args.seeds):
        teacher = None
        if any("distill" in VARIANTS[name] for name in variants):
            keras.utils.set_random_seed(seed)
            teacher = build_teacher(args.size, args.width)
            teacher_accuracies.append(fit(teacher, data, args.teacher_epochs, args.lr))
            print(f"seed {seed}: float teacher {teacher_accuracies[-1]:.4f}")
        for name in variants:
            accuracy, counts = train_student(VARIANTS[name], args, data, teacher, seed)
            results[name].append(accuracy)
            kernel_runs[name] = counts
            print(f"seed {seed}: {name} {accuracy:.4f}", flush=True)

    print()
    print(table(results, teacher_accuracies))
    print()
    for name, counts in kernel_runs.items():
        print(
            f"{name}, last stage: binary kernel runs {counts['compiled']}, "
            f"reference path {counts['reference']}"
        )
        if counts["compiled"]["backprop_filter"] + counts["reference"]["backprop_filter"] == 0:
            raise SystemExit(f"{name}: binary gradients never ran: binarization was not active")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "teacher": teacher_accuracies,
                    "variants": {
                        n: {"pieces": VARIANTS[n], "test_accuracy": a} for n, a in results.items()
                    },
                },
                f,
                indent=1,
            )
    return results, teacher_accuracies, kernel_runs


if __name__ == "__main__":
    main()
