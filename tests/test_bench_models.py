"""bench/models.py builds what it claims: the same architecture in float Keras,
as a larq-style composite and binarized by tapehook, with tapehook's binary
convs running tapehook's kernels and computing larq's forward. Tiny widths
and images, no timing."""

import importlib.util
import os
import pathlib
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tapehook

from conftest import recomputed_binary_convs

pytestmark = pytest.mark.slow

_PATH = pathlib.Path(__file__).resolve().parents[1] / "bench" / "models.py"
_spec = importlib.util.spec_from_file_location("bench_models", _PATH)
bench_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_models)

SIZE, CLASSES = 32, 10
TINY = {"birealnet18": dict(filters=8), "quicknet_small": dict(filters=(8, 16, 32, 64))}
# (binary convs, of which strided) per architecture, from the papers.
BINARY_CONVS = {"birealnet18": (16, 3), "quicknet_small": (16, 0)}
# tapehook-zoo builds the zoo's models at their own widths (its own test).
TAPEHOOK = tuple(i for i in bench_models.TAPEHOOK_IMPLS if i != "tapehook-zoo")
FUSED = bench_models.FUSED_IMPLS
# Where tapehook is in charge with nothing said: its layers once the model runs.
FAST = (*FUSED, *(i for i in bench_models.DEFAULT_IMPLS if i in TAPEHOOK))


@pytest.fixture(autouse=True)
def _keep_settings(monkeypatch):
    """bench_models.build sets TAPEHOOK_PACK_INPUTS and TAPEHOOK_BACKPROP_DY per
    implementation: restored after each test (the later tests of the session
    must not inherit an opt-in)."""
    monkeypatch.setenv("TAPEHOOK_PACK_INPUTS", os.environ.get("TAPEHOOK_PACK_INPUTS", "1"))
    monkeypatch.setenv("TAPEHOOK_BACKPROP_DY", os.environ.get("TAPEHOOK_BACKPROP_DY", "exact"))


def build(model, impl, estimator, **kwargs):
    keras.utils.set_random_seed(0)
    return bench_models.build(
        keras, model, impl, estimator, SIZE, classes=CLASSES, **TINY[model], **kwargs
    )


def structure(net):
    """(name, Conv2D or class name, weight shapes, trainable) of every layer;
    Keras's generated names lose their per-process counter."""
    return [
        (
            re.sub(r"_\d+$", "", layer.name),
            "Conv2D" if isinstance(layer, keras.layers.Conv2D) else type(layer).__name__,
            [tuple(w.shape) for w in layer.weights],
            layer.trainable,
        )
        for layer in net.layers
    ]


def binary_layers(net):
    return [layer for layer in net.layers if layer.name.startswith("binary")]


@pytest.mark.parametrize("model", list(bench_models.ARCHITECTURES))
def test_same_structure_and_parameters(model):
    est = bench_models.RECIPES[model]["estimators"][0]
    nets = {
        impl: build(model, impl, est) for impl in ("float", "float-fused", "larq-style", *TAPEHOOK)
    }
    reference = nets["float"]
    for impl, net in nets.items():
        assert structure(net) == structure(reference), impl
        assert net.count_params() == reference.count_params(), impl
    convs, strided = BINARY_CONVS[model]
    layers = binary_layers(reference)
    assert len(layers) == convs
    assert sum(layer.strides != (1, 1) for layer in layers) == strided
    # Only the tapehook variant's binary convs are marked, with the recipe.
    spec = tapehook.BinarySpec(**bench_models.tapehook_spec(model, est))
    for impl in TAPEHOOK:
        assert [tapehook.binary_spec_of(layer.kernel) for layer in binary_layers(nets[impl])] == [
            spec
        ] * convs
    # Only the -fused implementations' batch norms are tapehook's layer, and
    # those of the models tapehook is in charge of (fast layers: binarize
    # swaps them in, a tapehook.larq model at its first call).
    for impl, net in nets.items():
        net(tf.zeros([1, SIZE, SIZE, 3]), training=False)
        ours = impl in FAST
        norms = [l for l in net.layers if isinstance(l, keras.layers.BatchNormalization)]
        assert norms and all(
            isinstance(l, tapehook.layers.BatchNormalization) == ours for l in norms
        ), impl
    for impl in ("float", "float-fused", "larq-style"):
        assert all(
            tapehook.binary_spec_of(l.kernel) is None
            for l in nets[impl].layers
            if hasattr(l, "kernel")
        )


