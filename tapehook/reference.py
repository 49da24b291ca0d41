"""The reference binary Conv2D: the math of docs/design.md in plain TF ops.

Used by the fallback path when the compiled kernels are unavailable, and by the
tests as the independent reference the kernels are checked against.

    sign(t) = +1 if t >= 0 else -1
    W_hat   = alpha * sign(W)      alpha = 1, or mean |W| per output channel
              (W itself with weights=False)
    x_hat   = sign(x) if activations are binary else x
    y       = conv2d(x_hat, W_hat)     SAME / EXPLICIT pad x_hat with pad_value
    dW      = conv2d_backprop_filter(x_hat, dY) * alpha * e'(W)  [no alpha,
              no e'(W) with weights=False]
    dX      = conv2d_backprop_input(W_hat, dY) [* e'(x) when binary]

Estimators e'(t): ste_sign 1{|t| <= clip} (no mask for clip None; the
input's clip is activation_clip); approx_sign (2 - 2|t|) 1{|t| <= 1};
swish_sign beta (2 - beta t tanh(beta t / 2)) / (1 + cosh(beta t)).
"""

import tensorflow as tf

from tapehook.errors import TapehookError
from tapehook.spec import clip_threshold

SWISH_BETA = 5.0


def sign(t):
    """+1 where t >= 0, else -1 (zero maps to +1), in t's dtype."""
    one = tf.constant(1, t.dtype)
    return tf.where(t >= 0, one, -one)  # scalars broadcast: one pass over t


def estimator_grad(name, t, clip, beta=SWISH_BETA):
    """e'(t), the pseudo-derivative of sign, computed in float32 or float64.

    The ste_sign mask is exactly 1{|t| <= clip} for t in its own dtype:
    half / bfloat16 / float32 values are float32 numbers, compared with clip
    rounded toward zero to float32 (spec.clip_threshold).
    """
    wide = tf.float64 if t.dtype == tf.float64 else tf.float32
    t = tf.cast(t, wide)
    if name == "ste_sign":
        if clip is None:
            return tf.ones_like(t)
        threshold = clip_threshold(clip, float64=wide == tf.float64)
        return tf.cast(tf.abs(t) <= tf.constant(threshold, wide), wide)
    if name == "approx_sign":
        return tf.where(tf.abs(t) <= 1, 2 - 2 * tf.abs(t), tf.zeros_like(t))
    if name == "swish_sign":
        # beta: a float, or a variable annealed during training (tapehook.recipes).
        b = tf.cast(tf.convert_to_tensor(beta, dtype_hint=wide), wide)
        # 1 + cosh overflows to inf for large |t|, which correctly gives 0.
        return b * (2 - b * t * tf.tanh(b * t / 2)) / (1 + tf.cosh(b * t))
    raise ValueError(f"unknown estimator {name!r}")


def alpha(w, scale):
    """Per-output-channel scale (a constant in the backward pass)."""
    if scale == "mean_abs":
        return tf.stop_gradient(tf.reduce_mean(tf.abs(w), axis=[0, 1, 2]))
    return tf.ones([tf.shape(w)[-1]], w.dtype)


def balanced_kernel(w, balance, output_axes=1, epsilon=1e-12):
    """IR-Net's balanced weights per output channel (the last ``output_axes``
    axes: 2 for a depthwise kernel): W - mean(W) for ``"mean"``,
    (W - mean(W)) / sqrt(var(W) + epsilon) for ``"std"`` (population
    variance), over every other axis. Computed in float32 (float64 for
    float64 kernels) and cast back; differentiable, so the gradient flows
    through the mean and the deviation as in IR-Net."""
    wide = tf.float64 if w.dtype == tf.float64 else tf.float32
    w_wide = tf.cast(w, wide)
    axes = list(range(w.shape.rank - output_axes))
    centred = w_wide - tf.reduce_mean(w_wide, axis=axes, keepdims=True)
    if balance == "std":
        var = tf.reduce_mean(tf.square(centred), axis=axes, keepdims=True)
        centred = centred * tf.math.rsqrt(var + tf.constant(epsilon, wide))
    return tf.cast(centred, w.dtype)


def balance(spec, w, output_axes=1):
    """(spec, w) for a binary op: with ``spec.balance``, the balanced kernel
    (its ops recorded like any others, so W's gradient goes through them) and
    the spec it is binarized with."""
    if spec.balance is None:
        return spec, w
    w = tf.convert_to_tensor(w)
    if w.shape.rank is None or w.shape.rank <= output_axes:
        raise TapehookError(f"balance={spec.balance!r} needs a kernel of known rank, got {w.shape}")
    return spec.unbalanced(), balanced_kernel(w, spec.balance, output_axes)


