"""``retool demo``: the whole ReTool pipeline on a CPU, with a real small model, offline.

Stages (each one resumes if the demo is re-run with the same output folder):

1. data — the synthetic tool-worthy arithmetic task (:mod:`retool.tasks`): SFT
   dialogues with real sandbox outputs, RL problems and held-out test problems, three
   disjoint splits;
2. eval *before SFT* — the bundled SmolLM2-135M-Instruct zero-shot, tool on;
3. cold-start SFT (:mod:`retool.sft`) — LoRA on the tool dialogues;
4. eval *after SFT*;
5. RL (:mod:`retool.train`) — GRPO/PPO from the SFT adapter, code calls in the sandbox,
   problems drawn from the difficulty pool (``--curriculum difficulty``: fewer of the kinds,
   word-problem stories and problems whose recent groups were all right or all wrong);
6. eval *after RL*;
7. report — checkpoint comparison and training-curve plots (PNG + SVG), an HTML page of
   the after-RL trajectories, ``summary.json``/``summary.md`` and a printed table.

Every eval uses the same held-out problems, sampling settings and grader. The output
folder holds every stage's own run folder, so anything can be inspected or re-plotted.
Stages 2–6 each run in a process of their own (:mod:`retool.stage_process`), so the
memory one stage leaves resident is not carried under the next; the peak memory the demo
prints is the whole process tree's (stage processes, sandbox and grader processes).

The printed table and ``summary.md`` compare after RL with after SFT on the same held-out
problems, as ``retool compare`` does (difference, paired standard error, z, and whether
the gain exceeds two standard errors), so the reader can judge what RL bought. It also
gives the RL stage's informative share — the rolled-out groups with mixed rewards, the only
ones that teach — as "N of M groups informative".

Measured at these defaults (160 held-out problems x 1 sample, 8 RL steps x 4 problems, each
word-problem story a family of the difficulty pool, a tool response the model writes itself
sent back as an invalid call) on 2 cores of an AMD EPYC with AVX2 only (no native bf16: fp32
chosen by ``auto``), docs/demo.md recording every seed run, failures included, each named
before it ran: seed 42 in a fresh folder in 36.2 minutes, after SFT 75.0 % -> after RL
80.6 %, RL's gain +5.6 points at paired s.e. 2.4 (z 2.36, beyond two standard errors), 32 of
37 RL groups informative, peak memory 2.47 GiB for the process tree; seed 181 +5.0 (z 2.34),
137 +5.6 (z 2.36); seeds 191 and 193 within the noise (+1.9 and +4.4, z 0.69 and 1.53: each
lost one problem kind, its plans switched to another kind's expression, while gaining on
others). Every run's format and valid-call rate in its last two RL steps no lower than in
its first two, or within the noise; 28.4-36.2 minutes (51.7 in a slower session), peak
2.46-2.56 GiB. Before forged tool responses were sent back (a change in what is sampled), 13
of 15 seeds gained beyond two standard errors (docs/demo-history.md). On a CPU with native
bf16 (a Zen 4, an earlier version of the demo) it took 16.2-18.9 minutes.
Measured, never guaranteed: a seed can land within the noise.
Not covered: hub models (use ``retool train``/``retool eval`` with a preset).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from rich.console import Console
from rich.table import Table

from retool import tasks
from retool.algo import LR_SCHEDULES, PACKINGS
from retool.atomic import atomic_write_text
from retool.bundled import BundledModelMissing, resolve_model_name
from retool.config import ConfigError, add_config_args, config_from_args, make_config, option, require
from retool.curriculum import CURRICULA
from retool.engines.settings import TRAIN_PRECISIONS, LocalSettings
from retool.evaluate import EvalConfig, evaluate, format_behaviour
from retool.flag_checks import output_folder
from retool.log import read_metrics
from retool.protocol import INTERPRETERS, TemplateError
from retool.report import ReportInputError, plots, view
from retool.report.compare import compare, format_table
from retool.peak_rss import PeakRSS
from retool.results import EvalSummary
from retool.runs import latest_checkpoint
from retool.serialize import to_jsonable
from retool.sft import ConversationError, SFTConfig, sft
from retool.stage_process import StageDied, in_own_process
from retool.stats import proportion_difference
from retool.train import TrainConfig, train
from retool.weight_sync import WeightSyncError

T = TypeVar("T")

if TYPE_CHECKING:
    from retool.report.compare import Comparison

STAGES = ("before SFT", "after SFT", "after RL")


@dataclass
class DemoConfig:
    """Sizes of the CPU demo; ``--quick`` shrinks them to a few minutes' worth."""

    model: str = option("bundled:smollm2", "model to train (the bundled SmolLM2-135M-Instruct by default)")
    chat_template: str = option("hermes", "chat template (SmolLM2's own ignores tools, so Hermes)")
    output_dir: str = option("runs/demo", "where every stage writes; re-running resumes")
    quick: bool = option(False, "a smoke run of every stage in minutes: fewer dialogues, steps and eval "
                                      "problems — too small to show learning")
    seed: int = option(42, "seed of data, adapter init and sampling")
    sft_dialogues: int = option(400, "synthetic SFT dialogues")
    sft_steps: int = option(32, "SFT steps (16 left one seed's cold start too weak for RL to show a gain; "
                                "docs/demo-history.md)")
    sft_batch_size: int = option(4, "dialogues per SFT step")
    sft_lr: float = option(1e-3, "SFT learning rate (calibrated in docs/sft.md)")
    sft_recovery_share: float = option(0.0, "share of the SFT dialogues whose first call is a mistake (a real "
                                            "traceback, then 'I fix it' and the right call; the mistake is "
                                            "context, not trained on; stateless only; retool task-data "
                                            "--recovery-share)")
    rl_problems: int = option(400, "RL training problems")
    rl_steps: int = option(8, "RL steps (8 x 4 problems: the 32 groups of 16 x 2 in half the updates; on the "
                              "SFT folders of four seeds it gained +20.0/+6.9/+10.0/+4.4 where 16 x 2 gained "
                              "+16.2/+1.9/+12.5/+3.7, drifting less: docs/demo-history.md)")
    rl_batch_size: int = option(4, "problems per RL step")
    rl_group_size: int = option(8, "trajectories per problem (groups of 8 split into mixed rewards far more "
                                   "often than groups of 4: more informative groups per step)")
    rl_lr: float = option(1e-4, "RL learning rate (3e-4 eroded the call format in 10 steps)")
    rl_lr_schedule: str = option("constant", "RL learning rate over the steps (retool train --lr-schedule; cosine "
                                             "falls to 0.1 of --rl-lr at the last step)", choices=LR_SCHEDULES)
    rl_invalid_call_penalty: float = option(0.5, "subtracted from the reward of a rollout with a malformed tool "
                                                 "call (retool train --invalid-call-penalty; 0: outcome only, where "
                                                 "seed 83's RL broke one kind's calls and its all-wrong groups could "
                                                 "not teach them back, docs/demo-history.md)")
    rl_kl_coef: float = option(0.0, "anchor of the RL stage to the SFT policy (retool train --kl-coef): each trained "
                                    "token's advantage minus this x (sampler - SFT logprob); 0 = off")
    eval_problems: int = option(160, "held-out test problems (the paired s.e. of RL's gain shrinks with more; 64 "
                                         "x 2 left a +10.2-point gain at z 1.8; 192 took 0.4 min more per eval, "
                                         "docs/demo-history.md)")
    eval_samples: int = option(1, "samples per held-out problem (k of Average@k). For a fixed number of samples "
                                  "the paired s.e. of RL's gain is smallest at one sample each on more problems: "
                                  "192 x 1 costs what 96 x 2 did, with an s.e. 7-26 %% smaller on seven seeds "
                                  "(docs/demo-history.md)")
    base_eval_problems: int = option(32, "of those, how many the base model is evaluated on before SFT (it never "
                                         "calls the tool, so a few show it; the paired RL-vs-SFT comparison uses all)")
    max_turn_tokens: int = option(128, "tokens per assistant turn")
    max_trajectory_tokens: int = option(1024, "tokens per trajectory")
    max_code_calls: int = option(2, "code executions per trajectory")
    max_assistant_turns: int = option(3, "assistant turns per trajectory")
    packing: str = option("prefix-tree", "training micro-batch layout (see retool train --help; prefix-tree: a "
                                         "group's question and its samples' common opening run once)",
                          choices=PACKINGS)
    micro_batch_tokens: int = option(1280, "tokens per training micro-batch (the packed layouts: one row)")
    logprob_chunk_tokens: int = option(256, "training: output layer and log-softmax this many tokens at a time (the "
                                            "full logits of a 1,280-token micro-batch are 240 MB a copy); 0 = at once")
    gradient_checkpointing: bool = option(True, "training: recompute the layers' activations in the backward (the "
                                                "RL step's peak memory 5.2 -> 2.5 GiB with chunked logprobs, same "
                                                "gradients; docs/benchmarks.md)")
    train_precision: str = option("auto", "training arithmetic of the SFT and RL stages: fp32, bf16 (autocast over "
                                          "fp32 weights; ~2x faster steps on a CPU with native bf16, many times "
                                          "slower on one without) or auto (bf16 where the CPU or GPU has it "
                                          "natively, else fp32); see retool train --help and docs/train.md",
                                  choices=TRAIN_PRECISIONS)
    rl_prefix_once: bool = option(True, "RL training: the prompt every trajectory of a step shares runs once per "
                                        "forward_backward instead of once per micro-batch (the RL step 0.61x the "
                                        "FLOPs and time at the same peak; SFT gains nothing: docs/benchmarks.md)")
    rl_top_p: float = option(1.0, "nucleus sampling of the RL rollouts (1: the whole distribution; from one SFT "
                                  "adapter, groups of 8 were mixed for 14 of 16 problems at 1.0 against 8 of 16 at "
                                  "the evals' 0.7, docs/demo-history.md)")
    rl_refill_rounds: int = option(2, "dynamic sampling: extra rounds of fresh problems until a step's groups "
                                      "have mixed rewards (see retool train --help)")
    rl_curriculum: str = option("difficulty", "which RL problems a step draws: difficulty = fewer of the kinds, "
                                              "word-problem stories and problems whose recent groups were all "
                                              "right or all wrong; none = a seeded shuffle (see retool train "
                                              "--curriculum)",
                                choices=CURRICULA)
    rl_difficulty: str = option("", "harder RL problems per kind, kind=level,... or one level for all (0-2, each "
                                    "adds a digit to the operands; empty: level 0, the calibrated task; see "
                                    "retool task-data --difficulty)")
    interpreter: str = option("stateless", "stateless: every code call starts a fresh Python (the SFT dialogues "
                                           "make one call); stateful: one interpreter per trajectory keeps its "
                                           "variables (two-call dialogues that reuse them) — for every stage",
                              choices=INTERPRETERS)
    rl_save_every: int = option(0, "also keep an RL checkpoint every N steps (0: only the last)")
    rl_max_staleness: int = option(0, "RL samples step t + K while step t trains (--max-staleness of retool "
                                      "train; 0: sample, then train)")
    device: str = option("auto", "auto, cpu, cuda or cuda:N")
    dtype: str = option("auto", "auto (fp32 on CPU, bf16 on GPU), float32 or bfloat16")
    sampler_precision: str = option("auto", "number format the evals' and RL rollouts' sampler decodes in "
                                            "(--local-precision of retool eval/train): fp32; bf16 = half the "
                                            "sampler's weight and KV memory, faster on a CPU with native bf16; "
                                            "auto = bf16 where the CPU has it (avx512_bf16/AMX); training has "
                                            "its own --train-precision", choices=("fp32", "bf16", "auto"))
    eval_batch_kv_mb: int = option(384, "most memory the evals' running decode loop may hold in KV "
                                        "(--local-batch-kv-mb of retool eval; 0 = no bound): the peak of the demo's "
                                        "evals follows it, ~0.19 GiB per 128 MB; 384 against 256: the eval after "
                                        "SFT 0.92x the time, the same tokens; 512 0.84x, but its peak left no room "
                                        "under 3 GB for a runaway code call's 256 MiB (docs/demo.md)")
    sandbox_memory_mb: int = option(256, "memory one code call may allocate in the sandbox, MiB on top of the warm "
                                         "interpreter's (--sandbox-memory-mb of retool eval/train, 2048 there): "
                                         "the demo's peak counts the sandbox, and a runaway call the model wrote "
                                         "(2 ** 550 ** 782) held 1.5 GiB under 2048, taking one eval to 3.27 GiB; "
                                         "every call that ran to its end in the demo's recorded runs peaked at 78 "
                                         "MiB resident or less (docs/demo-history.md)")
    rl_spill_base: bool = option(True, "during RL rollouts, move the trainer's frozen layer matrices to a "
                                       "temporary file while the sampler decodes from its merged copy, and read "
                                       "them back for training (--local-spill-base of retool train: the same "
                                       "results, ~0.4 GB less at the RL stage's peak with fp32)")

    def validate(self) -> None:
        for name in ("sft_dialogues", "sft_steps", "sft_batch_size", "rl_problems", "rl_steps", "rl_batch_size",
                     "eval_problems", "eval_samples", "base_eval_problems", "max_turn_tokens", "max_trajectory_tokens",
                     "max_assistant_turns", "sandbox_memory_mb"):
            require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        require(self.rl_group_size >= 2, "rl_group_size must be >= 2")
        require(self.rl_kl_coef >= 0, f"rl_kl_coef must be >= 0, got {self.rl_kl_coef}")
        require(0 <= self.rl_invalid_call_penalty <= 2,
                f"rl_invalid_call_penalty must be in [0, 2], got {self.rl_invalid_call_penalty}")
        require(self.rl_max_staleness >= 0, f"rl_max_staleness must be >= 0, got {self.rl_max_staleness}")
        require(self.logprob_chunk_tokens >= 0, f"logprob_chunk_tokens must be >= 0, got {self.logprob_chunk_tokens}")
        require(self.rl_refill_rounds >= 0, f"rl_refill_rounds must be >= 0, got {self.rl_refill_rounds}")
        require(self.rl_save_every >= 0, f"rl_save_every must be >= 0, got {self.rl_save_every}")
        require(self.eval_batch_kv_mb >= 0, f"eval_batch_kv_mb must be >= 0, got {self.eval_batch_kv_mb}")
        require(self.rl_curriculum in CURRICULA, f"rl_curriculum must be one of {', '.join(CURRICULA)}")
        require(0 <= self.sft_recovery_share <= 1, f"sft_recovery_share must be in [0, 1], got "
                                                   f"{self.sft_recovery_share}")
        require(not self.sft_recovery_share or (self.interpreter == "stateless" and self.max_code_calls >= 2
                                                and self.max_assistant_turns >= 3),
                "sft_recovery_share needs --interpreter stateless, --max-code-calls >= 2 and "
                "--max-assistant-turns >= 3 (a mistaken call, the right one, the answer)")
        LocalSettings(precision=self.sampler_precision).validate()
        try:
            tasks.parse_difficulty(self.rl_difficulty)
        except ValueError as err:
            raise ConfigError(f"--rl-difficulty: {err}") from None

    def shrunk(self) -> "DemoConfig":
        """The ``--quick`` sizes."""
        if not self.quick:
            return self
        return dataclasses.replace(self, sft_dialogues=min(self.sft_dialogues, 96), sft_steps=min(self.sft_steps, 6),
                                   rl_problems=min(self.rl_problems, 64), rl_steps=min(self.rl_steps, 1),
                                   rl_batch_size=min(self.rl_batch_size, 2), eval_problems=min(self.eval_problems, 4),
                                   base_eval_problems=min(self.base_eval_problems, 4),
                                   eval_samples=min(self.eval_samples, 2))


