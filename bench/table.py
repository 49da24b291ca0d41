"""Turns bench results into docs: every measured number in docs/performance.md and the
README's speed headline comes from bench/results/*.json through this file.

    python bench/table.py [results.json]   # print the speed table (markdown)
    python bench/table.py --write          # write docs/performance.md and the README headline
    python bench/table.py --check          # fail if either differs from what --write writes

Inputs: bench/results/latest.json (bench/run.py), bench/results/memory.json
(bench/memory.py) and, when present, bench/results/baseline.json: a bench/run.py
run from before the change being measured, shown next to latest.json. The prose
below is fixed text on purpose: it says why, and leaves the how much to the data.
"""

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "performance.md"
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
    )


DOC_INTRO = """\
# Performance

<!-- Generated by `python bench/table.py --write` from bench/results/*.json; do not edit.
     `make lint` fails when this file is not what the results say. -->

Every number on this page comes from `bench/results/` through `bench/table.py`.
To refresh it: `python bench/run.py` (options in
[bench/README.md](../bench/README.md)), `python bench/memory.py`, then
`python bench/table.py --write`, which also rewrites the headline in the README.

## Speed

`bench/run.py` times tapehook against stock TensorFlow in the same process,
rep by rep, with oneDNN off and on. Stock is `tf.nn.conv2d` on ±1 floats for the
forwards, the larq-style step (`tf.custom_gradient` STE + stock convs) for the
steps, and stock `Conv2D` / `Conv2DBackpropInput` / `Conv2DBackpropFilter` for
the kernel rows. Shapes: batch 16 (b1: batch 1), NHWC, SAME, stride 1,
`scale="mean_abs"`.
"""

DOC_NOISE = """\
The benchmark machine is shared and noisy: min and median can differ widely on
the same row. Compare ratios within one run, and rerun before trusting a single
cell.

![median speedups](../bench/results/latest.png)
"""

DOC_WHY = """\
### Where the speed comes from

- **Fully binary forward**: bitpacked xor + popcount, with an AVX-512 VPOPCNTDQ
  tier chosen at run time and AVX2 and portable fallbacks. A 1x1 conv of up to
  512 channels and a 3x3 conv of up to 64 keep the channel tile's weights in
  registers while the pixels stream past; other convs use a 6-pixel x
  32-channel register tile. "Fully binary forward" calls one conv per
  `tf.function` call; "per conv of a graph" runs many in a `tf.while_loop`, as a
  model's forward runs its layers. The gap between the two rows is the
  Python-to-TF call, paid by both sides, and the cache misses of a call that
  follows stock's conv; it weighs most on small convs (the 1x1 layer, batch 1).
- **Inference keeps the packed filter**: a forward no tape records (Keras
  `predict` / `evaluate`, a forward-only `tf.function`) reuses the packed signs
  of W while the variable's buffer is unchanged, which TF's copy-on-write makes
  exact ([design.md](design.md), "Kernels and the build"). Each binary conv in
  a live inference function holds one reference to its filter buffer; writes
  that bypass TF (in place through DLPack or a NumPy view) are not seen.
- **Float-operand convolutions** (weight-only forward, both backprops) on Intel
  AMX: one operand is exactly ±1 (or 0), which bf16 holds exactly, and the float
  operand is split into three bf16 parts whose sum is exactly the float, so
  every product is exact and sums accumulate in fp32: fp32 results at bf16 tile
  speed (`cc_kernels/core/amx_conv.h`; `tests/cc/test_amx_conv.cc` checks the
  exactness bitwise). The row stores are AVX-512 with the STE mask fused in.
- **Backprops on AVX-512 without AMX** (dX, and dW of a binary input): for
  four floats g0..g3 the 16 signed sums ±g0 ±g1 ±g2 ±g3 fill one zmm register,
  and a vpermps indexed by four sign bits per lane (of W for dX, of x for dW)
  does 64 multiply-adds where an FMA does 16
  (`cc_kernels/core/lut_backprop.h`; the prototype's measurements:
  `bench/lut_backprop/REPORT.md`; at whole-model shapes: `bench/backprops.py`).
- **dW of a binary input on AVX2**: the same 16 signed sums, of 4 images' dy
  at one output pixel, stored as 16 vectors of 8 output channels; each input
  channel's 4 signs of x pick one, and a vaddps with its folded load does 32
  multiply-adds (`cc_kernels/core/lut_backprop_avx2.h`; against Eigen's
  backprop-filter at the models' shapes: `bench/backprops.py --plans avx2`).
- **Packed backward**: the backward of a binary-activation conv reads the 2-bit
  packed input directly; no float x is rebuilt.
- **The dispatcher** sends what tapehook does not win to stock ops. The rules,
  with the measurements behind them, live in `tapehook/dispatch.py`
  ([design.md](design.md), "Which implementation runs").
  `TAPEHOOK_DISPATCH=auto` (default) follows them, `kernels` always runs
  tapehook's kernels (what the tests check against the reference), `stock` never
  does. `TAPEHOOK_NO_AMX=1`, `TAPEHOOK_NO_AVX512=1` and `TAPEHOOK_NO_AVX2=1` step
  down the CPU tiers.
"""

