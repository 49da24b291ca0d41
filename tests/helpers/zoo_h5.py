"""Stand-ins for larq-zoo weight files, rebuilt from a committed skeleton.

A tf-keras ``save_weights`` HDF5 file is fully described by its groups, its
attributes (``layer_names``, each layer's ``weight_names``, ...) and its
datasets' names, shapes and dtypes; only the datasets' values make it large.
``skeleton_of`` records the first three, and ``write_h5`` writes a file with
the same structure whose values come from ``weight_value``: a seeded
generator that scripts/zoo_reference.py (tf-keras, larq-zoo) and
tests/test_zoo_reference.py (tapehook.zoo) both run, so the two sides load
identical weights without a 50 MB file in the repository.

Only numpy and h5py: it runs in the larq side environment too.
"""

import math

import h5py
import numpy as np

# Keep in step with the fixtures: changing a rule changes every recorded output.
GENERATOR = {
    "name": "zoo_h5.weight_value",
    "rules": {
        "kernel, depthwise_kernel": "uniform(-1, 1) * sqrt(3 / fan_in)",
        "moving_variance, gamma": "uniform(0.5, 1.5)",
        "moving_mean, beta, bias": "uniform(-0.5, 0.5)",
        "alpha (PReLU)": "uniform(0.05, 0.45)",
    },
    "fan_in": "product of all dims but the last (a depthwise kernel: its spatial dims)",
    "state": "np.random.RandomState([seed, index]); index counts datasets in h5 order "
    "(root layer_names, then each layer's weight_names), from 0",
    "scales": "a fixture may multiply a dataset by a factor (the classifier's, so that "
    "the softmax is neither saturated nor flat)",
}


def _attr_to_json(attrs, key):
    stored = attrs.get_id(key)
    value = attrs[key]
    string = h5py.check_string_dtype(stored.dtype)
    if string is not None:
        encoded = np.asarray(value, dtype=object)
        return {
            "string": string.encoding,
            "length": string.length,
            "shape": list(stored.shape),
            "value": [
                v.decode() if isinstance(v, bytes) else v for v in encoded.reshape(-1).tolist()
            ],
        }
    array = np.asarray(value)
    return {
        "dtype": array.dtype.str,
        "shape": list(array.shape),
        "value": array.reshape(-1).tolist(),
    }


def _attr_from_json(spec):
    shape = tuple(spec["shape"])
    if "string" in spec:
        dtype = h5py.string_dtype(encoding=spec["string"], length=spec["length"])
        values = spec["value"]
        if spec["length"] is not None:
            values = [v.encode(spec["string"]) for v in values]
        data = np.array(values, dtype=object if spec["length"] is None else dtype)
        return data.reshape(shape) if shape else data.reshape(()).item(), dtype, shape
    data = np.array(spec["value"], dtype=spec["dtype"]).reshape(shape)
    return data, data.dtype, shape


def skeleton_of(path):
    """Every group, attribute and dataset (name, shape, dtype) of an HDF5 file."""
    groups, datasets = [], []

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset):
            datasets.append({"path": name, "shape": list(obj.shape), "dtype": obj.dtype.str})
            if obj.attrs:
                raise ValueError(f"{path}: dataset {name} has attributes; not supported")
        else:
            groups.append(
                {"path": name, "attrs": {k: _attr_to_json(obj.attrs, k) for k in obj.attrs}}
            )

    with h5py.File(path, "r") as f:
        root = {k: _attr_to_json(f.attrs, k) for k in f.attrs}
        f.visititems(visit)
    return {"attrs": root, "groups": groups, "datasets": datasets}


def weight_order(skeleton):
    """Dataset paths in the order tf-keras reads them back (layer by layer)."""
    by_group = {g["path"]: g for g in skeleton["groups"]}
    order = []
    for layer in skeleton["attrs"]["layer_names"]["value"]:
        names = by_group[layer]["attrs"]["weight_names"]
        order.extend(f"{layer}/{name}" for name in names["value"] if "string" in names)
    known = {d["path"] for d in skeleton["datasets"]}
    if sorted(order) != sorted(known):
        raise ValueError("the skeleton's weight_names do not list exactly its datasets")
    return order


