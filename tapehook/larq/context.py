"""larq.context on tapehook: quantized_scope and the training-metrics scope."""

import contextlib
import threading

__all__ = ["metrics_scope", "quantized_scope", "get_training_metrics", "should_quantize"]

_state = threading.local()
_AVAILABLE_METRICS = {"flip_ratio"}
_training_metrics: set = set()


@contextlib.contextmanager
def quantized_scope(quantize):
    """Inside, a quantized layer's kernels read as their quantized values.

    ``layer.kernel`` and ``layer.get_weights()`` of tapehook.larq layers give
    the quantized kernel (e.g. +-1) inside ``quantized_scope(True)`` and the
    latent float kernel outside, as larq's QuantizedVariable does. Per thread.
    """
    backup = should_quantize()
    _state.should_quantize = bool(quantize)
    try:
        yield quantize
    finally:
        _state.should_quantize = backup


def should_quantize():
    """Whether the current thread is inside ``quantized_scope(True)``."""
    return getattr(_state, "should_quantize", False)


@contextlib.contextmanager
def metrics_scope(metrics=()):
    """Training metrics (only ``"flip_ratio"``) for quantizers created inside."""
    for metric in metrics:
        if metric not in _AVAILABLE_METRICS:
            raise ValueError(
                f"Unknown training metric '{metric}'. Available metrics: {_AVAILABLE_METRICS}."
            )
    backup = set(_training_metrics)
    _training_metrics.update(metrics)
    try:
        yield _training_metrics
    finally:
        _training_metrics.clear()
        _training_metrics.update(backup)


def get_training_metrics():
    """The live set of training metrics of the current scope."""
    return _training_metrics
