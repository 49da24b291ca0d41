#!/usr/bin/env python3
"""TensorFlow compatibility matrix for tapehook: `python scripts/compat.py`.

For each (Python, TensorFlow) row it keeps a virtual environment in a cache dir
outside the repository (default /tmp/tapehook-compat, or $TAPEHOOK_COMPAT_DIR),
installs that TF (pip resolves Keras / numpy from the TF pin) plus pytest,
pytest-timeout and scikit-learn, then tapehook with `pip install -e SRC
--no-deps` and tapehook's own requirements, so pip never replaces the pinned
TF. It then checks that `import tapehook` works, builds the kernels with
`python -m tapehook.build` (TAPEHOOK_CACHE_DIR inside the venv dir) and runs
the core tests with TAPEHOOK_KERNELS=compiled.

SRC is a snapshot of the working tree (tapehook/, cc_kernels/, tests/,
setup.py, pytest.ini, README.md) taken at start, so every row tests the same
code even while the tree is being edited; --live installs the tree itself.

A venv whose TF install completed is reused (marker file .compat-installed),
so a rerun only reinstalls tapehook, rebuilds if the sources changed and runs
the tests. --fresh recreates them.

It also runs an in-place upgrade check: one venv with TF 2.19, build + smoke
test, then `pip install tensorflow-cpu==2.21.0` into the same venv and the
smoke test again, which must rebuild the kernels for 2.21 on first use.

Results: a table on stdout and docs/compat.md (date, machine, table, upgrade
check, first failure per row in a collapsed section). Each row's result is
also kept as <venv>/result.json; with --only, rows not rerun are shown from
their last result.

At most --jobs (default 2) rows install at once; builds and test runs (the
CPU-heavy stages) run one at a time so their timings are comparable.
"""

import argparse
import collections
import concurrent.futures
import dataclasses
import datetime
import hashlib
import json
import os
import pathlib
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_CACHE = pathlib.Path(os.environ.get("TAPEHOOK_COMPAT_DIR", "/tmp/tapehook-compat"))
PYENV_VERSIONS = pathlib.Path(os.environ.get("PYENV_ROOT", "/root/.pyenv")) / "versions"
STABLE = ("2.16", "2.17", "2.18", "2.19", "2.20", "2.21")
NIGHTLY = "tf-nightly-cpu"
TEST_FILES = (
    "tests/test_modes.py",
    "tests/test_kernels.py",
    "tests/test_api.py",
    "tests/test_reference.py",
    "tests/test_keras.py",
)
SNAPSHOT_ITEMS = ("tapehook", "cc_kernels", "tests", "setup.py", "pytest.ini", "README.md")
TEST_EXTRAS = ("pytest", "pytest-timeout", "scikit-learn")
UPGRADE_FROM, UPGRADE_TO = "2.19", "2.21.0"

_print_lock = threading.Lock()
_cpu_lock = threading.Lock()  # builds and test runs, one at a time
_editable_lock = threading.Lock()  # `pip install -e` writes into SRC
_started = time.monotonic()


