"""Bi-Real-Net-18 and QuickNet-small in PyTorch, written as the BNN papers'
PyTorch code writes a binary network: each sign an autograd function with its
pseudo-gradient, ``F.conv2d`` on sign(x) and (alpha *) sign(W), ``nn.BatchNorm2d``,
``torch.optim.Adam``. The architectures are bench/models.py's Keras ones, layer
for layer (tests/test_bench_models.py loads a Keras model's weights into these
and compares outputs); bench/models.py runs them as its ``pytorch*``
implementations, in a python that has torch (TensorFlow is not needed here).

Where PyTorch code pads symmetrically (``padding=1`` on a stride-2 3x3 conv),
TF's "same" pads (0, 1) on an even size: the same output size and cost, the
window shifted by one pixel. At odd sizes the two agree.
"""

import os
import resource
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def sign(x):
    """sign with sign(0) = +1 (larq's; torch.sign(0) is 0)."""
    return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)


class ApproxSign(torch.autograd.Function):
    """Bi-Real-Net's approx sign: forward sign(x); backward dy * max(0, 2 - 2|x|)
    (the derivative of its piecewise-quadratic approximation of sign)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return sign(x)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return dy * torch.clamp(2 - 2 * x.abs(), min=0)


class SteSign(torch.autograd.Function):
    """Clipped straight-through sign: forward sign(x); backward dy * (|x| <= clip)."""

    @staticmethod
    def forward(ctx, x, clip):
        ctx.save_for_backward(x)
        ctx.clip = clip
        return sign(x)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return dy * (x.abs() <= ctx.clip).to(dy.dtype), None


class BinaryConv2d(nn.Conv2d):
    """3x3 conv of sign(x) and (alpha *) sign(W). ``estimator``: the input's
    pseudo-gradient ("approx_sign" or "ste_sign"); kernels take the clipped
    straight-through gradient; ``scale="mean_abs"``: alpha = mean|W| per output
    channel, a constant in the backward (Bi-Real's official code detaches it);
    ``pad_value``: the binarized input padded with it instead of zeros."""

    def __init__(self, in_channels, out_channels, stride, estimator, clip, scale, pad_value):
        super().__init__(in_channels, out_channels, 3, stride, padding=1, bias=False)
        nn.init.xavier_normal_(self.weight)  # Keras's glorot_normal
        if estimator not in ("approx_sign", "ste_sign"):
            raise ValueError(f"unknown input estimator {estimator!r}; use approx_sign or ste_sign")
        self.estimator, self.clip, self.scale, self.pad_value = estimator, clip, scale, pad_value

    def forward(self, x):
        if self.estimator == "approx_sign":
            x = ApproxSign.apply(x)
        else:
            x = SteSign.apply(x, self.clip)
        w = SteSign.apply(self.weight, self.clip)
        if self.scale == "mean_abs":
            w = w * self.weight.abs().mean(dim=(1, 2, 3), keepdim=True).detach()
        if self.pad_value:
            return F.conv2d(F.pad(x, (1, 1, 1, 1), value=self.pad_value), w, stride=self.stride)
        return F.conv2d(x, w, stride=self.stride, padding=1)


def _batch_norm(channels, keras_momentum=0.99, eps=1e-3, affine=True):
    """nn.BatchNorm2d with Keras's defaults (Keras's momentum m is torch's 1 - m)."""
    return nn.BatchNorm2d(channels, eps=eps, momentum=1 - keras_momentum, affine=affine)


def _conv(in_channels, out_channels, kernel, stride=1, groups=1, init=nn.init.xavier_normal_):
    conv = nn.Conv2d(
        in_channels, out_channels, kernel, stride, kernel // 2, groups=groups, bias=False
    )
    init(conv.weight)
    return conv


class BiRealBlock(nn.Module):
    """BN(binary conv(x)) + shortcut(x); on a width change the conv has stride 2
    and the shortcut is 2x2 average pool, 1x1 conv, BN."""

    def __init__(self, in_channels, width, binary):
        super().__init__()
        stride = 1 if width == in_channels else 2
        self.shortcut = None
        if stride == 2:
            self.shortcut = nn.Sequential(
                nn.AvgPool2d(2, 2, ceil_mode=True),  # TF's "same" at odd sizes too
                _conv(in_channels, width, 1),
                _batch_norm(width, 0.8),
            )
        self.conv = BinaryConv2d(in_channels, width, stride, **binary)
        self.bn = _batch_norm(width, 0.8)

    def keras_order(self):
        """Keras lists a functional model's layers by depth from the input: the
        shortcut's 1x1 conv (after its pool) comes level with the binary
        conv's BN, the shortcut's BN last."""
        if self.shortcut is None:
            return [self.conv, self.bn]
        return [self.conv, self.shortcut[1], self.bn, self.shortcut[2]]

    def forward(self, x):
        shortcut = x if self.shortcut is None else self.shortcut(x)
        return self.bn(self.conv(x)) + shortcut


class BiRealNet18(nn.Module):
    """Bi-Real-Net-18 (Liu et al. 2018, as larq-zoo builds it): float 7x7 stem,
    BN, 3x3 max pool; 16 binary blocks; global average pool; float classifier
    (logits)."""

    def __init__(self, binary, classes=1000, filters=64):
        super().__init__()
        self.stem = _conv(3, filters, 7, 2)
        self.stem_bn = _batch_norm(filters, 0.8)
        self.pool = nn.MaxPool2d(3, 2, padding=1)
        widths = [filters] * 4 + [2 * filters] * 4 + [4 * filters] * 4 + [8 * filters] * 4
        blocks, channels = [], filters
        for width in widths:
            blocks.append(BiRealBlock(channels, width, binary))
            channels = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        x = self.blocks(self.pool(self.stem_bn(self.stem(x))))
        return self.head(x.mean(dim=(2, 3)))


class BlurPool(nn.Module):
    """QuickNet's fixed 3x3 binomial blur per channel (depthwise), a buffer."""

    def __init__(self, channels, stride):
        super().__init__()
        k = torch.tensor([1.0, 2.0, 1.0])
        k = torch.outer(k, k) / 16
        self.register_buffer("weight", k.expand(channels, 1, 3, 3).contiguous())
        self.stride = stride

    def forward(self, x):
        return F.conv2d(x, self.weight, stride=self.stride, padding=1, groups=x.shape[1])


class QuickNetBlock(nn.Module):
    """x + BN(ReLU(binary conv(x))), the conv's input padded with +1."""

    def __init__(self, channels, binary):
        super().__init__()
        self.conv = BinaryConv2d(channels, channels, 1, **binary)
        self.bn = _batch_norm(channels, 0.9, eps=1e-5)

    def forward(self, x):
        return x + self.bn(F.relu(self.conv(x)))


class QuickNetSmall(nn.Module):
    """QuickNet-small (larq-zoo v1.0): stem (3x3/2 conv, BN, ReLU, 3x3/2
    depthwise, BN, 1x1 conv, BN); per section a float transition where the
    width changes (ReLU, 2x2 max pool stride 1, blur pool /2, 1x1 conv, BN),
    then binary blocks; ReLU, global average pool, float classifier (logits)."""

    def __init__(self, binary, classes=1000, filters=(32, 64, 256, 512), blocks=(4, 4, 4, 4)):
        super().__init__()
        he = nn.init.kaiming_normal_
        stem = filters[0] // 4
        self.stem = nn.Sequential(
            _conv(3, stem, 3, 2, init=he),
            _batch_norm(stem),
            nn.ReLU(),
            _conv(stem, stem, 3, 2, groups=stem, init=nn.init.xavier_uniform_),
            _batch_norm(stem, affine=False),
            _conv(stem, filters[0], 1, init=he),
            _batch_norm(filters[0]),
        )
        layers, channels = [], filters[0]
        for section, (count, width) in enumerate(zip(blocks, filters)):
            for layer in range(count):
                if width != channels:
                    stride = 1 if section == 0 or layer != 0 else 2
                    layers += [
                        nn.ReLU(),
                        nn.MaxPool2d(stride, 1),
                        BlurPool(channels, stride),
                        _conv(channels, width, 1),
                        _batch_norm(width, 0.9, eps=1e-5),
                    ]
                    channels = width
                layers.append(QuickNetBlock(channels, binary))
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(channels, classes)
        nn.init.xavier_normal_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x):
        x = F.relu(self.body(self.stem(x)))
        return self.head(x.mean(dim=(2, 3)))


