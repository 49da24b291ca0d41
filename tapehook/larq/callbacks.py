"""larq.callbacks on Keras 3: HyperparameterScheduler."""

import keras

__all__ = ["HyperparameterScheduler"]


def _get(value):
    return (
        float(keras.ops.convert_to_numpy(value)) if not isinstance(value, (int, float)) else value
    )


class HyperparameterScheduler(keras.callbacks.Callback):
    """Sets ``optimizer.<hyperparameter>`` from ``schedule(epoch_or_step[, current])``.

    As larq's: ``update_freq`` "epoch" (default) or "step" (the optimizer's
    iteration count); ``optimizer`` defaults to the model's; the value is
    logged under ``log_name`` (default: the hyperparameter's name) each epoch.
    """

    def __init__(
        self,
        schedule,
        hyperparameter,
        optimizer=None,
        update_freq="epoch",
        verbose=0,
        log_name=None,
    ):
        super().__init__()
        if update_freq not in ("epoch", "step"):
            raise ValueError(
                f"HyperparameterScheduler.update_freq can only be 'step' or "
                f"'epoch'. Received value '{update_freq}'"
            )
        self.optimizer = optimizer
        self.schedule = schedule
        self.hyperparameter = hyperparameter
        self.log_name = log_name or hyperparameter
        self.verbose = verbose
        self.update_freq = update_freq

    def set_model(self, model):
        super().set_model(model)
        if self.optimizer is None:
            self.optimizer = model.optimizer
        if self.hyperparameter == "lr" and not hasattr(self.optimizer, "lr"):
            self.hyperparameter = "learning_rate"  # tf-keras's alias; Keras 3 has no lr
        if not hasattr(self.optimizer, self.hyperparameter):
            raise ValueError(f'Optimizer must have a "{self.hyperparameter}" attribute.')

    def _set(self, t):
        current = _get(getattr(self.optimizer, self.hyperparameter))
        try:
            value = self.schedule(t, current)
        except TypeError:  # schedule(t), larq's older form
            value = self.schedule(t)
        hp = getattr(self.optimizer, self.hyperparameter)
        if hasattr(hp, "assign"):
            hp.assign(value)
        else:
            setattr(self.optimizer, self.hyperparameter, value)
        return _get(getattr(self.optimizer, self.hyperparameter))

    def on_batch_begin(self, batch, logs=None):
        if self.update_freq != "step":
            return
        step = int(_get(self.optimizer.iterations))
        value = self._set(step)
        if self.verbose > 0:
            print(f"Batch {step}: {self.log_name} is now {value}.")

    def on_epoch_begin(self, epoch, logs=None):
        if self.update_freq != "epoch":
            return
        value = self._set(epoch)
        if self.verbose > 0:
            print(f"Epoch {epoch}: {self.log_name} is now {value}.")

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs[self.log_name] = _get(getattr(self.optimizer, self.hyperparameter))