# ---------------------------------------------------------------- stages


def _say(message: str) -> None:
    print(f"[demo] {message}", file=sys.stderr, flush=True)


IDENTITY = ("model", "seed", "interpreter", "rl_difficulty", "rl_max_staleness", "sft_recovery_share")
"""What the stored stages were made with; a change needs a new folder."""


def check_identity(cfg: DemoConfig, out: Path) -> None:
    """Record the model, seed and interpreter of a new output folder; refuse a re-run that changes them.

    Re-running resumes every finished stage, so a folder made with one seed or interpreter mode
    would otherwise silently mix its stages with another's.
    """
    path = out / "demo.json"
    mine = {name: getattr(cfg, name) for name in IDENTITY}
    if not path.exists():
        atomic_write_text(path, json.dumps(mine, indent=2) + "\n")
        return
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path} is unreadable ({err}); use another --output-dir") from None
    defaults = {f.name: f.default for f in dataclasses.fields(DemoConfig)}  # a folder made before a name was added
    changed = [f"--{name.replace('_', '-')} {stored.get(name, defaults[name])!r} → {mine[name]!r}"
               for name in IDENTITY if stored.get(name, defaults[name]) != mine[name]]
    require(not changed, f"{out} holds a demo made with other settings ({', '.join(changed)}); its stages would "
                         "be resumed, not redone: use another --output-dir")


