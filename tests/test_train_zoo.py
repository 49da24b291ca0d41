"""examples/train_zoo.py on a tiny generated image folder: it trains a zoo
model on tapehook's kernels, checkpoints, resumes after an interruption and
exports LiteRT and LCE files whose own accuracy it reports."""

import importlib.util
import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tapehook

pytestmark = pytest.mark.slow

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "train_zoo.py"
COLORS = ((220, 40, 40), (40, 200, 60), (50, 60, 230))


def _module():
    spec = importlib.util.spec_from_file_location("train_zoo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """Three classes of noisy coloured PNGs, ten each, of varied sizes."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.RandomState(0)
    for c, color in enumerate(COLORS):
        (root / f"class_{c}").mkdir()
        for i in range(10):
            h, w = rng.randint(40, 70, size=2)
            image = np.clip(np.array(color) + rng.normal(0, 30, (h, w, 3)), 0, 255)
            png = tf.io.encode_png(image.astype(np.uint8)).numpy()
            (root / f"class_{c}" / f"{i}.png").write_bytes(png)
    return root


class _Interrupt(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        raise KeyboardInterrupt("simulated interruption")


def _args(folder, out, epochs, deploy=""):
    return [
        "--model", "QuickNetSmall", "--data", str(folder), "--image-size", "64",
        "--epochs", str(epochs), "--batch-size", "4", "--steps-per-epoch", "2",
        "--out", str(out), "--deploy", deploy, "--verbose", "0",
    ]  # fmt: skip


def test_trains_checkpoints_and_exports(image_folder, tmp_path):
    tapehook.reset_dispatch_counts()
    result = _module().main(_args(image_folder, tmp_path, 2, deploy="litert,lce"))
    assert result["classes"] == ["class_0", "class_1", "class_2"]
    assert result["epochs_run"] == 2 and len(result["history"]["loss"]) == 2
    assert np.isfinite(result["history"]["loss"]).all()
    # The binary convs' backward ran on tapehook's compiled kernels.
    assert tapehook.dispatch_counts()["compiled"]["backprop_filter"] > 0
    for name in ("last.keras", "best.keras"):
        assert (tmp_path / name).stat().st_size > 0
    # Each exported file reproduces the Keras model's accuracy on the
    # validation images (binary decisions are exact in both).
    assert set(result["file_accuracy"]) == {"litert", "lce"}
    for accuracy in result["file_accuracy"].values():
        assert abs(accuracy - result["keras_accuracy"]) <= 1 / 6 + 1e-9
    reloaded = keras.models.load_model(tmp_path / "last.keras")
    assert (
        reloaded.count_params() == keras.models.load_model(tmp_path / "best.keras").count_params()
    )


def test_resumes_after_an_interruption(image_folder, tmp_path, monkeypatch):
    module = _module()
    plain = module.callbacks
    monkeypatch.setattr(module, "callbacks", lambda out, model: plain(out, model) + [_Interrupt()])
    with pytest.raises(KeyboardInterrupt):
        module.main(_args(image_folder, tmp_path, 3))
    assert (tmp_path / "backup").exists()
    monkeypatch.setattr(module, "callbacks", plain)
    result = module.main(_args(image_folder, tmp_path, 3))
    # Epoch 1 came from the backup; only epochs 2 and 3 ran now.
    assert result["epochs_run"] == 2


def test_recipes_cover_the_zoo():
    from tapehook import zoo

    assert set(_module().RECIPES) == {*zoo.MODELS, *zoo.EXTRA_MODELS}


class _Record(keras.callbacks.Callback):
    """Each stage's RSign thresholds and stem kernel at its start and end."""

    def __init__(self, model, log):
        super().__init__()
        self.watched, self.log = model, log

    def _weights(self):
        m = self.watched
        return [
            m.get_layer("block_1_3x3_rsign").beta.numpy(),
            m.get_layer("stem_conv").kernel.numpy(),
        ]

    def on_train_begin(self, logs=None):
        self.log.append(("begin", self.watched, self._weights()))

    def on_train_end(self, logs=None):
        self.log.append(("end", self.watched, self._weights()))


def test_reactnet_two_stage_distillation(image_folder, tmp_path, monkeypatch):
    """ReActNet's recipe: a float teacher, stage 1 with float kernels, stage 2
    binary from stage 1's weights; one step each at 32 px."""
    import tapehook.larq as lq

    teacher = keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(4, 3),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    teacher.save(tmp_path / "teacher.keras")
    module, log = _module(), []
    plain = module.callbacks
    monkeypatch.setattr(module, "callbacks", lambda out, m: plain(out, m) + [_Record(m, log)])
    args = [
        "--model", "ReActNetA", "--data", str(image_folder), "--image-size", "32",
        "--epochs", "1", "--batch-size", "4", "--steps-per-epoch", "1", "--out",
        str(tmp_path / "out"), "--deploy", "", "--verbose", "0",
        "--teacher", str(tmp_path / "teacher.keras"), "--two-stage",
    ]  # fmt: skip
    result = module.main(args)
    assert np.isfinite(result["history"]["distillation_loss"]).all()
    (_, first, start1), (_, _, end1), (_, second, start2), _ = log
    assert first is not second
    for before, after, carried in zip(start1, end1, start2):
        assert not np.array_equal(before, after)  # stage 1 trained them
        np.testing.assert_array_equal(carried, after)  # stage 2 starts there

    def convs(model):
        return [layer for layer in model.layers if isinstance(layer, lq.layers.QuantConv2D)]

    assert (tmp_path / "out" / "stage1" / "last.keras").exists()
    assert len(convs(first)) == 31 and not any(conv.binary_spec.weights for conv in convs(first))
    for conv in convs(second):
        assert conv.binary_spec.weights and conv.binary_spec.activations
        latent = conv.kernel.numpy()
        with lq.context.quantized_scope(True):
            binary = np.asarray(conv.kernel)
        # sign(W) times the mean |W| of each output channel.
        alpha = np.abs(latent.astype("float64")).mean(axis=(0, 1, 2))
        np.testing.assert_allclose(binary, np.where(latent >= 0, 1, -1) * alpha, rtol=1e-5)
