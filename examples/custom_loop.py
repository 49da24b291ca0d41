"""An eager custom training loop: a binary conv layer trained with GradientTape.

The filter is a plain tf.Variable created inside ``tapehook.binary_scope``;
every step runs the binary forward and backward kernels eagerly.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import tapehook  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)

    digits = load_digits()
    x_all = tf.constant(digits.images[..., None] / 8.0 - 1.0, tf.float32)
    y_all = tf.constant(digits.target)
    tf.random.set_seed(0)
    with tapehook.binary_scope(activations=True, scale="mean_abs"):
        w = tf.Variable(tf.random.normal([3, 3, 1, 32], stddev=0.5), name="binary_filter")
    head = tf.Variable(tf.random.normal([8 * 8 * 32, 10], stddev=0.01), name="head")
    optimizer = tf.keras.optimizers.Adam(1e-2)
    rng = np.random.default_rng(0)
    for step in range(args.steps):
        batch = rng.choice(len(digits.target), 64, replace=False)
        with tf.GradientTape() as tape:
            h = tf.nn.conv2d(tf.gather(x_all, batch), w, strides=1, padding="SAME")
            logits = tf.reshape(tf.nn.relu(h), [64, -1]) @ head
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(tf.gather(y_all, batch), logits)
            )
        optimizer.apply_gradients(zip(tape.gradient(loss, [w, head]), [w, head]))
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d} loss {float(loss):.3f}")
    logits = tf.reshape(tf.nn.relu(tf.nn.conv2d(x_all, w, 1, "SAME")), [len(y_all), -1]) @ head
    accuracy = float(np.mean(np.argmax(logits, 1) == digits.target))
    print(f"training accuracy {accuracy:.3f}; spec {tapehook.binary_spec_of(w)}")
    print("dispatch counts:", tapehook.dispatch_counts())
    return accuracy


if __name__ == "__main__":
    main()
