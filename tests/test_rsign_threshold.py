"""A graph binarizes RSign's x - beta inside the binary conv: the forward
ops' threshold input (TapehookBinaryConv2D and its affine / add folds)
packs sign(x - beta) where it packs the input's signs, and in a training
step the ops that keep the input's bits and e' for the backward take it
too, so no pass computes t = x - beta. Checked: each op against itself on
x - beta (bit for bit) and the conv against plain TF's conv of
sign(x - beta), in every vector tier and on each way the AVX-512 tier reads
its input; models with RSign in predict against the same model run eagerly
(where t is computed) and against plain TF; tf.gradients on such a graph
against a tape's; a training step's graph (its gradients against plain TF:
tests/test_rsign_fold.py); bad thresholds rejected."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import tapehook
from tapehook import kernels, recipes

from conftest import TIERS, assert_close, inference_gradients, run_in_tier

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="compiled kernels not loaded")

# (x shape, filter [h, w], strides, padding, dilations): channel counts off
# the 16- and 64-lane words; a 1x1 conv (the AVX-512 tier packs per pixel),
# small inputs (packed up front) and one over 2^18 values (packed in bands).
CASES = [
    ((2, 9, 9, 5), (3, 3), 1, "SAME", 1),
    ((2, 9, 9, 70), (3, 3), 2, "SAME", 1),
    ((1, 12, 12, 130), (3, 3), 1, "VALID", 2),
    ((2, 8, 8, 64), (1, 1), 1, "VALID", 1),
    ((2, 8, 8, 48), (1, 1), 2, "SAME", 1),
    ((4, 32, 32, 70), (3, 3), 1, "SAME", 1),
]

_TIER_SCRIPT = """
import json, sys
import numpy as np
import tensorflow as tf
from tapehook import kernels
lib = kernels.library()
cases = json.loads(sys.argv[1])
out = {}
for i, (shape, k, stride, padding, dilation) in enumerate(cases):
    data = np.load(sys.argv[2] + f"/{i}.npz")
    x, w, beta = (tf.constant(data[n]) for n in ("x", "w", "beta"))
    m, b = tf.constant(data["m"]), tf.constant(data["b"])
    attrs = dict(strides=[1, stride, stride, 1], padding=padding,
                 dilations=[1, dilation, dilation, 1], activation_estimator="ste_sign",
                 scale="mean_abs")
    t = x - beta
    for cache in (False, True):
        out[f"{i}-plain-{cache}"] = lib.tapehook_binary_conv2d(
            x, w, threshold=[beta], cache_filter=cache, **attrs).numpy()
        out[f"{i}-plain-{cache}-t"] = lib.tapehook_binary_conv2d(
            t, w, cache_filter=cache, **attrs).numpy()
    y = out[f"{i}-plain-True-t"]
    addend = tf.constant(np.cos(y))
    out[f"{i}-affine"] = lib.tapehook_binary_conv2d_affine(
        x, w, m, b, threshold=[beta], relu=True, **attrs).numpy()
    out[f"{i}-affine-t"] = lib.tapehook_binary_conv2d_affine(t, w, m, b, relu=True, **attrs).numpy()
    out[f"{i}-add"] = lib.tapehook_binary_conv2d_affine_add(
        x, w, m, b, addend, threshold=[beta], **attrs).numpy()
    out[f"{i}-add-t"] = lib.tapehook_binary_conv2d_affine_add(t, w, m, b, addend, **attrs).numpy()
