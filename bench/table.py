"""Turns bench results into docs: every measured number in docs/performance.md,
docs/models.md and the README's speed headline comes from bench/results/*.json
through this file.

    python bench/table.py [results.json]   # print the speed table (markdown)
    python bench/table.py --write          # write the two pages and the README headline
    python bench/table.py --check          # fail if any differs from what --write writes

Inputs: bench/results/latest.json (bench/run.py), memory.json (bench/memory.py),
one JSON per other benchmark (OTHER_BENCHMARKS below), the whole-model runs
(MODEL_RUNS) and, when present, baseline.json: a bench/run.py run from before the
change being measured, shown next to latest.json. The prose below is fixed text on
purpose: it says why, and leaves the how much to the data.
"""

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "performance.md"
MODELS_DOC = ROOT / "docs" / "models.md"
README = ROOT / "README.md"
HEADLINE_START = "<!-- speed headline: written by `python bench/table.py --write` -->"
HEADLINE_END = "<!-- end of speed headline -->"

ROWS = [
    ("forward_binary", "fully binary forward"),
    ("forward_binary_graph", "fully binary forward, per conv of a graph"),
    ("forward_weight_only", "weight-only forward (inference)"),
    ("step_binary", "fully binary training step"),
    ("step_weight_only", "weight-only training step"),
    ("kernel_forward_binary", "fully binary forward kernel"),
    ("kernel_forward_weight_only", "weight-only forward kernel"),
    ("kernel_backprop_input", "backprop-input kernel"),
    ("kernel_backprop_filter", "backprop-filter kernel (binary x)"),
]


def load(path):
    return json.loads(pathlib.Path(path).read_text())


def _shapes(data):
    return list(dict.fromkeys(r["shape"] for r in data["results"][0]["rows"]))


def _block(data, onednn):
    return next((b for b in data["results"] if b["onednn"] == onednn), None)


def _speedups(data, comparison, onednn):
    """Median speedups of one comparison over the shapes, for one oneDNN setting."""
    block = _block(data, onednn)
    if block is None:
        return []
    return [r["speedup_median"] for r in block["rows"] if r["comparison"] == comparison]


def _span(values, unit="x", digits=2):
    """'lo-hi' of values as printed (one number when they print the same)."""
    if not values:
        return "-"
    lo, hi = (f"{v:.{digits}f}" for v in (min(values), max(values)))
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


def machine_line(data):
    blocks = data["results"]
    flags = ", ".join(data["cpu_flags"])
    return (
        f"Measured {data['date']} on {data['cpu_model']} ({data['cpu_count']} cores; "
        f"flags {flags}), TF {blocks[0]['tf_version']}, AMX kernels "
        f"{'on' if blocks[0].get('amx_kernels') else 'off'}; speedup = stock time / "
        f"tapehook time by median of {data['args']['reps']} interleaved reps "
        "(min-based in parentheses)."
    )


def speed_table(data):
    """The table of every comparison, shape and oneDNN setting, as markdown lines."""
    shapes = _shapes(data)
    lines = [
        "| oneDNN | comparison | " + " | ".join(shapes) + " |",
        "|---|---|" + "---|" * len(shapes),
    ]
    for block in data["results"]:
        by_key = {(r["comparison"], r["shape"]): r for r in block["rows"]}
        for key, label in ROWS:
            if not any(k == key for k, _ in by_key):
                continue
            cells = []
            for shape in shapes:
                r = by_key.get((key, shape))
                cells.append(
                    "-" if r is None else f"{r['speedup_median']:.2f}x ({r['speedup_min']:.2f})"
                )
            lines.append(f"| {block['onednn']} | {label} | " + " | ".join(cells) + " |")
    return lines


def summary_table(data):
    """Per comparison, the range of median speedups over the layers, per oneDNN setting."""
    settings = [b["onednn"] for b in data["results"]]
    lines = [
        "| comparison | " + " | ".join(f"oneDNN {s}" for s in settings) + " |",
        "|---|" + "---|" * len(settings),
    ]
    for key, label in ROWS:
        spans = [_span(_speedups(data, key, s)) for s in settings]
        if any(s != "-" for s in spans):
            lines.append(f"| {label} | " + " | ".join(spans) + " |")
    return lines


