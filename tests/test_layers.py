"""tapehook.layers.BatchNormalization against Keras 3's BatchNormalization
(the independent reference: the same math on other ops) and a NumPy
reference: outputs, gradients and moving statistics, in eager, tf.function,
Keras fit and MirroredStrategy; that training calls run the fused op, and
where and why they do not."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tapehook
from tapehook.layers import BatchNormalization

from conftest import fit_mirrored, inference_gradients, taped_inference_op_types

CONFIGS = {
    "default": {},
    "momentum_eps": dict(momentum=0.5, epsilon=1e-5),
    "no_center": dict(center=False),
    "no_scale_no_center": dict(scale=False, center=False),
}
SHAPES = {2: (6, 5), 3: (4, 3, 5), 4: (3, 4, 5, 6), 5: (2, 3, 2, 4, 5)}


def _pair(shape, seed=0, **kwargs):
    """Keras's layer and tapehook's, built, with the same random weights."""
    ref, ours = keras.layers.BatchNormalization(**kwargs), BatchNormalization(**kwargs)
    ref.build(shape)
    ours.build(shape)
    rng = np.random.default_rng(seed)
    for a, b in zip(ref.weights, ours.weights):
        value = rng.uniform(0.5, 1.5, a.shape).astype(np.float32)
        a.assign(value)
        b.assign(value)
    return ref, ours


def _inputs(shape, seed=1):
    rng = np.random.default_rng(seed)
    return tf.constant((rng.standard_normal(shape) * 2 + 0.5).astype(np.float32))


def _train_call(layer, x, mode):
    """Output and gradients (x, then trainable weights) of one training call
    under a non-trivial loss."""

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * tf.sin(y + 0.3))
        return [y, *tape.gradient(loss, [x, *layer.trainable_variables])]

    return (tf.function(step) if mode == "function" else step)(x)


def _numpy_training(x, gamma, beta, mean0, var0, momentum, epsilon):
    axes = tuple(range(x.ndim - 1))
    mean, var = x.mean(axes, dtype=np.float64), x.var(axes, dtype=np.float64)
    y = (x - mean) / np.sqrt(var + epsilon) * gamma + beta
    return y, mean0 * momentum + mean * (1 - momentum), var0 * momentum + var * (1 - momentum)


def _op_types(fn, *args):
    return {op.type for op in fn.get_concrete_function(*args).graph.get_operations()}


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("rank", list(SHAPES))
def test_training_matches_keras_and_numpy(rank, config, mode):
    shape, kwargs = SHAPES[rank], CONFIGS[config]
    ref, ours = _pair(shape, **kwargs)
    x = _inputs(shape)
    mean0, var0 = ours.moving_mean.numpy(), ours.moving_variance.numpy()
    expected = _train_call(ref, x, mode)
    got = _train_call(ours, x, mode)
    assert len(got) == len(expected) == 2 + kwargs.get("scale", True) + kwargs.get("center", True)
    for g, e, what in zip(got, expected, ["y", "dx", "d first weight", "d second weight"]):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-5, atol=1e-5, err_msg=what)
    for a, b in ((ours.moving_mean, ref.moving_mean), (ours.moving_variance, ref.moving_variance)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    gamma = ours.gamma.numpy() if ours.scale else 1.0
    beta = ours.beta.numpy() if ours.center else 0.0
    y, mean, var = _numpy_training(x.numpy(), gamma, beta, mean0, var0, ours.momentum, ours.epsilon)
    np.testing.assert_allclose(got[0].numpy(), y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours.moving_mean.numpy(), mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ours.moving_variance.numpy(), var, rtol=1e-6, atol=1e-6)


def test_training_runs_the_fused_op_and_inference_keras_ops():
    shape = SHAPES[4]
    ref, ours = _pair(shape)
    x = _inputs(shape)

    @tf.function
    def train(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(ours(x, training=True) ** 2)
        return tape.gradient(loss, x)

    types = _op_types(train, x)
    assert {"FusedBatchNormV3", "FusedBatchNormGradV3"} <= types
    assert "SquaredDifference" not in types  # none of Keras's moments
    infer = tf.function(lambda x: ours(x, training=False))
    assert "FusedBatchNormV3" not in _op_types(infer, x)
    # Inference is Keras's own computation: bit for bit.
    np.testing.assert_array_equal(ours(x, training=False).numpy(), ref(x, training=False).numpy())
    np.testing.assert_array_equal(ours(x).numpy(), ref(x).numpy())


def test_edge_batches():
    """One value per channel (variance 0), and a batch size known only when
    the function runs."""
    ref, ours = _pair((1, 1, 1, 3))
    x = _inputs((1, 1, 1, 3))
    for g, e in zip(_train_call(ours, x, "eager"), _train_call(ref, x, "eager")):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours.moving_variance.numpy(), ref.moving_variance.numpy())
    ref, ours = _pair((None, 4, 4, 3))
    spec = [tf.TensorSpec([None, 4, 4, 3])]
    x = _inputs((5, 4, 4, 3))
    got = tf.function(lambda x: ours(x, training=True), input_signature=spec)(x)
    expected = tf.function(lambda x: ref(x, training=True), input_signature=spec)(x)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours.moving_variance.numpy(), ref.moving_variance.numpy())


@pytest.mark.parametrize(
    "make,call,why",
    [
        (dict(renorm=True), {}, "renorm=True"),
        (dict(synchronized=True), {}, "synchronized=True"),
        (dict(axis=1), {}, "axis=1"),
        ({}, dict(mask=True), "a mask"),
        ({}, dict(dtype=tf.float64), "compute dtype float64"),
    ],
)
def test_unsupported_falls_back_to_keras_or_raises_when_fused(make, call, why):
    shape = (3, 4, 5, 6)
    x = tf.cast(_inputs(shape), call.get("dtype", tf.float32))
    mask = tf.constant(np.arange(60).reshape(3, 4, 5) % 3 > 0) if call.get("mask") else None
    kwargs = dict(make)
    if call.get("dtype") == tf.float64:
        kwargs["dtype"] = "float64"
    ref, ours = _pair(shape, **kwargs)
    if mask is not None:
        expected, got = ref(x, training=True, mask=mask), ours(x, training=True, mask=mask)
    else:
        expected, got = ref(x, training=True), ours(x, training=True)
    # Keras's own ops, so the same result bit for bit.
    np.testing.assert_array_equal(got.numpy(), expected.numpy())
    np.testing.assert_array_equal(ours.moving_variance.numpy(), ref.moving_variance.numpy())
    with pytest.raises(tapehook.TapehookError, match=why.replace("(", r"\(")) as err:
        fused = BatchNormalization(fused=True, **kwargs)
        fused.build(shape)
        fused(x, training=True, mask=mask)
    assert "fused=None" in str(err.value) and "fused=False" in str(err.value)


def test_fused_false_is_keras_and_bad_fused_value():
    shape = SHAPES[4]
    ref, _ = _pair(shape)
    ours = BatchNormalization(fused=False)
    ours.build(shape)
    for a, b in zip(ours.weights, ref.weights):
        a.assign(b)
    x = _inputs(shape)
    for g, e in zip(_train_call(ours, x, "function"), _train_call(ref, x, "function")):
        np.testing.assert_array_equal(g.numpy(), e.numpy())
    with pytest.raises(tapehook.TapehookError, match="fused is None"):
        BatchNormalization(fused="yes")


def test_not_trainable_is_inference():
    """Keras 3: a frozen batch norm normalizes with its moving statistics and
    does not update them, also under training=True."""
    shape = SHAPES[4]
    ref, ours = _pair(shape)
    ref.trainable = ours.trainable = False
    x = _inputs(shape)
    before = ours.moving_mean.numpy()
    np.testing.assert_array_equal(ours(x, training=True).numpy(), ref(x, training=True).numpy())
    np.testing.assert_array_equal(ours.moving_mean.numpy(), before)


def test_mixed_precision():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        ref, ours = _pair(SHAPES[4])
        x = tf.cast(_inputs(SHAPES[4]), tf.float16)
        got, expected = _train_call(ours, x, "function"), _train_call(ref, x, "function")
        assert got[0].dtype == expected[0].dtype == tf.float16
        for g, e in zip(got, expected):
            np.testing.assert_allclose(
                g.numpy().astype(np.float32), e.numpy().astype(np.float32), rtol=2e-3, atol=2e-3
            )
        np.testing.assert_allclose(ours.moving_variance.numpy(), ref.moving_variance.numpy())
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _small_model(norm):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(6, 3, padding="same", use_bias=False)(inputs)
    x = norm(momentum=0.7)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(4)(x)
    x = norm(momentum=0.7, center=False)(x)
    return keras.Model(inputs, keras.layers.Softmax()(x))


def _data():
    rng = np.random.default_rng(5)
    return rng.standard_normal((24, 8, 8, 3)).astype(np.float32), rng.integers(0, 4, 24)


def test_fit_matches_keras_and_saves(tmp_path):
    """Three SGD steps of fit: the same weights and moving statistics as the
    model with Keras's layers; .keras round trip keeps the layer and fused."""
    x, y = _data()
    nets = {}
    for name, norm in (("keras", keras.layers.BatchNormalization), ("ours", BatchNormalization)):
        net = _small_model(norm)
        net.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
        net.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        nets[name] = net
    for a, b in zip(nets["ours"].get_weights(), nets["keras"].get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    path = tmp_path / "net.keras"
    nets["ours"].save(path)
    loaded = keras.models.load_model(path)
    norms = [l for l in loaded.layers if isinstance(l, keras.layers.BatchNormalization)]
    assert len(norms) == 2 and all(type(l) is BatchNormalization for l in norms)
    assert all(l.fused is None for l in norms)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), nets["ours"].predict(x, verbose=0))