def log(msg):
    with _print_lock:
        print(f"[{time.monotonic() - _started:7.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------- helpers


def find_python(version):
    """The interpreter for "3.11": pyenv's newest 3.11.x, else python3.11 on PATH."""
    if PYENV_VERSIONS.is_dir():
        found = sorted(
            (
                p
                for p in PYENV_VERSIONS.glob(f"{version}.*")
                if re.fullmatch(rf"{re.escape(version)}\.\d+", p.name)
            ),
            key=lambda p: int(p.name.rsplit(".", 1)[1]),
        )
        if found and (found[-1] / "bin" / "python").exists():
            return str(found[-1] / "bin" / "python")
    return shutil.which(f"python{version}")


def clean_env(venv=None, **extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "TAPEHOOK_KERNELS", "TAPEHOOK_CACHE_DIR")
    }
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["TF_CPP_MIN_LOG_LEVEL"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if venv is not None:
        env["VIRTUAL_ENV"] = str(venv)
        env["PATH"] = f"{venv}/bin:{env.get('PATH', '')}"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(cmd, logfile, env, cwd=None, timeout=None):
    """Runs cmd, tees its output into logfile; returns (rc, output, seconds).

    rc is None when it ran past the timeout (the process group is killed).
    """
    start = time.monotonic()
    logfile.parent.mkdir(parents=True, exist_ok=True)
    with open(logfile, "w") as out:
        out.write(f"$ {' '.join(map(str, cmd))}\n")
        out.flush()
        proc = subprocess.Popen(
            list(map(str, cmd)),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    output = logfile.read_text(errors="replace")
    if rc is None:
        with open(logfile, "a") as out:
            out.write(f"\n[compat.py] killed after {timeout}s\n")
    return rc, output, round(time.monotonic() - start, 1)


def first_line_matching(text, patterns, default=""):
    for line in text.splitlines():
        for pat in patterns:
            if re.search(pat, line):
                return line.strip()
    return default


def tail(text, n=40):
    return "\n".join(text.rstrip().splitlines()[-n:])


def source_digest(root):
    digest = hashlib.sha256()
    for item in SNAPSHOT_ITEMS:
        path = root / item
        files = [path] if path.is_file() else sorted(path.rglob("*"))
        for f in files:
            if (
                f.is_file()
                and "__pycache__" not in f.parts
                and f.suffix not in (".pyc", ".so", ".o")
            ):
                digest.update(f.relative_to(root).as_posix().encode() + b"\0")
                digest.update(f.read_bytes())
    return digest.hexdigest()[:12]


def snapshot(cache):
    """Copies the parts of the working tree the matrix needs; returns its dir."""
    digest = source_digest(REPO)
    target = cache / "src" / digest
    if not (target / ".complete").exists():
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.o")
        for item in SNAPSHOT_ITEMS:
            src = REPO / item
            if src.is_dir():
                shutil.copytree(src, target / item, ignore=ignore)
            elif src.exists():
                shutil.copy2(src, target / item)
        (target / ".complete").write_text(digest)
    return target, digest


def install_requires(src):
    """tapehook's install_requires, read from setup.py without running it."""
    match = re.search(r"install_requires\s*=\s*\[([^\]]*)\]", (src / "setup.py").read_text())
    return re.findall(r"[\"']([^\"']+)[\"']", match.group(1)) if match else []


def machine_description():
    cpu = "unknown CPU"
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(
            re.search(r"MemTotal:\s+(\d+)", pathlib.Path("/proc/meminfo").read_text()).group(1)
        )
        mem = f"{kb / 2**20:.0f} GiB RAM"
    except (OSError, AttributeError):
        pass
    try:
        cxx = os.environ.get("CXX", "g++")
        cxx = subprocess.run(
            [cxx, "--version"], capture_output=True, text=True
        ).stdout.splitlines()[0]
    except (OSError, IndexError):
        cxx = "no C++ compiler"
    return f"{platform.node()}: {platform.platform()}, {cpu}, {os.cpu_count()} cores, {mem}, {cxx}"


# ----------------------------------------------------------------- rows


@dataclasses.dataclass
class Row:
    py: str  # "3.11"
    dist: str  # tensorflow-cpu / tf-nightly-cpu
    version: str  # "2.16" (newest patch) or an exact nightly version
    keras_min: bool = False  # pin Keras to the lowest version this TF accepts

    @property
    def name(self):
        return f"py{self.py}-{self.dist}-{self.version}" + ("-kerasmin" if self.keras_min else "")

    @property
    def requirement(self):
        if self.dist == "tensorflow-cpu" and self.version.count(".") == 1:
            return f"{self.dist}=={self.version}.*"
        return f"{self.dist}=={self.version}"

    @property
    def pre(self):
        return "nightly" in self.dist


def resolve_nightly(py, dist, cache):
    """Newest version of a nightly dist for this Python, or (None, why)."""
    python = find_python(py)
    if python is None:
        return None, f"no Python {py} interpreter"
    logfile = cache / "logs" / f"index-{dist}-py{py}.log"
    rc, out, _ = run(
        [python, "-m", "pip", "index", "versions", "--pre", dist], logfile, clean_env(), timeout=300
    )
    match = re.search(rf"^{re.escape(dist)} \(([^)]+)\)", out, re.M)
    if rc != 0 or not match:
        why = first_line_matching(out, [r"ERROR"], tail(out, 1)) if rc is not None else "timed out"
        return None, f"pip cannot find {dist} on this machine's registry: {why}"
    return match.group(1), ""


def pkg_versions(python, env):
    code = (
        "import json, importlib.metadata as m\n"
        "def v(*names):\n"
        "    for n in names:\n"
        "        try: return m.version(n)\n"
        "        except m.PackageNotFoundError: pass\n"
        "    return None\n"
        "print(json.dumps({'tf': v('tensorflow-cpu','tf-nightly-cpu','tensorflow','tf-nightly'),"
        "'keras': v('keras','keras-nightly'), 'numpy': v('numpy'), 'tapehook': v('tapehook')}))"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {}


def ensure_venv(venv, python, requirements, pre, logs, fresh, label):
    """Creates venv and pip-installs requirements unless a complete install is there.

    Returns (ok, status, output_of_failure).
    """
    marker = venv / ".compat-installed"
    wanted = json.dumps({"python": python, "requirements": requirements, "pre": pre})
    if (
        not fresh
        and marker.exists()
        and marker.read_text() == wanted
        and (venv / "bin" / "python").exists()
    ):
        log(f"{label}: reusing {venv}")
        return True, "reused", ""
    shutil.rmtree(venv, ignore_errors=True)
    logs.mkdir(parents=True, exist_ok=True)
    rc, out, _ = run([python, "-m", "venv", venv], logs / "venv.log", clean_env())
    if rc != 0:
        return False, "venv failed", out
    log(f"{label}: pip install {' '.join(requirements)}")
    cmd = [
        venv / "bin" / "python",
        "-m",
        "pip",
        "install",
        *(["--pre"] if pre else []),
        *requirements,
    ]
    rc, out, secs = run(cmd, logs / "install.log", clean_env(venv), timeout=3600)
    if rc != 0:
        if re.search(r"No matching distribution found for (tensorflow|tf-nightly)", out):
            return False, "no wheel", out
        return False, "install failed" if rc is not None else "install timed out", out
    marker.write_text(wanted)
    log(f"{label}: installed in {secs}s")
    return True, "installed", ""


def install_tapehook(venv, src, logs):
    env = clean_env(venv)
    pip = [venv / "bin" / "python", "-m", "pip", "install"]
    with _editable_lock:
        rc, out, _ = run(
            [*pip, "-e", src, "--no-deps"], logs / "tapehook-install.log", env, timeout=600
        )
    if rc != 0:
        return False, out
    deps = install_requires(src)
    if deps:
        rc, out, _ = run([*pip, *deps], logs / "tapehook-deps.log", env, timeout=600)
        if rc != 0:
            return False, out
    return True, ""


def pin_keras_min(vpy, venv, logs):
    """Installs the lowest Keras the installed TF's metadata allows (keras>=X -> X)."""
    code = (
        "import importlib.metadata as m, re\n"
        "for d in ('tensorflow-cpu','tf-nightly-cpu','tensorflow','tf-nightly'):\n"
        "    try: reqs = m.requires(d) or []\n"
        "    except m.PackageNotFoundError: continue\n"
        "    for r in reqs:\n"
        "        x = re.match(r'(keras(?:-nightly)?)\\s*\\(?\\s*[^;]*?>=\\s*([\\w.]+)', r)\n"
        "        if x: print(x.group(1) + '==' + x.group(2)); raise SystemExit\n"
    )
    found = subprocess.run(
        [vpy, "-c", code], capture_output=True, text=True, env=clean_env(venv)
    ).stdout.strip()
    if not found:
        return False, "keras==?", "no keras>=X requirement in the TF metadata"
    rc, out, _ = run(
        [vpy, "-m", "pip", "install", found], logs / "keras-pin.log", clean_env(venv), timeout=1200
    )
    return rc == 0, found, out


IMPORT_CHECK = """
import json, tensorflow as tf
import keras
import tapehook
print("COMPAT_JSON " + json.dumps({"tf": tf.__version__, "keras": keras.__version__}))
"""


def parse_pytest(out):
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    summary = ""
    for line in out.splitlines()[::-1]:
        if re.search(r"\b(passed|failed|error|errors|skipped|no tests ran)\b", line) and re.search(
            r"\bin [\d.]+s", line
        ):
            summary = line.strip("= ").strip()
            break
    for n, kind in re.findall(r"(\d+) (passed|failed|errors?|skipped)", summary):
        counts["errors" if kind.startswith("error") else kind] = int(n)
    first = first_line_matching(out, [r"^(FAILED|ERROR) "])
    if not first:
        first = first_line_matching(
            out, [r"^E\s+\w*(Error|Exception)", r"ImportError while", r"Timeout"]
        )
    return counts, summary, first, first_failure_block(out)


def first_failure_block(out):
    """The first test's section under FAILURES / ERRORS, shortened."""
    lines = out.splitlines()
    start = None
    for i, line in enumerate(lines):
        if re.match(r"^=+ (FAILURES|ERRORS) =+$", line):
            start = i + 1
            break
    if start is None:
        return ""
    end = len(lines)
    for j in range(start + 1, len(lines)):
        if re.match(r"^_{3,} .* _{3,}$", lines[j]) or re.match(r"^=+ .* =+$", lines[j]):
            end = j
            break
    block = lines[start:end]
    if len(block) > 70:
        block = block[:20] + ["[... trimmed ...]"] + block[-50:]
    return "\n".join(block)


def run_row(row, cache, src, digest, args):
    venv = cache / row.name
    logs = venv.parent / (row.name + "-logs")  # outside venv so --fresh keeps old logs aside
    result = {
        "name": row.name,
        "python": row.py,
        "dist": row.dist,
        "requested": row.requirement,
        "tf": None,
        "keras": None,
        "numpy": None,
        "status": "",
        "build_ok": None,
        "import_ok": None,
        "passed": None,
        "failed": None,
        "errors": None,
        "skipped": None,
        "build_s": None,
        "tests_s": None,
        "first_error": "",
        "details": "",
        "source": digest,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    label = row.name
    python = find_python(row.py)
    if python is None:
        result.update(status="no interpreter", first_error=f"no Python {row.py} found")
        return save(result, logs)
    ok, status, out = ensure_venv(
        venv, python, [row.requirement, *TEST_EXTRAS], row.pre, logs, args.fresh, label
    )
    if not ok:
        if status == "no wheel":
            line = f"pip has no {row.requirement} wheel for Python {row.py} here"
        else:
            line = first_line_matching(out, [r"^ERROR"], tail(out, 1))
        result.update(status=status, first_error=line, details=tail(out, 30))
        return save(result, logs)
    vpy = venv / "bin" / "python"
    if row.keras_min:
        ok, pin, out = pin_keras_min(vpy, venv, logs)
        result["requested"] += f" + {pin}"
        if not ok:
            result.update(
                status="keras pin failed",
                first_error=first_line_matching(out, [r"^ERROR"], tail(out, 1)),
                details=tail(out, 30),
            )
            return save(result, logs)
    ok, out = install_tapehook(venv, src, logs)
    if not ok:
        result.update(
            status="tapehook install failed",
            first_error=first_line_matching(out, [r"^ERROR"], tail(out, 1)),
            details=tail(out, 30),
        )
        return save(result, logs)
    versions = pkg_versions(str(vpy), clean_env(venv))
    result.update(tf=versions.get("tf"), keras=versions.get("keras"), numpy=versions.get("numpy"))

    kcache = venv / "kernel-cache"
    env = clean_env(venv, TAPEHOOK_CACHE_DIR=kcache)
    rc, out, _ = run(
        [vpy, "-c", IMPORT_CHECK],
        logs / "import.log",
        {**env, "TAPEHOOK_KERNELS": "reference"},
        cwd="/",
        timeout=600,
    )
    result["import_ok"] = rc == 0
    if rc != 0:
        result.update(
            first_error="import: "
            + first_line_matching(out, [r"^\w*(Error|Exception)\b.*:", r"Error"], tail(out, 1)),
            details="$ import tapehook\n" + tail(out, 40),
        )

    with _cpu_lock:
        log(f"{label}: building kernels (TF {result['tf']}, Keras {result['keras']})")
        rc, out, secs = run(
            [vpy, "-m", "tapehook.build"],
            logs / "build.log",
            env,
            cwd="/",
            timeout=args.build_timeout,
        )
    result.update(build_ok=rc == 0, build_s=secs)
    if rc != 0:
        if not result["first_error"]:
            result["first_error"] = "build: " + first_line_matching(
                out, [r"error:", r"TapehookError", r"Error"], tail(out, 1)
            )
            result["details"] = "$ python -m tapehook.build\n" + tail(out, 60)
        result["status"] = "build failed" if rc is not None else "build timed out"
        log(f"{label}: build FAILED ({secs}s)")
        return save(result, logs)

    with _cpu_lock:
        log(f"{label}: running tests")
        rc, out, secs = run(
            [
                vpy,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-rfE",
                f"--timeout={args.test_timeout}",
                *TEST_FILES,
            ],
            logs / "tests.log",
            {**env, "TAPEHOOK_KERNELS": "compiled", "COLUMNS": "240"},
            cwd=src,
            timeout=args.run_timeout,
        )
    counts, summary, first, block = parse_pytest(out)
    result.update(
        passed=counts["passed"],
        failed=counts["failed"],
        errors=counts["errors"],
        skipped=counts["skipped"],
        tests_s=secs,
        pytest_summary=summary,
    )
    if rc is None:
        result["status"] = f"tests timed out after {args.run_timeout}s"
        first = first or f"test run killed after {args.run_timeout}s"
    elif rc == 0:
        result["status"] = "ok"
    else:
        result["status"] = "tests failed" if summary else f"pytest exited {rc}"
        if not summary:
            block = block or tail(out, 40)
    if rc != 0 and not result["first_error"]:
        result["first_error"] = first or tail(out, 1)
        result["details"] = block or tail(out, 40)
    log(f"{label}: {result['status']} {summary}")
    return save(result, logs)


def save(result, logs):
    logs.mkdir(parents=True, exist_ok=True)
    result["logs"] = str(logs)
    (logs / "result.json").write_text(json.dumps(result, indent=1))
    return result


# ----------------------------------------------------------------- upgrade check

SMOKE = r"""
import json, sys
import numpy as np
import tensorflow as tf
import tapehook

x = tf.random.stateless_normal([2, 8, 8, 4], seed=[1, 2])
w = tf.Variable(tf.random.stateless_normal([3, 3, 4, 5], seed=[3, 4]))
tapehook.mark_binary(w)
tapehook.reset_dispatch_counts()
with tf.GradientTape() as tape:
    y = tf.nn.conv2d(x, w, strides=1, padding="SAME")
    loss = tf.reduce_sum(y * y)
dw = tape.gradient(loss, w)

# Expected: conv with sign(w); STE gradient = float gradient at sign(w), zero where |w| > 1.
w_sign = tf.Variable(np.sign(w.numpy()))
with tf.GradientTape() as tape:
    y_ref = tf.nn.conv2d(x, w_sign, strides=1, padding="SAME")
    loss_ref = tf.reduce_sum(y_ref * y_ref)
dw_ref = tape.gradient(loss_ref, w_sign) * tf.cast(tf.abs(w) <= 1.0, tf.float32)

info = tapehook.kernel_info()
counts = tapehook.dispatch_counts()["compiled"]
cpu = info["cpu"]
out = {
    "tf_version": tf.__version__,
    "loaded": cpu.get("loaded"),
    "built_for": cpu.get("tf_version"),
    "library": cpu.get("path"),
    "fresh_build": cpu.get("fresh_build"),
    "reason": cpu.get("reason"),
    "compiled_counts": counts,
    "forward_matches": bool(np.allclose(y.numpy(), y_ref.numpy(), atol=1e-4)),
    "grad_matches": bool(np.allclose(dw.numpy(), dw_ref.numpy(), rtol=1e-4, atol=1e-3)),
}
out["ok"] = bool(out["loaded"] and out["built_for"] == tf.__version__
                 and out["forward_matches"] and out["grad_matches"]
                 and counts["forward"] >= 1 and counts["backprop_filter"] >= 1)
print("SMOKE_JSON " + json.dumps(out))
sys.exit(0 if out["ok"] else 1)
"""


def smoke(vpy, env, logs, name):
    # The smoke checks that the compiled kernels ran: keep the dispatcher on them.
    rc, out, secs = run(
        [vpy, vpy.parent.parent / "smoke.py"],
        logs / f"{name}.log",
        {**env, "TAPEHOOK_KERNELS": "compiled", "TAPEHOOK_DISPATCH": "kernels"},
        cwd="/",
        timeout=900,
    )
    match = re.search(r"^SMOKE_JSON (.*)$", out, re.M)
    data = json.loads(match.group(1)) if match else {}
    data.update(rc=rc, seconds=secs)
    if rc != 0:
        data["error"] = first_line_matching(
            out,
            [r"^\w*(Error|Exception)\b.*:", r"Fatal|Segmentation|Aborted|undefined symbol"],
            tail(out, 1),
        )
        data["output_tail"] = tail(out, 30)
    return data


def upgrade_check(cache, src, digest, args):
    venv = cache / f"py3.11-upgrade-{UPGRADE_FROM}-to-{UPGRADE_TO}"
    logs = cache / (venv.name + "-logs")
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    result = {
        "from": UPGRADE_FROM,
        "to": UPGRADE_TO,
        "ok": False,
        "steps": [],
        "source": digest,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    python = find_python("3.11")
    # Always fresh: the check mutates the venv.
    ok, status, out = ensure_venv(
        venv,
        python,
        [f"tensorflow-cpu=={UPGRADE_FROM}.*", *TEST_EXTRAS],
        False,
        logs,
        True,
        "upgrade",
    )
    if not ok:
        result["error"] = f"installing TF {UPGRADE_FROM}: " + first_line_matching(
            out, [r"^ERROR"], tail(out, 1)
        )
        return save_upgrade(result, logs)
    (venv / "smoke.py").write_text(SMOKE)
    vpy = venv / "bin" / "python"
    ok, out = install_tapehook(venv, src, logs)
    if not ok:
        result["error"] = "installing tapehook: " + tail(out, 1)
        return save_upgrade(result, logs)
    env = clean_env(venv, TAPEHOOK_CACHE_DIR=venv / "kernel-cache")
    with _cpu_lock:
        log("upgrade: build + smoke on TF " + UPGRADE_FROM)
        rc, out, secs = run(
            [vpy, "-m", "tapehook.build"],
            logs / "build-before.log",
            env,
            cwd="/",
            timeout=args.build_timeout,
        )
        result["steps"].append(
            {
                "step": f"python -m tapehook.build (TF {UPGRADE_FROM})",
                "rc": rc,
                "seconds": secs,
                **({"error": tail(out, 5)} if rc != 0 else {}),
            }
        )
        before = smoke(vpy, env, logs, "smoke-before")
    result["before"] = before
    result["steps"].append({"step": "smoke before upgrade", **before})
    log(f"upgrade: pip install tensorflow-cpu=={UPGRADE_TO} into the same venv")
    rc, out, secs = run(
        [vpy, "-m", "pip", "install", f"tensorflow-cpu=={UPGRADE_TO}"],
        logs / "pip-upgrade.log",
        clean_env(venv),
        timeout=3600,
    )
    result["pip_upgrade"] = {
        "rc": rc,
        "seconds": secs,
        "installed": first_line_matching(out, [r"^Successfully installed"]),
    }
    if rc != 0:
        result["error"] = "pip upgrade: " + first_line_matching(out, [r"^ERROR"], tail(out, 1))
        return save_upgrade(result, logs)
    result["versions_after"] = pkg_versions(str(vpy), clean_env(venv))
    with _cpu_lock:
        log("upgrade: smoke on TF " + UPGRADE_TO + " (must rebuild on first use)")
        after = smoke(vpy, env, logs, "smoke-after")
    result["after"] = after
    libs = sorted(p.parent.name for p in (venv / "kernel-cache").glob("*/libtapehook_ops.so"))
    result["cached_libraries"] = libs
    result["ok"] = bool(
        before.get("ok")
        and after.get("ok")
        and after.get("fresh_build")
        and after.get("built_for") == after.get("tf_version")
        and str(after.get("tf_version", "")).startswith(UPGRADE_TO.rsplit(".", 1)[0])
        and after.get("library") != before.get("library")
    )
    log(f"upgrade: {'ok' if result['ok'] else 'FAILED'}")
    return save_upgrade(result, logs)


def save_upgrade(result, logs):
    result["logs"] = str(logs)
    (logs / "result.json").write_text(json.dumps(result, indent=1))
    return result


# ----------------------------------------------------------------- report

COLUMNS = (
    "python",
    "TF (pip)",
    "TF",
    "Keras",
    "numpy",
    "build",
    "import",
    "passed",
    "failed",
    "errors",
    "build s",
    "tests s",
    "status",
    "first error",
)


def cells(r):
    def yn(v):
        return "-" if v is None else ("yes" if v else "NO")

    def num(v):
        return "-" if v is None else str(v)

    first = (r.get("first_error") or "").replace("|", "\\|")
    if len(first) > 160:
        first = first[:157] + "..."
    return (
        r["python"],
        r["requested"],
        r.get("tf") or "-",
        r.get("keras") or "-",
        r.get("numpy") or "-",
        yn(r.get("build_ok")),
        yn(r.get("import_ok")),
        num(r.get("passed")),
        num(r.get("failed")),
        num(r.get("errors")),
        num(r.get("build_s")),
        num(r.get("tests_s")),
        r.get("status") or "-",
        first,
    )


# The page leaves out the timings and the first error (its own section below).
DOC_COLUMNS = [
    i for i, name in enumerate(COLUMNS) if name not in ("build s", "tests s", "first error")
]


def markdown_table(results):
    lines = [
        "| " + " | ".join(COLUMNS[i] for i in DOC_COLUMNS) + " |",
        "|" + "---|" * len(DOC_COLUMNS),
    ]
    lines += ["| " + " | ".join(cells(r)[i] for i in DOC_COLUMNS) + " |" for r in results]
    return "\n".join(lines)


def text_table(results):
    rows = [COLUMNS] + [cells(r) for r in results]
    widths = [min(max(len(row[i]) for row in rows), 70) for i in range(len(COLUMNS))]
    out = []
    for row in rows:
        out.append("  ".join(c[:w].ljust(w) for c, w in zip(row, widths)).rstrip())
    return "\n".join(out)


def upgrade_markdown(u):
    if u is None:
        return "Not run this time (`--no-upgrade`)."
    b, a = u.get("before", {}), u.get("after", {})
    lines = [
        f"Result: **{'PASS' if u.get('ok') else 'FAIL'}** ({u.get('date')}, source "
        f"`{u.get('source')}`).",
        "",
        f"One venv: `tensorflow-cpu=={u['from']}.*`, `python -m tapehook.build`, smoke test "
        f"(mark a variable, binary conv + gradient checked against conv(x, sign(w)) and the "
        f"STE gradient, `kernel_info()`); then `pip install tensorflow-cpu=={u['to']}` in the "
        f"same venv and the smoke test again, same `TAPEHOOK_CACHE_DIR`, no explicit build.",
        "",
        "| | TF | kernels loaded | built for | fresh build | library | forward ok | grad ok | rc |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, s in (("before", b), ("after upgrade", a)):
        lib = s.get("library") or "-"
        lib = "/".join(str(lib).split("/")[-2:])
        lines.append(
            f"| {label} | {s.get('tf_version', '-')} | {s.get('loaded', '-')} | "
            f"{s.get('built_for', '-')} | {s.get('fresh_build', '-')} | `{lib}` | "
            f"{s.get('forward_matches', '-')} | {s.get('grad_matches', '-')} | "
            f"{s.get('rc', '-')} |"
        )
    if u.get("pip_upgrade"):
        lines += ["", f"pip upgrade: {u['pip_upgrade'].get('installed') or '(nothing new)'}"]
    if u.get("cached_libraries"):
        lines += [
            "",
            "Libraries in the cache afterwards: "
            + ", ".join(f"`{x}`" for x in u["cached_libraries"]),
        ]
    for s in (b, a):
        if s.get("error"):
            lines += [
                "",
                "<details><summary>smoke failure: "
                + s["error"].replace("<", "&lt;")
                + "</summary>",
                "",
                "```",
                s.get("output_tail", ""),
                "```",
                "</details>",
            ]
    if u.get("error"):
        lines += ["", f"Error: `{u['error']}`"]
    return "\n".join(lines)


def write_doc(path, results, upgrade, machine, digest, live, unavailable):
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    parts = [
        "# TensorFlow compatibility matrix",
        "",
        "Generated by `python scripts/compat.py` (`make compat`); do not edit by hand.",
        "",
        f"- Date: {now}",
        f"- Machine: {machine}",
        f"- Source: {'working tree' if live else 'snapshot of the working tree'} `{digest}` "
        "(tapehook/, cc_kernels/, tests/, setup.py, pytest.ini)",
        "- Each row: a fresh venv with that TF (Keras and numpy as pip resolves them from the "
        "TF pin), `pip install -e . --no-deps` + tapehook's requirements, `import tapehook` "
        "(TAPEHOOK_KERNELS=reference), `python -m tapehook.build`, then "
        "`TAPEHOOK_KERNELS=compiled python -m pytest -q -p no:cacheprovider "
        + " ".join(TEST_FILES)
        + "`.",
        "",
    ]
    parts += [markdown_table(results), ""]
    stale = collections.Counter(
        r["source"] for r in results if r.get("source") and r.get("source") != digest
    )
    if stale:
        parts += [
            "Rows not rerun on this source, shown from their last run (date in the status "
            "column): " + ", ".join(f"{n} on source `{src}`" for src, n in sorted(stale.items())),
            "",
        ]
    if unavailable:
        parts += ["Not available on this machine's package registry: " + "; ".join(unavailable), ""]
    parts += [
        "## In-place upgrade (TF 2.19 -> 2.21 in one venv)",
        "",
        upgrade_markdown(upgrade),
        "",
        "## First failure per row",
        "",
    ]
    failing = [r for r in results if r.get("details")]
    if not failing:
        parts.append("No failures.")
    for r in failing:
        summary = f"{r['name']}: {r.get('status')} - {r.get('first_error', '')}"
        summary = summary.replace("<", "&lt;").replace(">", "&gt;")
        if len(summary) > 200:
            summary = summary[:197] + "..."
        parts += [
            f"<details><summary>{summary}</summary>",
            "",
            "```",
            r["details"].replace("```", "'''"),
            "```",
            "",
            "</details>",
            "",
        ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts).rstrip() + "\n")


# ----------------------------------------------------------------- main


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cache",
        type=pathlib.Path,
        default=DEFAULT_CACHE,
        help="where the venvs live (default %(default)s)",
    )
    p.add_argument("--jobs", type=int, default=2, help="rows installing at once (default 2)")
    p.add_argument(
        "--tf",
        nargs="*",
        default=list(STABLE),
        help="stable TF minor versions on Python 3.11 (default: %(default)s)",
    )
    p.add_argument(
        "--extra-pythons",
        nargs="*",
        default=["3.10", "3.12"],
        help="Pythons also tested with the newest stable TF and the nightly",
    )
    p.add_argument(
        "--nightly",
        nargs="*",
        default=[NIGHTLY],
        help="nightly dists to test on 3.11 (default %(default)s; also: tf-nightly)",
    )
    p.add_argument(
        "--keras-min",
        nargs="*",
        default=list(STABLE),
        help="stable TF versions also tested (Python 3.11) with the lowest Keras "
        "their metadata accepts (default: %(default)s)",
    )
    p.add_argument(
        "--only",
        nargs="*",
        default=None,
        help="run only rows whose name contains one of these; others are reported "
        "from their last result",
    )
    p.add_argument("--no-upgrade", action="store_true", help="skip the in-place upgrade check")
    p.add_argument("--fresh", action="store_true", help="recreate every venv")
    p.add_argument(
        "--live", action="store_true", help="install the working tree itself instead of a snapshot"
    )
    p.add_argument("--build-timeout", type=int, default=1200)
    p.add_argument("--test-timeout", type=int, default=300, help="per test (pytest-timeout)")
    p.add_argument("--run-timeout", type=int, default=1800, help="per pytest run")
    p.add_argument("--doc", type=pathlib.Path, default=REPO / "docs" / "compat.md")
    return p.parse_args()


def main():
    args = parse_args()
    cache = args.cache.resolve()
    if cache == REPO or REPO in cache.parents:
        sys.exit("compat.py: --cache must be outside the repository")
    cache.mkdir(parents=True, exist_ok=True)
    if args.live:
        src, digest = REPO, source_digest(REPO)
    else:
        src, digest = snapshot(cache)
    log(f"source {src} ({digest}); cache {cache}")

    rows, unavailable = [], []
    for v in args.tf:
        rows.append(Row("3.11", "tensorflow-cpu", v))
    newest = sorted(args.tf, key=lambda v: tuple(map(int, v.split("."))))[-1] if args.tf else None
    nightly_versions = {}
    for dist in args.nightly:
        for py in ["3.11", *args.extra_pythons]:
            version, why = resolve_nightly(py, dist, cache)
            if version is None:
                if py == "3.11":
                    unavailable.append(f"{dist} ({why})")
                    log(f"{dist}: {why}")
                    break
                continue
            nightly_versions[(dist, py)] = version
    for py in args.extra_pythons:
        if newest:
            rows.append(Row(py, "tensorflow-cpu", newest))
    for dist in args.nightly:
        for py in ["3.11", *args.extra_pythons]:
            if (dist, py) in nightly_versions:
                rows.append(Row(py, dist, nightly_versions[(dist, py)]))
    for v in args.keras_min:
        rows.append(Row("3.11", "tensorflow-cpu", v, keras_min=True))
    for dist in args.nightly:
        if (dist, "3.11") in nightly_versions:
            log(f"{dist}: newest is {nightly_versions[(dist, '3.11')]}")

    selected = [r for r in rows if args.only is None or any(s in r.name for s in args.only)]
    do_upgrade = not args.no_upgrade and (
        args.only is None or any("upgrade" in s for s in args.only)
    )
    results = {}
    upgrade = None
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(run_row, r, cache, src, digest, args): r.name for r in selected}
        if do_upgrade:
            futures[pool.submit(upgrade_check, cache, src, digest, args)] = "upgrade"
        for fut in concurrent.futures.as_completed(futures):
            name = futures[fut]
            try:
                value = fut.result()
            except Exception as exc:  # a bug here must not lose the other rows
                log(f"{name}: compat.py crashed: {exc!r}")
                value = None
            if name == "upgrade":
                upgrade = value
            else:
                results[name] = value
    for r in rows:
        if results.get(r.name) is None:
            old = cache / (r.name + "-logs") / "result.json"
            if old.exists():
                results[r.name] = json.loads(old.read_text())
                results[r.name]["status"] = (
                    results[r.name]["status"] + f" (from {results[r.name]['date']})"
                )
            elif r.name in [s.name for s in selected]:
                results[r.name] = {
                    "name": r.name,
                    "python": r.py,
                    "requested": r.requirement,
                    "status": "compat.py crashed",
                    "first_error": "",
                }
    if upgrade is None and not do_upgrade:
        old = cache / f"py3.11-upgrade-{UPGRADE_FROM}-to-{UPGRADE_TO}-logs" / "result.json"
        upgrade = json.loads(old.read_text()) if old.exists() else None
    ordered = [results[r.name] for r in rows if r.name in results]
    print()
    print(text_table(ordered))
    if unavailable:
        print("\nunavailable: " + "; ".join(unavailable))
    if upgrade is not None:
        print(
            f"\nin-place upgrade {UPGRADE_FROM} -> {UPGRADE_TO}: "
            f"{'PASS' if upgrade.get('ok') else 'FAIL'}"
        )
    write_doc(args.doc, ordered, upgrade, machine_description(), digest, args.live, unavailable)
    print(f"\nwrote {args.doc}")
    bad = [
        r for r in ordered if (r.get("status") or "").split(" (from ")[0] not in ("ok", "no wheel")
    ]
    return 1 if bad or (upgrade is not None and not upgrade.get("ok")) else 0


if __name__ == "__main__":
    sys.exit(main())
