"""Calibrate the cold-start task: accuracy of a model before and after SFT, with and without the tool.

Measures, in one process (the model loads once), on held-out problems of the synthetic
arithmetic task (``retool.tasks``, split ``test``), with the RL rollout itself
(``retool.rollout.Rollout``, the engine's sampler, the real sandbox, ``reward.agrade``):

1. zero-shot accuracy with the tool (tool mode) and without it (text mode);
2. SFT for ``--steps`` steps on ``--sft-data`` (``retool.sft.sft_step``, same engine);
3. accuracy after SFT in tool mode and in text mode.

Prints one line per phase (accuracy, format, tool-call rate, valid-call rate, time,
per-kind accuracy) and writes them all as JSON to ``--output``. Results and commands
are recorded in ``docs/sft.md``. Example (CPU, a few minutes)::

    PYTHONPATH=. python bench/sft_calibration.py --sft-data data/sft.jsonl --steps 16 \\
        --batch-size 4 --lr 3e-4 --n-test 32 --output runs/calibration.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from retool.sft import SFTConfig, build_run, load_dialogues, sft_step
from retool.tasks import make_problems

PHASES = ("zero_shot_tool", "zero_shot_text", "sft", "after_sft_tool", "after_sft_text")


def evaluate(engine, problems, *, tools: bool, chat_template: str, temperature: float, top_p: float,
             max_turn_tokens: int, seed: int) -> dict:
    """Roll out every problem once with the engine's current weights; accuracy and rollout metrics."""
    from retool.render import Renderer
    from retool.reward import agrade
    from retool.rollout import Rollout, RolloutConfig, rollout_metrics
    from retool.sandbox import Sandbox, SandboxConfig

    renderer = Renderer(engine.get_tokenizer(), chat_template=chat_template, tools=tools)
    config = RolloutConfig(max_turn_tokens=max_turn_tokens, max_trajectory_tokens=1024 + max_turn_tokens,
                           temperature=temperature, top_p=top_p, sandbox_timeout_s=10.0, seed=seed)
    t0 = time.monotonic()
    with Sandbox(SandboxConfig(timeout_s=10.0, workers=4)) as sandbox:
        rollout = Rollout(renderer, engine.save_weights_for_sampler(), sandbox if tools else None, agrade, config)
        groups = asyncio.run(rollout.groups(problems, 1))
    trajectories = [g[0] for g in groups]
    by_kind: dict[str, list[bool]] = defaultdict(list)
    for problem, t in zip(problems, trajectories):
        by_kind[problem.id.split("-")[1]].append(t.grade.correct)
    metrics = rollout_metrics(trajectories)
    return {
        "accuracy": metrics["reward/correct"], "format": metrics["reward/format"],
        "used_tool_rate": metrics["rollout/used_tool_rate"],
        "valid_tool_call_rate": metrics["rollout/valid_tool_call_rate"],
        "sampled_tokens": metrics["rollout/sampled_tokens"], "seconds": time.monotonic() - t0,
        "by_kind": {k: f"{sum(v)}/{len(v)}" for k, v in sorted(by_kind.items())},
        "examples": [t.turns[0].text[:300] for t in trajectories[:3]],
    }


def train(run, steps: int, eval_every: int, evaluate_now) -> dict:
    """``steps`` SFT steps on the run's engine (tool-mode eval every ``eval_every``); losses and time."""
    t0, losses, seconds = time.monotonic(), [], 0.0
    for step in range(1, steps + 1):
        metrics = sft_step(run, step)
        losses.append(round(metrics["sft/loss"], 4))
        seconds += metrics["time/step"]
        print(f"sft step {step}: loss {metrics['sft/loss']:.4f} ({metrics['time/step']:.1f}s)", file=sys.stderr)
        if eval_every and step % eval_every == 0 and step < steps:
            evaluate_now(f"sft_step_{step}_tool")
    return {"steps": steps, "batch_size": run.config.batch_size, "lr": run.config.lr, "losses": losses,
            "train_seconds": seconds, "seconds": time.monotonic() - t0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sft-data", required=True, help="dialogues from `retool task-data --split sft`")
    p.add_argument("--model", default="bundled:smollm2")
    p.add_argument("--chat-template", default="hermes")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--n-test", type=int, default=32, help="held-out problems (split 'test')")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.7, help="nucleus sampling of the evaluations (retool eval's default)")
    p.add_argument("--max-turn-tokens", type=int, default=160)
    p.add_argument("--phases", default=",".join(PHASES),
                   help=f"comma-separated phases to run, in this order: {','.join(PHASES)}")
    p.add_argument("--eval-every", type=int, default=0, help="also evaluate (tool mode) every N SFT steps")
    p.add_argument("--save-adapter", type=Path, default=None, help="save the engine state here after SFT")
    p.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)

    cfg = SFTConfig(model=args.model, chat_template=args.chat_template, data=args.sft_data, batch_size=args.batch_size,
                    max_steps=args.steps, lr=args.lr, lora_rank=args.lora_rank, lora_alpha=float(args.lora_rank),
                    seed=args.seed, run_dir="unused")
    t0 = time.monotonic()
    run, data = build_run(cfg, load_dialogues(args.sft_data))
    print(f"loaded model and {len(data.datums)} dialogues in {time.monotonic() - t0:.1f}s; {data.summary()}",
          file=sys.stderr)
    problems = make_problems(args.n_test, seed=args.seed, split="test")
    results: dict[str, object] = {"args": {k: str(v) for k, v in vars(args).items()}}

    def phase(name: str, tools: bool) -> None:
        out = evaluate(run.engine, problems, tools=tools, chat_template=args.chat_template,
                       temperature=args.temperature, top_p=args.top_p, max_turn_tokens=args.max_turn_tokens, seed=args.seed)
        results[name] = out
        print(f"{name}: " + json.dumps({k: v for k, v in out.items() if k != "examples"}), file=sys.stderr)
        print(f"  first turn: {out['examples'][0]!r}", file=sys.stderr)

    phases = [name.strip() for name in args.phases.split(",") if name.strip()]
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        p.error(f"unknown phases {unknown}; choose from {PHASES}")
    for name in PHASES:
        if name not in phases:
            continue
        if name == "sft":
            results["sft"] = train(run, args.steps, args.eval_every, lambda label: phase(label, tools=True))
            if args.save_adapter:
                run.engine.save_state(args.save_adapter)
        else:
            phase(name, tools=name.endswith("_tool"))
        if args.output:  # after every phase, so a long run's early numbers survive
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
