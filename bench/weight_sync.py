"""What the weight-sync guard costs: its check against the RL step it guards.

Runs ``retool train`` for ``--steps`` steps with the check on every step (the default,
``--weight-sync-check-every 1``) and prints, per step and on average, the check's
seconds (``time/weight_sync``: the probe scored by the sampler and by the trainer)
against the whole step's (``time/step``, the check included), their ratio, and the
load average. The baseline is the step itself, measured in the same run.

    python bench/weight_sync.py                        # bundled SmolLM2-135M, MATH-500, tool mode
    python bench/weight_sync.py --model tests-tiny     # the tests' 2-layer model
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from retool.config import make_config
from retool.log import read_metrics
from retool.train import TrainConfig, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bundled:smollm2", help="a model folder, bundled:smollm2 or tests-tiny")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-turn-tokens", type=int, default=128)
    args = parser.parse_args()
    model = args.model
    if model == "tests-tiny":
        from tests.tiny import boxed_digit_model_dir

        model = str(boxed_digit_model_dir())
    with tempfile.TemporaryDirectory() as tmp:
        cfg = make_config(TrainConfig, model=model, chat_template="hermes", train_data="math500",
                          batch_size=args.batch_size, group_size=args.group_size, max_steps=args.steps,
                          max_turn_tokens=args.max_turn_tokens, max_trajectory_tokens=1024, lora_rank=8,
                          sandbox_workers=2, run_dir=str(Path(tmp) / "run"), save_every=10_000)
        rows = read_metrics(train(cfg) / "metrics.jsonl")
    for r in rows:
        print(f"step {r['step']}: check {r['time/weight_sync']:.3f} s, step {r['time/step']:.2f} s, "
              f"ratio {r['time/weight_sync'] / r['time/step']:.4f}, max |Δlogprob| {r['weight_sync/max_abs_diff']:.2e}")
    check = sum(r["time/weight_sync"] for r in rows) / len(rows)
    step = sum(r["time/step"] for r in rows) / len(rows)
    print(f"mean: check {check:.3f} s vs step {step:.2f} s = ratio {check / step:.4f}; "
          f"load average {os.getloadavg()[0]:.2f} (model {args.model})")


if __name__ == "__main__":
    main()
