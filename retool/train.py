"""The ReTool RL loop: ``retool train``.

One step, top to bottom (:func:`train_step`):

    batch of problems → sampler with the current weights → rollout (group fork,
    code calls in the sandbox) → outcome rewards → group-centred advantages →
    datums (interpreter tokens weight 0) → forward_backward(ppo) → optim_step →
    metrics → (every N steps) checkpoint

With ``--stream-groups`` (:func:`_streamed_step`, :mod:`retool.streaming`) the stages from
the reward to the forward_backward run per group as the rollout goes on, and the
optim_step follows the last group. With ``--max-staleness K`` (:func:`_rolled_out_ahead`,
:mod:`retool.pipeline`) stages 1-2 of step ``t + K`` run on a worker thread while step ``t``
trains, on the weights step ``t`` started with.

The loop around it: :func:`train` builds the :class:`Trainer` and hands
:meth:`Trainer.run_step` to :func:`retool.runs.run_steps` (metric sinks, progress bar,
checkpoints, resume), which calls it once per step; ``run_step`` runs :func:`train_step`
and keeps what the run keeps of it (cost; saved trajectories, written in the background
and joined before each checkpoint).

Everything a run writes lives in its run folder (``docs/formats.md``, written by
:mod:`retool.runs`): the resolved config, ``metrics.jsonl``, optional compressed
trajectories per step, and checkpoints with a ``manifest.json``. ``--resume RUN_DIR``
continues from the last complete checkpoint with the same step numbering, data order,
weights, Adam moments and RNG states; metric rows a crashed run wrote after that
checkpoint are dropped.

Failures: a sampler or template error is reported with the step and problem id; a
rollout that fails is retried ``max_retries`` times (transient service errors), then
the run stops; a non-finite loss or gradient stops the run without applying the
update. Bad config values, a missing or empty ``--train-data``, an unusable gold answer,
a ``--model`` folder that does not exist and, on ``--resume``, a data file that changed
since the run started are all rejected before any model loads (:func:`check_inputs`);
the run folder is written only once the model has loaded, so a failed start leaves no
half-made run and a failed resume leaves ``config.json`` as it was.

Not covered here: the engines themselves (:mod:`retool.engines`), multi-node
training (the verl integration), a KL penalty or a reference model (ReTool trains
without one).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from retool import algo, curriculum, pipeline, runs, streaming
from retool.atomic import atomic_write_json
from retool.config import ConfigError, add_config_args, config_from_args, option, require, resumed_config
from retool.cost import CostMeter, CostOptions, cost_meter
from retool.data import DataError, load_problems, read_problems, require_usable_golds
from retool.engines import (
    AdamParams,
    ModelConfig,
    Requirements,
    SamplingClient,
    TrainingClient,
    check_supported,
    close_training_client,
)
from retool.flag_checks import output_folder
from retool.log import check_sinks
from retool.render import Renderer
from retool.reward import agrade
from retool.rollout import Grader, Rollout, RolloutBudgets, RolloutError, UsageMeter, rollout_metrics
from retool.sandbox import Sandbox, SandboxUnavailableError
from retool.seeding import derive_seed
from retool.stats import behaviour_figures, trajectory_stats
from retool.types import Datum, Grade, Problem, Trajectory
from retool.weight_sync import WeightSyncError, WeightSyncGuard, guard_for

LOSSES = ("ppo", "importance_sampling")
MODES = ("retool", "text")


@dataclass
class TrainConfig(CostOptions, RolloutBudgets, ModelConfig):
    """Every knob of ``retool train``; defaults are the seed's configuration (Qwen3.5-4B,
    LoRA 32, 8 problems x 8 trajectories, Adam lr 4e-5 betas (0.9, 0.95), PPO clip
    [0.8, 1.28], seed 42).

    The engine, model and adapter fields come from :class:`retool.engines.ModelConfig`
    (shared with ``retool sft``), the rollout and sandbox budgets from
    :class:`retool.rollout.RolloutBudgets` (shared with ``retool eval``), ``--price-table``
    and ``--max-cost`` from :class:`retool.cost.CostOptions` (shared with ``retool sft``).
    """

    # ---- data and batch
    train_data: str = option("data/train.jsonl", "training problems (JSONL from retool prepare-data, or a bundled set)")
    batch_size: int = option(8, "problems per step")
    group_size: int = option(8, "trajectories per problem (GRPO group)")
    max_steps: int = option(200, "number of RL steps")
    mode: str = option("retool", "retool = tool on, text = tool off", choices=MODES)

    # ---- rollout sampling
    temperature: float = option(1.0, "rollout sampling temperature")
    top_p: float = option(1.0, "rollout nucleus sampling")

    # ---- optimisation
    loss: str = option("ppo", "policy loss", choices=LOSSES)
    clip_low: float = option(0.8, "PPO ratio clip lower bound (1 - eps_low)")
    clip_high: float = option(1.28, "PPO ratio clip upper bound (1 + eps_high, clip-higher)")
    dual_clip: float | None = option(None, "PPO dual-clip constant c (e.g. 10); none = off")
    normalize_std: bool = option(False, "divide group-centred advantages by the group std")
    advantage: str = option("grpo", "grpo: group-centred rewards; passk: pass@k-aware rewards (PKPO / verl "
                                    "grpo_passk, --passk K), then centred", choices=algo.ADVANTAGES)
    passk: int = option(2, "K of --advantage passk (1 <= K < group_size; 1 = grpo)")
    overlong: str = option("none", "truncated trajectories (a budget ended them): none = graded like others; "
                                   "mask = loss weight 0 (no gradient); soft = DAPO's linear penalty over the "
                                   "last --overlong-buffer policy tokens of the policy-token budget "
                                   "(min(max_trajectory_tokens - prompt, max_assistant_turns x max_turn_tokens)), "
                                   "added to every reward before centring; tool tokens never count",
                           choices=algo.OVERLONG)
    overlong_buffer: int = option(512, "L of --overlong soft: the penalty falls from 0 to -1 over the last L "
                                       "policy tokens of the budget")
    invalid_call_penalty: float = option(0.0, "subtracted from the reward of a trajectory with a malformed tool "
                                              "call (bad JSON, unknown tool, a call cut off, a tool response the "
                                              "model wrote itself...), before centring: a "
                                              "group all wrong still teaches against broken calls; 0 = outcome "
                                              "reward only (ReTool's)")
    kl_coef: float = option(0.0, "anchor to the starting policy (the weights the run starts from: --init-from, or "
                                 "the base model): each trained token's advantage minus kl_coef x (sampler - "
                                 "reference logprob), a per-token KL penalty; 0 = off (ReTool's); train/kl_reference "
                                 "logs the mean log-ratio")
    behaviour_is: str = option("off", "sampler-trainer correction: the loss ratio becomes pi_theta/pi_old "
                                      "(trainer logprobs) times w from r = pi_old/mu (sampler logprobs): "
                                      "token-tis w = min(r_t, C), sequence-tis w = min(prod r_t, C), token-mask "
                                      "w = 1 if 1/T <= r_t <= T else 0; off = ratio pi_theta/mu as before",
                               choices=algo.BEHAVIOUR_IS)
    behaviour_is_cap: float = option(2.0, "C of token-tis / sequence-tis (> 1)")
    behaviour_is_threshold: float = option(2.0, "T of token-mask (> 1)")
    drop_degenerate_groups: bool = option(False, "skip groups whose rewards are all equal (zero advantage)")
    refill_rounds: int = option(0, "dynamic sampling (DAPO): up to N extra rollout rounds of fresh problems "
                                   "while fewer than batch_size groups are informative; only those are trained")
    curriculum: str = option("none", "which problems a step draws: none = a seeded shuffle per epoch; difficulty = "
                                     "fewer of those whose recent groups were all right or all wrong (an online "
                                     "difficulty pool, retool/curriculum.py)", choices=curriculum.CURRICULA)
    curriculum_floor: float = option(0.1, "difficulty curriculum: the lowest draw weight of a problem (a fresh "
                                          "one weighs 1), so none starves")
    lr: float = option(4e-5, "Adam learning rate")
    lr_schedule: str = option("constant", "learning rate over the run: constant = --lr every step; cosine = --lr "
                                          "at step 1 falling along a half cosine to --lr-min-ratio x --lr at "
                                          "--max-steps", choices=algo.LR_SCHEDULES)
    lr_min_ratio: float = option(0.1, "the last step's share of --lr under --lr-schedule cosine (0 to 1)")
    beta1: float = option(0.9, "Adam beta1")
    beta2: float = option(0.95, "Adam beta2")
    weight_decay: float = option(0.0, "decoupled weight decay")
    grad_clip_norm: float | None = option(None, "clip the global gradient norm; none = only measure")
    stream_groups: bool = option(False, "forward_backward on each group as soon as it (and every group before it) "
                                        "has ended, optim_step once all have, overlapping the rollout's tail; the "
                                        "loss becomes token sum / (batch_size x group_size x policy-token budget), "
                                        "the synchronous update times train/stream_scale (docs/train.md)")
    max_staleness: int = option(0, "sample ahead of training: step t+K's rollout runs while steps t..t+K-1 train, "
                                   "on the weights step t starts with, so a step trains groups up to K weight "
                                   "versions old (retool/pipeline.py); 0 = sample and train in turn")

    # ---- run bookkeeping
    run_dir: str = option("runs/retool", "where the run writes metrics, trajectories and checkpoints")
    run_name: str | None = option(None, "name for remote metric sinks (default: run folder name)")
    save_every: int = option(50, "checkpoint every N steps (and at the last step)")
    save_trajectories: bool = option(False, "write every trajectory of every step (gzip JSONL)")
    sinks: tuple[str, ...] = option(("jsonl",), "metric sinks: jsonl,swanlab,wandb,tensorboard")
    seed: int = option(42, "seed of data order, adapter init and sampling")
    max_retries: int = option(2, "retries of a failed rollout before the run stops")
    weight_sync_check_every: int = option(1, "after the sampler swap of every N-th step, check that the sampler's "
                                             "logprobs of a fixed probe equal the trainer's and moved with it "
                                             "(retool/weight_sync.py; 0 = off)")
    weight_sync_tolerance: float | None = option(None, "max |sampler - trainer logprob| the check allows; none = "
                                                       "the engine's (1e-3 in float32, 1.0 in bfloat16 or with "
                                                       "a bf16 sampler on float32 weights, 0.25 on a service)")

    def validate(self) -> None:
        self.validate_settings()
        self.validate_cost()
        try:
            check_sinks(self.sinks)
        except (ValueError, RuntimeError) as err:
            raise ConfigError(str(err)) from None
        check_supported(self.engine, self.requirements())

    def validate_settings(self) -> None:
        """The rules between the settings themselves (``retool verl-config`` shares them);
        :meth:`validate` adds what this machine must offer: sinks, engine, price table."""
        for name in ("batch_size", "group_size", "max_steps", "save_every"):
            require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        self.validate_model()
        self.validate_budgets()
        require(self.group_size >= 2, f"group_size must be >= 2 for group-centred advantages, got {self.group_size}")
        require(self.max_turn_tokens < self.max_trajectory_tokens,
                "max_turn_tokens must be smaller than max_trajectory_tokens")
        require(0 < self.clip_low <= 1 <= self.clip_high, f"need 0 < clip_low <= 1 <= clip_high, got "
                f"{self.clip_low}, {self.clip_high}")
        require(self.dual_clip is None or self.dual_clip > 1, "dual_clip must be > 1 (or none)")
        require(self.lr > 0 and 0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "invalid Adam settings")
        require(self.temperature > 0 and 0 < self.top_p <= 1, "temperature must be > 0 and top_p in (0, 1]")
        require(self.max_retries >= 0, "max_retries must be >= 0")
        require(self.weight_sync_check_every >= 0,
                f"weight_sync_check_every must be >= 0, got {self.weight_sync_check_every}")
        require(self.weight_sync_tolerance is None or self.weight_sync_tolerance > 0,
                "weight_sync_tolerance must be > 0 (or none)")
        require(self.refill_rounds >= 0, f"refill_rounds must be >= 0, got {self.refill_rounds}")
        require(self.max_staleness >= 0, f"max_staleness must be >= 0, got {self.max_staleness}")
        require(not (self.max_staleness and self.stream_groups),
                "--stream-groups with --max-staleness > 0 is not supported; use one of them")
        require(self.curriculum in curriculum.CURRICULA,
                f"curriculum must be one of {', '.join(curriculum.CURRICULA)}, got {self.curriculum!r}")
        require(0 < self.curriculum_floor <= 1, f"curriculum_floor must be in (0, 1], got {self.curriculum_floor}")
        require(self.advantage != "passk" or 1 <= self.passk < self.group_size,
                f"--passk must be in [1, group_size) = [1, {self.group_size}), got {self.passk}")
        require(self.overlong_buffer >= 1, f"overlong_buffer must be >= 1, got {self.overlong_buffer}")
        require(0 <= self.lr_min_ratio <= 1, f"lr_min_ratio must be in [0, 1], got {self.lr_min_ratio}")
        require(0 <= self.invalid_call_penalty <= 2,
                f"invalid_call_penalty must be in [0, 2] (rewards are +-1), got {self.invalid_call_penalty}")
        require(self.kl_coef >= 0, f"kl_coef must be >= 0, got {self.kl_coef}")
        require(self.behaviour_is_cap > 1 and self.behaviour_is_threshold > 1,
                "behaviour_is_cap and behaviour_is_threshold must be > 1")

    def requirements(self) -> Requirements:
        """What this run asks of its engine (checked against the engine's capabilities)."""
        return Requirements(full_finetune=self.full_finetune, loss=self.loss, dual_clip=self.dual_clip is not None,
                            behaviour_is=self.behaviour_is != "off",
                            packing=self.packing, train_top_p=self.top_p, train_temperature=self.temperature,
                            resume=True, weight_sync=self.weight_sync_check_every > 0,
                            stream_groups=self.stream_groups, max_staleness=self.max_staleness > 0,
                            kl_anchor=self.kl_coef > 0)


class StepError(RuntimeError):
    """A training step failed; the message names the step and what failed."""


Group = list[Trajectory]
"""One problem's trajectories, sampled together (a GRPO group), as the rollout returns them."""

Advantaged = tuple[Group, tuple[float, ...]]
"""A group and the advantage of each of its trajectories."""

GroupCallback = Callable[[int, int, Group], None]
"""Told ``(round, position, group)`` as each group of a rollout ends."""


# ---------------------------------------------------------------- one step


@dataclass
class GradeClock:
    """The rollout's grader, timed. Each trajectory is graded as it ends (in a thread,
    overlapped with the other trajectories' sampling); :meth:`take` gives the step's
    ``time/grade`` (those calls' seconds, summed) and ``time/grade_max`` (the longest one:
    the last trajectory's grading holds the step). Groups reused on a resume add nothing."""

    grader: Grader
    seconds: float = 0.0
    longest: float = 0.0

    async def __call__(self, response: str, gold: str) -> Grade:
        start = time.monotonic()
        try:
            return await self.grader(response, gold)
        finally:
            elapsed = time.monotonic() - start
            self.seconds += elapsed
            self.longest = max(self.longest, elapsed)

    def take(self) -> dict[str, float]:
        """The grading figures since the last call; resets them."""
        figures = {"time/grade": self.seconds, "time/grade_max": self.longest}
        self.seconds = self.longest = 0.0
        return figures


class TrajectoryWriter:
    """Writes each step's trajectories file (``--save-trajectories``) on one background
    thread, in step order, so the next step's sampler is asked for at once instead of after
    ~4 MB of JSON and gzip. :meth:`join` waits for every write and raises the first that
    failed; the trainer joins before each checkpoint (a checkpoint never precedes the files
    of its steps, so a resume finds every file up to it) and when the run ends."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="retool-trajectories")
        self._pending: list[Future[Path]] = []

    def submit(self, run_dir: Path, step: int, groups: list[Advantaged]) -> None:
        self._pending.append(self._pool.submit(runs.save_trajectories, run_dir, step, groups))

    def join(self) -> None:
        pending, self._pending = self._pending, []
        for write in pending:
            write.result()

    def close(self) -> None:
        """:meth:`join`, then stop the thread (also when a write failed)."""
        try:
            self.join()
        finally:
            self._pool.shutdown()


@dataclass
class Trainer:
    """The objects a run holds: config, engine, rollout, problems, counters."""

    config: TrainConfig
    engine: TrainingClient
    rollout: Rollout
    problems: list[Problem]
    sandbox: Sandbox | None
    """The code sandbox (``None`` in text mode)."""
    cost: CostMeter | None = None
    """The cost meter when the run has a ``--price-table``."""
    totals: dict[str, float] = dataclasses.field(default_factory=lambda: {
        "tokens/prefill_total": 0.0, "tokens/sampled_total": 0.0, "tokens/trained_total": 0.0,
        "sandbox/cpu_s_total": 0.0})
    store: runs.GroupStore | None = None
    """Finished groups of the step in progress, kept for a mid-step resume (``None``: not kept)."""
    reused_groups: int = 0
    pool: curriculum.PoolState | None = None
    """The difficulty pool's state with ``--curriculum difficulty`` (``None``: no curriculum)."""
    weight_sync: WeightSyncGuard | None = None
    """Checks each swapped sampler against the trainer (``None``: ``--weight-sync-check-every 0``)."""
    pipeline: pipeline.Pipeline[Ahead] | None = None
    """Rolls out later steps while this one trains (``None``: ``--max-staleness 0``)."""
    weight_version: int | None = None
    """The weight version this trainer's rollouts record (``None``: the step's own)."""
    grading: GradeClock | None = None
    """The rollout's timed grader (``time/grade``; ``None``: not timed)."""
    writer: TrajectoryWriter = dataclasses.field(default_factory=TrajectoryWriter)
    """Writes the trajectories files in the background (``save_trajectories``)."""

    def __post_init__(self) -> None:
        if self.config.curriculum == "difficulty" and self.pool is None:
            self.pool = curriculum.PoolState()

    def reuse(self, stored: runs.StoredGroup) -> None:
        """Count a group an interrupted run finished as if it had been sampled now."""
        self.rollout.usage.add(stored.usage)
        if self.sandbox is not None:
            self.sandbox.record_outcomes([(turn.exchange.result, turn.exchange.latency_s)
                                          for t in stored.trajectories for turn in t.turns
                                          if turn.exchange is not None and turn.exchange.result is not None])
        self.reused_groups += 1

    def run_step(self, step: int) -> dict[str, float]:
        """:func:`train_step`, then what the run keeps of it: its cost (with a price table),
        its trajectories (with ``save_trajectories``); the step's stored groups are dropped."""
        metrics, groups = train_step(self, step)
        if self.cost is not None:
            metrics.update(self.cost.charge(metrics, self.totals))
        if self.config.save_trajectories:
            self.writer.submit(Path(self.config.run_dir), step, groups)
        if self.store is not None and self.pipeline is None:  # pipelined: kept until a checkpoint covers them
            self.store.clear(step)
        return metrics

    def checkpoint_state(self, step: int) -> runs.TrainerState:
        """The state a checkpoint after ``step`` saves; every trajectories file up to it is written first.
        With ``--max-staleness`` the rollouts ahead go on: :meth:`checkpoint_ready` says when they are stored."""
        self.writer.join()
        pool = self.pool.to_json() if self.pool is not None else None
        sync = self.weight_sync.state() if self.weight_sync is not None else None
        return runs.TrainerState(step, step * self.config.batch_size, dict(self.totals), pool, sync)

    def checkpoint_ready(self, step: int, wait: bool) -> bool:
        """Whether the checkpoint after ``step`` can be resumed from: with ``--max-staleness``,
        once every group of the steps sampled ahead of it (with older weights) is stored;
        with ``wait``, after waiting for the rollouts in flight."""
        if self.pipeline is None:
            return True
        if wait:
            self.pipeline.drain()
        ahead = self.pipeline  # steps step+1 .. step+K, submitted by the end of step: sampled with older weights
        return ahead.ended(min(step + ahead.max_staleness, ahead.last_step))

    def checkpoint_listed(self, step: int) -> None:
        """The checkpoint after ``step`` is listed: drop the stored groups no resume can need (steps up to it)."""
        if self.store is not None and self.pipeline is not None:
            self.store.clear_through(step)

    def restore_state(self, state: runs.TrainerState) -> None:
        self.totals.update(state.totals)
        if self.pool is not None and state.curriculum is not None:
            self.pool = curriculum.PoolState.from_json(state.curriculum)
        if self.weight_sync is not None and state.weight_sync is not None:
            self.weight_sync.restore(state.weight_sync)

    def choose(self, step: int, round_: int, count: int, taken: list[int]) -> list[int]:
        """The problems of rollout round ``round_`` of ``step`` (0 = the batch, then refills)."""
        cfg, n = self.config, len(self.problems)
        if self.pool is not None:
            return curriculum.draw(self.pool, self.problems, count, seed=cfg.seed, step=step, round_=round_,
                                   floor=cfg.curriculum_floor, exclude=taken)
        if round_ == 0:
            return runs.batch_indices(step, cfg.batch_size, n, cfg.seed)
        return runs.refill_indices(step, round_, count, n, cfg.seed)


def train_step(trainer: Trainer, step: int) -> tuple[dict[str, float], list[Advantaged]]:
    """Run one RL step; return its metrics and the trajectory groups (with advantages).

    The stages are the numbered statements below, in order; each detail is one call away.
    """
    cfg, t0 = trainer.config, time.monotonic()
    if trainer.pipeline is not None:  # --max-staleness K: stages 1-2 ran ahead, up to K steps ago
        trainer, groups, refills, sync_metrics = _rolled_out_ahead(trainer, step)
        t_rollout = time.monotonic() - t0
    else:
        # 1. batch: the step's problems (a seeded shuffle per epoch, or the difficulty curriculum)
        batch = trainer.choose(step, 0, cfg.batch_size, [])
        # 2. rollout: a group of trajectories per problem, sampled on the current weights; with
        #    --refill-rounds, groups of fresh problems while too few are informative (dynamic sampling);
        #    first the weight-sync guard checks that sampler against the trainer (retool/weight_sync.py)
        sampler, sync_metrics = _checked_sampler(trainer, step)
        if cfg.stream_groups:  # stages 2-6 overlapped: each group trained as soon as it ends
            metrics, groups_and_advantages = _streamed_step(trainer, sampler, step, batch, t0)
            return {**metrics, **sync_metrics}, groups_and_advantages
        groups, refills = _roll_out(trainer, sampler, step, batch)
        t_rollout = time.monotonic() - t0
    # 3. reward: each trajectory was graded as it ended (the rollout's grader, retool.reward.agrade);
    #    --overlong soft adds its length penalty here, --invalid-call-penalty its penalty for broken calls
    rewards_BG, metrics = _shaped_rewards(cfg, groups)
    degenerate_B = [algo.is_degenerate(rewards_G) for rewards_G in rewards_BG]
    # 4. advantages: rewards centred in each group (--advantage passk: pass@k-aware rewards first)
    advantages_BG = [_advantages(cfg, rewards_G) for rewards_G in rewards_BG]
    # 5. datums: the advantage on the policy's tokens, weight 0 on prompt, template and interpreter
    #    tokens; groups of equal rewards dropped with --drop-degenerate-groups or refills
    trained = _trained_groups(cfg, groups, advantages_BG, degenerate_B)
    datums = _datums(cfg, trained)
    anchor_tally: list[tuple[float, int, float]] = []
    datums = _anchored(trainer, datums, anchor_tally)  # --kl-coef: the penalty toward the starting policy
    metrics.update(_anchor_metrics(anchor_tally))
    # 6. update: forward_backward with the policy loss, then one Adam step
    t1 = time.monotonic()
    metrics.update(_update(trainer, step, datums))
    t_train = time.monotonic() - t1
    # 7. log: reward, rollout, sandbox and token figures, running totals, timings
    metrics.update(_step_metrics(trainer, groups, degenerate_B, datums, len(trained), refills))
    metrics.update({"time/rollout": t_rollout, "time/train": t_train, "time/step": time.monotonic() - t0,
                    **sync_metrics})
    return metrics, list(zip(groups, advantages_BG))


def _streamed_step(trainer: Trainer, sampler: SamplingClient, step: int, batch: list[int],
                   t0: float) -> tuple[dict[str, float], list[Advantaged]]:
    """:func:`train_step` from stage 2 on with ``--stream-groups`` (:mod:`retool.streaming`):
    as each group ends, its reward, advantages and datums (stages 3-5), and its
    forward_backward in rollout order while later groups still roll out; one optim_step
    once every group has ended (stage 6). Then stages 3-5 once more over the whole batch
    for the log (the same datums, unscaled) and stage 7 as in the synchronous step."""
    cfg = trainer.config
    divisor = streaming.token_divisor(cfg.batch_size, cfg.group_size, _policy_budget(cfg, None))
    anchor_tally: list[tuple[float, int, float]] = []
    with streaming.StreamedUpdate(trainer.engine, cfg.loss, _loss_config(cfg), divisor,
                                  lambda group: _group_datums(trainer, group, anchor_tally)) as stream:
        groups, refills = _roll_out(trainer, sampler, step, batch, on_group=stream.add)
        t_rollout = time.monotonic() - t0
        try:
            update = stream.finish(_adam(cfg, step))
        except (FloatingPointError, RuntimeError, ValueError) as err:  # non-finite loss/inputs, OOM
            raise _update_failed(step, err) from err
    t_train = time.monotonic() - t0 - t_rollout
    rewards_BG, metrics = _shaped_rewards(cfg, groups)
    degenerate_B = [algo.is_degenerate(rewards_G) for rewards_G in rewards_BG]
    advantages_BG = [_advantages(cfg, rewards_G) for rewards_G in rewards_BG]
    trained = _trained_groups(cfg, groups, advantages_BG, degenerate_B)
    datums = _datums(cfg, trained)
    if update:
        metrics.update({**update, "train/sampler_nll": algo.sampler_nll(datums), **_anchor_metrics(anchor_tally)})
    metrics.update(_step_metrics(trainer, groups, degenerate_B, datums, len(trained), refills))
    metrics.update({"time/rollout": t_rollout, "time/train": t_train, "time/step": time.monotonic() - t0})
    return metrics, list(zip(groups, advantages_BG))


@dataclass(frozen=True)
class Ahead:
    """One step's rollout, done ahead by the pipeline (``--max-staleness``)."""

    trainer: Trainer
    """The trainer the rollout ran on: the run's, with the step's own token meter, weight
    version and difficulty pool (after this step's groups)."""
    groups: list[Group]
    refills: int
    seconds: float
    """How long the rollout took."""


def _rolled_out_ahead(trainer: Trainer, step: int) -> tuple[Trainer, list[Group], int, dict[str, float]]:
    """Stages 1-2 with ``--max-staleness K`` (:mod:`retool.pipeline`): a sampler that keeps
    this step's weights is checked by the weight-sync guard and given the rollout of step
    ``step + K``; then this step's rollout, done up to ``K`` steps ago, is taken. Returns
    the trainer that rollout ran on (stages 3-7 log its token usage), the groups, the
    refill rounds and the guard's metrics, with ``time/rollout_ahead`` (the rollout's own
    time) and ``time/rollout_wait`` (how long the trainer waited for it)."""
    sampler, sync_metrics = _checked_sampler(trainer, step)
    t0 = time.monotonic()
    ahead = trainer.pipeline.advance(step, lambda later, version, before: _roll_out_ahead(
        before.trainer if before is not None else trainer, sampler, later, version))
    waited = time.monotonic() - t0
    trainer.pool = ahead.trainer.pool  # what a checkpoint after this step saves
    flat = [t for g in ahead.groups for t in g]
    pipeline.check_within(step, flat, trainer.config.max_staleness)
    extra = {**sync_metrics, **pipeline.staleness_metrics(step, flat, trainer.config.max_staleness),
             "time/rollout_wait": waited, "time/rollout_ahead": ahead.seconds}
    return ahead.trainer, ahead.groups, ahead.refills, extra


def _roll_out_ahead(before: Trainer, sampler: SamplingClient, step: int, version: int) -> Ahead:
    """Stages 1-2 of ``step`` on a pipeline worker thread, on ``sampler`` (weights
    ``version``), from ``before``: the run's trainer, or with the difficulty pool the
    trainer the previous step's rollout ran on (its pool after that rollout)."""
    t0 = time.monotonic()
    view = copy.copy(before)
    view.rollout = dataclasses.replace(before.rollout)  # a fresh token meter: this step's own usage
    view.weight_version, view.reused_groups = version, 0
    batch = view.choose(step, 0, view.config.batch_size, [])
    groups, refills = _roll_out(view, sampler, step, batch)
    return Ahead(view, groups, refills, time.monotonic() - t0)


def _group_datums(trainer: Trainer, group: Group, anchor_tally: list[tuple[float, int, float]]) -> list[Datum]:
    """Stages 3-5 for one group: the datums it adds to the update (none when dropped);
    ``--kl-coef``'s figures of them appended to ``anchor_tally``."""
    cfg = trainer.config
    (rewards_G,), _ = _shaped_rewards(cfg, [group])
    advantages_G = _advantages(cfg, rewards_G)
    datums = _datums(cfg, _trained_groups(cfg, [group], [advantages_G], [algo.is_degenerate(rewards_G)]))
    return _anchored(trainer, datums, anchor_tally)


# ---------------------------------------------------------------- the stages' details


def _checked_sampler(trainer: Trainer, step: int) -> tuple[SamplingClient, dict[str, float]]:
    """The step's sampler (:func:`_current_sampler`) and the weight-sync guard's metrics
    of it (``{}`` without a guard)."""
    sampler = _current_sampler(trainer, step)
    return sampler, trainer.weight_sync.check(step, trainer.engine, sampler) if trainer.weight_sync else {}


def _current_sampler(trainer: Trainer, step: int) -> SamplingClient:
    """A sampler on the weights of the last update (a service engine loads them here, e.g. a
    vLLM server's adapter swap)."""
    try:
        if trainer.pipeline is not None:  # its weights must stay while training goes on
            return pipeline.frozen_sampler(trainer.engine)
        return trainer.engine.save_weights_for_sampler()
    except (RuntimeError, OSError) as err:
        raise StepError(f"step {step}: the sampler could not get the current weights: {err}") from err


def _roll_out(trainer: Trainer, sampler: SamplingClient, step: int, batch: list[int], *,
              on_group: GroupCallback | None = None) -> tuple[list[Group], int]:
    """The step's trajectory groups, and how many refill rounds it took.

    First a group for each problem of ``batch``; then, with ``refill_rounds``, up to that
    many rounds of fresh problems while fewer than ``batch_size`` groups are informative
    (DAPO's dynamic sampling; informative: the rewards the update sees differ, penalties
    included). The resume plumbing sits here too: groups an interrupted run
    of this step finished are reused (said once on stderr), and the ``after_rollout``
    failpoint may end the process (:func:`runs.failpoint`). ``on_group(round, position,
    group)`` is called as each group ends (or is reused).
    """
    cfg = trainer.config
    groups = _rollout_round(trainer, sampler, step, 0, batch, on_group)
    taken, rounds = list(batch), 0
    while rounds < cfg.refill_rounds:
        missing = _missing_groups(cfg, groups)
        if missing <= 0:
            break
        rounds += 1
        refill = trainer.choose(step, rounds, missing, taken)
        taken += refill
        groups += _rollout_round(trainer, sampler, step, rounds, refill, on_group)
    if trainer.reused_groups:
        print(f"step {step}: reused {trainer.reused_groups} trajectory group(s) that an interrupted run had "
              "finished; rolled out the rest", file=sys.stderr)
        trainer.reused_groups = 0
    runs.failpoint("after_rollout", step)
    return groups, rounds


def _missing_groups(cfg: TrainConfig, groups: list[Group]) -> int:
    """How many more groups a step needs for ``batch_size`` informative ones: groups whose rewards
    differ, penalties included (the ones the update learns from)."""
    return cfg.batch_size - len(groups) + algo.count_degenerate_groups(_shaped_rewards(cfg, groups)[0])


def _rollout_round(trainer: Trainer, sampler: SamplingClient, step: int, round_: int,
                   chosen: list[int], on_group: GroupCallback | None) -> list[Group]:
    """Roll out a group for each problem ``chosen`` (indices) in rollout round ``round_``
    (0 = the batch, then refills), and record the groups in the difficulty pool (when on)."""
    problems = [trainer.problems[i] for i in chosen]
    groups = _rollout_with_retries(trainer, problems, step, round_, sampler=sampler, on_group=on_group)
    if trainer.pool is not None:
        trainer.pool = curriculum.record(trainer.pool, problems, _rewards(groups))
    return groups


def _rollout_with_retries(trainer: Trainer, problems: list[Problem], step: int, round_: int, *,
                          sampler: SamplingClient | None, on_group: GroupCallback | None = None) -> list[Group]:
    """The groups of ``problems``, retrying a rollout that failed transiently up to
    ``max_retries`` times; any other failure is a :class:`StepError` at once."""
    for attempt in range(trainer.config.max_retries + 1):
        try:
            return asyncio.run(_rollout_groups(trainer, sampler, problems, step, round_, on_group))
        except RolloutError as err:
            if not err.transient:
                raise StepError(f"step {step}: rollout failed: {err}") from err
            if attempt == trainer.config.max_retries:
                raise StepError(f"step {step}: rollout failed after {attempt + 1} attempt(s): {err}") from err
            print(f"step {step}: rollout failed ({err}); retrying ({attempt + 1}/{trainer.config.max_retries})",
                  file=sys.stderr)
    raise AssertionError("unreachable")


async def _rollout_groups(trainer: Trainer, sampler: SamplingClient | None, problems: list[Problem], step: int,
                          round_: int, on_group: GroupCallback | None = None) -> list[Group]:
    """One group per problem, all at once, in the order of ``problems``.

    Every group is seeded from (run seed, step, round, position), so it is the same
    whenever and with whatever else it is rolled out. With a :class:`runs.GroupStore`,
    a group an interrupted run of this step already finished is reused (its token usage
    and sandbox outcomes counted as if sampled now), and each new group is kept as it
    finishes. Every group is handed to ``on_group`` (when given) as it ends.
    """

    async def one(index: int, problem: Problem) -> Group:
        group = await _group(trainer, sampler, problem, runs.GroupKey(step, round_, index, problem.id))
        if on_group is not None:
            on_group(round_, index, group)
        return group

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(problems))))


