"""export_tflite (LiteRT or Larq Compute Engine) and export_savedmodel.

Both build the deploy graph of graph.py, check what the converter made of
it, and write the result next to ``path`` first, renaming it into place only
when it is complete and checked: nothing half-written is left at ``path``.
"""

import contextlib
import os
import pathlib
import shutil
import tempfile
import warnings

import numpy as np
import tensorflow as tf

from tapehook.deploy import flatbuffer, graph, lce_env
from tapehook.errors import TapehookError

TARGETS = ("litert", "lce")
LCE_BCONV = "LceBconv2d"


def _destination(path, directory):
    """``path`` as a Path whose parent exists and is writable."""
    path = pathlib.Path(os.fspath(path)).expanduser()
    parent = path.parent.resolve()
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise TapehookError(
            f"cannot write {path}: {parent} is not a writable directory; "
            f"create it or pick a path you can write to"
        )
    if directory and path.exists() and not path.is_dir():
        raise TapehookError(
            f"cannot write a SavedModel to {path}: it is a file; remove it or pick another path"
        )
    if (
        directory
        and path.is_dir()
        and any(path.iterdir())
        and not (path / "saved_model.pb").exists()
    ):
        # Only an empty directory or an earlier SavedModel is replaced.
        raise TapehookError(
            f"cannot write a SavedModel to {path}: it is a directory "
            f"holding other files; pick a new or empty directory"
        )
    if not directory and path.is_dir():
        raise TapehookError(
            f"cannot write {path}: it is a directory; give a file path "
            f"such as {path / 'model.tflite'}"
        )
    return path


def _place(staged, path):
    """Moves the finished ``staged`` file or directory to ``path``."""
    if staged.is_dir() and path.is_dir():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
        os.replace(staged, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staged, path)


@contextlib.contextmanager
def _staging(path):
    """A scratch directory beside ``path`` (same file system, so the final
    rename is atomic), removed whatever happens."""
    try:
        scratch = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    except OSError as exc:
        raise TapehookError(f"cannot write beside {path} ({exc}); pick a writable path")
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _save(frozen, directory):
    """The frozen graph as a SavedModel with one serving signature."""

    @tf.function(
        input_signature=[
            tf.TensorSpec(a.shape, a.dtype, name=f"input_{i}") for i, a in enumerate(frozen.inputs)
        ]
    )
    def serve(*inputs):
        outputs = tf.nest.flatten(frozen(*inputs))
        return {f"output_{i}": y for i, y in enumerate(outputs)}

    module = tf.Module()
    module.serve = serve
    # The graph serves inference only: a layer's tf.custom_gradient (tapehook's
    # recipes binarizers) would otherwise have its gradient traced, and refused.
    options = tf.saved_model.SaveOptions(experimental_custom_gradients=False)
    tf.saved_model.save(
        module, str(directory), signatures={"serving_default": serve}, options=options
    )


def _report(path, model, binaries, warned, target, filters="bits"):
    rows = graph.layer_rows(model, binaries, target, filters)
    report = {
        "path": str(path),
        "bytes": _size(path),
        "binary_layers": len(binaries),
        "layers": rows,
        "warnings": list(warned),
    }
    if not binaries:
        message = (
            f"{model.name} has no binary layer: the export holds float ops only; "
            f"binarize it (tapehook.binarize) before exporting for 1-bit weights"
        )
        report["warnings"].append(message)
        warnings.warn(message, stacklevel=3)
    return report


def _size(path):
    path = pathlib.Path(path)
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def export_savedmodel(model, path) -> dict:
    """Writes ``model``'s inference graph as a SavedModel of stock TF ops.

    Binary layers become sign(x) (binary activations), a conv / matmul with a
    ±1 filter unpacked from 1-bit constants and alpha as a separate multiply;
    every weight is a constant. (A ±1 filter stored as a float constant would
    let Grappler fold alpha into it, which breaks the exact integer sums.) It loads with ``tf.saved_model.load`` (signature
    ``serving_default``: ``input_0``... to ``output_0``...) in a process that
    never imports tapehook, and serves in TF Serving. Returns a dict with
    ``path``, ``bytes``, ``binary_layers``, ``layers`` and ``warnings``.
    """
    path = _destination(path, directory=True)
    frozen, binaries = graph.frozen_function(model, filters="bits")
    with _staging(path) as scratch:
        _save(frozen, scratch / "model")
        _place(scratch / "model", path)
    return _report(path, model, binaries, [], "savedmodel")


