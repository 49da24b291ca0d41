"""Binary Conv2D forward: what gen_nn_ops.conv2d does with a marked filter.

tf.nn.conv2d, tf.nn.convolution and Keras 3 Conv2D / Conv1D all call
gen_nn_ops.conv2d; its wrapper (patches.py) sends a call with a marked filter
to ``conv2d``, which runs the compiled TapehookBinaryConv2D kernel (or the
dispatcher's stock route) with the spec as op attrs. The op is recorded on
any active tape as a "Conv2D" of (x, latent W), so the tape builds its
gradient through the registered Conv2D gradient, which gradient.py replaces.
"""

import dataclasses
import warnings

import tensorflow as tf

from tapehook import counts, dispatch, gradient, kernels, marks, override, reference, registry
from tapehook.compat import control_flow_util, execute, ops, record
from tapehook.errors import TapehookError
from tapehook.packing import pack_input, packable
from tapehook.spec import BinarySpec

PACKED_RECORD = "TapehookBinaryConv2DPacked"  # tape records that keep bits, not x

# On the output of a sign of a shifted input (tapehook.recipes.RSign): the
# ShiftedSign it was taken of.
SHIFTED_SIGN_ATTR = "_tapehook_shifted_sign"


@dataclasses.dataclass(frozen=True)
class ShiftedSign:
    """sign(t), t = x - beta (beta per channel), pseudo-gradient
    ``estimator`` at t with ``clip``."""

    t: tf.Tensor
    x: tf.Tensor
    beta: tf.Tensor
    estimator: str
    clip: float | None


def tag_shifted_sign(y, x, beta, t, estimator, clip):
    """Records on ``y`` = sign(t), t = x - beta (pseudo-gradient
    ``estimator`` at t) what it was taken of, so a binary conv reading ``y``
    can binarize t itself (``_fold_shifted_sign``). Only for t of y's dtype;
    a tensor that takes no attributes stays as it is."""
    if t.dtype == y.dtype:
        try:
            setattr(y, SHIFTED_SIGN_ATTR, ShiftedSign(t, x, beta, estimator, clip))
        except AttributeError:
            pass


def _fold_shifted_sign(x, spec):
    """(input, spec, shifted) for a conv of x = sign(t) (tag_shifted_sign):
    the conv binarizes t with the sign's own estimator instead, the same
    forward and, where the conv's own input estimator passes +-1 through
    unchanged (ste_sign with a clip of at least 1, or none), the same
    gradients: the mask e'(t) applied inside the conv's backward, then the
    shift's. The sign op itself is left without a consumer, which graphs
    prune; x's binarization and its backward no longer cost a pass of their
    own. ``shifted``: the ShiftedSign folded (None where none was), which
    lets an inference forward take x and beta instead of t."""
    shifted = marks.tensor_attribute(x, SHIFTED_SIGN_ATTR)
    if shifted is None or spec.activation_estimator != "ste_sign":
        return x, spec, None
    if spec.activation_clip is not None and spec.activation_clip < 1:
        return x, spec, None
    if shifted.estimator == "swish_sign" and spec.beta != reference.SWISH_BETA:
        return x, spec, None  # the spec's beta is the weights' too
    spec = dataclasses.replace(spec, activations=shifted.estimator, activation_clip=shifted.clip)
    return shifted.t, spec, shifted


def _threshold(shifted, x, spec, attrs, recording):
    """[beta] where the forward may binarize x - beta itself (x the
    ShiftedSign's unshifted input), so that no pass computes t = x - beta:
    in graphs (eagerly, RSign computed t already), float32, CPU kernels,
    padding that holds zeros (one-padding pads t, not x), and, where a tape
    records, a backward that reads only the bits packed from x and beta
    (never t itself); else []."""
    if recording and (not packable(x, spec) or override.override_for("Conv2D") is not None):
        return []
    if (
        shifted is None
        or tf.executing_eagerly()
        or x.dtype != tf.float32
        or shifted.x.dtype != tf.float32
        or shifted.x.shape.rank != 4
        or kernels.gpu_visible()
        or attrs["data_format"] != "NHWC"
    ):
        return []
    return [tf.cast(shifted.beta, tf.float32)]


