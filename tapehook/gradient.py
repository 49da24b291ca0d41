"""Binary Conv2D backward: the registered "Conv2D" gradient, dispatching on marks.

``conv2d_grad`` replaces TF's registered Conv2D gradient (patches.py). It reads
the binary spec fixed at forward time on the filter tensor a tape recorded
(conv2d.py sets it); a Conv2D without one gets TF's own gradient, bit for
bit. ``binary_conv2d_op_grad`` is the gradient of tapehook's
TapehookBinaryConv2D graph op (tf.gradients, a tf.function under an outer
tape, a loaded SavedModel): the spec is in the op's attrs.

Both take one backward: each backprop (dX, dW) runs where the dispatcher
says, a kernel plan or stock convolutions on the binarized operands, from x
or from the packed input bits the forward kept instead of x.
"""

import dataclasses

import tensorflow as tf

from tapehook import counts, dispatch, kernels, reference, registry
from tapehook.errors import TapehookError
from tapehook.packing import NO_MASK, PackedInput, scale_by_derivative
from tapehook.spec import BinarySpec

FORWARD_SPEC_ATTR = "_tapehook_forward_spec"  # on the filter tensor a tape records
BACKPROPS = ("backprop_input", "backprop_filter")  # one per Conv2D input (x, W)

# kernel op per backprop: (from x, from packed input bits)
_KERNEL_OPS = {
    "backprop_input": (
        "tapehook_binary_conv2d_backprop_input",
        "tapehook_binary_conv2d_backprop_input_packed",
    ),
    "backprop_filter": (
        "tapehook_binary_conv2d_backprop_filter",
        "tapehook_binary_conv2d_backprop_filter_packed",
    ),
}


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


def conv_attrs(get_attr) -> dict:
    """The Conv2D attrs the binary kernels share, read with ``get_attr(name)``."""
    return {
        "strides": list(get_attr("strides")),
        "padding": _text(get_attr("padding")),
        "explicit_paddings": list(get_attr("explicit_paddings")),
        "data_format": _text(get_attr("data_format")),
        "dilations": list(get_attr("dilations")),
    }


@dataclasses.dataclass
class PackedConvOp:
    """The Conv2D a tape recorded with packed input bits instead of x."""

    packed: PackedInput
    filter: tf.Tensor
    attrs: dict
    skip_input_indices: tuple
    type = "Conv2D"

    @property
    def inputs(self):
        return (self.packed, self.filter)

    def get_attr(self, name):
        return self.attrs[name]


def _library():
    library = kernels.loaded_library()
    if library is None:
        raise TapehookError(
            "a binary Conv2D recorded on the compiled kernels needs them for its "
            "gradient, but they are not loaded; see tapehook.kernel_info()"
        )
    return library


def _kernel_backprop(op, plan, x, w, dy, spec, attrs):
    """One backprop on the kernels, from x or from the packed input bits."""
    from_x, from_bits = _KERNEL_OPS[op]
    common = {**attrs, **spec.op_attrs(op), "plan": plan}
    if not isinstance(x, PackedInput):
        return getattr(_library(), from_x)(x, w, dy, **common)
    if x.derivative is None:
        return getattr(_library(), from_bits)(x.packed, w, dy, **common, channels=x.channels)
    # A continuous estimator's bits (packing.py): sign bits under all-ones
    # masks, which the packed ops read as ste_sign without a clip; dX_hat is
    # then scaled by the kept 16-bit e'(x).
    common["activation_estimator"] = "ste_sign"
    if op == "backprop_input":
        common.update(NO_MASK)
    grad = getattr(_library(), from_bits)(x.packed, w, dy, **common, channels=x.channels)
    if op == "backprop_input":
        grad = scale_by_derivative(grad, x)
    return grad


def _stock_backprops(ops, x, w, dy, spec, attrs):
    """{op: gradient} for the backprops ``ops`` on stock convolutions of the
    binarized operands; packed bits are unpacked to x_hat and e'(x) first."""
    counts.count_reference(**{op: 1 for op in ops})
    input_mask = None
    if isinstance(x, PackedInput):
        x, input_mask = x.unpack()
    dx, dw = reference.binary_conv2d_backward(
        x,
        w,
        dy,
        spec,
        attrs["strides"],
        attrs["padding"],
        attrs["explicit_paddings"],
        attrs["dilations"],
        need_dx="backprop_input" in ops,
        need_dw="backprop_filter" in ops,
        input_mask=input_mask,
    )
    return {op: grad for op, grad in zip(BACKPROPS, (dx, dw)) if op in ops}


def forward_input(x, after):
    """The float input ``x`` of a binary conv as its backward (or a rebuild of
    its output) reads it. Where ``x`` is a Pad / PadV2 output in the graph
    being built (one-padding makes one: conv2d.py), that pad run again on the
    unpadded tensor once the tensors ``after`` exist: the step then keeps the
    unpadded input (for a residual block the stream itself, which it may keep
    anyway) instead of a padded copy of it, and the kernels read the same
    values bit for bit. ``x`` itself elsewhere (eager, packed bits, other
    producers)."""
    if tf.executing_eagerly() or not hasattr(x, "op"):
        return x
    op = x.op
    if op.type not in ("Pad", "PadV2") or op.graph is not tf.compat.v1.get_default_graph():
        return x
    # The control dependency keeps the executor from running the pad in the
    # forward, which would keep its output as long as before.
    with tf.control_dependencies(after):
        if op.type == "Pad":
            return tf.raw_ops.Pad(input=op.inputs[0], paddings=op.inputs[1])
        return tf.raw_ops.PadV2(
            input=op.inputs[0], paddings=op.inputs[1], constant_values=op.inputs[2]
        )


