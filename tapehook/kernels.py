"""Builds, caches and loads the compiled kernels (cc_kernels/) for the installed TF.

The library is built on first use with tf.sysconfig's flags into a cache keyed by
TF version, compiler, flags and a hash of the sources, so a library built for one
TF version is never loaded into another. If it cannot be built or loaded,
binary convs run on the reference path (plain TF ops, same math), a warning is
emitted once, and ``kernel_info()`` says why.

``tapehook.config``'s ``kernels`` chooses the backend, read where a binary
conv is built: ``auto`` (default), ``reference`` (binary convs on the
reference path) or ``compiled`` (a library that could not be built or loaded
is an error). Its environment variable, ``TAPEHOOK_KERNELS``, also decides
at import: under ``reference`` the library is not built until a setting
asks for it.
"""

import ctypes
import fcntl
import functools
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import tensorflow as tf

from tapehook import cuda_build, dispatch
from tapehook.config import config
from tapehook.errors import TapehookError

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
LIBRARY_NAME = "libtapehook_ops.so"
BINARY_OP = "TapehookBinaryConv2D"  # the compiled forward's op type
# The fully binary forward with a per-channel affine output transform (an
# inference batch norm folded in: conv2d.fold_output_affine).
AFFINE_OP = "TapehookBinaryConv2DAffine"
# The same plus an addend of the output's shape (the residual add after that
# batch norm folded in too: conv2d.fold_residual_add).
AFFINE_ADD_OP = "TapehookBinaryConv2DAffineAdd"
_COUNT_KINDS = ("forward", "backprop_input", "backprop_filter")


def backprop_dy() -> str:
    """The backprop_dy setting in force here (tapehook.config): the
    backprop ops' ``backprop_dy`` attr, how the AMX backprops split dy into
    bf16 parts (cc_kernels/core/binary_conv.h DySplit). Read where a binary
    backward is built."""
    return config.get("backprop_dy")


def binary_op_attrs(op) -> dict:
    """The attrs of a TapehookBinaryConv2D(Affine, AffineAdd) op that its
    plain forward takes (all but the inferred T and num_threshold, and the
    affine ops' relu)."""
    skip = ("T", "num_threshold", "relu")
    return {name: op.get_attr(name) for name in op.node_def.attr if name not in skip}


def op_threshold(op) -> list:
    """The threshold inputs of such an op: [] or [beta] (its last input)."""
    try:
        count = op.get_attr("num_threshold")
    except ValueError:  # a graph op written before the input existed
        count = 0
    return list(op.inputs[len(op.inputs) - count :])


_lock = threading.Lock()
_state = {"tried": False, "library": None, "cdll": None, "info": None}
_forced_reference = [False]


def source_dir() -> pathlib.Path:
    """cc_kernels/: shipped inside the package on install, top-level in a checkout."""
    for candidate in (_PACKAGE_DIR / "_cc_kernels", _PACKAGE_DIR.parent / "cc_kernels"):
        if (candidate / "core").is_dir():
            return candidate
    raise TapehookError(
        "tapehook's C++ sources (cc_kernels/) are missing from the installation; "
        "reinstall tapehook with `pip install -e .` from a checkout"
    )


def _sources(root):
    return sorted(p for sub in ("core", "tf") for p in (root / sub).glob("*.cc"))


def _compiler():
    return os.environ.get("CXX", "g++")


def build_flags(root):
    """(compile flags, link flags) for the installed TensorFlow."""
    compile_flags = [
        "-O3",
        "-fPIC",
        "-Wall",
        "-Wno-sign-compare",
        "-Wno-deprecated-declarations",
        "-Wno-interference-size",
        *tf.sysconfig.get_compile_flags(),
        "-std=c++17",
        f'-DTAPEHOOK_TF_VERSION="{tf.__version__}"',
        f"-I{root}",
    ]
    return compile_flags, list(tf.sysconfig.get_link_flags())


def cuda_plan():
    """(build CUDA kernels?, reason if not) for the installed TensorFlow."""
    if os.environ.get("TAPEHOOK_NO_CUDA"):
        return False, "TAPEHOOK_NO_CUDA is set"
    if not tf.test.is_built_with_cuda():
        return False, f"this TensorFlow ({tf.__version__}) is a CPU-only build"
    reason = cuda_build.cuda_unavailable_reason()
    return reason is None, reason


