"""What a training step keeps for its backward, tensor by tensor.

    python bench/saved_tensors.py            # Bi-Real-Net-18 and QuickNet-small, 112 px
    python bench/saved_tensors.py --markdown # the tables from bench/results/saved_tensors.json

The tensor peak of bench/models.py says how much a step holds; this says
what. It traces one training step (a GradientTape over the model, the loss,
the gradients) of each implementation in bench/models.py as a graph, with no
run: every tensor the forward computes and a backward op reads is one the
step keeps until that op runs (backward ops whose results nothing uses, such
as the filter gradient of a frozen conv, are pruned by TF at run time and
not counted). Their bytes per sample, by the layer that
made them (bench/models.py's layer kinds) and by the op type that made them,
are the step's saved set; the tensor peak is that set plus the backward's
transients (the largest gradients alive at once). Not counted: the model's
input (the data) and weights (held anyway), and kept tensors whose size only
the run decides (listed per row as "unsized": FusedBatchNormV3's workspace). The larq 0.14 implementation
runs in another environment and is not traced here.
"""

import argparse
import collections
import json
import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import models  # noqa: E402 (bench/models.py: the architectures and implementations)

RESULTS = HERE / "results" / "saved_tensors.json"
# Producers whose outputs are not activations a step keeps: constants, the
# variables' reads (the weights), the inputs, shapes.
NOT_SAVED = {"Const", "ReadVariableOp", "Placeholder", "VarHandleOp", "Shape"}


def saved_set(graph, batch):
    """The forward tensors the backward of a traced training step reads:
    ([{tensor, producer, layers, bytes_per_sample}], [names of those whose
    static shape is unknown, so not counted: e.g. FusedBatchNormV3's
    reserve_space_3, a workspace the kernel sizes at run time]), forward ops
    being those created before the tape's first gradient op, an Identity
    counted as the tensor it forwards."""
    operations = graph.get_operations()
    first = next(
        (i for i, op in enumerate(operations) if op.name.startswith("gradient_tape")),
        len(operations),
    )
    forward = {op.name for op in operations[:first]}
    live = _live_ops(graph)
    saved, unsized = {}, set()
    for op in operations[first:]:
        if op.name not in live:
            continue  # a dead backward op (e.g. dW of a frozen filter): pruned at run time
        for t in op.inputs:
            while t.op.type == "Identity" and t.op.name in forward:
                t = t.op.inputs[0]
            producer = t.op
            if producer.name not in forward or producer.type in NOT_SAVED or t.name in saved:
                continue
            if not t.shape.is_fully_defined():
                unsized.add(t.name)
                continue
            saved[t.name] = {
                "tensor": t.name,
                "producer": producer.type,
                "layers": models._layer_kind(producer.name),
                "bytes_per_sample": t.dtype.size * t.shape.num_elements() / batch,
            }
    return sorted(saved.values(), key=lambda s: -s["bytes_per_sample"]), sorted(unsized)


def _live_ops(graph):
    """Names of the ops a run of the traced function executes: those its
    outputs or its stateful ops (the weight updates) depend on, as TF's
    function runtime prunes the rest (PruneFunctionBody)."""
    ops = graph.get_operations()
    todo = [t.op for t in graph.outputs] + [op for op in ops if op._is_stateful]
    todo += list(getattr(graph, "control_outputs", ()))
    live = set()
    while todo:
        op = todo.pop()
        if op.name in live:
            continue
        live.add(op.name)
        todo.extend(t.op for t in op.inputs)
        todo.extend(op.control_inputs)
    return live


def trace_step(net, loss, optimizer, x, y):
    """The graph of one training step of ``net`` (forward, loss, gradients,
    update), traced, not run."""
    import tensorflow as tf

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, net(x, training=True))
        grads = tape.gradient(value, net.trainable_variables)
        optimizer.apply(grads, net.trainable_variables)
        return value

    return step.get_concrete_function(x, y).graph


def measure(model, impl, estimator, size, batch):
    import keras as K
    import tensorflow as tf

    import tapehook

    K.utils.set_random_seed(0)
    net = models.build(K, model, impl, estimator, size)
    optimizer = (tapehook.optimizers.Adam if impl in models.FUSED_IMPLS else K.optimizers.Adam)(
        1e-3
    )
    optimizer.build(net.trainable_variables)
    graph = trace_step(
        net,
        K.losses.SparseCategoricalCrossentropy(),
        optimizer,
        tf.TensorSpec((batch, size, size, 3), tf.float32),
        tf.TensorSpec((batch,), tf.int64),
    )
    tensors, unsized = saved_set(graph, batch)
    by_layers, by_producer = collections.Counter(), collections.Counter()
    for t in tensors:
        by_layers[t["layers"]] += t["bytes_per_sample"]
        by_producer[t["producer"]] += t["bytes_per_sample"]
    return {
        "model": model,
        "impl": impl,
        "estimator": estimator,
        "size": size,
        "batch": batch,
        "bytes_per_sample": sum(t["bytes_per_sample"] for t in tensors),
        "by_layers": dict(by_layers.most_common()),
        "by_producer": dict(by_producer.most_common()),
        "largest": tensors[:12],
        "unsized": unsized,
    }


def markdown(result):
    mib = 2**20
    lines = []
    for model in dict.fromkeys(r["model"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["model"] == model]
        kinds = list(dict.fromkeys(k for r in rows for k in r["by_layers"]))
        lines += [
            f"{model}, {rows[0]['size']} px, batch {rows[0]['batch']}: MiB per sample kept "
            "for the backward, by the layers that made them",
            "",
            "| impl | input estimator | total | "
            + " | ".join(kinds)
            + " | unsized (not counted) |",
            "|---|---|---|" + "---|" * (len(kinds) + 1),
        ]
        for r in rows:
            cells = [f"{r['by_layers'].get(k, 0) / mib:.2f}" for k in kinds]
            lines.append(
                f"| {r['impl']} | {r['estimator'] or '-'} "
                f"| {r['bytes_per_sample'] / mib:.2f} | "
                + " | ".join(cells)
                + f" | {len(r.get('unsized', []))} |"
            )
        lines.append("")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="birealnet18,quicknet_small")
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(json.loads(RESULTS.read_text())))
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    rows = []
    for model in args.models.split(","):
        for impl in (i for i in models.IMPLS if i != "larq"):  # larq: another environment
            estimators = (
                [None] if impl in models.FLOAT_IMPLS else models.RECIPES[model]["estimators"]
            )
            for estimator in estimators:
                rows.append(measure(model, impl, estimator, args.size, args.batch))
                print(
                    f"{model} {impl} {estimator or '-'}: "
                    f"{rows[-1]['bytes_per_sample'] / 2**20:.2f} MiB/sample",
                    flush=True,
                )
    result = {"rows": rows}
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