def _check(x, w, attrs):
    marks.check_operands(x, w, "Conv2D")
    if attrs["data_format"] != "NHWC":
        raise TapehookError(
            f"a marked Conv2D filter was used with data_format "
            f"{attrs['data_format']}; binary kernels support NHWC only (Keras: "
            f"data_format='channels_last')"
        )
    if w.shape.rank is not None and w.shape.rank != 4:
        raise TapehookError(
            f"a marked Conv2D filter must be 4-D [h, w, in, out], got shape {w.shape}"
        )


_xla_warning_shown = False


def _warn_xla_once():
    global _xla_warning_shown
    if not _xla_warning_shown:
        _xla_warning_shown = True
        warnings.warn(
            "tapehook: a binary conv is being XLA-compiled (jit_compile=True); "
            "tapehook's kernels have no XLA implementation, so it runs the same "
            "math as plain TF ops (the reference path). Use jit_compile=False for "
            "the binary kernels.",
            RuntimeWarning,
            stacklevel=5,
        )


def _record(x, w, y, attrs, packed):
    """Records y = Conv2D(x, w) on the active tapes, with packed input bits
    instead of x where the forward kept them."""
    if packed is None or override.override_for("Conv2D") is not None:
        # (under override_gradient("Conv2D") the conv is recorded as a Conv2D,
        # so the override applies to it)
        execute.record_gradient(
            "Conv2D",
            [x, w],
            (
                "T",
                x.dtype.as_datatype_enum,
                "strides",
                attrs["strides"],
                "use_cudnn_on_gpu",
                True,
                "padding",
                attrs["padding"],
                "explicit_paddings",
                attrs["explicit_paddings"],
                "data_format",
                attrs["data_format"],
                "dilations",
                attrs["dilations"],
            ),
            [y],
        )
        return
    # record_gradient would keep x alive for the tape, and so would recording
    # under the name "Conv2D" (the tape keeps the inputs that op type's
    # gradient reads); a closure over the bits under tapehook's own name does
    # not. The backward still goes through the registered "Conv2D" gradient.
    # No tape watches x (a first layer's input): no dX, as the registered path
    # gets from skip_input_indices.
    skip = () if record.should_record_backprop([x]) else (0,)
    op = gradient.PackedConvOp(packed, w, attrs, skip)
    record.record_operation(
        PACKED_RECORD, [y], [x, w], lambda dy: registry.registered_gradient("Conv2D")(op, dy)
    )


def _kept_balance(spec, x, w, recording):
    """The op's balance attr where an inference forward balances W as it
    packs the filter it keeps (fully binary, float32, CPU), else "none"."""
    if (
        spec.balance is None
        or recording
        or spec.activation_estimator is None
        or x.dtype != tf.float32
        or w.dtype != tf.float32
        or kernels.gpu_visible()
    ):
        return "none"
    return spec.balance