def scaled_sign(w, a):
    """alpha * sign(W) in one pass (a broadcasts along the output channels)."""
    return tf.where(w >= 0, a, -a)


def binarize_input(x, spec):
    return sign(x) if spec.activation_estimator else x


def _explicit_amounts(explicit_paddings):
    """Conv2D's 8 explicit_paddings as tf.pad's [[before, after]] per NHWC axis."""
    p = list(explicit_paddings)
    return [p[0:2], p[2:4], p[4:6], p[6:8]]


def _explicit_to_valid(x, padding, explicit_paddings):
    """(x, padding), an EXPLICIT conv as a VALID conv of x padded with zeros."""
    if padding != "EXPLICIT":
        return x, padding
    return tf.pad(x, _explicit_amounts(explicit_paddings)), "VALID"


def float_conv2d(x, w, strides, padding, explicit_paddings, dilations):
    """Stock NHWC convolution of float tensors, with any padding and dilation.

    EXPLICIT padding is done with tf.pad (zeros) then VALID; dilations go
    through tf.nn.convolution, whose gradient works on CPU.
    """
    x, padding = _explicit_to_valid(x, padding, explicit_paddings)
    return tf.nn.convolution(x, w, strides=strides[1:3], padding=padding, dilations=dilations[1:3])


def _masked(grad, name, t, clip, beta):
    mask = estimator_grad(name, t, clip, beta)
    return tf.cast(tf.cast(grad, mask.dtype) * mask, grad.dtype)


def mask_input_grad(dx, x, spec):
    """dX times e'(x) when the input is binary."""
    if not spec.activation_estimator:
        return dx
    return _masked(dx, spec.activation_estimator, x, spec.activation_clip, spec.beta)


def mask_weight_grad(dw_hat, w, a, spec):
    """dW from the gradient of W_hat: times alpha e'(W), or as is (weights=False)."""
    if not spec.weights:
        return dw_hat
    return _masked(dw_hat * a, spec.ste, w, spec.clip, spec.beta)


def weight_hat(w, a, spec):
    """W_hat = alpha sign(W), or W itself with weights=False."""
    return scaled_sign(w, a) if spec.weights else float_kernel(w)


def float_kernel(w):
    """W as a new tensor that does not lead back to its marked variable, so
    the stock op it feeds runs float instead of coming back here
    (tf.raw_ops are not interposed)."""
    return tf.raw_ops.Identity(input=w)


