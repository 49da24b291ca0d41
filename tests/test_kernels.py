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
            batch=int(rng.choice([1, 1, 3])),
            h=h,
            w=w,
            cin=int(rng.choice([1, 3, 5, 7, 16])),
            cout=int(rng.choice([1, 2, 5, 9])),
            kh=int(kh),
            kw=int(kw),
            stride=int(rng.choice([1, 2])),
            dil=dil,
            padding=padding,
            pads=[int(p) for p in rng.integers(0, 3, size=4)],
            spec=SPECS[i % len(SPECS)],
            dtype=DTYPES[i % len(DTYPES)],
            seed=i,
        )


CASES = list(_cases(48))


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=[
        f"{c['padding']}-s{c['stride']}-d{c['dil']}-c{c['cin']}x{c['cout']}-"
        f"k{c['kh']}x{c['kw']}-{c['dtype'].name}"
        for c in CASES
    ],
)
def test_sweep(case):
    c = case
    x, w0 = random_inputs(
        (c["batch"], c["h"], c["w"], c["cin"]),
        (c["kh"], c["kw"], c["cin"], c["cout"]),
        c["dtype"],
        c["seed"],
    )
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
    w = tapehook.mark_binary(
        tf.Variable(w0),
        **{k: getattr(c["spec"], k) for k in ("activations", "scale", "ste", "clip")},
    )
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.nn.conv2d(x, w, strides=strides, padding=padding, dilations=dilations)
        g = tf.constant(np.random.default_rng(c["seed"]).normal(size=y.shape), tf.float32)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * g)
    dx, dw = tape.gradient(loss, [x, w])
    ry, rdx, rdw = reference_result(
        x, w0, c["spec"], g, strides=strides, dilations=dilations, **conv
    )
    assert_close(y, ry, c["dtype"], "forward")
    assert_close(dx, rdx, c["dtype"], "dX")
    assert_close(dw, rdw, c["dtype"], "dW")
    assert tapehook.dispatch_counts()["compiled"] == dict(
        forward=1, backprop_input=1, backprop_filter=1
    )


def test_zero_maps_to_plus_one_and_padding_stays_zero():
    """All-zero input with binary activations: sign(0) = +1 inside, 0 in the
    padding, so a 3x3 SAME all-ones conv counts the in-image taps."""
    x = tf.zeros([1, 3, 3, 1])
    w = tapehook.mark_binary(tf.Variable(tf.ones([3, 3, 1, 1])), activations=True)
    y = tf.nn.conv2d(x, w, 1, "SAME")[0, :, :, 0]
    np.testing.assert_array_equal(y, [[4, 6, 4], [6, 9, 6], [4, 6, 4]])


def _f64_bits(value):
    return int(np.float64(value).view(np.int64))


CLIP = 0.1
# Values on both sides of clip = 0.1 that float32 cannot tell apart:
# float32(0.1) = 0.10000000149 > 0.1, and nextafter(0.1, 1) < that.
EDGE = [
    CLIP,
    np.nextafter(CLIP, 1.0),
    -CLIP,
    -np.nextafter(CLIP, 1.0),
    np.nextafter(CLIP, 0.0),
    0.5,
]


def _edge_problem():
    """A 1x1 conv, one input channel, over the edge values: x holds them as
    pixels, w as output channels, so each mask decides one term of dX / dW."""
    edge = np.array(EDGE, np.float64)
    x = edge.reshape(1, 1, len(EDGE), 1)
    w = edge.reshape(1, 1, 1, len(EDGE))
    g = np.random.default_rng(5).normal(size=(1, 1, len(EDGE), len(EDGE)))
    mask_x = (np.abs(x[0, 0, :, 0]) <= CLIP).astype(float)
    mask_w = (np.abs(w[0, 0, 0, :]) <= CLIP).astype(float)
    sx, sw = np.where(x[0, 0, :, 0] >= 0, 1.0, -1.0), np.where(w[0, 0, 0, :] >= 0, 1.0, -1.0)
    gm = g[0, 0]
    dx = (gm @ sw * mask_x).reshape(x.shape)  # dX[p] = sum_o g[p, o] sign(w_o) e'(x_p)
    dw = (sx @ gm * mask_w).reshape(w.shape)  # dW[o] = sum_p sign(x_p) g[p, o] e'(w_o)
    assert mask_x.tolist() == [1, 0, 1, 0, 1, 0]  # the edge is really tested
    return x, w, g, dx, dw


