"""tapehook.larq: larq 0.14's API on Keras 3, checked against references written here.

The reference quantizers below are larq's documented forward and
pseudo-gradients written directly with tf.custom_gradient; a reference layer
is the same layer class given these (unknown to the spec mapping, so they run
as plain ops), which takes tapehook's marks and tapehook.larq.quantizers out
of the reference path.
"""

import json
import zlib

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import tapehook
import tapehook.larq as lq
from tapehook.larq import layers as lq_layers


def _mask(x, dy, clip):
    return dy if clip is None else dy * tf.cast(tf.abs(x) <= clip, dy.dtype)


def ref_sign(x):
    return tf.where(x >= 0, tf.ones_like(x), -tf.ones_like(x))


class RefQuantizer:
    """A callable larq-style quantizer the spec mapping does not know."""

    def __init__(self, kind, clip=1.0, beta=5.0):
        self.kind, self.clip, self.beta = kind, clip, beta

    def __call__(self, x):
        x = tf.convert_to_tensor(x)
        kind, clip, beta = self.kind, self.clip, self.beta
        alpha = (
            tf.stop_gradient(tf.reduce_mean(tf.abs(x), axis=list(range(x.shape.rank - 1))))
            if kind == "magnitude"
            else 1.0
        )

        @tf.custom_gradient
        def q(x):
            def grad(dy):
                if kind in ("ste", "magnitude"):
                    return _mask(x, dy, clip)
                if kind == "approx":
                    return dy * tf.where(tf.abs(x) <= 1, 2 - 2 * tf.abs(x), tf.zeros_like(x))
                bx = beta * x  # swish
                return dy * beta * (2 - bx * tf.tanh(bx / 2)) / (1 + tf.cosh(bx))

            return ref_sign(x), grad

        return alpha * q(x)


def _lq(kind, clip=1.0, beta=5.0):
    return {
        "ste": lambda: lq.quantizers.SteSign(clip_value=clip),
        "approx": lq.quantizers.ApproxSign,
        "swish": lambda: lq.quantizers.SwishSign(beta=beta),
        "magnitude": lambda: lq.quantizers.MagnitudeAwareSign(clip_value=clip),
    }[kind]()


# (layer class, constructor kwargs, input quantizer, kernel quantizer(s), input shape,
#  whether tapehook's marks run it)
CASES = {
    "conv2d_ste": (
        lq.layers.QuantConv2D,
        dict(filters=5, kernel_size=3, padding="same"),
        ("ste",),
        ("ste",),
        (2, 7, 6, 3),
        True,
    ),
    "conv2d_pad1": (
        lq.layers.QuantConv2D,
        dict(filters=4, kernel_size=3, padding="same", pad_values=1.0),
        ("ste",),
        ("ste",),
        (2, 6, 6, 3),
        True,
    ),
    "conv2d_bireal": (
        lq.layers.QuantConv2D,
        dict(filters=4, kernel_size=3, strides=2),
        ("approx",),
        ("magnitude",),
        (2, 9, 8, 3),
        True,
    ),
    "conv2d_swish10": (
        lq.layers.QuantConv2D,
        dict(filters=4, kernel_size=3, padding="same"),
        ("swish", 1.0, 10.0),
        ("swish", 1.0, 10.0),
        (2, 6, 6, 2),
        True,
    ),
    "conv2d_clips": (
        lq.layers.QuantConv2D,
        dict(filters=4, kernel_size=3, dilation_rate=2, padding="same"),
        ("ste", 0.5),
        ("ste", 1.3),
        (2, 8, 8, 3),
        True,
    ),
    "conv2d_weights_only": (
        lq.layers.QuantConv2D,
        dict(filters=4, kernel_size=2),
        None,
        ("ste",),
        (2, 5, 5, 3),
        True,
    ),
    "conv2d_ban": (
        lq.layers.QuantConv2D,
        dict(filters=4, kernel_size=3, padding="same"),
        ("ste", 0.7),
        None,
        (2, 6, 6, 3),
        True,
    ),
    "dense_ban_swish": (
        lq.layers.QuantDense,
        dict(units=5),
        ("swish", 1.0, 3.0),
        None,
        (3, 8),
        True,
    ),
    "conv2d_weights_only_pad1_noclip": (
        lq.layers.QuantConv2D,
        dict(filters=4, kernel_size=3, padding="same", pad_values=1.0),
        None,
        ("ste", None),
        (2, 5, 5, 3),
        True,
    ),
    "conv1d": (
        lq.layers.QuantConv1D,
        dict(filters=4, kernel_size=3, padding="same"),
        ("ste",),
        ("ste",),
        (2, 9, 3),
        True,
    ),
    "dense_magnitude": (
        lq.layers.QuantDense,
        dict(units=6),
        ("ste",),
        ("magnitude",),
        (3, 10),
        True,
    ),
    "depthwise": (
        lq.layers.QuantDepthwiseConv2D,
        dict(kernel_size=3, padding="same"),
        ("ste",),
        ("ste",),
        (2, 6, 6, 3),
        True,
    ),
    "depthwise_magnitude": (
        lq.layers.QuantDepthwiseConv2D,
        dict(kernel_size=3, depth_multiplier=2),
        ("ste",),
        ("magnitude",),
        (2, 6, 6, 3),
        False,
    ),
    "conv3d": (
        lq.layers.QuantConv3D,
        dict(filters=3, kernel_size=2),
        ("ste",),
        ("ste",),
        (2, 4, 4, 4, 2),
        False,
    ),
    "conv2d_transpose": (
        lq.layers.QuantConv2DTranspose,
        dict(filters=3, kernel_size=3),
        ("ste",),
        ("ste",),
        (2, 4, 4, 2),
        False,
    ),
    "separable2d": (
        lq.layers.QuantSeparableConv2D,
        dict(filters=3, kernel_size=3, padding="same", pad_values=1.0),
        ("ste",),
        (("ste",), ("approx",)),
        (2, 6, 6, 2),
        False,
    ),
    "conv1d_causal": (
        lq.layers.QuantConv1D,
        dict(filters=3, kernel_size=3, padding="causal"),
        ("ste",),
        ("ste",),
        (2, 7, 2),
        False,
    ),
}


