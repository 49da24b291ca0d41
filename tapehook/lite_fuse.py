"""The rewrite `tapehook.lite.Interpreter` makes of an LCE file as it loads it.

LCE's converter leaves float elementwise ops after a binary conv: QuickNet's
residual ADD, Bi-Real-Net's SUB, MUL, MUL (the zero-padding correction and
the batch norm) and its residual ADD. XNNPACK takes each run of them as its
own partition between two of our ops, so each costs a hand-over of the cores
between the two thread pools, and at two threads they do not get faster.
Here such a chain becomes the conv's epilogue: its operands are the conv's
inputs 5, 6, ... and its steps a custom option, and the conv applies each
step after its own output transform as the op itself would (one IEEE
operation and the op's fused activation each), so the results are the ops'
to the bit. Only the copy in memory changes; the file stays LCE's.
"""

import collections

from tapehook.deploy import flatbuffer

# Steps as LceBconv2d reads them (cc_kernels/lite/lce_ops.cc): the op in the
# low 3 bits, TFLite's fused activation (NONE, RELU, RELU_N1_TO_1, RELU6)
# above them, 6 bits a step.
_SUB_FROM, _SUB, _MUL, _ADD = range(4)
_MAX_STEPS = 8


def _code(model, op):
    code = model.operatorCodes[op.opcodeIndex]
    if code.customCode is not None:
        return code.customCode.decode()
    return max(code.builtinCode, code.deprecatedBuiltinCode)


def _chains(model, graph):
    """(conv index, [(op index, operand tensor, step code)]) for each conv
    whose float output runs through elementwise ops to take in."""
    schema = flatbuffer._schema()
    ops = schema.BuiltinOperator
    float32 = schema.TensorType.FLOAT32
    # An op's absent tensor lists read as None in the object API.
    for op in graph.operators:
        op.inputs = [] if op.inputs is None else list(op.inputs)
        op.outputs = [] if op.outputs is None else list(op.outputs)
    producer, consumers = {}, collections.defaultdict(list)
    for i, op in enumerate(graph.operators):
        for t in op.outputs:
            producer[t] = i
        for t in op.inputs:
            consumers[t].append(i)
    outputs = set(graph.outputs if graph.outputs is not None else ())

    def dims(t):
        tensor = graph.tensors[t]
        signature = tensor.shapeSignature
        if tensor.shape is None or (signature is not None and any(d < 0 for d in signature)):
            return None
        return [int(d) for d in tensor.shape]

    def operand_fits(t, shape, conv_index):
        """One value, one per channel, or the output's shape made before the
        conv runs (or a constant or graph input)."""
        d = dims(t)
        if d is None or graph.tensors[t].type != float32:
            return False
        size = 1
        for n in d:
            size *= n
        if size == 1 or (d and d[-1] == shape[-1] and size == shape[-1]):
            return True
        return d == shape and producer.get(t, -1) < conv_index

    found = []
    for b, conv in enumerate(graph.operators):
        if _code(model, conv) != "LceBconv2d" or len(conv.inputs) != 5 or not conv.outputs:
            continue
        t = conv.outputs[0]
        shape = dims(t)
        if shape is None or len(shape) != 4 or graph.tensors[t].type != float32:
            continue
        steps = []
        while len(steps) < _MAX_STEPS and t not in outputs and len(consumers[t]) == 1:
            i = consumers[t][0]
            op = graph.operators[i]
            kind = _code(model, op)
            if kind not in (ops.SUB, ops.MUL, ops.ADD) or len(op.inputs) != 2 or not op.outputs:
                break
            other = op.inputs[1] if op.inputs[0] == t else op.inputs[0]
            out = op.outputs[0]
            if other == t or not operand_fits(other, shape, b):
                break
            if dims(out) != shape or graph.tensors[out].type != float32:
                break
            options = op.builtinOptions
            activation = getattr(options, "fusedActivationFunction", 0) or 0
            if activation not in (0, 1, 2, 3):
                break
            if kind == ops.SUB:
                step = _SUB if op.inputs[0] == t else _SUB_FROM
            else:
                step = _MUL if kind == ops.MUL else _ADD
            steps.append((i, other, step | activation << 3))
            t = out
        if steps:
            found.append((b, steps))
    return found


def fuse_epilogues(data):
    """(bytes, n): `data` with each chain of float SUB / MUL / ADD ops after
    an LceBconv2d's float output (each with one value, one per channel or a
    tensor of the output's shape) taken into the conv, and how many ops; the
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
    found = _chains(model, graph)
    if not found:
        return data, 0
    dropped = set()
    for b, steps in found:
        conv = graph.operators[b]
        conv.inputs = [*conv.inputs, *(operand for _, operand, _ in steps)]
        conv.outputs = [graph.operators[steps[-1][0]].outputs[0]]
        options = flexbuffers.Loads(bytes(bytearray(conv.customOptions)))
        options["tapehook_epilogue_steps"] = len(steps)
        options["tapehook_epilogue"] = sum(code << (6 * k) for k, (_, _, code) in enumerate(steps))
        conv.customOptions = np.frombuffer(flexbuffers.Dumps(options), np.uint8)
        dropped.update(i for i, _, _ in steps)
    graph.operators = [op for i, op in enumerate(graph.operators) if i not in dropped]
    builder = flatbuffers.Builder(len(data) + 1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output()), len(dropped)