def test_full_size_parameter_counts():
    """At 224 px with 1000 classes, Bi-Real-Net-18 has larq-zoo's 11,699,112
    parameters; QuickNet-small within 0.1 % of larq-zoo's 12,655,688."""
    bireal = bench_models.birealnet18(
        keras, bench_models.binary_conv_factory(keras, "float", "birealnet18", None), 224
    )
    assert bireal.count_params() == 11_699_112
    quick = bench_models.quicknet_small(
        keras, bench_models.binary_conv_factory(keras, "float", "quicknet_small", None), 224
    )
    assert abs(quick.count_params() - 12_655_688) / 12_655_688 < 1e-3


@pytest.mark.parametrize("impl", TAPEHOOK)
@pytest.mark.parametrize(
    "model,estimator", [("birealnet18", "approx_sign"), ("quicknet_small", "ste_sign")]
)
def test_tapehook_runs_binary_kernels_and_matches_larq_style(model, estimator, impl):
    # tapehook-fused against larq-style with the same (fused) batch norm: Keras's
    # rounds differently in tf.function, and at these tiny widths (batch 2 of
    # 1x1 images at the end) that flips signs. The layer itself is checked
    # against Keras's in test_layers.py.
    # tapehook-default's and tapehook-larq's Keras batch norms become
    # tapehook's (fast layers).
    fast = impl in FAST
    norm = {"batch_norm": tapehook.layers.BatchNormalization} if fast else {}
    ours, theirs = build(model, impl, estimator), build(model, "larq-style", estimator, **norm)
    theirs.set_weights(ours.get_weights())
    x = tf.random.stateless_normal([2, SIZE, SIZE, 3], seed=[1, 2])
    tapehook.reset_dispatch_counts()
    y_ours = ours(x, training=False)
    convs, _ = BINARY_CONVS[model]
    assert tapehook.dispatch_counts()["compiled"]["forward"] == convs
    np.testing.assert_allclose(
        y_ours.numpy(), theirs(x, training=False).numpy(), rtol=1e-4, atol=1e-6
    )

    # One Keras fit step: every binary conv's forward and both backprops.
    for net in (ours, theirs):
        net.compile(keras.optimizers.SGD(0.0), "sparse_categorical_crossentropy", jit_compile=False)
    y = np.arange(2) % CLASSES
    tapehook.reset_dispatch_counts()
    loss_ours = ours.fit(x, y, epochs=1, verbose=0).history["loss"][0]
    counts = tapehook.dispatch_counts()
    # tapehook-recompute's batch norms run each binary forward again in the
    # backward (tapehook.layers.BatchNormalization(recompute=True)); so do the
    # default's, all narrower than 256 channels at these widths.
    recompute = impl in bench_models.RECOMPUTE_IMPLS or impl in bench_models.DEFAULT_IMPLS
    assert counts["compiled"] == {
        "forward": convs * (2 if recompute else 1),
        "backprop_input": convs,
        "backprop_filter": convs,
    }
    loss_theirs = theirs.fit(x, y, epochs=1, verbose=0).history["loss"][0]
    np.testing.assert_allclose(loss_ours, loss_theirs, rtol=1e-4)


@pytest.mark.parametrize("model", list(bench_models.ARCHITECTURES))
def test_recompute_early_rebuilds_only_the_narrow_batch_norms(model):
    """tapehook-recompute-early at the models' real widths: recompute on
    exactly the batch norms of fewer than 256 channels, so a fit step runs
    the binary forward again for the 8 binary convs of the first two stages
    (sections) only."""
    est = bench_models.RECIPES[model]["estimators"][0]
    keras.utils.set_random_seed(0)
    net = bench_models.build(keras, model, "tapehook-recompute-early", est, SIZE, classes=CLASSES)
    norms = [l for l in net.layers if isinstance(l, tapehook.layers.BatchNormalization)]
    assert [l.recompute for l in norms] == [l.input.shape[-1] < 256 for l in norms]
    assert any(l.recompute for l in norms) and not all(l.recompute for l in norms)
    net.compile(keras.optimizers.SGD(0.0), "sparse_categorical_crossentropy", jit_compile=False)
    x = tf.random.stateless_normal([2, SIZE, SIZE, 3], seed=[1, 2])
    tapehook.reset_dispatch_counts()
    net.fit(x, np.arange(2), epochs=1, verbose=0)
    convs, _ = BINARY_CONVS[model]
    assert tapehook.dispatch_counts()["compiled"] == {
        "forward": convs + 8,
        "backprop_input": convs,
        "backprop_filter": convs,
    }


