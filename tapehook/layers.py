"""Keras layers tapehook adds beside the binary kernels.

``BatchNormalization`` is Keras 3's layer (the same arguments, weights, math
and moving-statistics update) whose training steps run TensorFlow's fused
batch norm: one ``FusedBatchNormV3`` forward and one ``FusedBatchNormGradV3``
backward (oneDNN's where TF turns oneDNN on), instead of the dozen
elementwise and reduction ops per layer of Keras 3's TensorFlow backend.
tf-keras, and so larq, trained on the fused op; Keras 3 does not. In a binary
network a batch norm follows every binary conv, and Keras 3's is the largest
float cost of a training step around the binary kernels
(docs/models.md). Keras's own class is never changed; in a model tapehook is
in charge of (``tapehook.binarize``, ``tapehook.larq``), stock instances of
these three layers become instances of these classes unless
``fast_layers`` is off (``tapehook.models``; docs/design.md).

``MaxPooling2D`` is Keras 3's layer whose training calls keep the position
of each window's maximum for the backward instead of the pool's float input
and output (one byte per output element where the stock backward keeps
two float tensors, the larger four times the output's size at a stride-2
pool).

``Add`` is Keras 3's layer whose inference calls, in graphs, let the binary
conv before it (its batch norm folded in) add the other input as it writes
its outputs: the residual add of a Bi-Real-Net or QuickNet block costs no
pass of its own.
"""

import keras
import tensorflow as tf

from tapehook import conv2d, kernels
from tapehook.compat import control_flow_util, ops
from tapehook.errors import TapehookError

_PACKAGE = "tapehook"
# FusedBatchNormV3's input types; Keras computes batch norm in
# result_type(input, float32), so float64 inputs stay on Keras's ops.
_FUSED_DTYPES = (tf.float32,)


def _float32_or(weight, default):
    """A layer's optional gamma / beta in float32, or ``default`` without it."""
    return default if weight is None else tf.cast(weight, tf.float32)


# Stock convolutions a following per-channel affine can be folded into.
_FLOAT_CONVS = ("Conv2D", "DepthwiseConv2dNative")


def _conv_attrs(op):
    """A stock conv op's attrs, to build the same op again (T inferred)."""
    return {name: op.get_attr(name) for name in op.node_def.attr if name != "T"}


def _is_channels_last(op, *types):
    """``op`` is one of ``types`` computing on NHWC tensors."""
    return op.type in types and op.get_attr("data_format") == b"NHWC"


def _fold_into_float_conv(y, affine):
    """``y * multiplier + offset`` (per channel, ``affine()`` returning the
    two) as the stock float convolution that made ``y`` with its filter
    scaled, ``conv(x, W * multiplier) + offset`` (a BiasAdd, which TF's
    remapper fuses into the conv), where ``y`` is the NHWC output of a
    Conv2D or DepthwiseConv2dNative of a layer's kernel (a variable read)
    no larger than two passes over ``y``; None otherwise. The same transform
    to float rounding (the product is rounded once per filter tap instead
    of once per output); the unscaled conv is left without consumers and
    pruned."""
    op = y.op
    if not _is_channels_last(op, *_FLOAT_CONVS):
        return None
    x, kernel = op.inputs
    if kernel.op.type != "ReadVariableOp" or kernel.dtype != tf.float32:
        # Only a layer's own kernel: a computed or constant filter (tapehook's
        # deploy graphs' binary ones among them: LCE's converter matches them
        # as they are) keeps its batch norm.
        return None
    # Scaling the filter is a pass over W in every call; Keras's transform is
    # two passes over y. Fold where W is the smaller (a float network's deep
    # 3x3 convs at batch 1 are not: their filters outweigh their outputs).
    per_sample = y.shape[1:].num_elements()
    if per_sample is None or kernel.shape.num_elements() is None:
        return None
    if kernel.shape.num_elements() > 2 * (y.shape[0] or 1) * per_sample:
        return None
    multiplier, offset = affine()
    attrs = _conv_attrs(op)
    if op.type == "Conv2D":
        scaled = kernel * multiplier
        out = tf.raw_ops.Conv2D(input=x, filter=scaled, **attrs)
    else:  # depthwise: channel c * M + m of the output is filter[:, :, c, m]
        scaled = kernel * tf.reshape(multiplier, tf.shape(kernel)[2:])
        out = tf.raw_ops.DepthwiseConv2dNative(input=x, filter=scaled, **attrs)
    return tf.nn.bias_add(out, offset)


