"""One optimizer step over a whole model's variables: tapehook.optimizers.Adam
with its Adam-and-clip kernel against the same Adam with the update and the
WeightClip constraint run apart (ResourceApplyAdam, then Keras's constraint:
what tapehook's Adam ran before the kernel) and Keras 3's Adam, on
Bi-Real-Net-18's and QuickNet-small's variables (bench/models.py's tapehook
models: every binary conv's latent kernel has a WeightClip; stem, shortcuts,
batch norms and head have none).

Each is a tf.function of ``optimizer.apply(grads, variables)`` with fixed
random gradients, timed as the best of ``--calls`` calls, alternating,
``--repeats`` times (bench/backprops.py's timing). The weights differ between
the three only by rounding (tests/test_fused_adam.py); each optimizer updates
its own copy.

    python bench/adam_clip.py      # writes bench/results/adam_clip.json
"""

import argparse
import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="birealnet18,quicknet_small")
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--out", default=str(HERE / "results" / "adam_clip.json"))
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import tensorflow as tf

    import tapehook

    sys.path.insert(0, str(HERE))
    import models
    from backprops import time_alternating, write_alternating_result

    class SeparateAdam(tapehook.optimizers.Adam):
        """The update and the constraint apart (the kernel not taken)."""

        def _fused_variables(self, grads, variables):
            return []

    def stepper(opt, grads, variables):
        return lambda: opt.apply(grads, variables)

    rows = []
    for model in args.models.split(","):
        keras.utils.set_random_seed(0)
        fns, counts = {}, {}
        for name, cls in (
            ("fused", tapehook.optimizers.Adam),
            ("separate", SeparateAdam),
            ("keras", keras.optimizers.Adam),
        ):
            net = models.build(keras, model, "tapehook-fused", "ste_sign", args.size)
            variables = net.trainable_variables
            grads = [
                tf.random.stateless_normal(v.shape, seed=[i, 1]) for i, v in enumerate(variables)
            ]
            opt = cls(1e-3)
            opt.build(variables)
            fns[name] = tf.function(stepper(opt, grads, variables))
            counts = {
                "variables": len(variables),
                "clipped": sum(v.constraint is not None for v in variables),
                "parameters": int(sum(v.numpy().size for v in variables)),
                "clipped_parameters": int(
                    sum(v.numpy().size for v in variables if v.constraint is not None)
                ),
            }
        for fn in fns.values():
            fn()
        t = time_alternating(fns, args.repeats, args.calls)
        row = dict(model=model, size=args.size, ms=t, **counts)
        for other in ("separate", "keras"):
            row[f"{other}_x"] = {s: t[other][s] / t["fused"][s] for s in ("min", "median")}
        rows.append(row)
        print(
            f"{model}: {counts['clipped_parameters'] / 1e6:.1f}M of {counts['parameters'] / 1e6:.1f}M "
            f"parameters clipped; ms median fused {t['fused']['median']:.2f}, separate "
            f"{t['separate']['median']:.2f} ({row['separate_x']['min']:.2f}/{row['separate_x']['median']:.2f}x), "
            f"keras {t['keras']['median']:.2f} ({row['keras_x']['min']:.2f}/{row['keras_x']['median']:.2f}x)",
            flush=True,
        )
    write_alternating_result(args.out, rows, args.repeats, args.calls)


if __name__ == "__main__":
    main()
