"""larq.models on Keras 3: ModelProfile / LayerProfile and summary.

A profile counts, per layer, the parameters by bit width, their memory and the
multiply-accumulates (MACs) by precision, larq's definitions:

- a weight's bit width is its quantizer's ``precision`` (1 for a kernel tapehook
  marks binary), else 32;
- a MAC's precision is the larger of the layer's input precision (its
  ``input_quantizer``'s) and the weight's bit width; a conv or dense layer does
  (kernel size) x (output pixels) MACs per example;
- a BatchNormalization with moving statistics counts those, not beta / gamma,
  since at inference it folds into one scale and one offset per channel.
"""

import dataclasses
import math

import keras
import numpy as np

from tapehook import marks
from tapehook.larq import utils

__all__ = ["LayerProfile", "ModelProfile", "summary"]

# Layers whose kernels do (kernel size) x (output pixels) MACs; larq's set.
# tapehook.larq's quantized layers subclass these Keras layers.
_MAC_LAYERS = (
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.DepthwiseConv2D,
    keras.layers.SeparableConv1D,
    keras.layers.SeparableConv2D,
    keras.layers.Dense,
)

# Layers whose MACs are known (none for the pooling / reshaping ones).
_OP_COUNT_LAYERS = (
    keras.layers.Flatten,
    keras.layers.BatchNormalization,
    keras.layers.MaxPooling1D,
    keras.layers.MaxPooling2D,
    keras.layers.AveragePooling1D,
    keras.layers.AveragePooling2D,
    *_MAC_LAYERS,
)

# (weight dropped, statistic it folds with) in an inference BatchNormalization.
_FOLDED_BATCH_NORM = (("beta", "moving_mean"), ("gamma", "moving_variance"))


def _bitsize_as_str(bitsize: int) -> str:
    """The unit name of a memory column in bits (8: byte, 8 * 1024: kB)."""
    names = {8: "byte", 8 * 1024: "kB"}
    if bitsize not in names:
        raise NotImplementedError(f"No unit name for {bitsize} bits; use one of {sorted(names)}")
    return names[bitsize]


def _number_as_readable_str(num: float) -> str:
    """Three significant figures with k / M / B / T, scientific from 1e15."""
    num = float(f"{num:.3g}")  # round first: 999_500 is "1 M", not "1e+03 k"
    if num < 1000:
        return f"{num:f}".rstrip("0").rstrip(".")
    if num >= 1e15:
        return f"{num:.2E}"
    for unit in ("", " k", " M", " B", " T"):
        if num < 1000 or unit == " T":
            return f"{num:.3g}" + unit
        num /= 1000


def _table_entry(value, units: int = 1):
    """A count in ``units``; "?" where it is unknown (None)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "?"
    if isinstance(value, str) or value == 0 or units == 1:
        return value
    return value / units


def _normalize_shape(shape):
    return tuple(-1 if dim is None else dim for dim in shape)


def _runs_on(layer) -> str:
    """What computes a tapehook.larq layer: tapehook's kernels or plain TF ops."""
    from tapehook.larq.layers import _QuantMixin

    if not isinstance(layer, _QuantMixin):
        return ""
    if layer.binary_spec is not None:
        return "tapehook kernels"
    quantizers = [layer.input_quantizer, *layer._lq_quantizers().values()]
    return "plain TF ops" if any(q is not None for q in quantizers) else ""


class WeightProfile:
    """One weight: its element count and bit width."""

    def __init__(self, weight, trainable: bool = True):
        self._weight = weight
        precision = getattr(weight, "precision", None)
        if precision is None and marks.binary_spec_of(weight) is not None:
            precision = 1
        self.bitwidth = precision or 32
        self.trainable = trainable

    @property
    def count(self) -> int:
        return int(math.prod(self._weight.shape))

    @property
    def memory(self) -> int:
        return self.bitwidth * self.count

    @property
    def fp_equivalent_memory(self) -> int:
        return 32 * self.count

    @property
    def int8_fp_weights_memory(self) -> int:
        """The memory with every weight wider than 8 bits stored in 8."""
        return min(self.bitwidth, 8) * self.count

    def is_bias(self) -> bool:
        return "bias" in self._weight.name


@dataclasses.dataclass
class OperationProfile:
    n: int
    precision: int
    op_type: str