async def _group(trainer: Trainer, sampler: SamplingClient | None, problem: Problem, key: runs.GroupKey) -> Group:
    """The group of ``key``: the one an interrupted run stored, or a new one (then stored)."""
    stored = trainer.store.load(key) if trainer.store is not None else None
    if stored is not None:
        trainer.reuse(stored)
        return list(stored.trajectories)
    usage, cfg = UsageMeter(), trainer.config
    group = await trainer.rollout.group(problem, cfg.group_size, sampler=sampler,
                                        seed=derive_seed(cfg.seed, key.step, key.round, key.index), usage=usage,
                                        weight_version=key.step if trainer.weight_version is None
                                        else trainer.weight_version)
    if trainer.store is not None:
        trainer.store.save(key, group, usage.total)
        runs.failpoint("group_saved", key.step)
    return group


def _rewards(groups: list[Group]) -> list[list[float]]:
    """The rewards of every trajectory, group by group."""
    return [[t.grade.reward for t in g] for g in groups]


def _shaped_rewards(cfg: TrainConfig, groups: list[Group]) -> tuple[list[list[float]], dict[str, float]]:
    """The rewards advantages are computed from (``--overlong soft`` and ``--invalid-call-penalty``
    add their penalties), and how many trajectories each touched."""
    flat = [t for g in groups for t in g]
    truncated = sum(1 for t in flat if algo.is_truncated(t))
    metrics = {"rollout/truncated": float(truncated)}
    if cfg.overlong == "mask":
        metrics["train/overlong_masked"] = float(truncated)
    rewards_BG = _rewards(groups)
    if cfg.overlong == "soft":
        penalties_BG = [[algo.overlong_penalty(algo.policy_tokens(t), _policy_budget(cfg, t), cfg.overlong_buffer)
                         for t in g] for g in groups]
        flat_penalties = [p for penalties_G in penalties_BG for p in penalties_G]
        metrics["train/overlong_penalised"] = float(sum(1 for p in flat_penalties if p < 0))
        metrics["train/overlong_penalty_mean"] = sum(flat_penalties) / len(flat_penalties)
        rewards_BG = [[r + p for r, p in zip(rewards_G, penalties_G)]
                      for rewards_G, penalties_G in zip(rewards_BG, penalties_BG)]
    if cfg.invalid_call_penalty:
        broken_BG = [[t.num_invalid_calls > 0 for t in g] for g in groups]
        metrics["train/invalid_call_penalised"] = float(sum(sum(broken_G) for broken_G in broken_BG))
        rewards_BG = [[r - cfg.invalid_call_penalty * broken for r, broken in zip(rewards_G, broken_G)]
                      for rewards_G, broken_G in zip(rewards_BG, broken_BG)]
    return rewards_BG, metrics


