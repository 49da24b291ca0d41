"""Model-level benchmark: Bi-Real-Net-18 and QuickNet-small trained with Keras
``fit`` and run with ``predict``, tapehook against the same architecture as a
float network, as a larq-style composite in Keras 3, and (when a side
environment has it) larq 0.14 itself.

    python bench/models.py --quick    # 112 px, each model's own estimator, 1 round (~8-15 min)
    python bench/models.py            # 112 and 224 px, both estimators, 3 rounds (~2-3 h on 2 cores)
    python bench/models.py --profile-only   # only the per-op-type breakdown
    python bench/models.py --models birealnet18 --sizes 112 --batches 32 --rounds 2

Implementations of one architecture (the binary 3x3 convs, and for the
"-fused" ones the batch-norm and max-pool classes and the optimizer, are all
that differ;
tests/test_bench_models.py checks the parameter counts agree):

- ``float``: plain Keras 3 Conv2D;
- ``larq-style``: Keras 3 Conv2D whose convolution is stock ``tf.nn.conv2d``
  on sign(x) and (alpha *) sign(W), each sign a ``tf.custom_gradient`` with
  larq's pseudo-gradient, padding with +1 where the recipe pads with 1;
- ``tapehook``: the float model's convs, kernels clipped, ``tapehook.binarize``d
  with ``fast_layers=False`` (Keras's own batch norm, pool, add and Adam);
- ``tapehook-default``: the same binarized as a user does it, nothing else said
  (binarize's fast layers swap those four for tapehook's);
- ``tapehook-larq``: larq code run through the drop-in: the larq configuration
  below written with ``tapehook.larq`` on Keras 3 (``lq.layers.QuantConv2D``,
  its quantizers and WeightClip, Keras's own batch norm, pool, add and Adam);
- ``tapehook-zoo``: ``tapehook.zoo.BiRealNet`` / ``QuickNetSmall`` (larq-zoo's
  architectures as the zoo builds them, random weights), each model's own
  estimator only;
- ``float-fused`` / ``tapehook-fused``: ``float`` / ``tapehook`` with every batch
  norm ``tapehook.layers.BatchNormalization`` and ``tapehook.optimizers.Adam``
  (TF's fused kernels, as tf-keras trains with) instead of Keras 3's, and
  every max pool ``tapehook.layers.MaxPooling2D`` (its backward reads the
  window taps it kept, not the pool's float input and output), every
  residual add ``tapehook.layers.Add`` (in ``predict``, the binary conv
  before it adds);
- ``tapehook-recompute``: ``tapehook-fused`` with ``BatchNormalization(
  recompute=True)`` and ``MaxPooling2D(fuse_relu=True)``: the step keeps no
  conv's float output for its batch norm (it rebuilds them in the backward)
  and a pool that is a ReLU's only reader does that ReLU's backward;
  ``tapehook-recompute-f16`` / ``tapehook-recompute-x``: the same with
  ``TAPEHOOK_PACK_INPUTS=float16`` / ``float32`` (approx_sign inputs kept as
  binary16 e'(x) / as x instead of the default 16-bit fixed-point e'(x));
  ``tapehook-recompute-early``: recompute only on the batch norms of fewer
  than 256 channels (stem and first two stages); the later, smaller outputs
  are kept and not rebuilt; ``tapehook-recompute-early-bf16x2``: the same
  with ``TAPEHOOK_BACKPROP_DY=bf16x2`` (the AMX backprops' dy in two bf16
  parts, 16 significant bits, instead of three exact ones);
- ``larq``: ``lq.layers.QuantConv2D`` on tf-keras (TF_USE_LEGACY_KERAS=1), run
  with the python of a side environment (``--larq-python``; skipped when absent);
- ``pytorch`` / ``pytorch-channels-last`` / ``pytorch-compile``: the same
  architectures in PyTorch as BNN papers' code writes them (bench/torch_models.py:
  autograd signs, ``F.conv2d``, ``nn.BatchNorm2d``, ``torch.optim.Adam``), NCHW,
  channels_last, and NCHW under ``torch.compile``; run with the python of an
  environment with torch (``--torch-python`` or $TORCH_PYTHON; skipped when
  absent), as many intra-op threads as TF's default. A training step is
  forward, cross entropy, backward, Adam step and the latent-weight clip;
  predict is the forward under eval() and no_grad. No tensor-peak or profile
  runs (those read TF's allocator and profiler).

Every configuration (model, implementation, estimator, size, batch) runs in
its own subprocess; a round runs each group's configurations one after the
other, in reversed order every other round, so a noisy neighbour hits all
alike. Ratios are taken between configurations of the same round. Reported
per configuration: img/s of ``fit`` (median step time of the timed steps;
steps_per_execution 1, Keras's default) and of ``predict``, best and median
over rounds; the whole training step's peak memory per sample, as
bench/memory.py measures it: the process's peak resident memory (ru_maxrss)
after the fit steps, at batch 32 minus at batch 1, over 31. A profile of one
tapehook-fused (``--profile-impl``) Bi-Real-Net-18 training step (batch 32,
112 px), and of its predict, gives the time per op type. Results: bench/results/models.json and models.png; docs/models.md.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
LARQ_PYTHONS = ("/tmp/larqbench/bin/python", "/tmp/larqenv/bin/python")
TORCH_PYTHONS = ("/tmp/torchenv/bin/python",)
CLASSES = 1000

# Each model's binary-conv recipe, as larq-zoo trains it. ``estimators``: the
# input estimators measured, the model's own first. Kernels: ste_sign with
# ``clip`` (Bi-Real: magnitude_aware_sign = mean|W| per output channel, a
# constant in the backward, times ste_sign), WeightClip(clip) on the latent W.
RECIPES = {
    "birealnet18": dict(
        estimators=("approx_sign", "ste_sign"), clip=1.0, scale="mean_abs", pad_value=0.0
    ),
    "quicknet_small": dict(
        estimators=("ste_sign", "approx_sign"), clip=1.25, scale=None, pad_value=1.0
    ),
}
IMPLS = (
    "float",
    "float-fused",
    "larq-style",
    "tapehook",
    "tapehook-default",
    "tapehook-larq",
    "tapehook-zoo",
    "tapehook-fused",
    "tapehook-recompute",
    "tapehook-recompute-f16",
    "tapehook-recompute-x",
    "tapehook-recompute-early",
    "tapehook-recompute-early-bf16x2",
    "larq",
    "pytorch",
    "pytorch-channels-last",
    "pytorch-compile",
)
# "-fused": the model's batch norms tapehook.layers.BatchNormalization, its max
# pools tapehook.layers.MaxPooling2D (window taps kept for the backward) and its
# optimizer tapehook.optimizers.Adam (TF's fused ops, as tf-keras and so larq
# 0.14 train with) instead of Keras 3's. "tapehook-recompute": tapehook-fused
# with BatchNormalization(recompute=True) (the convs' outputs rebuilt in the
# backward instead of kept) and MaxPooling2D(fuse_relu=True) (a ReLU's
# backward done by the pool that is its only reader).
# "tapehook-recompute-f16" / "-x": tapehook-recompute with TAPEHOOK_PACK_INPUTS=
# float16 / float32 (approx_sign inputs kept as sign bits + binary16 e'(x) / as
# float x, instead of sign bits + fixed-point e'(x); ste_sign as before).
PACK_SETTINGS = {"tapehook-recompute-f16": "float16", "tapehook-recompute-x": "float32"}
# "tapehook-recompute-early": recompute=True only on the batch norms of fewer
# than 256 channels (the stem and the first two stages of both models), where
# a kept output is largest per unit of rebuild work (a 3x3 conv's rebuild
# costs 9 x in_channels multiply-adds per output element, the same per layer
# across stages, while its output shrinks 2x per stage); the later stages
# keep their conv outputs and skip the rebuild.
RECOMPUTE_BELOW_CHANNELS = {
    "tapehook-recompute-early": 256,
    "tapehook-recompute-early-bf16x2": 256,
}
# "-bf16x2": the AMX backprops split dy into two bf16 parts instead of three
# (TAPEHOOK_BACKPROP_DY=bf16x2: dy to 16 significant bits; opt-in).
BACKPROP_DY_SETTINGS = {"tapehook-recompute-early-bf16x2": "bf16x2"}
RECOMPUTE_IMPLS = ("tapehook-recompute", *PACK_SETTINGS, *RECOMPUTE_BELOW_CHANNELS)
FUSED_IMPLS = ("float-fused", "tapehook-fused", *RECOMPUTE_IMPLS)
# "tapehook-default": the float model's stock Keras layers binarized with
# nothing else said, as a user gets it: binarize's fast layers decide the batch
# norms, pools, adds and Adam (tapehook.models). "tapehook": the same with
# fast_layers=False (Keras's layers kept).
# "tapehook-larq" / "tapehook-zoo": larq code through tapehook.larq, and
# tapehook.zoo's models: tapehook is in charge of both (fast layers).
DEFAULT_IMPLS = ("tapehook-default", "tapehook-larq", "tapehook-zoo")
TAPEHOOK_IMPLS = ("tapehook", *DEFAULT_IMPLS, "tapehook-fused", *RECOMPUTE_IMPLS)
# The binarize'd ones (the others mark their binary convs themselves).
BINARIZED_IMPLS = ("tapehook", "tapehook-default", "tapehook-fused", *RECOMPUTE_IMPLS)
FLOAT_IMPLS = ("float", "float-fused")
# Run by bench/torch_models.py in a python with torch (no TF there).
TORCH_IMPLS = ("pytorch", "pytorch-channels-last", "pytorch-compile")
_PACK_INPUTS = os.environ.get("TAPEHOOK_PACK_INPUTS", "1")  # as the run was started
_BACKPROP_DY = os.environ.get("TAPEHOOK_BACKPROP_DY", "exact")


# ---------------------------------------------------------------------------
# Architectures. ``K`` is the Keras module (Keras 3, or tf-keras for larq);
# ``binary_conv(name, filters, kernel, strides, activation)`` makes the layer
# of a binary conv. Names: binary convs are "binary<i>", nothing else starts
# with "binary" (tapehook.binarize(include="binary*")).


def birealnet18(
    K, binary_conv, size, classes=CLASSES, filters=64, batch_norm=None, max_pool=None, add=None
):
    """Bi-Real-Net-18 (Liu et al. 2018, larq-zoo): float 7x7 stem, 16 binary
    3x3 convs each with BN and a float shortcut (on downsampling: 2x2 average
    pool, 1x1 conv, BN), global average pool, float classifier. ``batch_norm``
    / ``max_pool`` / ``add``: the BN / max-pool / add layer classes (default
    Keras's)."""
    L = K.layers
    BN = batch_norm or L.BatchNormalization
    MaxPool = max_pool or L.MaxPooling2D
    Add = add or L.Add
    inputs = K.Input((size, size, 3))
    x = L.Conv2D(
        filters,
        7,
        strides=2,
        padding="same",
        use_bias=False,
        kernel_initializer="glorot_normal",
        name="stem",
    )(inputs)
    x = BN(momentum=0.8)(x)
    x = MaxPool(3, strides=2, padding="same")(x)
    widths = [filters] * 4 + [2 * filters] * 4 + [4 * filters] * 4 + [8 * filters] * 4
    for i, width in enumerate(widths):
        shortcut = x
        strides = 1 if width == x.shape[-1] else 2
        if strides == 2:
            shortcut = L.AveragePooling2D(2, strides=2, padding="same")(shortcut)
            shortcut = L.Conv2D(
                width, 1, use_bias=False, kernel_initializer="glorot_normal", name=f"shortcut{i}"
            )(shortcut)
            shortcut = BN(momentum=0.8)(shortcut)
        y = binary_conv(f"binary{i}", width, 3, strides, None)(x)
        y = BN(momentum=0.8)(y)
        x = Add()([y, shortcut])
    x = L.GlobalAveragePooling2D()(x)
    outputs = L.Dense(classes, activation="softmax", name="head")(x)
    return K.Model(inputs, outputs, name="birealnet18")


def _blurpool(shape, dtype=None):
    """QuickNet's fixed 3x3 binomial blur, one per channel (depthwise)."""
    import numpy as np
    import tensorflow as tf

    k = np.outer([1.0, 2.0, 1.0], [1.0, 2.0, 1.0])
    k = np.broadcast_to((k / k.sum())[:, :, None, None], shape)
    return tf.constant(k, dtype=dtype or "float32")


def quicknet_small(
    K,
    binary_conv,
    size,
    classes=CLASSES,
    filters=(32, 64, 256, 512),
    blocks=(4, 4, 4, 4),
    batch_norm=None,
    max_pool=None,
    add=None,
):
    """QuickNet-small (larq-zoo, v1.0): stem (3x3/2 conv, BN, ReLU, 3x3/2
    depthwise, BN, 1x1 conv, BN); per section, a float transition where the
    width changes (ReLU, 2x2 max pool stride 1, fixed blur-pool depthwise
    3x3/2, 1x1 conv, BN), then residual blocks x + BN(ReLU(binary 3x3 conv
    padded with +1 (x))); ReLU, global average pool, float classifier.
    ``batch_norm`` / ``max_pool`` / ``add``: the BN / max-pool / add layer
    classes (default Keras's)."""
    L = K.layers
    BN = batch_norm or L.BatchNormalization
    MaxPool = max_pool or L.MaxPooling2D
    Add = add or L.Add
    inputs = K.Input((size, size, 3))
    x = L.Conv2D(
        filters[0] // 4,
        3,
        strides=2,
        padding="same",
        use_bias=False,
        kernel_initializer="he_normal",
        name="stem_conv",
    )(inputs)
    x = BN()(x)
    x = L.ReLU()(x)
    x = L.DepthwiseConv2D(3, strides=2, padding="same", use_bias=False, name="stem_depthwise")(x)
    x = BN(scale=False, center=False)(x)
    x = L.Conv2D(
        filters[0], 1, use_bias=False, kernel_initializer="he_normal", name="stem_pointwise"
    )(x)
    x = BN()(x)
    i = 0
    for section, (count, width) in enumerate(zip(blocks, filters)):
        for layer in range(count):
            if width != x.shape[-1]:
                strides = 1 if section == 0 or layer != 0 else 2
                x = L.ReLU()(x)
                x = MaxPool(pool_size=strides, strides=1)(x)
                x = L.DepthwiseConv2D(
                    3,
                    strides=strides,
                    padding="same",
                    use_bias=False,
                    depthwise_initializer=_blurpool,
                    trainable=False,
                    name=f"blurpool{i}",
                )(x)
                x = L.Conv2D(
                    width,
                    1,
                    use_bias=False,
                    kernel_initializer="glorot_normal",
                    name=f"transition{i}",
                )(x)
                x = BN(momentum=0.9, epsilon=1e-5)(x)
            y = binary_conv(f"binary{i}", int(x.shape[-1]), 3, 1, "relu")(x)
            y = BN(momentum=0.9, epsilon=1e-5)(y)
            x = Add()([x, y])
            i += 1
    x = L.ReLU()(x)
    x = L.GlobalAveragePooling2D()(x)
    x = L.Dense(classes, kernel_initializer="glorot_normal", name="head")(x)
    outputs = L.Activation("softmax")(x)
    return K.Model(inputs, outputs, name="quicknet_small")


ARCHITECTURES = {"birealnet18": birealnet18, "quicknet_small": quicknet_small}


# ---------------------------------------------------------------------------
# The binary conv layer of each implementation.


def clip_constraint(K, clip):
    """larq's WeightClip: latent weights kept in [-clip, clip]."""

    class Clip(K.constraints.Constraint):
        def __call__(self, w):
            import tensorflow as tf

            return tf.clip_by_value(w, -clip, clip)

        def get_config(self):
            return {}

    return Clip()


def _same_pads(size, kernel, stride):
    """TF's SAME padding (before, after) along one dimension."""
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def larq_style_ops():
    """larq's quantizers as tf.custom_gradient functions (larq's math)."""
    import tensorflow as tf

    def sign(t):  # larq: sign with sign(0) = +1
        return tf.where(t >= 0, tf.ones_like(t), -tf.ones_like(t))

    def ste_sign(clip):
        @tf.custom_gradient
        def f(t):
            return sign(t), lambda dy: dy * tf.cast(tf.abs(t) <= clip, dy.dtype)

        return f

    @tf.custom_gradient
    def approx_sign(t):
        def grad(dy):
            a = tf.abs(t)
            return dy * tf.where(a <= 1, 2 - 2 * a, tf.zeros_like(a))

        return sign(t), grad

    return {"ste_sign": ste_sign, "approx_sign": approx_sign}


def binary_conv_factory(K, impl, model, estimator):
    """``binary_conv(name, filters, kernel, strides, activation)`` for ``impl``."""
    recipe = RECIPES[model]
    clip, scale, pad_value = recipe["clip"], recipe["scale"], recipe["pad_value"]

    def common(name, filters, kernel, strides, activation):
        return dict(
            filters=filters,
            kernel_size=kernel,
            strides=strides,
            padding="same",
            activation=activation,
            use_bias=False,
            kernel_initializer="glorot_normal",
            name=name,
        )

    if impl in FLOAT_IMPLS:
        return lambda *a: K.layers.Conv2D(**common(*a))
    if impl == "larq" or impl == "tapehook-larq":
        if impl == "larq":
            import larq as lq
        else:
            import tapehook.larq as lq

        input_q = (
            lq.quantizers.SteSign(clip_value=clip)
            if estimator == "ste_sign"
            else lq.quantizers.ApproxSign()
        )
        kernel_q = (
            lq.quantizers.MagnitudeAwareSign(clip_value=clip)
            if scale
            else lq.quantizers.SteSign(clip_value=clip)
        )
        return lambda *a: lq.layers.QuantConv2D(
            **common(*a),
            input_quantizer=input_q,
            kernel_quantizer=kernel_q,
            kernel_constraint=lq.constraints.WeightClip(clip),
            pad_values=pad_value,
        )
    if impl in BINARIZED_IMPLS:  # binarized after the model is built
        import tapehook

        # tapehook's WeightClip, as a user writes it (tapehook.larq's
        # WeightClip is the same class): tapehook.optimizers.Adam (the -fused
        # and -recompute implementations) updates and clips such a kernel
        # in one pass; Keras's Adam applies it as the constraint it is.
        return lambda *a: K.layers.Conv2D(**common(*a), kernel_constraint=tapehook.WeightClip(clip))
    if impl != "larq-style":
        raise SystemExit(f"unknown implementation {impl!r}; use one of {IMPLS}")
    import tensorflow as tf

    ops = larq_style_ops()
    input_q = ops["ste_sign"](clip) if estimator == "ste_sign" else ops["approx_sign"]
    kernel_sign = ops["ste_sign"](clip)

    class LarqStyleConv2D(K.layers.Conv2D):
        def convolution_op(self, inputs, kernel):
            w = tf.convert_to_tensor(kernel)
            w_hat = kernel_sign(w)
            if scale:  # magnitude_aware_sign: alpha is a constant in the backward
                w_hat = w_hat * tf.stop_gradient(tf.reduce_mean(tf.abs(w), [0, 1, 2]))
            x_hat = input_q(inputs)
            padding = "SAME"
            if pad_value:  # larq pads the binarized input with +1
                k, s = self.kernel_size, self.strides
                pads = [
                    (0, 0),
                    _same_pads(x_hat.shape[1], k[0], s[0]),
                    _same_pads(x_hat.shape[2], k[1], s[1]),
                    (0, 0),
                ]
                x_hat = tf.pad(x_hat, pads, constant_values=pad_value)
                padding = "VALID"
            return tf.nn.conv2d(x_hat, w_hat, list(self.strides), padding)

    return lambda *a: LarqStyleConv2D(**common(*a), kernel_constraint=clip_constraint(K, clip))


def tapehook_spec(model, estimator):
    """tapehook.binarize keyword arguments for a model's recipe."""
    recipe = RECIPES[model]
    return dict(
        activations=True if estimator == "ste_sign" else estimator,
        ste="ste_sign",
        clip=recipe["clip"],
        scale=recipe["scale"],
        pad_value=recipe["pad_value"],
    )


ZOO_MODELS = {"birealnet18": "BiRealNet", "quicknet_small": "QuickNetSmall"}


def zoo_model(model, estimator, size, classes=CLASSES, **widths):
    """tapehook.zoo's model of an architecture (random weights); the zoo fixes
    the widths and the input estimator (the model's own)."""
    import tapehook.zoo

    own = RECIPES[model]["estimators"][0]
    if widths or estimator != own:
        raise SystemExit(
            f"tapehook-zoo builds {ZOO_MODELS[model]} as larq-zoo does: its own "
            f"estimator ({own}) and widths only, not {estimator!r} / {widths}"
        )
    return getattr(tapehook.zoo, ZOO_MODELS[model])(
        input_shape=(size, size, 3), num_classes=classes
    )


def build(K, model, impl, estimator, size, **kwargs):
    """The model of one configuration (tapehook's binarized)."""
    if impl in FUSED_IMPLS:
        import tapehook

        recompute = impl in RECOMPUTE_IMPLS
        below = RECOMPUTE_BELOW_CHANNELS.get(impl)

        class BatchNormalization(tapehook.layers.BatchNormalization):
            def build(self, input_shape):
                if below is not None:
                    self.recompute = input_shape[-1] < below
                super().build(input_shape)

        kwargs.setdefault("batch_norm", lambda **kw: BatchNormalization(recompute=recompute, **kw))
        # tapehook's max pool (its backward reads one-byte taps: 2-3x faster
        # than stock MaxPoolGrad on Eigen); the memory configuration's also
        # does the backward of a ReLU it is the only reader of
        kwargs.setdefault(
            "max_pool",
            lambda *a, **kw: tapehook.layers.MaxPooling2D(*a, fuse_relu=recompute, **kw),
        )
        # tapehook's add: in inference, done by the binary conv before it
        # (its batch norm folded in too)
        kwargs.setdefault("add", tapehook.layers.Add)
    if impl == "tapehook-zoo":
        net = zoo_model(model, estimator, size, **kwargs)
    else:
        net = ARCHITECTURES[model](
            K, binary_conv_factory(K, impl, model, estimator), size, **kwargs
        )
    if impl in TAPEHOOK_IMPLS:
        # Each binary conv's forward reads it (traced after this): set per
        # implementation, so configurations built in one process differ only so.
        os.environ["TAPEHOOK_PACK_INPUTS"] = PACK_SETTINGS.get(impl, _PACK_INPUTS)
        os.environ["TAPEHOOK_BACKPROP_DY"] = BACKPROP_DY_SETTINGS.get(impl, _BACKPROP_DY)
    if impl in BINARIZED_IMPLS:
        import tapehook

        # fast_layers=False: each configuration's layers are the ones it names
        # (the plain "tapehook" one keeps Keras's batch norm, pool, add and Adam);
        # "tapehook-default" leaves the choice to binarize, as users do.
        fast = {} if impl == "tapehook-default" else {"fast_layers": False}
        tapehook.binarize(net, include="binary*", **fast, **tapehook_spec(model, estimator))
    return net


# ---------------------------------------------------------------------------
# Child: one configuration, in its own process.

LAYER_KINDS = (  # layer-name prefix in an op's name -> where its time goes
    ("binary", "binary conv layers (sign, masks, convs)"),
    ("shortcut", "float shortcuts"),
    ("transition", "float transitions"),
    ("blurpool", "float transitions"),
    ("stem", "stem"),
    ("batch_normalization", "batch norm"),
    ("add", "residual adds"),
    ("re_lu", "relu"),
    ("max_pooling", "pooling"),
    ("average_pooling", "pooling"),
    ("global_average", "pooling"),
    ("head", "head"),
    ("activation", "head"),
    ("adam", "optimizer"),
    ("clip", "weight clip"),
)


def _layer_kind(op_name):
    parts = [p.lower() for p in op_name.split("/")]
    for part in parts[1:]:
        for prefix, kind in LAYER_KINDS:
            if part.startswith(prefix):
                return kind
    return "optimizer" if any("assign" in p or "apply" in p for p in parts) else "other"


def op_self_times(logdir):
    """(self_ps, count): self time in picoseconds (an op's duration less the
    ops nested in it) and number of runs per (op type, op name), over the
    host threads of a profile (the *.xplane.pb that tf.profiler.experimental
    writes)."""
    import collections

    space = load_xspace(logdir)
    self_ps, count = collections.Counter(), collections.Counter()
    for plane in space.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        names = {k: m.name for k, m in plane.event_metadata.items()}
        for line in plane.lines:
            # A TF op's event is named "op_name:OpType"; the executor's, the
            # runtime's and tf.data's own events have "::" or end in Dataset.
            ops = []
            for e in line.events:
                name = names.get(e.metadata_id, "")
                op_name, _, kind = name.rpartition(":")
                if (
                    op_name
                    and "::" not in name
                    and kind.lstrip("_")[:1].isalpha()
                    and " " not in kind
                    and not kind.endswith("Dataset")
                ):
                    ops.append((e.offset_ps, e.duration_ps, (kind, op_name)))
            ops.sort(key=lambda o: (o[0], -o[1]))
            stack = []
            for start, dur, op in ops:
                while stack and start >= stack[-1][0] + stack[-1][1]:
                    stack.pop()
                if stack:
                    self_ps[stack[-1][2]] -= dur
                self_ps[op] += dur
                count[op] += 1
                stack.append((start, dur, op))
    return self_ps, count


def op_type_breakdown(logdir, top=25):
    """Self time per TF op type (and per layer kind) on the host threads of a
    profile (op_self_times)."""
    import collections

    per_op, per_op_count = op_self_times(logdir)
    self_ps, count, by_kind = collections.Counter(), collections.Counter(), collections.Counter()
    for (kind, op_name), ps in per_op.items():
        self_ps[kind] += ps
        count[kind] += per_op_count[(kind, op_name)]
        by_kind[_layer_kind(op_name)] += ps
    total = sum(self_ps.values())
    rows = [
        {
            "op_type": k,
            "self_ms": v / 1e9,
            "share": v / total if total else 0.0,
            "count": count[k],
            "tapehook": k.startswith("Tapehook"),
        }
        for k, v in self_ps.most_common()
    ]
    kinds = [
        {"layers": k, "self_ms": v / 1e9, "share": v / total if total else 0.0}
        for k, v in by_kind.most_common()
    ]
    return {
        "total_op_self_ms": total / 1e9,
        "top": rows[:top],
        "all_types": len(rows),
        "by_layer_kind": kinds,
    }


def compiled_model(K, cfg):
    """(model, x, y): the configuration's model compiled as every run trains
    it (Adam 1e-3, tapehook's for the -fused ones; sparse cross-entropy) and
    its synthetic batch, seed 0."""
    import numpy as np

    impl, size, batch = cfg["impl"], cfg["size"], cfg["batch"]
    K.utils.set_random_seed(0)
    net = build(K, cfg["model"], impl, cfg["estimator"], size)
    compile_kwargs = {} if impl == "larq" else {"jit_compile": False}
    if impl in FUSED_IMPLS:
        import tapehook

        adam = tapehook.optimizers.Adam
    else:
        adam = K.optimizers.Adam
    net.compile(adam(1e-3), "sparse_categorical_crossentropy", **compile_kwargs)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, size, size, 3), dtype=np.float32)
    y = rng.integers(0, CLASSES, (batch,))
    return net, x, y