np.savez(sys.argv[2] + "/out.npz", **out)
"""


def _case_data(shape, k, seed):
    rng = np.random.default_rng(seed)
    c = shape[-1]
    x = rng.normal(size=shape).astype(np.float32)
    beta = (rng.normal(size=c) * 0.5).astype(np.float32)
    # x == beta exactly (sign(0) = +1), and NaN (sign -1, as the kernels' Sign)
    x.reshape(-1, c)[::7] = beta
    x.reshape(-1)[::101] = np.nan
    w = rng.normal(size=(*k, c, 6)).astype(np.float32)
    m = rng.uniform(0.5, 2, size=6).astype(np.float32)
    b = rng.normal(size=6).astype(np.float32)
    return dict(x=x, w=w, beta=beta, m=m, b=b)


def _reference(data, stride, padding, dilation):
    """Plain TF: conv of sign(x - beta) (NaN: -1) with alpha * sign(W)."""
    t = data["x"] - data["beta"]
    x_hat = np.where(t >= 0, 1.0, -1.0).astype(np.float32)
    w = data["w"]
    alpha = np.mean(np.abs(w), axis=(0, 1, 2))
    w_hat = np.where(w >= 0, alpha, -alpha).astype(np.float32)
    return tf.nn.conv2d(x_hat, w_hat, stride, padding, dilations=dilation).numpy()


@pytest.mark.parametrize("tier", TIERS)
def test_threshold_ops_equal_the_ops_on_the_shifted_input(tmp_path, tier):
    for i, (shape, k, *_) in enumerate(CASES):
        np.savez(tmp_path / f"{i}.npz", **_case_data(shape, k, seed=i))
    run_in_tier(tier, _TIER_SCRIPT, json.dumps(CASES), tmp_path)
    out = np.load(tmp_path / "out.npz")
    for i, (shape, k, stride, padding, dilation) in enumerate(CASES):
        for key in ("plain-False", "plain-True", "affine", "add"):
            np.testing.assert_array_equal(
                out[f"{i}-{key}"], out[f"{i}-{key}-t"], err_msg=f"case {i} {key}"
            )
        data = np.load(tmp_path / f"{i}.npz")
        want = _reference(data, stride, padding, dilation)
        for cache in ("False", "True"):
            assert_close(out[f"{i}-plain-{cache}"], want, what=f"case {i} cache {cache}")
        affine = np.maximum(want, 0) * data["m"] + data["b"]
        assert_close(out[f"{i}-affine"], affine, what=f"case {i} affine")


def _model(one_padding=False):
    """RSign -> binary conv -> batch norm -> add, twice (the second conv
    without its batch norm), binarized as users do."""
    inputs = keras.Input((10, 10, 24))
    h = keras.layers.Conv2D(24, 3, padding="same", use_bias=False, name="stem")(inputs)
    h = keras.layers.BatchNormalization()(h)
    y = recipes.RSign(name="rsign0")(h)
    y = keras.layers.Conv2D(24, 3, padding="same", use_bias=False, name="binary0")(y)
    y = keras.layers.BatchNormalization()(y)
    h = keras.layers.Add()([h, y])
    y = recipes.RSign(name="rsign1")(h)
    y = keras.layers.Conv2D(16, 3, strides=2, padding="same", use_bias=False, name="binary1")(y)
    model = keras.Model(inputs, y)
    extra = dict(pad_value=1.0) if one_padding else {}
    tapehook.binarize(model, include="binary*", activations=True, scale="mean_abs", **extra)
    rng = np.random.default_rng(3)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.moving_mean.assign(rng.normal(size=24).astype("float32") * 0.2)
            layer.moving_variance.assign(rng.uniform(0.5, 2, size=24).astype("float32"))
        if isinstance(layer, recipes.RSign):
            layer.beta.assign(rng.normal(size=24).astype("float32") * 0.3)
    x = rng.normal(size=(4, 10, 10, 24)).astype("float32")
    return model, x


def _thresholds(model, x):
    graph = tf.function(lambda t: model(t, training=False)).get_concrete_function(x).graph
    return sorted(
        (op.type, op.get_attr("num_threshold"))
        for op in graph.get_operations()
        if op.type.startswith("TapehookBinaryConv2D")
    )


def _plain_tf(model, x):
    """The model's inference output in plain TF ops, written here."""
    layers = {layer.name: layer for layer in model.layers}

    def bn(layer, v):
        return (v - layer.moving_mean) / tf.sqrt(
            layer.moving_variance + layer.epsilon
        ) * layer.gamma + layer.beta

    def binary_conv(name, v, rsign, stride):
        x_hat = tf.where(v - layers[rsign].beta >= 0, 1.0, -1.0)
        w = layers[name].kernel
        alpha = tf.reduce_mean(tf.abs(w), axis=[0, 1, 2])
        return tf.nn.conv2d(x_hat, tf.where(w >= 0, alpha, -alpha), stride, "SAME")

    bns = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    h = bn(bns[0], tf.nn.conv2d(x, layers["stem"].kernel, 1, "SAME"))
    h = h + bn(bns[1], binary_conv("binary0", h, "rsign0", 1))
    return binary_conv("binary1", h, "rsign1", 2)