def _make(cls, kwargs, input_q, kernel_q, make):
    kwargs = dict(kwargs)
    if input_q is not None:
        kwargs["input_quantizer"] = make(*input_q)
    names = list(cls._kernels.values())
    if kernel_q is None:
        return cls(**kwargs)
    kernel_qs = kernel_q if isinstance(kernel_q[0], tuple) else (kernel_q,)
    for name, q in zip(names, kernel_qs):
        kwargs[name] = make(*q)
    return cls(**kwargs)


def _result(layer, x, g, mode):
    variables = layer.trainable_variables

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
            loss = tf.reduce_sum(y * g)
        return y, tape.gradient(loss, [x] + variables)

    if mode == "function":
        step = tf.function(step)
    y, grads = step(tf.constant(x))
    return [y.numpy()] + [gr.numpy() for gr in grads]


@pytest.mark.parametrize("pack", ["float32", "1"])
@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_matches_reference(monkeypatch, case, mode, pack):
    """The drop-in layer against the same layer on the reference quantizers
    (larq's math). With TAPEHOOK_PACK_INPUTS=float32 every result to float32
    rounding; by default a continuous input estimator's e'(x) is kept in
    fixed point (within 1.53e-5 for approx_sign, 4.1e-5 for swish_sign), so
    dX is within that times |dX_hat| <= taps * filters * max|W| * max|g|
    (binarized weights scaled by at most max|W|)."""
    monkeypatch.setenv("TAPEHOOK_PACK_INPUTS", pack)
    cls, kwargs, input_q, kernel_q, shape, marked = CASES[case]
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    x = rng.normal(size=shape).astype("float32")
    layer = _make(cls, kwargs, input_q, kernel_q, _lq)
    ref = _make(cls, kwargs, input_q, kernel_q, RefQuantizer)
    layer.build(shape)
    ref.build(shape)
    assert (layer.binary_spec is not None) == marked, layer.binary_spec
    assert ref.binary_spec is None
    weights = [rng.uniform(-1.5, 1.5, size=w.shape).astype("float32") for w in layer.weights]
    layer.set_weights(weights)
    ref.set_weights(weights)
    y_shape = ref(x).shape
    g = rng.normal(size=y_shape).astype("float32")
    got, want = _result(layer, x, g, mode), _result(ref, x, g, mode)
    assert got[0].shape == want[0].shape
    spec = layer.binary_spec
    dx_atol = 1e-4
    if (
        pack == "1"
        and spec is not None
        and spec.activation_estimator in ("approx_sign", "swish_sign")
    ):
        kernel = np.abs(weights[0])
        dx_hat = (
            kernel.shape[0] * kernel.shape[1] * kernel.shape[-1] * kernel.max() * np.abs(g).max()
        )
        dx_atol += 4.15e-5 * dx_hat
    for i, (a, b) in enumerate(zip(got, want)):
        atol = dx_atol if i == 1 else 1e-4
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=atol, err_msg=f"{case} item {i}")
    if marked:  # the output is not float garbage: binary inputs give integer sums
        assert np.abs(got[0]).max() > 0


