"""Binary Conv2D: the forward interposer and the gradient that dispatches on marks.

Forward (``conv2d`` replaces gen_nn_ops.conv2d, which tf.nn.conv2d,
tf.nn.convolution and Keras 3 Conv2D/Conv1D all call): a float filter goes to
stock TF untouched. A marked filter runs the compiled TapehookBinaryConv2D
kernel with its spec as op attrs, and the op is recorded on any active tape as
a "Conv2D" of (x, latent W), so the tape builds its gradient through the
registered Conv2D gradient, which ``conv2d_grad`` replaces.

Backward: ``conv2d_grad`` reads the binary spec fixed at forward time on the
filter tensor; unmarked convs go to TF's own function, bit for bit. Graph
gradients of a TapehookBinaryConv2D op (tf.gradients, a tf.function under an
outer tape, a loaded SavedModel) read the spec from the op's attrs.
"""

import dataclasses
import threading
import warnings

import tensorflow as tf
from tapehook import dispatch, kernels, marks, reference, registry
from tapehook.packing import PackedInput, pack_input, packable
from tapehook.compat import control_flow_util, execute, ops, record
from tapehook.errors import TapehookError
from tapehook.spec import BinarySpec

_FORWARD_SPEC_ATTR = "_tapehook_forward_spec"  # on the filter tensor a tape records
BINARY_OP = "TapehookBinaryConv2D"
PACKED_RECORD = "TapehookBinaryConv2DPacked"  # tape records that keep bits, not x

# Set by patches.install(): TF's own gen_nn_ops.conv2d and Conv2D gradient.
stock = {"conv2d": None, "conv2d_grad": None}

_reference_counts_lock = threading.Lock()
_reference_counts = dict(forward=0, backprop_input=0, backprop_filter=0)


def _count_reference(**increments):
    with _reference_counts_lock:
        for kind, n in increments.items():
            _reference_counts[kind] += n


def dispatch_counts() -> dict:
    """How many binary forwards / backprops ran on each path.

    ``compiled`` counts kernel executions (exact in every mode, counted in C++).
    ``reference`` counts builds of binary work done with plain TF ops (the
    fallback, XLA, or the dispatcher's choice of stock convolutions): each run
    in eager, each trace inside tf.function or a graph.
    """
    with _reference_counts_lock:
        reference_counts = dict(_reference_counts)
    return {"compiled": kernels.compiled_counts(), "reference": reference_counts}


def reset_dispatch_counts() -> None:
    with _reference_counts_lock:
        for kind in _reference_counts:
            _reference_counts[kind] = 0
    kernels.reset_compiled_counts()


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


def _conv_attrs(get_attr) -> dict:
    """The Conv2D attrs the binary kernels share, read with ``get_attr(name)``."""
    return {
        "strides": list(get_attr("strides")),
        "padding": _text(get_attr("padding")),
        "explicit_paddings": list(get_attr("explicit_paddings")),
        "data_format": _text(get_attr("data_format")),
        "dilations": list(get_attr("dilations")),
    }


def _check(x, w, attrs):
    marks.check_operands(x, w, "Conv2D")
    if attrs["data_format"] != "NHWC":
        raise TapehookError(
            f"a marked Conv2D filter was used with data_format "
            f"{attrs['data_format']}; binary kernels support NHWC only (Keras: "
            f"data_format='channels_last')")
    if w.shape.rank is not None and w.shape.rank != 4:
        raise TapehookError(
            f"a marked Conv2D filter must be 4-D [h, w, in, out], got shape {w.shape}")


_xla_warned = []


def _warn_xla_once():
    if not _xla_warned:
        _xla_warned.append(True)
        warnings.warn(
            "tapehook: a binary conv is being XLA-compiled (jit_compile=True); "
            "tapehook's kernels have no XLA implementation, so it runs the same "
            "math as plain TF ops (the reference path). Use jit_compile=False for "
            "the binary kernels.", RuntimeWarning, stacklevel=4)