def _litert_flatbuffer(frozen):
    converter = tf.lite.TFLiteConverter.from_concrete_functions([frozen])
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return converter.convert()
    except Exception as exc:  # the converter raises ConverterError and others
        raise TapehookError(
            f"TensorFlow's TFLite converter refused the model: {str(exc)[-2000:]}\n"
            f"a layer uses an op LiteRT's builtin ops lack; replace or remove it"
        )


def _lce_check(binaries, model):
    for b in binaries:
        if b.kind == "conv2d" and not b.lce_bconv:
            what = (
                "float inputs (activations=False)"
                if b.binary_weights
                else "a float kernel (weights=False)"
            )
            raise TapehookError(
                f"binary layer {b.name!r} of {model.name} has {what}: LCE's LceBconv2d "
                f"needs binary inputs and binary weights, so this conv cannot be an "
                f"LceBconv2d; export with target='litert' or binarize with "
                f"activations=True and weights=True"
            )


def _lce_flatbuffer(frozen, scratch):
    _save(frozen, scratch / "saved_model")
    out = scratch / "lce.tflite"
    lce_env.worker("convert", scratch / "saved_model", out)
    return out.read_bytes()


def _verify(data, binaries, target, model, filters="bits"):
    """Checks the converter's output; returns (op counts, warnings)."""
    counts = flatbuffer.op_counts(data)
    if target == "litert":
        custom = sorted(op for op in counts if not op.isupper())
        if custom:
            raise TapehookError(
                f"the LiteRT file for {model.name} holds custom ops "
                f"{custom}; LiteRT's stock interpreter cannot run it"
            )
        packed = sum(b.binary_weights for b in binaries) if filters == "bits" else 0
        if counts.get("BITWISE_XOR", 0) != packed:
            # One unpacking per binary layer, else the converter folded a
            # filter back to floats (and may have folded alpha into it).
            raise TapehookError(
                f"TensorFlow's converter folded the 1-bit filters of {model.name} "
                f"({counts.get('BITWISE_XOR', 0)} of {packed} kept); this "
                f"TensorFlow version is not supported by target='litert' yet"
            )
        return counts, []
    expected = sum(b.lce_bconv for b in binaries)
    if counts.get(LCE_BCONV, 0) != expected:
        raise TapehookError(
            f"LCE's converter made {counts.get(LCE_BCONV, 0)} {LCE_BCONV} of "
            f"{model.name}'s {expected} binary Conv2D layers (ops: {counts}); the model "
            f"has a binary conv in a form LCE does not fuse; export it with "
            f"target='litert'"
        )
    notes = []
    for b in binaries:
        if b.kind != "conv2d":
            notes.append(
                f"{b.name} ({type(b.layer).__name__}) is binary but LCE has no "
                f"1-bit op for it: it runs as float ops with ±alpha weights"
            )
    return counts, notes