def make_data(cfg: DemoConfig, out: Path) -> dict[str, Path]:
    """Write the three disjoint splits of the arithmetic task (skipped when present)."""
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    paths = {"sft": data / "sft.jsonl", "rl": data / "rl.jsonl", "test": data / "test.jsonl"}
    if not paths["rl"].exists():
        problems = tasks.make_problems(cfg.rl_problems, cfg.seed, "rl",
                                       difficulty=tasks.parse_difficulty(cfg.rl_difficulty))
        tasks.write_jsonl(paths["rl"], map(to_jsonable, problems))
    if not paths["test"].exists():
        tasks.write_jsonl(paths["test"], map(to_jsonable, tasks.make_problems(cfg.eval_problems, cfg.seed, "test")))
    if not paths["sft"].exists():
        _say(f"generating {cfg.sft_dialogues} SFT dialogues (tool outputs from the real sandbox)")
        tasks.write_jsonl(paths["sft"], tasks.make_sft_conversations(cfg.sft_dialogues, cfg.seed,
                                                                     interpreter=cfg.interpreter,
                                                                     recovery_share=cfg.sft_recovery_share))
    return paths


def run_eval(cfg: DemoConfig, out: Path, test_path: Path, label: str, checkpoint: Path | None,
             problems: int | None = None) -> EvalSummary:
    """Evaluate one stage on the first ``problems`` held-out problems (all by default); return its summary."""
    problems = min(problems or cfg.eval_problems, cfg.eval_problems)
    _say(f"eval {label}: {problems} problems x {cfg.eval_samples} samples")
    eval_cfg = make_config(
        EvalConfig, dataset=str(test_path), mode="retool", model=cfg.model, chat_template=cfg.chat_template,
        checkpoint=str(checkpoint) if checkpoint else None, label=label, val_n=cfg.eval_samples,
        max_turn_tokens=cfg.max_turn_tokens, max_trajectory_tokens=cfg.max_trajectory_tokens,
        max_code_calls=cfg.max_code_calls, max_assistant_turns=cfg.max_assistant_turns, seed=cfg.seed,
        interpreter=cfg.interpreter, sandbox_workers=4, sandbox_memory_mb=cfg.sandbox_memory_mb,
        concurrency=problems, device=cfg.device, dtype=cfg.dtype,
        local=LocalSettings(precision=cfg.sampler_precision, batch_kv_mb=cfg.eval_batch_kv_mb),
        limit=problems if problems < cfg.eval_problems else None, output=str(eval_path(out, label)))
    return evaluate(eval_cfg).summary


