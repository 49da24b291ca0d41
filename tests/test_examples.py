"""Every example runs, with tiny settings, and really trains binary."""

import importlib.util
import json
import pathlib

import pytest

import tapehook

pytestmark = pytest.mark.slow

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _example(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_digits(tmp_path, capsys):
    binary, float_ = _example("train_digits").main(
        ["--epochs", "2", "--size", "8", "--verbose", "0", "--plot", str(tmp_path / "c.png")]
    )
    out = capsys.readouterr().out
    assert binary > 0.5 and float_ > 0.5
    assert (tmp_path / "c.png").stat().st_size > 1000
    assert "conv1" in out and "s/epoch" in out and "binary kernel runs" in out


def test_custom_loop():
    assert _example("custom_loop").main(["--steps", "60"]) > 0.5
    assert tapehook.dispatch_counts()["compiled"]["backprop_filter"] == 60


def test_binarize_resnet():
    layers, counts = _example("binarize_resnet").main(["--steps", "1", "--batch", "2"])
    assert layers == 52 and counts["backprop_filter"] == 52


def test_v1_graph():
    assert _example("v1_graph").main(["--steps", "60"]) > 0.5
    assert tapehook.dispatch_counts()["compiled"]["backprop_filter"] == 60


def test_distill_digits(tmp_path, capsys):
    """One seed, one epoch per stage: the table prints, and every binary conv
    of the fully binary stage ran its forward and gradients on the kernels."""
    module = _example("distill_digits")
    results, teacher, runs = module.main(
        "--seeds 1 --epochs 1 --teacher-epochs 3 --variants baseline,reactnet+balanced --json".split()
        + [str(tmp_path / "r.json")]
    )
    out = capsys.readouterr().out
    assert (
        "| reactnet+balanced | " in out and "| baseline | " in out and "| float teacher | " in out
    )
    assert teacher[0] > 0.5 and all(0.3 < a[0] <= 1 for a in results.values())
    steps = -(-len(module.load_data(8)[0]) // module.BATCH)
    for name, epochs in (("baseline", 2), ("reactnet+balanced", 1)):
        # 4 binary convs, each with both gradients per step, none on plain TF ops.
        compiled = runs[name]["compiled"]
        assert compiled["backprop_filter"] == compiled["backprop_input"] == 4 * steps * epochs
        assert compiled["forward"] >= 4 * steps * epochs
        assert runs[name]["reference"] == dict.fromkeys(runs[name]["reference"], 0)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["variants"]["reactnet+balanced"]["test_accuracy"] == results["reactnet+balanced"]