@pytest.mark.parametrize("model", list(bench_models.ARCHITECTURES))
def test_default_impl_is_what_binarize_gives(model):
    """tapehook-default measures the path a user gets: the model is built with
    Keras's own batch norm, max pool, add and Adam, and binarize and fit put
    tapehook's in their place (fast layers); the "tapehook" configuration
    keeps Keras's."""
    est = bench_models.RECIPES[model]["estimators"][0]
    x = tf.random.stateless_normal([2, SIZE, SIZE, 3], seed=[1, 2])
    swapped = {}
    for impl in ("tapehook-default", "tapehook-larq", "tapehook"):
        net = build(model, impl, est)
        net.compile(
            keras.optimizers.Adam(0.0), "sparse_categorical_crossentropy", jit_compile=False
        )
        net.fit(x, np.arange(2), epochs=1, verbose=0)
        norms = [l for l in net.layers if type(l).__name__ == "BatchNormalization"]
        assert norms
        swapped[impl] = (
            all(isinstance(l, tapehook.layers.BatchNormalization) for l in norms),
            isinstance(net.optimizer, tapehook.optimizers.Adam),
        )
    assert swapped == {
        "tapehook-default": (True, True),
        "tapehook-larq": (True, True),
        "tapehook": (False, False),
    }


@pytest.mark.parametrize("model", list(bench_models.ARCHITECTURES))
def test_zoo_impl_is_the_zoo_model_on_kernels(model):
    """tapehook-zoo is tapehook.zoo's model: the architecture's parameter count
    (Bi-Real-Net-18 exactly, QuickNet-small within 0.1 %, at the real widths),
    its batch norms and Adam tapehook's, and a fit step runs every binary conv
    on the kernels (again for those a recomputing batch norm rebuilds)."""
    est = bench_models.RECIPES[model]["estimators"][0]
    keras.utils.set_random_seed(0)
    net = bench_models.build(keras, model, "tapehook-zoo", est, SIZE, classes=CLASSES)
    assert net.name == model
    float_net = bench_models.build(keras, model, "float", None, SIZE, classes=CLASSES)
    assert abs(net.count_params() - float_net.count_params()) <= 1e-3 * float_net.count_params()
    other = bench_models.RECIPES[model]["estimators"][1]
    with pytest.raises(SystemExit, match="own estimator"):
        bench_models.build(keras, model, "tapehook-zoo", other, SIZE, classes=CLASSES)
    net.compile(keras.optimizers.Adam(0.0), "sparse_categorical_crossentropy", jit_compile=False)
    x = tf.random.stateless_normal([2, SIZE, SIZE, 3], seed=[1, 2])
    tapehook.reset_dispatch_counts()
    net.fit(x, np.arange(2), epochs=1, verbose=0)
    norms = [l for l in net.layers if isinstance(l, keras.layers.BatchNormalization)]
    assert all(isinstance(l, tapehook.layers.BatchNormalization) for l in norms)
    assert isinstance(net.optimizer, tapehook.optimizers.Adam)
    convs, _ = BINARY_CONVS[model]
    rebuilt = recomputed_binary_convs(net)
    assert rebuilt
    assert tapehook.dispatch_counts()["compiled"] == {
        "forward": convs + len(rebuilt),
        "backprop_input": convs,
        "backprop_filter": convs,
    }


def test_float_model_is_stock():
    net = build("birealnet18", "float", None)
    tapehook.reset_dispatch_counts()
    net(tf.zeros([1, SIZE, SIZE, 3]))
    counts = tapehook.dispatch_counts()
    assert not any(counts["compiled"].values()) and not any(counts["reference"].values())