def mirrored_variants():
    """For tests/helpers/mirrored_fit.py: the small model with each layer."""

    def build(norm):
        net = _small_model(norm)
        net.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
        return net

    return {
        "keras": lambda: build(keras.layers.BatchNormalization),
        "ours": lambda: build(BatchNormalization),
        # Its first batch norm reruns the conv before it in the backward.
        "recompute": lambda: build(lambda **kw: BatchNormalization(recompute=True, **kw)),
    }


@pytest.mark.slow
def test_mirrored_strategy_matches_keras():
    """fit under MirroredStrategy (2 logical CPUs, per-replica batch
    statistics as Keras's synchronized=False): the same weights and moving
    statistics as Keras's layer under the same strategy, with and without
    recompute."""
    out = fit_mirrored("test_layers")
    assert len(out["ours"]) == len(out["recompute"]) == len(out["keras"]) == 10
    for a, b, c in zip(out["ours"], out["recompute"], out["keras"]):
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(b, c, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# Inference folded into a binary conv (conv2d.fold_output_affine).


def _conv_bn(
    activation=None, norm=BatchNormalization, use_bias=False, spec=None, read_twice=False, **bn
):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((9, 9, 70))
    conv = keras.layers.Conv2D(
        40, 3, padding="same", use_bias=use_bias, activation=activation, name="binary"
    )
    z = conv(inputs)
    y = norm(**bn)(z)
    net = keras.Model(inputs, keras.layers.Add()([y, z if read_twice else y]))
    spec = spec or dict(activations=True, scale="mean_abs")
    tapehook.binarize(net, include="binary", fast_layers=False, **spec)  # Keras's layers stay
    rng = np.random.default_rng(11)
    layer = net.layers[2]
    for v in layer.weights:  # moving statistics and gamma / beta off their initial values
        v.assign(
            rng.uniform(0.5, 1.5, v.shape).astype(np.float32) * (-1 if "beta" in v.path else 1)
        )
    return net


def _infer_graph(net, x):
    fn = tf.function(lambda t: net(t, training=False))
    types = [op.type for op in fn.get_concrete_function(x).graph.get_operations()]
    return fn(x), types


@pytest.mark.parametrize("activation", [None, "relu", "bias"])
@pytest.mark.parametrize("spec", ["mean_abs", "plain", "one_padding"])
def test_inference_folds_into_binary_conv(activation, spec):
    specs = {
        "mean_abs": dict(activations=True, scale="mean_abs"),
        "plain": dict(activations="approx_sign"),
        "one_padding": dict(activations=True, pad_value=1.0, clip=1.25),
    }
    # "bias": the conv's BiasAdd, folded into the offset.
    use_bias = activation == "bias"
    activation = None if use_bias else activation
    ours = _conv_bn(activation, use_bias=use_bias, spec=specs[spec])
    ref = _conv_bn(
        activation, use_bias=use_bias, norm=keras.layers.BatchNormalization, spec=specs[spec]
    )
    ref.set_weights(ours.get_weights())
    x = _inputs((3, 9, 9, 70))
    tapehook.reset_dispatch_counts()
    got, types = _infer_graph(ours, x)
    assert types.count("TapehookBinaryConv2DAffine") == 1
    assert tapehook.dispatch_counts()["compiled"]["forward"] == 1  # the unfused one pruned
    expected, ref_types = _infer_graph(ref, x)
    assert "TapehookBinaryConv2DAffine" not in ref_types
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-4)
    # Eager calls and Keras predict give the same.
    np.testing.assert_allclose(ours(x, training=False).numpy(), expected.numpy(), atol=1e-4)
    np.testing.assert_allclose(ours.predict(x, verbose=0), expected.numpy(), atol=1e-4)