def same_padding(size, k, stride, dilation):
    """(before, after) SAME padding of one spatial dim, as TF computes it; for
    ints or scalar tensors."""
    effective = (k - 1) * dilation + 1
    if isinstance(size, int):
        out = -(-size // stride)
        total = max((out - 1) * stride + effective - size, 0)
    else:
        out = (size + stride - 1) // stride
        total = tf.maximum((out - 1) * stride + effective - size, 0)
    return total // 2, total - total // 2


def pad_input(x, w_shape, strides, padding, explicit_paddings, dilations, pad_value):
    """(x padded with pad_value as the conv's padding says, "VALID", []): the
    input, padding and explicit_paddings of the VALID conv that a conv whose
    padding value is not zero becomes. x is NHWC (Conv1D as H = 1);
    sign(pad_value) = pad_value for 0 and 1."""
    if padding == "VALID":
        return x, "VALID", []
    if padding == "EXPLICIT":
        amounts = _explicit_amounts(explicit_paddings)
    else:
        amounts = [[0, 0]]
        for axis in (1, 2):
            size = x.shape[axis] if x.shape[axis] is not None else tf.shape(x)[axis]
            amounts.append(
                list(
                    same_padding(
                        size, int(w_shape[axis - 1]), int(strides[axis]), int(dilations[axis])
                    )
                )
            )
        amounts.append([0, 0])
    return tf.pad(x, amounts, constant_values=tf.cast(pad_value, x.dtype)), "VALID", []


def binary_conv2d_backward(
    x,
    w,
    dy,
    spec,
    strides,
    padding,
    explicit_paddings,
    dilations,
    need_dx=True,
    need_dw=True,
    w_parts=None,
    input_mask=None,
):
    """(dX, dW) of the binary conv from stock conv gradients; None where not needed.

    dX = conv2d_backprop_input(alpha sign W, dY) [* e'(x)] and
    dW = conv2d_backprop_filter(x_hat, dY) * alpha * e'(W). Undilated convs call
    the stock backprop ops directly; TF's CPU backprops reject dilations, so a
    dilated conv differentiates tf.nn.convolution (SpaceToBatchND) instead.
    ``w_parts``: (alpha sign W or None, alpha) from the forward.
    ``input_mask``: e'(x) given (x then is x_hat itself, from packed bits).
    """
    dilated = any(d != 1 for d in dilations)
    w_hat, a = w_parts if w_parts is not None else (None, alpha(w, spec.scale))
    if w_hat is None and (need_dx or dilated):
        w_hat = weight_hat(w, a, spec)
    x_hat = binarize_input(x, spec) if need_dw or dilated else None
    if dilated:
        with tf.GradientTape() as tape:
            tape.watch([x_hat, w_hat])
            y = float_conv2d(x_hat, w_hat, strides, padding, explicit_paddings, dilations)
        dx, dw = tape.gradient(y, [x_hat, w_hat], output_gradients=dy)
    else:
        attrs = dict(
            strides=list(strides),
            padding=padding,
            data_format="NHWC",
            explicit_paddings=list(explicit_paddings or []),
        )
        dx = (
            tf.raw_ops.Conv2DBackpropInput(
                input_sizes=tf.shape(x), filter=w_hat, out_backprop=dy, **attrs
            )
            if need_dx
            else None
        )
        dw = (
            tf.raw_ops.Conv2DBackpropFilter(
                input=x_hat, filter_sizes=tf.shape(w), out_backprop=dy, **attrs
            )
            if need_dw
            else None
        )
    if dx is not None and need_dx:
        dx = mask_input_grad(dx, x, spec) if input_mask is None else dx * input_mask
    if dw is not None and need_dw:
        dw = mask_weight_grad(dw, w, a, spec)
    return (dx if need_dx else None), (dw if need_dw else None)


def _forward(x_hat, w_sign, a, spec, strides, padding, explicit_paddings, dilations):
    """conv(x_hat, alpha sign W), computed as conv(x_hat, sign W) * alpha: with
    binary inputs the conv sums exact integers, as the bitpacked kernels do."""
    y = float_conv2d(x_hat, w_sign, strides, padding, explicit_paddings, dilations)
    return y * a if spec.scale else y


def binary_conv2d(
    x,
    w,
    spec,
    strides=(1, 1, 1, 1),
    padding="SAME",
    explicit_paddings=(),
    dilations=(1, 1, 1, 1),
    on_backward=None,
):
    """Binary conv forward with the reference backward as its gradient.

    ``on_backward`` (optional) is called whenever the backward is built.
    """
    strides, dilations = list(strides), list(dilations)
    if spec.pad_value and padding != "VALID":
        x, padding, explicit_paddings = pad_input(
            x, w.shape, strides, padding, explicit_paddings, dilations, spec.pad_value
        )

    @tf.custom_gradient
    def conv(x, w):
        # alpha once, for the forward and the backward; alpha sign W too when
        # the forward uses it (float input), else the backward makes it
        a = alpha(w, spec.scale)
        if spec.activation_estimator and spec.weights:
            w_parts = (None, a)
            y = _forward(sign(x), sign(w), a, spec, strides, padding, explicit_paddings, dilations)
        else:
            w_parts = (weight_hat(w, a, spec), a)
            y = float_conv2d(
                binarize_input(x, spec), w_parts[0], strides, padding, explicit_paddings, dilations
            )

        def grad(dy):
            if on_backward is not None:
                on_backward()
            return binary_conv2d_backward(
                x, w, dy, spec, strides, padding, explicit_paddings, dilations, w_parts=w_parts
            )

        return y, grad

    return conv(x, w)


def _custom_binary(forward, backward, x, w, on_backward=None):
    """tf.custom_gradient of ``forward(x, w)`` with ``backward(x, w, dy)``."""

    @tf.custom_gradient
    def op(x, w):
        def grad(dy):
            if on_backward is not None:
                on_backward()
            return backward(x, w, dy)

        return forward(x, w), grad

    return op(x, w)


def binary_matmul(x, w, spec, on_backward=None):
    """Binary Dense: x_hat @ (alpha sign W), alpha per output column.

    dX = (dY @ (alpha sign W)^T) [* e'(x)], dW = (x_hat^T dY) * alpha * e'(W),
    for x of any rank >= 2 (leading axes are batch axes) and a 2-D W.
    """

    def forward(x, w):
        y = tf.linalg.matmul(binarize_input(x, spec), sign(w) if spec.weights else float_kernel(w))
        return y * alpha_dense(w, spec.scale) if spec.scale else y

    def backward(x, w, dy):
        a = alpha_dense(w, spec.scale)
        dx = tf.linalg.matmul(dy, weight_hat(w, a, spec), transpose_b=True)
        x_hat = tf.reshape(binarize_input(x, spec), [-1, tf.shape(x)[-1]])
        dw = tf.linalg.matmul(x_hat, tf.reshape(dy, [-1, tf.shape(dy)[-1]]), transpose_a=True)
        return mask_input_grad(dx, x, spec), mask_weight_grad(dw, w, a, spec)

    return _custom_binary(forward, backward, x, w, on_backward)


def alpha_dense(w, scale):
    if scale == "mean_abs":
        return tf.stop_gradient(tf.reduce_mean(tf.abs(w), axis=0))
    return tf.ones([tf.shape(w)[-1]], w.dtype)


def alpha_depthwise(w, scale):
    """alpha per depthwise output channel (c, m), flattened as the op orders them."""
    if scale == "mean_abs":
        return tf.stop_gradient(tf.reshape(tf.reduce_mean(tf.abs(w), axis=[0, 1]), [-1]))
    return tf.ones([tf.shape(w)[2] * tf.shape(w)[3]], w.dtype)


def _depthwise_float(x, w, strides, padding, explicit_paddings, dilations):
    """Stock NHWC depthwise conv of float tensors, with any padding and dilation.

    TF's CPU depthwise backprops ignore the dilations attr (they compute the
    undilated gradient), so a dilated one goes through tf.nn.depthwise_conv2d
    (SpaceToBatchND, which zero-pads the already binarized x_hat).
    """
    x, padding = _explicit_to_valid(x, padding, explicit_paddings)
    if any(d != 1 for d in dilations):
        return tf.nn.depthwise_conv2d(x, w, strides, padding, dilations=dilations[1:3])
    return tf.raw_ops.DepthwiseConv2dNative(
        input=x, filter=w, strides=strides, padding=padding, data_format="NHWC"
    )


def binary_depthwise_conv2d(
    x, w, spec, strides, padding, explicit_paddings=(), dilations=(1, 1, 1, 1), on_backward=None
):
    """Binary DepthwiseConv2dNative (NHWC): depthwise(x_hat, sign W) * alpha,
    alpha per output channel (c, m); same estimator masks as the conv."""
    strides, dilations = list(strides), list(dilations)
    explicit_paddings = list(explicit_paddings or [])
    if spec.pad_value and padding != "VALID":
        x, padding, explicit_paddings = pad_input(
            x, w.shape, strides, padding, explicit_paddings, dilations, spec.pad_value
        )
    dilated = any(d != 1 for d in dilations)
    conv = (strides, padding, explicit_paddings, dilations)

    def forward(x, w):
        w_hat = sign(w) if spec.weights else float_kernel(w)
        y = _depthwise_float(binarize_input(x, spec), w_hat, *conv)
        return y * alpha_depthwise(w, spec.scale) if spec.scale else y

    def backward(x, w, dy):
        a = alpha_depthwise(w, spec.scale)
        dy_scaled = dy * a
        x_hat, w_sign = binarize_input(x, spec), sign(w) if spec.weights else float_kernel(w)
        if dilated:
            with tf.GradientTape() as tape:
                tape.watch([x_hat, w_sign])
                y = _depthwise_float(x_hat, w_sign, *conv)
            dx, dw = tape.gradient(y, [x_hat, w_sign], output_gradients=dy_scaled)
        else:
            attrs = dict(
                strides=strides,
                padding=padding,
                data_format="NHWC",
                explicit_paddings=explicit_paddings,
            )
            dx = tf.raw_ops.DepthwiseConv2dNativeBackpropInput(
                input_sizes=tf.shape(x), filter=w_sign, out_backprop=dy_scaled, **attrs
            )
            dw = tf.raw_ops.DepthwiseConv2dNativeBackpropFilter(
                input=x_hat, filter_sizes=tf.shape(w), out_backprop=dy_scaled, **attrs
            )
        dx = mask_input_grad(dx, x, spec)
        return dx, (_masked(dw, spec.ste, w, spec.clip, spec.beta) if spec.weights else dw)

    return _custom_binary(forward, backward, x, w, on_backward)