def compiler_version() -> str:
    """The C++ compiler's first --version line (part of every build's cache
    key), or a TapehookError naming the fix when there is none."""
    try:
        return subprocess.run(
            [_compiler(), "--version"], capture_output=True, text=True, check=True
        ).stdout.splitlines()[0]
    except (OSError, subprocess.CalledProcessError) as exc:
        raise TapehookError(
            f"no C++ compiler: `{_compiler()} --version` failed ({exc}); install g++ "
            f"(Debian: apt install g++) or set CXX"
        ) from None


def _cache_key(root, compile_flags, link_flags, with_cuda):
    version = compiler_version()
    digest = hashlib.sha256()
    if with_cuda:
        nvcc = cuda_build.find_nvcc()
        version += subprocess.run(
            [nvcc, "--version"], capture_output=True, text=True
        ).stdout + " ".join(cuda_build.gencode_flags())
    for part in (tf.__version__, version, *compile_flags, *link_flags):
        digest.update(part.encode() + b"\0")
    for path in sorted(root.rglob("*")):
        # lite/ is the LiteRT library's (tapehook.lite_build), not this one's.
        if "lite" in path.relative_to(root).parts[:1]:
            continue
        if path.suffix in (".cc", ".h", ".cu") and (with_cuda or "cuda" not in path.parts):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes())
    return f"tf{tf.__version__}-{digest.hexdigest()[:16]}"


def cache_root() -> pathlib.Path:
    default = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache"))
    return pathlib.Path(os.environ.get("TAPEHOOK_CACHE_DIR", default / "tapehook"))


def _compile(root, compile_flags, link_flags, out_path, with_cuda):
    """Compiles each source to an object (at most 2 at once), then links.

    With CUDA, cc_kernels/cuda/*.cu are compiled by nvcc first, and
    -DGOOGLE_CUDA=1 turns on the GPU registrations in tf/binary_conv_ops_gpu.cc.
    """
    with tempfile.TemporaryDirectory(prefix="tapehook-build-") as tmp:
        objects, jobs = [], []
        if with_cuda:
            cuda_objects, cuda_cflags, cuda_ldflags = cuda_build.compile_cuda(root, tmp)
            objects += [pathlib.Path(o) for o in cuda_objects]
            compile_flags = [*compile_flags, *cuda_cflags]
            link_flags = [*link_flags, *cuda_ldflags]
        for src in _sources(root):
            obj = pathlib.Path(tmp) / (src.parent.name + "_" + src.stem + ".o")
            objects.append(obj)
            jobs.append([_compiler(), *compile_flags, "-c", str(src), "-o", str(obj)])
        for i in range(0, len(jobs), 2):
            running = [
                subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for cmd in jobs[i : i + 2]
            ]
            for cmd, proc in zip(jobs[i : i + 2], running):
                output = proc.communicate()[0]
                if proc.returncode:
                    raise TapehookError(f"compiling {cmd[-3]} failed:\n{output[-4000:]}")
        tmp_lib = pathlib.Path(tmp) / LIBRARY_NAME
        link = subprocess.run(
            [_compiler(), "-shared", *map(str, objects), "-o", str(tmp_lib), *link_flags],
            capture_output=True,
            text=True,
        )
        if link.returncode:
            raise TapehookError(f"linking {LIBRARY_NAME} failed:\n{link.stderr[-4000:]}")
        shutil.move(str(tmp_lib), str(out_path.with_suffix(".tmp")))
        os.replace(out_path.with_suffix(".tmp"), out_path)