def test_profile_breakdown_names_tapehook_ops(tmp_path):
    """The profile parser finds each executed op type once per execution."""
    w = tf.Variable(tf.random.stateless_normal([3, 3, 8, 8], seed=[3, 4]))
    tapehook.mark_binary(w, activations=True)
    x = tf.random.stateless_normal([2, 8, 8, 8], seed=[5, 6])

    @tf.function
    def f(x):
        return tf.nn.relu(tf.nn.conv2d(x, w, 1, "SAME"))

    f(x)
    tf.profiler.experimental.start(str(tmp_path))
    for _ in range(3):
        f(x)
    tf.profiler.experimental.stop()
    profile = bench_models.op_type_breakdown(str(tmp_path))
    rows = {r["op_type"]: r for r in profile["top"]}
    assert rows["TapehookBinaryConv2D"]["count"] == 3 and rows["TapehookBinaryConv2D"]["tapehook"]
    assert rows["Relu"]["count"] == 3 and not rows["Relu"]["tapehook"]
    assert abs(sum(r["share"] for r in profile["top"]) - 1) < 1e-6 or profile["all_types"] > 25


def _saved_set_of_head(hidden, inputs=(5,)):
    """bench/saved_tensors.py's saved_set (tensors, unsized) of one traced
    training step (SGD, from-logits cross entropy, batch 4) of a model
    ``Dense(3)(hidden(Input(inputs)))``."""
    spec = importlib.util.spec_from_file_location("bench_saved", _PATH.parent / "saved_tensors.py")
    saved = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(saved)
    keras.utils.set_random_seed(0)
    shape, inputs = inputs, keras.Input(inputs)
    net = keras.Model(inputs, keras.layers.Dense(3, name="head")(hidden(inputs)))
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(net.trainable_variables)
    graph = saved.trace_step(
        net,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer,
        tf.TensorSpec((4, *shape), tf.float32),
        tf.TensorSpec((4,), tf.int64),
    )
    return saved.saved_set(graph, 4)


def test_saved_set_is_what_the_backward_reads():
    """bench/saved_tensors.py on a model whose backward is known by hand:
    Dense-ReLU-Dense under a from-logits cross entropy keeps the ReLU's output
    (ReluGrad and the second MatMul's dW read it) and the cross entropy's
    backprop output; the input and the weights are not counted."""
    tensors, unsized = _saved_set_of_head(
        lambda inputs: keras.layers.Dense(8, activation="relu", name="head_hidden")(inputs)
    )
    assert unsized == []
    arrays = {t["producer"]: t["bytes_per_sample"] for t in tensors if t["bytes_per_sample"] >= 4}
    assert arrays == {"Relu": 8 * 4, "SparseSoftmaxCrossEntropyWithLogits": 3 * 4}
    assert all(t["layers"] == "head" for t in tensors if t["producer"] == "Relu")


def test_saved_set_skips_dead_backward_ops():
    """The tape builds a frozen depthwise conv's filter gradient, which
    nothing uses (TF prunes it at run time): the input it would read is not
    counted. Conv2D(1x1) -> frozen DepthwiseConv2D -> global pool -> head
    keeps the pooled features (the head's dW reads them) and the cross
    entropy's backprop, no feature map (the depthwise's dX reads its filter,
    the 1x1 conv's dW the model's input, the pool's gradient a shape)."""
    tensors, unsized = _saved_set_of_head(
        lambda inputs: keras.layers.GlobalAveragePooling2D()(
            keras.layers.DepthwiseConv2D(3, trainable=False, name="head_frozen")(
                keras.layers.Conv2D(2, 1, name="head_hidden")(inputs)
            )
        ),
        inputs=(6, 6, 2),
    )
    arrays = {t["producer"]: t["bytes_per_sample"] for t in tensors if t["bytes_per_sample"] >= 4}
    assert unsized == []
    assert arrays == {"Mean": 2 * 4, "SparseSoftmaxCrossEntropyWithLogits": 3 * 4}


def test_saved_set_lists_tensors_of_run_time_size():
    """A fused batch norm keeps a workspace whose size only the run decides:
    listed as unsized, not counted, and the rest still counted."""
    tensors, unsized = _saved_set_of_head(
        lambda inputs: tapehook.layers.BatchNormalization()(
            keras.layers.Dense(8, name="head_hidden")(inputs)
        )
    )
    assert len(unsized) == 1 and "FusedBatchNormV3" in unsized[0]
    assert {"FusedBatchNormV3", "SparseSoftmaxCrossEntropyWithLogits"} <= {
        t["producer"] for t in tensors
    }


