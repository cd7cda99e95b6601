"""``retool train --stream-groups`` against the synchronous step on the local engine.

The tiny boxed-digit model of the tests (``tests/tiny.py``: a 2-layer Llama whose
answers are boxed digits), text mode, on this machine's CPU. Runs alternate
synchronous / streamed (``--repeats`` pairs, ABAB, so a drift in the machine's load
hits both), each a fresh run of ``--steps`` steps; the first step of each run is left
out (warm-up). Printed: steps/s of each mode from the median ``time/step`` (on a shared,
loaded machine a mean is ruled by a few stalled steps), the streamed/sync ratio, the
median time left for training after the rollout (``time/train``), and the load. Torch
runs one intra-op thread (``--threads``), as the tests do: on a busy 2-core machine the
spin-waits of a second thread make single steps many times slower.

On a CPU the rollout and ``forward_backward`` share the same cores and the local
engine's model lock (sampling and training take turns), so little gain is expected:
what streaming overlaps is the Python side (rollout bookkeeping, grading) with the
training, not two computations at once. The Tinker latency model
(``bench/scale.py --stream-groups``) is the figure for a service engine.

    python bench/streaming.py --steps 6 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_once(work: Path, stream: bool, args: argparse.Namespace) -> list[dict]:
    """One fresh run; its metric rows after the first step."""
    from retool.config import make_config
    from retool.log import read_metrics
    from retool.train import TrainConfig, train
    from tests.test_train import digit_problems
    from tests.tiny import boxed_digit_model_dir

    work.mkdir(parents=True)
    cfg = make_config(TrainConfig, model=str(boxed_digit_model_dir()), chat_template="hermes", mode="text",
                      train_data=str(digit_problems(work / "train.jsonl", n=16)), batch_size=args.batch_size,
                      group_size=args.group_size, max_steps=args.steps, max_turn_tokens=args.max_turn_tokens,
                      max_trajectory_tokens=800, run_dir=str(work / "run"), save_every=1000, lora_rank=4,
                      lora_alpha=8.0, lr=2e-3, stream_groups=stream, seed=args.seed)
    return read_metrics(train(cfg) / "metrics.jsonl")[1:]


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per run (the first is left out)")
    parser.add_argument("--repeats", type=int, default=3, help="synchronous/streamed pairs")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-turn-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    if args.steps < 2 or args.repeats < 1:
        parser.error("--steps must be >= 2 and --repeats >= 1")
    import torch

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rows: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="retool-stream-bench-") as tmp:
        for repeat in range(args.repeats):
            for stream in (False, True):
                rows[stream] += run_once(Path(tmp) / f"{repeat}-{int(stream)}", stream, args)
    sync_s, stream_s = median(rows[False], "time/step"), median(rows[True], "time/step")
    print(f"\nlocal engine, tiny model, text mode: {args.batch_size} x {args.group_size} per step, "
          f"{args.repeats} x {args.steps - 1} timed steps per mode, {args.threads} torch thread(s); medians; load "
          f"{load_before} -> {os.getloadavg()}")
    for stream, label in ((False, "synchronous"), (True, "streamed")):
        r = rows[stream]
        print(f"{label:>12}: {1 / median(r, 'time/step'):.2f} steps/s ({median(r, 'time/step'):.3f} s/step: rollout "
              f"{median(r, 'time/rollout'):.3f} s, training after it {median(r, 'time/train'):.3f} s)")
    print(f"streamed / synchronous steps/s: {sync_s / stream_s:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
