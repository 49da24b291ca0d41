"""Every TensorFlow and Keras internal tapehook touches, in one place.

Other modules reach TF internals only through the names below. ``check()``
runs at ``import tapehook``, before anything is patched: if a piece is missing
or shaped differently, it raises TapehookError naming the TF version and the
piece, so a TF upgrade can never turn into silently wrong gradients or a
half-installed override. Supported and tested: docs/compat.md.
"""

import functools
import inspect

import tensorflow as tf
from tensorflow.python.eager import backprop, execute, record  # noqa: F401
from tensorflow.python.framework import (
    op_callbacks,  # noqa: F401
    ops,  # noqa: F401
)
from tensorflow.python.ops import (  # noqa: F401
    control_flow_util,
    gen_array_ops,
    gen_math_ops,
    gen_nn_ops,
    nn_impl,
    nn_ops,
    resource_variable_ops,
)

from tapehook.errors import TapehookError

TESTED_RANGE = "TensorFlow 2.16 to 2.22 (nightly) with Keras 3"


@functools.cache
def keras_variable_base():
    """The base class of every Keras 3 variable, or () without Keras.

    Keras 3.0-3.6 call it KerasVariable, and there layers create a class that
    is not the exported keras.Variable; 3.7+ call it Variable.
    """
    try:
        from keras.src.backend.common import variables
    except ImportError:  # Keras is optional for tapehook's core
        return ()
    return getattr(variables, "KerasVariable", None) or variables.Variable


def onednn_enabled() -> bool:
    """Whether TF runs its CPU convolutions on oneDNN (TF_ENABLE_ONEDNN_OPTS,
    read by TF at import; on by default on x86 Linux builds). False when TF
    does not say."""
    try:
        from tensorflow.python.util import _pywrap_util_port

        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return False


def hide_from_tracebacks(path: str, hidden: bool) -> None:
    """Adds (or removes) ``path`` to the files TF leaves out of the "in user
    code" frames of its error messages, as it leaves out its own: the
    pass-through wrappers of patches.py are part of TF's functions, so an
    error message through them reads exactly as without tapehook."""
    from tensorflow.python.util import traceback_utils

    excluded = getattr(traceback_utils, "_EXCLUDED_PATHS", None)
    if not isinstance(excluded, tuple):  # cosmetic only: nothing to adjust
        return
    excluded = tuple(p for p in excluded if p != path)
    traceback_utils._EXCLUDED_PATHS = excluded + ((path,) if hidden else ())


def _params(fn):
    return list(inspect.signature(inspect.unwrap(fn)).parameters)


def _fail(piece):
    raise TapehookError(
        f"TensorFlow {tf.__version__} lacks {piece}, which tapehook relies on; nothing "
        f"was patched. tapehook is tested with {TESTED_RANGE}; install one of those "
        f"(see docs/compat.md) or report this version"
    )


def gradient_registry_entries() -> dict:
    """``ops._gradient_registry._registry``: op type -> {"type": fn, ...}."""
    registry = getattr(ops, "_gradient_registry", None)
    entries = getattr(registry, "_registry", None)
    if not isinstance(entries, dict) or not callable(getattr(registry, "lookup", None)):
        _fail("ops._gradient_registry._registry (the gradient registry dict)")
    return entries


def gradient_registry_entry(op_type: str) -> dict:
    entry = gradient_registry_entries().get(op_type)
    if not isinstance(entry, dict) or not callable(entry.get("type")):
        _fail(f"a {{'type': fn}} gradient registry entry for {op_type}")
    return entry


