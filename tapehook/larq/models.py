"""larq.models on Keras 3: summary, a per-layer table of precision and memory."""

import math

from tapehook import marks
from tapehook.larq import utils

__all__ = ["summary"]


def _leaves(model):
    """Layers with rows: tapehook.larq layers count as one (their quantizers are
    sublayers), containers are opened."""
    from tapehook.larq.layers import _QuantMixin

    for layer in model._flatten_layers(include_self=False, recursive=False):
        if isinstance(layer, _QuantMixin) or not layer._flatten_layers(include_self=False):
            yield layer
        else:
            yield from _leaves(layer)


def _row(layer):
    from tapehook.larq.layers import _QuantMixin

    quantized = {}
    if isinstance(layer, _QuantMixin) and layer.built:
        for kernel, quantizer in layer._lq_quantizers().items():
            precision = getattr(quantizer, "precision", None)
            if precision is not None:
                quantized[id(layer._lq_latent(kernel))] = precision
    bits = {}
    for weight in layer.weights:
        precision = quantized.get(id(weight))
        if precision is None and marks.binary_spec_of(weight) is not None:
            precision = 1
        bits[precision or 32] = bits.get(precision or 32, 0) + math.prod(weight.shape)
    input_quantizer = getattr(layer, "input_quantizer", None)
    spec = getattr(layer, "binary_spec", None)
    runs = (
        "tapehook kernels"
        if spec is not None
        else "plain TF ops"
        if isinstance(layer, _QuantMixin) and (quantized or input_quantizer is not None)
        else ""
    )
    return dict(
        name=layer.name,
        type=type(layer).__name__,
        input_precision=getattr(input_quantizer, "precision", None) or "-",
        bits=bits,
        memory_bits=sum(b * n for b, n in bits.items()),
        runs=runs,
    )


def summary(model, print_fn=None, include_macs=True):
    """Prints a table per layer (input precision, parameters per bit width,
    memory, and whether tapehook's kernels or plain TF ops run it) and returns
    the rows. For tapehook's MAC counts and 1-bit memory of marked kernels see
    ``tapehook.summary``."""
    if not model.built:
        raise ValueError(
            "This model has not yet been built. Build the model first by "
            "calling `model.build()` or calling `model.fit()` with some data, "
            "or specify an `input_shape` argument in the first layer(s)."
        )
    rows = [_row(layer) for layer in _leaves(model)]
    widths = sorted({b for r in rows for b in r["bits"]})
    header = ["Layer", "Input prec. (bit)"] + [f"# {b}-bit" for b in widths] + ["Memory", "Runs on"]
    lines = [header] + [
        [r["name"], str(r["input_precision"])]
        + [str(r["bits"].get(b, 0)) for b in widths]
        + [utils.memory_as_readable_str(r["memory_bits"]), r["runs"]]
        for r in rows
    ]
    total_bits = sum(r["memory_bits"] for r in rows)
    total_params = {b: sum(r["bits"].get(b, 0) for r in rows) for b in widths}
    lines.append(
        ["Total", ""]
        + [str(total_params[b]) for b in widths]
        + [utils.memory_as_readable_str(total_bits), ""]
    )
    size = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, size)) for line in lines]
    rule = "  ".join("-" * w for w in size)
    text.insert(1, rule)
    text.insert(len(text) - 1, rule)
    float_bits = 32 * sum(total_params.values())
    text.append(
        f"{model.name}: {sum(total_params.values()):,} parameters, "
        f"{utils.memory_as_readable_str(total_bits)} quantized "
        f"({utils.memory_as_readable_str(float_bits)} at 32 bits)"
    )
    (print_fn or print)("\n".join(text))
    return rows