def binary_conv2d(x, w, spec: BinarySpec, attrs: dict, name=None, shifted=None):
    """y = conv2d(x_hat, alpha * sign(w)) with the binary backward attached.
    ``shifted``: the ShiftedSign x is the t of (_fold_shifted_sign), if any.
    A balanced spec binarizes W's balanced kernel: computed by recorded TF
    ops, or, in an inference forward, by the op as it packs the filter it
    keeps (so it is computed once while W is unchanged)."""
    with tf.name_scope(name or "BinaryConv2D"):
        x = tf.convert_to_tensor(x)
        w = tf.convert_to_tensor(w)
        _check(x, w, attrs)
        library = kernels.library()
        if library is not None and control_flow_util.GraphOrParentsInXlaContext(
            ops.get_default_graph()
        ):
            _warn_xla_once()
            library = None
        plan = (
            None
            if library is None
            else dispatch.forward_path(spec.unbalanced(), attrs, x.dtype.name, x.shape, w.shape)
        )
        recording = execute.must_record_gradient()
        balance = _kept_balance(spec, x, w, recording) if dispatch.runs_kernels(plan) else "none"
        if balance == "none":
            spec, w = reference.balance(spec, w)
        else:
            spec = spec.unbalanced()
        if not dispatch.runs_kernels(plan):
            counts.count_reference(forward=1)
            return reference.binary_conv2d(
                x,
                w,
                spec,
                attrs["strides"],
                attrs["padding"],
                attrs["explicit_paddings"],
                attrs["dilations"],
                on_backward=lambda: counts.count_reference(backprop_input=1, backprop_filter=1),
            )
        # A graph binarizes x - beta in the conv (no pass for t).
        threshold = _threshold(shifted, x, spec, attrs, recording)
        with record.stop_recording():
            # Inference (no tape recording) lets the forward keep its packed
            # filter (bitpacked, or the AMX GEMM's sign(W) for a float input)
            # while w's buffer stays the same: safe, since TF writes a
            # variable read elsewhere to a new buffer (see the op's
            # cache_filter). A training step would only pay a copy.
            y = library.tapehook_binary_conv2d(
                shifted.x if threshold else x,
                w,
                threshold=threshold,
                **attrs,
                **spec.op_attrs(),
                cache_filter=not recording,
                plan=plan,
                balance=balance,
            )
            # With binary activations the backward needs only sign(x) and e'(x):
            # keep those bits, not x (packing.py). Graph gradients of the op
            # find them on it; unused in inference, Grappler prunes them.
            packed = None
            if packable(x, spec) and (recording or not tf.executing_eagerly()):
                # (the bits of t, from x and beta where the op takes beta)
                packed = (
                    pack_input(shifted.x, spec, threshold) if threshold else pack_input(x, spec)
                )
                if not tf.executing_eagerly():
                    y.op._tapehook_packed_input = packed
        if recording:
            setattr(w, gradient.FORWARD_SPEC_ATTR, spec)
            _record(x, w, y, attrs, packed)
        return y


def fold_output_affine(y, affine):
    """``y * multiplier + offset`` (per output channel, ``affine()`` returning
    the two, called only here) computed by the binary forward that made
    ``y`` as it writes its outputs, where that is possible: ``y`` (or the ReLU
    of it) is the output of a compiled fully binary forward built in a graph
    for inference (``cache_filter``: no tape was recording), float32, on a
    machine without GPUs (the fused op is CPU only). Returns None otherwise;
    the caller then computes it itself. The unfused forward stays in the
    graph for any other consumer, and Grappler prunes it when there is none."""
    if tf.executing_eagerly() or not isinstance(y, tf.Tensor) or y.dtype != tf.float32:
        return None
    op, relu = y.op, False
    if op.type == "Relu" and len(op.inputs[0].consumers()) == 1:
        op, relu = op.inputs[0].op, True
    if (
        op.type != kernels.BINARY_OP
        or not op.get_attr("cache_filter")
        or op.get_attr("activation_estimator") == b"none"
        or kernels.gpu_visible()
    ):
        return None
    multiplier, offset = affine()
    return kernels.library().tapehook_binary_conv2d_affine(
        op.inputs[0],
        op.inputs[1],
        multiplier,
        offset,
        threshold=kernels.op_threshold(op),
        relu=relu,
        **kernels.binary_op_attrs(op),
    )