def check() -> None:
    """Raises TapehookError if any internal tapehook uses is missing or changed."""
    gradient_registry_entry("Conv2D")
    if "skip_input_indices" not in _params(getattr(backprop, "_MockOp", object).__init__):
        _fail("backprop._MockOp(..., skip_input_indices) (the eager tape's op view)")
    for owner, name in [
        (execute, "record_gradient"),
        (execute, "must_record_gradient"),
        (record, "stop_recording"),
        (control_flow_util, "GraphOrParentsInXlaContext"),
        (gen_array_ops, "identity"),
        (gen_array_ops, "expand_dims"),
        (gen_math_ops, "cast"),
        (resource_variable_ops.BaseResourceVariable, "_read_variable_op"),
    ]:
        if not callable(getattr(owner, name, None)):
            _fail(f"{getattr(owner, '__name__', owner)}.{name}")
    _check_override_internals()
    conv2d_params = [
        "input",
        "filter",
        "strides",
        "padding",
        "use_cudnn_on_gpu",
        "explicit_paddings",
        "data_format",
        "dilations",
        "name",
    ]
    if _params(gen_nn_ops.conv2d) != conv2d_params:
        _fail(f"gen_nn_ops.conv2d({', '.join(conv2d_params)})")
    for fn, head in [
        (gen_math_ops.mat_mul, ["a", "b", "transpose_a", "transpose_b"]),
        (gen_math_ops.batch_mat_mul_v2, ["x", "y", "adj_x", "adj_y"]),
        (gen_math_ops.batch_mat_mul_v3, ["x", "y", "Tout", "adj_x", "adj_y"]),
        (
            gen_nn_ops.depthwise_conv2d_native,
            [
                "input",
                "filter",
                "strides",
                "padding",
                "explicit_paddings",
                "data_format",
                "dilations",
            ],
        ),
    ]:
        if _params(fn)[: len(head)] != head:
            _fail(f"{fn.__module__}.{fn.__name__}({', '.join(head)}, ...)")
    if _params(nn_ops.convolution_internal)[:7] != [
        "input",
        "filters",
        "strides",
        "padding",
        "data_format",
        "dilations",
        "name",
    ]:
        _fail(
            "nn_ops.convolution_internal(input, filters, strides, padding, "
            "data_format, dilations, name, ...)"
        )
    for fn, head in [
        (
            nn_impl.depthwise_conv2d,
            ["input", "filter", "strides", "padding", "rate", "name", "data_format", "dilations"],
        ),
        (
            nn_impl.separable_conv2d,
            [
                "input",
                "depthwise_filter",
                "pointwise_filter",
                "strides",
                "padding",
                "rate",
                "name",
                "data_format",
                "dilations",
            ],
        ),
        (
            nn_ops.conv1d_v2,
            ["input", "filters", "stride", "padding", "data_format", "dilations", "name"],
        ),
    ]:
        if _params(fn) != head:
            _fail(f"{fn.__module__}.{fn.__name__}({', '.join(head)})")
    try:
        import keras
    except ImportError:
        return
    if not callable(getattr(keras.Layer, "__call__", None)) or not any(
        "get_config" in vars(c) for c in keras.layers.Conv2D.__mro__[:-1]
    ):
        _fail(f"Keras {keras.__version__}: Layer.__call__ / Conv2D.get_config")


def _check_override_internals() -> None:
    """What tapehook.override_gradient (override.py) relies on."""
    for owner, name in [
        (op_callbacks, "add_op_callback"),
        (op_callbacks, "remove_op_callback"),
        (record, "record_operation"),
        (record, "could_possibly_record"),
    ]:
        if not callable(getattr(owner, name, None)):
            _fail(f"{owner.__name__}.{name}")
    if _params(backprop._MockOp.__init__)[1:] != [
        "attrs",
        "inputs",
        "outputs",
        "typ",
        "skip_input_indices",
    ]:
        _fail("backprop._MockOp(attrs, inputs, outputs, typ, skip_input_indices)")
    # Graph gradients prefer an op's own _gradient_function to the registry.
    if "_gradient_function" not in ops.get_gradient_function.__code__.co_names:
        _fail("ops.get_gradient_function reading op._gradient_function")
    # Generated op wrappers record on tapes through execute.record_gradient,
    # looked up on the module at each call.
    if "record_gradient" not in gen_nn_ops.relu.__code__.co_names:
        _fail("generated op wrappers calling execute.record_gradient")
