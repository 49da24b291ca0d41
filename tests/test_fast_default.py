"""Fast layers by default: in a model tapehook is in charge of, Keras's own
BatchNormalization, MaxPooling2D, Add and Adam run tapehook's implementations
(tapehook.layers, tapehook.optimizers). Reference: the same model with
``fast_layers=False`` (Keras's layers, checked to stay Keras's classes and
ops): outputs, gradients and one fit step equal to float rounding; the fast
path is proven by the ops in the traced graphs."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tapehook
import tapehook.larq as lq
from tapehook import layers as th
from tapehook import optimizers as th_opt

FAST_TRAINING_OPS = {"FusedBatchNormV3", "TapehookMaxPoolTaps"}
AFFINE_ADD = "TapehookBinaryConv2DAffineAdd"
STOCK = (keras.layers.BatchNormalization, keras.layers.MaxPooling2D, keras.layers.Add)


def _block():
    """A Bi-Real-style block of Keras's own layers: float stem, batch norm,
    max pool, binary conv, batch norm, residual add, dense head."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((12, 12, 16))
    x = keras.layers.Conv2D(16, 3, padding="same", use_bias=False, name="stem")(inputs)
    x = keras.layers.BatchNormalization(name="bn0")(x)
    x = keras.layers.MaxPooling2D(2, name="pool")(x)
    y = keras.layers.Conv2D(16, 3, padding="same", use_bias=False, name="binary")(x)
    y = keras.layers.BatchNormalization(name="bn1")(y)
    x = keras.layers.Add(name="add")([y, x])
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(4, name="dense")(x))


def _binarized(fast_layers=None):
    model = _block()
    tapehook.binarize(model, include="binary", activations=True, fast_layers=fast_layers)
    return model


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.standard_normal((4, 12, 12, 16)).astype(np.float32))
    return x, tf.constant(rng.standard_normal((4, 4)).astype(np.float32))


def _kinds(model):
    return {l.name: type(l) for l in model.layers if isinstance(l, STOCK)}


def _op_types(fn, *args):
    return {op.type for op in fn.get_concrete_function(*args).graph.get_operations()}


def _train_ops(model, x):
    def step(t):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(t, training=True))
        return tape.gradient(loss, model.trainable_variables)

    return _op_types(tf.function(step), x)


