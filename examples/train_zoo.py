"""Train a tapehook.zoo model on your own images, then deploy it.

    python examples/train_zoo.py --model QuickNetSmall --data DIR

DIR holds one sub-folder of images per class (the layout of
``keras.utils.image_dataset_from_directory``); 20 % of each class is held out
for validation. The model is larq-zoo's architecture with a head for your
classes, trained with larq-zoo's recipe for it (its optimizer and learning-
rate schedule, the schedule's epoch boundaries scaled to ``--epochs``; batch
norm and weight clipping are part of the model) on larq-zoo's ImageNet
preprocessing (random crops and flips for training, the central crop for
validation). ``--weights imagenet`` (or a larq-zoo weights file) starts from
pretrained features: the headless model gets your head.

Keras prints progress; each epoch writes ``OUT/last.keras`` and
``OUT/best.keras`` (by validation accuracy), and ``OUT/backup`` lets an
interrupted run continue where it stopped (run the same command again). At
the end the model is exported for LiteRT and for Larq Compute Engine, and
each file is run on the validation set by its own interpreter to report its
accuracy (the LCE export builds LCE's side environment once; docs/deploy.md).

ReActNet's recipe (``--model ReActNetA``) adds two options that work for any
model: ``--teacher T.keras`` distills from a float model (its logits, or the
input of its final softmax) with ReActNet's distribution loss alone, and
``--two-stage`` first trains binary activations with float weights (stage 1,
checkpoints in ``OUT/stage1``), then the binary model from stage 1's weights,
each for ``--epochs`` with a fresh schedule.

    python examples/train_zoo.py --model ReActNetA --data DIR --teacher T.keras --two-stage
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tapehook  # noqa: E402
import tapehook.larq as lq  # noqa: E402
from tapehook import distill, zoo  # noqa: E402
from tapehook.zoo import preprocessing  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_digits import deploy  # noqa: E402

# larq-zoo's recipes (larq_zoo/training/): (optimizer, peak learning rate,
# schedule over larq-zoo's epochs). Schedules: ("cosine_warmup", warm-up
# epochs), ("linear",), ("steps", factor, boundaries) or ("halving", every).
# weight_decay: L2 on conv kernels, (stage 1, stage 2 or a single stage).
_QUICKNET = dict(optimizer="quicknet", lr=1e-2, schedule=("cosine_warmup", 5), epochs=600)
_DENSENET = dict(optimizer="adam", lr=4e-3, schedule=("steps", 0.1, (100, 110)), epochs=120)
RECIPES = {
    "QuickNetSmall": _QUICKNET,
    "QuickNet": _QUICKNET,
    "QuickNetLarge": _QUICKNET,
    "BiRealNet": dict(optimizer="adam", lr=5e-3, schedule=("linear",), epochs=300),
    "RealToBinaryNet": dict(
        optimizer="adam", lr=1e-3, schedule=("steps", 0.1, (40, 60, 70)), epochs=75
    ),
    "BinaryResNetE18": dict(
        optimizer="adam", lr=4e-3, schedule=("steps", 0.3, (70, 90, 110)), epochs=120
    ),
    "BinaryDenseNet28": _DENSENET,
    "BinaryDenseNet37": _DENSENET,
    "BinaryDenseNet37Dilated": dict(_DENSENET, schedule=("steps", 0.1, (60, 70)), epochs=80),
    "BinaryDenseNet45": dict(_DENSENET, lr=8e-3, schedule=("steps", 0.1, (80, 100)), epochs=125),
    "MeliusNet22": dict(optimizer="adam", lr=2e-3, schedule=("cosine_warmup", 5), epochs=120),
    "XNORNet": dict(
        optimizer="adam", lr=1e-3, schedule=("steps", 0.5, (10, 20, 30, 40, 50, 60)), epochs=100
    ),
    "DoReFaNet": dict(optimizer="adam", lr=2e-4, schedule=("steps", 0.2, (60, 75, 82)), epochs=90),
    "BinaryAlexNet": dict(optimizer="adam", lr=1e-2, schedule=("halving", 10), epochs=150),
    # ReActNet's code (mobilenet/*/run.sh, its 256-epoch setting), per stage.
    "ReActNetA": dict(
        optimizer="adam", lr=5e-4, schedule=("linear",), epochs=256, weight_decay=(1e-5, 0.0)
    ),
}


def load_data(directory, size, batch_size, seed=0):
    """(train, validation, class names): larq-zoo's preprocessing at ``size``
    px, images first resized to ``size * 8 / 7`` (224 -> 256) as ImageNet's
    evaluation crop assumes."""
    load = round(size * 8 / 7)
    train, val = keras.utils.image_dataset_from_directory(
        directory,
        image_size=(load, load),
        batch_size=None,
        validation_split=0.2,
        subset="both",
        seed=seed,
    )
    names = train.class_names
    train = train.shuffle(1024, seed=seed).map(
        lambda x, y: (preprocessing.training_input(x, size), y),
        num_parallel_calls=tf.data.AUTOTUNE,
    )
    val = val.map(
        lambda x, y: (preprocessing.evaluation_input(x, size), y),
        num_parallel_calls=tf.data.AUTOTUNE,
    )
    batch = lambda d: d.batch(batch_size).prefetch(tf.data.AUTOTUNE)  # noqa: E731
    return batch(train), batch(val), names


def schedule(recipe, epochs, steps_per_epoch):
    """The recipe's learning rate per step, its epochs scaled to ``epochs``."""
    scale = epochs / recipe["epochs"]
    total = max(epochs * steps_per_epoch, 1)
    kind, *args = recipe["schedule"]
    lr = recipe["lr"]
    if kind == "cosine_warmup":
        warmup = min(max(round(args[0] * scale * steps_per_epoch), 1), total - 1)
        return keras.optimizers.schedules.CosineDecay(
            0.0, max(total - warmup, 1), warmup_target=lr, warmup_steps=warmup
        )
    if kind == "linear":
        return keras.optimizers.schedules.PolynomialDecay(lr, total, end_learning_rate=0.0)
    if kind == "halving":
        every = max(round(args[0] * scale * steps_per_epoch), 1)
        return keras.optimizers.schedules.ExponentialDecay(lr, every, 0.5, staircase=True)
    factor, boundaries = args
    steps = sorted({max(round(b * scale * steps_per_epoch), 1) for b in boundaries})
    return keras.optimizers.schedules.PiecewiseConstantDecay(
        steps, [lr * factor**i for i in range(len(steps) + 1)]
    )


