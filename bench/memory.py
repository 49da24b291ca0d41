"""Peak memory of a training step: tapehook (binary activations keep 2 bits per
input element) vs the larq-style composite (float +-1 via tf.custom_gradient,
stock convs), in eager and tf.function.

    python bench/memory.py            # ~3-5 min on 2 cores
    python bench/memory.py --quick

Each configuration runs in a fresh subprocess; it reports the process's peak
resident memory (ru_maxrss) growth over a step beyond what the model and data
already hold, and the bytes the binary convs keep for their backward
(computed from the shapes: float x and x_hat for larq-style, packed sign and
mask bits for tapehook). The largest batch for a 4 GiB step budget is
extrapolated from two batch sizes (peak growth is linear in the batch).
Results: bench/results/memory.json, and docs/performance.md (bench/table.py).
"""

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
BUDGET = 4 * 2**30
CHANNELS, LAYERS, SIZE = 128, 6, 32  # a fully binary stack of 3x3 convs


def child(impl, mode, batch):
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    os.environ.setdefault("TAPEHOOK_DISPATCH", "kernels")
    import resource

    import tensorflow as tf

    import tapehook

    rng = tf.random.Generator.from_seed(0)
    filters = [tf.Variable(rng.normal([3, 3, CHANNELS, CHANNELS]) * 0.1) for _ in range(LAYERS)]
    scales = [tf.Variable(tf.ones([CHANNELS])) for _ in range(LAYERS)]
    x0 = rng.normal([batch, SIZE, SIZE, CHANNELS])

    @tf.custom_gradient
    def ste_sign(t):
        def grad(dy):
            return dy * tf.cast(tf.abs(t) <= 1, dy.dtype)

        return tf.where(t >= 0, tf.ones_like(t), -tf.ones_like(t)), grad

    if impl == "tapehook":
        for w in filters:
            tapehook.mark_binary(w, activations=True)

    def layer(h, w, scale):
        h = tf.nn.batch_normalization(h, *tf.nn.moments(h, [0, 1, 2]), None, scale, 1e-3)
        if impl == "tapehook":
            return tf.nn.conv2d(h, w, 1, "SAME")
        return tf.nn.conv2d(ste_sign(h), ste_sign(w), 1, "SAME")

    def step():
        with tf.GradientTape() as tape:
            h = x0
            for w, s in zip(filters, scales):
                h = layer(h, w, s)
            loss = tf.reduce_mean(h**2)
        grads = tape.gradient(loss, filters + scales)
        return loss, grads

    run = tf.function(step) if mode == "function" else step
    run()  # warm-up: traces, kernel caches, TF's allocator pools
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for _ in range(2):
        loss, grads = run()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    elements = batch * SIZE * SIZE * CHANNELS * LAYERS
    kept = elements * (2 / 8 if impl == "tapehook" else 8)  # bits vs float x + x_hat
    print(
        json.dumps(
            {
                "impl": impl,
                "mode": mode,
                "batch": batch,
                "peak_bytes": peak,
                "step_growth_bytes": peak - before,
                "conv_input_bytes_kept": kept,
                "counts": tapehook.dispatch_counts()["compiled"],
            }
        )
    )


def measure(impl, mode, batch):
    out = subprocess.run(
        [sys.executable, __file__, "--child", impl, mode, str(batch)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", nargs=3)
    args = parser.parse_args()
    if args.child:
        impl, mode, batch = args.child
        return child(impl, mode, int(batch))
    batches = (4, 8) if args.quick else (8, 16)
    rows = []
    for mode in ("eager", "function"):
        for impl in ("larq-style", "tapehook"):
            small, large = (measure(impl, mode, b) for b in batches)
            per_sample = (large["peak_bytes"] - small["peak_bytes"]) / (batches[1] - batches[0])
            fixed = large["peak_bytes"] - per_sample * batches[1]
            rows.append(
                {
                    **large,
                    "peak_bytes_per_sample": per_sample,
                    "max_batch_in_4GiB": int((BUDGET - fixed) // per_sample)
                    if per_sample > 0
                    else None,
                }
            )
            r = rows[-1]
            print(
                f"{mode:8s} {impl:10s} batch {r['batch']:3d}: peak {r['peak_bytes'] / 2**20:7.0f} MiB,"
                f" {per_sample / 2**20:6.1f} MiB/sample, conv inputs kept "
                f"{r['conv_input_bytes_kept'] / 2**20:7.1f} MiB, max batch in 4 GiB "
                f"{r['max_batch_in_4GiB']}",
                flush=True,
            )
    import tensorflow as tf

    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "memory.json").write_text(
        json.dumps(
            {
                "machine": platform.processor() or platform.machine(),
                "tf_version": tf.__version__,
                "model": f"{LAYERS} x (batch-norm, binary 3x3 conv {CHANNELS}->{CHANNELS}) at "
                f"{SIZE}x{SIZE}",
                "budget_bytes": BUDGET,
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
