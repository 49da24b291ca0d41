"""The deploy graph: a built Keras model as plain TF ops with frozen weights.

Each binary layer's ``call`` is replaced, while the model is traced once, by
the inference math of docs/design.md written in stock ops that converters
know:

    x_hat = where(x >= 0, 1, -1)            binary activations only (x itself
                                            where it already is such a where)
    y     = conv(x_hat, S) [* alpha]        S = sign(W) as a ±1 constant
    y     = activation(y + bias)            as the layer does

alpha stays *outside* the ±1 conv: with binary inputs the conv then sums
exact integers (as tapehook's bitpacked kernel and LCE's bconv do), while
alpha folded into the filter makes float sums that should be exactly 0 come
out ±1e-6, and a following sign flips. Every other layer runs its own call,
in float32 where its policy computes in float16 or bfloat16. The traced
function is frozen (variables become constants): LCE 0.16 cannot read
variables written by TF 2.21, and TF's own converter can keep uninitialised
ones.

``filters="float"`` stores S as float constants: what LCE's converter
matches and packs to 1 bit itself. ``"bits"`` (the SavedModel, LiteRT)
stores S packed 8 per byte and unpacks it at run time (BitwiseXor with a
zero only the running model knows, then a Gather from a table of ±1 per
byte value): built from constants alone, TF's Grappler and the TFLite
converter fold a filter back to floats and then fold alpha's multiply into
it, which brings the ±1e-6 sums back.
"""

import dataclasses
import math

import numpy as np
import tensorflow as tf
from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

from tapehook import export, marks, models
from tapehook.errors import TapehookError
from tapehook.spec import BinarySpec


def _keras():
    import keras

    return keras


@dataclasses.dataclass
class BinaryLayer:
    """One binary layer as deployed: its spec, sign bits and alpha."""

    layer: object
    kind: str  # "conv2d", "conv1d", "depthwise", "dense"
    spec: BinarySpec
    kernel: np.ndarray  # the latent kernel (used as is with weights=False)
    signs: np.ndarray  # bool, True where sign(W) = +1, kernel shape
    alpha: np.ndarray  # float32 per output channel (ones without scale)

    @property
    def name(self):
        return self.layer.name

    @property
    def padding(self) -> str | None:
        return getattr(self.layer, "padding", None)

    @property
    def pad_value(self) -> float:
        return self.spec.pad_value

    @property
    def binary_weights(self) -> bool:
        return self.spec.weights

    @property
    def lce_bconv(self) -> bool:
        """Whether LCE's converter can make this layer an LceBconv2d."""
        return (
            self.kind == "conv2d" and self.binary_weights and bool(self.spec.activation_estimator)
        )

    @property
    def float32_bytes(self) -> int:
        return 4 * self.signs.size


def _call_owner(layer):
    """The class whose call() ``layer`` runs. A tapehook.larq layer whose
    quantizers became its kernel's mark runs its Keras base class's call (the
    mark's spec binarizes inside the op), so deploy rewrites it as that."""
    from tapehook.larq.layers import _QuantMixin

    cls = type(layer)
    if isinstance(layer, _QuantMixin) and layer.binary_spec is not None:
        return next(c for c in cls.__mro__ if c.__module__.startswith("keras."))
    return cls


def _layer_kind(layer):
    """The kind of a binarizable layer whose call the deploy graph can replace."""
    keras = _keras()
    from keras.src.layers.convolutional.base_conv import BaseConv

    owner = _call_owner(layer)
    if isinstance(layer, keras.layers.DepthwiseConv2D):
        return "depthwise" if owner.call is keras.layers.DepthwiseConv2D.call else None
    if isinstance(layer, (keras.layers.Conv1D, keras.layers.Conv2D)):
        if owner.call is not BaseConv.call or owner.convolution_op is not BaseConv.convolution_op:
            return None
        return "conv2d" if isinstance(layer, keras.layers.Conv2D) else "conv1d"
    if isinstance(layer, keras.layers.Dense):
        return "dense" if owner.call is keras.layers.Dense.call else None
    return None


def check_built(model):
    keras = _keras()
    if not isinstance(model, keras.Model):
        raise TapehookError(f"deploy exports a keras.Model, got {type(model).__name__}")
    if not model.built or not model.weights:
        raise TapehookError(
            f"cannot export {model.name}: it is not built; call it on a batch or "
            f"use model.build(input_shape) first"
        )


