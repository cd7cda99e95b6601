"""What the weight-sync guard costs: its check against the work of an RL step.

Default (``--model tests-tiny``, the tests' 2-layer model): runs ``retool train`` for
``--steps`` steps with the check on every step and prints, per step and on average, the
check's seconds (``time/weight_sync``: the probe scored by the sampler and by the
trainer) against the whole step's (``time/step``, the check included), their ratio and
the load average — the baseline is the step itself, in the same run.

``--check-only`` (for a real model, e.g. the bundled SmolLM2-135M, whose full steps need
more memory than a shared machine has): loads the local engine, times ``--repeats``
checks and, as the same-run baseline, one rollout-sized sample call (``--group-size``
continuations of ``--max-turn-tokens`` tokens of a rollout's first prompt, i.e. one
group's first turn), alternating, medians after a warm-up round. A real step samples
``batch_size`` groups over several turns and trains on them too, so check / group is an
upper bound on the check's share of a step. Under a changing load only this same-run
ratio means anything.

    python bench/weight_sync.py
    python bench/weight_sync.py --check-only --model bundled:smollm2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.tiny builds the tiny model

from retool.config import make_config  # noqa: E402
from retool.engines import SamplingParams  # noqa: E402
from retool.log import read_metrics  # noqa: E402
from retool.train import TrainConfig, train  # noqa: E402
from retool.weight_sync import guard_for  # noqa: E402


def model_path(name: str) -> str:
    if name == "tests-tiny":
        from tests.tiny import boxed_digit_model_dir

        return str(boxed_digit_model_dir())
    return name


def run_steps(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = make_config(TrainConfig, model=model_path(args.model), chat_template="hermes", train_data="math500",
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


def check_only(args: argparse.Namespace) -> None:
    from retool.engines.local import LocalEngineConfig, LocalTrainingClient
    from retool.render import Renderer

    engine = LocalTrainingClient(LocalEngineConfig(model=model_path(args.model), lora_rank=32, lora_alpha=32.0))
    renderer = Renderer(engine.get_tokenizer(), chat_template="hermes", tools=True, model_name=args.model)
    guard = guard_for("local", 1, renderer, None)
    sampler = engine.save_weights_for_sampler()
    prompt = renderer.prompt_tokens(renderer.messages("What is 17 times 23?"))  # a rollout's first prompt
    params = SamplingParams(args.max_turn_tokens, stop_token_ids=(0,))
    checks, groups = [], []
    for step in range(args.repeats + 1):  # the first round warms both up (merge, oneDNN primitives): not counted
        seconds = guard.check(step + 1, engine, sampler)["time/weight_sync"]
        t0 = time.monotonic()
        asyncio.run(sampler.sample(prompt, args.group_size, params))
        if step:
            checks.append(seconds)
            groups.append(time.monotonic() - t0)
    check, group = sorted(checks)[len(checks) // 2], sorted(groups)[len(groups) // 2]
    print(f"probe: {len(guard.probe.tokens)} tokens ({len(guard.probe.tokens) - guard.probe.start} scored); "
          f"check median {check:.3f} s over {args.repeats} (alternating with the baseline)")
    print(f"baseline: one group's first turn ({args.group_size} x {args.max_turn_tokens} tokens of a "
          f"{len(prompt)}-token rollout prompt) median {group:.2f} s; ratio check / group {check / group:.4f}; "
          f"load average {os.getloadavg()[0]:.2f} (model {args.model})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tests-tiny", help="a model folder, bundled:smollm2 or tests-tiny")
    parser.add_argument("--check-only", action="store_true", help="time the check against one group's sampling")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-turn-tokens", type=int, default=128)
    args = parser.parse_args()
    check_only(args) if args.check_only else run_steps(args)


if __name__ == "__main__":
    main()
