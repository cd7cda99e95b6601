"""ReTool in one file: the RL loop top to bottom, to read and to copy.

A language model solves math problems; whenever it wants, it calls a Python interpreter
(one tool, ``code_interpreter``), reads the answer and goes on. Only the final
``\\boxed{}`` answer is graded (+1 right, -1 otherwise). Each step of this loop:

    1. batch       pick ``batch_size`` problems
    2. rollout     ``group_size`` trajectories per problem: the policy writes, calls
                   the interpreter (the sandbox runs the code), reads its output
    3. reward      grade each trajectory's final answer
    4. advantages  each reward minus its group's mean (GRPO)
    5. datums      tokens shifted into inputs/targets; the weight is the policy mask,
                   so prompt, template and interpreter tokens get no loss
    6. update      forward_backward with the PPO clipped loss (clip 0.8 / 1.28), then Adam
    7. log         one line per step (and a JSONL row with ``--output``)

Every stage is a few statements in :func:`train` below and calls the package's own
pieces: :mod:`retool.render` (token-exact chat rendering), :mod:`retool.rollout` (the
multi-turn state machine), :mod:`retool.sandbox`, :mod:`retool.reward`,
:mod:`retool.algo` and an engine from :mod:`retool.engines`.

Run it (after ``bash scripts/setup.sh``), on the bundled SmolLM2-135M-Instruct::

    .venv/bin/python examples/minimal_rl.py --steps 2
    .venv/bin/python examples/minimal_rl.py --init-from runs/demo/sft --steps 10 --output rl.jsonl

Zero-shot SmolLM2 never calls the tool and rarely boxes a right answer, so most groups
have equal rewards and teach nothing; start from a cold-start SFT run (``--init-from``,
e.g. the ``sft`` folder of a ``retool demo`` output) to see the reward move. Measured
zero-shot on two CPU cores shared with other jobs: at the defaults (2 x 4 trajectories)
with ``--packing bucketed``, one step took 535 s (65 s of it the rollout) and 5.5 GB of
memory at peak (load 12); with ``--batch-size 1 --group-size 2`` and the default
shared-prefix packing, 108 s (rollout 49 s, update 59 s) and 2.6 GB (load 8-10).

Deliberately left out (``retool train`` has them, ``retool/train.py``): checkpoints and
``--resume``, dynamic sampling (refill rounds), retries of failed rollouts, the cost
meter, metric sinks other than a JSONL file, saved trajectories, TOML presets, the
stateful interpreter and text-only mode.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from retool import algo
from retool.config import ConfigError
from retool.data import DataError, load_problems, require_usable_golds
from retool.engines import (
    ENGINE_NAMES,
    AdamParams,
    ModelConfig,
    Requirements,
    TrainingClient,
    check_supported,
    close_training_client,
)
from retool.render import Renderer
from retool.reward import GoldAnswerError, grade_many
from retool.rollout import Rollout, RolloutConfig, rollout_metrics
from retool.runs import load_engine
from retool.sandbox import Sandbox, SandboxConfig, SandboxUnavailableError
from retool.seeding import derive_seed
from retool.tasks import make_problems
from retool.types import Datum, Grade, Problem, Trajectory, TrajectoryGroup


def setting(default: object, help: str) -> object:
    """A :class:`Config` field: its default and the one line ``--help`` shows."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Config:
    """Every setting of this loop. Defaults fit two CPU cores: SmolLM2, 2 problems x 4
    trajectories, short turns (``retool train``'s defaults are the reference run's:
    Qwen3.5-4B, 8 x 8, 8,192-token trajectories)."""

    model: str = setting("bundled:smollm2", "HF model id, local folder, or bundled:smollm2")
    chat_template: str = setting("hermes", "chat-template override: 'hermes', a .jinja file, or 'none'")
    engine: str = setting("local", f"training/sampling engine ({' / '.join(ENGINE_NAMES)})")
    init_from: str = setting("", "start from these weights: an SFT/RL run folder or checkpoint ('' = the base model)")
    train_data: str = setting("", "problems JSONL/parquet ('' = the synthetic arithmetic task of the demo)")
    steps: int = setting(3, "RL steps")
    batch_size: int = setting(2, "problems per step")
    group_size: int = setting(4, "trajectories per problem (the GRPO group)")
    max_code_calls: int = setting(2, "code executions per trajectory")
    max_assistant_turns: int = setting(3, "assistant turns per trajectory")
    max_turn_tokens: int = setting(128, "tokens per assistant turn")
    max_trajectory_tokens: int = setting(1024, "tokens per trajectory, prompt included")
    temperature: float = setting(1.0, "rollout sampling temperature")
    top_p: float = setting(0.7, "rollout nucleus sampling")
    lora_rank: int = setting(32, "LoRA rank")
    micro_batch_tokens: int = setting(1280, "tokens per forward/backward micro-batch (memory grows with it)")
    packing: str = setting("shared-prefix", "micro-batch layout: shared-prefix (the shared prompt computed once; "
                                            "pure-attention models) or bucketed (any model, e.g. Qwen3.5)")
    lr: float = setting(1e-4, "Adam learning rate")
    clip_low: float = setting(0.8, "PPO ratio clip, lower bound")
    clip_high: float = setting(1.28, "PPO ratio clip, upper bound (clip-higher)")
    sandbox_timeout_s: float = setting(10.0, "wall-clock limit of one code execution")
    seed: int = setting(42, "seed of problem order, adapter init and sampling")
    output: str = setting("", "append one JSON row of metrics per step to this file ('' = print only)")