def binary_layers(model):
    """BinaryLayer for each marked kernel of ``model``; TapehookError for a
    marked variable the deploy graph cannot express."""
    found, owned = [], set()
    for layer, kernel, spec in export.binary_kernels(model):
        kind = _layer_kind(layer)
        what = f"binary layer {layer.name!r} ({type(layer).__name__})"
        if kind is None:
            raise TapehookError(
                f"{what} overrides call(); deploy can only rewrite the stock Keras "
                f"Conv1D / Conv2D / DepthwiseConv2D / Dense call; keep it float "
                f"(tapehook.binarize(..., exclude=[{layer.name!r}])) or use the stock layer"
            )
        if getattr(layer, "data_format", "channels_last") != "channels_last":
            raise TapehookError(
                f"{what} uses {layer.data_format}; deploy needs data_format='channels_last'"
            )
        if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
            raise TapehookError(
                f"{what} has LoRA or Keras quantization enabled; export a binary layer without them"
            )
        if kind != "dense" and str(layer.padding).lower() not in ("same", "valid"):
            raise TapehookError(
                f"{what} has padding={layer.padding!r}; deploy supports 'same' and 'valid'"
            )
        if getattr(layer, "groups", 1) != 1:
            raise TapehookError(f"{what} has groups={layer.groups}; use groups=1")
        value = np.asarray(kernel.numpy())
        if not np.all(np.isfinite(value.astype(np.float64))):
            raise TapehookError(f"{what}: its kernel holds inf or NaN; fix the weights")
        out_axes = export.output_axes(type(layer).__name__)
        value = export.binary_kernel_value(value, spec, out_axes)
        w = value.astype(np.float64)
        alpha = export._alpha(w, spec, out_axes)  # as the compiled kernels compute it
        found.append(BinaryLayer(layer, kind, spec, value, export.sign_bits(w), alpha))
        owned.update(id(c.handle) for c in marks.components(kernel))
    for var in model.weights:
        comps = marks.components(var) or ()
        if marks.binary_spec_of(var) is not None and not any(id(c.handle) in owned for c in comps):
            raise TapehookError(
                f"variable {var.path} is marked binary but is not the kernel of a "
                f"Conv1D / Conv2D / DepthwiseConv2D / Dense layer; deploy cannot "
                f"express it; unmark it or move it into such a layer"
            )
    return found


def sign(x):
    """where(x >= 0, 1, -1): both constants explicit, the form LCE's converter
    matches as its sign (0 and -0.0 give +1, as in tapehook)."""
    dt = x.dtype
    return tf.where(x >= tf.constant(0, dt), tf.constant(1, dt), tf.constant(-1, dt))


def arithmetic_sign(x):
    """sign(x) as 1 - 2 clip(ceil(-x), 0, 1) (0 and -0.0 give +1): ops
    XNNPACK runs (NEG, CEIL, MINIMUM / MAXIMUM, MUL, SUB), where LiteRT's
    GREATER_EQUAL + SELECT_V2 would leave the delegate at every binary layer."""
    dt = x.dtype
    step = tf.clip_by_value(tf.math.ceil(-x), tf.constant(0, dt), tf.constant(1, dt))
    return tf.constant(1, dt) - tf.constant(2, dt) * step


_PASS_THROUGH = ("Identity", "IdentityN", "Cast")


def is_sign(x):
    """Whether graph tensor ``x`` is a select between the constants 1 and -1
    (seen through identities and casts): a sign already taken, as by
    tapehook.recipes' RSign, EDESign and SwishSign. Signing it again would
    leave LCE's converter a quantize, dequantize, quantize chain in front of
    the bconv where one quantize does."""
    op = getattr(x, "op", None)
    while op is not None and op.type in _PASS_THROUGH:
        x = op.inputs[x.value_index if op.type == "IdentityN" else 0]
        op = x.op
    if op is None or op.type not in ("Select", "SelectV2"):
        return False
    branches = [_scalar_constant(t) for t in op.inputs[1:]]
    return None not in branches and sorted(branches) == [-1.0, 1.0]


def _scalar_constant(t):
    """A graph tensor's value as a float where it is a one-element constant
    (or the negation of one: reference.sign's -one), else None."""
    if t.op.type == "Neg":
        value = _scalar_constant(t.op.inputs[0])
        return None if value is None else -value
    value = tf.get_static_value(t)
    return float(np.ravel(value)[0]) if value is not None and np.size(value) == 1 else None