class LayerProfile:
    """Parameters, memory and MACs of one Keras layer."""

    def __init__(self, layer):
        self._layer = layer
        self.name = layer.name
        weights = list(layer.weights)
        if isinstance(layer, keras.layers.BatchNormalization):
            for dropped, statistic in _FOLDED_BATCH_NORM:
                names = [w.name.split("/")[-1] for w in weights]
                if dropped in names and statistic in names:
                    weights.pop(names.index(dropped))
        trainable = {id(w) for w in layer.trainable_weights}
        self.weight_profiles = [WeightProfile(w, trainable=id(w) in trainable) for w in weights]
        self.op_profiles = []
        if isinstance(layer, _MAC_LAYERS) and self.output_pixels:
            self.op_profiles = [
                OperationProfile(
                    n=p.count * self.output_pixels,
                    precision=max(self.input_precision or 32, p.bitwidth),
                    op_type="mac",
                )
                for p in self.weight_profiles
                if not p.is_bias()
            ]

    @property
    def _parts(self):
        """What the memory sums run over: weights here, layers in a model."""
        return self.weight_profiles

    @property
    def memory(self) -> int:
        return sum(p.memory for p in self._parts)

    @property
    def int8_fp_weights_memory(self) -> int:
        return sum(p.int8_fp_weights_memory for p in self._parts)

    @property
    def fp_equivalent_memory(self) -> int:
        return sum(p.fp_equivalent_memory for p in self._parts)

    def weight_count(self, bitwidth: int | None = None, trainable: bool | None = None) -> int:
        return sum(
            p.count
            for p in self.weight_profiles
            if (bitwidth is None or p.bitwidth == bitwidth)
            and (trainable is None or p.trainable == trainable)
        )

    def op_count(self, op_type: str | None = None, precision: int | None = None) -> int | None:
        """MACs (of ``precision`` bits, or all); None where the layer's are unknown."""
        if op_type != "mac":
            raise ValueError("Currently only counting of MAC-operations is supported.")
        if not isinstance(self._layer, _OP_COUNT_LAYERS) or not self.output_pixels:
            return None
        return sum(
            op.n
            for op in self.op_profiles
            if (precision is None or op.precision == precision) and op.op_type == op_type
        )

    @property
    def input_precision(self) -> int | None:
        quantizer = getattr(self._layer, "input_quantizer", None)
        return getattr(quantizer, "precision", None)

    @property
    def output_shape(self):
        """The output shape with -1 for unknown sizes; None for a layer never
        called on symbolic inputs (e.g. inside a subclassed model)."""
        try:
            output = self._layer.output
        except (AttributeError, ValueError):
            return None
        if isinstance(output, (list, tuple)):
            if len(output) == 1:
                return _normalize_shape(output[0].shape)
            return [_normalize_shape(o.shape) for o in output]
        return _normalize_shape(output.shape)

    @property
    def output_shape_str(self) -> str:
        return str(self.output_shape or "multiple")

    @property
    def output_pixels(self) -> int | None:
        """Pixels of one feature map (1 for a fully connected output)."""
        shape = self.output_shape
        if not shape:
            return None
        if isinstance(shape, list):
            raise NotImplementedError(f"{self.name} has several outputs: {shape}")
        if len(shape) == 4:
            return int(np.prod(shape[1:3]))
        if len(shape) == 3:
            return shape[1]
        if len(shape) == 2:
            return 1
        raise NotImplementedError(f"No pixel count for {self.name}'s output shape {shape}")

    @property
    def unique_param_bidtwidths(self) -> list[int]:  # larq's spelling
        return sorted({p.bitwidth for p in self.weight_profiles})

    @property
    def unique_op_precisions(self) -> list[int]:
        return sorted({op.precision for op in self.op_profiles})

    @property
    def runs_on(self) -> str:
        return _runs_on(self._layer)

    def generate_table_row(self, table_config) -> list:
        return [
            self.name,
            self.input_precision or "-",
            self.output_shape_str,
            *(
                _table_entry(self.weight_count(b), table_config["param_units"])
                for b in table_config["param_bidtwidths"]
            ),
            _table_entry(self.memory, table_config["memory_units"]),
            *(
                _table_entry(self.op_count("mac", p), table_config["mac_units"])
                for p in table_config["mac_precisions"]
            ),
        ]