def optimizer(recipe, epochs, steps_per_epoch):
    lr = schedule(recipe, epochs, steps_per_epoch)
    if recipe["optimizer"] == "quicknet":
        # QuickNet: Adam for the binary kernels, SGD with momentum (10x the
        # rate, same schedule shape) for everything else.
        sgd_recipe = dict(recipe, lr=recipe["lr"] * 10)
        return tapehook.optimizers.CaseOptimizer(
            (tapehook.optimizers.is_binary_variable, keras.optimizers.Adam(lr)),
            default_optimizer=keras.optimizers.SGD(
                schedule(sgd_recipe, epochs, steps_per_epoch), momentum=0.9
            ),
        )
    return keras.optimizers.Adam(lr, epsilon=1e-8)


def build(name, size, num_classes, weights):
    """The zoo model with a ``num_classes`` head; with ``weights`` the
    pretrained headless model plus a new pooled dense head."""
    model_fn = getattr(zoo, name)
    if weights is None:
        return model_fn(input_shape=(size, size, 3), num_classes=num_classes)
    base = model_fn(input_shape=(size, size, 3), weights=weights, include_top=False)
    x = keras.layers.GlobalAveragePooling2D()(base.output)
    outputs = keras.layers.Dense(num_classes, activation="softmax")(x)
    return keras.Model(base.input, outputs, name=f"{name}_head")


def evaluate_files(model, val, directory, targets):
    """Exports ``model`` per target and returns each file's validation
    accuracy, measured by that target's interpreter."""
    images, labels = zip(*[(x.numpy(), y.numpy()) for x, y in val.unbatch()])
    images, labels = np.stack(images), np.array(labels)
    keras_accuracy = float(np.mean(np.argmax(model.predict(images, verbose=0), -1) == labels))
    print(f"keras  validation accuracy {keras_accuracy:.4f}")
    prefix = os.path.join(directory, model.name)
    return keras_accuracy, deploy(model, images, labels, prefix, targets, split="validation")


class SaveModel(keras.callbacks.ModelCheckpoint):
    """ModelCheckpoint of ``model`` whatever fit trains (a Distiller of its logits)."""

    def __init__(self, filepath, model, **kwargs):
        super().__init__(filepath, **kwargs)
        self.saved = model

    def set_model(self, model):
        super().set_model(self.saved)


def callbacks(out, model):
    """Resume after an interruption, the last and the best ``model``."""
    return [
        keras.callbacks.BackupAndRestore(os.path.join(out, "backup")),
        SaveModel(os.path.join(out, "last.keras"), model),
        SaveModel(
            os.path.join(out, "best.keras"),
            model,
            monitor="val_accuracy",
            mode="max",
            save_best_only=True,
        ),
    ]