def test_pad_values_one_is_larq_padding():
    """pad_values=1.0 pads the quantized input with +1 (not zeros)."""
    x = np.random.default_rng(3).normal(size=(1, 5, 5, 2)).astype("float32")
    layer = lq.layers.QuantConv2D(
        1,
        3,
        padding="same",
        pad_values=1.0,
        input_quantizer="ste_sign",
        kernel_quantizer="ste_sign",
        use_bias=False,
    )
    layer.build(x.shape)
    w = np.random.default_rng(4).normal(size=(3, 3, 2, 1)).astype("float32")
    layer.set_weights([w])
    padded = np.pad(
        np.where(x >= 0, 1.0, -1.0), [(0, 0), (1, 1), (1, 1), (0, 0)], constant_values=1.0
    )
    want = tf.nn.conv2d(
        padded.astype("float32"), np.where(w >= 0, 1.0, -1.0).astype("float32"), 1, "VALID"
    ).numpy()
    np.testing.assert_allclose(layer(x).numpy(), want, atol=1e-5)
    assert layer.binary_spec.pad_value == 1.0


def test_spec_mapping():
    spec = lq_layers._spec_for(lq.quantizers.SteSign(), lq.quantizers.SteSign())
    assert tapehook.BinarySpec(**spec) == tapehook.BinarySpec(
        activations=True, ste="ste_sign", clip=1.0
    )
    spec = lq_layers._spec_for(lq.quantizers.SteSign(0.7), None)
    assert tapehook.BinarySpec(**spec) == tapehook.BinarySpec(
        weights=False, activations=True, ste="ste_sign", clip=0.7
    )
    spec = lq_layers._spec_for(
        lq.quantizers.SteSign(0.5), lq.quantizers.SteSign(1.3), pad_values=1.0
    )
    assert tapehook.BinarySpec(**spec) == tapehook.BinarySpec(
        activations=True, clip=1.3, activation_clip=0.5, pad_value=1.0
    )
    spec = lq_layers._spec_for(lq.quantizers.ApproxSign(), lq.quantizers.MagnitudeAwareSign())
    assert tapehook.BinarySpec(**spec) == tapehook.BinarySpec(
        activations="approx_sign", ste="ste_sign", scale="mean_abs"
    )
    assert lq_layers._spec_for(None, lq.quantizers.SteTern()) is None
    assert lq_layers._spec_for(lq.quantizers.DoReFa(), lq.quantizers.SteSign()) is None
    assert lq_layers._spec_for(None, None) is None
    spec = lq_layers._spec_for(None, lq.quantizers.SteSign(None), pad_values=1.0)
    assert tapehook.BinarySpec(**spec) == tapehook.BinarySpec(clip=None, pad_value=1.0)
    assert (
        lq_layers._spec_for(lq.quantizers.SteSign(), lq.quantizers.SteSign(), pad_values=0.5)
        is None
    )


