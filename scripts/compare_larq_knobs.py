"""tapehook's recipe knobs against larq 0.14 itself, on identical inputs.

For each knob (one-padding, swish_sign's beta, separate input / kernel
clips, no clip, float kernels with a binary input), one QuantConv2D in larq
(tf-keras, in a side environment) and the same conv marked with tapehook's
spec compute y, dX and dW of sum(y * g); the script prints the largest
differences. larq must be importable by LARQ_PYTHON (default
/tmp/larqenv/bin/python: python3 -m venv /tmp/larqenv && /tmp/larqenv/bin/pip
install tensorflow-cpu==2.21.0 tf-keras==2.21.0 larq==0.14.0).

    python scripts/compare_larq_knobs.py
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

# name: (larq QuantConv2D keywords as Python source, tapehook spec keywords)
KNOBS = {
    "pad_values=1": (
        "dict(input_quantizer='ste_sign', kernel_quantizer='ste_sign', pad_values=1.0)",
        dict(activations=True, pad_value=1.0),
    ),
    "pad_values=1 weight-only": (
        "dict(kernel_quantizer='ste_sign', pad_values=1.0)",
        dict(pad_value=1.0),
    ),
    "swish beta=2": (
        "dict(input_quantizer=lq.quantizers.SwishSign(beta=2.0),"
        " kernel_quantizer=lq.quantizers.SwishSign(beta=2.0))",
        dict(activations=True, ste="swish_sign", beta=2.0),
    ),
    "clips 0.5 / 1.5": (
        "dict(input_quantizer=lq.quantizers.SteSign(clip_value=0.5),"
        " kernel_quantizer=lq.quantizers.SteSign(clip_value=1.5))",
        dict(activations=True, clip=1.5, activation_clip=0.5),
    ),
    "no clip": (
        "dict(input_quantizer=lq.quantizers.SteSign(clip_value=None),"
        " kernel_quantizer=lq.quantizers.SteSign(clip_value=None))",
        dict(activations=True, clip=None),
    ),
    "float kernel (BAN)": (
        "dict(input_quantizer='ste_sign', kernel_quantizer=None)",
        dict(activations=True, weights=False),
    ),
}

_LARQ = r"""
import json, sys
import numpy as np, tensorflow as tf, larq as lq
data = np.load(sys.argv[1])
out = {}
for name, source in json.loads(sys.argv[2]).items():
    layer = lq.layers.QuantConv2D(data["w"].shape[-1], 3, padding="same", use_bias=False,
                                  **eval(source))
    x = tf.constant(data["x"])
    layer.build(x.shape)
    layer.kernel.assign(data["w"])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
        loss = tf.reduce_sum(y * data["g"])
    dx, dw = tape.gradient(loss, [x, layer.kernel])
    out[name] = [y.numpy().tolist(), dx.numpy().tolist(), dw.numpy().tolist()]
json.dump(out, open(sys.argv[3], "w"))
"""


def main():
    larq_python = os.environ.get("LARQ_PYTHON", "/tmp/larqenv/bin/python")
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(2, 7, 6, 5)) * 1.2).astype(np.float32)
    x[rng.random(x.shape) < 0.05] = 0.0
    w = (rng.normal(size=(3, 3, 5, 4)) * 0.8).astype(np.float32)
    g = rng.normal(size=(2, 7, 6, 4)).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        data, result = pathlib.Path(tmp, "data.npz"), pathlib.Path(tmp, "larq.json")
        np.savez(data, x=x, w=w, g=g)
        env = dict(os.environ, TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="3")
        sources = {name: source for name, (source, _) in KNOBS.items()}
        subprocess.run(
            [larq_python, "-c", _LARQ, str(data), json.dumps(sources), str(result)],
            env=env,
            check=True,
        )
        larq = json.loads(result.read_text())

    import tensorflow as tf

    import tapehook

    worst = 0.0
    for name, (_, spec) in KNOBS.items():
        var = tapehook.mark_binary(tf.Variable(w), **spec)
        xt = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = tf.nn.conv2d(xt, var, 1, "SAME")
            loss = tf.reduce_sum(y * g)
        dx, dw = tape.gradient(loss, [xt, var])
        diffs = [
            float(np.max(np.abs(np.asarray(ours) - np.asarray(theirs))))
            for ours, theirs in zip((y, dx, dw), larq[name])
        ]
        worst = max(worst, *diffs)
        print(f"{name:26} max |diff|  y {diffs[0]:.2e}  dX {diffs[1]:.2e}  dW {diffs[2]:.2e}")
    sys.exit(0 if worst < 1e-4 else 1)


if __name__ == "__main__":
    main()