def _policy_budget(cfg: TrainConfig, trajectory: Trajectory | None) -> int:
    """The most policy tokens ``trajectory`` could hold (``None``: any, an empty prompt's)."""
    return algo.policy_token_budget(cfg.max_trajectory_tokens, cfg.max_turn_tokens, cfg.max_assistant_turns,
                                    trajectory.prompt_len if trajectory is not None else 0)


def _advantages(cfg: TrainConfig, rewards_G: list[float]) -> tuple[float, ...]:
    if cfg.advantage == "passk":
        rewards_G = list(algo.passk_rewards(rewards_G, cfg.passk))
    return algo.group_advantages(rewards_G, cfg.normalize_std)


def _trained_groups(cfg: TrainConfig, groups: list[Group], advantages_BG: list[tuple[float, ...]],
                    degenerate_B: list[bool]) -> list[Advantaged]:
    """``(group, advantages)`` of the groups the update sees: all of them, unless groups of equal
    rewards are dropped (``--drop-degenerate-groups``, or any refill rounds)."""
    drop = cfg.drop_degenerate_groups or cfg.refill_rounds > 0
    return [(g, a) for g, a, degenerate in zip(groups, advantages_BG, degenerate_B) if not (drop and degenerate)]


def _datums(cfg: TrainConfig, trained: list[Advantaged]) -> list[Datum]:
    """One datum per trajectory with a trained token (``--overlong mask``: truncated ones left out)."""
    datums = [algo.trajectory_datum(t, a) for g, advantages_G in trained for t, a in zip(g, advantages_G)
              if not (cfg.overlong == "mask" and algo.is_truncated(t))]
    return [d for d in datums if d.num_trained > 0]