def change_table(before, after):
    """Per comparison and shape, after's median speedup over before's (oneDNN as in both)."""
    shapes = [s for s in _shapes(after) if s in _shapes(before)]
    lines = [
        "| oneDNN | comparison | " + " | ".join(shapes) + " |",
        "|---|---|" + "---|" * len(shapes),
    ]
    for block in after["results"]:
        old = _block(before, block["onednn"])
        if old is None:
            continue
        new_by = {(r["comparison"], r["shape"]): r for r in block["rows"]}
        old_by = {(r["comparison"], r["shape"]): r for r in old["rows"]}
        for key, label in ROWS:
            cells = []
            for shape in shapes:
                a, b = new_by.get((key, shape)), old_by.get((key, shape))
                cells.append(
                    "-"
                    if a is None or b is None
                    else f"{a['speedup_median'] / b['speedup_median']:.2f}"
                )
            if any(c != "-" for c in cells):
                lines.append(f"| {block['onednn']} | {label} | " + " | ".join(cells) + " |")
    return lines


def _memory_rows(memory):
    return {(r["mode"], r["impl"]): r for r in memory["rows"]}


def memory_table(memory):
    budget_gib = memory["budget_bytes"] / 2**30
    batch = memory["rows"][0]["batch"]
    lines = [
        f"| mode | | conv inputs kept for backward (batch {batch}) | peak memory per sample "
        f"| largest batch in a {budget_gib:g} GiB step |",
        "|---|---|---|---|---|",
    ]
    rows = _memory_rows(memory)
    for (mode, impl), r in rows.items():
        kept = r["conv_input_bytes_kept"] / 2**20
        base = rows.get((mode, "larq-style"))
        less = ""
        if impl != "larq-style" and base:
            less = f" ({base['conv_input_bytes_kept'] / r['conv_input_bytes_kept']:.0f}x less)"
        name = "tf.function" if mode == "function" else mode
        lines.append(
            f"| {name} | {impl} | {kept:.1f} MiB{less} | "
            f"{r['peak_bytes_per_sample'] / 2**20:.1f} MiB | {r['max_batch_in_4GiB']} |"
        )
    return lines


def memory_savings(memory):
    """{mode: (kept ratio, peak-per-sample drop in %, more samples in the budget in %)}."""
    rows = _memory_rows(memory)
    out = {}
    for mode in dict.fromkeys(m for m, _ in rows):
        ours, base = rows.get((mode, "tapehook")), rows.get((mode, "larq-style"))
        if ours and base:
            out[mode] = (
                base["conv_input_bytes_kept"] / ours["conv_input_bytes_kept"],
                100 * (1 - ours["peak_bytes_per_sample"] / base["peak_bytes_per_sample"]),
                100 * (ours["max_batch_in_4GiB"] / base["max_batch_in_4GiB"] - 1),
            )
    return out


def _cpu_words(data):
    flags = set(data["cpu_flags"])
    isa = [name for flag, name in (("avx512f", "AVX-512"), ("amx_tile", "AMX")) if flag in flags]
    return f"{data['cpu_count']}-core {data['cpu_model']}" + (
        f" with {' and '.join(isa)}" if isa else ""
    )


def headline(data, memory):
    """The README's one-line summary, linking to docs/performance.md."""
    onednn = "on" if _block(data, "on") else data["results"][0]["onednn"]
    parts = [
        f"a fully binary conv runs {_span(_speedups(data, 'forward_binary_graph', onednn))} "
        "faster than stock TensorFlow (per conv of a graph)",
        f"a fully binary training step {_span(_speedups(data, 'step_binary', onednn))}",
        f"a weight-only step {_span(_speedups(data, 'step_weight_only', onednn))}",
    ]
    saved = memory_savings(memory)
    if saved:
        kept = min(v[0] for v in saved.values())
        drops = [v[1] for v in saved.values()]
        parts.append(
            f"binary activations keep {kept:.0f}x less for the backward and cut peak training "
            f"memory per sample by {_span(drops, unit=' %', digits=0)}"
        )
    return (
        f"**Speed and memory** on a {_cpu_words(data)}, oneDNN {onednn}, median over "
        f"{len(_shapes(data))} layer shapes: "
        + ", ".join(parts[:-1])
        + "; "
        + parts[-1]
        + ". Tables and how they are measured: [docs/performance.md](docs/performance.md)."
        + models_headline()
    )


# bench/models.py's PyTorch configurations (table.py reads only their JSON).
TORCH_IMPLS = ("pytorch", "pytorch-channels-last", "pytorch-compile")


def models_headline():
    """The whole-model sentence: the default path (a stock Keras model
    binarized, DEFAULT_RUNS) at batch 32 against larq 0.14 and the fastest
    PyTorch form, training and predict."""
    runs = [load(RESULTS / name) for name, _ in DEFAULT_RUNS]
    data = runs[0]
    rows = [
        r
        for run in runs
        for r in run["rows"]
        if r["impl"] == "tapehook-default" and r["batch"] == 32
    ]
    if not rows:
        return ""

    def spans(what):
        larq = [r[f"{what}_x_larq_median"] for r in rows if f"{what}_x_larq_median" in r]
        torch = [_against_fastest(r, what, TORCH_IMPLS) for r in rows]
        torch = [t for t in torch if t is not None]
        return f"{_span(larq)} as fast as larq 0.14 and {_span(torch)} as fast as PyTorch"

    sizes = " and ".join(f"{s} px" for s in sorted({r["size"] for r in rows}))
    machine = _cpu_words({**data, "cpu_model": data["machine"]})
    return (
        f" **Whole models as users write them** on a {machine} (Bi-Real-Net-18, "
        f"QuickNet-small from Keras's own layers, `tapehook.binarize`d; batch 32, {sizes}): "
        f"training {spans('train')}, predict {spans('predict')}: "
        "[docs/models.md](docs/models.md)."
    )