def parse_config(argv: list[str] | None = None) -> Config:
    """The :class:`Config` the command line asks for (``--help`` lists every field)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                            help=f.metadata["help"])
    return Config(**vars(parser.parse_args(argv)))


def check(cfg: Config) -> None:
    """Refuse settings the loop cannot run, with one line saying which."""
    for name in ("steps", "batch_size", "max_assistant_turns", "max_turn_tokens", "lora_rank", "micro_batch_tokens"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.group_size < 2:
        raise ConfigError(f"--group-size must be >= 2 for group-centred advantages, got {cfg.group_size}")
    if cfg.max_turn_tokens >= cfg.max_trajectory_tokens:
        raise ConfigError("--max-turn-tokens must be smaller than --max-trajectory-tokens")
    if not (cfg.lr > 0 and cfg.temperature > 0 and 0 < cfg.top_p <= 1 and cfg.sandbox_timeout_s > 0):
        raise ConfigError("--lr, --temperature and --sandbox-timeout-s must be > 0, --top-p in (0, 1]")
    if not 0 < cfg.clip_low <= 1 <= cfg.clip_high:
        raise ConfigError(f"need 0 < --clip-low <= 1 <= --clip-high, got {cfg.clip_low}, {cfg.clip_high}")


# ---------------------------------------------------------------- the loop


def train(cfg: Config) -> list[dict[str, float]]:
    """Run ``cfg.steps`` RL steps; return each step's metrics."""
    problems = load_problems(cfg.train_data) if cfg.train_data else make_problems(200, cfg.seed, split="rl")
    if not problems:
        raise ConfigError(f"--train-data {cfg.train_data} holds no usable problems")
    if cfg.train_data:  # every gold answer must grade as right against itself, before anything loads
        require_usable_golds(cfg.train_data, problems)
    engine = load_engine(model_config(cfg), cfg.seed)
    renderer = Renderer(engine.get_tokenizer(), chat_template=template(cfg), tools=True, model_name=cfg.model)
    order = random.Random(cfg.seed)
    history = []
    try:
        with Sandbox(SandboxConfig(timeout_s=cfg.sandbox_timeout_s, workers=4)) as sandbox:
            for step in range(1, cfg.steps + 1):
                t0 = time.monotonic()
                # 1. batch
                batch = order.sample(problems, min(cfg.batch_size, len(problems)))
                # 2. rollout, with a sampler that holds the weights of the last update
                rollout = Rollout(renderer, engine.save_weights_for_sampler(), sandbox, grade_later,
                                  rollout_config(cfg))
                groups_B = asyncio.run(roll_out(rollout, batch, cfg.group_size, derive_seed(cfg.seed, step)))
                t_rollout = time.monotonic() - t0
                # 3. reward: +1 for a right boxed answer in the last turn, -1 otherwise
                groups_B = [graded(group) for group in groups_B]
                # 4. advantages: each reward minus its group's mean (zero for a group of equal rewards)
                advantages_BG = [algo.group_advantages(group.rewards_G) for group in groups_B]
                # 5. datums: the policy's tokens carry the advantage; interpreter tokens have weight 0
                datums_D = [algo.trajectory_datum(t, a) for group, advantages_G in zip(groups_B, advantages_BG)
                            for t, a in zip(group.trajectories_G, advantages_G)]
                datums_D = [d for d in datums_D if d.num_trained > 0]
                # 6. update: PPO clipped loss (token mean), then one Adam step
                t_update = time.monotonic()
                update_metrics = update(engine, datums_D, cfg)
                t_update = time.monotonic() - t_update
                # 7. log
                metrics = {"step": float(step), **rollout_metrics([t for g in groups_B for t in g.trajectories_G]),
                           **sandbox.metrics(reset=True), **update_metrics,
                           "rollout/degenerate_group_rate": degenerate_rate(groups_B),
                           **dataclasses.replace(rollout.take_usage(),
                                                 trained=sum(d.num_trained for d in datums_D)).metrics(),
                           "time/rollout": t_rollout, "time/train": t_update, "time/step": time.monotonic() - t0}
                log(metrics, cfg.output)
                history.append(metrics)
    finally:
        close_training_client(engine)
    return history


