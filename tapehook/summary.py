"""tapehook.summary(model): a per-layer table of what is binary and what it costs.

Costs are counted as the BNN literature counts them (Bi-Real-Net, ReActNet,
larq-zoo): per sample, one MAC per multiply-accumulate of a conv or dense
layer; a MAC is *binary* (a BOP) only where both its operands are 1 bit (a
binary kernel on a binarized input), every other MAC is a float one (a
FLOP); OPs = FLOPs + BOPs / 64, the rate of a 64-bit XNOR-popcount against
one float multiply-add.
"""

import dataclasses
import math

from tapehook import marks, models
from tapehook.config import config


@dataclasses.dataclass
class ModelSummary:
    """``rows``: one dict per layer; ``totals``: sums; ``settings``: the
    tapehook.config settings in force when it was made. ``str()`` is the
    table, then the settings on one line."""

    rows: list
    totals: dict
    settings: dict = dataclasses.field(default_factory=dict)

    def __str__(self):
        header = (
            "layer",
            "type",
            "binary",
            "spec",
            "params",
            "mem 32-bit",
            "mem binarized",
            "binary MACs",
            "float MACs",
            "OPs",
        )
        lines = [header] + [
            (
                r["name"],
                r["type"],
                "yes" if r["binary"] else "no",
                r["spec"],
                f"{r['params']:,}",
                _bytes(r["float32_bytes"]),
                _bytes(r["binarized_bytes"]),
                _count(r["binary_macs"]),
                _count(r["float_macs"]),
                _count(r["ops"]),
            )
            for r in self.rows
        ]
        t = self.totals
        lines.append(
            (
                "total",
                "",
                f"{t['binary_layers']} layers",
                "",
                f"{t['params']:,}",
                _bytes(t["float32_bytes"]),
                _bytes(t["binarized_bytes"]),
                _count(t["binary_macs"]),
                _count(t["float_macs"]),
                _count(t["ops"]),
            )
        )
        widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
        text = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)) for line in lines]
        text.insert(1, "  ".join("-" * w for w in widths))
        text.insert(len(text) - 1, text[1])
        ratio = t["float32_bytes"] / max(t["binarized_bytes"], 1)
        text.append(
            f"binary params: {t['binary_params']:,} of {t['params']:,}; "
            f"model memory {_bytes(t['float32_bytes'])} at 32 bits, "
            f"{_bytes(t['binarized_bytes'])} with 1-bit binary kernels "
            f"({ratio:.1f}x smaller); MACs and OPs (float MACs + binary MACs / 64) "
            "per sample."
        )
        if self.settings:
            text.append(
                "settings (tapehook.config): "
                + ", ".join(f"{name}={value!r}" for name, value in self.settings.items())
            )
        return "\n".join(text)


def _bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def _count(n):
    return f"{n / 1e6:.2f}M" if n else "0"


def _spec_text(spec):
    if spec is None:
        return ""
    parts = [spec.ste if spec.weights else "float-weights"]
    if spec.activation_estimator:
        parts.append(f"act={spec.activation_estimator}")
    if spec.scale:
        parts.append(spec.scale)
    if spec.weights and spec.ste == "ste_sign" and spec.clip != 1.0:
        parts.append("clip=none" if spec.clip is None else f"clip={spec.clip:g}")
    if spec.activation_estimator == "ste_sign" and spec.activation_clip != spec.clip:
        parts.append(
            "act_clip=none"
            if spec.activation_clip is None
            else f"act_clip={spec.activation_clip:g}"
        )
    if "swish_sign" in (spec.ste, spec.activation_estimator) and spec.beta != 5.0:
        parts.append(f"beta={spec.beta:g}")
    if spec.pad_value:
        parts.append("pad=1")
    return " ".join(parts)


def _macs(layer):
    """Multiply-accumulates per sample of a conv or dense layer, else 0."""
    kernel = getattr(layer, "kernel", None)
    if kernel is None or not getattr(layer, "built", False):
        return 0
    shape = models.output_shape_of(layer)
    if shape is None:
        return 0
    pixels = math.prod(d for d in shape[1:-1] if d is not None)
    return pixels * math.prod(kernel.shape)


def _bits(quantizer):
    """Bits of a tapehook.larq quantizer's output (32: none or unknown)."""
    precision = getattr(quantizer, "precision", None)
    return precision if quantizer is not None and precision else 32


def _operand_bits(layer, spec):
    """(input bits, kernel bits) of a conv / dense layer's products."""
    if spec is not None:
        return (1 if spec.activation_estimator else 32), (1 if spec.weights else 32)
    kernel_quantizer = getattr(layer, "kernel_quantizer", None) or getattr(
        layer, "depthwise_quantizer", None
    )
    return _bits(getattr(layer, "input_quantizer", None)), _bits(kernel_quantizer)


def _leaf_layers(container):
    """The layers that get a row: those with a kernel (a tapehook.larq layer's
    quantizers are part of its row) and those holding no layers; containers
    (sub-models, blocks) give their layers' rows instead."""
    for layer in container._flatten_layers(include_self=False, recursive=False):
        if getattr(layer, "kernel", None) is not None or not layer._flatten_layers(
            include_self=False
        ):
            yield layer
        else:
            yield from _leaf_layers(layer)


def summary(model, print_fn=print) -> ModelSummary:
    """Per-layer table: binary or float, spec, parameters, memory at 32 bits and
    with binary kernels stored at 1 bit (plus alpha), binary MACs (1-bit
    kernel on a 1-bit input), float MACs and OPs (module docstring).
    Printed with ``print_fn`` (None to skip) and returned as data."""
    rows = []
    for layer in _leaf_layers(model):
        params = sum(math.prod(w.shape) for w in layer.weights)
        kernel = getattr(layer, "kernel", None)
        spec = marks.binary_spec_of(kernel) if kernel is not None else None
        input_bits, kernel_bits = _operand_bits(layer, spec)
        binary_params = math.prod(kernel.shape) if kernel_bits == 1 else 0
        alpha_bytes = 4 * kernel.shape[-1] if spec and spec.scale else 0
        macs = _macs(layer)
        both_binary = (input_bits, kernel_bits) == (1, 1)
        rows.append(
            dict(
                name=layer.name,
                type=type(layer).__name__,
                binary=spec is not None,
                spec=_spec_text(spec),
                params=params,
                binary_params=binary_params,
                float32_bytes=4 * params,
                binarized_bytes=4 * (params - binary_params)
                + math.ceil(binary_params / 8)
                + alpha_bytes,
                binary_macs=macs if both_binary else 0,
                float_macs=0 if both_binary else macs,
                ops=(macs / 64 if both_binary else macs),
            )
        )
    keys = (
        "params",
        "binary_params",
        "float32_bytes",
        "binarized_bytes",
        "binary_macs",
        "float_macs",
        "ops",
    )
    totals = {k: sum(r[k] for r in rows) for k in keys}
    totals["binary_layers"] = sum(r["binary"] for r in rows)
    result = ModelSummary(rows, totals, config.current())
    if print_fn is not None:
        print_fn(str(result))
    return result