def test_inference_not_folded_where_it_cannot_be():
    x = _inputs((2, 9, 9, 70))

    def folds(net):
        return "TapehookBinaryConv2DAffine" in _infer_graph(net, x)[1]

    assert not folds(_conv_bn("relu", use_bias=True))  # a bias before the ReLU
    assert not folds(_conv_bn(read_twice=True))  # another layer reads the conv's output
    assert not folds(_conv_bn(spec=dict(activations=False)))  # weight-only conv
    assert not folds(_conv_bn(fused=False))
    assert not folds(_conv_bn(activation="tanh"))
    # Under a tape (cache_filter off: a gradient may be asked for) it is not.
    net = _conv_bn()

    assert "TapehookBinaryConv2DAffine" not in taped_inference_op_types(net, x)


def _inference_gradients(net, x):
    """tf.gradients (no tape) of an inference output: x, the conv kernel,
    gamma and beta; and the graph's op types."""
    return inference_gradients(net, x, [net.layers[1].kernel, *net.layers[2].trainable_variables])


@pytest.mark.parametrize("activation", [None, "relu"])
def test_folded_inference_gradients(activation):
    """tf.gradients of a folded inference graph (no tape: the fold happens)
    equal those of Keras's batch norm after the same binary conv."""
    x = _inputs((2, 9, 9, 70))
    ours = _conv_bn(activation)
    ref = _conv_bn(activation, norm=keras.layers.BatchNormalization)
    ref.set_weights(ours.get_weights())
    got, types = _inference_gradients(ours, x)
    expected, ref_types = _inference_gradients(ref, x)
    assert "TapehookBinaryConv2DAffine" in types and "TapehookBinaryConv2DAffine" not in ref_types
    assert len(got) == 4
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-3)


