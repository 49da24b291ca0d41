"""A tf.compat.v1 graph and Session with tf.gradients: the same binary conv.

Graph-mode gradients reach tapehook's op through TF's gradient registry, so a
v1 training loop needs no change beyond marking the filter.
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
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)

    digits = load_digits()
    images = (digits.images[..., None] / 8.0 - 1.0).astype("float32")
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(0)
        x = tf.compat.v1.placeholder(tf.float32, [None, 8, 8, 1])
        labels = tf.compat.v1.placeholder(tf.int64, [None])
        w = tapehook.mark_binary(
            tf.Variable(tf.random.normal([3, 3, 1, 32], stddev=0.5)), activations=True
        )
        head = tf.Variable(tf.random.normal([8 * 8 * 32, 10], stddev=0.01))
        h = tf.nn.relu(tf.nn.conv2d(x, w, strides=1, padding="SAME"))
        logits = tf.reshape(h, [-1, 8 * 8 * 32]) @ head
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
        grads = tf.compat.v1.gradients(loss, [w, head])
        train = [v.assign_sub(0.05 * g) for v, g in zip([w, head], grads)]
        accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), labels), tf.float32))
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            rng = np.random.default_rng(0)
            for step in range(args.steps):
                batch = rng.choice(len(images), 64, replace=False)
                value, _ = sess.run([loss, train], {x: images[batch], labels: digits.target[batch]})
                if step % 50 == 0 or step == args.steps - 1:
                    print(f"step {step:4d} loss {value:.3f}")
            result = sess.run(accuracy, {x: images, labels: digits.target})
    print(f"training accuracy {result:.3f}")
    print("dispatch counts:", tapehook.dispatch_counts())
    return float(result)


if __name__ == "__main__":
    main()
