"""BinarySpec: what "binary" means for one marked filter (validated, immutable)."""

import dataclasses
import struct

import numpy as np

from tapehook.errors import TapehookError

# Pseudo-derivatives of sign for the backward pass (math in docs/design.md).
ESTIMATORS = ("ste_sign", "approx_sign", "swish_sign")
SCALES = (None, "mean_abs")
PAD_VALUES = (0.0, 1.0)
BALANCES = (None, "mean", "std")
FIELDS = (
    "activations",
    "scale",
    "ste",
    "clip",
    "pad_value",
    "weights",
    "beta",
    "activation_clip",
    "balance",
)


class _SameAsClip:
    """activation_clip's default: the input's clip is the weights' clip."""

    def __repr__(self):
        return "SAME_AS_CLIP"

    def __reduce__(self):
        return "SAME_AS_CLIP"


SAME_AS_CLIP = _SameAsClip()


def clip_threshold(clip: float, float64: bool) -> float:
    """The number ``|t| <= clip`` compares against, exact for t in its dtype.

    float64 inputs use clip itself. Every half / bfloat16 / float32 value is a
    float32 number, and for those |t| <= clip holds exactly when |t| <= the
    largest float32 not above clip (rounding to nearest could widen the mask:
    float32(0.1) = 0.10000000149).
    """
    if clip is None:  # no mask
        return float("inf")
    if float64:
        return float(clip)
    narrow = np.float32(clip)
    if float(narrow) > clip:
        narrow = np.nextafter(narrow, np.float32(0))
    return float(narrow)


def _clip_attrs(name, clip) -> dict:
    """A clip as two op attrs: float32 rounded toward zero (exact for half /
    bfloat16 / float32 inputs, see clip_threshold) and the double's bits for
    float64 inputs; no mask (None) is +inf."""
    return {
        name: clip_threshold(clip, float64=False),
        f"{name}_f64_bits": float64_bits(clip_threshold(clip, float64=True)),
    }


