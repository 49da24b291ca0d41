"""Which implementation runs each part of a binary conv: one of tapehook's
kernels (and which: its plan) or stock TF convolutions on binarized operands
(tapehook/reference.py's ops).

The choice is made here and nowhere else, once per conv: at trace time in
graphs, per call in eager. ``choose`` is the whole rule, a pure function of
the conv and of what the kernels can run on this CPU (the C++ capability
query, ``kernels.conv_capabilities``); it returns ``STOCK`` or a plan, an
implementation name that travels to the kernel as the op's ``plan`` attr
(cc_kernels/core/plan.h), which runs it without deciding again.

``tapehook.config``'s ``dispatch`` picks the policy (default: the
``TAPEHOOK_DISPATCH`` environment variable, else ``auto``), read at each
decision (trace time in graphs): ``auto``, ``kernels`` (always tapehook's
kernels, on the best implementation the CPU can run, and on a GPU its CUDA
kernels; what the test suite checks against the reference) or ``stock``.

Where TensorFlow sees a GPU (``kernels.gpu_visible``: it then places a binary
conv's ops there), ``auto`` runs every binary conv stock: cuDNN convolutions
on the binarized operands, the reference's math in TF ops. The CUDA kernels
run only under ``kernels``, the explicit opt-in: they have been checked on a
GPU only through the framework-free harness (their TF wrapper has never run
inside TensorFlow), and a fully binary step on them is slower than cuDNN at
every measured shape (bench/CUDA.md).

On the CPU, ``auto`` follows the benchmarks, run against stock TF with
oneDNN on and off (bench/run.py, bench/backprops.py; docs/performance.md):

- forward with binary activations: tapehook's bitpacked xor/popcount kernel
  (one xor and popcount does a machine word of binary multiply-adds);
- convolutions with a float operand (the weight-only forward, both
  backprops) where the AMX kernels can run them (the capability query: Intel
  AMX, not float64, stride 1 for the forward — the backprops run strided
  convs by phases), SAME or VALID padding and at least AMX_MIN_PIXELS input
  pixels (batch x H x W), dW also at least AMX_MIN_TAPS kernel taps unless
  the input was kept as packed bits: tapehook's kernels, which run them as
  exact bf16x3 AMX GEMMs (cc_kernels/core/amx_conv.h) — except the dW of a
  weight-only conv (float x times float dy, six bf16 products per term) when
  TF runs oneDNN, whose backprop-filter then wins;
- otherwise, forward with float activations: stock Conv2D on sign(W), then
  alpha (TF's AVX-512 / oneDNN float convolutions beat our AVX2 ones);
- otherwise, backprops with a ±1 operand (dX: sign W; a dW with binary
  activations: sign x) on AVX-512, float32, undilated, of a conv whose
  forward ran on the kernels (a forward on stock takes the whole conv to
  reference.py, which differentiates itself): tapehook's sign-table
  kernels (plan ``avx512``, cc_kernels/core/lut_backprop.h): a vpermps picks
  one of the 16 signed sums of 4 float values per lane, 64 multiply-adds per
  permute and add against 16 per FMA; also dX on AMX CPUs where dy's image
  is under AMX_MIN_IMAGE_PIXELS pixels (a 4x4 stage, or a stride-2 conv
  from 7x7), where the AMX GEMM's fixed preparation does not pay;
- otherwise, where TF runs Eigen's convolutions (oneDNN off, as TF sets it
  on AVX2 CPUs), plan ``avx2``: dX on tapehook's AVX2 GEMM (sign W needs no
  multiplies), and a binary-input dW on the AVX2 sign tables
  (cc_kernels/core/lut_backprop_avx2.h: 8 signed sums of 3 dy values per
  vpermps);
- otherwise, backprops: stock Conv2DBackpropInput / Filter on
  (x_hat, alpha sign W) with the estimator masks applied after, except for
  dilated convs, which TF's CPU backprops reject and tapehook's kernels
  handle natively.
"""

from tapehook.config import SETTINGS, config
from tapehook.errors import TapehookError

KERNELS, STOCK = "kernels", "stock"
POLICIES = SETTINGS["dispatch"].allowed  # ("auto", KERNELS, STOCK)
# Where a binary conv's ops run: TF places them on a GPU whenever it sees one.
CPU, GPU = "cpu", "gpu"
DEVICES = (CPU, GPU)
# Implementations of the kernels, best first (the ops' plan attr values).
PREFERENCE = ("amx", "avx512", "avx2", "portable")


def policy() -> str:
    """The dispatch policy in force here (tapehook.config's ``dispatch``)."""
    return config.get("dispatch")


