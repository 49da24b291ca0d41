"""Dispatch counters: how many binary forwards / backprops ran on each path.

``compiled`` counts kernel executions (exact in every mode, counted in C++).
``reference`` counts builds of binary work done with plain TF ops (the
fallback, XLA, the dispatcher's choice of stock convolutions, binary Dense and
DepthwiseConv2D): each run in eager, each trace inside tf.function or a graph.
"""

import threading

from tapehook import kernels

KINDS = ("forward", "backprop_input", "backprop_filter")

_lock = threading.Lock()
_reference = dict.fromkeys(KINDS, 0)


def count_reference(**increments) -> None:
    """Adds to the reference-path counters (``forward=1``, ...)."""
    with _lock:
        for kind, n in increments.items():
            _reference[kind] += n


def dispatch_counts() -> dict:
    """{"compiled": {kind: n}, "reference": {kind: n}} since the last reset."""
    with _lock:
        reference = dict(_reference)
    return {"compiled": kernels.compiled_counts(), "reference": reference}


def reset_dispatch_counts() -> None:
    with _lock:
        for kind in _reference:
            _reference[kind] = 0
    kernels.reset_compiled_counts()