def _recompute_float_conv(y):
    """``rebuild(after)``: the NHWC Conv2D / DepthwiseConv2dNative that made
    ``y`` run again on the same input and filter (which its own backward
    keeps: dW reads x, dX the filter) once the tensors ``after`` exist; None
    where ``y`` is not such a conv's float32 output in a graph. The control
    dependency also keeps Grappler from merging the rerun with the forward."""
    if tf.executing_eagerly() or y.dtype != tf.float32:
        return None
    op = y.op
    if not _is_channels_last(op, *_FLOAT_CONVS):
        return None
    x, kernel = op.inputs
    attrs = _conv_attrs(op)
    conv = getattr(tf.raw_ops, op.type)

    def rebuild(after):
        with tf.control_dependencies(after):
            return conv(input=x, filter=kernel, **attrs)

    return rebuild


def _read_elsewhere(layer, index=None):
    """Whether, in the Keras functional graphs ``layer`` is called in, a
    tensor it reads (its ``index``-th input, or any) is read by another layer
    too (which would keep an unfolded op computing beside the folded one). A
    layer called outside functional graphs has no such record; there only
    readers created before the call are seen (``Tensor.consumers()``)."""
    for node in getattr(layer, "_inbound_nodes", ()):
        tensors = node.input_tensors
        for tensor in tensors if index is None else tensors[index : index + 1]:
            history = getattr(tensor, "_keras_history", None)
            producer = history.operation if history else None
            if producer is None:
                continue
            readers = [
                n
                for n in getattr(producer, "_outbound_nodes", ())
                if any(t is tensor for t in n.input_tensors)
            ]
            if len(readers) > 1:
                return True
    return False


def _fused_batch_norm(x, gamma, beta, epsilon):
    """FusedBatchNormV3 of NHWC ``x`` in training mode (batch statistics):
    output, batch mean, Bessel-corrected batch variance, reserve spaces."""
    empty = tf.constant([], tf.float32)
    return tf.raw_ops.FusedBatchNormV3(
        x=x,
        scale=gamma,
        offset=beta,
        mean=empty,
        variance=empty,
        epsilon=epsilon,
        exponential_avg_factor=1.0,
        data_format="NHWC",
        is_training=True,
    )


