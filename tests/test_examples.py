"""Every example runs, with tiny settings, and really trains binary."""

import importlib.util
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
