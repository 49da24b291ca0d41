"""larq 0.14's public API on Keras 3 and tapehook: ``import tapehook.larq as lq``.

Layers whose quantizers map onto a ``tapehook.BinarySpec`` are marked and
run on tapehook's kernels; everything else runs larq's math in plain TF ops.
What maps, what does not and what is missing: docs/larq.md.
"""

import tapehook  # noqa: F401  (installs the marks' gradient)
from tapehook.larq import (
    activations,
    callbacks,
    constraints,
    context,
    layers,
    math,
    metrics,
    models,
    optimizers,
    quantizers,
    utils,
)

__version__ = "0.14.0"  # the larq API this package follows

__all__ = [
    "layers",
    "activations",
    "callbacks",
    "constraints",
    "context",
    "math",
    "metrics",
    "models",
    "quantizers",
    "optimizers",
    "utils",
]
