"""tapehook.binarize on Keras models and tf.Modules, every Keras entry point,
XLA, saving/loading, and tapehook.summary."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tapehook
from tapehook import kernels

from conftest import assert_close

BINARY = tapehook.BinarySpec(activations=True, scale="mean_abs")


def _data(n=4, size=8, channels=3, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(n, size, size, channels)).astype("float32"),
        rng.integers(0, classes, size=n),
    )


def _reference_outputs(model, x):
    """The model's outputs with every binary conv on the reference path."""
    kernels.force_reference(True)
    try:
        return model(x, training=False)
    finally:
        kernels.force_reference(False)


@tapehook.binarize(first_and_last_float=True, activations=True, scale="mean_abs")
class Net(keras.Model):
    """A subclassed model with a nested sub-model and a lazily created layer."""

    def __init__(self):
        super().__init__()
        self.stem = keras.layers.Conv2D(8, 3, padding="same", name="stem")
        self.block = keras.Sequential(
            [
                keras.layers.Conv2D(8, 3, padding="same", name="inner_a"),
                keras.layers.BatchNormalization(),
                keras.layers.Conv2D(8, 1, name="inner_b"),
            ],
            name="block",
        )
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.head = keras.layers.Dense(3, name="head")
        self.late = None

    def call(self, x):
        if self.late is None:
            self.late = keras.layers.Conv2D(8, 3, padding="same", name="late")
        h = self.stem(x)
        h = self.late(self.block(h))
        return self.head(self.pool(h))


def _binary_names(model):
    return sorted(
        l.name
        for l in model._flatten_layers(include_self=False)
        if getattr(l, "kernel", None) is not None and tapehook.binary_spec_of(l.kernel)
    )


def test_decorator_marks_nested_and_lazy_layers_before_first_step():
    model = Net()
    x, y = _data()
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    model.fit(x, y, epochs=1, verbose=0)  # the very first traced step is binary
    assert _binary_names(model) == ["inner_a", "inner_b", "late"]
    assert tapehook.binary_spec_of(model.late.kernel) == BINARY
    counts = tapehook.dispatch_counts()["compiled"]
    assert counts["forward"] == 3 and counts["backprop_filter"] == 3
    assert_close(model(x), _reference_outputs(model, x), what="outputs")


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        (dict(), ["c1", "c2", "c3", "d"]),
        (dict(first_and_last_float=True), ["c2", "c3"]),
        (dict(include="c[12]"), ["c1", "c2"]),
        (dict(exclude=["c1", "c3"]), ["c2", "d"]),
        (dict(exclude=lambda layer: getattr(layer, "filters", 0) == 4), ["c1", "c3", "d"]),
    ],
)
def test_include_exclude_and_recipe(kwargs, expected):
    model = keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            keras.layers.Conv2D(8, 3, name="c1"),
            keras.layers.Conv2D(4, 3, name="c2"),
            keras.layers.Conv2D(8, 1, name="c3"),
            keras.layers.Flatten(),
            keras.layers.Dense(2, name="d"),
        ]
    )
    assert tapehook.binarize(model, **kwargs) is model
    assert _binary_names(model) == expected


def test_last_conv_layer_is_kept_float_by_the_recipe():
    model = keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            keras.layers.Conv2D(4, 3, name="a"),
            keras.layers.Conv2D(4, 3, name="b"),
            keras.layers.Conv2D(2, 1, name="last"),
        ]
    )
    tapehook.binarize(model, first_and_last_float=True)
    assert _binary_names(model) == ["b"]