def run_sft(cfg: DemoConfig, out: Path, sft_path: Path) -> Path:
    """Cold-start SFT on the dialogues; returns the run folder (resumed if interrupted)."""
    run_dir = out / "sft"
    latest = latest_checkpoint(run_dir)
    if latest is not None and latest[0] >= cfg.sft_steps:
        return run_dir
    _say(f"SFT: {cfg.sft_steps} steps x {cfg.sft_batch_size} dialogues")
    sft_cfg = make_config(SFTConfig, model=cfg.model, chat_template=cfg.chat_template, data=str(sft_path),
                          batch_size=cfg.sft_batch_size, max_steps=cfg.sft_steps, lr=cfg.sft_lr,
                          max_seq_tokens=cfg.max_trajectory_tokens, packing=cfg.packing,
                          micro_batch_tokens=cfg.micro_batch_tokens, logprob_chunk_tokens=cfg.logprob_chunk_tokens,
                          gradient_checkpointing=cfg.gradient_checkpointing, train_precision=cfg.train_precision,
                          interpreter=cfg.interpreter,
                          run_dir=str(run_dir),
                          save_every=cfg.sft_steps, seed=cfg.seed, device=cfg.device, dtype=cfg.dtype)
    return sft(sft_cfg, resume=(run_dir / "config.json").exists())


