"""export_bitpacked / load_bitpacked: a Keras model with its binary kernels at 1 bit.

The file format (version 1) is specified in docs/bitpacked_format.md. Binary
kernels are stored as sign bits plus alpha per output channel; the latent
float kernel is not stored, so loading sets W = alpha * sign, which the
binary forward turns back into the same W_hat (sign(W) gives the same bits,
and mean |W| per channel is alpha exactly).
"""

import hashlib
import json
import math
import os
import struct
import zlib

import numpy as np
import tensorflow as tf

from tapehook import marks, models, reference
from tapehook.errors import TapehookError
from tapehook.spec import BinarySpec

MAGIC = b"\x89TAPEHK\n"  # like PNG's: catches 7-bit and newline-mangling transfers
FORMAT = "tapehook-bitpacked"
VERSION = 1
_HEADER = struct.Struct("<8sIII")  # magic, version, manifest bytes, manifest CRC32
_ALPHA_DTYPE = "float32"


def binary_kernels(model):
    """(layer, kernel, spec) for each binarizable layer whose kernel is marked,
    in the layer walk of tapehook.summary."""
    found = []
    for layer in model._flatten_layers(include_self=False):
        if not models.is_binarizable(layer):
            continue
        kernel = getattr(layer, "kernel", None)
        spec = marks.binary_spec_of(kernel) if kernel is not None else None
        if spec is not None:
            found.append((layer, kernel, spec))
    return found


def sign_bits(w):
    """True where the binary forward's sign is +1 (w >= 0, zero included)."""
    return np.asarray(w) >= 0


def _numpy_dtype(name):
    return np.dtype(tf.as_dtype(name).as_numpy_dtype).newbyteorder("<")


class _Data:
    """The data section being written: arrays back to back, one record each."""

    def __init__(self):
        self.chunks, self.size = [], 0

    def add(self, array, dtype):
        raw = np.ascontiguousarray(array, dtype=_numpy_dtype(dtype)).tobytes()
        record = {
            "offset": self.size,
            "shape": list(np.shape(array)),
            "dtype": dtype,
            "sha256": hashlib.sha256(raw).hexdigest(),
        }
        self.chunks.append(raw)
        self.size += len(raw)
        return record


def output_axes(layer_type) -> int:
    """Trailing kernel axes that index output channels: 2 for DepthwiseConv2D
    ([h, w, in, multiplier]: one channel per (in, multiplier)), else 1."""
    return 2 if layer_type == "DepthwiseConv2D" else 1


def _alpha(w, spec, out_axes):
    """alpha per output channel as the compiled kernels compute it: |W| summed in
    float64, divided, rounded once to float32."""
    out = math.prod(w.shape[-out_axes:])
    if spec.scale is None:
        return np.ones(out, np.float32)
    flat = np.abs(w.astype(np.float64)).reshape(-1, out)
    return (flat.sum(axis=0) / flat.shape[0]).astype(np.float32)


def _manifest_spec(spec):
    """A stored spec: version 1's fields (``balance`` is never stored: a
    balanced kernel is stored as its binary weights)."""
    config = models.spec_to_config(spec)
    del config["balance"]
    return config


def binary_kernel_value(value, spec, out_axes):
    """The kernel whose signs and alpha a binary layer uses: the latent one,
    or with ``spec.balance`` the balanced one, computed by the same TF ops
    as training's forward so that every sign agrees."""
    if spec.balance is None:
        return value
    return reference.balanced_kernel(tf.constant(value), spec.balance, out_axes).numpy()


