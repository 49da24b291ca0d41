"""What a .tflite file holds: its operators and constant tensors, read from the
flatbuffer itself (TF's generated schema reader), not from an interpreter."""

import collections
import functools


@functools.cache
def _schema():
    # Imported on first use: `import tapehook` does not load TFLite's schema.
    from tensorflow.lite.python import schema_py_generated as schema

    return schema


def _names(enum):
    return {v: k for k, v in vars(enum).items() if not k.startswith("_")}


def _model(data):
    return _schema().Model.GetRootAs(bytearray(data), 0)


def _op_name(code):
    if code.CustomCode():
        return code.CustomCode().decode()
    builtin = max(code.BuiltinCode(), code.DeprecatedBuiltinCode())
    return _names(_schema().BuiltinOperator).get(builtin, f"BUILTIN_{builtin}")


def operators(data):
    """Operator names of the main subgraph in execution order (custom ops by
    their custom code, e.g. "LceBconv2d")."""
    model = _model(data)
    codes = [_op_name(model.OperatorCodes(i)) for i in range(model.OperatorCodesLength())]
    graph = model.Subgraphs(0)
    return [codes[graph.Operators(i).OpcodeIndex()] for i in range(graph.OperatorsLength())]


def op_counts(data):
    return dict(collections.Counter(operators(data)))


def constants(data):
    """(name, type, shape, bytes) of every tensor of the main subgraph backed
    by a non-empty buffer, i.e. the stored weights."""
    model = _model(data)
    graph = model.Subgraphs(0)
    found = []
    for i in range(graph.TensorsLength()):
        tensor = graph.Tensors(i)
        buffer = model.Buffers(tensor.Buffer())
        size = buffer.DataLength() or buffer.Size()
        if size:
            found.append(
                (
                    tensor.Name().decode(),
                    _names(_schema().TensorType).get(tensor.Type(), "?"),
                    tuple(int(d) for d in tensor.ShapeAsNumpy()) if tensor.ShapeLength() else (),
                    int(size),
                )
            )
    return found