def _anchored(trainer: Trainer, datums: list[Datum], tally: list[tuple[float, int, float]]) -> list[Datum]:
    """``--kl-coef``: ``datums`` with the penalty toward the starting policy in their advantages
    (:func:`algo.kl_anchored`; the engine scores them under the weights it kept at the start);
    ``(log-ratio sum, trained tokens, seconds)`` of that appended to ``tally`` for
    :func:`_anchor_metrics`. ``datums`` as they are without it."""
    coef = trainer.config.kl_coef
    if not coef or not datums:
        return datums
    t0 = time.monotonic()
    reference_D = trainer.engine.reference_logprobs(datums, trainer.config.temperature)
    anchored = [algo.kl_anchored(d, reference_N, coef) for d, reference_N in zip(datums, reference_D)]
    tally.append((sum(gap for _, gap, _ in anchored), sum(count for _, _, count in anchored), time.monotonic() - t0))
    return [d for d, _, _ in anchored]


def _anchor_metrics(tally: list[tuple[float, int, float]]) -> dict[str, float]:
    """``train/kl_reference`` (the trained tokens' mean sampler - reference log-ratio, an estimate
    of KL(sampler || reference)) and ``time/reference`` (the scoring's seconds); ``{}`` when
    nothing was scored."""
    if not tally:
        return {}
    tokens = sum(count for _, count, _ in tally)
    return {"train/kl_reference": sum(gap for gap, _, _ in tally) / max(tokens, 1),
            "time/reference": sum(seconds for _, _, seconds in tally)}


