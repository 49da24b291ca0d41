"""Which implementation runs each part of a binary conv: tapehook's kernels or
stock TF convolutions on binarized operands (tapehook/reference.py's ops).

``TAPEHOOK_DISPATCH`` picks the policy, read at each decision (trace time in
graphs): ``auto`` (default), ``kernels`` (always tapehook's kernels; what the
test suite checks against the reference) or ``stock``.

``auto`` follows bench/results/latest.json, measured in one run against stock
TF with oneDNN on and off (README, "Speed"):

- forward with binary activations: tapehook's bitpacked xor/popcount kernel,
  faster than stock on every measured shape (1.4-3.8x);
- forward with float activations: stock Conv2D on sign(W), then alpha; our
  float kernels reached 0.5-0.8x of TF's AVX-512/oneDNN convolutions;
- backprops: stock Conv2DBackpropInput / Filter on (x_hat, alpha sign W) with
  the estimator masks applied after, except for dilated convs, which TF's CPU
  backprops reject and tapehook's kernels handle natively.
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


def forward_path(spec) -> str:
    chosen = policy()
    if chosen != "auto":
        return chosen
    return KERNELS if spec.activation_estimator else STOCK


def backprop_path(attrs) -> str:
    chosen = policy()
    if chosen != "auto":
        return chosen
    return KERNELS if any(d != 1 for d in attrs["dilations"]) else STOCK