ARCHITECTURES = {"birealnet18": BiRealNet18, "quicknet_small": QuickNetSmall}


def build(model, estimator, recipe, **kwargs):
    """The torch model of bench/models.py's ``model`` with its ``recipe``
    (clip, scale, pad_value) and input ``estimator``."""
    binary = dict(
        estimator=estimator,
        clip=recipe["clip"],
        scale=recipe["scale"],
        pad_value=recipe["pad_value"],
    )
    return ARCHITECTURES[model](binary, **kwargs)


def keras_weights(net):
    """(tensor, layout) of the model's tensors in Keras's ``get_weights()``
    order: modules in registration order but where a module says otherwise
    (``keras_order``); BN gamma, beta, moving mean, moving variance; dense
    kernel, bias. layout: "conv", "depthwise", "dense" or "vector"."""
    out = []
    for m in _keras_layers(net):
        if isinstance(m, nn.Conv2d):
            out.append((m.weight, "depthwise" if m.groups > 1 else "conv"))
        elif isinstance(m, BlurPool):
            out.append((m.weight, "depthwise"))
        elif isinstance(m, nn.BatchNorm2d):
            stats = [m.running_mean, m.running_var]
            out += [(t, "vector") for t in ([m.weight, m.bias] if m.affine else []) + stats]
        elif isinstance(m, nn.Linear):
            out += [(m.weight, "dense"), (m.bias, "vector")]
    return out


