"""tf.distribute: MirroredStrategy over 2 logical CPUs (fit and a custom loop
with strategy.run) and MultiWorkerMirroredStrategy with 2 local worker
processes give the same weights as single-device training on the same global
batch. Each run is a fresh process (logical devices must be set before TF runs)."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(os.path.dirname(__file__), "helpers", "distributed_training.py")


def _env(**extra):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **extra}
    env.pop("TF_CONFIG", None)
    env.update(extra)
    return env


def _train(mode, tmp_path, **env):
    out = tmp_path / f"{mode}.npz"
    run = subprocess.run(
        [sys.executable, SCRIPT, mode, str(out)],
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return np.load(out)


def _weights(result):
    return [
        result[k]
        for k in sorted((k for k in result.files if k.startswith("arr_")), key=lambda k: int(k[4:]))
    ]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _train("single", tmp_path_factory.mktemp("single"))


def _assert_same_training(result, single):
    assert list(result["marked"]) == [True, True]
    for a, b in zip(_weights(result), _weights(single)):
        # Replicas sum gradients in another order: float rounding, relative
        # to each weight tensor's scale.
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * (1 + np.abs(b).max()))
    assert result["counts"][2] > 0  # the compiled backprop-filter kernel ran


@pytest.mark.parametrize("mode", ["mirrored_fit", "mirrored_loop"])
def test_mirrored_strategy_matches_single_device(mode, single, tmp_path):
    result = _train(mode, tmp_path)
    assert list(result["components"]) == [2, 2]  # one mark per replica component
    _assert_same_training(result, single)


def _free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def test_multi_worker_mirrored_matches_single_process(single, tmp_path):
    workers = [f"127.0.0.1:{p}" for p in _free_ports(2)]
    procs = []
    for index in range(2):
        config = json.dumps(
            {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        )
        out = tmp_path / f"worker{index}.npz"
        procs.append(
            (
                out,
                subprocess.Popen(
                    [sys.executable, SCRIPT, "multiworker", str(out)],
                    env=_env(TF_CONFIG=config),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
            )
        )
    try:
        for out, proc in procs:
            _, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err[-4000:]
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for out, _ in procs:
        _assert_same_training(np.load(out), single)