def export_bitpacked(model, path) -> dict:
    """Writes ``model``'s weights to ``path``: binary kernels as packed sign bits
    plus alpha and their BinarySpec, every other weight as it is.

    Returns sizes in bytes: ``binary_kernels`` (count), ``binary_weights``,
    ``binary_bytes`` (bits + alpha as stored), ``binary_float32_bytes`` (the
    same kernels at 32 bits), ``other_bytes`` (every other weight) and
    ``file_bytes``.
    """
    weights = _weights(model, "export")
    binary = {id(kernel): (layer, spec) for layer, kernel, spec in binary_kernels(model)}
    data, entries = _Data(), []
    for var in weights:
        value = np.asarray(var.numpy())
        entry = {
            "path": var.path,
            "name": var.name,
            "shape": list(value.shape),
            "dtype": _dtype_name(var),
        }
        if id(var) in binary and binary[id(var)][1].weights:
            layer, spec = binary[id(var)]
            if not np.all(np.isfinite(value.astype(np.float64))):
                raise TapehookError(
                    f"binary kernel {var.path} holds inf or NaN: its sign bits and "
                    f"alpha cannot be stored; fix the weights before exporting"
                )
            out_axes = output_axes(type(layer).__name__)
            # A balanced kernel is stored as the binary weights it gives, under
            # the unbalanced spec: W = alpha * sign reproduces them (balancing
            # that W again would change alpha, and an all-negative row's signs).
            value = binary_kernel_value(value, spec, out_axes)
            spec = spec.unbalanced()
            entry.update(
                kind="binary",
                layer=layer.name,
                layer_type=type(layer).__name__,
                spec=_manifest_spec(spec),
                output_axes=out_axes,
                bits=data.add(np.packbits(_sign_rows(value, out_axes), axis=1), "uint8"),
                alpha=data.add(_alpha(value, spec, out_axes), _ALPHA_DTYPE),
            )
        else:
            entry.update(kind="float", value=data.add(value, entry["dtype"]))
            if id(var) in binary:  # weights=False: a float kernel, binary input
                entry["spec"] = _manifest_spec(binary[id(var)][1])
        entries.append(entry)
    manifest = json.dumps(
        {"format": FORMAT, "version": VERSION, "data_bytes": data.size, "weights": entries},
        indent=1,
    ).encode()
    header = _HEADER.pack(MAGIC, VERSION, len(manifest), zlib.crc32(manifest))
    path = os.fspath(path)
    partial = f"{path}.partial-{os.getpid()}"
    with open(partial, "wb") as f:  # then renamed: a reader never sees half a file
        f.write(header + manifest)
        for chunk in data.chunks:
            f.write(chunk)
    os.replace(partial, path)
    binary_entries = [e for e in entries if e["kind"] == "binary"]
    binary_weights = sum(math.prod(e["shape"]) for e in binary_entries)
    return dict(
        binary_kernels=len(binary_entries),
        binary_weights=binary_weights,
        binary_bytes=sum(_nbytes(e["bits"]) + _nbytes(e["alpha"]) for e in binary_entries),
        binary_float32_bytes=4 * binary_weights,
        other_bytes=sum(_nbytes(e["value"]) for e in entries if e["kind"] == "float"),
        file_bytes=os.path.getsize(path),
    )


def _sign_rows(w, out_axes):
    """[out, K] sign bits: row o is output channel o's weights in C order
    (packbits: first bit in the MSB)."""
    return sign_bits(w).reshape(-1, math.prod(w.shape[-out_axes:])).T


def _nbytes(record):
    return math.prod(record["shape"]) * _numpy_dtype(record["dtype"]).itemsize


def _dtype_name(var):
    return tf.as_dtype(var.dtype).name


def _weights(model, action):
    weights = list(model.weights)
    if not weights:
        raise TapehookError(
            f"cannot {action} {model.name}: it has no weights yet; build it first "
            f"(call it on a batch or use model.build(input_shape))"
        )
    return weights