def _update(trainer: Trainer, step: int, datums: list[Datum]) -> dict[str, float]:
    """forward_backward and optim_step on ``datums`` (nothing without any); their metrics.

    A non-finite loss or gradient (or an out-of-memory error) stops the run with a
    :class:`StepError` and the update not applied."""
    if not datums:
        return {}
    cfg = trainer.config
    fb_future = trainer.engine.submit_forward_backward(datums, cfg.loss, _loss_config(cfg))
    opt_future = trainer.engine.submit_optim_step(_adam(cfg, step))  # taken before the first is done, as services allow
    try:
        fb, opt = fb_future.result(), opt_future.result()
    except (FloatingPointError, RuntimeError, ValueError) as err:  # non-finite loss/inputs, OOM
        raise _update_failed(step, err) from err
    return {**fb.metrics, **opt.metrics, "train/sampler_nll": algo.sampler_nll(datums)}


def _adam(cfg: TrainConfig, step: int) -> AdamParams:
    """Step ``step``'s optimiser settings (the learning rate by ``--lr-schedule``)."""
    lr = algo.scheduled_lr(cfg.lr, step, cfg.max_steps, cfg.lr_schedule, cfg.lr_min_ratio)
    return AdamParams(learning_rate=lr, beta1=cfg.beta1, beta2=cfg.beta2, weight_decay=cfg.weight_decay,
                      grad_clip_norm=cfg.grad_clip_norm)


