"""What the backward of a binary-activation conv keeps instead of its float input.

The gradient needs sign(x) (for dW) and e'(x) (for dX), not x itself:

- sign bits: 1 bit per element (bit set for x >= 0), packed 8 per uint8 along
  the channel axis (channels padded to a multiple of 8 with zeros);
- e'(x): for ``ste_sign`` the mask 1{|x| <= clip}, 1 bit per element packed
  the same way: 2 bits in all, 16x smaller than float32.

``approx_sign`` and ``swish_sign`` have a continuous e'(x): matching the
reference math needs it at the input's precision, which costs as much as x
itself, so convs with those input estimators keep x (``packable``).
"""

import dataclasses

import tensorflow as tf

_SHIFTS = [7, 6, 5, 4, 3, 2, 1, 0]  # first channel in the top bit


def _pack_bits(flags):
    """bool [..., C] -> uint8 [..., ceil(C / 8)], first channel in the top bit."""
    bits = tf.cast(flags, tf.uint8)
    channels = tf.shape(bits)[-1]
    pad = (-channels) % 8
    rank = bits.shape.rank
    bits = tf.pad(bits, [[0, 0]] * (rank - 1) + [[0, pad]])
    bits = tf.reshape(bits, tf.concat([tf.shape(bits)[:-1], [-1, 8]], 0))
    return tf.reduce_sum(tf.bitwise.left_shift(bits, tf.constant(_SHIFTS, tf.uint8)), axis=-1)


def _unpack_bits(packed, channels):
    """Inverse of _pack_bits: uint8 [..., ceil(C / 8)] -> uint8 0/1 [..., C]."""
    bits = tf.bitwise.bitwise_and(tf.bitwise.right_shift(packed[..., None], tf.constant(_SHIFTS, tf.uint8)), 1)
    bits = tf.reshape(bits, tf.concat([tf.shape(packed)[:-1], [-1]], 0))
    return bits[..., :channels]


@dataclasses.dataclass
class PackedInput:
    """The bits a binary conv's backward needs from its input x."""

    signs: tf.Tensor        # uint8, packed sign bits
    mask: tf.Tensor         # uint8, packed 1{|x| <= clip}
    channels: int
    dtype: tf.DType

    def x_hat(self):
        """sign(x) as +-1 in x's dtype."""
        bits = tf.cast(_unpack_bits(self.signs, self.channels), self.dtype)
        return 2 * bits - 1

    def activation_grad(self):
        """e'(x) = 1{|x| <= clip} in x's dtype."""
        return tf.cast(_unpack_bits(self.mask, self.channels), self.dtype)


def packable(x, spec) -> bool:
    return spec.activation_estimator == "ste_sign" and x.shape[-1] is not None


def pack_input(x, spec) -> PackedInput:
    """Sign bits and ste_sign mask of a binary conv's input."""
    mask = _pack_bits(tf.abs(x) <= tf.cast(spec.clip, x.dtype))
    return PackedInput(_pack_bits(x >= 0), mask, int(x.shape[-1]), x.dtype)
