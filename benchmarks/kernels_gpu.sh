#!/usr/bin/env bash
# The prepared device check for the kernels (issue 8): on a lent GPU machine, run from
# the repository root as the device tool's command, e.g.
#
#     run(command="bash benchmarks/kernels_gpu.sh", timeout_s=480)
#
# It needs no install: the machine's python3 already has torch, triton and pytest, and
# `opencomposer.kernels` is made importable by a link in /tmp. It runs
#   1. the GPU tests (pytest -m gpu tests/kernels): the MX GEMM on the backend
#      `mx.gemm_backend` picks (Triton on H100/H200, MX _scaled_mm on Blackwell) against
#      the exact emulation;
#   2. benchmarks/kernels.py --only gpu: bf16 vs FP8 tensorwise _scaled_mm vs MXFP8 GEMM,
#      bf16 _grouped_mm vs FP8 rowwise _scaled_grouped_mm, and the MoE layer in bf16 and
#      MXFP8, in TFLOP/s; numbers also go to $OUT/kernels_gpu.json.
# Expected wall time on an H200: about a minute after the machine starts. Here (no CUDA)
# the same script runs the CPU fallback at toy sizes: `OUT=/tmp bash benchmarks/kernels_gpu.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && ! "$PY" -c "import torch" 2>/dev/null; then PY=.venv/bin/python; fi
shim=$(mktemp -d)
trap 'rm -rf "$shim"' EXIT
mkdir -p "$shim/opencomposer" && ln -s "$PWD/kernels" "$shim/opencomposer/kernels"
export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv
"$PY" -c "import torch, opencomposer.kernels as k; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), k.__path__[0])"
"$PY" -m pytest -q -p no:cacheprovider -o addopts= -m gpu tests/kernels/test_kernels_mx.py 2>&1 | tail -5
"$PY" benchmarks/kernels.py --only gpu --json "$out/kernels_gpu.json"