def binary_conv2d(x, w, spec: BinarySpec, attrs: dict, name=None):
    """y = conv2d(x_hat, alpha * sign(w)) with the binary backward attached."""
    with tf.name_scope(name or "BinaryConv2D"):
        x = tf.convert_to_tensor(x)
        w = tf.convert_to_tensor(w)
        _check(x, w, attrs)
        library = kernels.library()
        if library is not None and control_flow_util.GraphOrParentsInXlaContext(
                ops.get_default_graph()):
            _warn_xla_once()
            library = None
        if library is None or dispatch.forward_path(
                spec, attrs, x.dtype.name, x.shape, w.shape) == dispatch.STOCK:
            _count_reference(forward=1)
            return reference.binary_conv2d(
                x, w, spec, attrs["strides"], attrs["padding"],
                attrs["explicit_paddings"], attrs["dilations"],
                on_backward=lambda: _count_reference(backprop_input=1, backprop_filter=1))
        recording = execute.must_record_gradient()
        with record.stop_recording():
            # Inference (no tape recording) lets the forward keep its packed
            # filter (bitpacked, or the AMX GEMM's sign(W) for a float input)
            # while w's buffer stays the same: safe, since TF writes a
            # variable read elsewhere to a new buffer (see the op's
            # cache_filter). A training step would only pay a copy.
            cache = not recording
            y = library.tapehook_binary_conv2d(x, w, **attrs, **spec.op_attrs(),
                                               cache_filter=cache)
            # With binary activations the backward needs only sign(x) and e'(x):
            # keep those bits, not x (packing.py). Graph gradients of the op
            # find them on it; unused in inference, Grappler prunes them.
            packed = None
            if packable(x, spec) and (recording or not tf.executing_eagerly()):
                packed = pack_input(x, spec)
                if not tf.executing_eagerly():
                    y.op._tapehook_packed_input = packed
        if recording:
            setattr(w, _FORWARD_SPEC_ATTR, spec)
            if packed is None or _conv2d_overridden():
                execute.record_gradient("Conv2D", [x, w], (
                    "T", x.dtype.as_datatype_enum, "strides", attrs["strides"],
                    "use_cudnn_on_gpu", True, "padding", attrs["padding"],
                    "explicit_paddings", attrs["explicit_paddings"],
                    "data_format", attrs["data_format"],
                    "dilations", attrs["dilations"]), [y])
            else:
                # record_gradient would keep x alive for the tape, and so would
                # recording under the name "Conv2D" (the tape keeps the inputs
                # that op type's gradient reads); a closure over the bits under
                # tapehook's own name does not. The backward still goes through
                # the registered "Conv2D" gradient.
                # No tape watches x (a first layer's input): no dX, as the
                # registered path gets from skip_input_indices.
                skip = () if record.should_record_backprop([x]) else (0,)
                op = _PackedConvOp(packed, w, attrs, skip)
                record.record_operation(
                    PACKED_RECORD, [y], [x, w],
                    lambda dy: registry.registered_gradient("Conv2D")(op, dy))
        return y


def conv2d(input, filter, strides, padding, use_cudnn_on_gpu=True,  # noqa: A002
           explicit_paddings=(), data_format="NHWC", dilations=(1, 1, 1, 1),
           name=None):
    """Drop-in for gen_nn_ops.conv2d: binary for marked filters, stock otherwise."""
    spec = marks.spec_for_use(filter)
    if spec is None:
        return stock["conv2d"](input, filter, strides, padding,
                               use_cudnn_on_gpu=use_cudnn_on_gpu,
                               explicit_paddings=explicit_paddings,
                               data_format=data_format, dilations=dilations,
                               name=name)
    if not isinstance(padding, str):
        raise TapehookError(f"padding must be 'SAME', 'VALID' or 'EXPLICIT', got {padding!r}")
    attrs = {"strides": list(strides), "padding": padding,
             "explicit_paddings": list(explicit_paddings or []),
             "data_format": data_format or "NHWC",
             "dilations": list(dilations or [1, 1, 1, 1])}
    return binary_conv2d(input, filter, spec, attrs, name=name)


def _conv2d_overridden() -> bool:
    """Is a tapehook.override_gradient("Conv2D", ...) scope open on this thread?
    Then the conv is recorded as a Conv2D, so the override applies to it."""
    from tapehook import override  # override imports this module
    return override._override_for("Conv2D") is not None


@dataclasses.dataclass
class _PackedConvOp:
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


def _library_for_gradient():
    library = kernels.library()
    if library is None:
        raise TapehookError(
            "a binary Conv2D recorded on the compiled kernels needs them for its "
            "gradient, but they are not loaded; see tapehook.kernel_info()")
    return library


