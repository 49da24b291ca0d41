"""The compiled kernels against the reference over a seeded random sweep of
shapes, odd channel counts, strides, paddings (incl. EXPLICIT), dilations,
dtypes and specs."""

import numpy as np
import pytest
import tensorflow as tf

import tapehook
from conftest import SPECS, assert_close, random_inputs, reference_result

DTYPES = [tf.float32, tf.float64, tf.float16, tf.bfloat16]


def _cases(count, seed=2026):
    rng = np.random.default_rng(seed)
    for i in range(count):
        kh, kw = rng.choice([1, 2, 3, 5]), rng.choice([1, 3])
        dil = int(rng.choice([1, 1, 2]))
        padding = ["SAME", "VALID", "EXPLICIT"][i % 3]
        h = int(rng.integers((kh - 1) * dil + 1, 12))
        w = int(rng.integers((kw - 1) * dil + 1, 12))
        yield dict(
            batch=int(rng.choice([1, 1, 3])), h=h, w=w,
            cin=int(rng.choice([1, 3, 5, 7, 16])), cout=int(rng.choice([1, 2, 5, 9])),
            kh=int(kh), kw=int(kw), stride=int(rng.choice([1, 2])), dil=dil,
            padding=padding, pads=[int(p) for p in rng.integers(0, 3, size=4)],
            spec=SPECS[i % len(SPECS)], dtype=DTYPES[i % len(DTYPES)], seed=i)


CASES = list(_cases(48))


@pytest.mark.parametrize("case", CASES, ids=[
    f"{c['padding']}-s{c['stride']}-d{c['dil']}-c{c['cin']}x{c['cout']}-"
    f"k{c['kh']}x{c['kw']}-{c['dtype'].name}" for c in CASES])
def test_sweep(case):
    c = case
    x, w0 = random_inputs((c["batch"], c["h"], c["w"], c["cin"]),
                          (c["kh"], c["kw"], c["cin"], c["cout"]), c["dtype"], c["seed"])
    if c["padding"] == "EXPLICIT":
        t, b, l, r = c["pads"]
        padding = [[0, 0], [t, b], [l, r], [0, 0]]
        conv = dict(padding="EXPLICIT", explicit_paddings=[0, 0, t, b, l, r, 0, 0])
    else:
        padding = c["padding"]
        conv = dict(padding=padding)
    strides, dilations = [1, c["stride"], c["stride"], 1], [1, c["dil"], c["dil"], 1]
    if c["dil"] > 1:
        strides = [1, 1, 1, 1]  # TF's Conv2D rejects strides > 1 with dilations > 1
    w = tapehook.mark_binary(tf.Variable(w0), **{
        k: getattr(c["spec"], k) for k in ("activations", "scale", "ste", "clip")})
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.nn.conv2d(x, w, strides=strides, padding=padding, dilations=dilations)
        g = tf.constant(np.random.default_rng(c["seed"]).normal(size=y.shape), tf.float32)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * g)
    dx, dw = tape.gradient(loss, [x, w])
    ry, rdx, rdw = reference_result(x, w0, c["spec"], g, strides=strides,
                                    dilations=dilations, **conv)
    assert_close(y, ry, c["dtype"], "forward")
    assert_close(dx, rdx, c["dtype"], "dX")
    assert_close(dw, rdw, c["dtype"], "dW")
    assert tapehook.dispatch_counts()["compiled"] == dict(
        forward=1, backprop_input=1, backprop_filter=1)


def test_zero_maps_to_plus_one_and_padding_stays_zero():
    """All-zero input with binary activations: sign(0) = +1 inside, 0 in the
    padding, so a 3x3 SAME all-ones conv counts the in-image taps."""
    x = tf.zeros([1, 3, 3, 1])
    w = tapehook.mark_binary(tf.Variable(tf.ones([3, 3, 1, 1])), activations=True)
    y = tf.nn.conv2d(x, w, 1, "SAME")[0, :, :, 0]
    np.testing.assert_array_equal(y, [[4, 6, 4], [6, 9, 6], [4, 6, 4]])