@pytest.mark.parametrize("packed", [False, True])
def test_float64_clip_mask_is_exact_in_the_ops(packed):
    """Bug #15.8 (C++ side): with float64 inputs the ops compare |t| <= clip in
    double against clip_f64_bits, not against the float attr widened to
    0.10000000149 (which would pass nextafter(0.1, 1))."""
    x, w, g, want_dx, want_dw = _edge_problem()
    lib = tapehook.kernels.library()
    attrs = dict(
        strides=[1, 1, 1, 1],
        padding="VALID",
        scale="none",
        weight_estimator="ste_sign",
        activation_estimator="ste_sign",
        clip=np.float32(CLIP).item(),
        clip_f64_bits=_f64_bits(CLIP),
    )
    if packed:
        bits = lib.tapehook_pack_input(x, clip=attrs["clip"], clip_f64_bits=attrs["clip_f64_bits"])
        dx = lib.tapehook_binary_conv2d_backprop_input_packed(bits, w, g, channels=1, **attrs)
        dw = lib.tapehook_binary_conv2d_backprop_filter_packed(bits, w, g, channels=1, **attrs)
    else:
        dx = lib.tapehook_binary_conv2d_backprop_input(x, w, g, **attrs)
        dw = lib.tapehook_binary_conv2d_backprop_filter(x, w, g, **attrs)
    np.testing.assert_allclose(dx.numpy(), want_dx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw.numpy(), want_dw, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pack_inputs", ["1", "0"])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_float64_clip_mask_is_exact(monkeypatch, mode, pack_inputs):
    """Bug #15.8 through the public API (TAPEHOOK_DISPATCH=kernels, the suite's
    default): a float64 conv with clip=0.1 masks both gradients with exactly
    1{|t| <= 0.1}, with the input kept as packed bits or as floats."""
    monkeypatch.setenv("TAPEHOOK_PACK_INPUTS", pack_inputs)
    x, w0, g, want_dx, want_dw = _edge_problem()
    x = tf.constant(x)
    w = tapehook.mark_binary(tf.Variable(w0), activations=True, clip=CLIP)

    def grads(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.nn.conv2d(x, w, 1, "VALID")
        return tape.gradient(y, [x, w], output_gradients=tf.constant(g))

    dx, dw = grads(x) if mode == "eager" else tf.function(grads)(x)
    np.testing.assert_allclose(dx.numpy(), want_dx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw.numpy(), want_dw, rtol=1e-12, atol=1e-12)
    assert tapehook.dispatch_counts()["compiled"]["backprop_filter"] == 1


@pytest.mark.parametrize("fails", [False, True])
def test_a_build_says_what_it_does(tmp_path, monkeypatch, capfd, fails):
    """A kernel build (a first import) prints one line on stderr when it starts
    (what, for which TF, where it is cached, how long) and one when it is done
    or failed; a cached library prints nothing. The compiler is stubbed: this
    checks the messages, not the compile."""
    from tapehook import kernels

    def fake_compile(root, compile_flags, link_flags, out_path, with_cuda):
        if fails:
            raise tapehook.TapehookError("compiling x.cc failed:\nerror: boom")
        out_path.write_bytes(b"not a library")

    monkeypatch.setenv("TAPEHOOK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_compile", fake_compile)
    if fails:
        with pytest.raises(tapehook.TapehookError, match="boom"):
            kernels.build()
    else:
        kernels.build()
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("tapehook: building CPU") and tf.__version__ in lines[0]
    assert str(tmp_path) in lines[0] and "about 20 s" in lines[0]
    if fails:
        assert "failed" in lines[1] and "compiling x.cc failed" in lines[1]
    else:
        assert lines[1].startswith("tapehook: built ") and str(tmp_path) in lines[1]
        kernels.build()  # cached now: silent
        assert capfd.readouterr().err == ""