def _keras_layers(module):
    if isinstance(module, nn.Conv2d | nn.BatchNorm2d | nn.Linear | BlurPool):
        return [module]
    order = getattr(module, "keras_order", None)
    children = order() if order else module.children()
    return [leaf for child in children for leaf in _keras_layers(child)]


# Keras's layout -> torch's: conv (h, w, in, out) -> (out, in, h, w); depthwise
# (h, w, channels, 1) -> (channels, 1, h, w); dense (in, out) -> (out, in).
_FROM_KERAS = {"conv": (3, 2, 0, 1), "depthwise": (2, 3, 0, 1), "dense": (1, 0), "vector": (0,)}


def load_keras_weights(net, arrays):
    """Copies a Keras model's ``get_weights()`` into ``net``."""
    tensors = keras_weights(net)
    if len(tensors) != len(arrays):
        raise ValueError(f"{len(arrays)} Keras weights for {len(tensors)} torch tensors")
    with torch.no_grad():
        for (t, layout), a in zip(tensors, arrays):
            a = np.asarray(a).transpose(_FROM_KERAS[layout])
            if a.shape != tuple(t.shape):
                raise ValueError(f"Keras weight of shape {a.shape} for torch {tuple(t.shape)}")
            t.copy_(torch.from_numpy(np.ascontiguousarray(a)))


def count_params(net):
    """Parameters as Keras counts them: trainable and not, BN moving statistics
    and the fixed blur included (not torch's num_batches_tracked)."""
    return sum(t.numel() for t, _ in keras_weights(net))


# ---------------------------------------------------------------------------
# bench/models.py's child process for the pytorch* implementations.

IMPLS = {  # impl -> (memory format, torch.compile)
    "pytorch": (torch.contiguous_format, False),
    "pytorch-channels-last": (torch.channels_last, False),
    "pytorch-compile": (torch.contiguous_format, True),
}


def threads():
    """TF's default intra-op thread count: the CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


def child(cfg, recipe, classes):
    """One configuration: ``train_steps`` = (warm-up, timed) training steps
    (forward, cross entropy, backward, Adam, latent-weight clip, as the Keras
    rows' WeightClip), then ``predict_steps`` forwards under eval / no_grad.
    Returns the fields bench/models.py's TF child prints."""
    memory_format, compiled = IMPLS[cfg["impl"]]
    torch.set_num_threads(threads())
    torch.manual_seed(0)
    batch, size = cfg["batch"], cfg["size"]
    net = build(cfg["model"], cfg["estimator"], recipe, classes=classes)
    net = net.to(memory_format=memory_format)
    run = torch.compile(net) if compiled else net
    rng = np.random.default_rng(0)  # bench/models.py's batch, NHWC -> NCHW
    x = torch.from_numpy(rng.standard_normal((batch, size, size, 3), dtype=np.float32))
    x = x.permute(0, 3, 1, 2).contiguous(memory_format=memory_format)
    y = torch.from_numpy(rng.integers(0, classes, (batch,)))
    clip = recipe["clip"]
    latent = [m.weight for m in net.modules() if isinstance(m, BinaryConv2d)]
    optimizer = torch.optim.Adam(net.parameters(), 1e-3, eps=1e-7)  # Keras's epsilon

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(run(x), y).backward()
        optimizer.step()
        with torch.no_grad():
            for w in latent:
                w.clamp_(-clip, clip)

    def predict_step():
        with torch.no_grad():
            F.softmax(run(x), dim=1)

    def timed(step, warm, steps):
        times = []
        for _ in range(warm + steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        return times[warm:]

    load_start = os.getloadavg()[0]
    net.train()
    train = timed(train_step, *cfg["train_steps"])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    net.eval()
    predict = timed(predict_step, *cfg["predict_steps"])
    return {
        **cfg,
        "train_step_s": train,
        "predict_step_s": predict,
        "train_img_s": batch / statistics.median(train),
        "predict_img_s": batch / statistics.median(predict),
        "peak_rss_bytes": peak,
        "params": count_params(net),
        "dispatch_counts": None,
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
        "profile": None,
    }