@keras.saving.register_keras_serializable(package=_PACKAGE)
class BatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` trained on TensorFlow's fused op.

    Takes every argument of Keras 3's layer, plus ``fused``, which decides
    how *training* calls (``training=True`` on a trainable layer) run:

    - ``None`` (default): the fused op where it applies — channels-last
      (``axis`` the last axis) inputs of rank 2 to 5, float32 compute dtype
      (mixed precision included: Keras computes batch norm in float32), no
      mask, ``renorm=False``, ``synchronized=False`` — and Keras's ops, the
      same math, otherwise;
    - ``True``: the fused op, or a TapehookError naming what prevents it;
    - ``False``: exactly Keras's layer.

    Inference calls compute Keras's ``x * a + b`` (a, b from the moving
    statistics, gamma and beta, as Keras computes them) with Keras's ops —
    the fused op does not beat them at small batches — or, in a graph
    (``tf.function``, Keras ``predict``), folded into the convolution whose
    float32 output (plus a bias) the input is, when nothing else reads it:

    - (the ReLU of) a compiled fully binary conv built with no tape
      recording: that conv applies it as it writes its outputs (one fused
      multiply-add per output, no pass over the tensor;
      TapehookBinaryConv2DAffine, CPU);
    - a stock NHWC ``Conv2D`` or ``DepthwiseConv2dNative`` (a float stem,
      shortcut or transition): ``conv(x, W * a) + b``, the scaled filter and
      a BiasAdd that TF fuses into the conv — taped or not, the gradients
      are those of the same math.

    ``tf.gradients`` of a folded graph is defined. Deploy exports are
    unaffected (their binary convs are stock ops).

    ``recompute=True`` trades time for memory in training graphs
    (``tf.function``, Keras ``fit``, ``tf.gradients``): where the input is
    (the ReLU of, the bias added to) the float32 output of a convolution —
    a compiled binary conv, or a stock NHWC ``Conv2D`` /
    ``DepthwiseConv2dNative`` (a float stem, shortcut or transition) — the
    backward does not keep that input (4 bytes per element, the largest
    tensor a conv block keeps) but computes it again from what the conv's
    own backward keeps anyway (a binary conv's packed input bits or input,
    a float conv's input and filter): one more forward conv per layer and
    step. The rebuilt input equals the kept one (bit for bit: the binary
    forward is exact and the float one deterministic), so results are those
    of ``recompute=False``. Elsewhere (other inputs, eager calls; binary
    convs on machines with GPUs) the layer trains as with
    ``recompute=False``. Which layers to recompute is the trade: a 3x3
    conv's rebuild costs about the same in every stage of a ResNet-style
    network while the output it saves halves per stage, so recomputing only
    the first stages' batch norms keeps most of the saving for part of the
    time (Bi-Real-Net-18: those of fewer than 256 channels;
    docs/models.md measures both).

    Results equal Keras's to float rounding: outputs and gradients (through
    the batch statistics), and the moving statistics updated as Keras does,
    ``moving * momentum + batch * (1 - momentum)`` with the *biased* batch
    variance (tf-keras's fused path used the Bessel-corrected one; this layer
    keeps Keras 3's).
    """

    def __init__(self, *args, fused=None, recompute=False, **kwargs):
        if fused not in (None, True, False):
            raise TapehookError(
                f"BatchNormalization(fused={fused!r}): fused is None (fused where it "
                "applies), True or False"
            )
        if recompute not in (True, False):
            raise TapehookError(
                f"BatchNormalization(recompute={recompute!r}): recompute is True or False"
            )
        if recompute and fused is False:
            raise TapehookError(
                "BatchNormalization(recompute=True, fused=False): the recomputed input "
                "is read by the fused batch norm's backward; pass fused=None or True"
            )
        super().__init__(*args, **kwargs)
        self.fused = fused
        self.recompute = recompute
        if fused:
            reason = self._config_reason()
            if reason:
                raise TapehookError(
                    f"BatchNormalization(fused=True) with {reason}: TensorFlow's fused "
                    "batch norm does not support it; pass fused=None (fused where it "
                    "applies) or fused=False"
                )

    def _config_reason(self):
        """Why the layer's configuration cannot run fused, or None."""
        if self.renorm:
            return "renorm=True"
        if self.synchronized:
            return "synchronized=True"
        if keras.backend.backend() != "tensorflow":
            return f"the {keras.backend.backend()} backend"
        return None

    def _input_reason(self, inputs, mask):
        """Why this call cannot run fused, or None."""
        reason = self._config_reason()
        if reason:
            return reason
        if mask is not None:
            return "a mask"
        rank = inputs.shape.rank
        if rank is None or not 2 <= rank <= 5:
            return f"inputs of rank {rank} (fused: 2 to 5)"
        if self.axis not in (-1, rank - 1):
            return f"axis={self.axis} on rank-{rank} inputs (fused: the last axis, channels last)"
        compute = tf.as_dtype(keras.backend.result_type(inputs.dtype, "float32"))
        if compute not in _FUSED_DTYPES:
            return f"compute dtype {compute.name} (fused: float32)"
        return None

    def call(self, inputs, training=None, mask=None):
        if self.fused is False:
            return super().call(inputs, training=training, mask=mask)
        if not (training and self.trainable):
            # Inference: Keras's x * a + b (the fused op does not beat its two
            # elementwise ops at small batches: bench/results/batch_norm.json),
            # or that transform folded into the conv whose output this is.
            folded = self._folded_inference(inputs, mask)
            if folded is not None:
                return folded
            return super().call(inputs, training=training, mask=mask)
        inputs = tf.convert_to_tensor(inputs)
        reason = self._input_reason(inputs, mask)
        if reason:
            if self.fused:
                raise TapehookError(
                    f"BatchNormalization(fused=True) trained with {reason}: TensorFlow's "
                    "fused batch norm does not support it; pass fused=None or fused=False"
                )
            return super().call(inputs, training=training, mask=mask)
        return self._fused_training_call(inputs)

    def _folded_inference(self, inputs, mask):
        """The inference output computed by the conv that produced ``inputs``
        (a binary one: conv2d.fold_output_affine; a float one:
        _fold_into_float_conv), or None where it cannot be."""
        if not isinstance(inputs, tf.Tensor) or tf.executing_eagerly():
            return None
        if self._input_reason(inputs, mask) or inputs.shape.rank != 4:
            return None
        if tf.as_dtype(self.compute_dtype) != tf.float32 or inputs.dtype != tf.float32:
            return None
        if inputs.consumers() or _read_elsewhere(self):
            return None  # another layer reads the conv's output too: fold nothing
        y, affine = inputs, self._inference_affine
        if _is_channels_last(y.op, "BiasAdd") and len(y.op.inputs[0].consumers()) == 1:
            # (z + bias) * a + b = z * a + (bias * a + b): fold the bias too.
            y, bias = y.op.inputs

            def affine():
                multiplier, offset = self._inference_affine()
                return multiplier, bias * multiplier + offset

        folded = conv2d.fold_output_affine(y, affine)
        if folded is None:
            folded = _fold_into_float_conv(y, affine)
        return folded

    def _recomputed_batch_norm(self, inputs, gamma, beta):
        """(output, batch mean, batch variance) of the fused batch norm of
        ``inputs`` whose backward reads the input rebuilt from the conv that
        made it (a binary one: conv2d.recompute_output; a float one:
        _recompute_float_conv) instead of the kept one; None where ``inputs``
        is not (the ReLU of, the BiasAdd of) such a conv's output."""
        if tf.executing_eagerly() or inputs.dtype != tf.float32 or inputs.shape.rank != 4:
            return None
        u, relu = inputs, False
        if u.op.type == "Relu":
            u, relu = u.op.inputs[0], True
        y, bias = u, None
        if _is_channels_last(y.op, "BiasAdd"):
            y, bias = y.op.inputs
        rebuild_conv = conv2d.recompute_output(y) or _recompute_float_conv(y)
        if rebuild_conv is None:
            return None

        def rebuild(after):
            rebuilt = rebuild_conv(after)
            return rebuilt if bias is None else tf.nn.bias_add(rebuilt, bias)

        epsilon, stats = self.epsilon, []

        @tf.custom_gradient
        def batch_norm(u, gamma, beta):
            x = tf.nn.relu(u) if relu else u
            out, mean, variance, *reserve = _fused_batch_norm(x, gamma, beta, epsilon)
            stats.extend([mean, variance])

            def grad(d_out):
                # What FusedBatchNormV3's registered gradient computes, on the
                # rebuilt input (equal to x bit for bit).
                x2 = rebuild([d_out])
                library = kernels.cpu_library()
                if library is not None:
                    # tapehook's kernel writes dx over d_out and does the
                    # ReLU (and its backward) itself: the step holds two
                    # full-size tensors here, not three or four (core/batch_norm.h).
                    rows = tf.cast(tf.size(x2, out_type=tf.int64) // x2.shape[-1], tf.float32)
                    biased = variance * tf.math.divide_no_nan(rows - 1.0, rows)
                    dx, dgamma, dbeta = library.tapehook_batch_norm_grad(
                        d_out, x2, gamma, mean, tf.math.rsqrt(biased + epsilon), relu=relu
                    )
                    return dx, dgamma, dbeta
                if relu:
                    x2 = tf.nn.relu(x2)
                dx, dgamma, dbeta, _, _ = tf.raw_ops.FusedBatchNormGradV3(
                    y_backprop=d_out,
                    x=x2,
                    scale=gamma,
                    reserve_space_1=reserve[0],
                    reserve_space_2=reserve[1],
                    reserve_space_3=reserve[2],
                    epsilon=epsilon,
                    data_format="NHWC",
                    is_training=True,
                )
                if relu:
                    dx = tf.raw_ops.ReluGrad(gradients=dx, features=x2)
                return dx, dgamma, dbeta

            return out, grad

        out = batch_norm(u, gamma, beta)
        return out, stats[0], stats[1]

    def _inference_affine(self):
        """Keras's inference transform x * a + b: (a, b) as
        tf.nn.batch_normalization computes them."""
        inv = tf.math.rsqrt(tf.cast(self.moving_variance, tf.float32) + self.epsilon)
        if self.scale:
            inv = inv * tf.cast(self.gamma, tf.float32)
        shift = -tf.cast(self.moving_mean, tf.float32) * inv
        if self.center:
            shift = tf.cast(self.beta, tf.float32) + shift
        return inv, shift

    def _fused_training_call(self, inputs):
        """Batch statistics, output and the moving-statistics update of one
        training call, on FusedBatchNormV3 (its registered gradient,
        FusedBatchNormGradV3, differentiates through the statistics)."""
        channels = inputs.shape[-1]
        x = tf.cast(inputs, tf.float32)
        shape = tf.shape(x)
        rank = inputs.shape.rank
        # FusedBatchNormV3 takes NHWC: fold the middle axes into H (and W).
        if rank == 2:
            x4 = tf.reshape(x, [shape[0], 1, 1, channels])
        elif rank == 3:
            x4 = tf.reshape(x, [shape[0], shape[1], 1, channels])
        elif rank == 5:
            x4 = tf.reshape(x, [shape[0], shape[1] * shape[2], shape[3], channels])
        else:
            x4 = x
        gamma = _float32_or(self.gamma, tf.ones([channels]))
        beta = _float32_or(self.beta, tf.zeros([channels]))
        recomputed = self._recomputed_batch_norm(inputs, gamma, beta) if self.recompute else None
        if recomputed is not None:
            y, mean, variance = recomputed
        else:
            y, mean, variance, _, _, _ = _fused_batch_norm(x4, gamma, beta, self.epsilon)
        # The op returns the Bessel-corrected variance, n / max(n - 1, 1)
        # times the biased one it normalizes with; Keras's moving variance
        # averages the biased one.
        n = tf.cast(tf.size(x4, out_type=tf.int64) // channels, tf.float32)
        variance = variance * (tf.maximum(n - 1.0, 1.0) / tf.maximum(n, 1.0))
        for moving, batch in ((self.moving_mean, mean), (self.moving_variance, variance)):
            old = tf.cast(moving, tf.float32)
            moving.assign(
                tf.cast(old * self.momentum + batch * (1.0 - self.momentum), moving.dtype)
            )
        if rank != 4:
            y = tf.reshape(y, shape)
        return tf.cast(y, self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "fused": self.fused, "recompute": self.recompute}


# MaxPoolWithArgmax's input types.
_ARGMAX_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


def _max_pool_keeping_argmax(x, ksize, strides, padding, fuse_relu=False):
    """NHWC max pool of ``x`` whose backward keeps the position of each
    window's maximum instead of the pool's input and output, which stock
    MaxPoolGrad reads: one byte per output element (its tap in the window,
    tapehook's kernels: float32 on the CPU, windows of up to 127 taps), else
    an int32 index within the image (int64 where one image has 2**31
    elements or more). The same output and gradient as tf.nn.max_pool2d's
    (the first maximum of a window in row-major order gets its gradient, as
    in MaxPoolGrad). ``fuse_relu``: _max_pool_keeping_taps."""
    ksize = [1, *ksize, 1]
    strides = [1, *strides, 1]
    library = kernels.cpu_library()
    # tapehook's kernels (float32, CPU) where they apply: TF's
    # MaxPoolWithArgmax CPU kernel is the slower of the two at a stem pool's
    # size (bench/step_ops.py's per-op times of a bench/models.py step); both
    # give the same outputs and positions.
    ours = library is not None and x.dtype == tf.float32
    if ours and ksize[1] * ksize[2] <= _MAX_POOL_TAPS:
        return _max_pool_keeping_taps(library, x, ksize, strides, padding, fuse_relu)
    per_image = x.shape[1:].num_elements()
    index_dtype = tf.int32 if per_image is not None and per_image < 2**31 else tf.int64
    ours = ours and index_dtype == tf.int32

    @tf.custom_gradient
    def pool(x):
        if ours:
            y, kept = library.tapehook_max_pool_argmax(
                x, ksize=ksize, strides=strides, padding=padding
            )
        else:
            y, argmax = tf.nn.max_pool_with_argmax(
                x, ksize, strides, padding, include_batch_in_index=False
            )
            kept = tf.cast(argmax, index_dtype)
        shape = tf.shape(x)

        @tf.custom_gradient
        def grad(dy):
            argmax = tf.cast(kept, tf.int64)
            # MaxPoolGradWithArgmax reads only its input's shape.
            dx = tf.raw_ops.MaxPoolGradWithArgmax(
                input=tf.zeros(shape, dy.dtype),
                grad=dy,
                argmax=argmax,
                ksize=ksize,
                strides=strides,
                padding=padding,
                include_batch_in_index=False,
            )

            def grad_of_grad(v):
                # dx is linear in dy (TF registers no gradient for the op):
                # its transpose reads v at each window's maximum, as stock
                # MaxPoolGradGrad does (the indices are constant in x).
                images = tf.shape(v)[0]
                flat = tf.reshape(v, [images, -1])
                taken = tf.gather(flat, tf.reshape(argmax, [images, -1]), batch_dims=1)
                return tf.reshape(taken, tf.shape(dy))

            return dx, grad_of_grad

        return y, grad

    return pool(x)


# Taps a window may have for its maximum's tap to fit one byte
# (core/max_pool.h kMaxPoolTaps).
_MAX_POOL_TAPS = 127


def _max_pool_keeping_taps(library, x, ksize, strides, padding, fuse_relu):
    """_max_pool_keeping_argmax on tapehook's kernels, keeping one byte per
    output element (TapehookMaxPoolTaps). With ``fuse_relu``, where ``x`` is
    a graph's ReLU output, the taps also mark windows whose maximum is not > 0, and, if
    the pool is that output's only reader when the backward is built, the
    pool's gradient is that of the ReLU's input (ReluGrad applied), so the
    ReLU's own backward, which reads its float output, does not run. With
    other readers the pool's gradient goes to the ReLU's output, whose
    stock backward then adds all of them first, as without tapehook."""
    attrs = dict(ksize=ksize, strides=strides, padding=padding)
    relu = fuse_relu and not tf.executing_eagerly() and x.op.type == "Relu"
    inputs = (x.op.inputs[0], x) if relu else (x,)

    @tf.custom_gradient
    def pool(*inputs):
        y, taps = library.tapehook_max_pool_taps(x, relu=relu, **attrs)
        shape = tf.shape(x)

        def grad(dy):
            # The graph is whole now: x's readers are the pool and the
            # IdentityN of this custom gradient, or more.
            fused = relu and all(
                op is y.op or (op.type == "IdentityN" and any(t is y for t in op.inputs))
                for op in x.consumers()
            )

            @tf.custom_gradient
            def backprop(dy):
                dx = library.tapehook_max_pool_taps_grad(dy, taps, shape, relu=fused, **attrs)

                def grad_of_grad(v):
                    # dx is linear in dy: its transpose reads v at each tap
                    # (as MaxPoolGradGrad does, after ReluGrad's gradient
                    # when fused).
                    return library.tapehook_max_pool_taps_gather(v, taps, relu=fused, **attrs)

                return dx, grad_of_grad

            dx = backprop(dy)
            if not relu:
                return dx
            return (dx, None) if fused else (None, dx)

        return y, grad

    return pool(*inputs)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class MaxPooling2D(keras.layers.MaxPooling2D):
    """``keras.layers.MaxPooling2D`` whose training calls keep less for the
    backward.

    Takes every argument of Keras 3's layer, plus ``save_argmax`` and
    ``fuse_relu``. With
    ``save_argmax=True`` (default), a training call (``training=True``:
    Keras ``fit``, or ``model(x, training=True)`` under a tape) on a
    channels-last input keeps, per *output* element, where its window's
    maximum was, instead of the pool's float input and output that stock
    MaxPoolGrad reads: one byte (the tap within the window; tapehook's
    kernels, float32 on the CPU, windows of up to 127 taps), else an int32
    index within the image (TensorFlow's MaxPoolWithArgmax). With
    ``fuse_relu=True`` (default False), in a graph (``tf.function``, Keras
    ``fit``), a pool whose input is a ReLU's output and its only reader also
    does that ReLU's backward, so the ReLU's float output is not kept either
    (QuickNet's transitions). Its cost, which is why it is opt-in: a
    gradient with respect to that ReLU output itself (``tape.watch`` of it,
    ``tf.gradients`` to it) is then None; what flows further back, to the
    ReLU's input and every weight, is unchanged. Outputs and gradients equal the stock layer's bit
    for bit (ties included: the first maximum of a window in row-major
    order gets the gradient, as in MaxPoolGrad) where TF runs its own
    MaxPoolGrad; with oneDNN on, a graph's MaxPoolGrad is rewritten to
    oneDNN's, which adds overlapping windows' gradients in another order
    (equal to float rounding). Inference calls, ``channels_first`` inputs,
    XLA-compiled graphs (MaxPoolWithArgmax has no XLA kernel) and input
    dtypes other than float16 / bfloat16 / float32 / float64 run Keras's
    layer, as does ``save_argmax=False``. Second derivatives gather at the
    kept positions, as MaxPoolGradGrad does.
    """

    def __init__(self, *args, save_argmax=True, fuse_relu=False, **kwargs):
        for name, value in (("save_argmax", save_argmax), ("fuse_relu", fuse_relu)):
            if not isinstance(value, bool):
                raise TapehookError(f"MaxPooling2D({name}={value!r}): {name} is True or False")
        super().__init__(*args, **kwargs)
        self.save_argmax = save_argmax
        self.fuse_relu = fuse_relu

    def call(self, inputs, training=None):
        if not (self.save_argmax and training and self.data_format == "channels_last"):
            return super().call(inputs)
        inputs = tf.convert_to_tensor(inputs)
        if inputs.dtype not in _ARGMAX_DTYPES or (
            not tf.executing_eagerly()
            and control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph())
        ):
            return super().call(inputs)
        return _max_pool_keeping_argmax(
            inputs, self.pool_size, self.strides, self.padding.upper(), self.fuse_relu
        )

    def get_config(self):
        return {
            **super().get_config(),
            "save_argmax": self.save_argmax,
            "fuse_relu": self.fuse_relu,
        }


@keras.saving.register_keras_serializable(package=_PACKAGE)
class Add(keras.layers.Add):
    """``keras.layers.Add`` that, in inference graphs, lets the binary conv
    before it do the add.

    Takes every argument of Keras 3's layer. Where one of two inputs is a
    ``BatchNormalization``'s inference output folded into a compiled binary
    conv (that layer's docstring: TapehookBinaryConv2DAffine, CPU, built in
    a graph — ``tf.function``, Keras ``predict`` — with no tape recording)
    and no other layer reads it, the conv adds the other input as it writes
    its outputs (TapehookBinaryConv2DAffineAdd; the output may take over the
    other input's buffer): one pass over the residual stream less per block
    of a Bi-Real-Net or QuickNet. Each output is the folded conv's float
    output plus the other input, the sum a separate add makes, bit for bit;
    inputs of different static shapes (broadcasting), dtypes other than
    float32 and every other call compute Keras's add. ``tf.gradients`` of a
    folded graph is defined. Deploy exports are unaffected.
    """

    def call(self, inputs):
        # Eager calls never fold: skip the walk over the Keras graph there.
        if not tf.executing_eagerly() and isinstance(inputs, (list, tuple)) and len(inputs) == 2:
            for i in (0, 1):
                y, addend = inputs[i], inputs[1 - i]
                if _read_elsewhere(self, i):
                    continue
                folded = conv2d.fold_residual_add(y, addend)
                if folded is not None:
                    return folded
        return super().call(inputs)
