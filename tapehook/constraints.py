"""Keras 3 weight constraints for binary networks."""

import math

import keras

from tapehook.errors import TapehookError


@keras.saving.register_keras_serializable(package="tapehook")
class WeightClip(keras.constraints.Constraint):
    """Clips latent weights to ``[-clip_value, clip_value]`` after each update.

    larq's ``WeightClip`` on Keras 3: with a straight-through sign estimator
    (``ste_sign`` passes gradients where ``|w| <= clip``) latent weights that
    drift past the clip get no gradient any more and can never flip back;
    clipping them keeps every binary weight trainable. Use it as a layer's
    ``kernel_constraint``; the optimizer applies it after each step.
    """

    def __init__(self, clip_value=1.0):
        if (
            isinstance(clip_value, bool)
            or not isinstance(clip_value, (int, float))
            or (not math.isfinite(clip_value) or clip_value <= 0)
        ):
            raise TapehookError(
                f"WeightClip(clip_value={clip_value!r}): clip_value must be a positive "
                f"finite number, e.g. 1.0 (the clip of the ste_sign estimator)"
            )
        self.clip_value = float(clip_value)

    def __call__(self, w):
        return keras.ops.clip(w, -self.clip_value, self.clip_value)

    def get_config(self):
        return {"clip_value": self.clip_value}
