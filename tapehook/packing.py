"""What the backward of a binary-activation conv keeps instead of its float input.

With the ``ste_sign`` input estimator the gradient needs sign(x) (for dW) and
1{|x| <= clip} (for dX), not x: 2 bits per element, packed 4 elements per
byte along the channel axis by tapehook's TapehookPackInput kernel
(cc_kernels/core/pack_input.h), 16x smaller than float32.

``approx_sign`` and ``swish_sign`` have a continuous e'(x): matching the
reference math needs it at the input's precision, which costs as much as x
itself, so by default convs with those input estimators keep x.

``TAPEHOOK_PACK_INPUTS`` chooses (read at each conv's forward):

- ``1`` (default): ste_sign inputs as bits, the others as x;
- ``0``: x everywhere: the packing costs a pass over x in the forward and an
  unpack in the backward (docs/performance.md);
- ``float16``: also approx_sign / swish_sign inputs of float32 as bits
  (sign only: their masks are all ones) plus e'(x) rounded to binary16 (to
  nearest even), computed in the forward: 18 bits per element instead of 32.
  dW is exact (it reads only sign(x)); dX is dX_hat * e'(x) with e'(x)
  off by at most 2^-11 relative (2^-25 absolute below 2^-14): a precision
  trade, not the reference's float32 math. Inputs of other dtypes keep x
  (half / bfloat16 x is no larger; float64's e'(x) would lose 42 bits).
"""

import dataclasses
import os

import tensorflow as tf

from tapehook import kernels
from tapehook.errors import TapehookError
from tapehook.spec import _clip_attrs

# Clip attrs of no ste_sign mask (+inf): all mask bits one.
NO_MASK = _clip_attrs("clip", None)


@dataclasses.dataclass
class PackedInput:
    """The bits a binary conv's backward needs from its input x."""

    packed: tf.Tensor  # uint8 [..., ceil(channels / 4)]
    channels: int
    dtype: tf.DType
    # e'(x) in float16 for a continuous estimator (TAPEHOOK_PACK_INPUTS=
    # float16); None for ste_sign, whose e'(x) is the mask bits.
    derivative: tf.Tensor | None = None

    @property
    def shape(self) -> tf.TensorShape:
        """The static shape of the input these bits stand for."""
        return self.packed.shape[:-1].concatenate([self.channels])

    def unpack(self):
        """(sign(x) as +-1, e'(x)) in x's dtype: e'(x) is the ste_sign mask
        1{|x| <= clip}, or the kept float16 derivative widened."""
        x_hat, mask = kernels.library().tapehook_unpack_input(
            self.packed, channels=self.channels, T=self.dtype
        )
        if self.derivative is not None:
            mask = tf.cast(self.derivative, self.dtype)
        return x_hat, mask


MODES = ("1", "0", "float16")


def mode() -> str:
    value = os.environ.get("TAPEHOOK_PACK_INPUTS", "1")
    if value not in MODES:
        raise TapehookError(f"TAPEHOOK_PACK_INPUTS={value!r}; use one of {MODES} (packing.py)")
    return value


def packable(x, spec) -> bool:
    if spec.activation_estimator is None or x.shape[-1] is None:
        return False
    chosen = mode()
    if spec.activation_estimator == "ste_sign":
        return chosen != "0"
    return chosen == "float16" and x.dtype == tf.float32


def pack_input(x, spec) -> PackedInput:
    """The bits (and, for a continuous estimator, the float16 e'(x)) a binary
    conv's backward keeps of its input (compiled kernels)."""
    library = kernels.library()
    if spec.activation_estimator == "ste_sign":
        packed = library.tapehook_pack_input(x, **spec.pack_attrs())
        return PackedInput(packed, int(x.shape[-1]), x.dtype)
    # Sign bits with masks of all ones (no clip): the packed backprops then
    # give dX_hat, which the backward scales by the kept e'(x).
    packed = library.tapehook_pack_input(x, **NO_MASK)
    derivative = library.tapehook_estimator_grad_half(
        x, activation_estimator=spec.activation_estimator
    )
    return PackedInput(packed, int(x.shape[-1]), x.dtype, derivative)