def binary_backward(x, w, dy, spec, attrs, skip=()):
    """(dX, dW), None where skipped. ``x`` may be the PackedInput kept instead
    of the input. Each backprop takes its own path (the dispatcher may split
    them)."""
    # The backprop ops' backprop_dy attr: tapehook.config's, as the backward
    # is built (a bad TAPEHOOK_BACKPROP_DY fails here).
    kernel_attrs = {**attrs, "backprop_dy": kernels.backprop_dy()}
    packed = isinstance(x, PackedInput)
    paths = {
        op: dispatch.backprop_path(
            attrs,
            dy.dtype.name,
            x.shape,
            w.shape,
            filter_grad=op == "backprop_filter",
            packed=packed,
            spec=spec,
        )
        for i, op in enumerate(BACKPROPS)
        if i not in skip
    }
    stock = [op for op, path in paths.items() if path == dispatch.STOCK]
    grads = _stock_backprops(stock, x, w, dy, spec, attrs) if stock else {}
    for op, path in paths.items():
        if dispatch.runs_kernels(path):
            grads[op] = _kernel_backprop(op, path, x, w, dy, spec, kernel_attrs)
    return tuple(grads.get(op) for op in BACKPROPS)


def conv2d_grad(op, grad):
    """The registered "Conv2D" gradient while tapehook is installed."""
    spec = getattr(op.inputs[1], FORWARD_SPEC_ATTR, None)
    if spec is None:
        return registry.original_gradient("Conv2D")(op, grad)
    skip = tuple(getattr(op, "skip_input_indices", None) or ())
    x = forward_input(op.inputs[0], [grad])
    return binary_backward(x, op.inputs[1], grad, spec, conv_attrs(op.get_attr), skip)


def _shifted_input(op, x):
    """What the backward of a forward op binarized: its input x, or
    x - threshold where the op has a threshold (RSign folded in)."""
    threshold = kernels.op_threshold(op)
    return x - threshold[0] if threshold else x


def _backward_filter(op):
    """(the filter the op binarized, chain): W itself, or where the op
    balanced it (an inference forward's balance attr) the balanced kernel
    rebuilt by TF ops, and chain(dW) the gradient of the op's filter input
    through that balancing (IR-Net's, as a tape gets it)."""
    w = op.inputs[1]
    balance = _text(op.get_attr("balance")) if "balance" in op.node_def.attr else "none"
    if balance == "none":
        return w, lambda dw: dw
    balanced = reference.balanced_kernel(w, balance)

    def chain(dw):
        return None if dw is None else tf.gradients(balanced, w, grad_ys=dw)[0]

    return balanced, chain


def _threshold_grad(op, dx):
    """(The threshold's gradient,) or (): d(x - beta)/dbeta = -1, summed
    over every axis but the channels."""
    if not kernels.op_threshold(op):
        return ()
    return (None if dx is None else -tf.reduce_sum(dx, [0, 1, 2]),)


def binary_conv2d_affine_op_grad(op, grad):
    """Gradient of a TapehookBinaryConv2DAffine op (an inference batch norm
    folded into a binary conv, built where no tape recorded: what
    tf.gradients on such a graph asks for). The conv's output is recomputed
    for the ReLU mask and the multiplier's gradient."""
    dx, dw, dmultiplier, doffset = _affine_grads(op, grad)
    return (dx, dw, dmultiplier, doffset, *_threshold_grad(op, dx))


def _affine_grads(op, grad):
    x, w, multiplier = op.inputs[:3]
    binarized, chain = _backward_filter(op)
    spec, attrs = BinarySpec.from_op_attrs(op.get_attr), conv_attrs(op.get_attr)
    conv = kernels.library().tapehook_binary_conv2d(
        x, w, threshold=kernels.op_threshold(op), **kernels.binary_op_attrs(op)
    )
    pre = tf.nn.relu(conv) if op.get_attr("relu") else conv
    d_pre = grad * multiplier
    if op.get_attr("relu"):
        d_pre = tf.where(conv > 0, d_pre, tf.zeros_like(d_pre))
    dx, dw = binary_backward(_shifted_input(op, x), binarized, d_pre, spec, attrs)
    axes = [0, 1, 2]
    return dx, chain(dw), tf.reduce_sum(grad * pre, axes), tf.reduce_sum(grad, axes)


def binary_conv2d_affine_add_op_grad(op, grad):
    """Gradient of a TapehookBinaryConv2DAffineAdd op (the affine op's
    output plus an addend: a residual add folded in too): the affine op's
    gradients, and the addend's, ``grad`` itself."""
    dx, dw, dmultiplier, doffset = _affine_grads(op, grad)
    return (dx, dw, dmultiplier, doffset, grad, *_threshold_grad(op, dx))


def binary_conv2d_op_grad(op, grad):
    """Gradient of a TapehookBinaryConv2D graph op: the spec is in its attrs,
    the input's bits (binary activations) on the op when it was built here
    (of x - threshold where it has one)."""
    skip = tuple(getattr(op, "skip_input_indices", None) or ())
    x = getattr(op, "_tapehook_packed_input", None) or _shifted_input(
        op, forward_input(op.inputs[0], [grad])
    )
    backward_skip = skip
    if kernels.op_threshold(op) and 2 not in skip:
        # dX is also what the threshold's gradient sums.
        backward_skip = tuple(i for i in skip if i != 0)
    binarized, chain = _backward_filter(op)
    dx, dw = binary_backward(
        x,
        binarized,
        grad,
        BinarySpec.from_op_attrs(op.get_attr),
        conv_attrs(op.get_attr),
        backward_skip,
    )
    threshold_grad = _threshold_grad(op, dx)
    return (None if 0 in skip else dx, chain(dw), *threshold_grad)