@pytest.mark.parametrize(
    "name,cls,x,fwd,grad",
    [
        (
            "ste_sign",
            lq.quantizers.SteSign,
            [-2, -1, -0.5, 0, 0.5, 1, 1.5],
            [-1, -1, -1, 1, 1, 1, 1],
            [0, 1, 1, 1, 1, 1, 0],
        ),
        (
            "approx_sign",
            lq.quantizers.ApproxSign,
            [-2, -0.5, 0, 0.25, 1],
            [-1, -1, 1, 1, 1],
            [0, 1, 2, 1.5, 0],
        ),
        (
            "ste_heaviside",
            lq.quantizers.SteHeaviside,
            [-2, -0.5, 0, 0.5, 2],
            [0, 0, 0, 1, 1],
            [0, 1, 1, 1, 0],
        ),
        (
            "ste_tern",
            lq.quantizers.SteTern,
            [-2, -0.05, -0.01, 0, 0.05, 0.5],
            [-1, -1, 0, 0, 1, 1],
            [0, 1, 1, 1, 1, 1],
        ),
    ],
)
def test_quantizer_by_name(name, cls, x, fwd, grad):
    q = lq.quantizers.get(name)
    assert type(q) is cls
    t = tf.constant(x, tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(t)
        y = q(t)
    np.testing.assert_array_equal(y.numpy(), fwd)
    np.testing.assert_allclose(tape.gradient(y, t).numpy(), grad, atol=1e-6)
    back = lq.quantizers.deserialize(lq.quantizers.serialize(q))
    assert type(back) is cls


def test_swish_dorefa_noop_math():
    x = np.linspace(-2, 2, 17).astype("float32")
    t = tf.constant(x)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(t)
        swish = lq.quantizers.SwishSign(beta=3.0)(t)
        dorefa = lq.quantizers.DoReFa(k_bit=2, mode="activations")(t)
    b = 3.0 * x
    np.testing.assert_allclose(
        tape.gradient(swish, t).numpy(),
        3.0 * (2 - b * np.tanh(b / 2)) / (1 + np.cosh(b)),
        rtol=1e-5,
    )
    np.testing.assert_allclose(dorefa.numpy(), np.round(np.clip(x, 0, 1) * 3) / 3, atol=1e-6)
    np.testing.assert_allclose(
        tape.gradient(dorefa, t).numpy(), ((x >= 0) & (x <= 1)).astype("float32")
    )
    assert lq.quantizers.NoOp(precision=1)(t).numpy().tolist() == x.tolist()
    np.testing.assert_array_equal(lq.math.sign(t).numpy(), np.where(x >= 0, 1, -1))
    np.testing.assert_array_equal(lq.math.heaviside(t).numpy(), (x > 0).astype("float32"))


def _model(pad=1.0):
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(8, 3, padding="same"),
            keras.layers.BatchNormalization(),
            lq.layers.QuantConv2D(
                8,
                3,
                padding="same",
                pad_values=pad,
                use_bias=False,
                input_quantizer="ste_sign",
                kernel_quantizer="ste_sign",
                kernel_constraint="weight_clip",
            ),
            keras.layers.BatchNormalization(),
            keras.layers.GlobalAveragePooling2D(),
            lq.layers.QuantDense(
                3,
                input_quantizer="ste_sign",
                kernel_quantizer="ste_sign",
                kernel_constraint="weight_clip",
            ),
        ]
    )


def _data(n=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8, 8, 1)).astype("float32")
    return x, (x.mean(axis=(1, 2, 3)) > 0).astype("int64") + (x[:, 0, 0, 0] > 1)


