"""Compiles tapehook's CUDA kernels (cc_kernels/cuda/*.cu) with nvcc.

Standard library only and no tapehook imports: bench/cuda_harness.py loads
this file by path on GPU machines that have no TensorFlow.

Use from the TF build (tapehook/kernels.py, CUDA builds of TF only)::

    objects, cflags, ldflags = compile_cuda(root, tmp_dir)
    # compile every .cc (core/, tf/) with the TF flags + cflags
    #   (cflags = -DGOOGLE_CUDA=1 and the CUDA include dir, which turns on
    #    tf/binary_conv_ops_gpu.cc), then link the .cc objects + `objects`
    #    with the TF link flags + ldflags.

Which CUDA to build with
------------------------
The GPU ``tensorflow`` 2.21 wheel is built against CUDA 12.5 (runtime from the
``nvidia-*-cu12`` wheels). tapehook's kernels link their own static CUDA
runtime (``-lcudart_static``) and only share TF's stream, so the runtime
version is not tied to TF's; what matters is the NVIDIA driver: a CUDA 12.x
runtime runs on any driver >= 525, a CUDA 13 runtime needs a driver >= 580.

* Supported and recommended: nvcc 12.x (12.5 to 12.9) with TF 2.21's GPU
  wheel. If the machine has no CUDA 12 toolkit, ``pip install
  nvidia-cuda-nvcc-cu12 nvidia-cuda-runtime-cu12`` and point ``$CUDA_HOME``
  (or ``$NVCC``) at it; nvcc 12 targets sm_75 .. sm_90 the same way.
* nvcc 13.0 (the build machines) compiles the same sources (CUDA 13 supports
  sm_75 and newer only) and is what the framework-free harness uses; inside a
  TF 2.21 process it also needs a driver >= 580 and is not yet verified there.

Architectures: SASS for sm_75, sm_80 and sm_90, plus compute_90 PTX so newer
GPUs (sm_100, sm_120) JIT-compile the kernels at load time.
"""

import concurrent.futures
import os
import pathlib
import re
import shutil
import subprocess

DEFAULT_ARCHS = ("75", "80", "90")
LINK_LIBS = ("-lcudart_static", "-lrt", "-ldl", "-lpthread")


class CudaBuildError(RuntimeError):
    """nvcc is missing or a CUDA compile / link failed."""


def find_nvcc():
    """Path of nvcc ($NVCC, PATH, $CUDA_HOME/bin, /usr/local/cuda/bin) or None."""
    candidates = [os.environ.get("NVCC"), shutil.which("nvcc")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "bin", "nvcc"))
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def cuda_unavailable_reason():
    """None if nvcc is available, else why the CUDA kernels cannot be built."""
    if find_nvcc() is None:
        return (
            "nvcc not found (looked at $NVCC, PATH, $CUDA_HOME/bin, "
            "/usr/local/cuda/bin); install a CUDA 12.x toolkit or "
            "`pip install nvidia-cuda-nvcc-cu12` and set CUDA_HOME"
        )
    return None


def _nvcc_or_raise():
    nvcc = find_nvcc()
    if nvcc is None:
        raise CudaBuildError(cuda_unavailable_reason())
    return nvcc


