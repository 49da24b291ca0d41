#!/usr/bin/env bash
# Builds the CUDA kernels + CPU core into the harness library with nvcc, checks
# every kernel against the CPU core and benchmarks them against cuDNN.
# Needs nvcc, numpy and PyTorch with CUDA; no TensorFlow. See bench/CUDA.md.
#   bash bench/cuda_run.sh [--skip-bench] [--archs 90]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# Build SASS for the GPU that is here only (one arch keeps nvcc fast).
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .' || true)
args=("$@")
if [[ -n "$arch" && " ${args[*]-} " != *" --archs "* ]]; then
  args+=(--archs "$arch")
fi
exec "$PYTHON" bench/cuda_harness.py "${args[@]}"