def test_case_optimizer_bop_fit_and_weight_clip():
    model = _model()
    opt = lq.optimizers.CaseOptimizer(
        (lq.optimizers.Bop.is_binary_variable, lq.optimizers.Bop(threshold=1e-6, gamma=1e-2)),
        default_optimizer=keras.optimizers.Adam(0.01),
    )
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data()
    before = [v.numpy().copy() for v in model.trainable_variables]
    model.fit(x, y, epochs=2, batch_size=16, verbose=0)
    for var, old in zip(model.trainable_variables, before):
        assert not np.array_equal(var.numpy(), old), var.path
        if lq.optimizers.Bop.is_binary_variable(var):
            assert set(np.unique(var.numpy())) <= {-1.0, 1.0}
    with pytest.raises(TypeError):
        lq.optimizers.CaseOptimizer((False, lq.optimizers.Bop()))
    # WeightClip with Adam: latent weights stay in [-1, 1].
    model = _model()
    model.compile(
        keras.optimizers.Adam(0.5), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    assert np.abs(model.layers[2].kernel.numpy()).max() <= 1.0


def test_keras_save_load_and_quantized_scope(tmp_path):
    model = _model()
    x, _ = _data(8)
    want = model.predict(x, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    back = keras.models.load_model(path)
    np.testing.assert_allclose(back.predict(x, verbose=0), want, rtol=1e-6)
    assert back.layers[2].binary_spec == model.layers[2].binary_spec is not None
    latent = model.layers[2].get_weights()[0]
    with lq.context.quantized_scope(True):
        quantized = model.layers[2].get_weights()[0]
        np.testing.assert_array_equal(model.layers[2].kernel.numpy(), quantized)
    np.testing.assert_array_equal(quantized, np.where(latent >= 0, 1.0, -1.0))


def test_locally_connected_errors():
    with pytest.raises(tapehook.TapehookError, match="Keras 3 has no LocallyConnected"):
        lq.layers.QuantLocallyConnected2D(3, 3)


def _write_layer_weights(group, layers):
    """larq / tf-keras HDF5 weights layout, as larq 0.14 with tf-keras 2.21 writes it
    (checked against files it saved): attrs backend, keras_version and
    layer_names (every layer, weightless ones too); one group per layer whose
    weight_names attr lists "<layer>/<weight>:0" and whose datasets sit at
    <layer>/<layer>/<weight>:0; an empty top_level_model_weights group."""
    group.attrs["backend"] = "tensorflow"
    group.attrs["keras_version"] = "2.21.0"
    group.attrs["layer_names"] = np.array([name for name, _ in layers], dtype=object)
    for layer, values in layers + [("top_level_model_weights", [])]:
        sub = group.create_group(layer)
        names = [f"{layer}/{w}:0" for w, _ in values]
        sub.attrs["weight_names"] = (
            np.array(names, dtype=object) if names else np.array([], dtype="float64")
        )
        for (_, value), name in zip(values, names):
            sub.create_dataset(name, data=value)


def _tf_keras_layers(rng):
    """(name, [(weight, value)]) for _model()'s layers, in tf-keras's names."""
    names = [
        ("input_1", []),
        ("conv2d", ["kernel", "bias"]),
        ("batch_normalization", ["gamma", "beta", "moving_mean", "moving_variance"]),
        ("quant_conv2d", ["kernel"]),
        ("batch_normalization_1", ["gamma", "beta", "moving_mean", "moving_variance"]),
        ("global_average_pooling2d", []),
        ("quant_dense", ["kernel", "bias"]),
    ]
    shapes = {
        "conv2d": [(3, 3, 1, 8), (8,)],
        "quant_conv2d": [(3, 3, 8, 8)],
        "quant_dense": [(8, 3), (3,)],
    }
    layers = []
    for name, weights in names:
        values = []
        for i, w in enumerate(weights):
            shape = shapes[name][i] if name in shapes else (8,)
            value = (
                rng.uniform(0.5, 1.5, shape) if w == "moving_variance" else rng.normal(size=shape)
            )
            values.append((w, value.astype("float32")))
        layers.append((name, values))
    return layers


def _reference_forward(layers, x):
    """_model()'s inference forward in NumPy-fed TF ops, larq's math."""
    weights = [[v for _, v in values] for _, values in layers if values]
    (k0, b0), bn1, (k1,), bn2, (k2, b2) = weights

    def bn(t, p):
        gamma, beta, mean, var = p
        return (t - mean) / np.sqrt(var + 1e-3) * gamma + beta

    def sign(t):
        return np.where(t >= 0, 1.0, -1.0).astype("float32")

    h = bn(tf.nn.conv2d(x, k0, 1, "SAME").numpy() + b0, bn1)
    h = np.pad(sign(h), [(0, 0), (1, 1), (1, 1), (0, 0)], constant_values=1.0)
    h = bn(tf.nn.conv2d(h.astype("float32"), sign(k1), 1, "VALID").numpy(), bn2)
    return sign(h.mean(axis=(1, 2))) @ sign(k2) + b2


def test_load_larq_h5_weights(tmp_path):
    """A larq (tf-keras) save_weights file loads by position into the same
    architecture built with tapehook.larq; outputs follow larq's math."""
    layers = _tf_keras_layers(np.random.default_rng(5))
    path = str(tmp_path / "larq_weights.h5")
    with h5py.File(path, "w") as f:
        _write_layer_weights(f, layers)
    model = _model()
    model.load_weights(path)
    flat = [v for _, values in layers for _, v in values]
    for var, value in zip(model.weights, flat):
        np.testing.assert_array_equal(var.numpy(), value)
    x, _ = _data(4)
    np.testing.assert_allclose(
        model.predict(x, verbose=0), _reference_forward(layers, x), rtol=1e-4, atol=1e-4
    )


def _quantizer_config(cls, name, **config):
    return {
        "module": "larq.quantizers",
        "class_name": cls,
        "registered_name": cls,
        "config": {"name": name, "trainable": True, "dtype": "float32", **config},
    }


def _legacy_model_config():
    """_model() as larq 0.14 / tf-keras 2.21 writes model_config in a .h5 file."""
    clip = {
        "module": "larq.constraints",
        "class_name": "weight_clip",
        "config": {"clip_value": 1},
        "registered_name": "weight_clip",
    }

    def quant(cls, name, extra):
        return {
            "class_name": cls,
            "config": {
                "name": name,
                "trainable": True,
                "dtype": "float32",
                "activation": "linear",
                "kernel_regularizer": None,
                "bias_regularizer": None,
                "activity_regularizer": None,
                "kernel_constraint": clip,
                "bias_constraint": None,
                "input_quantizer": _quantizer_config("SteSign", name + "_in", clip_value=1.0),
                "kernel_quantizer": _quantizer_config("SteSign", name + "_k", clip_value=1.0),
                **extra,
            },
        }

    def bn(name):
        return {
            "class_name": "BatchNormalization",
            "config": {
                "name": name,
                "trainable": True,
                "dtype": "float32",
                "axis": [3],
                "momentum": 0.99,
                "epsilon": 0.001,
                "center": True,
                "scale": True,
            },
        }

    layers = [
        {
            "class_name": "InputLayer",
            "config": {
                "batch_input_shape": [None, 8, 8, 1],
                "dtype": "float32",
                "sparse": False,
                "ragged": False,
                "name": "input_1",
            },
        },
        {
            "class_name": "Conv2D",
            "config": {
                "name": "conv2d",
                "trainable": True,
                "dtype": "float32",
                "filters": 8,
                "kernel_size": [3, 3],
                "strides": [1, 1],
                "padding": "same",
                "data_format": "channels_last",
                "dilation_rate": [1, 1],
                "groups": 1,
                "activation": "linear",
                "use_bias": True,
            },
        },
        bn("batch_normalization"),
        quant(
            "QuantConv2D",
            "quant_conv2d",
            {
                "filters": 8,
                "kernel_size": [3, 3],
                "strides": [1, 1],
                "padding": "same",
                "data_format": "channels_last",
                "dilation_rate": [1, 1],
                "groups": 1,
                "use_bias": False,
                "pad_values": 1.0,
            },
        ),
        bn("batch_normalization_1"),
        {
            "class_name": "GlobalAveragePooling2D",
            "config": {
                "name": "global_average_pooling2d",
                "trainable": True,
                "dtype": "float32",
                "data_format": "channels_last",
                "keepdims": False,
            },
        },
        quant("QuantDense", "quant_dense", {"units": 3, "use_bias": True}),
    ]
    return {"class_name": "Sequential", "config": {"name": "sequential", "layers": layers}}


def test_load_larq_legacy_h5_model(tmp_path):
    """A larq legacy .h5 model (config + weights) loads with keras.models.load_model."""
    layers = _tf_keras_layers(np.random.default_rng(6))
    path = str(tmp_path / "larq_model.h5")
    with h5py.File(path, "w") as f:
        f.attrs["backend"] = "tensorflow"
        f.attrs["keras_version"] = "2.21.0"
        f.attrs["model_config"] = json.dumps(_legacy_model_config())
        # Sequential files list the layers without the InputLayer.
        _write_layer_weights(f.create_group("model_weights"), layers[1:])
    model = keras.models.load_model(path, compile=False)
    kinds = [type(layer).__name__ for layer in model.layers]
    assert kinds == [
        "Conv2D",
        "BatchNormalization",
        "QuantConv2D",
        "BatchNormalization",
        "GlobalAveragePooling2D",
        "QuantDense",
    ], kinds
    assert model.layers[2].binary_spec.pad_value == 1.0
    assert isinstance(model.layers[2].kernel_constraint, lq.constraints.WeightClip)
    x, _ = _data(4)
    np.testing.assert_allclose(
        model.predict(x, verbose=0), _reference_forward(layers, x), rtol=1e-4, atol=1e-4
    )


def test_quantizer_functions_in_v1_graph():
    """The quantizer functions are plain TF ops: tf.compat.v1 graphs and tf.gradients."""
    values = np.array([-2.0, -0.7, 0.0, 0.4, 1.2], "float32")
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [5])
        outputs = [
            lq.quantizers.ste_sign(x, clip_value=0.5),
            lq.quantizers.approx_sign(x),
            lq.quantizers.swish_sign(x, beta=2.0),
        ]
        grads = [tf.gradients(y, x)[0] for y in outputs]
        with tf.compat.v1.Session() as sess:
            ys, gs = sess.run([outputs, grads], {x: values})
    for y in ys:
        np.testing.assert_array_equal(y, np.where(values >= 0, 1, -1))
    np.testing.assert_array_equal(gs[0], (np.abs(values) <= 0.5).astype("float32"))
    np.testing.assert_allclose(
        gs[1], np.where(np.abs(values) <= 1, 2 - 2 * np.abs(values), 0), rtol=1e-6
    )
    b = 2.0 * values
    np.testing.assert_allclose(gs[2], 2.0 * (2 - b * np.tanh(b / 2)) / (1 + np.cosh(b)), rtol=1e-5)


@pytest.mark.slow
def test_quicknet_example_trains():
    """examples/larq_quicknet.py: larq-zoo's QuickNet via tapehook.larq, Bop + Adam."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "examples" / "larq_quicknet.py"
    spec = importlib.util.spec_from_file_location("larq_quicknet", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.quicknet((32, 32, 1), 10)
    marked = [
        layer.binary_spec for layer in model.layers if isinstance(layer, lq.layers.QuantConv2D)
    ]
    assert len(marked) == 4 and all(
        spec == tapehook.BinarySpec(activations=True, clip=1.25, pad_value=1.0) for spec in marked
    ), marked
    accuracy = example.main(["--epochs", "4", "--bop"])
    assert accuracy >= 0.9, accuracy


@pytest.mark.parametrize("kernel_quantizer", ["ste_sign", "ste_tern"])
def test_mixed_float16(kernel_quantizer):
    """Under mixed_float16 the kernel is quantized as the layer computes (float16),
    on tapehook's marks (ste_sign) and on plain ops (ste_tern) alike."""
    x = np.random.default_rng(7).normal(size=(4, 6, 6, 3)).astype("float32")

    def build():
        return keras.Sequential(
            [
                keras.Input((6, 6, 3)),
                lq.layers.QuantConv2D(
                    4,
                    3,
                    padding="same",
                    input_quantizer="ste_sign",
                    kernel_quantizer=kernel_quantizer,
                    kernel_constraint="weight_clip",
                ),
                keras.layers.Activation("linear", dtype="float32"),
            ]
        )

    reference = build()
    want = reference(x).numpy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = build()
        model.set_weights(reference.get_weights())
        assert model.layers[0].compute_dtype == "float16"
        np.testing.assert_allclose(model(x).numpy(), want, rtol=1e-3, atol=1e-3)
        model.compile(keras.optimizers.Adam(0.01), "mse")
        before = model.layers[0].kernel.numpy().copy()
        model.fit(x, np.ones_like(want), epochs=2, verbose=0)
        assert not np.array_equal(model.layers[0].kernel.numpy(), before)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _ref_tern(w, threshold=0.05):
    return np.where(w > threshold, 1.0, np.where(w < -threshold, -1.0, 0.0))


@pytest.mark.parametrize("kernel_quantizer", ["ste_sign", "ste_tern"])
def test_flip_ratio_metric_in_fit(kernel_quantizer):
    """Under metrics_scope(["flip_ratio"]) fit logs the mean share of quantized
    kernel values that changed from one step to the next, for a kernel on
    tapehook's marks (ste_sign) and on plain ops (ste_tern)."""
    quantize = {"ste_sign": lambda w: np.where(w >= 0, 1.0, -1.0), "ste_tern": _ref_tern}

    def build():
        keras.utils.set_random_seed(3)
        return keras.Sequential(
            [
                keras.Input((16,)),
                lq.layers.QuantDense(
                    8, kernel_quantizer=kernel_quantizer, kernel_constraint="weight_clip"
                ),
            ]
        )

    rng = np.random.default_rng(3)
    x = rng.normal(size=(96, 16)).astype("float32")
    y = rng.normal(size=(96, 8)).astype("float32")
    plain = build()
    plain.compile(keras.optimizers.SGD(0.5), "mse")
    assert not any("flip_ratio" in k for k in plain.fit(x, y, verbose=0).history)

    with lq.context.metrics_scope(["flip_ratio"]):
        model = build()
    layer = model.layers[0]
    assert (layer.binary_spec is not None) == (kernel_quantizer == "ste_sign")
    assert [m.name for m in layer.metrics] == [f"flip_ratio/{layer.kernel_quantizer.name}"]
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: seen.append(
            quantize[kernel_quantizer](layer.kernel.numpy())
        )
    )
    model.compile(keras.optimizers.SGD(0.5), "mse")
    history = model.fit(x, y, batch_size=8, shuffle=False, callbacks=[record], verbose=0)
    flips = [np.mean(a != b) for a, b in zip(seen, seen[1:])]
    assert len(seen) == 12 and 0 < np.mean(flips) < 1
    logged = history.history[layer.metrics[0].name]
    np.testing.assert_allclose(logged, [np.mean(flips)], rtol=1e-5)


