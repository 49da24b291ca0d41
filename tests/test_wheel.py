"""The package as users install it: `python -m build` makes an sdist and a
wheel (from that sdist, so the sdist carries everything), and the wheel,
installed into a fresh venv outside the checkout, imports, binarizes, trains
a step on its compiled kernels and exports."""

import pathlib
import subprocess
import sys
import sysconfig
import textwrap

import pytest

import tapehook

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent

SMOKE = textwrap.dedent(
    """
    import pathlib, sys
    import keras, numpy as np
    import tapehook
    assert str(pathlib.Path(tapehook.__file__)).startswith(sys.prefix), tapehook.__file__
    assert tapehook.__version__ == sys.argv[1]
    inputs = keras.Input((8, 8, 2))
    h = keras.layers.Conv2D(8, 3, padding="same", name="stem")(inputs)
    h = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="binary")(h)
    h = keras.layers.BatchNormalization()(h)
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inputs, outputs)
    tapehook.binarize(model, include="binary", activations=True)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 8, 8, 2)).astype("float32"), rng.integers(0, 3, 16)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert tapehook.dispatch_counts()["compiled"]["backprop_filter"] == 2
    path = pathlib.Path(sys.argv[2]) / "m.tflite"
    tapehook.export_tflite(model, str(path), target="litert")
    out = tapehook.deploy.run_tflite(str(path), x[:2], target="litert")
    np.testing.assert_allclose(out, model.predict(x[:2], verbose=0), rtol=1e-4, atol=1e-4)
    print("SMOKE OK")
    """
)


def _run(args, **kwargs):
    result = subprocess.run(args, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)])
    (wheel,) = dist.glob(f"tapehook-{tapehook.__version__}-*.whl")
    (sdist,) = dist.glob(f"tapehook-{tapehook.__version__}.tar.gz")
    assert sdist.stat().st_size > 0
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)])
    # TensorFlow and the other dependencies come from the test environment (a
    # path after the venv's own site-packages, whose .pth files are not run, so
    # the checkout's editable install stays out); tapehook from the wheel.
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    pathlib.Path(site.stdout.strip(), "test_env.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n"
    )
    result = _run(
        [str(python), "-c", SMOKE, tapehook.__version__, str(tmp_path)],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "HOME": str(pathlib.Path.home())},
    )
    assert "SMOKE OK" in result.stdout
