"""tapehook: train binary-weight (and binary-activation) networks in TF 2.

Marks on variables say which kernels (Conv1D, Conv2D, DepthwiseConv2D, Dense)
are binary; TensorFlow's registered Conv2D gradient is replaced once, at
import, by one that reads those marks and dispatches to tapehook's binary
kernels. See docs/design.md.
"""

from tapehook import layers, optimizers
from tapehook.callbacks import FlipRatio
from tapehook.config import config
from tapehook.constraints import WeightClip
from tapehook.counts import dispatch_counts, reset_dispatch_counts
from tapehook.deploy import export_savedmodel, export_tflite
from tapehook.errors import TapehookError
from tapehook.export import export_bitpacked, load_bitpacked
from tapehook.kernels import kernel_info
from tapehook.kernels import library as _load_kernels
from tapehook.marks import binary_spec_of, mark_binary, unmark
from tapehook.models import binarize
from tapehook.override import override_gradient
from tapehook.patches import install as _install
from tapehook.scope import binary_scope
from tapehook.spec import BinarySpec
from tapehook.summary import ModelSummary, summary

__version__ = "0.2.0"

__all__ = [
    "BinarySpec",
    "FlipRatio",
    "TapehookError",
    "binarize",
    "binary_scope",
    "binary_spec_of",
    "config",
    "dispatch_counts",
    "export_bitpacked",
    "export_savedmodel",
    "export_tflite",
    "kernel_info",
    "load_bitpacked",
    "ModelSummary",
    "mark_binary",
    "override_gradient",
    "reset_dispatch_counts",
    "summary",
    "unmark",
    "WeightClip",
    "layers",
    "optimizers",
    "distill",
    "larq",
    "recipes",
    "zoo",
]

# Submodules with heavier imports (larq-zoo's models, larq's API) load on
# first use: `tapehook.zoo.QuickNet(...)` works after a plain `import tapehook`.
_LAZY = ("distill", "larq", "recipes", "zoo")


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"tapehook.{name}")
    raise AttributeError(f"module 'tapehook' has no attribute {name!r}")


_install()
# Load (building once if needed) at import, so SavedModels and .keras files
# holding tapehook ops load in any process that imported tapehook.
_load_kernels()