def test_larq_names_resolve_in_keras(tmp_path):
    """ "hard_tanh", "leaky_tanh" and "weight_clip" resolve through Keras's own
    get / serialize / deserialize and in stock Keras layers, saved and loaded;
    Keras's own names are untouched."""
    assert keras.activations.get("hard_tanh") is lq.activations.hard_tanh
    assert keras.activations.get("leaky_tanh") is lq.activations.leaky_tanh
    assert keras.activations.get("relu") is keras.activations.relu
    for fn in (lq.activations.hard_tanh, lq.activations.leaky_tanh):
        assert keras.activations.deserialize(keras.activations.serialize(fn)) is fn
    clip = keras.constraints.get("weight_clip")
    assert type(clip) is lq.constraints.weight_clip and clip.clip_value == 1
    back = keras.constraints.deserialize(
        keras.constraints.serialize(lq.constraints.WeightClip(0.3))
    )
    assert type(back) is lq.constraints.WeightClip and back.clip_value == 0.3
    assert type(keras.constraints.get("non_neg")) is keras.constraints.NonNeg

    x = np.linspace(-3, 3, 24, dtype="float32").reshape(4, 6)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(6, activation="leaky_tanh", kernel_constraint="weight_clip"),
            keras.layers.Activation("hard_tanh"),
        ]
    )
    model.layers[0].set_weights([2 * np.eye(6, dtype="float32"), np.zeros(6, "float32")])
    h = 2 * x
    leaky = np.where(h < -1, -1 + 0.2 * (h + 1), np.where(h > 1, 1 + 0.2 * (h - 1), h))
    want = np.clip(leaky, -1, 1)
    np.testing.assert_allclose(model.predict(x, verbose=0), want, rtol=1e-6)
    path = str(tmp_path / "names.keras")
    model.save(path)
    back = keras.models.load_model(path)
    assert back.layers[0].activation is lq.activations.leaky_tanh
    assert isinstance(back.layers[0].kernel_constraint, lq.constraints.WeightClip)
    np.testing.assert_allclose(back.predict(x, verbose=0), want, rtol=1e-6)