def build(force=False) -> dict:
    """Builds the kernel library for the installed TF (or finds it cached).

    Safe to call from several processes at once: a file lock serializes builds.
    Returns the build record (path, TF version, flags).
    """
    root = source_dir()
    compile_flags, link_flags = build_flags(root)
    with_cuda, no_cuda_reason = cuda_plan()
    directory = cache_root() / _cache_key(root, compile_flags, link_flags, with_cuda)
    directory.mkdir(parents=True, exist_ok=True)
    lib_path, record_path = directory / LIBRARY_NAME, directory / "build.json"
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        fresh = force or not (lib_path.exists() and record_path.exists())
        if fresh:
            # A first import compiles for a while: say what and where.
            what = "CPU" + (" + CUDA" if with_cuda else "") + " kernels"
            _say(
                f"building {what} ({len(_sources(root))} C++ files) for "
                f"TensorFlow {tf.__version__} into {directory} (once per TF "
                f"version and source change; about 20 s"
                f"{', plus several minutes of nvcc' if with_cuda else ''})..."
            )
            start = time.monotonic()
            try:
                _compile(root, compile_flags, link_flags, lib_path, with_cuda)
            except Exception as exc:
                _say(
                    f"building the kernels failed after "
                    f"{time.monotonic() - start:.0f} s: {str(exc).splitlines()[0]}"
                )
                raise
            _say(f"built {lib_path} in {time.monotonic() - start:.0f} s")
            record_path.write_text(
                json.dumps(
                    {
                        "tf_version": tf.__version__,
                        "compile_flags": compile_flags,
                        "link_flags": link_flags,
                        "sources": str(root),
                        "cuda": with_cuda,
                        "no_cuda_reason": no_cuda_reason,
                    },
                    indent=1,
                )
            )
    record = json.loads(record_path.read_text())
    record.update(path=str(lib_path), fresh_build=fresh)
    if record["tf_version"] != tf.__version__:
        raise TapehookError(
            f"cached kernel library {lib_path} was built for TF {record['tf_version']}, "
            f"not the running TF {tf.__version__}; delete {directory}"
        )
    return record


def _say(message):
    """One line on stderr: the build is the only slow, silent step of import."""
    print(f"tapehook: {message}", file=sys.stderr, flush=True)


def _load():
    """Builds if needed and loads the library; returns (library, cdll, info)."""
    record = build()
    library = tf.load_op_library(record["path"])
    cdll = ctypes.CDLL(record["path"])
    cdll.tapehook_built_tf_version.restype = ctypes.c_char_p
    cdll.tapehook_dispatch_count.restype = ctypes.c_int64
    cdll.tapehook_amx_usable.restype = ctypes.c_int
    cdll.tapehook_conv_capabilities.restype = ctypes.c_uint32
    cdll.tapehook_conv_capabilities.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_int64),
    ]
    cdll.tapehook_set_switches_for_test.argtypes = [ctypes.c_int]
    built_for = cdll.tapehook_built_tf_version().decode()
    if built_for != tf.__version__:
        raise TapehookError(
            f"{record['path']} was built for TF {built_for}, running TF {tf.__version__}"
        )
    _default_threshold(library)
    return library, cdll, record


# The ops whose last input is the optional per-channel threshold: the
# forwards, and what they keep of their input for the backward.
THRESHOLD_OPS = (
    "tapehook_binary_conv2d",
    "tapehook_binary_conv2d_affine",
    "tapehook_binary_conv2d_affine_add",
    "tapehook_pack_input",
    "tapehook_estimator_grad_fixed",
    "tapehook_estimator_grad_half",
)


def _default_threshold(library):
    """TF's generated wrappers require every input, a list one too: the
    forwards take ``threshold=()`` (none) unless a caller gives one."""
    for name in THRESHOLD_OPS:
        generated = getattr(library, name)

        def with_default(*args, threshold=(), _op=generated, **kwargs):
            return _op(*args, threshold=threshold, **kwargs)

        functools.update_wrapper(with_default, generated)
        setattr(library, name, with_default)


