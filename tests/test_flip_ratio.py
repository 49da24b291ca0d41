"""FlipRatio in model.fit: equal to sign changes counted with NumPy between
kernel snapshots that a separate callback takes."""

import keras
import numpy as np
import pytest

import tapehook
from tapehook.callbacks import FlipRatio

STEPS, EPOCHS = 6, 3


class Snapshots(keras.callbacks.Callback):
    """Copies of the given kernels at train begin and at every batch / epoch end,
    and the flip_ratio the logs carried then."""

    def __init__(self, kernels):
        super().__init__()
        self.kernels = kernels
        self.batches, self.epochs, self.batch_logs, self.epoch_logs = [], [], [], []

    def _copy(self):
        return [k.numpy().copy() for k in self.kernels]

    def on_train_begin(self, logs=None):
        self.batches.append(self._copy())
        self.epochs.append(self._copy())

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(self._copy())
        self.batch_logs.append(logs.get("flip_ratio"))

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(self._copy())
        self.epoch_logs.append(logs.get("flip_ratio"))


def _flips(before, after):
    """(over all kernels, per kernel) fraction of weights whose sign changed."""
    changed = [np.count_nonzero((a >= 0) != (b >= 0)) for a, b in zip(before, after)]
    return sum(changed) / sum(a.size for a in after), [c / a.size for c, a in zip(changed, after)]


def _fit(callback, run_eagerly=False):
    keras.utils.set_random_seed(0)
    model = tapehook.binarize(
        keras.Sequential(
            [
                keras.Input((8, 8, 3)),
                keras.layers.Conv2D(8, 3, padding="same", name="stem"),
                keras.layers.Conv2D(16, 3, padding="same", name="mid"),
                keras.layers.Conv2D(16, 3, name="top"),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(4, name="head"),
            ]
        ),
        first_and_last_float=True,
        activations=True,
        scale="mean_abs",
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        run_eagerly=run_eagerly,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    kernels = [model.get_layer("mid").kernel, model.get_layer("top").kernel]
    snapshots = Snapshots(kernels)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * STEPS, 8, 8, 3)).astype("float32")
    y = rng.integers(0, 4, size=4 * STEPS)
    history = model.fit(
        x, y, batch_size=4, epochs=EPOCHS, verbose=0, callbacks=[callback, snapshots]
    )
    return history, snapshots


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["compiled", "eager"])
def test_per_batch_flip_ratio_matches_numpy(run_eagerly):
    callback = FlipRatio(per_layer=True)
    history, snaps = _fit(callback, run_eagerly)
    expected = [_flips(a, b) for a, b in zip(snaps.batches, snaps.batches[1:])]
    assert len(callback.history) == len(expected) == STEPS * EPOCHS
    assert any(total > 0 for total, _ in expected)  # the test would be vacuous otherwise
    for got, (total, (mid, top)) in zip(callback.history, expected):
        assert got == {
            "flip_ratio": pytest.approx(total, rel=1e-12),
            "flip_ratio/mid": pytest.approx(mid, rel=1e-12),
            "flip_ratio/top": pytest.approx(top, rel=1e-12),
        }
    assert snaps.batch_logs == [r["flip_ratio"] for r in callback.history]
    per_epoch = [
        np.mean([t for t, _ in expected[e * STEPS : (e + 1) * STEPS]]) for e in range(EPOCHS)
    ]
    assert history.history["flip_ratio"] == pytest.approx(per_epoch, rel=1e-12)
    assert len(history.history["flip_ratio/mid"]) == EPOCHS


def test_per_epoch_flip_ratio_matches_numpy():
    callback = FlipRatio(every="epoch")
    history, snaps = _fit(callback)
    expected = [_flips(a, b)[0] for a, b in zip(snaps.epochs, snaps.epochs[1:])]
    assert len(expected) == EPOCHS and any(expected)
    assert [r["flip_ratio"] for r in callback.history] == pytest.approx(expected, rel=1e-12)
    assert history.history["flip_ratio"] == pytest.approx(expected, rel=1e-12)
    assert snaps.batch_logs == [None] * (STEPS * EPOCHS)
    assert "flip_ratio/mid" not in history.history


def test_model_without_binary_kernels_is_refused():
    model = keras.Sequential([keras.Input((4, 4, 1)), keras.layers.Conv2D(2, 3)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(
        tapehook.TapehookError, match="no binary Conv1D / Conv2D / DepthwiseConv2D / Dense kernels"
    ):
        model.fit(
            np.zeros((2, 4, 4, 1)), np.zeros((2, 2, 2, 2)), verbose=0, callbacks=[FlipRatio()]
        )


def test_bad_every_is_refused():
    with pytest.raises(tapehook.TapehookError, match="every='step'"):
        FlipRatio(every="step")