# The AMX kernels split their float operand and pack sign(W) before the GEMM;
# below these sizes that preparation outweighs the GEMM and stock convs win.
# Set by bench/run.py and bench/backprops.py; docs/performance.md.
AMX_MIN_TAPS = 4
AMX_MIN_PIXELS = 128
# On an AMX CPU, a dX with sign W whose dy has images of fewer pixels than
# this runs on the AVX-512 sign-table kernel, not the AMX GEMM (whose fixed
# preparation of the float dy does not pay there). dy's image, not x's: a
# strided dX's AMX GEMM runs over dy's grid (by phases). A binary-input dW
# stays on AMX at every size, from floats or packed bits. Set by
# bench/backprops.py --plans amx,avx512; docs/performance.md.
AMX_MIN_IMAGE_PIXELS = 49


def _known(shape, dims):
    """Whether a static 4-D shape has its first ``dims`` dims known (False for
    None and for shapes of unknown rank)."""
    try:
        dims_list = list(shape)
    except (TypeError, ValueError):  # None, or a TensorShape of unknown rank
        return False
    return len(dims_list) == 4 and None not in dims_list[:dims]


def _best(capabilities) -> str:
    for impl in PREFERENCE:
        if impl in capabilities:
            return impl
    return STOCK  # no kernels loaded


def _amx_pays(capabilities, attrs, x_shape, w_shape, min_taps) -> bool:
    """Whether the AMX kernels can run this conv and it is big enough for them
    to beat stock. Unknown dims count as large."""
    # EXPLICIT padding was never measured against stock: it stays there.
    if "amx" not in capabilities or attrs["padding"] not in ("SAME", "VALID"):
        return False
    if _known(x_shape, 3) and (
        int(x_shape[0]) * int(x_shape[1]) * int(x_shape[2]) < AMX_MIN_PIXELS
    ):
        return False
    return not (_known(w_shape, 2) and int(w_shape[0]) * int(w_shape[1]) < min_taps)