def _read(path):
    """(manifest, data section) of a file, with header, sizes and the manifest checked."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < _HEADER.size:
        raise TapehookError(f"{path}: truncated ({len(raw)} bytes, shorter than the header)")
    magic, version, manifest_bytes, crc = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise TapehookError(f"{path}: not a tapehook bitpacked file (bad magic {magic!r})")
    if version != VERSION:
        raise TapehookError(
            f"{path}: format version {version}; this tapehook reads version {VERSION}"
        )
    start = _HEADER.size + manifest_bytes
    if len(raw) < start:
        raise TapehookError(f"{path}: truncated inside the manifest")
    manifest_raw = raw[_HEADER.size : start]
    if zlib.crc32(manifest_raw) != crc:
        raise TapehookError(f"{path}: manifest checksum mismatch; the file is corrupt")
    manifest = json.loads(manifest_raw)
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise TapehookError(
            f"{path}: manifest says format {manifest.get('format')!r} version "
            f"{manifest.get('version')!r}, expected {FORMAT!r} version {VERSION}"
        )
    data = raw[start:]
    if len(data) != manifest["data_bytes"]:
        state = "truncated" if len(data) < manifest["data_bytes"] else "has trailing bytes"
        raise TapehookError(
            f"{path}: {state}: data section is {len(data)} bytes, the manifest "
            f"says {manifest['data_bytes']}"
        )
    return manifest, data


def _array(data, record, what):
    """One stored array, its bounds and SHA-256 checked."""
    offset, nbytes = record["offset"], _nbytes(record)
    if not 0 <= offset <= len(data) - nbytes:
        raise TapehookError(f"{what}: bytes {offset}..{offset + nbytes} lie outside the data")
    raw = data[offset : offset + nbytes]
    if hashlib.sha256(raw).hexdigest() != record["sha256"]:
        raise TapehookError(f"{what}: checksum mismatch; the file is corrupt")
    return np.frombuffer(raw, _numpy_dtype(record["dtype"])).reshape(record["shape"])


def _describe(entry):
    return f"{entry['path']} {tuple(entry['shape'])} {entry['dtype']}"


def _target_entry(var):
    return {"path": var.path, "name": var.name, "shape": list(var.shape), "dtype": _dtype_name(var)}


def _check_matches(entries, weights, path):
    """Weights are matched by position in model.weights (paths hold auto-generated
    layer names that differ between two instances of one architecture); name,
    shape and dtype must agree at every position."""
    targets = [_target_entry(var) for var in weights]
    for i in range(max(len(entries), len(targets))):
        stored = entries[i] if i < len(entries) else None
        target = targets[i] if i < len(targets) else None
        same = (
            stored is not None
            and target is not None
            and all(stored[k] == target[k] for k in ("name", "shape", "dtype"))
        )
        if not same:
            raise TapehookError(
                f"{path} does not fit this model: the file has {len(entries)} weights, "
                f"the model {len(targets)}; weight {i} is "
                f"{_describe(stored) if stored else 'missing'} in the file and "
                f"{_describe(target) if target else 'missing'} in the model; load into "
                f"a model of the architecture that was exported"
            )


def _binary_value(entry, data, what):
    """The kernel W = alpha * sign that reproduces the stored bits and alpha."""
    spec = BinarySpec(**entry["spec"])
    shape, dtype = entry["shape"], entry["dtype"]
    out_axes = entry.get("output_axes", 1)
    if out_axes not in (1, 2):
        raise TapehookError(f"{what}: output_axes {out_axes!r} is not 1 or 2")
    k, out = math.prod(shape[:-out_axes]), math.prod(shape[-out_axes:])
    bits = _array(data, entry["bits"], f"{what} sign bits")
    alpha = _array(data, entry["alpha"], f"{what} alpha").astype(np.float32)
    if bits.shape != (out, (k + 7) // 8) or alpha.shape != (out,):
        raise TapehookError(
            f"{what}: bits {bits.shape} / alpha {alpha.shape} do not fit shape {shape}"
        )
    rows = np.unpackbits(bits, axis=1)
    if rows[:, k:].any():
        raise TapehookError(f"{what}: padding bits are set; the file is corrupt")
    if not np.all(np.isfinite(alpha) & (alpha >= 0)):
        raise TapehookError(f"{what}: alpha must be finite and >= 0")
    if spec.scale is None and not np.all(alpha == 1):
        raise TapehookError(f"{what}: alpha must be ones when the spec has no scale")
    signs = rows[:, :k].T.reshape(shape).astype(bool)
    value = (
        alpha.reshape(shape[-out_axes:]) * np.where(signs, 1.0, -1.0).astype(np.float32)
    ).astype(_numpy_dtype(dtype))
    if not np.array_equal(sign_bits(value), signs):
        raise TapehookError(
            f"{what}: alpha * sign does not reproduce the sign bits in {dtype} "
            f"(alpha 0 or below {dtype}'s range on a channel with -1 signs)"
        )
    return value, spec


def load_bitpacked(model, path):
    """Restores a file of ``export_bitpacked`` into ``model`` (same architecture,
    built) and returns it. Binary kernels become alpha * sign and are marked
    with the stored spec. Everything is checked before any weight is assigned:
    on a corrupt file or a mismatched model this raises TapehookError and
    leaves the model as it was."""
    weights = _weights(model, "load into")
    path = os.fspath(path)
    try:
        manifest, data = _read(path)
        entries = manifest["weights"]
        _check_matches(entries, weights, path)
        layers = {
            id(layer.kernel): layer
            for layer in model._flatten_layers(include_self=False)
            if getattr(layer, "kernel", None) is not None
        }
        updates = [
            _update(entry, var, layers.get(id(var)), data, f"{path}: {entry['path']}")
            for entry, var in zip(entries, weights)
        ]
    except TapehookError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise TapehookError(f"{path}: malformed manifest ({exc!r})") from None
    for var, value, _, _ in updates:
        var.assign(value)
    for var, _, spec, layer in updates:
        if spec is not None:
            marks.set_mark(var, spec)
            if layer is not None:
                models.restore_layer_spec(layer, models.spec_to_config(spec))
    return model


def _update(entry, var, layer, data, what):
    """(variable, value, spec or None, layer) for one stored weight, all checked."""
    binary_layer = layer is not None and models.is_binarizable(layer)
    if entry["kind"] == "binary":
        if not binary_layer:
            owner = f"a {type(layer).__name__} kernel" if layer else "not a layer's kernel"
            raise TapehookError(
                f"{what} is stored binary, but the model's {var.path} is {owner}; only "
                f"Conv1D / Conv2D / DepthwiseConv2D / Dense kernels can be binary"
            )
        value, spec = _binary_value(entry, data, what)
        return var, value, spec, layer
    if entry["kind"] != "float":
        raise TapehookError(f"{what}: unknown kind {entry['kind']!r}")
    spec = BinarySpec(**entry["spec"]) if entry.get("spec") else None
    if spec is None and binary_layer and marks.binary_spec_of(var) is not None:
        raise TapehookError(
            f"{what} is stored float, but the model marks {var.path} binary; unmark it "
            f"(or binarize fewer layers) so the loaded model computes what was exported"
        )
    return var, _array(data, entry["value"], what), spec, layer
