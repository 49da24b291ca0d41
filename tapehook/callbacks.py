"""FlipRatio: how many binary weights change sign per training step or epoch."""

import numpy as np

from tapehook.errors import TapehookError
from tapehook.export import binary_kernels, sign_bits

try:
    import keras

    _Callback = keras.callbacks.Callback
except ImportError:  # tapehook works without Keras; FlipRatio needs it
    _Callback = object

EVERY = ("batch", "epoch")


class FlipRatio(_Callback):
    """Fraction of binary weights whose sign changed (larq's flip ratio).

    ``every="batch"``: measured between consecutive ``on_train_batch_end`` calls
    (one per step; one per ``steps_per_execution`` steps when that is > 1),
    added to the batch logs, and the epoch's mean to the epoch logs.
    ``every="epoch"``: measured between consecutive epoch ends, added to the
    epoch logs. The key is ``flip_ratio`` (over all binary kernels, each weight
    counted once); ``per_layer=True`` adds ``flip_ratio/<layer name>`` too.
    Every measurement is also appended to ``history``, a list of dicts with
    those keys. Signs are compared on the CPU with NumPy: a copy of every
    binary kernel per measurement.
    """

    def __init__(self, every="batch", per_layer=False):
        if every not in EVERY:
            raise TapehookError(f"FlipRatio(every={every!r}): use one of {EVERY}")
        super().__init__()
        self.every, self.per_layer = every, per_layer
        self.history = []

    def on_train_begin(self, logs=None):
        # fit builds the model before this, so lazily marked kernels exist by now.
        self._kernels = [(layer.name, kernel) for layer, kernel, _ in binary_kernels(self.model)]
        if not self._kernels:
            raise TapehookError(
                f"FlipRatio: model {self.model.name!r} has no binary Conv1D / Conv2D / "
                f"DepthwiseConv2D / Dense kernels; binarize or mark it before fit"
            )
        self._signs = self._snapshot()
        self._epoch = []

    def _snapshot(self):
        return [sign_bits(kernel.numpy()) for _, kernel in self._kernels]

    def _measure(self, logs):
        signs = self._snapshot()
        flips = [int(np.count_nonzero(new != old)) for new, old in zip(signs, self._signs)]
        self._signs = signs
        ratios = {"flip_ratio": sum(flips) / sum(s.size for s in signs)}
        if self.per_layer:
            ratios.update(
                {
                    f"flip_ratio/{name}": n / s.size
                    for (name, _), n, s in zip(self._kernels, flips, signs)
                }
            )
        self.history.append(ratios)
        if logs is not None:
            logs.update(ratios)
        return ratios

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = []

    def on_train_batch_end(self, batch, logs=None):
        if self.every == "batch":
            self._epoch.append(self._measure(logs))

    def on_epoch_end(self, epoch, logs=None):
        if self.every == "epoch":
            self._measure(logs)
        elif self._epoch and logs is not None:
            logs.update(
                {key: float(np.mean([r[key] for r in self._epoch])) for key in self._epoch[0]}
            )