def test_folded_model_exports(tmp_path):
    """A Keras SavedModel of a folded model serves the folded op (tapehook
    loaded); tapehook's LiteRT export writes stock ops and matches predict."""
    from tapehook.deploy import export_tflite, run_tflite

    net = _conv_bn("relu")
    x = _inputs((4, 9, 9, 70))
    expected = net.predict(x, verbose=0)
    net.export(str(tmp_path / "sm"), verbose=False)
    loaded = tf.saved_model.load(str(tmp_path / "sm"))
    ops_in_file = {
        n.op for f in loaded.serve.concrete_functions for n in f.graph.as_graph_def().node
    } | {
        n.op
        for f in loaded.serve.concrete_functions
        for fn in f.graph.as_graph_def().library.function
        for n in fn.node_def
    }
    assert "TapehookBinaryConv2DAffine" in ops_in_file
    np.testing.assert_allclose(loaded.serve(x).numpy(), expected, rtol=1e-5, atol=1e-4)
    report = export_tflite(net, tmp_path / "m.tflite")
    assert all(op.isupper() for op in report["ops"])
    np.testing.assert_allclose(run_tflite(tmp_path / "m.tflite", x), expected, atol=1e-3)


# ---------------------------------------------------------------------------
# Inference folded into a stock float conv (layers._fold_into_float_conv).

FLOAT_CONVS = {
    "conv_strided": lambda: keras.layers.Conv2D(7, 3, strides=2, padding="same", use_bias=False),
    "conv_bias": lambda: keras.layers.Conv2D(5, 3, padding="valid"),
    "conv_dilated": lambda: keras.layers.Conv2D(5, 3, dilation_rate=2, use_bias=False),
    "pointwise": lambda: keras.layers.Conv2D(8, 1, use_bias=False),
    "depthwise_x2": lambda: keras.layers.DepthwiseConv2D(
        3, depth_multiplier=2, padding="same", use_bias=False
    ),
    "depthwise_bias": lambda: keras.layers.DepthwiseConv2D(3, strides=2, padding="valid"),
}


def _float_conv_bn(kind, norm=BatchNormalization, read_twice=False, trainable=True, **bn):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((11, 11, 6))
    z = FLOAT_CONVS[kind]()(inputs)
    layer = norm(**bn)
    layer.trainable = trainable
    y = layer(z)
    net = keras.Model(inputs, keras.layers.Add()([y, z]) if read_twice else y * y)
    rng = np.random.default_rng(3)
    for v in layer.weights + [w for w in net.layers[1].weights if "bias" in w.path]:
        v.assign(
            rng.uniform(0.5, 1.5, v.shape).astype(np.float32) * (-1 if "beta" in v.path else 1)
        )
    return net