def fold_residual_add(y, addend):
    """``y + addend`` computed by the conv that made ``y`` as it writes its
    outputs, where ``y`` is the output of a TapehookBinaryConv2DAffine op
    (fold_output_affine: an inference batch norm folded into a binary conv)
    that nothing else reads, and ``addend`` a float32 tensor of ``y``'s
    static shape: each output is the affine op's float output plus the
    addend, the sum a separate add makes, to the bit. Returns None otherwise.
    The caller checks that no other layer will read ``y``."""
    if tf.executing_eagerly() or not tf.is_symbolic_tensor(y) or not isinstance(addend, tf.Tensor):
        return None  # (an eager tensor, e.g. a constant captured by the graph, has no op)
    op = y.op
    if op.type != kernels.AFFINE_OP or y.consumers() or addend.dtype != tf.float32:
        return None
    if addend.shape.rank != 4 or addend.shape != y.shape or not y.shape[1:].is_fully_defined():
        return None  # the same static shape; only the batch may be unknown (checked at run time)
    x, w, multiplier, offset = op.inputs[:4]
    return kernels.library().tapehook_binary_conv2d_affine_add(
        x,
        w,
        multiplier,
        offset,
        addend,
        threshold=kernels.op_threshold(op),
        relu=op.get_attr("relu"),
        **kernels.binary_op_attrs(op),
    )


def recompute_output(y):
    """A function ``rebuild(after)`` that computes ``y`` again, bit for bit,
    from what the backward of the binary conv that made it keeps anyway — its
    packed sign / mask bits (ste_sign inputs, packing.py) or its input x —
    and its filter, once the tensors ``after`` exist; None where ``y`` is not
    the float32 output of a compiled binary forward in a graph on a machine
    without GPUs. A caller that reads ``y`` in its own backward can read the
    rebuilt one there instead, so the step need not keep ``y`` (one more
    binary forward per step; docs/design.md, "Recomputed batch-norm inputs")."""
    if tf.executing_eagerly() or not isinstance(y, tf.Tensor) or y.dtype != tf.float32:
        return None
    op = y.op
    if op.type != kernels.BINARY_OP or kernels.gpu_visible():
        return None
    packed = getattr(op, "_tapehook_packed_input", None)
    x, w = op.inputs[:2]
    threshold = kernels.op_threshold(op)
    attrs = kernels.binary_op_attrs(op)

    def rebuild(after):
        # The control dependency keeps the executor from running the rebuild
        # as soon as its inputs exist (in the forward), which would keep its
        # output as long as y.
        with tf.control_dependencies(after):
            # sign(x) as +-1: the forward binarizes it to the same bits.
            if packed is not None:  # (of x - threshold where there is one)
                return kernels.library().tapehook_binary_conv2d(packed.unpack()[0], w, **attrs)
            source = gradient.forward_input(x, [])
            return kernels.library().tapehook_binary_conv2d(source, w, threshold=threshold, **attrs)

    return rebuild


def conv2d(
    spec,
    input,
    filter,
    strides,
    padding,
    use_cudnn_on_gpu=True,  # noqa: A002
    explicit_paddings=(),
    data_format="NHWC",
    dilations=(1, 1, 1, 1),
    name=None,
):
    """gen_nn_ops.conv2d's arguments, with a marked filter and its ``spec``
    (patches.py's wrapper found it, marking the filter inside a binary_scope):
    the binary conv."""
    del use_cudnn_on_gpu  # CPU kernels; the GPU ones choose their own
    input, spec, shifted = _fold_shifted_sign(input, spec)  # noqa: A001
    if not isinstance(padding, str):
        raise TapehookError(f"padding must be 'SAME', 'VALID' or 'EXPLICIT', got {padding!r}")
    attrs = {
        "strides": list(strides),
        "padding": padding,
        "explicit_paddings": list(explicit_paddings or []),
        "data_format": data_format or "NHWC",
        "dilations": list(dilations or [1, 1, 1, 1]),
    }
    if spec.pad_value and padding != "VALID" and attrs["data_format"] == "NHWC":
        # One-padding: a VALID conv of x padded with pad_value (sign(1) = 1,
        # so x_hat is padded with 1 too); every path then sees a VALID conv,
        # the padded taps count in dW, and tf.pad's gradient slices dX back.
        input, attrs["padding"], attrs["explicit_paddings"] = reference.pad_input(  # noqa: A001
            tf.convert_to_tensor(input),
            filter.shape,
            attrs["strides"],
            padding,
            attrs["explicit_paddings"],
            attrs["dilations"],
            spec.pad_value,
        )
        shifted = None
    return binary_conv2d(input, filter, spec, attrs, name=name, shifted=shifted)