def run_rl(cfg: DemoConfig, out: Path, rl_path: Path, sft_dir: Path) -> Path:
    """RL from the SFT adapter; returns the run folder (resumed if interrupted)."""
    run_dir = out / "rl"
    latest = latest_checkpoint(run_dir)
    if latest is not None and latest[0] >= cfg.rl_steps:
        return run_dir
    _say(f"RL: {cfg.rl_steps} steps x {cfg.rl_batch_size} problems x {cfg.rl_group_size} trajectories")
    train_cfg = make_config(
        TrainConfig, model=cfg.model, chat_template=cfg.chat_template, init_from=str(sft_dir),
        train_data=str(rl_path), batch_size=cfg.rl_batch_size, group_size=cfg.rl_group_size,
        max_steps=cfg.rl_steps, max_turn_tokens=cfg.max_turn_tokens, max_trajectory_tokens=cfg.max_trajectory_tokens,
        max_code_calls=cfg.max_code_calls, max_assistant_turns=cfg.max_assistant_turns, lr=cfg.rl_lr,
        invalid_call_penalty=cfg.rl_invalid_call_penalty, kl_coef=cfg.rl_kl_coef, lr_schedule=cfg.rl_lr_schedule,
        packing=cfg.packing, micro_batch_tokens=cfg.micro_batch_tokens, logprob_chunk_tokens=cfg.logprob_chunk_tokens,
        gradient_checkpointing=cfg.gradient_checkpointing, prefix_once=cfg.rl_prefix_once, top_p=cfg.rl_top_p,
        train_precision=cfg.train_precision,
        refill_rounds=cfg.rl_refill_rounds, curriculum=cfg.rl_curriculum, interpreter=cfg.interpreter,
        sandbox_workers=4, sandbox_memory_mb=cfg.sandbox_memory_mb, run_dir=str(run_dir),
        max_staleness=cfg.rl_max_staleness,
        save_every=cfg.rl_save_every or cfg.rl_steps, save_trajectories=True, seed=cfg.seed, device=cfg.device,
        dtype=cfg.dtype, local=LocalSettings(precision=cfg.sampler_precision, spill_base=cfg.rl_spill_base))
    return train(train_cfg, resume=(run_dir / "config.json").exists())


def eval_path(out: Path, label: str) -> Path:
    """Where the eval of stage ``label`` is written (``eval/after-sft.jsonl`` …)."""
    return out / "eval" / f"{label.replace(' ', '-').lower()}.jsonl"


def rl_gain(out: Path) -> Comparison:
    """After RL against after SFT on the same held-out problems, as ``retool compare`` computes it."""
    return compare(eval_path(out, STAGES[1]), eval_path(out, STAGES[2]))


@dataclass(frozen=True)
class RolloutShare:
    """How many of the RL stage's rolled-out groups (refills included) had mixed rewards: the
    demo's efficiency figure — an all-right or all-wrong group is rolled out and teaches nothing."""

    steps: int
    groups: int
    informative: int

    @property
    def share(self) -> float:
        return self.informative / self.groups if self.groups else 0.0

    def sentence(self) -> str:
        return (f"RL rollouts: {self.informative} of {self.groups} groups informative ({self.share:.0%}, mixed "
                f"rewards) over {self.steps} step{'s' if self.steps != 1 else ''}")

    def to_json(self) -> dict[str, float]:
        return {"steps": self.steps, "groups": self.groups, "informative_groups": self.informative,
                "informative_share": self.share}