DOC_INTRO = """\
# Performance

<!-- Generated by `python bench/table.py --write` from bench/results/*.json; do not edit.
     `make lint` fails when this file is not what the results say. -->

Each table names its JSON in `bench/results/` and the command that reruns it
(options: `bench/README.md`).

## Speed

`bench/run.py` (`bench/results/latest.json`): tapehook against stock TF in one
process, rep by rep, oneDNN off and on; stock is `tf.nn.conv2d` on ±1 floats
(forwards), the larq-style `tf.custom_gradient` step (steps), stock Conv2D and
its backprops (kernels). Batch 16, NHWC, SAME, stride 1, `scale="mean_abs"`.
"""

DOC_NOISE = """\
Compare ratios within one run. Per layer shape: `python bench/table.py`,
`bench/results/latest.png`.
"""

DOC_WHY = """\
Why: [Design](design.md); the sign-table backprops' prototype:
`bench/lut_backprop/REPORT.md` (`lut_backprop_prototype.json`).
"""

DOC_MEMORY = """\
## Training memory

`bench/memory.py` (`bench/results/memory.json`): one training step of batch
norms and binary 3x3 convs per configuration, each in a fresh process.
"""

DOC_MEMORY_NOTES = """\
"Peak per sample": the slope of peak resident memory over two batch sizes;
the largest batch extrapolates it.
"""


def performance_doc(data, memory, baseline=None):
    out = [
        DOC_INTRO,
        machine_line(data),
        "",
        "Median speedup over the layers, lowest to highest:",
        "",
    ]
    out += summary_table(data)
    out += ["", DOC_NOISE]
    overhead = {
        s: _speedups(data, "eager_step_overhead", s) for s in ("off", "on") if _block(data, s)
    }
    if any(overhead.values()):
        spans = ", ".join(f"{_span(v)} with oneDNN {s}" for s, v in overhead.items() if v)
        out += [
            "Interposer overhead: an eager batch-1 step through tapehook runs at "
            f"{spans} of a hand-written `tf.custom_gradient` step on the same kernels "
            "(above 1: tapehook's is faster).",
            "",
        ]
    out.append(DOC_WHY)
    out.append(DOC_MEMORY)
    out.append(f"Model: {memory['model']}, TF {memory['tf_version']}.\n")
    out += memory_table(memory)
    saved = memory_savings(memory)
    if saved:
        words = "; ".join(
            f"{'tf.function' if mode == 'function' else mode}: {drop:.0f} % less peak memory "
            f"per sample, {more:.0f} % more samples in the budget"
            for mode, (_, drop, more) in saved.items()
        )
        out += ["", f"Whole training step, tapehook against larq-style: {words}.", ""]
    out.append(DOC_MEMORY_NOTES)
    out += [
        "## Other benchmarks",
        "",
        "Bi-Real-Net-18 and QuickNet-small against larq 0.14 and PyTorch: "
        "[Whole models](models.md).",
        "",
    ]
    for bench in OTHER_BENCHMARKS:
        out += other_section(bench)
    if baseline is not None:
        out += [
            "## Before and after",
            "",
            "`bench/results/baseline.json` (before the change being measured) and "
            "`latest.json` (after), on the same machine; their dates are on the "
            "machine lines.",
            "",
            "Before: " + machine_line(baseline),
            "",
        ]
        out += speed_table(baseline)
        out += [
            "",
            "After: the table above. After's median speedup / before's (1.00: "
            "unchanged; the noise of one cell is tens of percent):",
            "",
        ]
        out += change_table(baseline, data)
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def _ms(cell):
    return f"{cell['median']:.2f}"


def _x(value):
    return "-" if value is None else f"{value:.2f}x"


def adam_clip_table(data):
    lines = [
        "| model | px | parameters (clipped) | fused Adam + clip ms | Adam, then clip ms "
        "| Keras 3 Adam ms | x Adam, then clip | x Keras 3 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['model']} | {r['size']} | {r['parameters']:,} ({r['clipped_parameters']:,}) "
            f"| {_ms(r['ms']['fused'])} | {_ms(r['ms']['separate'])} | {_ms(r['ms']['keras'])} "
            f"| {_x(r['separate_x']['median'])} | {_x(r['keras_x']['median'])} |"
        )
    return lines


