"""Trains a small binarized Keras model under a tf.distribute strategy (or none)
and writes the final weights and dispatch counts to an .npz file.

    python distributed_training.py MODE OUT.npz
MODE: single | mirrored_fit | mirrored_loop | multiworker (TF_CONFIG set by the caller)
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

MODE, OUT = sys.argv[1], sys.argv[2]
GLOBAL_BATCH, STEPS = 8, 3

if MODE.startswith("mirrored"):
    # Two logical CPUs; must happen before TF runs anything (tapehook included).
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

import tapehook  # noqa: E402


def build():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(6, 3, padding="same", use_bias=False)(inputs)
    h = keras.layers.Conv2D(6, 3, padding="same", use_bias=False)(h)
    outputs = keras.layers.Dense(2)(keras.layers.Flatten()(h))
    return tapehook.binarize(keras.Model(inputs, outputs), activations=True)


rng = np.random.default_rng(0)
x = rng.normal(size=(GLOBAL_BATCH * STEPS, 8, 8, 3)).astype("float32")
y = rng.normal(size=(GLOBAL_BATCH * STEPS, 2)).astype("float32")

if MODE == "single":
    strategy = tf.distribute.get_strategy()
elif MODE in ("mirrored_fit", "mirrored_loop"):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
elif MODE == "multiworker":
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
else:
    raise SystemExit(f"unknown mode {MODE}")

with strategy.scope():
    model = build()
    optimizer = keras.optimizers.SGD(0.05)
    model.compile(optimizer=optimizer, loss="mse")

if MODE in ("mirrored_loop", "multiworker"):  # Keras 3 fit fails under MWMS itself
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    )

    @tf.function
    def step(xb, yb):
        def replica(xb, yb):
            with tf.GradientTape() as tape:
                per_example = tf.reduce_mean(tf.square(model(xb, training=True) - yb), axis=1)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        strategy.run(replica, args=(xb, yb))

    for xb, yb in dataset:
        step(xb, yb)
else:
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)

marked = [
    bool(tapehook.binary_spec_of(l.kernel))
    for l in model.layers
    if isinstance(l, keras.layers.Conv2D)
]
components = [
    len(getattr(l.kernel.value, "values", [l.kernel.value]))
    for l in model.layers
    if isinstance(l, keras.layers.Conv2D)
]
np.savez(
    OUT,
    *[w for w in model.get_weights()],
    marked=marked,
    components=components,
    counts=[
        tapehook.dispatch_counts()["compiled"][k]
        for k in ("forward", "backprop_input", "backprop_filter")
    ],
)