async def roll_out(rollout: Rollout, batch: list[Problem], group_size: int, seed: int) -> list[TrajectoryGroup]:
    """One group per problem, all rolled out at once (each trajectory on its own task)."""
    trajectories_BG = await asyncio.gather(*(rollout.group(problem, group_size, seed=derive_seed(seed, i))
                                             for i, problem in enumerate(batch)))
    return [TrajectoryGroup(p, tuple(t_G)) for p, t_G in zip(batch, trajectories_BG)]


UNGRADED = Grade(reward=0.0, correct=False, formatted=False)


async def grade_later(final_text: str, gold: str) -> Grade:
    """The rollout's grader hook, left empty: this loop grades in its own step (3).
    ``retool train`` passes :func:`retool.reward.agrade` here, grading as trajectories end."""
    return UNGRADED


def graded(group: TrajectoryGroup) -> TrajectoryGroup:
    """The group with each trajectory's final assistant turn graded against the gold answer."""
    trajectories_G = group.trajectories_G
    grades_G = grade_many([final_text(t) for t in trajectories_G], [group.problem.answer] * len(trajectories_G))
    return TrajectoryGroup(group.problem,
                           tuple(dataclasses.replace(t, grade=g) for t, g in zip(trajectories_G, grades_G)))


def final_text(trajectory: Trajectory) -> str:
    """What the reward reads: the text of the last assistant turn ('' if none was sampled)."""
    return trajectory.turns[-1].text if trajectory.turns else ""


def update(engine: TrainingClient, datums_D: list[Datum], cfg: Config) -> dict[str, float]:
    """One policy-gradient update on ``datums_D``; its loss and optimiser metrics."""
    if not datums_D:
        return {}
    loss_config = {"clip_low_threshold": cfg.clip_low, "clip_high_threshold": cfg.clip_high}
    result = engine.forward_backward(datums_D, "ppo", loss_config)  # FloatingPointError if the loss is not finite
    step = engine.optim_step(AdamParams(learning_rate=cfg.lr, beta1=0.9, beta2=0.95))
    return {**result.metrics, **step.metrics}


def degenerate_rate(groups_B: list[TrajectoryGroup]) -> float:
    """Share of groups whose rewards are all equal: they teach nothing this step."""
    return algo.count_degenerate_groups([g.rewards_G for g in groups_B]) / len(groups_B)


LINE_FIELDS = ("reward/mean", "reward/correct", "rollout/code_calls", "rollout/degenerate_group_rate",
               "train/loss", "train/clip_frac", "sandbox/latency_p50", "time/rollout", "time/train")


def log(metrics: dict[str, float], output: str) -> None:
    """Print the step's main figures on one line; append every figure to ``output``."""
    shown = " ".join(f"{k}={metrics[k]:.4g}" for k in LINE_FIELDS if k in metrics)
    print(f"step {int(metrics['step'])}: {shown}", flush=True)
    if output:
        with open(output, "a") as f:
            f.write(json.dumps(metrics) + "\n")


# ---------------------------------------------------------------- settings for the package's pieces


def model_config(cfg: Config) -> ModelConfig:
    """The engine's model and adapter settings (LoRA on every linear layer, alpha = rank)."""
    model = ModelConfig(engine=cfg.engine, model=cfg.model, chat_template=template(cfg), lora_rank=cfg.lora_rank,
                        lora_alpha=float(cfg.lora_rank), micro_batch_tokens=cfg.micro_batch_tokens,
                        packing=cfg.packing, init_from=cfg.init_from or None)
    model.validate_model()
    check_supported(cfg.engine, Requirements(loss="ppo", packing=cfg.packing, train_top_p=cfg.top_p,
                                             train_temperature=cfg.temperature))
    return model


def template(cfg: Config) -> str | None:
    return None if cfg.chat_template == "none" else cfg.chat_template


def rollout_config(cfg: Config) -> RolloutConfig:
    return RolloutConfig(max_code_calls=cfg.max_code_calls, max_assistant_turns=cfg.max_assistant_turns,
                         max_trajectory_tokens=cfg.max_trajectory_tokens, max_turn_tokens=cfg.max_turn_tokens,
                         max_tool_response_tokens=128, temperature=cfg.temperature, top_p=cfg.top_p,
                         sandbox_timeout_s=cfg.sandbox_timeout_s)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    try:
        check(cfg)
        if cfg.output:
            Path(cfg.output).parent.mkdir(parents=True, exist_ok=True)
        train(cfg)
    except (ConfigError, DataError, GoldAnswerError, SandboxUnavailableError, FloatingPointError, OSError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