def _update_failed(step: int, err: Exception) -> StepError:
    return StepError(f"step {step}: the update failed and was not applied ({type(err).__name__}: {err}); resume "
                     "from the last checkpoint after fixing the cause (e.g. a lower --lr or --micro-batch-tokens)")


def _loss_config(cfg: TrainConfig) -> dict[str, float]:
    out: dict[str, float] = {}
    if cfg.behaviour_is != "off":
        value = cfg.behaviour_is_threshold if cfg.behaviour_is == "token-mask" else cfg.behaviour_is_cap
        out[algo.BEHAVIOUR_IS_KEYS[cfg.behaviour_is]] = value
    if cfg.loss != "ppo":
        return out
    out.update({"clip_low_threshold": cfg.clip_low, "clip_high_threshold": cfg.clip_high})
    if cfg.dual_clip is not None:
        out["dual_clip"] = cfg.dual_clip
    return out


def _step_metrics(trainer: Trainer, groups: list[Group], degenerate_B: list[bool], datums: list[Datum],
                  trained_groups: int, refills: int) -> dict[str, float]:
    """The step's reward, rollout, behaviour, sandbox, curriculum and token figures; adds
    the step's tokens and sandbox CPU time to the running totals."""
    flat = [t for g in groups for t in g]
    usage = trainer.rollout.take_usage()
    trained = float(sum(d.num_trained for d in datums))
    metrics = rollout_metrics(flat)
    metrics.update({f"behaviour/{k}": v for k, v in behaviour_figures(trajectory_stats(flat)).items()})
    metrics.update(trainer.sandbox.metrics(reset=True) if trainer.sandbox is not None else {})
    metrics.update(trainer.grading.take() if trainer.grading is not None else {})
    _add_totals(trainer.totals, usage.prefill, usage.sampled, trained, metrics.get("sandbox/cpu_s", 0.0))
    if trainer.pool is not None:
        metrics.update(curriculum.pool_metrics(trainer.pool, trainer.problems, trainer.config.curriculum_floor))
    metrics.update({
        "rollout/degenerate_group_rate": sum(degenerate_B) / len(groups),
        "rollout/informative_group_rate": (len(groups) - sum(degenerate_B)) / len(groups),
        "train/datums": float(len(datums)),
        "train/groups": float(trained_groups),
        "rollout/groups": float(len(groups)), "rollout/refill_rounds": float(refills),
        "tokens/prefill": float(usage.prefill), "tokens/sampled": float(usage.sampled),
        "tokens/trained": trained, **trainer.totals,
    })
    return metrics