def _folded_conv(types_and_graph):
    """The graph's BiasAdd ops fed by a conv whose filter was scaled (a Mul)."""
    return [
        op
        for op in types_and_graph.get_operations()
        if op.type == "BiasAdd"
        and op.inputs[0].op.type in ("Conv2D", "DepthwiseConv2dNative")
        and op.inputs[0].op.inputs[1].op.type == "Mul"
    ]


@pytest.mark.parametrize("kind", sorted(set(FLOAT_CONVS) - {"conv_dilated"}))
def test_inference_folds_into_float_conv(kind):
    ours = _float_conv_bn(kind)
    ref = _float_conv_bn(kind, norm=keras.layers.BatchNormalization)
    ref.set_weights(ours.get_weights())
    x = _inputs((3, 11, 11, 6))
    fn = tf.function(lambda t: ours(t, training=False))
    graph = fn.get_concrete_function(x).graph
    folded = _folded_conv(graph)
    assert len(folded) == 1
    # The batch norm's output is the folded conv's: the model's y * y reads it.
    (square,) = set(folded[0].outputs[0].consumers())
    assert square.type == "Mul" and square.inputs[0] is square.inputs[1]
    expected = ref(x, training=False).numpy()
    assert not _folded_conv(
        tf.function(lambda t: ref(t, training=False)).get_concrete_function(x).graph
    )
    np.testing.assert_allclose(fn(x).numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours(x, training=False).numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours.predict(x, verbose=0), expected, rtol=1e-5, atol=1e-5)


def test_inference_not_folded_into_float_conv_where_it_cannot_be():
    x = _inputs((2, 11, 11, 6))

    def folds(net):
        fn = tf.function(lambda t: net(t, training=False))
        return bool(_folded_conv(fn.get_concrete_function(x).graph))

    assert folds(_float_conv_bn("conv_strided"))
    assert not folds(_float_conv_bn("conv_strided", read_twice=True))
    assert not folds(_float_conv_bn("conv_strided", fused=False))
    # Keras's dilated conv is SpaceToBatchND, Conv2D, BatchToSpaceND: not a conv's output.
    assert not folds(_float_conv_bn("conv_dilated"))
    # A filter larger than two passes over the batch's outputs (3x3x64x32 taps
    # against 32 outputs per sample) is not scaled per call: folded from batch 288.
    keras.utils.set_random_seed(5)
    inputs = keras.Input((3, 3, 64))
    big = keras.Model(
        inputs, BatchNormalization()(keras.layers.Conv2D(32, 3, use_bias=False)(inputs))
    )
    for batch, folded in ((None, False), (1, False), (287, False), (288, True)):
        fn = tf.function(lambda t: big(t, training=False))
        graph = fn.get_concrete_function(tf.TensorSpec((batch, 3, 3, 64))).graph
        assert bool(_folded_conv(graph)) == folded, batch
    keras.utils.set_random_seed(5)
    inputs = keras.Input((11, 11, 6))
    relu = keras.layers.Conv2D(4, 3, activation="relu", use_bias=False)(inputs)
    assert not folds(keras.Model(inputs, BatchNormalization()(relu)))  # ReLU in between


@pytest.mark.parametrize("taped", [False, True])
@pytest.mark.parametrize("kind", ["conv_bias", "depthwise_x2"])
def test_float_folded_inference_gradients(kind, taped):
    """Gradients through a folded float conv (tf.gradients, or a tape in a
    tf.function) to the input, the conv's weights, gamma and beta equal
    those through Keras's batch norm."""
    x = _inputs((2, 11, 11, 6))
    weight = None

    def grads(net):
        nonlocal weight
        variables = [*net.layers[1].trainable_variables, *net.layers[2].trainable_variables]

        if weight is None:  # a fixed random weighting of the outputs
            weight = tf.constant(np.random.default_rng(4).standard_normal(net.output_shape[1:]))
            weight = tf.cast(weight, tf.float32)

        @tf.function
        def g(t):
            if not taped:
                y = net(t, training=False)
                return tf.gradients(tf.reduce_sum(y * weight), [t, *variables])
            with tf.GradientTape() as tape:
                tape.watch(t)
                loss = tf.reduce_sum(net(t, training=False) * weight)
            return tape.gradient(loss, [t, *variables])

        return g(x), g.get_concrete_function(x).graph

    ours, ref = _float_conv_bn(kind), _float_conv_bn(kind, norm=keras.layers.BatchNormalization)
    ref.set_weights(ours.get_weights())
    got, graph = grads(ours)
    expected, _ = grads(ref)
    assert _folded_conv(graph)
    assert len(got) == len(expected) >= 3
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-4)


