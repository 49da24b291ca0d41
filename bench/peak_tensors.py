"""Which tensors are alive at a training step's memory peak, from the
allocator's own events.

    python bench/peak_tensors.py                 # tapehook-recompute and larq-style, 112 px
    python bench/peak_tensors.py --markdown      # the tables from bench/results/peak_tensors.json

bench/models.py's tensor peak says how high a step's memory goes and
bench/saved_tensors.py what the backward keeps; this says when the peak is
and what makes it. Each configuration runs in its own process on TF's BFC
allocator (``TF_CPU_ALLOCATOR_USE_BFC=true``, as the tensor-peak runs), fits
two steps, then ``--steps`` single steps each under the TF profiler, whose
trace has an event per allocation and deallocation (op, shape, requested
bytes, the allocator's chunk bytes). Replaying a step's events in time
order gives two peaks, both past what was allocated when the step began
(the median step of each kind is reported: the executor's op order, so the
peak, changes from step to step):

- **requested**: the largest sum of live tensors' requested bytes, what the
  step's tensors need; and the tensors alive at that moment, by the op that
  made them and its layer kind (bench/models.py);
- **chunks**: the largest sum of the allocator's chunks (what
  ``get_memory_info``'s peak counts, so bench/models.py's tensor peak): BFC
  hands out a free chunk up to twice the request without splitting it, so
  this moves with the order allocations happen in.

Per sample: batch b minus batch 1, over b - 1.
"""

import argparse
import collections
import json
import os
import pathlib
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import models  # noqa: E402 (bench/models.py: the architectures and implementations)

RESULTS = HERE / "results" / "peak_tensors.json"


def allocation_events(logdir):
    """[(time_ps, +1 / -1, requested_bytes, chunk_bytes, address, op, shape)] of
    the CPU allocator's events in a profile, in time order."""
    events = []
    for plane in models.load_xspace(logdir).planes:
        names = {k: m.name for k, m in plane.event_metadata.items()}
        stat_names = {k: m.name for k, m in plane.stat_metadata.items()}
        for line in plane.lines:
            for e in line.events:
                kind = names.get(e.metadata_id, "")
                if kind not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                stats = {}
                for s in e.stats:
                    value = s.WhichOneof("value")
                    v = getattr(s, value) if value else None
                    if value == "ref_value":
                        v = stat_names.get(v, "")
                    stats[stat_names.get(s.metadata_id, "")] = v
                events.append(
                    (
                        line.timestamp_ns * 1000 + e.offset_ps,
                        1 if kind == "MemoryAllocation" else -1,
                        int(stats.get("requested_bytes", 0)),
                        int(stats.get("allocation_bytes", 0)),
                        int(stats.get("addr", 0)),
                        stats.get("tf_op", ""),
                        stats.get("shape", ""),
                    )
                )
    return sorted(events)


def replay(events):
    """(requested peak, chunk peak, live tensors at the requested peak): bytes
    past the start; a deallocation of a tensor allocated before the step is
    counted from its own event (requested bytes = chunk bytes then)."""
    live, requested, chunks = {}, 0, 0
    peak_requested, peak_chunks, at_peak = 0, 0, []
    for _, sign, req, chunk, addr, op, shape in events:
        if sign > 0:
            live[addr] = (req, chunk, op, shape)
            requested, chunks = requested + req, chunks + chunk
        else:
            req0, chunk0, _, _ = live.pop(addr, (chunk, chunk, "", ""))
            requested, chunks = requested - req0, chunks - chunk0
        peak_chunks = max(peak_chunks, chunks)
        if requested > peak_requested:
            peak_requested, at_peak = requested, list(live.values())
    return peak_requested, peak_chunks, at_peak