def _add_totals(totals: dict[str, float], prefill: int, sampled: int, trained: float, cpu_s: float) -> None:
    totals["tokens/prefill_total"] += prefill
    totals["tokens/sampled_total"] += sampled
    totals["tokens/trained_total"] += trained
    totals["sandbox/cpu_s_total"] = totals.get("sandbox/cpu_s_total", 0.0) + cpu_s


# ---------------------------------------------------------------- building a run


TRAIN_DATA_RECORD = "train_data.json"
"""The run folder's record of its training data: absolute path and sha256 (:func:`runs.data_fingerprint`)."""


@dataclass(frozen=True)
class CheckedInputs:
    """What :func:`check_inputs` read and found usable."""

    problems: list[Problem]
    fingerprint: dict[str, str]


def check_inputs(cfg: TrainConfig, *, resume: bool = False) -> CheckedInputs:
    """Check every input of a run before any model loads or any file is written: no other
    run in the folder (unless resuming), the ``--model`` folder, the data file (present, not
    empty, unchanged since the run started when resuming) and every gold answer.

    Raises :class:`ConfigError` or :class:`retool.data.DataError`, each one line that says
    what to fix.
    """
    runs.refuse_existing_run(Path(cfg.run_dir), resume=resume)
    try:
        data = read_problems(cfg.train_data)
    except DataError as err:
        raise ConfigError(f"--train-data {err}; give a JSONL/parquet file of problems "
                          "(`retool prepare-data` writes one) or a bundled set") from None
    runs.check_model_folder(cfg.model)
    fingerprint = runs.data_fingerprint(data.path)
    if resume:
        runs.check_same_data(Path(cfg.run_dir), TRAIN_DATA_RECORD, fingerprint)
    require_usable_golds(data.path, data.problems)
    return CheckedInputs(list(data.problems), fingerprint)