def runtime_zero(x, x_hat, binary_input):
    """A uint8 0 that only the running model knows. Converters constant-fold a
    filter built from constants alone and then fuse alpha's multiply into it
    (the ±1e-6 sums above); mixing this zero into the bits prevents both.
    Binary inputs: min |x_hat| - 1 (LCE's converter fixes the batch size at
    1, so a zero taken from the batch size would fold there); float inputs,
    where alpha's placement only changes float rounding: from the batch size.
    """
    if binary_input:
        zero = tf.cast(tf.reduce_min(tf.abs(x_hat)) - 1, tf.int32)
    else:
        zero = tf.minimum(tf.shape(x)[0], 1) - 1
    return tf.cast(zero, tf.uint8)


# sign bits of every byte value, first bit in the MSB, as ±1 (a lookup table
# the unpacking gathers from: one pass over the filter instead of shifts,
# masks and arithmetic; int8 keeps it at 2 KiB, shared by all layers).
_SIGNS_OF_BYTE = (
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(np.int8) * 2 - 1
)

# The order the bits are stored in: the layout TFLite's op wants (OHWI for
# CONV_2D, [out, in] for FULLY_CONNECTED), so the converter cancels the
# transpose back to TF's layout against its own instead of running one.
_STORED_ORDER = {"conv2d": (3, 0, 1, 2), "dense": (1, 0)}


def sign_filter(signs, dtype, filters, zero=None, table=None, kind=None):
    """sign(W) as a ±1 tensor of ``dtype`` in W's layout. "float": a constant;
    "bits": packed bytes whose unpacking depends on ``zero`` (runtime_zero),
    gathered from ``table`` (the graph's _SIGNS_OF_BYTE constant)."""
    if filters == "float":
        return tf.constant(np.where(signs, 1, -1).astype(dtype.as_numpy_dtype))
    order = _STORED_ORDER.get(kind)
    stored = signs if order is None else np.transpose(signs, order)
    packed = np.packbits(stored.reshape(-1))  # C order, first bit in the MSB
    index = tf.cast(tf.bitwise.bitwise_xor(tf.constant(packed), zero), tf.int32)
    flat = tf.reshape(tf.cast(tf.gather(table, index), dtype), [-1])
    if flat.shape[0] != signs.size:
        flat = flat[: signs.size]
    s = tf.reshape(flat, stored.shape)
    return s if order is None else tf.transpose(s, np.argsort(order))


