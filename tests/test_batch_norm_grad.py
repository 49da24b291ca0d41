"""TapehookBatchNormGrad (core/batch_norm.h), the gradient a recomputed
batch norm runs: against the batch-norm gradient worked out in float64
NumPy, with and without the fused ReLU, over one and several row blocks;
bad shapes get an error naming them."""

import numpy as np
import pytest
import tensorflow as tf

from tapehook import kernels

from conftest import assert_close

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="needs the compiled kernels")


def _reference(dy, u, gamma, epsilon, relu):
    """(dx, dgamma, dbeta) of y = gamma * x_hat + beta over the last axis,
    x = relu(u) if relu, batch statistics (biased variance); then the ReLU's
    backward. float64."""
    dy, u, gamma = (np.asarray(t, np.float64) for t in (dy, u, gamma))
    x = np.maximum(u, 0.0) if relu else u
    axes = tuple(range(x.ndim - 1))
    m = x.size // x.shape[-1]
    mean, var = x.mean(axes), x.var(axes)
    inv = 1.0 / np.sqrt(var + epsilon)
    x_hat = (x - mean) * inv
    dbeta, dgamma = dy.sum(axes), (dy * x_hat).sum(axes)
    dx = gamma * inv / m * (m * dy - dbeta - x_hat * dgamma)
    if relu:
        dx = np.where(u > 0, dx, 0.0)
    return dx, dgamma, dbeta


def _op(dy, u, gamma, epsilon, relu):
    x = tf.nn.relu(u) if relu else u
    mean, var = tf.nn.moments(x, axes=list(range(len(x.shape) - 1)))
    return kernels.library().tapehook_batch_norm_grad(
        dy, u, gamma, mean, tf.math.rsqrt(var + epsilon), relu=relu
    )


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("shape", [(2, 5, 5, 3), (3, 9, 9, 70), (4, 16, 16, 8), (1, 1, 1, 4)])
@pytest.mark.parametrize("graph", [False, True])
def test_matches_float64_reference(shape, relu, graph):
    rng = np.random.default_rng(sum(shape))
    u = tf.constant(rng.normal(0.3, 1.5, shape), tf.float32)
    dy = tf.constant(rng.normal(size=shape), tf.float32)
    gamma = tf.constant(rng.uniform(0.5, 1.5, shape[-1]), tf.float32)
    fn = tf.function(_op, autograph=False) if graph else _op
    got = fn(dy, u, gamma, 1e-3, relu)
    want = _reference(dy, u, gamma, 1e-3, relu)
    for g, w, what in zip(got, want, ("dx", "dgamma", "dbeta")):
        assert_close(g, w, what=f"{what}, relu={relu}")


def test_relu_masks_where_the_input_is_not_positive():
    u = tf.constant([[-1.0, 2.0], [0.0, 3.0], [1.5, -0.5], [2.0, 1.0]])
    dy = tf.constant([[0.5, -2.0], [1.0, 0.3], [-0.7, 1.1], [0.2, -0.4]])
    dx, _, _ = _op(dy, u, tf.constant([1.0, 1.0]), 1e-3, True)
    np.testing.assert_array_equal(dx.numpy()[u.numpy() <= 0], 0.0)
    assert np.all(dx.numpy()[u.numpy() > 0] != 0.0)
    want, _, _ = _reference(dy, u, [1.0, 1.0], 1e-3, True)
    assert_close(dx, want, what="dx")


def test_bad_shapes_name_them():
    lib = kernels.library()
    v = tf.ones([3])
    with pytest.raises(tf.errors.InvalidArgumentError, match="same shape"):
        lib.tapehook_batch_norm_grad(tf.ones([2, 3]), tf.ones([2, 4]), v, v, v)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"must be \[3\]"):
        lib.tapehook_batch_norm_grad(tf.ones([2, 3]), tf.ones([2, 3]), tf.ones([4]), v, v)