def _loss_and_grads(model, x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum((model(x, training=True) - y) ** 2)
    return [loss, *tape.gradient(loss, model.trainable_variables)]


def _assert_close(a, b, rtol=1e-4, atol=1e-5):
    for u, v in zip(a, b, strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol)


def test_binarized_stock_layers_run_tapehooks_with_keras_results():
    fast, stock = _binarized(), _binarized(fast_layers=False)
    assert _kinds(fast) == {
        "bn0": th.BatchNormalization,
        "pool": th.MaxPooling2D,
        "bn1": th.BatchNormalization,
        "add": th.Add,
    }
    assert sorted(t.__name__ for t in _kinds(stock).values()) == sorted(
        t.__name__ for t in _kinds(fast).values()
    ) and all(t in STOCK for t in _kinds(stock).values())
    assert fast.get_layer("bn1").recompute and fast.get_layer("bn1").fused is None
    assert not fast.get_layer("pool").fuse_relu
    x, y = _data()
    # Training graphs: the fused batch norm and tapehook's pool; Keras's without.
    assert FAST_TRAINING_OPS <= _train_ops(fast, x)
    assert not FAST_TRAINING_OPS & _train_ops(stock, x)
    # Predict graph: the residual add done by the binary conv.
    infer = _op_types(tf.function(lambda t: fast(t, training=False)), x)
    assert AFFINE_ADD in infer
    assert AFFINE_ADD not in _op_types(tf.function(lambda t: stock(t, training=False)), x)
    # Eager and tf.function: outputs and gradients (batch statistics) agree.
    _assert_close(_loss_and_grads(fast, x, y), _loss_and_grads(stock, x, y))
    step = tf.function(_loss_and_grads)
    _assert_close(step(fast, x, y), step(stock, x, y))
    for training in (False, True):
        _assert_close([fast(x, training=training)], [stock(x, training=training)])
    _assert_close(
        [tf.function(lambda t: fast(t, training=False))(x)],
        [stock.predict(x, verbose=0)],
    )


def test_fit_step_and_adam_equal_keras():
    fast, stock = _binarized(), _binarized(fast_layers=False)
    stock.set_weights(fast.get_weights())
    x, y = _data(1)
    for model in (fast, stock):
        # Adam's first step is lr * g / (|g| + epsilon): a larger epsilon keeps
        # gradients near zero (equal to float rounding) from being amplified.
        model.compile(keras.optimizers.Adam(1e-2, epsilon=1e-3), "mse")
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # one step
    assert type(fast.optimizer) is th_opt.Adam
    assert type(stock.optimizer) is keras.optimizers.Adam
    # Moving statistics (Keras's biased-variance update) and trained weights.
    _assert_close(fast.get_weights(), stock.get_weights(), rtol=1e-3, atol=1e-5)
    fast_string = _binarized()
    fast_string.compile("adam", "mse")
    fast_string.fit(x, y, verbose=0)
    assert type(fast_string.optimizer) is th_opt.Adam


def test_keras_file_round_trip_and_summary(tmp_path):
    model = _binarized()
    x, _ = _data(2)
    expected = model.predict(x, verbose=0)
    lines = []
    model.summary(print_fn=lines.append)
    assert any("bn1" in line for line in lines) and any("pool (MaxPooling2D)" in l for l in lines)
    path = str(tmp_path / "fast.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert _kinds(loaded) == _kinds(model)
    assert loaded.get_layer("bn1").recompute
    np.testing.assert_allclose(loaded.predict(x, verbose=0), expected, rtol=1e-6, atol=1e-6)
    assert AFFINE_ADD in _op_types(tf.function(lambda t: loaded(t, training=False)), x)


@tapehook.binarize(include="binary*", activations=True)
class SubclassedBlock(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stem = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)
        self.norm = keras.layers.BatchNormalization()
        self.pool = keras.layers.MaxPooling2D(2)
        self.binary = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="binary")
        self.head = keras.layers.Dense(3)

    def call(self, x, training=None):
        x = self.pool(self.norm(self.stem(x), training=training), training=training)
        x = self.binary(x)
        return self.head(tf.reduce_mean(x, axis=[1, 2]))


def test_subclassed_model_and_the_process_setting():
    x = _data(3)[0][..., :8]
    keras.utils.set_random_seed(5)
    fast = SubclassedBlock()
    fast(x)  # layers decided at their first call under the model
    keras.utils.set_random_seed(5)
    with tapehook.config(fast_layers=False):
        stock = SubclassedBlock()
        stock(x)
    assert type(fast.norm) is th.BatchNormalization and type(fast.pool) is th.MaxPooling2D
    assert type(stock.norm) is keras.layers.BatchNormalization
    assert type(stock.pool) is keras.layers.MaxPooling2D
    assert "training" not in stock.pool._call_signature.parameters
    stock.set_weights(fast.get_weights())
    _assert_close(_loss_and_grads(fast, x, 0.0), _loss_and_grads(stock, x, 0.0))
    assert FAST_TRAINING_OPS <= _train_ops(fast, x)
    assert not FAST_TRAINING_OPS & _train_ops(stock, x)


def test_opt_out_restores_stock_exactly_and_untouched_models_stay_stock():
    model = _binarized()
    model.compile(keras.optimizers.Adam(), "mse")
    tapehook.binarize(model, include="binary", activations=True, fast_layers=False)
    for layer in model.layers:
        if isinstance(layer, STOCK):
            assert type(layer) in STOCK
            assert not {"fused", "recompute", "save_argmax", "fuse_relu"} & set(vars(layer))
    assert type(model.optimizer) is keras.optimizers.Adam
    x, _ = _data(4)
    assert not FAST_TRAINING_OPS & _train_ops(model, x)
    assert AFFINE_ADD not in _op_types(tf.function(lambda t: model(t, training=False)), x)
    # A model tapehook never touches (in an armed process): Keras's classes
    # and ops, and its outputs bit for bit those of its own layers' math.
    untouched = _block()
    reference = _block()
    untouched.compile(keras.optimizers.Adam(), "mse")
    untouched.fit(x, tf.zeros((4, 4)), verbose=0)
    assert all(t in STOCK for t in _kinds(untouched).values())
    assert type(untouched.optimizer) is keras.optimizers.Adam
    assert not FAST_TRAINING_OPS & _train_ops(untouched, x)
    reference.set_weights(untouched.get_weights())
    np.testing.assert_array_equal(untouched(x, training=True), reference(x, training=True))
    with pytest.raises(tapehook.TapehookError, match="fast_layers"):
        tapehook.binarize(_block(), fast_layers="yes")


def _larq_model():
    keras.utils.set_random_seed(6)
    return keras.Sequential(
        [
            keras.Input((8, 8, 4)),
            keras.layers.Conv2D(8, 3, padding="same"),
            keras.layers.BatchNormalization(),
            keras.layers.MaxPooling2D(2),
            lq.layers.QuantConv2D(
                8, 3, padding="same", input_quantizer="ste_sign", kernel_quantizer="ste_sign"
            ),
            keras.layers.BatchNormalization(),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(3),
        ]
    )


def test_larq_model_gets_fast_layers():
    x = _data(5)[0][:, :8, :8, :4]
    fast = _larq_model()
    got = _loss_and_grads(fast, x, 0.0)  # decided at the model's first call
    with tapehook.config(fast_layers=False):
        stock = _larq_model()
        expected = _loss_and_grads(stock, x, 0.0)
    kinds = [type(l) for l in fast.layers]
    assert kinds.count(th.BatchNormalization) == 2 and th.MaxPooling2D in kinds
    assert not {th.BatchNormalization, th.MaxPooling2D} & {type(l) for l in stock.layers}
    assert FAST_TRAINING_OPS <= _train_ops(fast, x)
    _assert_close(got, expected)