def test_predict_binarizes_the_shifted_input_in_the_conv():
    model, x = _model()
    # every binary conv of the inference graph takes beta, the first with
    # its batch norm and the add folded in (the unfused ops that the folds
    # leave without consumers are pruned)
    ops = _thresholds(model, x)
    assert ("TapehookBinaryConv2DAffineAdd", 1) in ops
    assert all(n == 1 for _, n in ops)
    tapehook.reset_dispatch_counts()
    got = model.predict(x, verbose=0)
    assert tapehook.dispatch_counts()["compiled"]["forward"] == 2
    eager = model(x, training=False)  # eager: RSign computes t, the conv reads it
    assert_close(got, eager, what="predict vs eager")
    assert_close(got, _plain_tf(model, x), what="predict vs plain TF")


def test_one_padding_keeps_the_shifted_input():
    """One-padding pads t (its sign +1), not x: no threshold there."""
    model, x = _model(one_padding=True)
    assert all(n == 0 for _, n in _thresholds(model, x))
    assert_close(model.predict(x, verbose=0), model(x, training=False), what="predict")


def test_inference_graph_gradients_reach_beta():
    """tf.gradients of an inference graph (no tape: the threshold forms)
    equal a tape's gradients of the eager model (t computed by RSign)."""
    model, x = _model()
    x = tf.constant(x)
    variables = [layer.beta for layer in model.layers if isinstance(layer, recipes.RSign)] + [
        model.get_layer("binary0").kernel
    ]
    got, types = inference_gradients(model, x, variables)
    assert "TapehookBinaryConv2DAffineAdd" in types
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = model(x, training=False)
        loss = tf.reduce_sum(y * tf.cos(y))
    want = tape.gradient(loss, [x, *variables])
    for name, g, r in zip(["dx", "dbeta0", "dbeta1", "dw0"], got, want):
        assert_close(g, r, what=name)
        assert float(tf.reduce_max(tf.abs(r))) > 0, name


def test_bad_thresholds_are_rejected():
    lib = kernels.library()
    x, w = tf.ones([1, 5, 5, 8]), tf.ones([3, 3, 8, 4])
    attrs = dict(strides=[1, 1, 1, 1], padding="SAME")
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"threshold must be \[in_c\] = \[8\]"):
        lib.tapehook_binary_conv2d(
            x, w, threshold=[tf.ones([3])], activation_estimator="ste_sign", **attrs
        )
    with pytest.raises(tf.errors.InvalidArgumentError, match="needs float32 and binary input"):
        lib.tapehook_binary_conv2d(x, w, threshold=[tf.ones([8])], **attrs)
    with pytest.raises(tf.errors.InvalidArgumentError, match="needs float32 and binary input"):
        lib.tapehook_binary_conv2d(
            tf.cast(x, tf.float64),
            tf.cast(w, tf.float64),
            threshold=[tf.ones([8], tf.float64)],
            activation_estimator="ste_sign",
            **attrs,
        )