def rl_rollouts(rl_dir: Path) -> RolloutShare | None:
    """The informative share of an RL run folder's steps (``None`` without ``metrics.jsonl``)."""
    path = Path(rl_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = read_metrics(path)
    groups = [round(r["rollout/groups"]) for r in rows]
    rates = [r["rollout/informative_group_rate"] if "rollout/informative_group_rate" in r
             else 1 - r["rollout/degenerate_group_rate"] for r in rows]  # a run from before the rate
    return RolloutShare(len(rows), sum(groups), sum(round(g * rate) for g, rate in zip(groups, rates)))


@dataclass(frozen=True)
class Rate:
    """``hits`` of ``total`` (trajectories with a ``\\boxed{}`` answer, or valid call attempts)."""

    hits: int
    total: int

    @property
    def value(self) -> float:
        return self.hits / self.total if self.total else float("nan")


@dataclass(frozen=True)
class EndOfRL:
    """The RL stage's format and valid-call rates on its first steps against its last ones
    (``steps`` each: two, or one in a run of two or three steps), pooled over every
    trajectory rolled out in them, refills included: is the end of RL worse than its start?
    Rates of a few dozen samples move by several points from sampling alone, so each
    difference comes with its standard error (two independent proportions) and a verdict;
    the held-out evals' paired comparison (format and ``valid_tool_call_rate`` after RL
    against after SFT) is the larger sample."""

    steps: int
    first_format: Rate
    last_format: Rate
    first_valid: Rate
    last_valid: Rate

    @staticmethod
    def difference(first: Rate, last: Rate) -> tuple[float, float]:
        """``last − first`` and its standard error."""
        return proportion_difference((first.hits, first.total), (last.hits, last.total))

    @classmethod
    def verdict(cls, first: Rate, last: Rate) -> str:
        diff, stderr = cls.difference(first, last)
        if diff != diff:
            return "not measured"
        if diff >= 0:
            return "no lower"
        return "lower, within 2 s.e. (noise)" if -diff <= 2 * stderr else "lower by more than 2 s.e."

    def _pairs(self) -> tuple[tuple[str, str, Rate, Rate], ...]:
        """(printed name, JSON name, first, last) of each rate compared."""
        return (("format", "format", self.first_format, self.last_format),
                ("valid calls", "valid_tool_call_rate", self.first_valid, self.last_valid))

    def sentence(self) -> str:
        parts = []
        for name, _, a, b in self._pairs():
            diff, stderr = self.difference(a, b)
            change = "" if diff != diff else f", {100 * diff:+.1f} pts, s.e. {100 * stderr:.1f}"
            parts.append(f"{name} {a.value:.0%} of {a.total} → {b.value:.0%} of {b.total}{change}: "
                         f"{self.verdict(a, b)}")
        return (f"End of RL (first {self.steps} steps → last {self.steps}, rollouts pooled): "
                + "; ".join(parts))

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"steps_compared": self.steps}
        for _, name, a, b in self._pairs():
            diff, stderr = self.difference(a, b)
            out[name] = {"first": [a.hits, a.total], "last": [b.hits, b.total], "difference": diff,
                         "stderr": stderr, "verdict": self.verdict(a, b)}
        return out