def load_xspace(logdir):
    """The newest profile (*.xplane.pb, as tf.profiler.experimental writes
    it) under ``logdir``, parsed."""
    import glob

    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    files = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))
    space = xplane_pb2.XSpace()
    space.ParseFromString(pathlib.Path(files[-1]).read_bytes())
    return space


def child(cfg):
    if cfg["impl"] in TORCH_IMPLS:
        import torch_models  # bench/, this script's directory

        result = torch_models.child(cfg, RECIPES[cfg["model"]], CLASSES)
        return print(json.dumps(result))
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    if cfg.get("tensor_memory"):
        # TF's BFC allocator on the CPU keeps allocation statistics
        # (tf.config.experimental.get_memory_info); the default one does not.
        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    impl = cfg["impl"]
    if impl == "larq":
        os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import resource

    import tensorflow as tf

    if impl == "larq":
        K = tf.keras
    else:
        import keras as K
    if impl in TAPEHOOK_IMPLS + FUSED_IMPLS:
        import tapehook

    batch = cfg["batch"]
    net, x, y = compiled_model(K, cfg)
    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    inputs = tf.data.Dataset.from_tensors(x).repeat()

    if cfg.get("tensor_memory"):
        # Peak bytes of TF tensors during a fit step, past what the model,
        # its optimizer state and the data already hold (after two steps),
        # for each of ``tensor_steps`` steps: the executor's op order, so the
        # peak, changes from step to step (by up to 30 % at batch 32).
        net.fit(data, steps_per_epoch=2, epochs=1, verbose=0)
        peaks = []
        for _ in range(cfg.get("tensor_steps", 1)):
            tf.config.experimental.reset_memory_stats("CPU:0")
            before = tf.config.experimental.get_memory_info("CPU:0")["current"]
            net.fit(data, steps_per_epoch=1, epochs=1, verbose=0)
            peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)
        print(json.dumps({**cfg, "tensor_peak_bytes": max(peaks), "tensor_step_peaks": peaks}))
        return

    class Timer(K.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.ends = [time.perf_counter()]

        def on_train_batch_end(self, step, logs=None):
            self.ends.append(time.perf_counter())

        def on_predict_batch_end(self, step, logs=None):
            self.ends.append(time.perf_counter())

    def step_times(timer, warmup):
        deltas = [b - a for a, b in zip(timer.ends, timer.ends[1:])]
        return deltas[warmup:]

    load_start = os.getloadavg()[0]
    warm, steps = cfg["train_steps"]
    timer = Timer()
    net.fit(data, steps_per_epoch=warm + steps, epochs=1, verbose=0, callbacks=[timer])
    train = step_times(timer, warm)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    counts = tapehook.dispatch_counts() if impl in TAPEHOOK_IMPLS else None
    info = tapehook.kernel_info()["cpu"] if impl in TAPEHOOK_IMPLS else {}

    profile = None
    if cfg.get("profile"):
        count = cfg["profile"]

        def profiled(run):
            """run() under TF's profiler: its op-type breakdown and wall time."""
            logdir = tempfile.mkdtemp(prefix="tapehook_models_profile_")
            tf.profiler.experimental.start(logdir)
            t0 = time.perf_counter()
            run()
            wall = time.perf_counter() - t0
            tf.profiler.experimental.stop()
            return {**op_type_breakdown(logdir), "steps": count, "wall_ms": wall * 1e3}

        profile = profiled(lambda: net.fit(data, steps_per_epoch=count, epochs=1, verbose=0))
        # The same for predict (the inference graph: folded batch norms).
        net.predict(inputs, steps=2, verbose=0)
        profile["predict"] = profiled(lambda: net.predict(inputs, steps=count, verbose=0))

    warm, steps = cfg["predict_steps"]
    timer = Timer()
    net.predict(inputs, steps=warm + steps, verbose=0, callbacks=[timer])
    predict = step_times(timer, warm)
    print(
        json.dumps(
            {
                **cfg,
                "train_step_s": train,
                "predict_step_s": predict,
                "train_img_s": batch / statistics.median(train),
                "predict_img_s": batch / statistics.median(predict),
                "peak_rss_bytes": peak,
                "params": int(net.count_params()),
                "dispatch_counts": counts,
                "amx": info.get("amx"),
                "kernel_library": info.get("path"),
                "load_start": load_start,
                "load_end": os.getloadavg()[0],
                "profile": profile,
            }
        )
    )


# ---------------------------------------------------------------------------
# Parent: rounds of subprocesses, summary, JSON, PNG.


def side_python(arg, candidates):
    """The python of a side environment: ``arg`` ('none': none), else the
    first of ``candidates`` that exists."""
    if arg == "none":
        return None
    for path in [arg] if arg else candidates:
        if path and os.access(path, os.X_OK):
            return path
    return None


def larq_python(arg):
    return side_python(arg, LARQ_PYTHONS)


def torch_python(arg):
    return side_python(arg, (os.environ.get("TORCH_PYTHON"), *TORCH_PYTHONS))


def run_config(cfg, python):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_USE_LEGACY_KERAS", None)
    out = subprocess.run(
        [python, __file__, "--child", json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
        cwd=str(HERE.parent),
    )
    if out.returncode:
        return {**cfg, "error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def config_label(cfg):
    """A configuration in the progress lines: model, size, batch, impl, estimator."""
    return (
        f"{cfg['model']:14s} {cfg['size']}px b{cfg['batch']:<2d} {cfg['impl']:12s} "
        f"{cfg['estimator'] or '-':11s}"
    )


def run_reported(cfg, lq_python, th_python=None):
    """run_config with the python of the configuration's implementation; a
    failure is printed (and returned, with its error)."""
    python = {"larq": lq_python, **dict.fromkeys(TORCH_IMPLS, th_python)}
    r = run_config(cfg, python.get(cfg["impl"], sys.executable))
    if "error" in r:
        what = " tensor memory" if cfg.get("tensor_memory") else ""
        print(f"FAILED{what} {config_label(cfg)}:\n{r['error']}", flush=True)
    return r


def steps_for(batch, quick):
    """(warm-up, timed) steps for fit and predict."""
    if batch == 1:
        return (3, 10 if quick else 20), (5, 20 if quick else 40)
    return (2, 3 if quick else 5), (2, 4 if quick else 6)


def summarize(runs, groups):
    """Per configuration: best / median of rounds; ratios within a round."""

    def key(r):
        return (r["model"], r["size"], r["batch"], r["impl"], r["estimator"])

    by = {}
    for r in runs:
        if "error" not in r:
            by.setdefault(key(r), []).append(r)
    rows = []
    for model, size, batch, configs in groups:
        for impl, est in configs:
            rs = by.get((model, size, batch, impl, est), [])
            if not rs:
                continue
            row = {
                "model": model,
                "size": size,
                "batch": batch,
                "impl": impl,
                "estimator": est,
                "rounds": len(rs),
            }
            for what in ("train", "predict"):
                vals = [r[f"{what}_img_s"] for r in rs]
                row[f"{what}_img_s_best"] = max(vals)
                row[f"{what}_img_s_median"] = statistics.median(vals)
                for other in ("larq-style", "larq", *FLOAT_IMPLS, "tapehook", *TORCH_IMPLS):
                    if other == impl:
                        continue
                    ratios = []
                    for r in rs:
                        o = [
                            q
                            for q in by.get(
                                (model, size, batch, other, None if other in FLOAT_IMPLS else est),
                                [],
                            )
                            if q["round"] == r["round"]
                        ]
                        if o:
                            ratios.append(r[f"{what}_img_s"] / o[0][f"{what}_img_s"])
                    if ratios:
                        row[f"{what}_x_{other}_min"] = min(ratios)
                        row[f"{what}_x_{other}_median"] = statistics.median(ratios)
            # Peak per sample: batch 32 vs batch 1 of the same round.
            if batch != 1:
                per = []
                for r in rs:
                    small = [
                        q
                        for q in by.get((model, size, 1, impl, est), [])
                        if q["round"] == r["round"]
                    ]
                    if small:
                        per.append((r["peak_rss_bytes"] - small[0]["peak_rss_bytes"]) / (batch - 1))
                if per:
                    row["peak_bytes_per_sample_min"] = min(per)
                    row["peak_bytes_per_sample_median"] = statistics.median(per)
            if rs[0].get("dispatch_counts"):
                row["dispatch_counts"] = rs[0]["dispatch_counts"]
            rows.append(row)
    for row in rows:  # memory ratio vs larq-style (same size, estimator)
        if "peak_bytes_per_sample_median" in row and row["impl"] != "larq-style":
            ref = [
                q
                for q in rows
                if q["impl"] == "larq-style"
                and q["model"] == row["model"]
                and q["size"] == row["size"]
                and q["batch"] == row["batch"]
                and q["estimator"] == (row["estimator"] or q["estimator"])
                and "peak_bytes_per_sample_median" in q
            ]
            if ref:
                row["peak_per_sample_x_lower_than_larq_style"] = (
                    ref[0]["peak_bytes_per_sample_median"] / row["peak_bytes_per_sample_median"]
                )
    return rows


def attach_tensor_memory(rows, tensor_runs):
    """Adds to each batch > 1 row the tensor peak per sample of its
    configuration (batch b minus batch 1, over b - 1; median over
    measurements) and, but for larq-style's own, larq-style's over it."""
    by = {}
    for r in tensor_runs:
        if "error" not in r:
            key = (r["model"], r["size"], r["impl"], r["estimator"])
            steps = r.get("tensor_step_peaks", [r["tensor_peak_bytes"]])
            by.setdefault(key, {}).setdefault(r["batch"], []).extend(steps)
    # median: a typical step (median over steps and runs); max: the largest
    # step, what a training run has to provide for.
    per_sample = {"": {}, "_max": {}}
    for key, batches in by.items():
        big = max(batches)
        if big > 1 and 1 in batches:
            for suffix, stat in (("", statistics.median), ("_max", max)):
                per_sample[suffix][key] = (stat(batches[big]) - stat(batches[1])) / (big - 1)
    for row in rows:
        key = (row["model"], row["size"], row["impl"], row["estimator"])
        for suffix, values in per_sample.items():
            if row["batch"] == 1 or key not in values:
                continue
            row[f"tensor_peak{suffix}_bytes_per_sample"] = values[key]
            # float rows: against larq-style with the model's own estimator
            estimator = (
                RECIPES[row["model"]]["estimators"][0]
                if row["impl"] in FLOAT_IMPLS
                else row["estimator"]
            )
            ref = values.get((row["model"], row["size"], "larq-style", estimator))
            if ref and row["impl"] != "larq-style":
                row[f"tensor_peak{suffix}_x_lower_than_larq_style"] = ref / values[key]
    return rows


def print_table(rows, file=sys.stdout):
    head = (
        f"{'model':15s} {'px':>3s} {'b':>2s} {'impl':12s} {'input est':11s} "
        f"{'train img/s best/med':>21s} {'x l-style':>9s} {'x float':>7s} {'x f-fused':>9s} "
        f"{'predict img/s best/med':>23s} {'x l-style':>9s} {'MiB/sample':>10s} {'mem x':>5s} "
        f"{'tensor MiB':>10s} {'x':>5s}"
    )
    print(head, file=file)
    for r in rows:
        mem = r.get("peak_bytes_per_sample_median")
        print(
            f"{r['model']:15s} {r['size']:3d} {r['batch']:2d} {r['impl']:12s} "
            f"{r['estimator'] or '-':11s} "
            f"{r['train_img_s_best']:9.1f}/{r['train_img_s_median']:9.1f}   "
            f"{r.get('train_x_larq-style_median', float('nan')):7.2f}x "
            f"{r.get('train_x_float_median', float('nan')):6.2f}x "
            f"{r.get('train_x_float-fused_median', float('nan')):8.2f}x "
            f"{r['predict_img_s_best']:10.1f}/{r['predict_img_s_median']:10.1f}  "
            f"{r.get('predict_x_larq-style_median', float('nan')):7.2f}x "
            f"{mem / 2**20 if mem else float('nan'):10.2f} "
            f"{r.get('peak_per_sample_x_lower_than_larq_style', float('nan')):5.2f} "
            f"{r.get('tensor_peak_bytes_per_sample', float('nan')) / 2**20:10.2f} "
            f"{r.get('tensor_peak_x_lower_than_larq_style', float('nan')):5.2f}",
            file=file,
        )


def print_profile(profile, file=sys.stdout, what="training steps"):
    print(
        f"{profile['steps']} {what}, {profile['wall_ms']:.0f} ms wall; op self "
        f"time {profile['total_op_self_ms']:.0f} ms over {profile['all_types']} op types",
        file=file,
    )
    print(f"{'op type':48s} {'self ms':>9s} {'share':>6s} {'count':>6s}", file=file)
    for r in profile["top"]:
        mark = " (tapehook)" if r["tapehook"] else ""
        print(
            f"{r['op_type'] + mark:48s} {r['self_ms']:9.1f} {100 * r['share']:5.1f}% "
            f"{r['count']:6d}",
            file=file,
        )
    print(f"\n{'by layer':48s} {'self ms':>9s} {'share':>6s}", file=file)
    for r in profile["by_layer_kind"]:
        print(f"{r['layers']:48s} {r['self_ms']:9.1f} {100 * r['share']:5.1f}%", file=file)
    if "predict" in profile:
        print("\npredict:", file=file)
        print_profile(profile["predict"], file, "predict batches")


def markdown(result):
    """The doc's tables (docs/models.md) from a models.json."""

    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    lines = [
        "| model | px | batch | impl | input estimator | train img/s best / median | "
        "train x larq-style (min / med) | train x larq (med) | train x float (med) | "
        "train x float-fused (med) | "
        "predict img/s best / median | predict x larq-style (min / med) | "
        "peak MiB/sample | memory x lower than larq-style | "
        "tensor peak MiB/sample | tensor peak x lower than larq-style | "
        "largest step's tensor peak MiB/sample | x lower than larq-style's |",
        "|" + "---|" * 18,
    ]
    for r in result["rows"]:
        mem = r.get("peak_bytes_per_sample_median")
        tensor = r.get("tensor_peak_bytes_per_sample")
        largest = r.get("tensor_peak_max_bytes_per_sample")
        lines.append(
            f"| {r['model']} | {r['size']} | {r['batch']} | {r['impl']} | {r['estimator'] or '-'} "
            f"| {f(r['train_img_s_best'])} / {f(r['train_img_s_median'])} "
            f"| {f(r.get('train_x_larq-style_min'), '.2f')} / "
            f"{f(r.get('train_x_larq-style_median'), '.2f')} "
            f"| {f(r.get('train_x_larq_median'), '.2f')} "
            f"| {f(r.get('train_x_float_median'), '.2f')} "
            f"| {f(r.get('train_x_float-fused_median'), '.2f')} "
            f"| {f(r['predict_img_s_best'])} / {f(r['predict_img_s_median'])} "
            f"| {f(r.get('predict_x_larq-style_min'), '.2f')} / "
            f"{f(r.get('predict_x_larq-style_median'), '.2f')} "
            f"| {f(mem / 2**20 if mem else None, '.2f')} "
            f"| {f(r.get('peak_per_sample_x_lower_than_larq_style'), '.2f')} "
            f"| {f(tensor / 2**20 if tensor else None, '.2f')} "
            f"| {f(r.get('tensor_peak_x_lower_than_larq_style'), '.2f')} "
            f"| {f(largest / 2**20 if largest else None, '.2f')} "
            f"| {f(r.get('tensor_peak_max_x_lower_than_larq_style'), '.2f')} |"
        )
    predicts = []
    for p in result.get("profiles", []):
        lines += profile_markdown(p, f"{p['estimator']} inputs", "fit steps")
        if "predict" in p and not predicts:  # one graph whatever the input estimator
            predicts = profile_markdown({**p, **p["predict"]}, "predict", "predict batches")
    return "\n".join(lines + predicts)


def profile_markdown(p, what, unit):
    """One profile's two tables (op types, layer kinds)."""
    lines = [
        "",
        f"Bi-Real-Net-18, {p['impl']}, {what}, batch {p['batch']}, {p['size']} px: "
        f"{p['steps']} {unit}, {p['wall_ms']:.0f} ms wall, "
        f"{p['total_op_self_ms']:.0f} ms of op self time",
        "",
        "| op type | self ms | share | count |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['op_type']}{' (tapehook)' if r['tapehook'] else ''} | "
        f"{r['self_ms']:.1f} | {100 * r['share']:.1f} % | {r['count']} |"
        for r in p["top"][:15]
    ]
    lines += ["", "| layers | self ms | share |", "|---|---|---|"]
    lines += [
        f"| {r['layers']} | {r['self_ms']:.1f} | {100 * r['share']:.1f} % |"
        for r in p["by_layer_kind"]
        if r["self_ms"] > 0
    ]
    return lines


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = [r for r in rows if r["impl"] in TAPEHOOK_IMPLS]
    if not ours:
        return
    labels = [
        f"{r['model'].replace('_small', '-s')}\n{r['size']}px b{r['batch']}\n"
        f"{r['estimator']}{r['impl'].removeprefix('tapehook').replace('-', ' ')}"
        for r in ours
    ]
    series = [
        ("train vs larq-style", "train_x_larq-style_median"),
        ("train vs float", "train_x_float_median"),
        ("predict vs larq-style", "predict_x_larq-style_median"),
        ("memory/sample vs larq-style", "peak_per_sample_x_lower_than_larq_style"),
        ("tensor peak/sample vs larq-style", "tensor_peak_x_lower_than_larq_style"),
    ]
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(ours)), 4.8))
    width = 0.8 / len(series)
    for i, (name, key) in enumerate(series):
        ax.bar(
            [j + (i - (len(series) - 1) / 2) * width for j in range(len(ours))],
            [r.get(key, 0) or 0 for r in ours],
            width,
            label=name,
        )
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xticks(range(len(ours)), labels, fontsize=7)
    ax.set_ylabel("tapehook speedup / memory reduction (x, median)")
    ax.set_title("tapehook on whole models (Keras fit / predict, CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--child")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="112 px, each model's own estimator, 1 round, fewer steps",
    )
    parser.add_argument("--models", default=",".join(ARCHITECTURES))
    parser.add_argument("--sizes", default=None, help="default 112,224 (quick: 112)")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument(
        "--estimators",
        default=None,
        help="'own' (each model's), 'all' (default; quick: own), or names",
    )
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (quick: 1)")
    parser.add_argument(
        "--larq-python", default=None, help="python of a larq 0.14 env; 'none' to skip larq"
    )
    parser.add_argument(
        "--torch-python",
        default=None,
        help="python of an env with torch (default $TORCH_PYTHON, then "
        f"{', '.join(TORCH_PYTHONS)}); 'none' to skip the pytorch implementations",
    )
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--profile-estimators", default="approx_sign,ste_sign")
    parser.add_argument(
        "--profile-impl", default="tapehook-fused", choices=(*FLOAT_IMPLS, *TAPEHOOK_IMPLS)
    )
    parser.add_argument("--profile-batch", type=int, default=32)
    parser.add_argument("--profile-size", type=int, default=112, choices=(112, 224))
    parser.add_argument("--profile-only", action="store_true")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument(
        "--no-tensor-memory",
        action="store_true",
        help="skip the tensor-peak runs (BFC allocator statistics, batch 1 and the largest)",
    )
    parser.add_argument(
        "--tensor-repeats",
        type=int,
        default=1,
        help="tensor-peak runs per configuration and batch (the peak moves with the "
        "executor's op order)",
    )
    parser.add_argument(
        "--tensor-steps",
        type=int,
        default=5,
        help="fit steps measured per tensor-peak run: the table has the median step "
        "(over steps and runs) and the largest",
    )
    parser.add_argument("--out", default=str(RESULTS / "models.json"))
    parser.add_argument(
        "--append",
        action="store_true",
        help="add this run's rounds to --out's runs (e.g. 224 px after 112)",
    )
    parser.add_argument(
        "--tensor-only",
        action="store_true",
        help="only the tensor-peak runs; --out keeps its timing rounds and profiles, "
        "and its tensor-peak runs are replaced by these",
    )
    parser.add_argument(
        "--markdown", action="store_true", help="print --out's tables as Markdown and exit"
    )
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    if args.markdown:
        return print(markdown(json.loads(pathlib.Path(args.out).read_text())))

    quick = args.quick
    sizes = [int(s) for s in (args.sizes or ("112" if quick else "112,224")).split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    rounds = 0 if args.tensor_only else args.rounds or (1 if quick else 3)
    estimators = args.estimators or ("own" if quick else "all")
    lq_python = larq_python(args.larq_python)
    th_python = torch_python(args.torch_python)
    impls = [
        i
        for i in args.impls.split(",")
        if (i != "larq" or lq_python) and (i not in TORCH_IMPLS or th_python)
    ]
    groups = []
    for model in args.models.split(","):
        ests = RECIPES[model]["estimators"]
        ests = (
            ests[:1]
            if estimators == "own"
            else ests
            if estimators == "all"
            else [e for e in estimators.split(",") if e in ests]
        )
        configs = [(i, None) for i in impls if i in FLOAT_IMPLS]
        own = RECIPES[model]["estimators"][0]
        configs += [
            (i, e)
            for e in ests
            for i in impls
            if i not in FLOAT_IMPLS and (i != "tapehook-zoo" or e == own)
        ]
        for size in sizes:
            for batch in batches:
                groups.append((model, size, batch, configs))

    sys.path.insert(0, str(HERE))
    from run import cpu_flags, cpu_model, onednn_setting  # bench/run.py

    meta = {
        "machine": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_count": os.cpu_count(),
        "load_start": os.getloadavg(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "larq_python": lq_python,
        "torch_python": th_python,
        "quick": quick,
        "rounds": rounds,
        "tensor_repeats": args.tensor_repeats,
        "tensor_steps": args.tensor_steps,
        "onednn": onednn_setting(),
        "dispatch": os.environ.get("TAPEHOOK_DISPATCH", "auto"),
    }
    runs = []
    if not (args.profile_only or args.tensor_only):
        for rnd in range(rounds):
            for gi, (model, size, batch, configs) in enumerate(groups):
                order = configs if (rnd + gi) % 2 == 0 else configs[::-1]
                for impl, est in order:
                    train, predict = steps_for(batch, quick)
                    cfg = dict(
                        model=model,
                        impl=impl,
                        estimator=est,
                        size=size,
                        batch=batch,
                        train_steps=train,
                        predict_steps=predict,
                        round=f"{meta['started']}/{rnd}",
                    )
                    r = run_reported(cfg, lq_python, th_python)
                    runs.append(r)
                    if "error" not in r:
                        print(
                            f"round {rnd} {config_label(cfg)} train "
                            f"{r['train_img_s']:8.1f} img/s  predict "
                            f"{r['predict_img_s']:8.1f} img/s  peak "
                            f"{r['peak_rss_bytes'] / 2**20:6.0f} MiB  load "
                            f"{r['load_start']:.2f}",
                            flush=True,
                        )
    tensor_runs = []
    if not (args.profile_only or args.no_tensor_memory) and max(batches) > 1:
        seen = set()
        for model, size, _, configs in groups:
            for impl, est in configs:
                if (model, size, impl, est) in seen or impl in TORCH_IMPLS:
                    continue
                seen.add((model, size, impl, est))
                for batch in [1, max(batches)] * args.tensor_repeats:
                    cfg = dict(
                        model=model,
                        impl=impl,
                        estimator=est,
                        size=size,
                        batch=batch,
                        tensor_memory=True,
                        tensor_steps=args.tensor_steps,
                        round=f"{meta['started']}/tensor",
                    )
                    r = run_reported(cfg, lq_python)
                    tensor_runs.append(r)
                    if "error" not in r:
                        print(
                            f"tensor peak {config_label(cfg)} "
                            f"{r['tensor_peak_bytes'] / 2**20:8.1f} MiB",
                            flush=True,
                        )
    profiles = []
    if not (args.no_profile or args.tensor_only):
        for est in args.profile_estimators.split(","):
            cfg = dict(
                model="birealnet18",
                impl=args.profile_impl,
                estimator=est,
                size=args.profile_size,
                batch=args.profile_batch,
                train_steps=(2, 2),
                predict_steps=(1, 1),
                round=-1,
                profile=args.profile_steps,
            )
            r = run_config(cfg, sys.executable)
            if "error" in r:
                print(f"profile FAILED ({est}):\n{r['error']}", flush=True)
                continue
            profiles.append(
                {
                    "model": "birealnet18",
                    "size": args.profile_size,
                    "batch": args.profile_batch,
                    "impl": args.profile_impl,
                    "estimator": est,
                    **r["profile"],
                    "dispatch_counts": r["dispatch_counts"],
                }
            )
            print(
                f"\nBi-Real-Net-18, {args.profile_impl}, {est} inputs, batch {args.profile_batch}, "
                f"{args.profile_size} px:"
            )
            print_profile(profiles[-1])

    meta["load_end"] = os.getloadavg()
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    out = pathlib.Path(args.out)
    previous = json.loads(out.read_text()) if out.exists() else {}
    sessions = [dict(meta)]
    if args.append and previous:
        runs = previous.get("runs", []) + runs
        sessions = previous.get("sessions", []) + sessions
        profiles = profiles or previous.get("profiles", [])
        tensor_runs = previous.get("tensor_memory", []) + tensor_runs
    if args.tensor_only and previous:
        runs = previous.get("runs", [])
        sessions = previous.get("sessions", []) + sessions
        profiles = previous.get("profiles", [])
    # Groups (model, size, batch) and their configurations, in run order.
    groups = {}
    for r in runs:
        configs = groups.setdefault((r["model"], r["size"], r["batch"]), [])
        if (r["impl"], r["estimator"]) not in configs:
            configs.append((r["impl"], r["estimator"]))
    rows = summarize(runs, [(*k, v) for k, v in groups.items()])
    attach_tensor_memory(rows, tensor_runs)
    print()
    print_table(rows)
    import tensorflow as tf

    meta["tf_version"] = tf.__version__
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        **meta,
        "sessions": sessions,
        "rows": rows or previous.get("rows", []),
        "runs": runs or previous.get("runs", []),
        "profiles": profiles or previous.get("profiles", []),
        "tensor_memory": tensor_runs or previous.get("tensor_memory", []),
    }
    if args.profile_only and previous:  # keep the table's run metadata
        result = {
            **previous,
            "profiles": profiles or previous.get("profiles", []),
            "profile_load": [meta["load_start"], meta["load_end"]],
        }
    out.write_text(json.dumps(result, indent=1))
    if rows:
        plot(rows, out.with_suffix(".png"))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