def batch_norm_table(data):
    """One row per feature map, the batch sizes side by side."""
    batches = sorted({r["batch"] for r in data["rows"]})
    maps = {}
    for r in data["rows"]:
        maps.setdefault((r["size"], r["side"], r["channels"]), {})[r["batch"]] = r
    head = ["px", "feature map"]
    head += [f"{kind} x, batch {b}" for kind in ("train", "inference") for b in batches]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (size, side, channels), by_batch in maps.items():
        cells = [str(size), f"{side}x{side}x{channels}"]
        for key in ("train_x", "infer_x"):
            cells += [_x(by_batch[b][key]["median"]) if b in by_batch else "-" for b in batches]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def backprops_table(data):
    """Per shape: each plan's speedup (median of the file's runs) per backprop."""
    kinds = [("dX", "dX"), ("dW", "dW"), ("dW packed", "dW packed")]
    head = ["shape"] + [f"{label}, {plan}" for plan in data["plans"] for _, label in kinds]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in data["rows"]:
        cells = [r["shape"]]
        for plan in data["plans"]:
            for kind, _ in kinds:
                values = r.get(f"{kind} {plan} x")
                cells.append(_x(sorted(values)[len(values) // 2]) if values else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def backward_route_table(data):
    """The auto route's whole backward over stock (median of the runs), lowest to highest
    over the shapes, per input estimator at the smallest and largest batch."""
    batches = sorted({r["batch"] for r in data["rows"]})
    batches = [batches[0], batches[-1]]
    lines = ["| input estimator | " + " | ".join(f"batch {b}" for b in batches) + " |"]
    lines.append("|---|" + "---|" * len(batches))
    for e in dict.fromkeys(r["estimator"] for r in data["rows"]):
        spans = [
            _span(
                [
                    sorted(r["x"])[len(r["x"]) // 2]
                    for r in data["rows"]
                    if r["estimator"] == e and r["batch"] == b
                ]
            )
            for b in batches
        ]
        lines.append(f"| {e} | " + " | ".join(spans) + " |")
    return lines


def overhead_table(data):
    lines = [
        "| eager op | stock us | tapehook imported: + us | a variable marked elsewhere: + us |",
        "|---|---|---|---|",
    ]
    for op, r in data["table"].items():
        lines.append(
            f"| `{op}` | {r['stock']['median_us']:.1f} | {r['imported']['delta_median_us']:+.2f} "
            f"| {r['marked_elsewhere']['delta_median_us']:+.2f} |"
        )
    return lines


def padding_table(data):
    kinds = list(dict.fromkeys(r["kind"] for r in data["rows"]))
    by = {(r["shape"], r["kind"]): r["ratio_median"] for r in data["rows"]}
    lines = ["| shape | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for shape in dict.fromkeys(r["shape"] for r in data["rows"]):
        lines.append(f"| {shape} | " + " | ".join(_x(by.get((shape, k))) for k in kinds) + " |")
    return lines


def rsign_table(data):
    """Per shape: each variant's time over the plain conv's, forward and step."""
    head = ["shape (batch 32)"] + [
        f"{v} {kind}" for v in ("rsign", "balanced") for kind in ("forward", "step")
    ]
    by = {(r["shape"], r["kind"]): r for r in data["rows"]}
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for shape in dict.fromkeys(r["shape"] for r in data["rows"]):
        cells = [
            _x(by[(shape, kind)][f"{v}_x_median"])
            for v in ("rsign", "balanced")
            for kind in ("forward", "step")
        ]
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    return lines


def pack_accuracy_table(data):
    names = {"1": "default: e'(x) in 16-bit fixed point", "float32": "float32: x kept"}
    lines = [
        "| `TAPEHOOK_PACK_INPUTS` | test accuracy per seed | final loss per seed |",
        "|---|---|---|",
    ]
    for key, runs in data.items():
        acc = ", ".join(f"{r['test_accuracy']:.4f}" for r in runs)
        loss = ", ".join(f"{r['final_loss']:.4f}" for r in runs)
        lines.append(f"| {names.get(key, key)} | {acc} | {loss} |")
    return lines


def deploy_table(data):
    lines = [
        "| file | bytes | LceBconv2d | ms per image | max abs diff vs predict |",
        "|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['name']} | {r['bytes']:,} | {r['bconv']} | {r['ms_batch1']:.2f} "
            f"| {r['max_abs_diff_vs_predict']:.1e} |"
        )
    return lines


def deploy_zoo_table(data):
    lines = [
        "| model | file, interpreter | MiB | ms per image | x float twin | max abs diff vs LCE |",
        "|---|---|---|---|---|---|",
    ]
    floats = {r["model"]: r["ms_batch1"] for r in data["rows"] if r["binary_layers"] == 0}
    for r in data["rows"]:
        diff = r.get("max_abs_diff_vs_lce")
        lines.append(
            f"| {r['model']} | {r['name']} | {r['bytes'] / 2**20:.1f} | {r['ms_batch1']:.1f} "
            f"| {floats[r['model']] / r['ms_batch1']:.2f} | {'-' if diff is None else f'{diff:.1e}'} |"
        )
    return lines


def saved_tensors_table(data):
    mib = 2**20
    models = list(dict.fromkeys(r["model"] for r in data["rows"]))
    lines = [
        "| impl | input estimator | " + " | ".join(f"{m} MiB/sample" for m in models) + " |",
        "|---|---|" + "---|" * len(models),
    ]
    by = {(r["model"], r["impl"], r["estimator"]): r for r in data["rows"]}
    for impl, est in dict.fromkeys((r["impl"], r["estimator"]) for r in data["rows"]):
        cells = [
            f"{by[(m, impl, est)]['bytes_per_sample'] / mib:.2f}" if (m, impl, est) in by else "-"
            for m in models
        ]
        lines.append(f"| {impl} | {est or '-'} | " + " | ".join(cells) + " |")
    return lines


# (file in bench/results, title, what it measures, command that rewrites it, table)
OTHER_BENCHMARKS = [
    (
        "batch_norm.json",
        "tapehook.layers.BatchNormalization against Keras 3's",
        "A training call with its backward and an inference call at Bi-Real-Net-18's "
        "batch-norm shapes; x = Keras time / tapehook time (median).",
        "python bench/batch_norm.py",
        batch_norm_table,
    ),
    (
        "adam_clip.json",
        "tapehook.optimizers.Adam with a WeightClip in one kernel",
        "One optimizer step over a whole model's variables (median ms): the fused "
        "update-and-clip, TF's fused Adam followed by the constraint, and Keras 3's Adam.",
        "python bench/adam_clip.py",
        adam_clip_table,
    ),
    (
        "backprops_amx.json",
        "Binary backprops on AMX and AVX-512 against oneDNN",
        "Both backprops at Bi-Real-Net-18 / QuickNet-small shapes, batch 32, ±1 operands "
        "ready, per plan; x = stock time / tapehook time (packed: dW from packed bits). "
        "`tapehook/dispatch.py`'s thresholds rest on it, `backprops.json` and "
        "`backprops_amx_7x7.json` (two `--only 7x7` runs).",
        "python bench/backprops.py --plans amx,avx512 --sizes 112,224 "
        "--out bench/results/backprops_amx.json",
        backprops_table,
    ),
    (
        "backprops_avx2.json",
        "Binary backprops on AVX2 against Eigen",
        "The AVX2 kernels (dX GEMM, dW sign tables) where TF runs Eigen's convolutions.",
        "TAPEHOOK_NO_AVX512=1 python bench/backprops.py --plans avx2 "
        "--out bench/results/backprops_avx2.json",
        backprops_table,
    ),
    (
        "backward_route.json",
        "A binary conv's whole backward: the auto route against stock",
        "x = stock route time / auto route time over Bi-Real-Net-18 and QuickNet-small "
        "shapes (per shape and batch in the file).",
        "python bench/backward_route.py",
        backward_route_table,
    ),
    (
        "saved_tensors.json",
        "What a training step keeps for its backward",
        "Traced, not run: the forward tensors the backward reads, per sample, batch 32, "
        "112 px (`--markdown` breaks them down by layer).",
        "python bench/saved_tensors.py",
        saved_tensors_table,
    ),
    (
        "pack_accuracy.json",
        "Accuracy with approx_sign inputs kept in 16-bit fixed point",
        "`examples/train_digits.py`'s model with approx_sign inputs, three seeds each.",
        "python bench/pack_accuracy.py",
        pack_accuracy_table,
    ),
    (
        "deploy.json",
        "Deployed files",
        "A small BNN exported each way ([Deploy](deploy.md)); one thread unless said, batch 1.",
        "python bench/deploy.py",
        deploy_table,
    ),
    (
        "deploy_zoo.json",
        "Zoo models deployed on x86: tapehook.lite against LCE's interpreter and float "
        "(AVX-512 kernels)",
        "224 px, random weights: the float twin (XNNPACK), the `filters='float'` file, "
        "the LCE file in LCE 0.16's interpreter and in `tapehook.lite`; one thread unless "
        "said, batch 1, median of 50.",
        "python bench/deploy.py --zoo QuickNetSmall,BiRealNet --size 224 "
        "--out bench/results/deploy_zoo.json",
        deploy_zoo_table,
    ),
    (
        "deploy_zoo_avx2.json",
        "The same on an x86 without AVX-512 (AVX2 kernels)",
        "As above, on a CPU whose best tier is AVX2 (most desktop and laptop x86, "
        "AMD before Zen 4).",
        "python bench/deploy.py --zoo QuickNetSmall,BiRealNet --size 224 "
        "--out bench/results/deploy_zoo_avx2.json (on such a CPU)",
        deploy_zoo_table,
    ),
    (
        "overhead.json",
        "What importing tapehook costs unmarked eager ops",
        "Median µs per eager call, stock TF; the rows are added time.",
        "python bench/overhead.py",
        overhead_table,
    ),
    (
        "rsign.json",
        "What RSign and balanced weights cost per binary conv",
        "A binary 3x3 conv after `RSign` (folded: the conv binarizes x - beta itself) or "
        'with `balance="std"`, over the plain conv: time / plain time, median.',
        "python bench/rsign.py",
        rsign_table,
    ),
    (
        "padding.json",
        "One-padding against zero padding",
        "A binary conv's forward and training step, zero-padding time / "
        "`pad_value=1.0` time (median).",
        "python bench/padding.py",
        padding_table,
    ),
]


def other_section(bench):
    name, title, what, command, table = bench
    data = load(RESULTS / name)
    machine = data.get("machine") if isinstance(data, dict) else None
    where = f" Measured on {machine}." if machine and machine not in ("x86_64", "unknown") else ""
    return [
        f"### {title}",
        "",
        f"{what} From `bench/results/{name}`; rerun: `{command}`.{where}",
        "",
        *table(data),
        "",
    ]


# Whole models: (file in bench/results, what the run measured, its command line).
MODEL_RUNS = [
    (
        "models_112px.json",
        "Training and predict at 112 px, batch 1 and 32, both models",
        "python bench/models.py --sizes 112 --batches 1,32 --estimators ste_sign,approx_sign "
        "--impls float-fused,larq-style,tapehook-fused,tapehook-recompute,"
        "tapehook-recompute-early,larq --rounds 1 --no-profile --no-tensor-memory "
        "--larq-python LARQ_ENV/bin/python --out bench/results/models_112px.json",
    ),
    (
        "models_224px.json",
        "Training and predict of Bi-Real-Net-18 at 224 px, batch 32",
        "python bench/models.py --models birealnet18 --sizes 224 --batches 32 "
        "--estimators ste_sign,approx_sign --impls larq-style,float-fused,tapehook-fused,"
        "tapehook-recompute-early,tapehook-recompute-early-bf16x2,larq --rounds 2 "
        "--no-profile --no-tensor-memory --larq-python LARQ_ENV/bin/python "
        "--out bench/results/models_224px.json",
    ),
]
MEMORY_RUNS = [
    (
        "models_memory_birealnet_112px.json",
        "python bench/models.py --models birealnet18 --sizes 112 --batches 1,32 "
        "--estimators ste_sign,approx_sign --impls larq-style,tapehook-recompute,"
        "tapehook-recompute-early,larq --rounds 2 --tensor-repeats 2 --tensor-steps 5 "
        "--no-profile --larq-python LARQ_ENV/bin/python "
        "--out bench/results/models_memory_birealnet_112px.json",
    ),
    (
        "models_memory_quicknet_112px.json",
        "python bench/models.py --models quicknet_small --sizes 112 --batches 1,32 "
        "--estimators ste_sign,approx_sign --impls float-fused,larq-style,tapehook-fused,"
        "tapehook-recompute,tapehook-recompute-early,larq --rounds 2 --tensor-repeats 2 "
        "--tensor-steps 5 --no-profile --larq-python LARQ_ENV/bin/python "
        "--out bench/results/models_memory_quicknet_112px.json",
    ),
]

# The default path (a stock Keras model binarized, nothing else said) against
# larq 0.14, PyTorch and the float network: (file, its command line).
DEFAULT_RUNS = [
    (
        "models_default_112px.json",
        "python bench/models.py --models birealnet18,quicknet_small --sizes 112 --batches 1,32 "
        "--estimators own --impls tapehook-default,tapehook-larq,tapehook-zoo,larq,larq-style,"
        "float-fused,"
        "pytorch-channels-last,pytorch-compile --rounds 2 --no-profile --tensor-repeats 1 "
        "--torch-python TORCH_ENV/bin/python --larq-python LARQ_ENV/bin/python "
        "--out bench/results/models_default_112px.json",
    ),
    (
        "models_default_224px.json",
        "python bench/models.py --models birealnet18,quicknet_small --sizes 224 --batches 32 "
        "--estimators own --impls tapehook-default,tapehook-larq,tapehook-zoo,larq,larq-style,"
        "pytorch-channels-last,pytorch-compile --rounds 1 --no-profile --no-tensor-memory "
        "--torch-python TORCH_ENV/bin/python --larq-python LARQ_ENV/bin/python "
        "--out bench/results/models_default_224px.json",
    ),
]

MODELS_DEFAULT = """\
## The default path

What a user gets with nothing but tapehook's defaults (fast layers on):
`binarize`: the model written with Keras's own layers and
`tapehook.binarize`d; `tapehook.larq`: the same model as larq code
(`lq.layers.QuantConv2D`, Keras's own batch norm, pool, add and Adam) run
through the drop-in; `tapehook.zoo`: `tapehook.zoo.BiRealNet` /
`QuickNetSmall` (random weights, the model's own input estimator).
PyTorch: the architecture as BNN papers' PyTorch code writes it
(`bench/torch_models.py`: autograd signs, `F.conv2d` on sign(x) and
mean|W| * sign(W), `nn.BatchNorm2d`, Adam, kernels clipped;
`tests/test_bench_models.py` checks it against the Keras model),
channels-last and `torch.compile`, with TF's thread count; x PyTorch is
against the faster of the two in each round. x float: against the float
network with tapehook's layers (float-fused). Tensor peak: x lower than
larq-style's, batch 32 against batch 1. `TORCH_ENV`: a venv with torch (CPU
build).
"""

MODELS_INTRO = """\
# Whole models

<!-- Generated by `python bench/table.py --write` from bench/results/models_*.json; do not
     edit. `make lint` fails when this file is not what the results say. -->

`bench/models.py` trains (`fit`) and runs (`predict`) Bi-Real-Net-18 and
QuickNet-small on synthetic data, each implementation in its own subprocess
(`tests/test_bench_models.py` checks they compute the same model).
float-fused: the float network with tapehook's batch norm and Adam;
larq-style: larq's math on Keras 3; larq: larq 0.14 on tf-keras (`LARQ_ENV`);
tapehook-recompute-early: tapehook's layers written into the model, batch
norms narrower than 256 channels recomputed (what fast layers choose, with the
pool's ReLU fusion on; the default path itself: its own section below);
-bf16x2: with `backprop_dy="bf16x2"`. The JSONs hold every
configuration measured. Ratios are within a round (median over rounds); img/s:
batch / median step time.
"""

MODELS_MEMORY = """\
## Training memory

**Tensor peak**: the peak bytes of TF tensors in a `fit` step beyond the
model, optimizer state and data, per sample (batch 32 minus batch 1, over 31),
median over steps; memory outside TF's allocator is not counted. x lower:
larq-style's peak over this one's, same input estimator.
"""


def _run_line(data):
    return (
        f"Measured {data['started'][:10]} on a {data['cpu_count']}-core {data['machine']} "
        f"({', '.join(f for f in data['cpu_flags'] if f.startswith(('avx512f', 'amx')))}), "
        f"TF {data['tf_version']}, oneDNN {data['onednn']}, {data['rounds']} round(s)."
    )


# The configuration closest to what fast layers choose (recompute in the early
# stages), and its opt-in variant; a run without them shows every tapehook
# configuration it measured. The JSON keeps every row.
DEFAULT_CONFIGURATIONS = ("tapehook-recompute-early", "tapehook-recompute-early-bf16x2")


def _default_configurations(rows):
    tapehook_impls = {r["impl"] for r in rows if r["impl"].startswith("tapehook")}
    return (set(DEFAULT_CONFIGURATIONS) & tapehook_impls) or tapehook_impls


def models_speed_table(data):
    lines = [
        "| model | batch | impl | input estimator | train img/s | x larq 0.14 | x larq-style "
        "| x float-fused | predict img/s | predict x larq-style |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = sorted(
        data["rows"],
        key=lambda r: (r["model"], -r["batch"], r["estimator"] or "", r["impl"]),
    )
    shown = _default_configurations(rows)
    for r in rows:
        if r["impl"] not in shown:
            continue
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['impl']} | {r['estimator'] or '-'} "
            f"| {r['train_img_s_median']:.1f} | {_x(r.get('train_x_larq_median'))} "
            f"| {_x(r.get('train_x_larq-style_median'))} "
            f"| {_x(r.get('train_x_float-fused_median'))} "
            f"| {r['predict_img_s_median']:.1f} | {_x(r.get('predict_x_larq-style_median'))} |"
        )
    return lines


def models_memory_table(data):
    lines = [
        "| model | impl | input estimator | tensor peak MiB/sample | x lower than larq-style |",
        "|---|---|---|---|---|",
    ]
    shown = _default_configurations(data["rows"]) | {"larq-style", "float-fused"}
    for r in data["rows"]:
        peak = r.get("tensor_peak_bytes_per_sample")
        if peak is None or r["impl"] not in shown:
            continue
        lines.append(
            f"| {r['model']} | {r['impl']} | {r['estimator'] or '-'} | {peak / 2**20:.2f} "
            f"| {_x(r.get('tensor_peak_x_lower_than_larq_style'))} |"
        )
    return lines


def _against_fastest(row, what, impls):
    """row's median ratio against the fastest of ``impls`` (the smallest ratio)."""
    ratios = [row.get(f"{what}_x_{impl}_median") for impl in impls]
    ratios = [r for r in ratios if r is not None]
    return min(ratios) if ratios else None


# The default path's configurations, as the table names them.
DEFAULT_IMPLS = {
    "tapehook-default": "`binarize`",
    "tapehook-larq": "`tapehook.larq`",
    "tapehook-zoo": "`tapehook.zoo`",
}


def models_default_table(data):
    lines = [
        "| model | px | batch | written as | input estimator | train img/s | x larq 0.14 "
        "| x PyTorch | predict img/s | x larq 0.14 | x PyTorch | predict x float "
        "| tensor peak x lower |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = list(DEFAULT_IMPLS)
    rows = [r for r in data["rows"] if r["impl"] in DEFAULT_IMPLS]
    rows.sort(key=lambda r: (r["model"], -r["batch"], order.index(r["impl"])))
    for r in rows:
        peak = r.get("tensor_peak_x_lower_than_larq_style")  # on the batch-32 row
        lines.append(
            f"| {r['model']} | {r['size']} | {r['batch']} | {DEFAULT_IMPLS[r['impl']]} "
            f"| {r['estimator']} "
            f"| {r['train_img_s_median']:.1f} | {_x(r.get('train_x_larq_median'))} "
            f"| {_x(_against_fastest(r, 'train', TORCH_IMPLS))} "
            f"| {r['predict_img_s_median']:.1f} | {_x(r.get('predict_x_larq_median'))} "
            f"| {_x(_against_fastest(r, 'predict', TORCH_IMPLS))} "
            f"| {_x(r.get('predict_x_float-fused_median'))} | {_x(peak)} |"
        )
    return lines


def models_doc():
    out = [MODELS_INTRO, "## Speed", ""]
    for name, title, command in MODEL_RUNS:
        data = load(RESULTS / name)
        out += [f"### {title}", "", f"`bench/results/{name}`. {_run_line(data)} Rerun:", ""]
        out += ["```bash", command, "```", ""]
        out += models_speed_table(data)
        out.append("")
    for intro, runs, table in (
        (MODELS_DEFAULT, DEFAULT_RUNS, models_default_table),
        (MODELS_MEMORY, MEMORY_RUNS, models_memory_table),
    ):
        out.append(intro)
        for name, command in runs:
            data = load(RESULTS / name)
            out += [f"`bench/results/{name}`. {_run_line(data)} Rerun:", ""]
            out += ["```bash", command, "```", ""]
            out += table(data)
            out.append("")
    out += [
        "Where a step's time goes, op by op: `python bench/step_ops.py --inter-op-1` "
        "(a 224 px Bi-Real-Net-18 step under the TF profiler).",
    ]
    return "\n".join(out).rstrip("\n") + "\n"


def readme_with_headline(text, line):
    start, end = text.find(HEADLINE_START), text.find(HEADLINE_END)
    if start < 0 or end < start:
        raise SystemExit(f"README.md lacks the lines {HEADLINE_START!r} ... {HEADLINE_END!r}")
    return text[: start + len(HEADLINE_START)] + "\n" + line + "\n" + text[end:]


def outputs():
    """{path: text} that --write writes."""
    data, memory = load(RESULTS / "latest.json"), load(RESULTS / "memory.json")
    baseline_path = RESULTS / "baseline.json"
    baseline = load(baseline_path) if baseline_path.exists() else None
    return {
        DOC: performance_doc(data, memory, baseline),
        MODELS_DOC: models_doc(),
        README: readme_with_headline(README.read_text(), headline(data, memory)),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="?", default=RESULTS / "latest.json")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help="write the docs")
    group.add_argument("--check", action="store_true", help="check the docs are current")
    args = parser.parse_args(argv)
    if not (args.write or args.check):
        data = load(args.results)
        print(machine_line(data) + "\n")
        print("\n".join(speed_table(data)))
        return 0
    stale = []
    for path, text in outputs().items():
        if path.exists() and path.read_text() == text:
            continue
        if args.write:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
        else:
            stale.append(str(path.relative_to(ROOT)))
    if stale:
        print(
            f"{', '.join(stale)}: not what bench/results says; run python bench/table.py --write",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
