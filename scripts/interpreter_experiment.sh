#!/usr/bin/env bash
# Stateless vs stateful interpreter on the CPU experiment's task (docs/cpu-experiment.md):
# the whole pipeline of scripts/cpu_experiment.sh (data -> SFT -> eval -> RL -> eval) once
# per mode, then `retool compare` of the two modes after SFT and after RL on the same
# held-out problems: accuracy, code calls and tokens per trajectory, and the share of
# calls that fail with NameError (plus format, tool use, valid calls).
#
#   bash scripts/interpreter_experiment.sh          # OUT=runs/interpreter; stages resume if re-run
#
# Takes about 2 hours per mode on a 2-core CPU (RL ~75 min, two evals ~20 min each, SFT
# and data a few minutes; see the timing.log of each mode), so ~4 hours in all. Run it on
# an otherwise idle machine: the rollouts' sandbox calls and the local sampler share it.
set -euo pipefail
cd "$(dirname "$0")/.."
RETOOL=${RETOOL:-.venv/bin/retool}
OUT=${OUT:-runs/interpreter}
for mode in stateless stateful; do
  INTERPRETER=$mode OUT="$OUT/$mode" RETOOL="$RETOOL" bash scripts/cpu_experiment.sh
done
for stage in sft rl; do
  echo "## after ${stage^^}: stateless (before) vs stateful (after)" | tee "$OUT/compare-$stage.md"
  "$RETOOL" compare "$OUT/stateless/eval/$stage.jsonl" "$OUT/stateful/eval/$stage.jsonl" | tee -a "$OUT/compare-$stage.md"
done
echo "comparisons in $OUT/compare-sft.md and $OUT/compare-rl.md"