def child(cfg):
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import keras as K
    import tensorflow as tf

    net, x, y = models.compiled_model(K, cfg)
    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    net.fit(data, steps_per_epoch=2, epochs=1, verbose=0)
    steps = []
    for step in range(cfg["steps"]):
        logdir = os.path.join(cfg["logdir"], str(step))
        tf.profiler.experimental.start(logdir)
        net.fit(data, steps_per_epoch=1, epochs=1, verbose=0)
        tf.profiler.experimental.stop()
        steps.append(replay(allocation_events(logdir)))
    # the step whose requested peak is the median one (the executor's op
    # order, so the peak, changes from step to step)
    requested, chunks, at_peak = sorted(steps, key=lambda s: s[0])[len(steps) // 2]
    tensors = collections.Counter()
    for req, _, op, shape in at_peak:
        tensors[(op, shape)] += req
    print(
        json.dumps(
            {
                **cfg,
                "requested_peak_bytes": requested,
                "chunk_peak_bytes": statistics.median(s[1] for s in steps),
                "step_requested_peaks": [s[0] for s in steps],
                "step_chunk_peaks": [s[1] for s in steps],
                "at_peak": [
                    {
                        "op": op,
                        "shape": shape,
                        "layers": models._layer_kind(op),
                        "bytes": b,
                    }
                    for (op, shape), b in tensors.most_common(15)
                ],
            }
        )
    )


def run(cfg):
    import tempfile

    with tempfile.TemporaryDirectory() as logdir:
        out = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps({**cfg, "logdir": logdir})],
            capture_output=True,
            text=True,
        )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{cfg}: {out.stderr[-2000:]}")
    return json.loads(lines[-1])


def per_sample(runs):
    """Rows of (model, impl, estimator): both peaks per sample and the
    tensors alive at the largest batch's requested peak."""
    by = collections.defaultdict(dict)
    for r in runs:
        by[(r["model"], r["impl"], r["estimator"])][r["batch"]] = r
    rows = []
    for (model, impl, estimator), batches in by.items():
        big = max(batches)
        one, top = batches[1], batches[big]
        rows.append(
            {
                "model": model,
                "impl": impl,
                "estimator": estimator,
                "batch": big,
                **{
                    f"{k}_per_sample": (top[f"{k}_bytes"] - one[f"{k}_bytes"]) / (big - 1)
                    for k in ("requested_peak", "chunk_peak")
                },
                "at_peak": top["at_peak"],
            }
        )
    for row in rows:
        ref = next(
            (
                r
                for r in rows
                if r["impl"] == "larq-style"
                and (r["model"], r["estimator"]) == (row["model"], row["estimator"])
            ),
            None,
        )
        if ref and row is not ref:
            for k in ("requested_peak", "chunk_peak"):
                row[f"{k}_x_lower_than_larq_style"] = (
                    ref[f"{k}_per_sample"] / row[f"{k}_per_sample"]
                )
    return rows


def markdown(result):
    mib = 2**20
    lines = [
        "| model | impl | input estimator | requested peak MiB/sample (x lower than "
        "larq-style) | chunk peak MiB/sample (x lower) | largest tensors alive at the "
        "requested peak, batch 32 (MiB: op, shape) |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:

        def ratio(k):
            v = r.get(f"{k}_x_lower_than_larq_style")
            return f" ({v:.2f}x)" if v else ""

        alive = "; ".join(
            f"{t['bytes'] / mib:.1f}: {t['op'].split('/', 1)[-1]} {t['shape']}"
            for t in r["at_peak"][:4]
        )
        lines.append(
            f"| {r['model']} | {r['impl']} | {r['estimator'] or '-'} "
            f"| {r['requested_peak_per_sample'] / mib:.2f}{ratio('requested_peak')} "
            f"| {r['chunk_peak_per_sample'] / mib:.2f}{ratio('chunk_peak')} | {alive} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child")
    parser.add_argument("--models", default="birealnet18,quicknet_small")
    parser.add_argument("--impls", default="larq-style,tapehook-recompute")
    parser.add_argument("--estimators", default="ste_sign,approx_sign")
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="profiled fit steps per run")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    if args.markdown:
        return print(markdown(json.loads(RESULTS.read_text())))
    runs = []
    for model in args.models.split(","):
        for impl in args.impls.split(","):
            estimators = [None] if impl in models.FLOAT_IMPLS else args.estimators.split(",")
            for estimator in estimators:
                for batch in (1, args.batch):
                    cfg = dict(
                        model=model,
                        impl=impl,
                        estimator=estimator,
                        size=args.size,
                        batch=batch,
                        steps=args.steps,
                    )
                    runs.append(run(cfg))
                    print(
                        f"{model} {impl} {estimator or '-'} b{batch}: requested "
                        f"{runs[-1]['requested_peak_bytes'] / 2**20:.1f} MiB, chunks "
                        f"{runs[-1]['chunk_peak_bytes'] / 2**20:.1f} MiB",
                        flush=True,
                    )
    result = {"size": args.size, "rows": per_sample(runs), "runs": runs}
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
