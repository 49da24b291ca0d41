"""What the backward of a binary-activation conv keeps instead of its float input.

With the ``ste_sign`` input estimator the gradient needs sign(x) (for dW) and
1{|x| <= clip} (for dX), not x: 2 bits per element, packed 4 elements per
byte along the channel axis by tapehook's TapehookPackInput kernel
(cc_kernels/core/pack_input.h), 16x smaller than float32.

``approx_sign`` and ``swish_sign`` have a continuous e'(x). For a float32
input the backward keeps the sign bits (masks all ones) and e'(x) itself,
computed in the forward, in 16 bits (18 bits per element instead of 32):
dW is exact (it reads only sign(x)) and dX is dX_hat * e'(x).

``tapehook.config``'s ``pack_inputs`` chooses (default: the
``TAPEHOOK_PACK_INPUTS`` environment variable, else ``1``; read at each
conv's forward):

- ``1`` (default): ste_sign inputs as bits; approx_sign / swish_sign inputs
  of float32 as bits plus e'(x) in 16-bit fixed point over the derivative's
  range (``TapehookEstimatorGradFixed``): e' off by at most 1.53e-5
  (approx_sign, e' in [0, 2]) or 4.1e-5 (swish_sign, e' in [-0.37, 5]) in
  absolute terms, so dX by at most that times |dX_hat| (the gradient
  reaching the sign): about the float32 tolerance the tests hold the
  reference to (2e-5 of a tensor's scale), more than it relative to dX's
  own scale only where every e'(x) is small; 32x finer than binary16 near
  e' = 2. On machines with a GPU (the fixed-point ops are CPU kernels) and
  for other dtypes (half / bfloat16 x is no larger; float64's e'(x) would
  lose most of its bits) those inputs keep x;
- ``float32``: approx_sign / swish_sign inputs keep x, so dX is the
  reference's float32 math (ste_sign inputs still as bits);
- ``0``: x everywhere: the packing costs a pass over x in the forward and an
  unpack in the backward (docs/performance.md);
- ``float16``: approx_sign / swish_sign inputs of float32 as bits plus e'(x)
  rounded to binary16 (to nearest even), also where a GPU is present: e'(x)
  off by at most 2^-11 relative (2^-25 absolute below 2^-14).
"""

import dataclasses

import tensorflow as tf

from tapehook import kernels
from tapehook.config import config
from tapehook.spec import _clip_attrs

# Clip attrs of no ste_sign mask (+inf): all mask bits one.
NO_MASK = _clip_attrs("clip", None)


@dataclasses.dataclass
class PackedInput:
    """The bits a binary conv's backward needs from its input x."""

    packed: tf.Tensor  # uint8 [..., ceil(channels / 4)]
    channels: int
    dtype: tf.DType
    # e'(x) of a continuous estimator: uint16 fixed point (the default) or
    # float16 (pack_inputs='float16'); None for ste_sign, whose e'(x)
    # is the mask bits.
    derivative: tf.Tensor | None = None
    estimator: str | None = None

    @property
    def shape(self) -> tf.TensorShape:
        """The static shape of the input these bits stand for."""
        return self.packed.shape[:-1].concatenate([self.channels])

    def unpack(self):
        """(sign(x) as +-1, e'(x)) in x's dtype: e'(x) is the ste_sign mask
        1{|x| <= clip}, or the kept derivative as the kernels widen it."""
        library = kernels.loaded_library()
        x_hat, mask = library.tapehook_unpack_input(
            self.packed, channels=self.channels, T=self.dtype
        )
        if self.derivative is not None:
            mask = scale_by_derivative(tf.ones_like(x_hat), self)
        return x_hat, mask


def scale_by_derivative(grad, packed: PackedInput):
    """grad * the kept e'(x), on the kernels (which own the fixed point's
    offset and step)."""
    library = kernels.loaded_library()
    if packed.derivative.dtype == tf.float16:
        return library.tapehook_scale_by_half(grad, packed.derivative)
    return library.tapehook_scale_by_fixed(
        grad, packed.derivative, activation_estimator=packed.estimator
    )


def mode() -> str:
    """The pack_inputs setting in force here (tapehook.config)."""
    return config.get("pack_inputs")


def packable(x, spec) -> bool:
    if spec.activation_estimator is None or x.shape[-1] is None:
        return False
    chosen = mode()
    if spec.activation_estimator == "ste_sign":
        return chosen != "0"
    if x.dtype != tf.float32:
        return False
    if chosen == "float16":
        return True
    return chosen == "1" and not kernels.gpu_visible()


def pack_input(x, spec, threshold=()) -> PackedInput:
    """The bits (and, for a continuous estimator, the 16-bit e'(x)) a binary
    conv's backward keeps of its input (compiled kernels); with
    ``threshold=[beta]`` those of x - beta (RSign's shift), which the kernels
    compute a run at a time instead of a tensor of its own."""
    library = kernels.library()
    threshold = list(threshold)
    if spec.activation_estimator == "ste_sign":
        packed = library.tapehook_pack_input(x, threshold=threshold, **spec.pack_attrs())
        return PackedInput(packed, int(x.shape[-1]), x.dtype)
    # Sign bits with masks of all ones (no clip): the packed backprops then
    # give dX_hat, which the backward scales by the kept e'(x).
    packed = library.tapehook_pack_input(x, threshold=threshold, **NO_MASK)
    estimator = spec.activation_estimator
    grad = (
        library.tapehook_estimator_grad_half
        if mode() == "float16"
        else library.tapehook_estimator_grad_fixed
    )
    derivative = grad(x, threshold=threshold, activation_estimator=estimator)
    return PackedInput(packed, int(x.shape[-1]), x.dtype, derivative, estimator)
