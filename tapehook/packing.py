"""What the backward of a binary-activation conv keeps instead of its float input.

With the ``ste_sign`` input estimator the gradient needs sign(x) (for dW) and
1{|x| <= clip} (for dX), not x: 2 bits per element, packed 4 elements per
byte along the channel axis by tapehook's TapehookPackInput kernel
(cc_kernels/core/pack_input.h), 16x smaller than float32.

``approx_sign`` and ``swish_sign`` have a continuous e'(x): matching the
reference math needs it at the input's precision, which costs as much as x
itself, so convs with those input estimators keep x (``packable``).
``TAPEHOOK_PACK_INPUTS=0`` keeps x everywhere: the packing costs a pass over
x in the forward and an unpack in the backward (docs/performance.md).
"""

import dataclasses
import os

import tensorflow as tf

from tapehook import kernels


@dataclasses.dataclass
class PackedInput:
    """The bits a binary conv's backward needs from its input x."""

    packed: tf.Tensor  # uint8 [..., ceil(channels / 4)]
    channels: int
    dtype: tf.DType

    @property
    def shape(self) -> tf.TensorShape:
        """The static shape of the input these bits stand for."""
        return self.packed.shape[:-1].concatenate([self.channels])

    def unpack(self):
        """(sign(x) as +-1, 1{|x| <= clip}) in x's dtype."""
        return kernels.library().tapehook_unpack_input(
            self.packed, channels=self.channels, T=self.dtype
        )


def packable(x, spec) -> bool:
    return (
        spec.activation_estimator == "ste_sign"
        and x.shape[-1] is not None
        and os.environ.get("TAPEHOOK_PACK_INPUTS", "1") != "0"
    )


def pack_input(x, spec) -> PackedInput:
    """Sign and ste_sign mask bits of a binary conv's input (compiled kernels)."""
    packed = kernels.library().tapehook_pack_input(x, **spec.pack_attrs())
    return PackedInput(packed, int(x.shape[-1]), x.dtype)
