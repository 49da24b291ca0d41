"""BinarySpec: what "binary" means for one marked filter (validated, immutable)."""

import dataclasses
import struct
from typing import Optional, Union

import numpy as np

from tapehook.errors import TapehookError

# Pseudo-derivatives of sign for the backward pass (math in docs/design.md).
ESTIMATORS = ("ste_sign", "approx_sign", "swish_sign")
SCALES = (None, "mean_abs")


def clip_threshold(clip: float, float64: bool) -> float:
    """The number ``|t| <= clip`` compares against, exact for t in its dtype.

    float64 inputs use clip itself. Every half / bfloat16 / float32 value is a
    float32 number, and for those |t| <= clip holds exactly when |t| <= the
    largest float32 not above clip (rounding to nearest could widen the mask:
    float32(0.1) = 0.10000000149).
    """
    if float64:
        return float(clip)
    narrow = np.float32(clip)
    if float(narrow) > clip:
        narrow = np.nextafter(narrow, np.float32(0))
    return float(narrow)


def float64_bits(value: float) -> int:
    """The IEEE-754 bit pattern of a double, as a signed 64-bit int attr."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def float64_from_bits(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


@dataclasses.dataclass(frozen=True)
class BinarySpec:
    """How a marked Conv2D filter (and optionally its input) is binarized.

    - ``ste``: estimator of the weights' gradient (one of ``ESTIMATORS``).
    - ``clip``: ``ste_sign`` passes gradients where ``|t| <= clip``.
    - ``scale``: None (alpha = 1) or ``"mean_abs"`` (alpha per output channel).
    - ``activations``: False (float input), True (input binarized with
      ``ste``), or an estimator name used for the input alone.
    """

    activations: Union[bool, str] = False
    scale: Optional[str] = None
    ste: str = "ste_sign"
    clip: float = 1.0

    def __post_init__(self):
        if self.ste not in ESTIMATORS:
            raise TapehookError(
                f"unknown estimator ste={self.ste!r}; use one of {ESTIMATORS}")
        if self.scale not in SCALES:
            raise TapehookError(
                f"unknown scale={self.scale!r}; use None or 'mean_abs'")
        if not isinstance(self.activations, bool) and self.activations not in ESTIMATORS:
            raise TapehookError(
                f"activations={self.activations!r} is not supported; use False "
                f"(float input), True (same estimator as the weights) or one "
                f"of {ESTIMATORS}")
        if isinstance(self.clip, bool) or not isinstance(self.clip, (int, float)):
            raise TapehookError(f"clip must be a positive number, got {self.clip!r}")
        if not self.clip > 0:
            raise TapehookError(f"clip must be > 0, got {self.clip!r}")
        object.__setattr__(self, "clip", float(self.clip))

    @property
    def activation_estimator(self) -> Optional[str]:
        """Estimator for the conv input, or None when the input stays float."""
        if self.activations is True:
            return self.ste
        return self.activations or None

    def op_attrs(self) -> dict:
        """The spec as attrs of the tapehook kernel ops."""
        return {
            "scale": self.scale or "none",
            "weight_estimator": self.ste,
            "activation_estimator": self.activation_estimator or "none",
            **self.clip_attrs(),
        }

    def clip_attrs(self) -> dict:
        """The clip as op attrs: float32 rounded toward zero, exact for half /
        bfloat16 / float32 inputs (clip_threshold)."""
        return {"clip": clip_threshold(self.clip, float64=False)}

    @classmethod
    def from_op_attrs(cls, get_attr) -> "BinarySpec":
        """Inverse of ``op_attrs``, reading attrs through ``get_attr(name)``."""
        def text(name):
            value = get_attr(name)
            return value.decode() if isinstance(value, bytes) else value

        ste = text("weight_estimator")
        act = text("activation_estimator")
        scale = text("scale")
        return cls(
            activations=False if act == "none" else (True if act == ste else act),
            scale=None if scale == "none" else scale,
            ste=ste,
            clip=get_attr("clip"),
        )