_PACK_SCRIPT = """
import sys
import numpy as np
import tensorflow as tf
from tapehook import kernels
lib = kernels.library()
out = {}
for i, channels in enumerate((5, 70, 1100)):
    rng = np.random.default_rng(i)
    x = rng.normal(size=(3, 7, channels)).astype(np.float32)
    beta = (rng.normal(size=channels) * 0.5).astype(np.float32)
    x.reshape(-1, channels)[::3] = beta
    x.reshape(-1)[::97] = np.nan
    t = tf.constant(x - beta)
    x, beta = tf.constant(x), tf.constant(beta)
    for clip in (0.7, float("inf")):
        attrs = dict(clip=clip)
        out[f"{i}-pack-{clip}"] = lib.tapehook_pack_input(x, threshold=[beta], **attrs).numpy()
        out[f"{i}-pack-{clip}-t"] = lib.tapehook_pack_input(t, **attrs).numpy()
    for name in ("approx_sign", "swish_sign"):
        for kind in ("fixed", "half"):
            op = getattr(lib, f"tapehook_estimator_grad_{kind}")
            got = op(x, threshold=[beta], activation_estimator=name)
            want = op(t, activation_estimator=name)
            out[f"{i}-{name}-{kind}"] = tf.bitcast(got, tf.uint16).numpy()
            out[f"{i}-{name}-{kind}-t"] = tf.bitcast(want, tf.uint16).numpy()
np.savez(sys.argv[1], **out)
"""


@pytest.mark.parametrize("tier", TIERS)
def test_kept_bits_and_derivatives_of_the_shifted_input(tmp_path, tier):
    """What a training step keeps for the backward, from x and beta: the
    same bits (sign, mask) and 16-bit e' as from x - beta, in every tier,
    rows longer than one buffered run (1100 channels) included."""
    run_in_tier(tier, _PACK_SCRIPT, tmp_path / "out.npz")
    out = np.load(tmp_path / "out.npz")
    keys = [k for k in out.files if not k.endswith("-t")]
    assert len(keys) == 18
    for key in keys:
        np.testing.assert_array_equal(out[key], out[key + "-t"], err_msg=key)


@pytest.mark.parametrize("estimator", ["ste_sign", "approx_sign"])
def test_training_graph_never_needs_the_shifted_input(estimator):
    """Under a tape in a graph the conv and what it keeps take beta; t is
    read only by RSign's own sign, which nothing reads (pruned)."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(4, 8, 8, 16)).astype("float32"))
    w = tf.Variable(rng.normal(size=(3, 3, 16, 8)).astype("float32"))
    tapehook.mark_binary(w, activations=True, scale="mean_abs")
    rsign = recipes.RSign(estimator=estimator)
    rsign.build(x.shape)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.nn.conv2d(rsign(x), w, 1, "SAME")
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, [x, rsign.beta, w])

    graph = step.get_concrete_function(x).graph
    thresholds = {
        op.type: op.get_attr("num_threshold")
        for op in graph.get_operations()
        if "num_threshold" in op.node_def.attr
    }
    kept = {"ste_sign": [], "approx_sign": ["TapehookEstimatorGradFixed"]}[estimator]
    assert thresholds == dict.fromkeys(["TapehookBinaryConv2D", "TapehookPackInput", *kept], 1)
    (shift,) = [op for op in graph.get_operations() if op.type == "Sub"]
    readers = {c.type for c in shift.outputs[0].consumers()}
    assert readers <= {"GreaterEqual", "IdentityN"}, readers  # RSign's sign only


def test_bad_thresholds_of_the_kept_bits_are_rejected():
    lib = kernels.library()
    x = tf.ones([2, 3, 8])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"threshold must be \[channels\]"):
        lib.tapehook_pack_input(x, threshold=[tf.ones([3])])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"threshold must be \[channels\]"):
        lib.tapehook_estimator_grad_fixed(
            x, threshold=[tf.ones([9])], activation_estimator="approx_sign"
        )
    with pytest.raises(tf.errors.InvalidArgumentError, match="needs float32 or float64"):
        lib.tapehook_pack_input(tf.cast(x, tf.float16), threshold=[tf.ones([8], tf.float16)])