def test_frozen_batch_norm_fine_tuning_folds():
    """A frozen batch norm (trainable=False runs in inference mode, as in
    fine-tuning) after a float conv is folded inside the fit step, and the
    conv trains as under Keras's frozen batch norm."""
    x = _inputs((8, 11, 11, 6)).numpy()
    y = np.random.default_rng(2).standard_normal((8, 6, 6, 7)).astype(np.float32)
    nets = []
    for norm in (BatchNormalization, keras.layers.BatchNormalization):
        net = _float_conv_bn("conv_strided", norm=norm, trainable=False)
        if nets:
            net.set_weights(nets[0].get_weights())
        net.compile(keras.optimizers.SGD(0.05), "mse")
        nets.append(net)
    before = [w.copy() for w in nets[0].get_weights()]
    for net in nets:
        net.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(nets[0].get_weights(), nets[1].get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert not np.allclose(nets[0].get_weights()[0], before[0])  # the conv trained
    # A training call (what fit's step traces) folds the frozen batch norm.
    graph = tf.function(lambda t: nets[0](t, training=True)).get_concrete_function(x).graph
    assert _folded_conv(graph)


def test_deploy_graphs_keep_their_batch_norms_on_binary_convs(tmp_path):
    """A deploy graph's binary conv is a stock conv of a constant sign filter:
    the batch norm is not folded into it (LCE's converter matches the conv as
    it is), so the exported ops equal those with Keras's batch norm (the
    float stem's batch norm is tapehook's in both), and the file computes
    what predict does."""
    from tapehook.deploy import export_tflite, run_tflite

    reports, x = [], _inputs((2, 9, 9, 70))
    for norm in (BatchNormalization, keras.layers.BatchNormalization):
        keras.utils.set_random_seed(7)
        inputs = keras.Input((9, 9, 70))
        z = BatchNormalization()(keras.layers.Conv2D(70, 1, use_bias=False, name="stem")(inputs))
        y = norm()(keras.layers.Conv2D(40, 3, use_bias=False, name="binary")(z))
        net = keras.Model(inputs, y)
        tapehook.binarize(net, include="binary", activations=True, fast_layers=False)
        report = export_tflite(net, tmp_path / f"{norm.__module__}.tflite")
        np.testing.assert_allclose(
            run_tflite(tmp_path / f"{norm.__module__}.tflite", x),
            net.predict(x, verbose=0),
            rtol=1e-4,
            atol=1e-3,
        )
        reports.append(report)
    assert sorted(reports[0]["ops"]) == sorted(reports[1]["ops"])


# ---------------------------------------------------------------------------
# recompute=True: the training backward rebuilds the binary conv's output
# (conv2d.recompute_output) instead of keeping it.

RECOMPUTE_SPECS = {
    "mean_abs": dict(activations=True, scale="mean_abs"),  # packed ste_sign bits
    "approx_sign": dict(activations="approx_sign"),  # rebuilt from the kept x
    "one_padding": dict(activations=True, pad_value=1.0, clip=1.25),
    # rebuilt from x padded again (gradient.forward_input), not a kept padded copy
    "approx_one_padding": dict(activations="approx_sign", pad_value=1.0),
}


def _recompute_net(activation, spec, recompute, norm=None):
    """_conv_bn's binary conv + batch norm (no second reader), its batch norm
    tapehook's with ``recompute`` (or ``norm``)."""
    use_bias = activation == "bias"
    return _conv_bn(
        None if use_bias else activation,
        norm=norm or (lambda **kw: BatchNormalization(recompute=recompute, **kw)),
        use_bias=use_bias,
        spec=RECOMPUTE_SPECS[spec],
    )


def _training_step(net, mode):
    """Output, gradients (x, then trainable weights) and moving statistics
    of one training call: eager tape, tf.function tape, or tf.gradients in a
    tf.function (no tape); and the traced graph (None eagerly)."""
    norm = net.layers[2]

    def step(x):
        if mode == "gradients":
            y = net(x, training=True)
            grads = tf.gradients(tf.reduce_sum(y * tf.sin(y + 0.3)), [x, *net.trainable_variables])
        else:
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = net(x, training=True)
                loss = tf.reduce_sum(y * tf.sin(y + 0.3))
            grads = tape.gradient(loss, [x, *net.trainable_variables])
        return [y, *grads, tf.identity(norm.moving_mean), tf.identity(norm.moving_variance)]

    x = _inputs((3, *net.inputs[0].shape[1:]))
    if mode == "eager":
        return [t.numpy() for t in step(x)], None
    fn = tf.function(step)
    return [t.numpy() for t in fn(x)], fn.get_concrete_function(x).graph


def _backward_reads_forward_conv_output(graph, conv="TapehookBinaryConv2D"):
    """Whether an op of the backward (under a gradient name scope) reads the
    output of a forward ``conv``, directly or through its BiasAdd / Relu."""
    backward = ("gradients", "gradient_tape")
    for op in graph.get_operations():
        if op.type != conv or op.name.startswith(backward):
            continue
        tensors = list(op.outputs)
        while tensors:
            for reader in tensors.pop().consumers():
                if reader.name.startswith(backward) or "/gradients/" in reader.name:
                    return True
                if reader.type in ("BiasAdd", "Relu", "Identity"):
                    tensors.extend(reader.outputs)
    return False


def _batch_norm_inputs(net):
    """In one tf.gradients graph of a training call: the forward batch norm's
    input and the one its backward reads (tapehook's TapehookBatchNormGrad,
    which applies a fused ReLU itself, or FusedBatchNormGradV3)."""

    @tf.function
    def step(x):
        y = net(x, training=True)
        tf.gradients(tf.reduce_sum(y * y), net.trainable_variables)
        ops = tf.compat.v1.get_default_graph().get_operations()
        forward = [op for op in ops if op.type == "FusedBatchNormV3"]
        backward = [
            op for op in ops if op.type in ("TapehookBatchNormGrad", "FusedBatchNormGradV3")
        ]
        assert len(forward) == len(backward) == 1
        rebuilt = backward[0].inputs[1]
        if backward[0].type == "TapehookBatchNormGrad" and backward[0].get_attr("relu"):
            rebuilt = tf.nn.relu(rebuilt)
        return forward[0].inputs[0], rebuilt

    return [t.numpy() for t in step(_inputs((3, *net.inputs[0].shape[1:])))]


def _check_recompute(build, mode, conv):
    """One training call of ``build(recompute, norm=None)``'s net with
    recompute=True against recompute=False (to the graph's own float
    reordering) and Keras's batch norm (to float rounding); in graphs, that
    the backward reads a rerun ``conv`` (not the forward's output) and, with
    tf.gradients, that the rebuilt input equals the kept one bit for bit.
    Returns the recompute graph (None eagerly)."""
    net = build(True)
    got, graph = _training_step(net, mode)
    kept, kept_graph = _training_step(build(False), mode)
    keras_bn, _ = _training_step(build(False, keras.layers.BatchNormalization), mode)
    assert len(got) == len(kept) == len(keras_bn)
    # got: output, dx, the trainable variables' gradients, moving statistics.
    biases = {2 + i for i, v in enumerate(net.trainable_variables) if v.name.endswith("bias")}
    for i, (a, b, c) in enumerate(zip(got, kept, keras_bn)):
        if i in biases:
            # A conv bias before a batch norm has gradient zero but for
            # rounding, which depends on the summation order (tapehook's
            # batch-norm gradient sums in another order than
            # FusedBatchNormGradV3; tests/test_batch_norm_grad.py holds it to
            # float64): each is zero to rounding, not equal to the others.
            for grad in (a, b, c):
                assert np.abs(grad).max() <= 1e-3, np.abs(grad).max()
            continue
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-3)
    if mode == "eager":
        np.testing.assert_array_equal(got[0], kept[0])
        return None  # eager calls keep the input (no graph to rebuild it in)
    assert [op.type for op in graph.get_operations()].count(conv) == 2  # forward, rerun
    assert [op.type for op in kept_graph.get_operations()].count(conv) == 1
    assert _backward_reads_forward_conv_output(kept_graph, conv)
    assert not _backward_reads_forward_conv_output(graph, conv)
    if mode == "gradients":
        forward, rebuilt = _batch_norm_inputs(build(True))
        np.testing.assert_array_equal(rebuilt, forward)
    return graph