def library():
    """The loaded op library, or None when binary convs use the reference
    path (the kernels setting is ``reference``, or the library did not load).
    Loads it (building once if needed) the first time a setting other than
    ``reference`` asks."""
    if _forced_reference[0]:
        return None
    mode = config.get("kernels")
    if mode == "reference":
        with _lock:
            if _state["info"] is None:
                _state["info"] = {"loaded": False, "reason": "kernels setting is 'reference'"}
        return None
    with _lock:
        if not _state["tried"]:
            _state["tried"] = True
            try:
                _state["library"], _state["cdll"], record = _load()
                _state["info"] = {"loaded": True, **record}
            except Exception as exc:  # any build/load failure: report, fall back
                _state["info"] = {"loaded": False, "reason": f"{type(exc).__name__}: {exc}"}
                if mode != "compiled":
                    warnings.warn(
                        "tapehook: compiled kernels unavailable, binary convs run on "
                        f"the reference path (plain TF ops). Reason: {exc}",
                        RuntimeWarning,
                        stacklevel=3,
                    )
        if mode == "compiled" and _state["library"] is None:
            raise TapehookError(
                "the kernels setting is 'compiled' (tapehook.config or TAPEHOOK_KERNELS) "
                f"but the kernels could not be built or loaded: {_state['info']['reason']}"
            )
        return _state["library"]


def loaded_library():
    """The library if it is loaded, whatever the kernels setting now: for
    ops on tensors that the kernels made (packed input bits), which only
    they read."""
    with _lock:
        return _state["library"]


def gpu_visible() -> bool:
    """Whether TensorFlow sees a GPU, and so places a model's ops there: the
    one check behind the dispatcher's GPU route and every guard of a CPU-only
    kernel."""
    return bool(tf.config.list_logical_devices("GPU"))


def cpu_library():
    """The loaded library where its CPU-only ops (batch-norm gradient, max
    pools, fixed-point e'(x), Adam-and-clip) may run: loaded and no GPU
    visible (TF places the surrounding ops on the GPU); else None."""
    loaded = library()
    if loaded is None or gpu_visible():
        return None
    return loaded


def force_reference(enabled: bool) -> None:
    """Routes binary forwards built from now on to the reference path (testing)."""
    _forced_reference[0] = bool(enabled)


def amx_usable() -> bool:
    """Whether the loaded CPU kernels can run their float-operand convolutions
    on Intel AMX (cc_kernels/core/amx_conv.h): the CPU has AMX-BF16, Linux
    granted the tile state, and TAPEHOOK_NO_AMX / TAPEHOOK_NO_AVX2 were unset
    when the kernels first read them (cc_kernels/core/cpu.h reads them once)."""
    library()
    cdll = _state["cdll"]
    return bool(cdll is not None and cdll.tapehook_amx_usable())


# Implementations of a binary conv, numbered as tapehook::Impl
# (cc_kernels/core/plan.h); the names are the ops' `plan` attr values.
IMPLS = ("portable", "avx2", "avx512", "amx")
_OPS = {"forward": 0, "backprop_input": 1, "backprop_filter": 2}
_capabilities_cache = {}


def _known_dims(shape, count):
    """The first ``count`` dims of a static shape, -1 where unknown."""
    try:
        dims = shape.as_list() if isinstance(shape, tf.TensorShape) else list(shape)
    except (TypeError, ValueError):  # None, or unknown rank
        return [-1] * count
    if len(dims) != 4:
        return [-1] * count
    return [-1 if d is None else int(d) for d in dims[:count]]


def conv_capabilities(
    op, attrs, dtype, x_shape=None, w_shape=None, binary_input=False, packed=False
) -> frozenset:
    """The implementations (``IMPLS`` names) the loaded kernels can run this
    conv with on this CPU: the C++ capability query (cc_kernels/core/plan.h).
    op: "forward", "backprop_input" or "backprop_filter"; attrs: the conv's
    attrs; dtype: the input's dtype name; shapes: static NHWC / HWIO shapes,
    unknown dims allowed. Empty when the kernels are not loaded."""
    cdll = _state["cdll"]
    if cdll is None:
        library()
        cdll = _state["cdll"]
    if cdll is None:
        return frozenset()
    batch, in_h, in_w, in_c = _known_dims(x_shape, 4)
    k_h, k_w, _, out_c = _known_dims(w_shape, 4)
    strides, dilations = attrs["strides"], attrs["dilations"]
    pad_top = pad_left = -1  # SAME / VALID: fit every implementation
    if attrs["padding"] == "EXPLICIT":
        pads = list(attrs["explicit_paddings"])
        pad_top, pad_left = int(pads[2]), int(pads[4])
    elif attrs["padding"] == "VALID":
        pad_top = pad_left = 0
    key = (
        _OPS[op],
        int(bool(binary_input)),
        int(bool(packed)),
        int(dtype == "float64"),
        batch,
        in_h,
        in_w,
        in_c,
        out_c,
        k_h,
        k_w,
        -1,
        -1,
        int(strides[1]),
        int(strides[2]),
        int(dilations[1]),
        int(dilations[2]),
        pad_top,
        pad_left,
    )
    # The answer depends on the key and the switches only: ask C++ once per key
    # (an eager conv decides on every call).
    answer = _capabilities_cache.get(key)
    if answer is None:
        bits = cdll.tapehook_conv_capabilities(*key[:4], (ctypes.c_int64 * 15)(*key[4:]))
        answer = frozenset(name for i, name in enumerate(IMPLS) if bits >> i & 1)
        _capabilities_cache[key] = answer
    return answer