def toolkit_dirs(nvcc):
    """(include dirs, library dirs) nvcc itself uses, from `nvcc --dryrun`.

    nvcc may be a wrapper script (as /usr/local/bin/nvcc here), so its own
    path does not locate the toolkit.
    """
    run = subprocess.run(
        [nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
        capture_output=True,
        text=True,
    )
    text = run.stdout + run.stderr

    def paths(var, flag):
        match = re.search(rf"^#\$ {var}=(.*)$", text, re.MULTILINE)
        found = re.findall(rf'"?{flag}([^"\s]+)"?', match.group(1)) if match else []
        return [os.path.normpath(p) for p in found if not p.endswith("stubs")]

    includes, libs = paths("INCLUDES", "-I"), paths("LIBRARIES", "-L")
    if not includes or not libs:
        raise CudaBuildError(
            f"could not read the CUDA include / library dirs from "
            f"`{nvcc} --dryrun`:\n{text[-2000:]}"
        )
    return includes, libs


def gencode_flags(archs=DEFAULT_ARCHS):
    """SASS for every arch, PTX for the newest (forward compatibility)."""
    flags = []
    for arch in archs[:-1]:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    last = archs[-1]
    flags += ["-gencode", f"arch=compute_{last},code=[sm_{last},compute_{last}]"]
    return flags


def nvcc_flags(root, archs=DEFAULT_ARCHS):
    return [
        "-O3",
        "-std=c++17",
        "-Xcompiler",
        "-fPIC",
        "--threads",
        "0",
        f"-I{root}",
        *gencode_flags(archs),
    ]


def _run_all(jobs):
    """Runs compile commands concurrently; raises with the first failure's output."""
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        runs = list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), jobs))
    for cmd, run in zip(jobs, runs):
        if run.returncode:
            raise CudaBuildError(f"`{' '.join(cmd)}` failed:\n{(run.stdout + run.stderr)[-4000:]}")


def cuda_sources(root):
    return sorted(pathlib.Path(root, "cuda").glob("*.cu"))


def compile_cuda(root, out_dir, archs=DEFAULT_ARCHS):
    """Compiles cc_kernels/cuda/*.cu into out_dir.

    root is the cc_kernels directory. Returns (object paths, extra compile
    flags for the .cc files of the TF library, extra link flags). Raises
    CudaBuildError when nvcc is missing or a compile fails.
    """
    nvcc = _nvcc_or_raise()
    root, out_dir = pathlib.Path(root), pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    includes, libs = toolkit_dirs(nvcc)
    objects, jobs = [], []
    for src in cuda_sources(root):
        obj = out_dir / f"cuda_{src.stem}.o"
        objects.append(obj)
        jobs.append([nvcc, *nvcc_flags(root, archs), "-c", str(src), "-o", str(obj)])
    _run_all(jobs)
    static = [d for d in libs if os.path.isfile(os.path.join(d, "libcudart_static.a"))]
    if not static:
        raise CudaBuildError(
            f"libcudart_static.a not found in {libs}; install the CUDA "
            f"runtime of the same toolkit as {nvcc}"
        )
    compile_flags = ["-DGOOGLE_CUDA=1", *(f"-I{d}" for d in includes)]
    return objects, compile_flags, [f"-L{static[0]}", *LINK_LIBS]


def build_harness(root, out_path, archs=DEFAULT_ARCHS, cuda_objects=None):
    """Links the framework-free GPU harness library (no TensorFlow).

    It holds the CUDA kernels, the CPU core (cc_kernels/core/*.cc) as the
    reference, and the extern "C" shim cc_kernels/cuda/harness/harness.cu.
    cuda_objects reuses objects from compile_cuda(); else they are compiled.
    """
    nvcc = _nvcc_or_raise()
    root, out_path = pathlib.Path(root), pathlib.Path(out_path)
    build_dir = out_path.parent / (out_path.stem + ".objs")
    if cuda_objects is None:
        cuda_objects = compile_cuda(root, build_dir, archs)[0]
    objects, jobs = [pathlib.Path(o) for o in cuda_objects], []
    for src in [root / "cuda" / "harness" / "harness.cu", *sorted((root / "core").glob("*.cc"))]:
        obj = build_dir / f"{src.parent.name}_{src.stem}.o"
        jobs.append([nvcc, *nvcc_flags(root, archs), "-c", str(src), "-o", str(obj)])
        objects.append(obj)
    build_dir.mkdir(parents=True, exist_ok=True)
    _run_all(jobs)
    link = subprocess.run(
        [
            nvcc,
            "-shared",
            *gencode_flags(archs),
            *map(str, objects),
            "-o",
            str(out_path),
            "-lpthread",
        ],
        capture_output=True,
        text=True,
    )
    if link.returncode:
        raise CudaBuildError(f"linking {out_path} failed:\n{(link.stdout + link.stderr)[-4000:]}")
    return out_path
