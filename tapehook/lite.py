"""LCE files in LiteRT's interpreter, on tapehook's kernels.

``tapehook.lite.Interpreter(path, num_threads=...)`` opens a file that Larq
Compute Engine's converter wrote (``LceQuantize``, ``LceBconv2d``,
``LceDequantize``, ``LceBMaxPool2d`` as custom ops, next to builtin ones) in
``ai_edge_litert``'s interpreter, with LCE's ops run by tapehook's bitpacked
kernels (cc_kernels/core: AVX-512, AVX2 or portable, as the CPU allows) and
the builtin ops by LiteRT (XNNPACK). It is an
``ai_edge_litert.interpreter.InterpreterWithCustomOps``, so the whole
``tf.lite.Interpreter`` interface works; a file with no LCE op runs as in a
plain interpreter.

The ops are registered through the interpreter's custom-op hook (see
cc_kernels/lite/resolver_hook.cc for how without TFLite's hidden symbols);
the library is built on first use (tapehook/lite_build.py) and cached.
What a file gets wrong (a corrupt custom option, a tensor of the wrong type
or shape) raises a TapehookError naming the op and the problem.

Results equal LCE's interpreter bit for bit for every bitpacked tensor and
for float outputs of VALID and one-padded (``pad_values=1``) bconvs (the
same epilogue, ``float(clamp(2 * count)) * multiplier + bias``, in the same
order). Zero-padded SAME bconvs are computed exactly (padding taps add 0)
where LCE corrects a one-padded sum in float: equal up to float rounding,
except where a window overhangs two opposite sides of an input smaller than
the filter, which LCE's correction leaves out (its result there is the
one-padded sum).
"""

import ctypes
import os
import threading

from tapehook.errors import TapehookError

__all__ = ["Interpreter", "registerer", "library_path", "kernel_impl"]  # noqa: F822 (Interpreter: __getattr__)

_lock = threading.Lock()
_loaded = {}


def library_path():
    """The path of libtapehook_lite.so, built first if needed."""
    from tapehook import lite_build

    return lite_build.build()


def _library():
    with _lock:
        if "cdll" not in _loaded:
            # RTLD_GLOBAL: the registerer can then also be named by symbol
            # ("TapehookLiteRegisterLceOps"), which LiteRT looks up in the process.
            cdll = ctypes.CDLL(str(library_path()), mode=ctypes.RTLD_GLOBAL)
            cdll.tapehook_lite_register.argtypes = [
                ctypes.c_void_p,
                ctypes.c_char_p,
                ctypes.c_size_t,
            ]
            cdll.tapehook_lite_register.restype = ctypes.c_int
            cdll.tapehook_lite_impl.restype = ctypes.c_char_p
            _loaded["cdll"] = cdll
        return _loaded["cdll"]


def kernel_impl():
    """The kernels LceBconv2d runs here: "avx512", "avx2" or "portable" (the
    CPU's best, less the TAPEHOOK_NO_AVX512 / TAPEHOOK_NO_AVX2 switches)."""
    return _library().tapehook_lite_impl().decode()


def registerer(errors=None):
    """A registerer for ``InterpreterWithCustomOps(custom_op_registerers=[...])``:
    called with the address of the interpreter's op resolver, it adds LCE's
    ops. A failure is appended to ``errors`` (a list) when given, else raised
    (which LiteRT reports as its own error)."""
    cdll = _library()

    def register(resolver_address):
        message = ctypes.create_string_buffer(1024)
        if cdll.tapehook_lite_register(resolver_address, message, len(message)):
            text = message.value.decode(errors="replace")
            if errors is None:
                raise TapehookError(f"registering LCE's ops into LiteRT failed: {text}")
            errors.append(text)

    return register


def _interpreter_base():
    try:
        from ai_edge_litert.interpreter import InterpreterWithCustomOps
    except ImportError:
        raise TapehookError(
            "tapehook.lite needs ai-edge-litert: pip install ai-edge-litert (or tapehook[deploy])"
        ) from None
    return InterpreterWithCustomOps


def _errors_as_tapehook(method):
    def wrapped(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except RuntimeError as exc:
            raise TapehookError(f"{self._path_text}: {exc}") from None

    wrapped.__name__ = method.__name__
    wrapped.__doc__ = method.__doc__
    return wrapped


def _make_class():
    base = _interpreter_base()

    class Interpreter(base):
        """LiteRT's interpreter with LCE's ops on tapehook's kernels.

        ``Interpreter(path, num_threads=None)``, or
        ``Interpreter(model_content=bytes, num_threads=...)``; further keyword
        arguments go to LiteRT's interpreter. ``num_threads`` is shared by
        LiteRT's ops and LCE's (default 1).

        ``fuse`` (default True): each run of float SUB, MUL and ADD ops after
        a binary conv (a residual add, Bi-Real-Net's batch norm) is taken
        into the conv as the file loads, with the same results to the bit;
        ``fused_ops`` says how many ops. The file is not changed. Off with
        ``fuse=False``, and with ``experimental_preserve_all_tensors=True``,
        which keeps every tensor of the file to read."""

        def __init__(
            self, model_path=None, num_threads=None, model_content=None, fuse=True, **kwargs
        ):
            if model_path is not None:
                model_path = os.fspath(model_path)
                if not os.path.isfile(model_path):
                    raise TapehookError(f"no model file at {model_path!r}")
            self._path_text = model_path or "the model"
            self.fused_ops = 0
            if fuse and not kwargs.get("experimental_preserve_all_tensors"):
                from tapehook import lite_fuse

                data = model_content
                if data is None and model_path is not None:
                    with open(model_path, "rb") as f:
                        data = f.read()
                if data is not None:
                    fused, self.fused_ops = lite_fuse.fuse_epilogues(bytes(data))
                    if self.fused_ops:
                        model_path, model_content = None, fused
            errors = []
            kwargs.pop("custom_op_registerers", None)
            try:
                super().__init__(
                    model_path=model_path,
                    model_content=model_content,
                    num_threads=num_threads,
                    custom_op_registerers=[registerer(errors)],
                    **kwargs,
                )
            except (ValueError, RuntimeError) as exc:
                detail = f" ({'; '.join(errors)})" if errors else ""
                raise TapehookError(
                    f"LiteRT could not open {self._path_text}{detail}: {exc}"
                ) from None
            if errors:
                raise TapehookError(
                    f"LCE's ops could not be registered into this ai_edge_litert: "
                    f"{'; '.join(errors)}"
                )

        allocate_tensors = _errors_as_tapehook(base.allocate_tensors)
        invoke = _errors_as_tapehook(base.invoke)
        resize_tensor_input = _errors_as_tapehook(base.resize_tensor_input)

    Interpreter.__module__ = __name__
    return Interpreter


def __getattr__(name):
    # The class is made on first use: importing tapehook.lite needs neither
    # ai_edge_litert nor a compiler.
    if name == "Interpreter":
        cls = _make_class()
        globals()["Interpreter"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