def set_switches_for_test(no_amx=False, no_avx512=False, no_avx2=False):
    """Pins the kernels' TAPEHOOK_NO_* switches in this process (tests; the
    environment's are read once). ``None`` for all three restores them."""
    library()
    cdll = _state["cdll"]
    if cdll is None:
        raise TapehookError("the compiled kernels are not loaded")
    _capabilities_cache.clear()
    if no_amx is None:
        cdll.tapehook_set_switches_for_test(-1)
        return
    cdll.tapehook_set_switches_for_test(
        int(bool(no_amx)) | int(bool(no_avx512)) << 1 | int(bool(no_avx2)) << 2
    )


def kernel_info() -> dict:
    """Which compiled kernels are loaded, what they were built against, or
    why not, and the settings in force (tapehook.config)."""
    try:
        library()
    except TapehookError:  # kernels='compiled' and not loaded: info says why
        pass
    cpu = dict(_state["info"])
    if cpu.get("loaded"):
        cpu["amx"] = amx_usable()
    if _forced_reference[0] or config.get("kernels") == "reference":
        cpu["forced_reference"] = True
    if cpu.get("cuda"):
        gpu = {"loaded": True, "path": cpu["path"]}
    else:
        gpu = {
            "loaded": False,
            "reason": cpu.get("no_cuda_reason") or cpu.get("reason") or cuda_plan()[1],
        }
    gpu["devices"] = [d.name for d in tf.config.list_physical_devices("GPU")]
    gpu["binary_convs"], gpu["why"] = _gpu_route(cpu)
    return {"cpu": cpu, "gpu": gpu, "tensorflow": tf.__version__, "settings": config.current()}


def _gpu_route(cpu):
    """(dispatch.KERNELS or STOCK, why): what binary convs run on where a GPU
    is visible."""
    if not cpu.get("loaded") or cpu.get("forced_reference"):
        return dispatch.STOCK, "the kernels are not loaded: TF ops on the binarized operands"
    setting = f"dispatch={dispatch.policy()!r}"
    if dispatch.gpu_route() == dispatch.STOCK:
        if dispatch.policy() == dispatch.STOCK:
            return dispatch.STOCK, setting
        return dispatch.STOCK, (
            f"{setting}: cuDNN convolutions on the binarized operands; tapehook's CUDA "
            "kernels have not run inside TensorFlow and a fully binary step on them is "
            "slower than cuDNN (bench/CUDA.md). tapehook.config(dispatch='kernels') opts in"
        )
    if cpu.get("cuda"):
        return dispatch.KERNELS, f"{setting}: tapehook's CUDA kernels (untested inside TensorFlow)"
    return dispatch.KERNELS, (
        f"{setting}, but this library has no CUDA kernels: the CPU kernels, their "
        "operands copied from and back to the GPU"
    )


def compiled_counts() -> dict:
    cdll = _state["cdll"]
    if cdll is None:
        return dict.fromkeys(_COUNT_KINDS, 0)
    return {kind: int(cdll.tapehook_dispatch_count(i)) for i, kind in enumerate(_COUNT_KINDS)}


def reset_compiled_counts() -> None:
    if _state["cdll"] is not None:
        _state["cdll"].tapehook_reset_dispatch_counts()