@pytest.mark.slow
def test_resnet50_unchanged_model_code():
    model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)
    # alpha = mean |W| keeps 52 stacked binary convs from overflowing to inf.
    tapehook.binarize(model, first_and_last_float=True, scale="mean_abs")
    convs = [l for l in model.layers if isinstance(l, keras.layers.Conv2D)]
    float_convs = [l.name for l in convs if not tapehook.binary_spec_of(l.kernel)]
    assert float_convs == ["conv1_conv"]
    x, y = _data(2, 64, 3, 10)
    assert_close(model(x, training=False), _reference_outputs(model, x), what="outputs")
    tapehook.reset_dispatch_counts()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=2, epochs=1, verbose=0)
    counts = tapehook.dispatch_counts()["compiled"]
    # A batch norm that recomputes its input (fast layers' rule) reruns the
    # binary conv before it ("<block>_conv" -> "<block>_bn") in the backward.
    reruns = sum(
        1
        for l in model.layers
        if getattr(l, "recompute", False)
        and tapehook.binary_spec_of(model.get_layer(l.name[: -len("bn")] + "conv").kernel)
    )
    assert reruns > 0
    assert counts == dict(
        forward=len(convs) - 1 + reruns,
        backprop_input=len(convs) - 1,
        backprop_filter=len(convs) - 1,
    )


class CustomStep(keras.Model):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def _functional(cls=keras.Model):
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(inputs)
    h = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(h)
    return cls(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(h)))