def same_pads(size, kernel, stride, dilation):
    """(before, after) of TF's SAME padding along one axis."""
    effective = (kernel - 1) * dilation + 1
    out = -(-size // stride)
    total = max((out - 1) * stride + effective - size, 0)
    return total // 2, total - total // 2


def _pad(x, w_shape, strides, padding, dilations, pad_value):
    """(x, padding): SAME with a non-zero pad value becomes tf.pad with SAME's
    amounts, then VALID; LCE turns that into its pad_values=1 bconv."""
    if padding != "SAME" or pad_value == 0:
        return x, padding
    pads = [same_pads(x.shape[i + 1], w_shape[i], strides[i], dilations[i]) for i in range(2)]
    return tf.pad(x, [(0, 0), *pads, (0, 0)], constant_values=pad_value), "VALID"


def _conv2d(x, w, strides, padding, dilations, pad_value):
    x, padding = _pad(x, w.shape, strides, padding, dilations, pad_value)
    return tf.nn.conv2d(
        x, w, strides=[1, *strides, 1], padding=padding, dilations=[1, *dilations, 1]
    )


def _zero_padded(binary, x):
    """Whether a SAME conv pads x_hat with zeros somewhere."""
    if binary.padding != "same" or binary.pad_value != 0:
        return False
    layer = binary.layer
    return any(
        sum(
            same_pads(
                x.shape[i + 1], binary.signs.shape[i], layer.strides[i], layer.dilation_rate[i]
            )
        )
        for i in range(2)
    )


def _lce_zero_padded(binary, x_hat, s):
    """alpha * conv(x_hat, S) with zero padding, for LCE. LCE's bconv corrects
    zero padding in float: exact with multiplier 1 (integers), but with alpha
    folded in it leaves ±1e-7 where the sum is 0, flipping a sign that
    follows. So alpha is applied after the bconv as (0 - y) * -alpha, a form
    LCE's converter does not fold into the bconv (it folds y * alpha)."""
    layer = binary.layer
    y = tf.nn.conv2d(
        x_hat, s, [1, *layer.strides, 1], "SAME", dilations=[1, *layer.dilation_rate, 1]
    )
    if binary.spec.scale is None:
        return y
    dtype = x_hat.dtype.as_numpy_dtype
    return tf.subtract(tf.constant(0, x_hat.dtype), y) * tf.constant(-binary.alpha.astype(dtype))


def binary_call(binary, filters, shared):
    """A replacement ``call(inputs)`` computing ``binary``'s layer in plain ops.

    ``filters``: "bits" everywhere, "float": float ±1 constants everywhere
    (XNNPACK runs such convs at float speed; alpha is applied as
    (0 - y) * -alpha, which converters do not fold into the filter), or
    "lce": float ±1 constants for the layers LCE makes LceBconv2d (its
    converter packs those), bits elsewhere.
    ``shared``: a dict for constants all layers of one trace share.
    """
    layer, spec = binary.layer, binary.spec
    stored = "float" if filters == "float" or (filters == "lce" and binary.lce_bconv) else "bits"

    def call(inputs, *args, **kwargs):
        x = tf.convert_to_tensor(inputs)
        dtype = x.dtype
        x_hat = x
        if spec.activation_estimator and not is_sign(x):
            x_hat = arithmetic_sign(x) if filters == "float" else sign(x)
        # A zero-padded SAME conv2d of float filters applies alpha itself.
        scaled_in_conv = stored == "float" and binary.kind == "conv2d" and _zero_padded(binary, x)
        if binary.binary_weights:
            if stored == "float":
                s = sign_filter(binary.signs, dtype, stored)
            else:
                if "table" not in shared:  # one constant per traced graph
                    shared["table"] = tf.constant(_SIGNS_OF_BYTE)
                s = sign_filter(
                    binary.signs,
                    dtype,
                    stored,
                    runtime_zero(x, x_hat, bool(spec.activation_estimator)),
                    shared["table"],
                    binary.kind,
                )
        else:  # weights=False: the float kernel, no alpha
            s = tf.constant(binary.kernel.astype(dtype.as_numpy_dtype))
        if binary.kind == "dense":
            y = (
                tf.matmul(x_hat, s)
                if x.shape.rank == 2
                else tf.tensordot(x_hat, s, [[x.shape.rank - 1], [0]])
            )
        elif binary.kind == "depthwise":
            strides, dilations = list(layer.strides), list(layer.dilation_rate)
            x_hat, padding = _pad(
                x_hat, s.shape, strides, layer.padding.upper(), dilations, binary.pad_value
            )
            y = tf.nn.depthwise_conv2d(x_hat, s, [1, *strides, 1], padding, dilations=dilations)
        elif scaled_in_conv:
            y = _lce_zero_padded(binary, x_hat, s)
        elif binary.kind == "conv1d":
            y = _conv2d(
                x_hat[:, None],
                s[None],
                [1, *layer.strides],
                layer.padding.upper(),
                [1, *layer.dilation_rate],
                binary.pad_value,
            )[:, 0]
        else:
            y = _conv2d(
                x_hat,
                s,
                list(layer.strides),
                layer.padding.upper(),
                list(layer.dilation_rate),
                binary.pad_value,
            )
        if spec.scale is not None and binary.binary_weights and not scaled_in_conv:
            alpha = binary.alpha.astype(dtype.as_numpy_dtype)
            if filters == "float":  # kept out of the constant filter (see above)
                y = tf.subtract(tf.constant(0, dtype), y) * tf.constant(-alpha)
            else:
                y = y * tf.constant(alpha)
        bias = getattr(layer, "bias", None)
        if bias is not None:
            y = y + tf.cast(bias, dtype)
        if layer.activation is not None:
            y = layer.activation(y)
        return y

    return call


def _input_specs(model):
    inputs = getattr(model, "inputs", None)
    try:
        tensors = list(inputs) if inputs else []
    except (AttributeError, ValueError):
        tensors = []
    if tensors:
        return [tf.TensorSpec([None, *t.shape[1:]], tf.as_dtype(t.dtype)) for t in tensors]
    shapes = getattr(model, "_build_shapes_dict", None) or {}
    if len(shapes) == 1:
        shape = tuple(next(iter(shapes.values())))
        return [tf.TensorSpec([None, *shape[1:]], tf.float32)]
    raise TapehookError(
        f"cannot tell the input shape of {model.name}: call model.build(input_shape) "
        f"(Keras records it there), or export a functional wrapper: "
        f"inputs = keras.Input(shape); keras.Model(inputs, model(inputs))"
    )


def _float32_policies(model):
    """{layer: its policy} for the layers of ``model`` that compute in float16
    or bfloat16 on float32 variables (mixed_float16, mixed_bfloat16). The
    deploy graph traces them in float32: LiteRT's builtin ops and LCE's bconv
    take float32, and the weights are float32 already."""
    found = {}
    for layer in model._flatten_layers(include_self=True):
        policy = layer.dtype_policy
        if (
            policy.quantization_mode is None
            and policy.variable_dtype == "float32"
            and policy.compute_dtype in ("float16", "bfloat16")
        ):
            found[layer] = layer._dtype_policy
    return found


def frozen_function(model, filters):
    """(frozen ConcreteFunction of the inference graph, [BinaryLayer])."""
    check_built(model)
    binaries = binary_layers(model)
    specs = _input_specs(model)
    replaced, shared, policies = [], {}, _float32_policies(model)
    try:
        for layer in policies:
            layer._dtype_policy = _keras().DTypePolicy("float32")
        for b in binaries:
            models._set(b.layer, "call", binary_call(b, filters, shared))
            replaced.append(b.layer)

        @tf.function(input_signature=specs, autograph=False)
        def serve(*args):
            return model(args[0] if len(args) == 1 else list(args), training=False)

        concrete = serve.get_concrete_function()
    finally:
        for layer in replaced:
            del layer.__dict__["call"]
        for layer, policy in policies.items():
            layer._dtype_policy = policy
    frozen = convert_variables_to_constants_v2(concrete)
    _check_plain(frozen.graph.as_graph_def(), model)
    return frozen, binaries


def _check_plain(graph_def, model):
    """Refuses a graph that still holds tapehook ops or variables."""
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    left = sorted(
        {
            n.op
            for n in nodes
            if n.op.startswith("Tapehook")
            or n.op in ("ReadVariableOp", "VarHandleOp", "ResourceGather")
        }
    )
    if left:
        raise TapehookError(
            f"the inference graph of {model.name} still holds {left}: a layer "
            f"outside Conv1D / Conv2D / DepthwiseConv2D / Dense uses a binary "
            f"kernel or a variable directly; deploy cannot freeze it"
        )


def kernel_bytes(binary, target, filters="bits"):
    """Bytes a binary layer's kernel takes in the file: LCE's bconv packs 32
    input channels per int32 word per tap; float filters take 4 bytes per
    sign; bits 8 signs per byte; plus alpha (float32 per channel) where a
    scale is set."""
    if not binary.binary_weights:
        return binary.kernel.size * binary.kernel.itemsize
    alpha = 4 * binary.alpha.size if binary.spec.scale else 0
    if filters == "float":
        return 4 * binary.signs.size + alpha
    if target == "lce" and binary.lce_bconv:
        kh, kw, cin, cout = binary.signs.shape
        return 4 * cout * kh * kw * -(-cin // 32) + alpha
    return -(-binary.signs.size // 8) + alpha


def layer_rows(model, binaries, target, filters="bits"):
    """One dict per layer with weights: binary or float, spec, float32 bytes
    and, for binary layers, the kernel's bytes in this target."""
    by_id = {id(b.layer): b for b in binaries}
    rows = []
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, _keras().Model) or not layer.weights:
            continue
        b = by_id.get(id(layer))
        row = {
            "name": layer.name,
            "type": type(layer).__name__,
            "binary": b is not None,
            "spec": models.spec_to_config(b.spec) if b else None,
            "padding": b.padding if b else getattr(layer, "padding", None),
            "float32_bytes": sum(4 * math.prod(w.shape) for w in layer.weights),
        }
        if b is not None:
            row["kernel_float32_bytes"] = b.float32_bytes
            row["kernel_bytes"] = kernel_bytes(b, target, filters)
            row["op"] = "LceBconv2d" if target == "lce" and b.lce_bconv else "float ops"
        rows.append(row)
    return rows