DOC_MEMORY = """\
## Training memory

With binary activations (`ste_sign` on the input, the default), a binary conv
keeps 2 bits per input element for its backward (sign and STE mask, packed)
instead of float copies, and its float input is freed as soon as your code drops
it (`tests/test_memory.py` checks this with a weak reference). `python
bench/memory.py` runs each configuration in a fresh process: a stack of batch
norms and binary 3x3 convs, one training step.
"""

DOC_MEMORY_NOTES = """\
"Peak per sample" is the slope of the process's peak resident memory over two
batch sizes; the largest batch extrapolates it. `approx_sign` / `swish_sign`
inputs keep the float input (their pseudo-derivative needs its precision). TF's
allocator statistics read 0 on CPU, so resident memory is the measure here.
`python bench/leak_check.py` runs many eager training steps of a small binarized
Keras model and prints resident memory and the dispatch counters as it goes.
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
    out += ["", "Every row (median, min-based in parentheses):", ""]
    out += speed_table(data)
    out += ["", DOC_NOISE]
    overhead = {
        s: _speedups(data, "eager_step_overhead", s) for s in ("off", "on") if _block(data, s)
    }
    if any(overhead.values()):
        spans = ", ".join(f"{_span(v)} with oneDNN {s}" for s, v in overhead.items() if v)
        out += [
            "Interposer overhead: an eager batch-1 step through tapehook against a "
            "hand-written `tf.custom_gradient` step calling the same kernels runs at "
            f"{spans} (above 1: tapehook's step is the faster one).",
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
        "- Whole models (Bi-Real-Net-18, QuickNet-small; float, larq-style, tapehook, larq "
        "0.14; with Keras 3's or TF's fused batch norm and Adam): `bench/models.py`, "
        "[models_perf.md](models_perf.md); what their training steps keep for the "
        "backward: `bench/saved_tensors.py` (`bench/results/saved_tensors.json`).",
        "- tapehook.layers.BatchNormalization against Keras 3's, per layer: "
        "`bench/batch_norm.py` (`bench/results/batch_norm.json`).",
        "- Deployed files (LiteRT float, LiteRT binary, LCE): `bench/deploy.py`, "
        "[deploy.md](deploy.md).",
        "- What importing tapehook costs unmarked eager ops: `bench/overhead.py` "
        "(`bench/results/overhead.json`).",
        "- One-padding against zero padding: `bench/padding.py` (`bench/results/padding.json`).",
        "- Both backprops at Bi-Real-Net / QuickNet shapes, batch 32, against oneDNN: "
        "`bench/backprops.py` (`bench/results/backprops.json`).",
        "",
    ]
    if baseline is not None:
        out += [
            "## Before and after",
            "",
            "`bench/results/baseline.json` (before: the commit before the one-conv-plan "
            "work, 198798f) and `latest.json` (after), on the same machine; their "
            "dates are on the machine lines.",
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