@pytest.mark.parametrize("mode", ["eager", "function", "gradients"])
@pytest.mark.parametrize("activation", [None, "relu", "bias"])
@pytest.mark.parametrize(
    "spec, pack",
    [(spec, "1") for spec in RECOMPUTE_SPECS]
    + [(spec, "float32") for spec in RECOMPUTE_SPECS if spec.startswith("approx")],
)
def test_recompute_matches_kept_input(monkeypatch, spec, pack, activation, mode):
    """The backward reads a rebuilt conv output (not the forward's) equal to
    it bit for bit; outputs, gradients and moving statistics those of
    recompute=False (to the graph's own float reordering) and of Keras's
    batch norm (to float rounding). The rebuild reads the kept sign bits, or
    (approx_sign under TAPEHOOK_PACK_INPUTS=float32) the kept x."""
    monkeypatch.setenv("TAPEHOOK_PACK_INPUTS", pack)
    graph = _check_recompute(
        lambda recompute, norm=None: _recompute_net(activation, spec, recompute, norm),
        mode,
        "TapehookBinaryConv2D",
    )
    if graph is not None:
        types = [op.type for op in graph.get_operations()]
        keeps_x = pack == "float32"
        assert ("TapehookUnpackInput" in types) == (not keeps_x)
        if spec == "approx_one_padding":
            forward_pad, *backward_pads = [
                op for op in graph.get_operations() if op.type == "PadV2"
            ]
            readers = sorted(op.type for op in forward_pad.outputs[0].consumers())
            if keeps_x:
                assert readers == ["TapehookBinaryConv2D"], readers
                assert len(backward_pads) == 2  # the rerun conv's input, the backprops'
            else:
                assert readers == [
                    "TapehookBinaryConv2D",
                    "TapehookEstimatorGradFixed",
                    "TapehookPackInput",
                ], readers
                assert not backward_pads