def _binary_backward(x, w, dy, spec, attrs, skip):
    """(dX, dW) from the compiled backprop kernels, or stock backprops on the
    binarized operands where the dispatcher says they are faster; None where
    skipped. ``x`` may be the PackedInput kept instead of the input."""
    packed = x if isinstance(x, PackedInput) else None
    x_shape = packed.shape if packed is not None else x.shape
    # Each backprop takes its own path (the dispatcher may split them).
    paths = [None if i in skip else dispatch.backprop_path(
        attrs, dy.dtype.name, x_shape, w.shape, filter_grad=bool(i),
        binary_input=spec.activations, packed=packed is not None) for i in (0, 1)]
    grads = [None, None]
    if packed is not None:
        # The kernels read the packed sign / mask bits directly; stock ops get
        # them unpacked: dX as a float-input backprop on x_hat times e'(x), dW
        # on x_hat (its own sign).
        all_attrs = {**attrs, **spec.op_attrs(), "channels": packed.channels}
        if dispatch.KERNELS in paths:
            library = _library_for_gradient()
            if paths[0] == dispatch.KERNELS:
                grads[0] = library.tapehook_binary_conv2d_backprop_input_packed(
                    packed.packed, w, dy, **all_attrs)
            if paths[1] == dispatch.KERNELS:
                grads[1] = library.tapehook_binary_conv2d_backprop_filter_packed(
                    packed.packed, w, dy, **all_attrs)
        if dispatch.STOCK in paths:
            x_hat, mask = packed.unpack()
            stock = [p == dispatch.STOCK for p in paths]
            _count_reference(backprop_input=int(stock[0]), backprop_filter=int(stock[1]))
            conv = (attrs["strides"], attrs["padding"], attrs["explicit_paddings"],
                    attrs["dilations"])
            if stock[0]:
                grads[0] = reference.binary_conv2d_backward(
                    x_hat, w, dy, dataclasses.replace(spec, activations=False), *conv,
                    need_dx=True, need_dw=False)[0] * mask
            if stock[1]:
                grads[1] = reference.binary_conv2d_backward(
                    x_hat, w, dy, spec, *conv, need_dx=False, need_dw=True)[1]
        return tuple(grads)
    if dispatch.STOCK in paths:
        stock = [p == dispatch.STOCK for p in paths]
        _count_reference(backprop_input=int(stock[0]), backprop_filter=int(stock[1]))
        ref = reference.binary_conv2d_backward(
            x, w, dy, spec, attrs["strides"], attrs["padding"], attrs["explicit_paddings"],
            attrs["dilations"], need_dx=stock[0], need_dw=stock[1])
        grads = [g if s else None for g, s in zip(ref, stock)]
    if dispatch.KERNELS in paths:
        library = _library_for_gradient()
        all_attrs = {**attrs, **spec.op_attrs()}
        if paths[0] == dispatch.KERNELS:
            grads[0] = library.tapehook_binary_conv2d_backprop_input(x, w, dy, **all_attrs)
        if paths[1] == dispatch.KERNELS:
            grads[1] = library.tapehook_binary_conv2d_backprop_filter(x, w, dy, **all_attrs)
    return tuple(grads)


def conv2d_grad(op, grad):
    """The registered "Conv2D" gradient while tapehook is installed."""
    spec = getattr(op.inputs[1], _FORWARD_SPEC_ATTR, None)
    if spec is None:
        return stock["conv2d_grad"](op, grad)
    skip = tuple(getattr(op, "skip_input_indices", None) or ())
    return _binary_backward(op.inputs[0], op.inputs[1], grad, spec,
                            _conv_attrs(op.get_attr), skip)


def binary_conv2d_op_grad(op, grad):
    """Gradient of a TapehookBinaryConv2D graph op: the spec is in its attrs,
    the input's bits (binary activations) on the op when it was built here."""
    skip = tuple(getattr(op, "skip_input_indices", None) or ())
    x = getattr(op, "_tapehook_packed_input", None) or op.inputs[0]
    return _binary_backward(x, op.inputs[1], grad,
                            BinarySpec.from_op_attrs(op.get_attr),
                            _conv_attrs(op.get_attr), skip)
