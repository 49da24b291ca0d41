"""Per-op time of a few training (or predict) steps of one bench/models.py
configuration, op by op (not summed by type as ``models.py --profile-only``):
which instance of an op type is slow, e.g. the last stage's backprops.

    python bench/step_ops.py --size 224 --impl tapehook-recompute-early --estimator ste_sign
    python bench/step_ops.py ... --inter-op-1            # each op's own time, no overlap
    python bench/step_ops.py ... --min-image-pixels 50   # dispatch.AMX_MIN_IMAGE_PIXELS

Prints self time (models.op_self_times) in ms per step for the slowest ops,
then per op type. Times under the TF profiler; run it on a quiet machine and
compare runs alternated."""

import argparse
import collections
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="birealnet18")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--impl", default="tapehook-recompute-early")
    parser.add_argument("--estimator", default="ste_sign")
    parser.add_argument("--mode", choices=["train", "predict"], default="train")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--inter-op-1", action="store_true")
    parser.add_argument("--min-image-pixels", type=int)
    args = parser.parse_args()

    import keras
    import models
    import tensorflow as tf

    import tapehook.dispatch

    if args.inter_op_1:
        tf.config.threading.set_inter_op_parallelism_threads(1)
    if args.min_image_pixels is not None:
        tapehook.dispatch.AMX_MIN_IMAGE_PIXELS = args.min_image_pixels
    cfg = dict(
        model=args.model,
        impl=args.impl,
        estimator=args.estimator,
        size=args.size,
        batch=args.batch,
    )
    net, x, y = models.compiled_model(keras, cfg)

    def run():
        if args.mode == "train":
            data = tf.data.Dataset.from_tensors((x, y)).repeat()
            net.fit(data, steps_per_epoch=args.steps, epochs=1, verbose=0)
        else:
            data = tf.data.Dataset.from_tensors(x).repeat().take(args.steps)
            net.predict(data, verbose=0)

    run()  # trace and warm up
    logdir = tempfile.mkdtemp()
    tf.profiler.experimental.start(logdir)
    run()
    tf.profiler.experimental.stop()

    per_op, calls = models.op_self_times(logdir)
    ms = 1e-9 / args.steps
    for (kind, name), ps in per_op.most_common(args.top):
        print(f"{ps * ms:8.2f} ms/step {calls[(kind, name)]:3d}  {kind:45s} {name}")
    by_kind = collections.Counter()
    for (kind, _), ps in per_op.items():
        by_kind[kind] += ps
    print(f"TOTAL {sum(by_kind.values()) * ms:.1f} ms/step")
    for kind, ps in by_kind.most_common():
        print(f"{ps * ms:8.2f} ms/step {kind}")


if __name__ == "__main__":
    main()
