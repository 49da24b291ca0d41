"""tapehook.lite: LCE files in LiteRT's interpreter on tapehook's kernels.

Each LCE op of an exported file is checked node by node against a NumPy
statement of LCE's op semantics (core/bconv2d/output_transform.h,
bitpacking/bitpack.h, bmaxpool.h): bits and integer counts bit for bit,
float epilogues to the bit where LCE's formula has one rounding order
(one-padding, VALID) and to float rounding for zero padding (LCE corrects
its one-padded sum in float there); the whole file against LCE's own
interpreter in its side environment; corrupt options and tensors against
TapehookError.
"""

import numpy as np
import pytest

import tapehook
from tapehook.errors import TapehookError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

lite = pytest.importorskip("tapehook.lite")
pytest.importorskip("ai_edge_litert")


def _bits(words, channels):
    """int32 words [..., W] -> 0/1 bits [..., channels] (channel c at bit c % 32)."""
    u = words.astype(np.int64) & 0xFFFFFFFF
    shifts = np.arange(32)
    bits = (u[..., :, None] >> shifts) & 1
    return bits.reshape(*words.shape[:-1], -1)[..., :channels].astype(np.int64)


def _pack(bits):
    """0/1 bits [..., C] -> int32 words [..., ceil(C / 32)]."""
    c = bits.shape[-1]
    words = -(-c // 32)
    padded = np.zeros((*bits.shape[:-1], words * 32), np.int64)
    padded[..., :c] = bits
    w = (padded.reshape(*bits.shape[:-1], words, 32) << np.arange(32)).sum(-1)
    return (w & 0xFFFFFFFF).astype(np.uint32).view(np.int32)


def _same_pads(size, k, stride, dil):
    out = -(-size // stride)
    total = max((out - 1) * stride + (k - 1) * dil + 1 - size, 0)
    return out, total // 2


def _bconv_reference(x_words, filt, opts, channels_in, out_type, mul, bias, thr):
    """LCE's LceBconv2d in NumPy: (result, exact) with exact False where LCE
    itself rounds differently (zero padding)."""
    n, h, w, _ = x_words.shape
    o, kh, kw, fwords = filt.shape
    groups = -(-channels_in // 32) // fwords
    cg = channels_in // groups
    sh, sw = opts["stride_height"], opts["stride_width"]
    dh, dw = opts["dilation_height_factor"], opts["dilation_width_factor"]
    same = opts["padding"] == 0
    x_hat = 1 - 2 * _bits(x_words, channels_in)  # +-1
    w_hat = 1 - 2 * _bits(filt, cg)
    if same:
        oh, pt = _same_pads(h, kh, sh, dh)
        ow, pl = _same_pads(w, kw, sw, dw)
    else:
        oh, pt = (h - (kh - 1) * dh - 1) // sh + 1, 0
        ow, pl = (w - (kw - 1) * dw - 1) // sw + 1, 0
    pad_value = opts["pad_values"] if same else 1
    big_h, big_w = (oh - 1) * sh + (kh - 1) * dh + 1, (ow - 1) * sw + (kw - 1) * dw + 1
    xp = np.full((n, max(big_h + pt, h + pt), max(big_w + pl, w + pl), channels_in), pad_value)
    xp[:, pt : pt + h, pl : pl + w] = x_hat
    dot = np.zeros((n, oh, ow, o), np.int64)
    og = o // groups
    for i in range(kh):
        for j in range(kw):
            patch = xp[
                :,
                i * dh : i * dh + (oh - 1) * sh + 1 : sh,
                j * dw : j * dw + (ow - 1) * sw + 1 : sw,
            ]
            for g in range(groups):
                dot[..., g * og : (g + 1) * og] += np.einsum(
                    "nhwc,oc->nhwo",
                    patch[..., g * cg : (g + 1) * cg],
                    w_hat[g * og : (g + 1) * og, i, j],
                )
    K = kh * kw * cg
    twice = K - dot  # 2 * LCE's xor-popcount accumulator
    if out_type == np.int32:
        return _pack((twice // 2 > thr).astype(np.int64)), True
    lo, hi = {0: (-(2**31), 2**31 - 1), 1: (0, 2**31 - 1), 2: (-1, 1), 3: (0, 6)}[
        opts["fused_activation_function"]
    ]
    lo, hi = max(lo, -K), min(hi, K)
    m = (-1 * mul.astype(np.float64)).astype(np.float32)
    b = (bias.astype(np.float64) + K * mul.astype(np.float64)).astype(np.float32)
    x = np.clip(twice, -hi + K, -lo + K).astype(np.float32)
    return x * m + b, not (same and opts["pad_values"] == 0)


# ------------------------------------------------------------------ models


def _varied_model():
    import keras

    from tapehook.larq import layers as lq

    kw = dict(input_quantizer="ste_sign", kernel_quantizer="ste_sign", use_bias=False)
    i = keras.Input((16, 16, 40))
    x = lq.QuantConv2D(64, 3, padding="same", pad_values=1.0, **kw)(i)
    x = keras.layers.BatchNormalization()(x)
    x = lq.QuantConv2D(96, 3, strides=2, padding="same", pad_values=1.0, **kw)(x)
    x = keras.layers.BatchNormalization()(x)
    x = lq.QuantConv2D(40, 2, padding="valid", dilation_rate=2, **kw)(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.MaxPooling2D(2, padding="same")(x)
    x = lq.QuantConv2D(33, 3, padding="same", pad_values=1.0, **kw)(x)
    x = keras.layers.ReLU()(x)
    a = lq.QuantConv2D(24, 3, padding="same", **kw)(x)
    b = lq.QuantConv2D(20, 3, padding="same", pad_values=1.0, **kw)(x)
    b = keras.layers.ReLU()(b)
    pool = keras.layers.GlobalAveragePooling2D()
    x = keras.layers.Concatenate()([pool(a), pool(b)])
    o = keras.layers.Dense(3)(x)
    return _random_batch_norms(keras.Model(i, o), seed=1, signed_gamma=True)


def _random_batch_norms(model, seed, signed_gamma):
    """The model, its batch norms given statistics far from the identity."""
    import keras

    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            gamma, beta, mean, var = layer.get_weights()
            sign = rng.choice([-1, 1], gamma.shape) if signed_gamma else 1
            layer.set_weights(
                [
                    rng.uniform(0.5, 2.0, gamma.shape).astype("float32") * sign,
                    rng.normal(0, 2.0, beta.shape).astype("float32"),
                    rng.normal(0, 3.0, mean.shape).astype("float32"),
                    rng.uniform(0.5, 4.0, var.shape).astype("float32"),
                ]
            )
    return model


def _lce_export(tmp_path_factory, model, name, bconvs):
    path = tmp_path_factory.mktemp("lite") / f"{name}.tflite"
    report = tapehook.export_tflite(model, path, target="lce")
    assert report["ops"]["LceBconv2d"] == bconvs
    return path


@pytest.fixture(scope="module")
def lce_file(tmp_path_factory):
    return _lce_export(tmp_path_factory, _varied_model(), "varied", 6)


def _run(path, x, num_threads=1, preserve=False):
    interp = lite.Interpreter(
        path, num_threads=num_threads, experimental_preserve_all_tensors=preserve
    )
    interp.allocate_tensors()
    interp.set_tensor(interp.get_input_details()[0]["index"], x)
    interp.invoke()
    return interp


def _inputs(seed, n=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 16, 16, 40)).astype(np.float32)
    x[0, 0, 0, :4] = [0.0, -0.0, np.float32(1e-30), -np.float32(1e-30)]
    # LCE packs x < 0: NaN (either sign) as +1, infinities by their sign.
    x[0, 0, 1, :4] = [np.nan, -np.nan, -np.inf, np.inf]
    return x


# ------------------------------------------------------------------- tests


def test_file_holds_each_form(lce_file):
    """The varied file exercises what the node checks below claim."""
    from tapehook.deploy import flatbuffer

    ops = flatbuffer.op_counts(lce_file.read_bytes())
    assert ops.get("LceBMaxPool2d", 0) == 1, ops
    assert ops.get("LceQuantize", 0) >= 1, ops


@pytest.mark.parametrize("seed", [0, 1])
def test_nodes_match_lce_semantics(lce_file, seed):
    interp = _run(lce_file, _inputs(seed), preserve=True)
    seen = {"bitpacked": 0, "float_exact": 0, "float_zero_pad": 0, "pool": 0, "quantize": 0}
    for op in interp._get_ops_details():
        name = op["op_name"]
        ins = [interp.get_tensor(i) if i >= 0 else None for i in op["inputs"]]
        out = interp.get_tensor(op["outputs"][0])
        if name == "LceQuantize":
            expected = _pack((ins[0] < 0).astype(np.int64))
            np.testing.assert_array_equal(out, expected)
            seen["quantize"] += 1
        elif name == "LceBMaxPool2d":
            # Recomputed from the window's bits: AND of the valid taps.
            x = ins[0]
            n, h, w, c = x.shape
            oh, ow = out.shape[1:3]
            k, s = 2, 2
            _, pt = _same_pads(h, k, s, 1)
            _, pl = _same_pads(w, k, s, 1)
            expected = np.full((n, oh, ow, c), -1, np.int32)
            for i in range(oh):
                for j in range(ow):
                    rows = slice(max(i * s - pt, 0), min(i * s - pt + k, h))
                    cols = slice(max(j * s - pl, 0), min(j * s - pl + k, w))
                    expected[:, i, j] = np.bitwise_and.reduce(
                        x[:, rows, cols].reshape(n, -1, c), axis=1
                    )
            np.testing.assert_array_equal(out, expected)
            seen["pool"] += 1
        elif name == "LceBconv2d":
            opts = _bconv_options(lce_file, op["index"])
            thr = ins[4] if out.dtype == np.int32 else None
            mul = ins[2] if out.dtype != np.int32 else None
            bias = ins[3] if out.dtype != np.int32 else None
            ref, exact = _bconv_reference(
                ins[0], ins[1], opts, opts["channels_in"], out.dtype.type, mul, bias, thr
            )
            if out.dtype == np.int32:
                np.testing.assert_array_equal(out, ref)
                seen["bitpacked"] += 1
            elif exact:
                np.testing.assert_array_equal(out, ref)
                seen["float_exact"] += 1
            else:
                np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)
                seen["float_zero_pad"] += 1
    assert all(seen.values()), seen


def _bconv_options(path, op_index):
    """Custom options of operator op_index, decoded (flexbuffers)."""
    import flatbuffers.flexbuffers as flex
    from tensorflow.lite.python import schema_py_generated as schema

    model = schema.Model.GetRootAs(bytearray(path.read_bytes()), 0)
    op = model.Subgraphs(0).Operators(op_index)
    return flex.Loads(op.CustomOptionsAsNumpy().tobytes())


def test_matches_lce_interpreter(lce_file):
    from tapehook.deploy import run_tflite

    x = _inputs(2)
    ours = _run(lce_file, x)
    ours = ours.get_tensor(ours.get_output_details()[0]["index"])
    theirs = run_tflite(lce_file, x, target="lce")
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_two_threads_same_bits(lce_file):
    x = _inputs(3)
    one = _run(lce_file, x, num_threads=1, preserve=True)
    two = _run(lce_file, x, num_threads=2, preserve=True)
    for op in one._get_ops_details():
        if op["op_name"].startswith("Lce"):
            t = op["outputs"][0]
            np.testing.assert_array_equal(one.get_tensor(t), two.get_tensor(t))


_SHARED_POOL_SCRIPT = """
import sys, threading, time, numpy as np
from tapehook import lite
x = np.load(sys.argv[2])
want = np.load(sys.argv[3])
errors = []

def run(k):
    try:
        interp = lite.Interpreter(sys.argv[1], num_threads=2)
        interp.allocate_tensors()
        out = interp.get_output_details()[0]["index"]
        for i in range(40):
            interp.set_tensor(interp.get_input_details()[0]["index"], x)
            interp.invoke()
            got = interp.get_tensor(out)
            if not np.array_equal(got, want):
                errors.append(f"caller {k}, invoke {i}: {np.abs(got - want).max()}")
            # Past the pool's polling: its thread sleeps and must be woken.
            if i % 4 == 3:
                time.sleep(0.002)
    except Exception as e:
        errors.append(repr(e))

callers = [threading.Thread(target=run, args=(k,)) for k in range(3)]
for c in callers:
    c.start()
for c in callers:
    c.join()
print("\\n".join(errors))
sys.exit(1 if errors else 0)
"""


def test_shared_pool_concurrent_callers(lce_file, tmp_path):
    """Interpreters with the same thread count share one pool: three Python
    threads invoking their own interpreters at once, with pauses that let the
    pool's thread fall asleep, all get the one-thread outputs bit for bit,
    and the process neither hangs (a fresh process under a timeout) nor
    fails."""
    import subprocess
    import sys

    x = _inputs(7)
    one = _run(lce_file, x)
    want = one.get_tensor(one.get_output_details()[0]["index"])
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "want.npy", want)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _SHARED_POOL_SCRIPT,
            str(lce_file),
            str(tmp_path / "x.npy"),
            str(tmp_path / "want.npy"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]


# ---------------------------------------------------------------- bad files


def _with_operator(path, tmp_path, op_name, edit):
    """A copy of the file with edit(operator_t, model_t) applied to each
    operator named op_name."""
    import flatbuffers
    from tensorflow.lite.python import schema_py_generated as schema

    model = schema.ModelT.InitFromObj(schema.Model.GetRootAs(bytearray(path.read_bytes()), 0))
    codes = [c.customCode.decode() if c.customCode else None for c in model.operatorCodes]
    for op in model.subgraphs[0].operators:
        if codes[op.opcodeIndex] == op_name:
            edit(op, model)
    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    out = tmp_path / f"edited_{op_name}.tflite"
    out.write_bytes(bytes(builder.Output()))
    return out


@pytest.mark.parametrize("op_name", ["LceBconv2d", "LceBMaxPool2d"])
def test_corrupt_custom_options_raise(lce_file, tmp_path, op_name):
    rng = np.random.default_rng(4)
    original = bytes(_bconv_options_raw(lce_file, op_name))
    cases = [b"", b"\x00", original[: len(original) // 2], original[:-1] + b"\x07"]
    cases += [bytes(rng.integers(0, 256, rng.integers(1, 80), dtype=np.uint8)) for _ in range(12)]
    for k in range(0, len(original), 3):  # each byte flipped in turn
        flipped = bytearray(original)
        flipped[k] ^= 0xFF
        cases.append(bytes(flipped))
    raised = 0
    for case in cases:

        def edit(op, model, case=case):
            op.customOptions = list(case)

        edited = _with_operator(lce_file, tmp_path, op_name, edit)
        try:
            _run(edited, _inputs(0))
        except TapehookError as exc:
            assert op_name in str(exc) or "LiteRT could not open" in str(exc)
            raised += 1
    assert raised >= 16


def _bconv_options_raw(path, op_name):
    from tensorflow.lite.python import schema_py_generated as schema

    model = schema.Model.GetRootAs(bytearray(path.read_bytes()), 0)
    for i in range(model.Subgraphs(0).OperatorsLength()):
        op = model.Subgraphs(0).Operators(i)
        code = model.OperatorCodes(op.OpcodeIndex()).CustomCode()
        if code and code.decode() == op_name:
            return op.CustomOptionsAsNumpy().tobytes()
    raise AssertionError(op_name)


def test_bad_filter_shape_raises(lce_file, tmp_path):
    def edit(op, model):
        tensor = model.subgraphs[0].tensors[op.inputs[1]]
        tensor.shape = [tensor.shape[0], tensor.shape[1], tensor.shape[2] * 2, 7]

    edited = _with_operator(lce_file, tmp_path, "LceBconv2d", edit)
    with pytest.raises(TapehookError, match="LceBconv2d"):
        _run(edited, _inputs(0))


def test_bad_input_type_raises(lce_file, tmp_path):
    def edit(op, model):
        model.subgraphs[0].tensors[op.outputs[0]].type = 0  # float32 "bits"

    edited = _with_operator(lce_file, tmp_path, "LceQuantize", edit)
    with pytest.raises(TapehookError, match="LceQuantize"):
        _run(edited, _inputs(0))


def test_foreign_files(tmp_path):
    junk = tmp_path / "junk.tflite"
    junk.write_bytes(b"not a flatbuffer" * 10)
    with pytest.raises(TapehookError, match="could not open"):
        lite.Interpreter(junk)
    with pytest.raises(TapehookError, match="no model file"):
        lite.Interpreter(tmp_path / "missing.tflite")


def test_grouped_bconv_matches_lce_semantics(lce_file, tmp_path):
    """Two groups: the 64-channel bconv's filter cut to its first word per
    tap, so each half of the output channels reads its own 32 input channels."""

    def edit(op, model):
        graph = model.subgraphs[0]
        options = op.customOptions
        import flatbuffers.flexbuffers as flex

        if flex.Loads(bytes(options))["channels_in"] != 64:
            return
        tensor = graph.tensors[op.inputs[1]]
        words = np.frombuffer(bytes(model.buffers[tensor.buffer].data), np.int32)
        words = words.reshape(tensor.shape)[..., :1].copy()
        model.buffers[tensor.buffer].data = list(words.tobytes())
        tensor.shape = list(words.shape)

    edited = _with_operator(lce_file, tmp_path, "LceBconv2d", edit)
    interp = _run(edited, _inputs(5), preserve=True)
    checked = 0
    for op in interp._get_ops_details():
        if op["op_name"] != "LceBconv2d":
            continue
        opts = _bconv_options(edited, op["index"])
        ins = [interp.get_tensor(i) if i >= 0 else None for i in op["inputs"]]
        if opts["channels_in"] != 64:
            continue
        assert ins[1].shape[3] == 1
        out = interp.get_tensor(op["outputs"][0])
        ref, _ = _bconv_reference(ins[0], ins[1], opts, 64, np.int32, None, None, ins[4])
        np.testing.assert_array_equal(out, ref)
        checked += 1
    assert checked == 1


_TIER_SCRIPT = """
import sys, numpy as np
from tapehook import lite
interp = lite.Interpreter(sys.argv[1], num_threads=2, experimental_preserve_all_tensors=True)
interp.allocate_tensors()
interp.set_tensor(interp.get_input_details()[0]["index"], np.load(sys.argv[2]))
interp.invoke()
found = {str(op["outputs"][0]): interp.get_tensor(op["outputs"][0])
         for op in interp._get_ops_details() if op["op_name"].startswith("Lce")}
np.savez(sys.argv[3], impl=np.array(lite.kernel_impl()), **found)
"""


@pytest.mark.parametrize("switch", ["TAPEHOOK_NO_AVX512", "TAPEHOOK_NO_AVX2"])
def test_lower_tiers_same_results(lce_file, tmp_path, switch):
    """The AVX2 and portable kernels (switched to, in a fresh process) give
    every LCE op's output of the default tier, bit for bit."""
    import os
    import subprocess
    import sys

    np.save(tmp_path / "x.npy", _inputs(6))
    outputs = {}
    for name, env in (("default", {}), ("lower", {switch: "1"})):
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                _TIER_SCRIPT,
                str(lce_file),
                str(tmp_path / "x.npy"),
                str(tmp_path / f"{name}.npz"),
            ],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        outputs[name] = dict(np.load(tmp_path / f"{name}.npz"))
    impl = {name: str(found.pop("impl")) for name, found in outputs.items()}
    assert impl["lower"] in ({"TAPEHOOK_NO_AVX512": "avx2"}.get(switch, "portable"), "portable")
    if impl["default"] == impl["lower"]:
        pytest.skip(f"this CPU runs {impl['default']} with or without {switch}")
    assert len(outputs["default"]) == 8
    for key, value in outputs["default"].items():
        np.testing.assert_array_equal(outputs["lower"][key], value, err_msg=key)


def test_registerer_by_symbol_name(lce_file):
    """LiteRT's other registerer form: a symbol it looks up in the process."""
    from ai_edge_litert.interpreter import InterpreterWithCustomOps

    lite.kernel_impl()  # loads the library (RTLD_GLOBAL)
    x = _inputs(7)
    by_name = InterpreterWithCustomOps(
        model_path=str(lce_file), custom_op_registerers=["TapehookLiteRegisterLceOps"]
    )
    by_name.allocate_tensors()
    by_name.set_tensor(by_name.get_input_details()[0]["index"], x)
    by_name.invoke()
    ours = _run(lce_file, x)
    np.testing.assert_array_equal(
        by_name.get_tensor(by_name.get_output_details()[0]["index"]),
        ours.get_tensor(ours.get_output_details()[0]["index"]),
    )


def _with_dequantize(path, tmp_path, out_type, scale=None, zero_point=None):
    """A copy whose LceQuantize output also feeds a new LceDequantize (to
    out_type, a TFLite TensorType value), whose output is a graph output."""
    import flatbuffers
    from tensorflow.lite.python import schema_py_generated as schema

    model = schema.ModelT.InitFromObj(schema.Model.GetRootAs(bytearray(path.read_bytes()), 0))
    graph = model.subgraphs[0]
    codes = [c.customCode.decode() if c.customCode else None for c in model.operatorCodes]
    quantize = next(op for op in graph.operators if codes[op.opcodeIndex] == "LceQuantize")
    code = schema.OperatorCodeT()
    code.builtinCode = code.deprecatedBuiltinCode = schema.BuiltinOperator.CUSTOM
    code.customCode = b"LceDequantize"
    code.version = 1
    model.operatorCodes.append(code)
    unpacked = graph.tensors[quantize.inputs[0]]
    tensor = schema.TensorT()
    tensor.shape = list(unpacked.shape)
    tensor.type = out_type
    tensor.name = b"dequantized"
    tensor.buffer = 0
    if scale is not None:
        tensor.quantization = schema.QuantizationParametersT()
        tensor.quantization.scale = [scale]
        tensor.quantization.zeroPoint = [zero_point]
    graph.tensors.append(tensor)
    op = schema.OperatorT()
    op.opcodeIndex = len(model.operatorCodes) - 1
    op.inputs = [quantize.outputs[0]]
    op.outputs = [len(graph.tensors) - 1]
    graph.operators.insert(graph.operators.index(quantize) + 1, op)
    graph.outputs = list(graph.outputs) + [len(graph.tensors) - 1]
    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    out = tmp_path / f"dequantize_{out_type}.tflite"
    out.write_bytes(bytes(builder.Output()))
    return out


@pytest.mark.parametrize(
    "out_type,scale,zero_point,plus,minus",
    [(0, None, None, 1.0, -1.0), (9, 0.5, 3, 5, 1), (9, 0.01, 100, 127, 0), (6, None, None, 1, 0)],
)
def test_dequantize(lce_file, tmp_path, out_type, scale, zero_point, plus, minus):
    """LceDequantize: +1 / -1 as float, as int8 zero_point +- round(1 / scale)
    (saturated), as bool true / false."""
    edited = _with_dequantize(lce_file, tmp_path, out_type, scale, zero_point)
    x = _inputs(8)
    interp = _run(edited, x)
    out = interp.get_tensor(interp.get_output_details()[-1]["index"])
    np.testing.assert_array_equal(out, np.where(x < 0, minus, plus).astype(out.dtype))


def test_quantize_int8_input(lce_file, tmp_path):
    """LceQuantize of int8: bit set where the value is below the zero point."""

    from tensorflow.lite.python import schema_py_generated as schema

    def edit(op, model):
        tensor = model.subgraphs[0].tensors[op.inputs[0]]
        tensor.type = 9
        tensor.quantization = schema.QuantizationParametersT()
        tensor.quantization.scale = [0.05]
        tensor.quantization.zeroPoint = [3]

    edited = _with_operator(lce_file, tmp_path, "LceQuantize", edit)
    interp = lite.Interpreter(edited, experimental_preserve_all_tensors=True)
    interp.allocate_tensors()
    x = np.random.default_rng(9).integers(-128, 128, (1, 16, 16, 40)).astype(np.int8)
    interp.set_tensor(interp.get_input_details()[0]["index"], x)
    interp.invoke()
    quantize = next(op for op in interp._get_ops_details() if op["op_name"] == "LceQuantize")
    np.testing.assert_array_equal(
        interp.get_tensor(quantize["outputs"][0]), _pack((x < 3).astype(np.int64))
    )


def test_batch_resize(lce_file):
    """LCE's converter fixes batch 1; resized to 3, each sample's output is
    its batch-1 output, bit for bit."""
    x = _inputs(10, n=3)
    interp = lite.Interpreter(lce_file)
    index = interp.get_input_details()[0]["index"]
    interp.resize_tensor_input(index, x.shape)
    interp.allocate_tensors()
    interp.set_tensor(index, x)
    interp.invoke()
    batched = interp.get_tensor(interp.get_output_details()[0]["index"])
    for i in range(3):
        one = _run(lce_file, x[i : i + 1])
        np.testing.assert_array_equal(
            batched[i : i + 1], one.get_tensor(one.get_output_details()[0]["index"])
        )


# ------------------------------------------------------------ residual adds


def _residual_model():
    """Residual blocks as QuickNet writes them (x + BN(bconv(x))), with the
    ADD's operands both ways round, both paddings and a ReLU after one ADD
    (the converter fuses it into the ADD), and one conv output that also
    feeds a second op (not fusable)."""
    import keras

    from tapehook.larq import layers as lq

    kw = dict(input_quantizer="ste_sign", kernel_quantizer="ste_sign", use_bias=False)
    i = keras.Input((9, 9, 40))
    x = keras.layers.Conv2D(40, 1)(i)
    for k, (pad, swap) in enumerate([(1.0, False), (0.0, True), (1.0, True)]):
        y = lq.QuantConv2D(40, 3, padding="same", pad_values=pad, **kw)(x)
        y = keras.layers.BatchNormalization(name=f"bn{k}")(y)
        x = keras.layers.Add()([y, x] if swap else [x, y])
        if k == 1:
            x = keras.layers.ReLU()(x)
    y = lq.QuantConv2D(40, 3, padding="same", pad_values=1.0, **kw)(x)
    y = keras.layers.BatchNormalization(name="bn_shared")(y)
    x = keras.layers.Add()([x, y])
    pool = keras.layers.GlobalAveragePooling2D()
    o = keras.layers.Dense(3)(keras.layers.Concatenate()([pool(x), pool(y)]))
    return _random_batch_norms(keras.Model(i, o), seed=3, signed_gamma=False)


@pytest.fixture(scope="module")
def residual_file(tmp_path_factory):
    return _lce_export(tmp_path_factory, _residual_model(), "residual", 4)


def _output(interp, x):
    index = interp.get_input_details()[0]["index"]
    interp.resize_tensor_input(index, x.shape)
    interp.allocate_tensors()
    interp.set_tensor(index, x)
    interp.invoke()
    return interp.get_tensor(interp.get_output_details()[0]["index"])


@pytest.mark.parametrize("num_threads", [1, 2])
def test_residual_adds_fused_same_bits(residual_file, num_threads):
    """The three ADDs of a conv's own output are taken into the conv (the
    fourth conv's output also feeds the pool: kept), and the outputs are
    those with the ADDs run by LiteRT, bit for bit, at batch 1 and 3."""
    from tapehook.deploy import flatbuffer

    assert flatbuffer.op_counts(residual_file.read_bytes())["ADD"] == 4
    schema = flatbuffer._schema()
    model = schema.Model.GetRootAs(bytearray(residual_file.read_bytes()), 0)
    activations = []
    for i in range(model.Subgraphs(0).OperatorsLength()):
        op = model.Subgraphs(0).Operators(i)
        if op.BuiltinOptionsType() == schema.BuiltinOptions.AddOptions:
            options = schema.AddOptions()
            options.Init(op.BuiltinOptions().Bytes, op.BuiltinOptions().Pos)
            activations.append(options.FusedActivationFunction())
    assert sorted(activations) == [0, 0, 0, schema.ActivationFunctionType.RELU]
    fused = lite.Interpreter(residual_file, num_threads=num_threads)
    plain = lite.Interpreter(residual_file, num_threads=num_threads, fuse=False)
    assert (fused.fused_ops, plain.fused_ops) == (3, 0)
    kept = lite.Interpreter(residual_file, experimental_preserve_all_tensors=True)
    assert kept.fused_ops == 0  # every tensor of the file stays readable
    for n, seed in ((1, 20), (3, 21)):
        x = np.random.default_rng(seed).standard_normal((n, 9, 9, 40)).astype(np.float32)
        np.testing.assert_array_equal(_output(fused, x), _output(plain, x))


def test_residual_adds_from_bytes(residual_file):
    """model_content takes the same rewrite as a path."""
    x = np.random.default_rng(22).standard_normal((1, 9, 9, 40)).astype(np.float32)
    from_bytes = lite.Interpreter(model_content=residual_file.read_bytes())
    assert from_bytes.fused_ops == 3
    np.testing.assert_array_equal(
        _output(from_bytes, x), _output(lite.Interpreter(residual_file, fuse=False), x)
    )


@pytest.mark.parametrize("declared", [False, True])
def test_bad_epilogue_raises(lce_file, tmp_path, declared):
    """An LceBconv2d input beyond LCE's five (a foreign file's), undeclared or
    declared as an epilogue step but not a float tensor of one value, one per
    channel or the output's shape, is named, not read out of bounds."""
    import numpy as np
    from flatbuffers import flexbuffers

    def edit(op, model):
        op.inputs = [*op.inputs, op.inputs[1]]  # the int32 filter
        if declared:
            options = flexbuffers.Loads(bytes(bytearray(op.customOptions)))
            options.update(tapehook_epilogue_steps=1, tapehook_epilogue=3)
            op.customOptions = np.frombuffer(flexbuffers.Dumps(options), np.uint8)

    edited = _with_operator(lce_file, tmp_path, "LceBconv2d", edit)
    message = "an epilogue operand .input 5" if declared else "expected 5 input"
    with pytest.raises(TapehookError, match=message):
        _run(edited, _inputs(0))


@pytest.fixture(scope="module")
def bireal_file(tmp_path_factory):
    import keras

    from tapehook import zoo

    keras.utils.set_random_seed(5)
    model = zoo.BiRealNet(input_shape=(32, 32, 3), num_classes=10)
    return _lce_export(tmp_path_factory, _random_batch_norms(model, 6, True), "bireal", 16)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_bireal_chains_fused_same_bits(bireal_file, num_threads):
    """Bi-Real-Net's LCE file follows each binary conv with SUB (from one
    value), MUL, MUL (one value per channel) and ADDs (the batch norm's, the
    residual): every one is taken into the 16 convs, and the outputs are
    LiteRT's, bit for bit."""
    from tapehook.deploy import flatbuffer

    counts = flatbuffer.op_counts(bireal_file.read_bytes())
    assert (counts["SUB"], counts["MUL"]) == (16, 32) and counts["ADD"] >= 16, counts
    fused = lite.Interpreter(bireal_file, num_threads=num_threads)
    assert fused.fused_ops == counts["SUB"] + counts["MUL"] + counts["ADD"]
    plain = lite.Interpreter(bireal_file, num_threads=num_threads, fuse=False)
    for n, seed in ((1, 30), (2, 31)):
        x = np.random.default_rng(seed).standard_normal((n, 32, 32, 3)).astype(np.float32)
        np.testing.assert_array_equal(_output(fused, x), _output(plain, x))