def build_trainer(cfg: TrainConfig, problems: list[Problem] | None = None) -> Trainer:
    """Load data (unless given), engine, renderer, sandbox and rollout for ``cfg``."""
    cost = cost_meter(cfg, cfg.engine, cfg.model)  # a bad price table fails before anything loads
    problems = load_problems(cfg.train_data) if problems is None else problems
    tools = cfg.mode == "retool"
    sandbox = cfg.start_sandbox() if tools else None  # before the model: strict refuses early
    try:
        engine = runs.load_engine(cfg, cfg.seed)
    except OSError as err:  # a model the engine cannot find or read: one line, not a traceback
        if sandbox is not None:
            sandbox.close()
        raise ConfigError(" ".join(str(err).split())) from err
    except BaseException:
        if sandbox is not None:
            sandbox.close()
        raise
    if cfg.kl_coef:  # the starting weights, before a resume loads its checkpoint: the same reference either way
        engine.keep_reference()
    renderer = Renderer(engine.get_tokenizer(), chat_template=cfg.chat_template, tools=tools, model_name=cfg.model,
                        interpreter=cfg.interpreter)
    # no sampler of its own: every step hands the rollout one on its current weights
    # (train_step), so none is made on untrained weights that a resume would replace at once
    grading = GradeClock(agrade)
    rollout = Rollout(renderer, None, sandbox, grading, cfg.rollout_config(temperature=cfg.temperature, top_p=cfg.top_p))
    store = runs.GroupStore(Path(cfg.run_dir), runs.run_fingerprint(cfg))
    guard = guard_for(cfg.engine, cfg.weight_sync_check_every, renderer, cfg.weight_sync_tolerance,
                      half_precision=_half_precision(cfg), bf16_sampler=_bf16_sampler(cfg))
    ahead = (pipeline.Pipeline[Ahead](cfg.max_staleness, cfg.max_steps, chained=cfg.curriculum == "difficulty")
             if cfg.max_staleness else None)  # chained: the pool passes from one step's rollout to the next
    return Trainer(cfg, engine, rollout, problems, sandbox, store=store, cost=cost, weight_sync=guard, pipeline=ahead,
                   grading=grading)


def _half_precision(cfg: TrainConfig) -> bool:
    """Whether a local trainer (``local``, ``vllm``) holds bfloat16 weights."""
    if cfg.engine not in ("local", "vllm"):
        return False
    from retool.engines.local.model import resolve_device, resolve_dtype  # torch: heavy, kept off retool train --help

    return str(resolve_dtype(cfg.dtype, resolve_device(cfg.device))) != "torch.float32"


def _bf16_sampler(cfg: TrainConfig) -> bool:
    """Whether the local engine's sampler decodes in bfloat16 (``--local-precision``) on
    float32 weights."""
    if cfg.engine != "local" or _half_precision(cfg):
        return False
    from retool.engines.local.lean_decode import resolve_precision  # torch: heavy, kept off retool train --help
    from retool.engines.local.model import resolve_device

    return resolve_precision(cfg.local.precision, resolve_device(cfg.device)) is not None


def train(cfg: TrainConfig, *, resume: bool = False) -> Path:
    """Run (or resume) RL training as configured; return the run folder."""
    run_dir = Path(cfg.run_dir)
    cfg = runs.with_absolute_paths(cfg)
    inputs = check_inputs(cfg, resume=resume)
    trainer = build_trainer(cfg, inputs.problems)
    ended: BaseException | None = None
    try:
        if not (resume and runs.latest_checkpoint(run_dir)):  # a resume takes its checkpoint's client instead
            getattr(trainer.engine, "start", lambda: None)()  # a service engine's run, refused before any file
        runs.create_run(run_dir, cfg)
        atomic_write_json(run_dir / TRAIN_DATA_RECORD, {**inputs.fingerprint, "problems": len(inputs.problems)})
        runs.run_steps(runs.StepLoop(
            run_dir, cfg, cfg.max_steps, trainer.engine, step=trainer.run_step,
            progress_fields=_progress_fields, checkpoint_state=trainer.checkpoint_state,
            restore_state=trainer.restore_state, checkpoint_ready=trainer.checkpoint_ready,
            checkpoint_listed=trainer.checkpoint_listed, stop=trainer.cost.stop_reason if trainer.cost else None),
            resume=resume)
    except BaseException as err:
        ended = err
        raise
    finally:
        try:
            trainer.writer.close()
        finally:
            if trainer.pipeline is not None:
                trainer.pipeline.close()
            close_training_client(trainer.engine, ended)
            if trainer.sandbox is not None:
                trainer.sandbox.close()
    return run_dir


def _progress_fields(metrics: Mapping[str, float]) -> dict[str, float]:
    fields = {"reward": metrics["reward/mean"], "correct": metrics["reward/correct"],
              "informative": metrics["rollout/informative_group_rate"],
              "tok_s": metrics["tokens/sampled"] / max(metrics.get("time/rollout_ahead", metrics["time/rollout"]),
                                                       1e-9)}
    if "cost/total" in metrics:
        fields["usd"] = metrics["cost/total"]
    return fields


# ---------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        description=__doc__.split("\n\n")[0] + " Flags override a --config TOML preset (configs/*.toml); "
        "every flag's default is the seed's configuration.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue the run in RUN_DIR from its last checkpoint (its saved config is used; "
                        "--max-steps may extend it, --max-cost raise its budget)")
    add_config_args(p, TrainConfig)
    p.set_defaults(func=_run_train_command)


def _run_train_command(args: argparse.Namespace) -> int:
    try:
        if args.resume:
            cfg = resumed_config(TrainConfig, args)
        else:
            cfg = config_from_args(TrainConfig, args)
        output_folder(cfg.run_dir, "--resume" if args.resume else "--run-dir")
        if cfg.engine == "vllm" and cfg.vllm.adapter_dir:  # the adapters the server hot-loads are written there
            output_folder(cfg.vllm.adapter_dir, "--vllm-adapter-dir")
        run_dir = train(cfg, resume=bool(args.resume))
    except (ConfigError, DataError, StepError, WeightSyncError, FileNotFoundError, SandboxUnavailableError,
            pipeline.StalenessError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"run folder: {run_dir}")
    return 0