class ModelProfile(LayerProfile):
    """The profiles of a model's layers (a nested model is one ModelProfile)."""

    def __init__(self, model):
        self.name = model.name
        self.layer_profiles = [
            ModelProfile(layer) if isinstance(layer, keras.Model) else LayerProfile(layer)
            for layer in model.layers
        ]

    @property
    def _parts(self):
        return self.layer_profiles

    def weight_count(self, bitwidth: int | None = None, trainable: bool | None = None) -> int:
        return sum(lp.weight_count(bitwidth, trainable) for lp in self.layer_profiles)

    def op_count(self, op_type: str | None = None, precision: int | None = None) -> int:
        return sum(lp.op_count(op_type, precision) or 0 for lp in self.layer_profiles)

    @property
    def unique_param_bidtwidths(self) -> list[int]:
        return sorted({b for lp in self.layer_profiles for b in lp.unique_param_bidtwidths})

    @property
    def unique_op_precisions(self) -> list[int]:
        return sorted({p for lp in self.layer_profiles for p in lp.unique_op_precisions})

    @property
    def input_precision(self) -> int | None:
        return self.layer_profiles[0].input_precision if self.layer_profiles else None

    @property
    def output_shape(self):
        return self.layer_profiles[-1].output_shape if self.layer_profiles else None

    @property
    def runs_on(self) -> str:
        return ", ".join(sorted({lp.runs_on for lp in self.layer_profiles} - {""}))

    def _table_config(self, include_macs):
        return {
            "param_bidtwidths": self.unique_param_bidtwidths,
            "mac_precisions": self.unique_op_precisions if include_macs else [],
            "param_units": 1,
            "memory_units": 8 * 1024,
            "mac_units": 1,
        }

    def _generate_table_header(self, table_config) -> list[str]:
        return [
            "Layer",
            "Input prec.\n(bit)",
            "Outputs",
            *(
                f"# {b}-bit\nx {table_config['param_units']}"
                for b in table_config["param_bidtwidths"]
            ),
            f"Memory\n({_bitsize_as_str(table_config['memory_units'])})",
            *(f"{p}-bit MACs" for p in table_config["mac_precisions"]),
        ]

    def _generate_table_total(self, table_config) -> list:
        return ["Total", "", "", *self.generate_table_row(table_config)[3:]]

    def generate_table(self, include_macs: bool = True) -> list[list]:
        """Header, one row per layer and the total (larq's stats table)."""
        config = self._table_config(include_macs)
        return [
            self._generate_table_header(config),
            *(lp.generate_table_row(config) for lp in self.layer_profiles),
            self._generate_table_total(config),
        ]

    def generate_summary(self, include_macs: bool = True) -> list[list]:
        """(label, value) rows of the model's totals (larq's summary table)."""
        rows = [
            ["Total params", _number_as_readable_str(self.weight_count())],
            ["Trainable params", _number_as_readable_str(self.weight_count(trainable=True))],
            ["Non-trainable params", _number_as_readable_str(self.weight_count(trainable=False))],
            ["Model size", utils.memory_as_readable_str(self.memory)],
            [
                "Model size (8-bit FP weights)",
                utils.memory_as_readable_str(self.int8_fp_weights_memory),
            ],
            ["Float-32 Equivalent", utils.memory_as_readable_str(self.fp_equivalent_memory)],
            ["Compression Ratio of Memory", self.memory / max(1e-8, self.fp_equivalent_memory)],
        ]
        if include_macs:
            macs = self.op_count("mac")
            rows.append(["Number of MACs", _number_as_readable_str(macs)])
            for precision, kind in ((1, "binarized"), (2, "ternarized")):
                ratio = self.op_count("mac", precision) / max(1, macs)
                if ratio > 0:
                    rows.append([f"Ratio of MACs that are {kind}", f"{ratio:.4f}"])
        return rows


def _render(title, rows, right_aligned, header_lines=0):
    """A boxed text table; cells may hold line breaks (a header's units)."""
    rows = [[f"{v:.2f}" if isinstance(v, float) else str(v) for v in row] for row in rows]
    split = [[cell.split("\n") for cell in row] for row in rows]
    widths = [max(len(line) for row in split for line in row[i]) for i in range(len(rows[0]))]

    def lines_of(row):
        height = max(len(cell) for cell in row)
        for k in range(height):
            cells = [(cell + [""] * height)[k] for cell in row]
            yield (
                "| "
                + "  ".join(
                    c.rjust(w) if i in right_aligned else c.ljust(w)
                    for i, (c, w) in enumerate(zip(cells, widths))
                )
                + " |"
            )

    inner = sum(widths) + 2 * (len(widths) - 1) + 2
    rule = "+" + "-" * inner + "+"
    out = ["+" + title + "-" * max(inner - len(title), 0) + "+"]
    for index, row in enumerate(split):
        out.extend(lines_of(row))
        if index + 1 == header_lines or (header_lines and index + 2 == len(split)):
            out.append(rule)
    out.append(rule)
    return "\n".join(out)


def summary(model, print_fn=None, include_macs=True):
    """Prints larq's two tables for ``model``: per layer the input precision,
    output shape, parameters per bit width, memory (kB = 8 * 1024 bits), MACs
    per precision and what runs it (tapehook's kernels or plain TF ops); then
    the model's totals, compression ratio and the share of binarized and
    ternarized MACs (``include_macs``)."""
    if not model.built:
        raise ValueError(
            "This model has not yet been built. Build the model first by "
            "calling `model.build()` or calling `model.fit()` with some data, "
            "or specify an `input_shape` argument in the first layer(s)."
        )
    profile = ModelProfile(model)
    stats = profile.generate_table(include_macs)
    runs = ["Runs on", *(lp.runs_on for lp in profile.layer_profiles), ""]
    stats = [row + [run] for row, run in zip(stats, runs)]
    right = set(range(1, len(stats[0]) - 1))
    (print_fn or print)(_render(f"{model.name} stats", stats, right, header_lines=1))
    totals = profile.generate_summary(include_macs)
    (print_fn or print)(_render(f"{model.name} summary", totals, set()))
