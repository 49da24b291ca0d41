"""larq.constraints on Keras 3: WeightClip (tapehook.constraints.WeightClip).

"weight_clip" resolves through ``keras.constraints.get`` and round-trips
through Keras serialization.
"""

import keras

from tapehook.larq import utils

__all__ = ["WeightClip", "weight_clip"]

try:
    from tapehook.constraints import WeightClip as _TapehookWeightClip
except ImportError:  # tapehook without its constraints module
    _TapehookWeightClip = None


if _TapehookWeightClip is not None:

    @utils.register_keras_custom_object
    @keras.saving.register_keras_serializable(package="larq")
    class WeightClip(_TapehookWeightClip):
        """Clips weights to [-clip_value, clip_value] (larq's WeightClip)."""

        def __init__(self, clip_value: float = 1):
            super().__init__(clip_value)
else:

    @utils.register_keras_custom_object
    @keras.saving.register_keras_serializable(package="larq")
    class WeightClip(keras.constraints.Constraint):
        """Clips weights to [-clip_value, clip_value] (larq's WeightClip)."""

        def __init__(self, clip_value: float = 1):
            self.clip_value = clip_value

        def __call__(self, w):
            return keras.ops.clip(w, -self.clip_value, self.clip_value)

        def get_config(self):
            return {"clip_value": self.clip_value}


@utils.register_keras_custom_object
@keras.saving.register_keras_serializable(package="larq")
class weight_clip(WeightClip):  # noqa: N801 (larq's alias)
    pass


utils.register_keras_name("constraints", "weight_clip", weight_clip)