def weight_value(path, shape, dtype, seed, index, scale=1.0):
    """The value of dataset ``path`` (see GENERATOR)."""
    rng = np.random.RandomState([seed, index])
    kind = path.rsplit("/", 1)[-1].split(":")[0]
    if kind in ("kernel", "depthwise_kernel"):
        fan_in = math.prod(shape[:-2] if kind == "depthwise_kernel" else shape[:-1])
        value = rng.uniform(-1.0, 1.0, shape) * math.sqrt(3.0 / fan_in)
    elif kind in ("moving_variance", "gamma"):
        value = rng.uniform(0.5, 1.5, shape)
    elif kind in ("moving_mean", "beta", "bias"):
        value = rng.uniform(-0.5, 0.5, shape)
    elif kind == "alpha":
        value = rng.uniform(0.05, 0.45, shape)
    else:
        raise ValueError(f"no generator rule for weight {path!r}")
    return (value * scale).astype(dtype)


def weight_values(skeleton, seed, scales=None):
    """{dataset path: value} for every dataset; ``scales`` maps a dataset
    path to a factor (default 1)."""
    shapes = {d["path"]: d for d in skeleton["datasets"]}
    scales = scales or {}
    return {
        path: weight_value(
            path, shapes[path]["shape"], shapes[path]["dtype"], seed, i, scales.get(path, 1.0)
        )
        for i, path in enumerate(weight_order(skeleton))
    }


def write_h5(skeleton, path, seed, scales=None):
    """An HDF5 file with ``skeleton``'s structure and generated values."""
    values = weight_values(skeleton, seed, scales)
    with h5py.File(path, "w") as f:
        for key, spec in skeleton["attrs"].items():
            data, dtype, shape = _attr_from_json(spec)
            f.attrs.create(key, data, shape=shape, dtype=dtype)
        for group in skeleton["groups"]:
            g = f.require_group(group["path"])
            for key, spec in group["attrs"].items():
                data, dtype, shape = _attr_from_json(spec)
                g.attrs.create(key, data, shape=shape, dtype=dtype)
        for d in skeleton["datasets"]:
            f.create_dataset(d["path"], data=values[d["path"]])
    return path


def differences(a, b):
    """How two HDF5 files differ in groups, attributes (value and type) and
    datasets (shape, dtype, values); [] when they do not."""
    found = []

    def attrs(pa, pb, where):
        if sorted(pa.attrs) != sorted(pb.attrs):
            found.append(f"{where}: attribute names {sorted(pa.attrs)} != {sorted(pb.attrs)}")
            return
        for key in pa.attrs:
            ida, idb = pa.attrs.get_id(key), pb.attrs.get_id(key)
            if ida.shape != idb.shape or ida.dtype != idb.dtype:
                found.append(f"{where}@{key}: {ida.shape} {ida.dtype} != {idb.shape} {idb.dtype}")
            elif h5py.check_string_dtype(ida.dtype) != h5py.check_string_dtype(idb.dtype):
                found.append(f"{where}@{key}: string types differ")
            elif not np.array_equal(np.asarray(pa.attrs[key]), np.asarray(pb.attrs[key])):
                found.append(f"{where}@{key}: values differ")

    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        attrs(fa, fb, "/")
        names_a, names_b = [], []
        fa.visit(names_a.append)
        fb.visit(names_b.append)
        if names_a != names_b:
            found.append(f"objects differ: {sorted(set(names_a) ^ set(names_b))[:10]}")
            return found
        for name in names_a:
            oa, ob = fa[name], fb[name]
            if type(oa) is not type(ob):
                found.append(f"{name}: {type(oa).__name__} != {type(ob).__name__}")
                continue
            attrs(oa, ob, name)
            if isinstance(oa, h5py.Dataset):
                if oa.shape != ob.shape or oa.dtype != ob.dtype:
                    found.append(f"{name}: {oa.shape} {oa.dtype} != {ob.shape} {ob.dtype}")
                elif not np.array_equal(oa[()], ob[()]):
                    found.append(f"{name}: values differ")
    return found
