"""Without a compiler the import still works: one warning, the reference path,
and kernel_info() says why. Run in a fresh process with an empty cache."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = r"""
import json, warnings
import tensorflow as tf
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import tapehook
    from tapehook import reference
    x = tf.random.normal([2, 5, 5, 3], seed=1)
    w = tapehook.mark_binary(tf.Variable(tf.random.normal([3, 3, 3, 4], seed=2)),
                             activations=True)
    results = []
    for _ in range(2):
        with tf.GradientTape() as tape:
            y = tf.nn.conv2d(x, w, 1, "SAME")
            loss = tf.reduce_sum(y ** 2)
        results.append(tape.gradient(loss, w))
wt = tf.convert_to_tensor(w)
with tf.GradientTape() as tape:
    tape.watch(wt)
    ry = reference.binary_conv2d(x, wt, tapehook.binary_spec_of(w))
    rloss = tf.reduce_sum(ry ** 2)
err = float(tf.reduce_max(tf.abs(tape.gradient(rloss, wt) - results[1])))
print(json.dumps({
    "warnings": [str(c.message) for c in caught if c.category is RuntimeWarning
                 and "tapehook" in str(c.message)],
    "info": tapehook.kernel_info()["cpu"],
    "counts": tapehook.dispatch_counts(),
    "forward_err": float(tf.reduce_max(tf.abs(y - ry))),
    "grad_err": err,
}))
"""


def _run(tmp_path, **env):
    """SCRIPT in a fresh process with an empty kernel cache and ``env``."""
    full_env = {
        **os.environ,
        "TAPEHOOK_CACHE_DIR": str(tmp_path / "cache"),
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    full_env.pop("TAPEHOOK_KERNELS", None)
    return subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={**full_env, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_no_compiler_falls_back_to_reference_with_one_warning(tmp_path):
    run = _run(tmp_path, CXX="/nonexistent/g++")
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(result["warnings"]) == 1, result["warnings"]
    assert "no C++ compiler" in result["warnings"][0]
    assert result["info"]["loaded"] is False
    assert "no C++ compiler" in result["info"]["reason"]
    assert result["counts"]["compiled"]["forward"] == 0
    assert result["counts"]["reference"]["forward"] == 2
    assert result["forward_err"] < 1e-5 and result["grad_err"] < 1e-3


def test_compiled_mode_makes_a_missing_compiler_an_error(tmp_path):
    run = _run(tmp_path, CXX="/nonexistent/g++", TAPEHOOK_KERNELS="compiled")
    assert run.returncode != 0
    assert "the kernels setting is 'compiled'" in run.stderr
    assert "could not be built or loaded" in run.stderr and "no C++ compiler" in run.stderr
