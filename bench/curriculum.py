"""The difficulty pool's informative share against the seeded shuffle, in one run.

Two RL runs of the tiny boxed-digit model (``tests/tiny.py``: it answers a random digit,
a favoured 2 about 1 time in 5) on the same 16 problems, the same seed and sizes: half
have gold answer 2 (their groups are often mixed), half gold 100, which the model never
writes (their groups are always 0/G, family ``never``). The first run draws with
``--curriculum none``, the second with ``--curriculum difficulty``. Printed per run:
groups rolled out, informative groups (mixed rewards), their share, rollout seconds,
and the ratio of the shares; plus ``os.getloadavg()``.

This measures the mechanism on a toy whose families differ sharply in difficulty, not
the CPU demo's gain (run ``retool demo`` for that).

    .venv/bin/python bench/curriculum.py [--steps 12] [--refill-rounds 0]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retool.config import make_config  # noqa: E402
from retool.log import read_metrics  # noqa: E402
from retool.train import TrainConfig, train  # noqa: E402
from tests.tiny import DIGIT_QUESTION, boxed_digit_model_dir  # noqa: E402


def write_problems(path: Path, n: int = 16) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            answer, family = ("2", "digit") if i % 2 else ("100", "never")
            f.write(json.dumps({"id": f"p{i}", "question": DIGIT_QUESTION, "answer": answer,
                                "data_source": family}) + "\n")
    return path


def run(folder: Path, data: Path, curriculum: str, args: argparse.Namespace) -> dict[str, float]:
    cfg = make_config(TrainConfig, model=str(boxed_digit_model_dir()), chat_template="hermes", train_data=str(data),
                      batch_size=2, group_size=4, max_steps=args.steps, max_turn_tokens=12,
                      max_trajectory_tokens=600, mode="text", sandbox_workers=1, run_dir=str(folder / curriculum),
                      save_every=args.steps, lora_rank=4, lora_alpha=8.0, lr=1e-3, refill_rounds=args.refill_rounds,
                      curriculum=curriculum, seed=args.seed)
    rows = read_metrics(train(cfg) / "metrics.jsonl")
    groups = sum(r["rollout/groups"] for r in rows)
    informative = sum(round(r["rollout/groups"] * r["rollout/informative_group_rate"]) for r in rows)
    return {"groups": groups, "informative": informative, "share": informative / groups,
            "refills": sum(r["rollout/refill_rounds"] for r in rows), "rollout_s": sum(r["time/rollout"] for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--refill-rounds", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        data = write_problems(Path(tmp) / "problems.jsonl")
        results = {name: run(Path(tmp), data, name, args) for name in ("none", "difficulty")}
    print(f"{'curriculum':<12} {'groups':>6} {'informative':>11} {'share':>6} {'refill rounds':>13} {'rollout s':>9}")
    for name, r in results.items():
        print(f"{name:<12} {r['groups']:>6.0f} {r['informative']:>11.0f} {r['share']:>6.1%} {r['refills']:>13.0f} "
              f"{r['rollout_s']:>9.1f}")
    base = results["none"]["share"]
    ratio = results["difficulty"]["share"] / base if base else float("inf")
    print(f"informative share, difficulty / none: {ratio:.2f}x   load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