def test_model_profile_counts():
    """ModelProfile counts parameters by bit width, memory and MACs by precision
    from the layers' shapes: a tapehook-marked Keras conv's kernel is 1-bit, a
    binary input makes its MACs binary, Dense on a sequence does kernel x steps."""
    conv = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)
    model = keras.Sequential(
        [
            keras.Input((10, 10, 4)),
            conv,
            lq.layers.QuantConv2D(
                16,
                3,
                strides=2,
                input_quantizer="ste_sign",
                kernel_quantizer="ste_sign",
                kernel_constraint="weight_clip",
            ),
            keras.layers.Reshape((16, 16)),
            keras.layers.Dense(5),
        ]
    )
    tapehook.marks.mark_binary(conv.kernel)
    profiles = lq.models.ModelProfile(model).layer_profiles
    # (weights per bit width, input precision, output pixels, MACs per precision)
    want = [
        ({1: 3 * 3 * 4 * 8}, None, 100, {32: 3 * 3 * 4 * 8 * 100}),
        ({1: 3 * 3 * 8 * 16, 32: 16}, 1, 16, {1: 3 * 3 * 8 * 16 * 16}),
        ({}, None, 16, {}),
        ({32: 16 * 5 + 5}, None, 16, {32: 16 * 5 * 16}),
    ]
    for profile, (bits, input_precision, pixels, macs) in zip(profiles, want, strict=True):
        assert {b: profile.weight_count(b) for b in profile.unique_param_bidtwidths} == bits
        assert profile.memory == sum(b * n for b, n in bits.items())
        assert profile.input_precision == input_precision
        assert profile.output_pixels == pixels
        assert {p: profile.op_count("mac", p) for p in profile.unique_op_precisions} == macs
    assert profiles[2].op_count("mac") is None  # Reshape: MACs unknown
    assert [p.runs_on for p in profiles] == ["", "tapehook kernels", "", ""]
    lines = []
    lq.models.summary(model, print_fn=lines.append)
    stats, totals = (text.splitlines() for text in lines)
    assert stats[0].startswith(f"+{model.name} stats")
    row = next(line for line in stats if line.startswith(f"| {profiles[1].name} "))
    assert row.split()[-5:-3] == [str(3 * 3 * 8 * 16 * 16), "0"] and "tapehook kernels" in row
    ratio = 3 * 3 * 8 * 16 * 16 / sum(sum(m.values()) for *_, m in want)
    assert f"| Ratio of MACs that are binarized  {ratio:.4f}" in "\n".join(totals)
    with pytest.raises(ValueError, match="not yet been built"):
        lq.models.summary(keras.Sequential([keras.layers.Dense(2)]))