def _dy_image(attrs, x_shape, w_shape):
    """Pixels of one image of dy (the conv's output) for SAME / VALID
    padding, or None where x's or w's spatial dims are unknown."""
    if not (_known(x_shape, 3) and _known(w_shape, 2)):
        return None
    pixels = 1
    for axis in (1, 2):
        size, stride = int(x_shape[axis]), int(attrs["strides"][axis])
        if attrs["padding"] == "VALID":
            size -= (int(w_shape[axis - 1]) - 1) * int(attrs["dilations"][axis])
        pixels *= max(0, -(-size // stride))
    return pixels


def choose(
    op,
    *,
    policy,
    capabilities,
    attrs,
    x_shape=None,
    w_shape=None,
    binary_input=False,
    packed=False,
    onednn=False,
    spec_supported=True,
    device=CPU,
) -> str:
    """The implementation of one part of a binary conv: ``STOCK`` or a plan
    (a name in ``capabilities``). A pure function, the whole dispatch rule.

    op: "forward", "backprop_input" or "backprop_filter"; policy: a
    ``POLICIES`` value; capabilities: the implementations the kernels can run
    this conv with here (``kernels.conv_capabilities``); attrs: the conv's
    attrs; x_shape / w_shape: static shapes (NHWC, HWIO), unknown dims
    allowed; binary_input: x enters as sign(x); packed: the backward kept x
    as packed bits (which stock ops need unpacked first); onednn: TF runs
    oneDNN convolutions; spec_supported: the kernels compute this spec's math
    (``kernels_take``), whatever the policy; device: a ``DEVICES`` value,
    where TF will place the conv's ops.
    """
    if device not in DEVICES:
        raise TapehookError(f"dispatch device {device!r}; use one of {DEVICES}")
    if policy == STOCK or not capabilities or not spec_supported:
        return STOCK
    best = _best(capabilities)
    if policy == KERNELS:
        return best  # on a GPU too: the opt-in to the CUDA kernels
    if device == GPU:
        # The CUDA kernels are untested inside TF and slower than cuDNN per
        # step (bench/CUDA.md): stock unless opted in.
        return STOCK
    if op == "forward":
        if binary_input or _amx_pays(capabilities, attrs, x_shape, w_shape, 1):
            return best
        return STOCK
    filter_grad = op == "backprop_filter"
    if any(d != 1 for d in attrs["dilations"]):
        return best  # stock CPU backprops reject dilation
    # Where AMX does not run a backprop (or does not pay), the AVX-512
    # sign-table kernels do when they can (their capability: a ±1 operand,
    # sign W for dX, sign x for a binary-input dW; float32): four multiply-
    # adds per lane and instruction where oneDNN's float GEMM does one
    # (bench/lut_backprop/REPORT.md).
    otherwise = "avx512" if "avx512" in capabilities else STOCK
    if (
        otherwise == STOCK
        and (binary_input or not filter_grad)
        and not onednn
        and "avx2" in capabilities
    ):
        # No AVX-512 sign-table kernels (an AVX2 CPU) and TF on Eigen's
        # convolutions (it turns oneDNN on only on newer ISAs): plan avx2's
        # dX (its GEMM on sign W) and its dW of a binary input (the AVX2 sign
        # tables, lut_backprop_avx2.h) beat Eigen's backprops; a float
        # input's dW has no ±1 operand to exploit and stays stock
        # (bench/results/backprops_avx2.json).
        otherwise = "avx2"
    # A 1x1 dW runs about as fast as stock on AMX: take it only when the
    # kernels save unpacking the input bits. A 1x1 dX wins.
    min_taps = 1 if packed or not filter_grad else AMX_MIN_TAPS
    if not _amx_pays(capabilities, attrs, x_shape, w_shape, min_taps):
        return otherwise
    image = _dy_image(attrs, x_shape, w_shape)
    if (
        image is not None
        and image < AMX_MIN_IMAGE_PIXELS
        and otherwise != STOCK
        and not filter_grad
    ):
        return otherwise  # the sign-table dX beats AMX's on small images
    # dW of a weight-only conv is float x float: no exact operand, so AMX needs
    # six bf16 products per term, slower than oneDNN's backprop-filter.
    if filter_grad and not binary_input and onednn:
        return otherwise
    return best


def kernels_take(spec) -> bool:
    """Whether tapehook's kernels compute this spec's math. A float kernel
    (weights=False) has no binary kernel to run on, and the kernels' swish_sign
    has beta 5: such convs run stock convolutions on the binarized operands
    (reference.py) under every policy. pad_value needs nothing: conv2d.py runs
    a one-padded conv as a VALID conv of the padded input."""
    swish = "swish_sign" in (spec.ste, spec.activation_estimator)
    return spec.weights and (spec.beta == 5.0 or not swish)


def _choose_here(op, attrs, dtype, x_shape, w_shape, binary_input, packed, spec):
    """``choose`` with this process's policy, capabilities, TF build and
    devices."""
    import tapehook.compat as compat  # both import TF: not at module import
    import tapehook.kernels as kernels

    chosen = policy()
    capabilities = frozenset()
    supported = kernels_take(spec)
    if chosen != STOCK and supported and attrs is not None and dtype is not None:
        capabilities = kernels.conv_capabilities(
            op, attrs, dtype, x_shape, w_shape, binary_input=binary_input, packed=packed
        )
    return choose(
        op,
        policy=chosen,
        capabilities=capabilities,
        attrs=attrs,
        x_shape=x_shape,
        w_shape=w_shape,
        binary_input=binary_input,
        packed=packed,
        onednn=compat.onednn_enabled(),
        spec_supported=supported,
        device=GPU if kernels.gpu_visible() else CPU,
    )


def gpu_route() -> str:
    """``KERNELS`` or ``STOCK``: what binary convs the kernels compute run on
    where a GPU is visible, under this process's policy (``choose``'s answer
    there, which depends on nothing else; kernel_info reports it)."""
    plan = choose(
        "forward",
        policy=policy(),
        capabilities=frozenset(PREFERENCE),
        attrs=None,
        binary_input=True,
        device=GPU,
    )
    return KERNELS if runs_kernels(plan) else STOCK


def runs_kernels(path) -> bool:
    """Whether a ``forward_path`` / ``backprop_path`` result is a kernel plan."""
    return path is not None and path != STOCK


def forward_path(spec, attrs=None, dtype=None, x_shape=None, w_shape=None) -> str:
    """STOCK or the forward's plan. attrs: the conv's attrs (strides, padding,
    dilations, ...); dtype: the input's dtype name; x_shape / w_shape: static
    shapes (NHWC, HWIO)."""
    return _choose_here(
        "forward",
        attrs,
        dtype,
        x_shape,
        w_shape,
        bool(spec.activation_estimator),
        False,
        spec,
    )


def backprop_path(
    attrs,
    dtype=None,
    x_shape=None,
    w_shape=None,
    *,
    spec,
    filter_grad=False,
    packed=False,
) -> str:
    """STOCK or the plan of one backprop of the conv with BinarySpec ``spec``:
    filter_grad selects dW (else dX); packed, whether the backward kept
    packed input bits."""
    return _choose_here(
        "backprop_filter" if filter_grad else "backprop_input",
        attrs,
        dtype,
        x_shape,
        w_shape,
        bool(spec.activation_estimator),
        packed,
        spec,
    )