def test_recompute_fit_and_config(tmp_path):
    """Keras fit (two SGD steps) with recompute=True ends at the same weights
    as recompute=False; the .keras round trip keeps the setting."""
    x = _inputs((6, 9, 9, 70)).numpy()
    y = np.random.default_rng(2).standard_normal((6, 9, 9, 40)).astype(np.float32)
    weights = {}
    for recompute in (False, True):
        net = _recompute_net("relu", "one_padding", recompute)
        net.compile(keras.optimizers.SGD(0.05), "mse", jit_compile=False)
        net.fit(x, y, batch_size=3, epochs=1, shuffle=False, verbose=0)
        weights[recompute] = net.get_weights()
    for a, b in zip(weights[True], weights[False]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    path = tmp_path / "net.keras"
    net.save(path)
    norm = keras.models.load_model(path).layers[2]
    assert type(norm) is BatchNormalization and norm.recompute is True


@pytest.mark.parametrize("mode", ["function", "gradients"])
@pytest.mark.parametrize("kind", ["conv_strided", "conv_bias", "pointwise", "depthwise_bias"])
def test_recompute_after_float_conv(kind, mode):
    """After a stock float conv the backward reads the conv rerun on its
    input and filter, equal to the forward's output bit for bit; results
    those of recompute=False and of Keras's batch norm."""
    conv = "DepthwiseConv2dNative" if kind.startswith("depthwise") else "Conv2D"

    def net(recompute, norm=None):
        return _float_conv_bn(
            kind, norm=norm or (lambda **kw: BatchNormalization(recompute=recompute, **kw))
        )

    _check_recompute(net, mode, conv)


def test_recompute_elsewhere_is_the_fused_layer():
    """Where the input is no conv's output (here a sum) recompute=True trains
    as recompute=False: the same graph ops, the same results."""
    x = _inputs((3, 9, 9, 70))
    results, op_types = [], []
    for recompute in (False, True):
        keras.utils.set_random_seed(7)
        inputs = keras.Input((9, 9, 70))
        z = keras.layers.Conv2D(40, 3, padding="same")(inputs)
        z = keras.layers.Add()([z, z])
        net = keras.Model(inputs, BatchNormalization(recompute=recompute)(z))

        @tf.function
        def step(x, net=net):
            with tf.GradientTape() as tape:
                y = net(x, training=True)
                loss = tf.reduce_sum(y * tf.sin(y))
            return [y, *tape.gradient(loss, net.trainable_variables)]

        results.append([t.numpy() for t in step(x)])
        op_types.append(
            sorted(op.type for op in step.get_concrete_function(x).graph.get_operations())
        )
    assert op_types[0] == op_types[1]
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_recompute_bad_values():
    with pytest.raises(tapehook.TapehookError, match="recompute is True or False"):
        BatchNormalization(recompute="yes")
    with pytest.raises(tapehook.TapehookError, match="pass fused=None or True"):
        BatchNormalization(recompute=True, fused=False)