@pytest.mark.parametrize(
    "entry", ["fit", "fit_eager", "train_on_batch", "custom_train_step", "evaluate", "predict"]
)
def test_every_keras_entry_point_is_binary(entry):
    model = tapehook.binarize(
        _functional(CustomStep if entry == "custom_train_step" else keras.Model), **vars(BINARY)
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        run_eagerly=entry == "fit_eager",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = _data(4, classes=2)
    if entry in ("fit", "fit_eager", "custom_train_step"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    elif entry == "train_on_batch":
        model.train_on_batch(x, y)
    elif entry == "evaluate":
        model.evaluate(x, y, verbose=0)
    else:
        out = model.predict(x, verbose=0)
        assert_close(out, _reference_outputs(model, x), what="predict")
    counts = tapehook.dispatch_counts()["compiled"]
    assert counts["forward"] >= 2
    trains = entry not in ("evaluate", "predict")
    assert counts["backprop_filter"] == (2 if trains else 0)


def test_training_matches_reference_path():
    """Two fit steps on the kernels and on the reference path: same weights."""
    x, y = _data(4, classes=2)

    def train(reference):
        keras.utils.set_random_seed(3)
        model = tapehook.binarize(_functional(), **vars(BINARY))
        model.compile(
            optimizer=keras.optimizers.SGD(0.05),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        kernels.force_reference(reference)
        try:
            model.fit(x, y, batch_size=2, epochs=1, verbose=0, shuffle=False)
        finally:
            kernels.force_reference(False)
        return model.get_weights()

    for a, b in zip(train(False), train(True)):
        assert_close(a, b, what="weights")


# ---- XLA ----


def test_auto_jit_with_a_gpu_visible_stays_off(monkeypatch):
    fake_gpu = tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")
    real = tf.config.list_physical_devices
    monkeypatch.setattr(
        tf.config,
        "list_physical_devices",
        lambda kind=None: real(kind) + ([fake_gpu] if kind in (None, "GPU") else []),
    )
    plain = _functional()
    plain.compile(optimizer="sgd", loss="mse", jit_compile="auto")
    assert plain.jit_compile is True  # the simulated GPU is seen
    model = tapehook.binarize(_functional())
    model.compile(optimizer="sgd", loss="mse", jit_compile="auto")
    assert model.jit_compile is False
    x, _ = _data(4)
    model.fit(x, np.zeros((4, 2), "float32"), epochs=1, verbose=0)
    assert tapehook.dispatch_counts()["compiled"]["backprop_filter"] == 2


def test_explicit_jit_compile_true_runs_binary_without_xla():
    model = tapehook.binarize(_functional())
    with pytest.warns(UserWarning, match="jit_compile=False"):
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    x, _ = _data(4)
    model.fit(x, np.zeros((4, 2), "float32"), epochs=1, verbose=0)
    assert tapehook.dispatch_counts()["compiled"]["backprop_filter"] == 2


def test_xla_compiled_function_runs_the_binary_math():
    x = tf.constant(_data(2)[0])
    w = tapehook.mark_binary(tf.Variable(tf.random.normal([3, 3, 3, 4], seed=4)), activations=True)

    @tf.function(jit_compile=True)
    def step(x):
        with tf.GradientTape() as tape:
            y = tf.nn.conv2d(x, w, 1, "SAME")
            loss = tf.reduce_sum(y * y)
        return y, tape.gradient(loss, w)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        y, dw = step(x)
    w0 = tf.convert_to_tensor(w)
    with tf.GradientTape() as tape:
        tape.watch(w0)
        ry = tapehook.reference.binary_conv2d(x, w0, tapehook.binary_spec_of(w))
        rloss = tf.reduce_sum(ry * ry)
    assert_close(y, ry, what="forward")
    assert_close(dw, tape.gradient(rloss, w0), what="dW")
    assert tapehook.dispatch_counts()["compiled"]["forward"] == 0


# ---- saving and loading ----


def test_keras_file_round_trip_keeps_marks(tmp_path):
    model = tapehook.binarize(_functional(), exclude="conv2d*_1*", **vars(BINARY))
    x, y = _data(4, classes=2)
    expected_specs = [tapehook.binary_spec_of(l.kernel) for l in model.layers[1:3]]
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert [tapehook.binary_spec_of(l.kernel) for l in loaded.layers[1:3]] == expected_specs
    np.testing.assert_array_equal(loaded(x), model(x))
    tapehook.reset_dispatch_counts()
    loaded.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    loaded.fit(x, y, epochs=1, verbose=0)
    assert tapehook.dispatch_counts()["compiled"]["backprop_filter"] == sum(
        s is not None for s in expected_specs
    )


def test_saved_model_signature_is_binary(tmp_path):
    model = tapehook.binarize(_functional(), **vars(BINARY))
    x, _ = _data(4)
    expected = model(x)
    model.export(str(tmp_path / "sm"), verbose=False)
    loaded = tf.saved_model.load(str(tmp_path / "sm"))
    tapehook.reset_dispatch_counts()
    np.testing.assert_array_equal(loaded.serve(x), expected)
    assert tapehook.dispatch_counts()["compiled"]["forward"] == 2


def test_saved_model_of_a_module_trains_binary(tmp_path):
    class Module(tf.Module):
        def __init__(self):
            self.w = tapehook.mark_binary(tf.Variable(tf.random.normal([3, 3, 3, 4], seed=1)))

        @tf.function(input_signature=[tf.TensorSpec([None, 8, 8, 3])])
        def __call__(self, x):
            return tf.nn.conv2d(x, self.w, 1, "SAME")

    module = Module()
    tf.saved_model.save(module, str(tmp_path / "mod"))
    loaded = tf.saved_model.load(str(tmp_path / "mod"))
    x = tf.constant(_data(2)[0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(loaded(x) ** 2)
    dw = tape.gradient(loss, loaded.w)
    w0 = tf.convert_to_tensor(module.w)
    with tf.GradientTape() as tape:
        tape.watch(w0)
        rloss = tf.reduce_sum(tapehook.reference.binary_conv2d(x, w0, tapehook.BinarySpec()) ** 2)
    assert_close(dw, tape.gradient(rloss, w0), what="dW through a loaded SavedModel")


def test_checkpoint_restore_keeps_binary(tmp_path):
    model = tapehook.binarize(_functional(), **vars(BINARY))
    x, _ = _data(4)
    prefix = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    other = tapehook.binarize(_functional(), **vars(BINARY))
    tf.train.Checkpoint(model=other).restore(prefix).assert_consumed()
    assert all(tapehook.binary_spec_of(l.kernel) == BINARY for l in other.layers[1:3])
    np.testing.assert_array_equal(other(x), model(x))


# ---- tf.Module ----


@tapehook.binarize(exclude="float_*", activations=True)
class Mod(tf.Module):
    def __call__(self, x):
        if not hasattr(self, "w"):
            self.w = tf.Variable(tf.random.normal([3, 3, 3, 4], seed=2), name="binary_w")
            self.f = tf.Variable(tf.random.normal([1, 1, 4, 2], seed=3), name="float_w")
        return tf.nn.conv2d(tf.nn.conv2d(x, self.w, 1, "SAME"), self.f, 1, "SAME")


def test_decorated_tf_module():
    module = Mod()
    module(tf.constant(_data(1)[0]))
    assert tapehook.binary_spec_of(module.w) == tapehook.BinarySpec(activations=True)
    assert tapehook.binary_spec_of(module.f) is None


def test_binarize_rejects_other_things():
    with pytest.raises(tapehook.TapehookError, match="keras.Model or tf.Module"):
        tapehook.binarize(int)
    with pytest.raises(tapehook.TapehookError, match="takes a keras.Model"):
        tapehook.binarize(3)
    with pytest.raises(tapehook.TapehookError, match="unknown estimator"):
        tapehook.binarize(ste="nope")
    grouped = keras.Sequential([keras.Input((8, 8, 4)), keras.layers.Conv2D(4, 3, groups=2)])
    with pytest.raises(tapehook.TapehookError, match="groups=2"):
        tapehook.binarize(grouped)


# ---- summary ----


def test_summary_counts_bits_and_macs():
    model = keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            keras.layers.Conv2D(16, 3, padding="same", use_bias=False, name="f"),
            keras.layers.Conv2D(32, 3, padding="same", use_bias=False, name="b"),
            keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="w"),
            keras.layers.Flatten(),
            keras.layers.Dense(10, name="d"),
        ]
    )
    tapehook.binarize(model, include="b", scale="mean_abs", activations=True)
    tapehook.binarize(model, include="w", scale="mean_abs")  # weights only
    printed = []
    result = tapehook.summary(model, print_fn=printed.append)
    rows = {r["name"]: r for r in result.rows}
    assert rows["b"]["binary"] and rows["w"]["binary"] and not rows["f"]["binary"]
    assert rows["b"]["binary_params"] == 3 * 3 * 16 * 32
    assert rows["b"]["binarized_bytes"] == 3 * 3 * 16 * 32 // 8 + 4 * 32
    # 1-bit x 1-bit products are binary MACs; a binary kernel on a float
    # input multiplies floats by +-alpha: float MACs.
    assert rows["b"]["binary_macs"] == 8 * 8 * 3 * 3 * 16 * 32 and rows["b"]["float_macs"] == 0
    assert rows["w"]["binary_macs"] == 0 and rows["w"]["float_macs"] == 8 * 8 * 3 * 3 * 32 * 8
    assert rows["f"]["float_macs"] == 8 * 8 * 3 * 3 * 3 * 16
    assert rows["d"]["float_macs"] == 8 * 8 * 8 * 10
    flops = 8 * 8 * 3 * 3 * 3 * 16 + 8 * 8 * 3 * 3 * 32 * 8 + 8 * 8 * 8 * 10
    assert result.totals["ops"] == flops + 8 * 8 * 3 * 3 * 16 * 32 / 64
    assert result.totals["binary_layers"] == 2
    assert result.totals["params"] == model.count_params()
    assert "b" in printed[0] and "mean_abs" in printed[0] and "OPs" in printed[0]


def test_summary_counts_larq_quantizer_precision():
    """tapehook.larq layers count by their quantizers' precision, marked or not."""
    import tapehook.larq as lq

    def layer(name, input_quantizer):
        return lq.layers.QuantConv2D(
            4, 3, padding="same", use_bias=False, name=name,
            input_quantizer=input_quantizer, kernel_quantizer="ste_sign",
            kernel_constraint="weight_clip",
        )  # fmt: skip

    model = keras.Sequential([keras.Input((6, 6, 4)), layer("bb", "ste_sign"), layer("fb", None)])
    rows = {r["name"]: r for r in tapehook.summary(model, print_fn=None).rows}
    macs = 6 * 6 * 3 * 3 * 4 * 4
    assert (rows["bb"]["binary_macs"], rows["bb"]["float_macs"], rows["bb"]["ops"]) == (
        macs,
        0,
        macs / 64,
    )
    assert (rows["fb"]["binary_macs"], rows["fb"]["float_macs"]) == (0, macs)
