"""The rewrite `tapehook.lite.Interpreter` makes of an LCE file as it loads it.

A residual network's LCE file adds each binary conv's float output to the
block's input in a float ADD (QuickNet: 16 of them). XNNPACK takes each such
ADD as its own partition between two of our ops, so each costs a hand-over
of the cores between the two thread pools, and at two threads it does not
get faster. Here such an ADD becomes the conv's sixth input: the conv adds
it in its output transform, after the same two roundings, so the sum is the
ADD's to the bit. Only the copy in memory changes; the file stays LCE's.
"""

import collections

from tapehook.deploy import flatbuffer

# TFLite's fused activations that LceBconv2d's addend clamp takes: NONE,
# RELU, RELU_N1_TO_1, RELU6 (its custom option "tapehook_add_activation").
_ACTIVATIONS = (0, 1, 2, 3)


def _is_op(model, op, builtin=None, custom=None):
    code = model.operatorCodes[op.opcodeIndex]
    if custom is not None:
        return code.customCode is not None and code.customCode.decode() == custom
    return max(code.builtinCode, code.deprecatedBuiltinCode) == builtin


def _fusable_adds(model, graph):
    """(bconv index, add index, addend tensor, activation) of each ADD to
    take in."""
    schema = flatbuffer._schema()
    float32 = schema.TensorType.FLOAT32
    producer, uses = {}, collections.Counter()
    for i, op in enumerate(graph.operators):
        for t in op.outputs if op.outputs is not None else ():
            producer[t] = i
        for t in op.inputs if op.inputs is not None else ():
            uses[t] += 1
    outputs = set(graph.outputs if graph.outputs is not None else ())

    def shape(t):
        tensor = graph.tensors[t]
        dims = list(tensor.shape) if tensor.shape is not None else None
        signature = tensor.shapeSignature
        if dims is None or (signature is not None and any(d < 0 for d in signature)):
            return None
        return dims

    found = []
    for a, op in enumerate(graph.operators):
        if not _is_op(model, op, builtin=schema.BuiltinOperator.ADD):
            continue
        if op.inputs is None or len(op.inputs) != 2 or len(op.outputs) != 1:
            continue
        options = op.builtinOptions
        activation = options.fusedActivationFunction if options is not None else 0
        if activation not in _ACTIVATIONS:
            continue
        for conv_out, addend in (tuple(op.inputs), tuple(op.inputs)[::-1]):
            b = producer.get(conv_out)
            if b is None or conv_out == addend:
                continue
            conv = graph.operators[b]
            if not _is_op(model, conv, custom="LceBconv2d") or len(conv.inputs) != 5:
                continue
            # The conv's output feeds only this ADD; the addend exists when the
            # conv runs (made before it, or a graph input or constant).
            if uses[conv_out] != 1 or conv_out in outputs:
                continue
            if producer.get(addend, -1) >= b:
                continue
            types = {graph.tensors[t].type for t in (conv_out, addend, op.outputs[0])}
            dims = shape(conv_out)
            if types != {float32} or dims is None or len(dims) != 4:
                continue
            if shape(addend) != dims or shape(op.outputs[0]) != dims:
                continue
            found.append((b, a, addend, activation))
            break
    return found


def fuse_adds(data):
    """(bytes, n): `data` with each float ADD of an LceBconv2d's float output
    and a tensor of the same shape taken into the conv, and how many; the
    input itself (n = 0) when none is, or the file is not one this rewrite
    reads whole (buffers outside the flatbuffer, several subgraphs), or it
    cannot be read: LiteRT's interpreter then says what is wrong with it."""
    try:
        return _fused(data)
    except Exception:  # a corrupt or foreign file: not this rewrite's to judge
        return data, 0


def _fused(data):
    import flatbuffers
    import numpy as np
    from flatbuffers import flexbuffers

    schema = flatbuffer._schema()
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAs(bytearray(data), 0))
    if len(model.subgraphs or ()) != 1 or any((b.offset or 0) > 1 for b in model.buffers or ()):
        return data, 0
    graph = model.subgraphs[0]
    found = _fusable_adds(model, graph)
    if not found:
        return data, 0
    for b, a, addend, activation in found:
        conv, add = graph.operators[b], graph.operators[a]
        conv.inputs = [*conv.inputs, addend]
        conv.outputs = [add.outputs[0]]
        if activation:
            options = flexbuffers.Loads(bytes(bytearray(conv.customOptions)))
            options["tapehook_add_activation"] = int(activation)
            conv.customOptions = np.frombuffer(flexbuffers.Dumps(options), np.uint8)
    dropped = {a for _, a, _, _ in found}
    graph.operators = [op for i, op in enumerate(graph.operators) if i not in dropped]
    builder = flatbuffers.Builder(len(data) + 1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output()), len(found)
