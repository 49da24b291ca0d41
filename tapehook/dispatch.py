"""Which implementation runs each part of a binary conv: tapehook's kernels or
stock TF convolutions on binarized operands (tapehook/reference.py's ops).

``TAPEHOOK_DISPATCH`` picks the policy, read at each decision (trace time in
graphs): ``auto`` (default), ``kernels`` (always tapehook's kernels; what the
test suite checks against the reference) or ``stock``.

``auto`` follows bench/results/latest.json, measured in one run against stock
TF with oneDNN on and off (README, "Speed"):

- forward with binary activations: tapehook's bitpacked xor/popcount kernel,
  faster than stock on every measured shape;
- convolutions with a float operand (the weight-only forward, both
  backprops) on a CPU with Intel AMX (``kernels.amx_usable()``), stride 1,
  float32 / float16 / bfloat16, SAME or VALID padding and at least
  AMX_MIN_PIXELS input pixels (batch x H x W), dW also at least
  AMX_MIN_TAPS kernel taps unless the input was kept as packed bits:
  tapehook's kernels, which run them as exact bf16x3 AMX GEMMs
  (cc_kernels/core/amx_conv.h) — except the dW of a weight-only conv (float x
  times float dy, six bf16 products per term) when TF runs oneDNN, whose
  backprop-filter is then faster, and a binary-input dW that gets x as
  floats (not as packed bits) over images under DW_MIN_IMAGE_PIXELS;
- otherwise, forward with float activations: stock Conv2D on sign(W), then
  alpha; our AVX2 float kernels reached 0.5-0.8x of TF's AVX-512/oneDNN
  convolutions;
- otherwise, backprops: stock Conv2DBackpropInput / Filter on
  (x_hat, alpha sign W) with the estimator masks applied after, except for
  dilated convs, which TF's CPU backprops reject and tapehook's kernels
  handle natively.
"""

import os

from tapehook.errors import TapehookError

KERNELS, STOCK = "kernels", "stock"
POLICIES = ("auto", KERNELS, STOCK)


def policy() -> str:
    value = os.environ.get("TAPEHOOK_DISPATCH", "auto")
    if value not in POLICIES:
        raise TapehookError(f"TAPEHOOK_DISPATCH={value!r}; use one of {POLICIES}")
    return value


# The AMX kernels split their float operand and pack sign(W) before the GEMM;
# below these sizes that preparation outweighs the GEMM and stock convs win.
# Bench (oneDNN on): batch-1 14x14x256 (196 pixels) at parity to 1.15x;
# 1x1: forward 1.2-1.3x, dX 1.2x, a float-input dW 0.96-1.07x.
AMX_MIN_TAPS = 4
AMX_MIN_PIXELS = 128
# A dW whose input reaches it as floats (binary activations not kept as packed
# bits: approx_sign / swish_sign, or TAPEHOOK_PACK_INPUTS=0) over images of
# fewer pixels than this: stock. Bench, batch 16: 7x7x512 0.82-0.94x (oneDNN
# on) and 0.82-1.06x (off); 14x14x256 1.3x and 2.1x. From packed bits our dW
# wins everywhere (7x7x512: 1.7x on, 2.0x off), stock having to unpack first.
DW_MIN_IMAGE_PIXELS = 100


def _known(shape, dims):
    """Whether a static 4-D shape has its first ``dims`` dims known (False for
    None and for shapes of unknown rank)."""
    try:
        dims_list = list(shape)
    except (TypeError, ValueError):  # None, or a TensorShape of unknown rank
        return False
    return len(dims_list) == 4 and None not in dims_list[:dims]


def _amx_fits(attrs, dtype, x_shape=None, w_shape=None, min_taps=1) -> bool:
    """Whether the AMX kernels take this conv (mirrors amx::Supports*) and it
    is big enough for them to beat stock. Unknown dims count as large."""
    from tapehook import kernels  # kernels imports TF; keep this module light

    if attrs is None or dtype is None:
        return False
    if _known(x_shape, 3) and (int(x_shape[0]) * int(x_shape[1]) * int(x_shape[2])
                               < AMX_MIN_PIXELS):
        return False
    if _known(w_shape, 2) and int(w_shape[0]) * int(w_shape[1]) < min_taps:
        return False
    return (all(s == 1 for s in attrs["strides"])
            and attrs["padding"] in ("SAME", "VALID")
            and dtype in ("float32", "float16", "bfloat16")
            and kernels.amx_usable())


def forward_path(spec, attrs=None, dtype=None, x_shape=None, w_shape=None) -> str:
    """attrs: the conv's attrs (strides, padding, dilations, ...); dtype: the
    input's dtype name; x_shape / w_shape: static shapes (NHWC, HWIO)."""
    chosen = policy()
    if chosen != "auto":
        return chosen
    if spec.activation_estimator or _amx_fits(attrs, dtype, x_shape, w_shape):
        return KERNELS
    return STOCK


def backprop_path(attrs, dtype=None, x_shape=None, w_shape=None,
                  filter_grad=False, binary_input=True, packed=False) -> str:
    """Path of one backprop: filter_grad selects dW (else dX); binary_input
    says whether x enters it as sign(x); packed, whether the backward kept
    packed input bits (which stock ops need unpacked first)."""
    chosen = policy()
    if chosen != "auto":
        return chosen
    if any(d != 1 for d in attrs["dilations"]):
        return KERNELS
    # A 1x1 dW runs about as fast as stock on AMX: take it only when the
    # kernels save unpacking the input bits. A 1x1 dX wins (1.2x).
    min_taps = 1 if packed or not filter_grad else AMX_MIN_TAPS
    if not _amx_fits(attrs, dtype, x_shape, w_shape, min_taps):
        return STOCK
    if (filter_grad and binary_input and not packed and _known(x_shape, 3)
            and int(x_shape[1]) * int(x_shape[2]) < DW_MIN_IMAGE_PIXELS):
        return STOCK
    # dW of a weight-only conv is float x float: no exact operand, so AMX needs
    # six bf16 products per term, slower than oneDNN's backprop-filter.
    if filter_grad and not binary_input:
        from tapehook import compat

        return STOCK if compat.onednn_enabled() else KERNELS
    return KERNELS
