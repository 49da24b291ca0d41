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
  float32 / float16 / bfloat16 and SAME or VALID padding: tapehook's kernels,
  which run them as exact bf16x3 AMX GEMMs (cc_kernels/core/amx_conv.h);
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


def _amx_fits(attrs, dtype) -> bool:
    """Whether the AMX kernels take this conv (mirrors amx::Supports*)."""
    from tapehook import kernels  # kernels imports TF; keep this module light

    return (attrs is not None and dtype is not None
            and all(s == 1 for s in attrs["strides"])
            and attrs["padding"] in ("SAME", "VALID")
            and dtype in ("float32", "float16", "bfloat16")
            and kernels.amx_usable())


def forward_path(spec, attrs=None, dtype=None) -> str:
    """attrs: the conv's attrs (strides, padding, dilations, ...); dtype: the
    input's dtype name."""
    chosen = policy()
    if chosen != "auto":
        return chosen
    if spec.activation_estimator or _amx_fits(attrs, dtype):
        return KERNELS
    return STOCK


def backprop_path(attrs, dtype=None) -> str:
    chosen = policy()
    if chosen != "auto":
        return chosen
    if any(d != 1 for d in attrs["dilations"]) or _amx_fits(attrs, dtype):
        return KERNELS
    return STOCK