def rl_end(rl_dir: Path) -> EndOfRL | None:
    """:class:`EndOfRL` of an RL run folder (``None`` before two steps are logged). The
    counts come back from each step's rates: ``rollout/groups`` × the run's group size
    trajectories, ``rollout/tool_call_attempts`` call attempts per trajectory."""
    rl_dir = Path(rl_dir)
    rows = {r["step"]: r for r in read_metrics(rl_dir / "metrics.jsonl")}  # a resumed step: its last row
    config = rl_dir / "config.json"
    if len(rows) < 2 or not config.is_file():
        return None
    group_size = int(json.loads(config.read_text())["group_size"])
    ordered = [rows[step] for step in sorted(rows)]
    k = min(2, len(ordered) // 2)

    def pooled(chosen: list[dict]) -> tuple[Rate, Rate]:
        fmt_hits = fmt_total = valid_hits = valid_total = 0
        for row in chosen:
            n = round(row["rollout/groups"]) * group_size
            calls = round(row["rollout/tool_call_attempts"] * n)
            fmt_hits += round(row["reward/format"] * n)
            fmt_total += n
            valid_hits += round(row["rollout/valid_tool_call_rate"] * calls)
            valid_total += calls
        return Rate(fmt_hits, fmt_total), Rate(valid_hits, valid_total)

    (first_format, first_valid), (last_format, last_valid) = pooled(ordered[:k]), pooled(ordered[-k:])
    return EndOfRL(k, first_format, last_format, first_valid, last_valid)


def report(cfg: DemoConfig, out: Path, summaries: dict[str, EvalSummary], gain: Comparison, rl_dir: Path,
           memory: PeakRSS | None = None, stage_seconds: dict[str, float] | None = None) -> list[Path]:
    """Plots, the HTML viewer and the summary files (with the process tree's peak memory:
    ``peak_pss_mb``, its real footprint, ``peak_rss_mb``, RSS summed over it, and
    ``peak_pss_mb_by_stage``, each stage's own PSS peak; and, when
    given, each stage's wall time in this invocation)."""
    written = plots.plot_checkpoints(out / "eval", out / "plots", order=STAGES)
    written += plots.plot_training(rl_dir, out / "plots")
    written.append(view.write_view([eval_path(out, STAGES[2])], out / "view.html",
                                   tokenizer_name=resolve_model_name(cfg.model), title="retool demo: after RL"))
    accuracy = gain.metric("accuracy")
    summary = {**{k: s.to_json() for k, s in summaries.items()},
               "rl_vs_sft": {"problems": gain.problems, "samples_per_problem": cfg.eval_samples,
                             **{m.name: {"before": m.before, "after": m.after, "difference": m.difference,
                                         "paired_stderr": m.stderr, "z": m.z} for m in gain.metrics},
                             "significant": accuracy.significant},
               "peak_pss_mb": round(memory.peak_bytes / 2**20) if memory else 0,
               "peak_rss_mb": round(memory.rss_peak_bytes / 2**20) if memory else 0,
               "peak_pss_mb_by_stage": {name: round(peak / 2**20) for name, peak in memory.stage_pss_bytes.items()}
               if memory else {}}
    if stage_seconds is not None:
        summary["stage_seconds"] = {stage: round(seconds, 1) for stage, seconds in stage_seconds.items()}
    rollouts = rl_rollouts(rl_dir)
    if rollouts is not None:
        summary["rl_rollouts"] = rollouts.to_json()
    end = rl_end(rl_dir)
    if end is not None:
        summary["rl_end"] = end.to_json()
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    atomic_write_text(out / "summary.md", summary_markdown(summaries, gain, quick=cfg.quick,
                                                           interpreter=cfg.interpreter, rollouts=rollouts,
                                                           end=end))
    return written


def gain_sentence(gain: Comparison) -> str:
    """One line on RL's held-out gain: difference, paired s.e., z and the verdict; within the
    noise, also the headroom the cold start left (the most RL could gain)."""
    acc = gain.metric("accuracy")
    if acc.z is None:
        return (f"RL vs SFT on the same {gain.problems} held-out problems: accuracy {100 * acc.difference:+.1f} "
                "points (no paired standard error: every problem scored the same both times)")
    verdict = "more than 2 standard errors: RL helped beyond the noise" if acc.significant and acc.z > 0 else (
        "more than 2 standard errors below: RL hurt" if acc.significant else "within 2 standard errors: noise")
    # Where the gain is noise, the room the cold start left: a strong one (seeds whose after-SFT
    # accuracy was 85-91 % in docs/demo.md) has little to gain, and says so.
    room = f"; after SFT at {acc.before:.1%}, the most RL could gain is {100 * (1 - acc.before):+.1f} points" \
        if not acc.significant else ""
    return (f"RL vs SFT on the same {gain.problems} held-out problems: accuracy {100 * acc.difference:+.1f} points, "
            f"paired s.e. {100 * acc.stderr:.1f}, z = {acc.z:+.2f} ({verdict}{room})")


STATEFUL_NOTE = "Interpreter: stateful — one interpreter per trajectory keeps its variables across calls."
QUICK_NOTE = "--quick is a smoke run of every stage: far too small to show learning (run without it to see RL's gain)."


def summary_markdown(summaries: dict[str, EvalSummary], gain: Comparison, *, quick: bool = False,
                     interpreter: str = "stateless", rollouts: RolloutShare | None = None,
                     end: EndOfRL | None = None) -> str:
    """The demo's tables as Markdown (the same numbers the console shows)."""
    rows = [STATEFUL_NOTE, ""] if interpreter == "stateful" else []
    rows += ["| stage | problems × k | accuracy (Average@k) | ± s.e. | Pass@k | format | used the tool | code calls |",
            "|---|---|---|---|---|---|---|---|"]
    for stage, s in summaries.items():
        rows.append(f"| {stage} | {s.num_problems} × {s.k} | {s.average_at_k:.1%} | {s.average_at_k_stderr:.1%} | "
                    f"{s.pass_at_k:.1%} | {s.format:.1%} | {s.used_tool_rate:.1%} | {s.code_calls:.2f} |")
    rows += ["", "Tool-use behaviour (the ReTool paper's analyses; `retool compare` below pairs them):", ""]
    rows += [f"- {stage}: {format_behaviour(s.behaviour)}" for stage, s in summaries.items() if s.behaviour]
    rows += ["", f"**{gain_sentence(gain)}.**", "", "After RL against after SFT (`retool compare`: per-problem "
             "differences, so each problem's difficulty cancels):", "", format_table(gain)]
    if rollouts is not None:
        rows += ["", rollouts.sentence() + "."]
    if end is not None:
        rows += ["", end.sentence() + "."]
    if quick:
        rows += ["", QUICK_NOTE]
    return "\n".join(rows) + "\n"


def print_table(summaries: dict[str, EvalSummary], gain: Comparison, out: Path, seconds: float,
                quick: bool, interpreter: str = "stateless", rollouts: RolloutShare | None = None,
                end: EndOfRL | None = None) -> None:
    mode = "" if interpreter == "stateless" else f", {interpreter} interpreter"
    table = Table(title=f"retool demo — held-out arithmetic, tool on{mode} ({seconds / 60:.1f} min)")
    for column in ("stage", "problems × k", "accuracy", "± s.e.", "Pass@k", "format", "used the tool", "code calls"):
        table.add_column(column, justify="right" if column != "stage" else "left", no_wrap=column == "stage")
    for stage, s in summaries.items():
        table.add_row(stage, f"{s.num_problems} × {s.k}", f"{s.average_at_k:.1%}", f"{s.average_at_k_stderr:.1%}", f"{s.pass_at_k:.1%}",
                      f"{s.format:.1%}", f"{s.used_tool_rate:.1%}", f"{s.code_calls:.2f}")
    console = Console()
    console.print(table)
    console.print(gain_sentence(gain), markup=False)
    if rollouts is not None:
        console.print(rollouts.sentence(), markup=False)
    if end is not None:
        console.print(end.sentence(), markup=False)
    if quick:
        console.print(QUICK_NOTE, markup=False)
    console.print(f"output folder: {out}  (summary.md, plots/, view.html, sft/, rl/, eval/)", markup=False)


class StageClock:
    """Wall time of each stage of one ``retool demo`` invocation (a stage resumed from an
    earlier invocation shows the few seconds it took to find its files)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[stage] = time.monotonic() - start

    def sentence(self) -> str:
        """One line for the demo's output: ``stages: data 5 s, eval before SFT 0.6 min, …``."""
        parts = [f"{stage} {seconds:.0f} s" if seconds < 60 else f"{stage} {seconds / 60:.1f} min"
                 for stage, seconds in self.seconds.items()]
        return "stages (wall time): " + ", ".join(parts)


def run_demo(cfg: DemoConfig) -> dict[str, EvalSummary]:
    """Run every stage; return the summaries by stage."""
    cfg = cfg.shrunk()
    start = time.monotonic()
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    check_identity(cfg, out)
    resolve_model_name(cfg.model)  # converts the bundled model once, or says how to install it
    clock = StageClock()
    with clock("data"):
        paths = make_data(cfg, out)
    with PeakRSS() as memory:
        def stage(name: str, function: Callable[..., T], *args: object) -> T:
            """One stage, timed and its memory peak kept, in a process of its own (what one stage
            leaves resident is not under the next)."""
            with clock(name), memory.stage(name):
                return in_own_process(name, function, *args)

        summaries = {STAGES[0]: stage("eval before SFT", run_eval, cfg, out, paths["test"], STAGES[0], None,
                                      cfg.base_eval_problems)}
        sft_dir = stage("SFT", run_sft, cfg, out, paths["sft"])
        summaries[STAGES[1]] = stage("eval after SFT", run_eval, cfg, out, paths["test"], STAGES[1], sft_dir)
        rl_dir = stage("RL", run_rl, cfg, out, paths["rl"], sft_dir)
        summaries[STAGES[2]] = stage("eval after RL", run_eval, cfg, out, paths["test"], STAGES[2], rl_dir)
    gain = rl_gain(out)
    report(cfg, out, summaries, gain, rl_dir, memory, clock.seconds)
    print_table(summaries, gain, out, time.monotonic() - start, cfg.quick, cfg.interpreter, rl_rollouts(rl_dir),
                rl_end(rl_dir))
    print(clock.sentence())
    print(memory.sentence())
    return summaries


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        description=__doc__.split("\n\n")[0] + " Default sizes take tens of minutes on 2 cores; --quick a few.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_args(p, DemoConfig)
    p.set_defaults(func=_run_demo_command)


def _run_demo_command(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(DemoConfig, args)
        output_folder(cfg.output_dir, "--output-dir")
        run_demo(cfg)
    except (ConfigError, BundledModelMissing, ReportInputError, ConversationError, TemplateError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (WeightSyncError, StageDied) as err:  # the RL sampler off the trainer's weights; a stage's process killed
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0