def test_tensor_peak_per_sample_takes_median_and_largest_step():
    """attach_tensor_memory: per sample = (batch b - batch 1) / (b - 1), over
    every measured step of every run (median: a typical step; max: the
    largest), and larq-style's over it; a float row against larq-style with
    the model's own estimator."""
    mib = 2**20

    def run(impl, estimator, batch, steps):
        return dict(
            model="birealnet18",
            size=112,
            impl=impl,
            estimator=estimator,
            batch=batch,
            tensor_peak_bytes=max(steps) * mib,
            tensor_step_peaks=[s * mib for s in steps],
        )

    runs = [
        run("larq-style", "approx_sign", 1, [10, 10]),
        run("larq-style", "approx_sign", 5, [50, 54]),
        run("larq-style", "approx_sign", 5, [58]),  # median 54, max 58
        run("tapehook-recompute", "approx_sign", 1, [2, 4, 3]),  # median 3, max 4
        run("tapehook-recompute", "approx_sign", 5, [11, 19, 15]),  # median 15, max 19
        run("float-fused", None, 1, [1]),
        run("float-fused", None, 5, [23]),
        run("larq-style", "ste_sign", 1, [0]),
        run("larq-style", "ste_sign", 5, [400]),
    ]
    rows = [
        dict(model="birealnet18", size=112, impl=impl, estimator=est, batch=batch)
        for impl, est in [
            ("larq-style", "approx_sign"),
            ("tapehook-recompute", "approx_sign"),
            ("float-fused", None),
        ]
        for batch in (1, 5)
    ]
    bench_models.attach_tensor_memory(rows, runs)
    got = {(r["impl"], r["batch"]): r for r in rows}
    assert "tensor_peak_bytes_per_sample" not in got["tapehook-recompute", 1]
    ours, larq_style = got["tapehook-recompute", 5], got["larq-style", 5]
    assert larq_style["tensor_peak_bytes_per_sample"] == 11 * mib
    assert larq_style["tensor_peak_max_bytes_per_sample"] == 12 * mib
    assert "tensor_peak_x_lower_than_larq_style" not in larq_style
    assert ours["tensor_peak_bytes_per_sample"] == 3 * mib
    assert ours["tensor_peak_max_bytes_per_sample"] == 3.75 * mib
    assert ours["tensor_peak_x_lower_than_larq_style"] == pytest.approx(11 / 3)
    assert ours["tensor_peak_max_x_lower_than_larq_style"] == pytest.approx(12 / 3.75)
    assert got["float-fused", 5]["tensor_peak_x_lower_than_larq_style"] == pytest.approx(11 / 5.5)


def test_peak_tensors_replay_counts_requested_and_chunk_bytes():
    """bench/peak_tensors.py's replay: both peaks past the start of the step
    (a tensor freed that was allocated before it lowers the running sum by
    its own bytes), and the tensors alive at the requested peak."""
    spec = importlib.util.spec_from_file_location("bench_peaks", _PATH.parent / "peak_tensors.py")
    peaks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peaks)
    # (time, +1 / -1, requested, chunk, address, op, shape)
    events = [
        (0, 1, 100, 200, 1, "a", "[100]"),  # requested 100, chunks 200
        (1, 1, 50, 50, 2, "b", "[50]"),  # 150, 250
        (2, -1, 0, 30, 9, "", ""),  # freed, allocated before the step: 120, 220
        (3, -1, 0, 200, 1, "", ""),  # a freed: 20, 20
        (4, 1, 400, 410, 3, "c", "[400]"),  # 420, 430
        (5, 1, 10, 90, 4, "d", "[10]"),  # 430, 520
        (6, -1, 0, 410, 3, "", ""),  # 30, 110
    ]
    requested, chunks, alive = peaks.replay(events)
    assert requested == 430
    assert chunks == 520
    assert sorted(alive) == [(10, 90, "d", "[10]"), (50, 50, "b", "[50]"), (400, 410, "c", "[400]")]