def float64_bits(value: float) -> int:
    """The IEEE-754 bit pattern of a double, as a signed 64-bit int attr."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def float64_from_bits(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating))


@dataclasses.dataclass(frozen=True)
class BinarySpec:
    """How a marked kernel (and optionally its input) is binarized.

    - ``ste``: estimator of the weights' gradient (one of ``ESTIMATORS``).
    - ``clip``: ``ste_sign`` on the weights passes gradients where
      ``|t| <= clip``; None: everywhere (no mask).
    - ``scale``: None (alpha = 1) or ``"mean_abs"`` (alpha per output channel).
    - ``activations``: False (float input), True (input binarized with
      ``ste``), or an estimator name used for the input alone.
    - ``pad_value``: 0.0 or 1.0, what SAME / EXPLICIT padding pads the conv
      input x_hat with (larq ``pad_values``).
    - ``weights``: False keeps the kernel float (no sign, no alpha) while the
      input is binarized: the first stage of the two-stage BAN recipe.
    - ``beta``: swish_sign's beta, for weights and input.
    - ``activation_clip``: ``ste_sign``'s clip for the input (default: clip).
    - ``balance``: None, ``"mean"`` or ``"std"`` (IR-Net's balanced weights):
      the kernel is binarized as W - mean(W), or (W - mean(W)) / std(W), per
      output channel (``reference.balanced_kernel``); sign, alpha and the
      estimator's mask are taken there, and the gradient flows through the
      mean and the deviation to W.
    """

    activations: bool | str = False
    scale: str | None = None
    ste: str = "ste_sign"
    clip: float | None = 1.0
    pad_value: float = 0.0
    weights: bool = True
    beta: float = 5.0
    activation_clip: float | None = SAME_AS_CLIP
    balance: str | None = None

    def __post_init__(self):
        if self.ste not in ESTIMATORS:
            raise TapehookError(f"unknown estimator ste={self.ste!r}; use one of {ESTIMATORS}")
        if self.scale not in SCALES:
            raise TapehookError(f"unknown scale={self.scale!r}; use None or 'mean_abs'")
        if not isinstance(self.activations, bool) and self.activations not in ESTIMATORS:
            raise TapehookError(
                f"activations={self.activations!r} is not supported; use False "
                f"(float input), True (same estimator as the weights) or one "
                f"of {ESTIMATORS}"
            )
        if self.activation_clip is SAME_AS_CLIP:
            object.__setattr__(self, "activation_clip", self.clip)
        for name in ("clip", "activation_clip"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not _is_number(value) or not value > 0:
                raise TapehookError(
                    f"{name} must be > 0: a positive number, or None for no mask; got {value!r}"
                )
            object.__setattr__(self, name, float(value))
        if (
            isinstance(self.pad_value, bool)
            or not _is_number(self.pad_value)
            or float(self.pad_value) not in PAD_VALUES
        ):
            raise TapehookError(
                f"pad_value must be 0.0 (zero padding) or 1.0 (one padding, larq's "
                f"pad_values=1.0), got {self.pad_value!r}"
            )
        object.__setattr__(self, "pad_value", float(self.pad_value))
        if isinstance(self.beta, bool) or not _is_number(self.beta) or not self.beta > 0:
            raise TapehookError(f"beta (swish_sign's) must be a number > 0, got {self.beta!r}")
        object.__setattr__(self, "beta", float(self.beta))
        if not isinstance(self.weights, bool):
            raise TapehookError(
                f"weights must be True (binary) or False (float "
                f"kernel, binary input), got {self.weights!r}"
            )
        if not self.weights and not self.activation_estimator:
            raise TapehookError(
                "weights=False keeps the kernel float, so the input must be binary: "
                "pass activations=True (or an estimator name), or weights=True"
            )
        if self.balance not in BALANCES:
            raise TapehookError(
                f"unknown balance={self.balance!r}; use None, 'mean' (W - mean(W) per "
                f"output channel) or 'std' (IR-Net: (W - mean(W)) / std(W))"
            )
        if not self.weights and self.balance is not None:
            raise TapehookError(
                f"balance={self.balance!r} balances binarized weights; with weights=False "
                f"the kernel stays float: use balance=None"
            )
        if not self.weights and self.scale is not None:
            raise TapehookError(
                f"scale={self.scale!r} scales binarized weights; with weights=False "
                f"the kernel stays float: use scale=None"
            )

    def unbalanced(self) -> "BinarySpec":
        """The spec the balanced kernel itself is binarized with."""
        return dataclasses.replace(self, balance=None)

    @property
    def activation_estimator(self) -> str | None:
        """Estimator for the conv input, or None when the input stays float."""
        if self.activations is True:
            return self.ste
        return self.activations or None

    def op_attrs(self, op="forward") -> dict:
        """The spec as attrs of one tapehook kernel op.

        op: "forward" (TapehookBinaryConv2D: the whole spec, so a graph
        gradient or a loaded SavedModel can rebuild it from the op),
        "backprop_input" (the input's mask: activation_clip) or
        "backprop_filter" (the weights' mask: clip).
        """
        attrs = {
            "scale": self.scale or "none",
            "weight_estimator": self.ste,
            "activation_estimator": self.activation_estimator or "none",
            **_clip_attrs("clip", self.activation_clip if op == "backprop_input" else self.clip),
        }
        if op == "forward":
            attrs.update(
                _clip_attrs("activation_clip", self.activation_clip),
                beta=self.beta,
                pad_value=self.pad_value,
            )
        return attrs

    def pack_attrs(self) -> dict:
        """Attrs of TapehookPackInput: the input's ste_sign mask."""
        return _clip_attrs("clip", self.activation_clip)

    def to_config(self) -> dict:
        """Every field, JSON-serializable (Keras configs, .thbits manifests)."""
        return {name: getattr(self, name) for name in FIELDS}

    @classmethod
    def from_op_attrs(cls, get_attr) -> "BinarySpec":
        """Inverse of ``op_attrs``, reading attrs through ``get_attr(name)``."""

        def text(name):
            value = get_attr(name)
            return value.decode() if isinstance(value, bytes) else value

        def optional(name, default):
            try:
                return get_attr(name)
            except (ValueError, KeyError):  # an op written before the attr existed
                return default

        ste = text("weight_estimator")
        act = text("activation_estimator")
        scale = text("scale")

        def clip(name):
            bits = optional(f"{name}_f64_bits", 0)
            value = float64_from_bits(bits) if bits else optional(name, -1.0)
            return None if value == float("inf") else value

        weights_clip, act_clip = clip("clip"), clip("activation_clip")
        return cls(
            activations=False if act == "none" else (True if act == ste else act),
            scale=None if scale == "none" else scale,
            ste=ste,
            clip=weights_clip,
            activation_clip=weights_clip if act_clip == -1.0 else act_clip,
            beta=optional("beta", 5.0),
            pad_value=optional("pad_value", 0.0),
        )
