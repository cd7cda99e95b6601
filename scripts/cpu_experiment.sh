#!/usr/bin/env bash
# The CPU RL experiment of docs/cpu-experiment.md, end to end, with the time of each stage:
# synthetic data -> cold-start SFT -> eval after SFT -> RL (configs/cpu-smollm2.toml)
# -> eval after RL -> paired comparison -> training curves.
#
#   bash scripts/cpu_experiment.sh            # defaults below; every stage resumes if re-run
#   SFT_STEPS=24 RL_STEPS=30 RL_REFILL=0 bash scripts/cpu_experiment.sh
#   RL_STALENESS=1 OUT=runs/cpu-k1 bash scripts/cpu_experiment.sh   # RL sampling one step ahead
#   INTERPRETER=stateful OUT=runs/cpu-stateful bash scripts/cpu_experiment.sh
#     # the same with one interpreter session per trajectory: two-call SFT dialogues that
#     # reuse variables, and --interpreter stateful for sft, eval and train
#     # (scripts/interpreter_experiment.sh runs both modes and compares them)
#
# Needs the project installed (bash scripts/setup.sh). Writes under $OUT (default runs/cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
RETOOL=${RETOOL:-.venv/bin/retool}
OUT=${OUT:-runs/cpu}
SFT_STEPS=${SFT_STEPS:-16}
SFT_LR=${SFT_LR:-1e-3}
RL_STEPS=${RL_STEPS:-20}
RL_LR=${RL_LR:-1e-4}
RL_REFILL=${RL_REFILL:-2}   # dynamic-sampling rounds a step (0: plain GRPO batches)
RL_STALENESS=${RL_STALENESS:-0}  # --max-staleness: sample step t + K while step t trains (0: in turn)
TEST_N=${TEST_N:-64}
VAL_N=${VAL_N:-2}
INTERPRETER=${INTERPRETER:-stateless}
MODE=(--interpreter "$INTERPRETER")
SFT_DATA=data/arith/sft.jsonl
[ "$INTERPRETER" = stateless ] || SFT_DATA=data/arith/sft-$INTERPRETER.jsonl
mkdir -p "$OUT" data/arith
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/timing.log"; }
timed() { local name=$1; shift; local t0=$SECONDS; log "start $name"; "$@"; log "done $name in $((SECONDS - t0)) s"; }

timed data bash -c "$RETOOL task-data --split sft --n 400 --interpreter $INTERPRETER --output $SFT_DATA &&
  $RETOOL task-data --split rl --n 400 --output data/arith/rl.jsonl &&
  $RETOOL task-data --split test --n $TEST_N --output data/arith/test.jsonl"

COMMON=(--model bundled:smollm2 --chat-template hermes --packing shared-prefix)
if [ -f "$OUT/sft/config.json" ]; then
  timed sft "$RETOOL" sft --resume "$OUT/sft" --max-steps "$SFT_STEPS"
else
  timed sft "$RETOOL" sft "${COMMON[@]}" "${MODE[@]}" --data "$SFT_DATA" --batch-size 4 \
    --max-steps "$SFT_STEPS" --lr "$SFT_LR" --save-every 8 --run-dir "$OUT/sft"
fi

EVAL=("${MODE[@]}" --dataset data/arith/test.jsonl --val-n "$VAL_N" --max-turn-tokens 128 --max-trajectory-tokens 1024
      --max-code-calls 2 --max-assistant-turns 3 --sandbox-timeout-s 10 --concurrency 16)
timed eval-sft "$RETOOL" eval --checkpoint "$OUT/sft" --label "after SFT" "${EVAL[@]}" --output "$OUT/eval/sft.jsonl"

if [ -f "$OUT/rl/config.json" ]; then
  timed rl "$RETOOL" train --resume "$OUT/rl" --max-steps "$RL_STEPS"
else
  timed rl "$RETOOL" train --config configs/cpu-smollm2.toml "${MODE[@]}" --init-from "$OUT/sft" \
    --max-steps "$RL_STEPS" --lr "$RL_LR" \
    --refill-rounds "$RL_REFILL" --max-staleness "$RL_STALENESS" --run-dir "$OUT/rl"
fi

timed eval-rl "$RETOOL" eval --checkpoint "$OUT/rl" --label "after RL" "${EVAL[@]}" --output "$OUT/eval/rl.jsonl"

"$RETOOL" compare "$OUT/eval/sft.jsonl" "$OUT/eval/rl.jsonl" | tee "$OUT/compare.md"
"$RETOOL" plot training "$OUT/rl" --output-dir "$OUT/plots"
"$RETOOL" plot checkpoints "$OUT/eval" --output-dir "$OUT/plots"
log "all done; results in $OUT"