# Odd sizes at every stride-2 layer, where PyTorch's symmetric padding and
# TF's "same" padding pick the same pixels (at even sizes they differ by one).
TORCH_SIZES = {"birealnet18": 33, "quicknet_small": 61}
# Runs in the torch python (no TF there): the torch model of bench/models.py's
# recipe with the Keras weights, its eval forward (softmax) and the
# gradients of one training-mode cross entropy, in Keras's layouts.
_TORCH_SIDE = """
import sys, numpy as np, torch, torch.nn.functional as F
sys.path.insert(0, sys.argv[1])
import models, torch_models
d = np.load(sys.argv[2], allow_pickle=True)
name, est = str(d["model"]), str(d["estimator"])
net = torch_models.build(name, est, models.RECIPES[name], classes=int(d["classes"]),
                         **d["kwargs"].item())
weights = [d[f"w{i}"] for i in range(int(d["count"]))]
torch_models.load_keras_weights(net, weights)
x = torch.from_numpy(d["x"]).permute(0, 3, 1, 2).contiguous()
net.eval()
with torch.no_grad():
    probs = F.softmax(net(x), dim=1).numpy()
net.train()
F.cross_entropy(net(x), torch.from_numpy(d["y"])).backward()
grads = {}
for i, (t, layout) in enumerate(torch_models.keras_weights(net)):
    if t.grad is not None:
        back = np.argsort(torch_models._FROM_KERAS[layout])
        grads[f"g{i}"] = t.grad.numpy().transpose(back)
np.savez(sys.argv[3], probs=probs, params=torch_models.count_params(net), **grads)
"""


@pytest.mark.parametrize(
    "model,estimator",
    [("birealnet18", "approx_sign"), ("birealnet18", "ste_sign"), ("quicknet_small", "ste_sign")],
)
def test_pytorch_model_matches_keras_larq_style(model, estimator, tmp_path):
    """bench/torch_models.py's model (the pytorch* implementations) with the
    larq-style Keras model's weights: the same parameter count, the same
    eval-mode output, and the same gradients of a training-mode cross entropy
    for every trainable weight (the sign estimators' pseudo-gradients, alpha a
    constant in the backward, BN on batch statistics)."""
    import subprocess

    python = bench_models.torch_python(None)
    if python is None:
        pytest.skip(
            "no python with torch (TORCH_PYTHON, or /tmp/torchenv/bin/python); CI installs no torch"
        )
    size = TORCH_SIZES[model]
    keras.utils.set_random_seed(0)
    net = bench_models.build(
        keras, model, "larq-style", estimator, size, classes=CLASSES, **TINY[model]
    )
    # Batch norms with moving statistics away from (0, 1), so eval mode uses them.
    rng = np.random.default_rng(0)
    weights = []
    for v in net.weights:
        a = v.numpy()
        if "moving_mean" in v.path:
            a = rng.normal(0, 0.3, a.shape).astype(a.dtype)
        elif "moving_variance" in v.path:
            a = rng.uniform(0.5, 2.0, a.shape).astype(a.dtype)
        weights.append(a)
    net.set_weights(weights)
    x = rng.standard_normal((2, size, size, 3)).astype(np.float32)
    y = np.array([1, 7])
    case, out = tmp_path / "case.npz", tmp_path / "out.npz"
    np.savez(
        case,
        model=model,
        estimator=estimator,
        classes=CLASSES,
        kwargs=np.array(TINY[model], dtype=object),
        x=x,
        y=y,
        count=len(weights),
        **{f"w{i}": w for i, w in enumerate(weights)},
    )
    run = subprocess.run(
        [python, "-c", _TORCH_SIDE, str(_PATH.parent), str(case), str(out)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = np.load(out)

    assert int(theirs["params"]) == net.count_params()
    np.testing.assert_allclose(
        theirs["probs"], net(x, training=False).numpy(), rtol=1e-4, atol=1e-6
    )
    with tf.GradientTape() as tape:
        loss = keras.losses.sparse_categorical_crossentropy(y, net(x, training=True))
        loss = tf.reduce_mean(loss)
    grads = tape.gradient(loss, net.weights)
    trainable = {id(v) for v in net.trainable_weights}
    checked = 0
    for i, (v, g) in enumerate(zip(net.weights, grads)):
        if id(v) not in trainable:
            assert f"g{i}" not in theirs, v.path
            continue
        np.testing.assert_allclose(theirs[f"g{i}"], g.numpy(), rtol=2e-3, atol=2e-5, err_msg=v.path)
        checked += 1
    assert checked == len(net.trainable_weights)