def logits(model):
    """``model``'s logits: the input of a final softmax layer, the log of the
    output where the last layer has a softmax inside (the same softmax at any
    temperature), else the output."""
    last = model.layers[-1]
    if isinstance(last, keras.layers.Softmax) or (
        isinstance(last, keras.layers.Activation) and last.activation is keras.activations.softmax
    ):
        return keras.Model(model.inputs, last.input, name=f"{model.name}_logits")
    if getattr(last, "activation", None) is keras.activations.softmax:
        tiny = keras.ops.convert_to_tensor(np.finfo("float32").tiny)
        log_p = keras.ops.log(keras.ops.maximum(model.outputs[0], tiny))
        return keras.Model(model.inputs, log_p, name=f"{model.name}_logits")
    return model


def float_weights(model):
    """``model`` with float kernels where its larq layers binarize them, the
    inputs still binarized: ReActNet's stage 1 (the same weights, in order)."""

    def clone(layer):
        config = layer.get_config()
        if isinstance(layer, lq.layers.QuantConv2D) and layer.kernel_quantizer is not None:
            config.update(kernel_quantizer=None, kernel_constraint=None)
        return type(layer).from_config(config)

    return keras.models.clone_model(model, clone_function=clone)


def decay_kernels(model, rate):
    """ReActNet's weight decay (PyTorch Adam's, added to the gradient):
    L2(rate / 2) on every conv kernel."""
    for weight in model.trainable_weights:
        if rate and len(weight.shape) == 4:
            weight.regularizer = keras.regularizers.L2(rate / 2)


def train_stage(model, teacher, args, data, steps, out, weight_decay):
    """Fits ``model`` for ``args.epochs``, against ``teacher``'s logits with
    the distribution loss alone (ReActNet's) when there is one."""
    train, val = data
    recipe = RECIPES[args.model]
    decay_kernels(model, weight_decay)
    trained, loss = model, "sparse_categorical_crossentropy"
    if teacher is not None:
        trained = distill.Distiller(logits(model), logits(teacher), alpha=0.0, beta=1.0)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    trained.compile(
        optimizer=optimizer(recipe, args.epochs, steps), loss=loss, metrics=["accuracy"]
    )
    os.makedirs(out, exist_ok=True)
    return trained.fit(
        train,
        validation_data=val,
        epochs=args.epochs,
        steps_per_epoch=steps,
        callbacks=callbacks(out, model),
        verbose=args.verbose,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="QuickNetSmall", choices=sorted(RECIPES))
    parser.add_argument("--data", required=True, help="folder with one sub-folder per class")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument(
        "--steps-per-epoch", type=int, default=None, help="cap on steps per epoch (smoke runs)"
    )
    parser.add_argument("--weights", default=None, help="'imagenet' or a larq-zoo weights file")
    parser.add_argument(
        "--teacher", default="none", help="a float .keras model to distill, or none"
    )
    parser.add_argument(
        "--two-stage", action="store_true", help="binary activations first, then binary weights"
    )
    parser.add_argument("--out", default="train_zoo_out", help="checkpoints and exports")
    parser.add_argument("--deploy", default="litert,lce", help="targets to export ('' for none)")
    parser.add_argument("--verbose", type=int, default=2)
    args = parser.parse_args(argv)

    keras.utils.set_random_seed(0)
    train, val, names = load_data(args.data, args.image_size, args.batch_size)
    steps = int(train.cardinality())
    if args.steps_per_epoch:
        steps = min(steps, args.steps_per_epoch)
        train = train.repeat()
    model = build(args.model, args.image_size, len(names), args.weights)
    tapehook.summary(model, print_fn=print if args.verbose else None)
    teacher = None if args.teacher == "none" else keras.models.load_model(args.teacher)
    decays = RECIPES[args.model].get("weight_decay", (0.0, 0.0))
    if args.two_stage:
        first = float_weights(model)
        stage1 = os.path.join(args.out, "stage1")
        done = os.path.join(stage1, "done.weights.h5")
        if os.path.exists(done):  # a rerun after stage 1 finished goes on with stage 2
            first.load_weights(done)
        else:
            train_stage(first, teacher, args, (train, val), steps, stage1, decays[0])
            first.save_weights(done)
        model.set_weights(first.get_weights())
    history = train_stage(model, teacher, args, (train, val), steps, args.out, decays[-1])
    targets = [t for t in args.deploy.split(",") if t]
    keras_accuracy, files = evaluate_files(model, val, args.out, targets)
    return dict(
        history=history.history,
        epochs_run=len(history.epoch),
        classes=names,
        keras_accuracy=keras_accuracy,
        file_accuracy=files,
        steps_per_epoch=steps,
    )


if __name__ == "__main__":
    main()