def export_tflite(model, path, *, target="litert", filters="bits") -> dict:
    """Writes ``model`` as a .tflite flatbuffer at ``path``.

    ``target="litert"``: TensorFlow's own TFLite converter, stock builtin ops
    only (runs in ``ai_edge_litert``). ``filters="bits"`` (the smallest
    file) stores binary filters as packed sign bits unpacked at run time,
    which XNNPACK cannot take; ``filters="float"`` (the fast file) stores them
    as float ±1 constants, 32 bits per weight, which XNNPACK runs at float
    speed. alpha is a float multiply after the conv in both.
    ``target="lce"``: Larq Compute Engine 0.16's converter, run in a cached
    side environment; every binary Conv2D becomes an ``LceBconv2d`` with
    1-bit weights. Models with a weight-only binary Conv2D are refused.
    Both compute in float32, also for a mixed-precision model.

    Returns ``path``, ``bytes``, ``binary_layers``, ``layers`` (per layer:
    binary, spec, float32 bytes), ``ops`` (operator counts in the file),
    ``target`` and ``warnings``. See docs/deploy.md.
    """
    if target not in TARGETS:
        raise TapehookError(f"unknown target={target!r}; use 'litert' or 'lce'")
    if filters not in ("bits", "float"):
        raise TapehookError(
            f"unknown filters={filters!r}; use 'bits' (smallest file) or 'float' (fastest)"
        )
    if target == "lce" and filters != "bits":
        raise TapehookError(
            "filters= chooses how target='litert' stores binary filters; LCE's converter "
            "always packs them to 1 bit: leave filters='bits'"
        )
    path = _destination(path, directory=False)
    graph.check_built(model)
    if target == "lce":
        _lce_check(graph.binary_layers(model), model)
    frozen, binaries = graph.frozen_function(
        model, filters=("bits" if filters == "bits" else "float") if target == "litert" else "lce"
    )
    with _staging(path) as scratch:
        if target == "litert":
            data = _litert_flatbuffer(frozen)
        else:
            data = _lce_flatbuffer(frozen, scratch)
        counts, notes = _verify(data, binaries, target, model, filters)
        staged = scratch / "model.tflite"
        staged.write_bytes(data)
        _place(staged, path)
    report = _report(path, model, binaries, notes, target, filters)
    report.update(target=target, ops=counts, filters=filters)
    return report


def run_tflite(path, inputs, *, target="litert", time_repeats=0):
    """Runs an exported file on ``inputs`` (an array with a batch axis, or a
    list of them): LiteRT's interpreter in this process, or LCE's in its side
    environment. Returns the outputs (an array, or a list), and with
    ``time_repeats`` also the median seconds of one batch-1 call."""
    arrays = [np.asarray(x) for x in (inputs if isinstance(inputs, (list, tuple)) else [inputs])]
    if target == "litert":
        outputs, seconds = _run_litert(path, arrays, time_repeats)
    elif target == "lce":
        outputs, seconds = _run_lce(path, arrays, time_repeats)
    else:
        raise TapehookError(f"unknown target={target!r}; use 'litert' or 'lce'")
    result = outputs[0] if len(outputs) == 1 else outputs
    return (result, seconds) if time_repeats else result


def _run_litert(path, arrays, repeats):
    import time

    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:
        raise TapehookError(
            "running a LiteRT file needs ai-edge-litert: "
            "pip install ai-edge-litert (or tapehook[deploy])"
        ) from None
    interpreter = Interpreter(model_path=str(path), num_threads=1)
    inputs = interpreter.get_input_details()
    for detail, x in zip(inputs, arrays):
        interpreter.resize_tensor_input(detail["index"], x.shape)
    interpreter.allocate_tensors()
    for detail, x in zip(inputs, arrays):
        interpreter.set_tensor(detail["index"], x.astype(detail["dtype"]))
    interpreter.invoke()
    outputs = [interpreter.get_tensor(d["index"]) for d in interpreter.get_output_details()]
    seconds = None
    if repeats:
        for detail, x in zip(inputs, arrays):
            interpreter.resize_tensor_input(detail["index"], (1, *x.shape[1:]))
        interpreter.allocate_tensors()
        for detail, x in zip(inputs, arrays):
            interpreter.set_tensor(detail["index"], x[:1].astype(detail["dtype"]))
        times = []
        for i in range(repeats + 3):
            start = time.perf_counter()
            interpreter.invoke()
            if i >= 3:
                times.append(time.perf_counter() - start)
        seconds = float(np.median(times))
    return outputs, seconds


def _run_lce(path, arrays, repeats):
    with tempfile.TemporaryDirectory(prefix="tapehook-lce-") as scratch:
        scratch = pathlib.Path(scratch)
        np.savez(scratch / "in.npz", **{f"x{i}": x for i, x in enumerate(arrays)})
        args = ["run", pathlib.Path(path).resolve(), scratch / "in.npz", scratch / "out.npz"]
        if repeats:
            args += ["--time", str(repeats)]
        lce_env.worker(*args)
        with np.load(scratch / "out.npz") as data:
            outputs = [data[f"y{i}"] for i in range(len(data.files)) if f"y{i}" in data.files]
            seconds = float(data["seconds"]) if "seconds" in data.files else None
    return outputs, seconds
