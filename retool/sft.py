"""Cold-start SFT: ``retool sft`` (ReTool's first stage, which the reference run skipped).

Supervised fine-tuning on code-interleaved dialogues in OpenAI chat format, on the
same engine and in the same checkpoint layout as RL, so ``retool train --init-from
SFT_RUN_DIR`` continues from the result. One step, top to bottom (:func:`sft_step`):

    batch of dialogues (seeded shuffle per epoch) → datums → forward_backward
    (cross_entropy) → optim_step (scheduled lr) → metrics → (every N steps) checkpoint

The dialogues themselves — reading and validating the OpenAI-format JSONL, and their
token layout, which is the RL rollout's (assistant tokens mask 1, tool output and
template glue mask 0) — are :mod:`retool.dialogues`'s.

Not covered: multi-turn user dialogues, parallel tool calls, tools other than
``code_interpreter``, packing several dialogues into one sequence, evaluation during
SFT (use the RL rollout on held-out problems, as ``docs/sft.md`` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retool import runs
from retool.algo import make_datum
from retool.atomic import atomic_write_json
from retool.config import ConfigError, add_config_args, config_from_args, option, require, resumed_config
from retool.cost import CostOptions, cost_meter
from retool.dialogues import AssistantFormatter, ConversationError, Dialogue, dialogue_tokens, load_dialogues
from retool.engines import ModelConfig, Requirements, check_supported, close_training_client
from retool.engines.base import AdamParams
from retool.flag_checks import output_folder
from retool.log import check_sinks
from retool.protocol import INTERPRETERS, TemplateError, system_prompt
from retool.render import Renderer
from retool.types import Datum

SCHEDULES = ("constant", "linear", "cosine")


@dataclass
class SFTConfig(CostOptions, ModelConfig):
    """Every knob of ``retool sft``.

    The engine, model and adapter fields come from :class:`retool.engines.ModelConfig`,
    shared with ``retool train``: keep them equal in both runs, since the RL run's
    ``--init-from`` loads this run's adapter. ``--price-table`` and ``--max-cost`` price
    the trained tokens (:class:`retool.cost.CostOptions`).
    """

    # ---- data
    data: str = option("data/sft.jsonl", "OpenAI-format tool dialogues (JSONL; see `retool task-data`)")
    max_seq_tokens: int = option(4096, "drop (and count) dialogues longer than this many tokens")
    max_tool_response_tokens: int = option(512, "tokens per tool message (head+tail kept), as in RL")
    interpreter: str = option("stateless", "the interpreter mode the data teaches (the tool's description; "
                              "use the RL run's --interpreter, and task-data's for its dialogues)",
                              choices=INTERPRETERS)

    # ---- optimisation
    batch_size: int = option(8, "dialogues per step")
    epochs: float = option(1.0, "passes over the data (ignored when max_steps is set)")
    max_steps: int | None = option(None, "number of steps; none = epochs x dialogues / batch_size")
    lr: float = option(2e-4, "peak Adam learning rate (SFT of a LoRA adapter wants more than RL's 4e-5)")
    lr_schedule: str = option("constant", "decay after warm-up", choices=SCHEDULES)
    warmup_steps: int = option(0, "linear warm-up steps from 0 to lr")
    beta1: float = option(0.9, "Adam beta1")
    beta2: float = option(0.95, "Adam beta2")
    weight_decay: float = option(0.0, "decoupled weight decay")
    grad_clip_norm: float | None = option(1.0, "clip the global gradient norm; none = only measure")

    # ---- run bookkeeping
    run_dir: str = option("runs/sft", "where the run writes metrics and checkpoints")
    run_name: str | None = option(None, "name for remote metric sinks (default: run folder name)")
    save_every: int = option(50, "checkpoint every N steps (and at the last step)")
    sinks: tuple[str, ...] = option(("jsonl",), "metric sinks: jsonl,swanlab,wandb,tensorboard")
    seed: int = option(42, "seed of data order and adapter init")

    def validate(self) -> None:
        for name in ("batch_size", "save_every", "max_seq_tokens", "max_tool_response_tokens"):
            require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        self.validate_model()
        self.validate_cost()
        require(self.max_steps is None or self.max_steps >= 1, f"max_steps must be >= 1, got {self.max_steps}")
        require(self.epochs > 0, f"epochs must be > 0, got {self.epochs}")
        require(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        require(self.lr > 0 and 0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "invalid Adam settings")
        require(self.grad_clip_norm is None or self.grad_clip_norm > 0, "grad_clip_norm must be > 0 (or none)")

        try:
            check_sinks(self.sinks)
        except (ValueError, RuntimeError) as err:
            raise ConfigError(str(err)) from None
        check_supported(self.engine, Requirements(full_finetune=self.full_finetune, loss="cross_entropy",
                                                  packing=self.packing, resume=True))


@dataclass(frozen=True)
class SFTData:
    """Datums ready to train, and what happened on the way."""

    datums: tuple[Datum, ...]
    dialogues: int
    dropped_too_long: tuple[str, ...]
    """``FILE:LINE`` of dialogues over ``max_seq_tokens``."""
    truncated_tool_outputs: int
    nonstandard_system_prompts: int
    """Dialogues whose system prompt differs from the RL rollout's (``protocol.system_prompt``
    of the renderer's interpreter mode)."""

    def summary(self) -> dict[str, Any]:
        return {"dialogues": self.dialogues, "datums": len(self.datums),
                "dropped_too_long": len(self.dropped_too_long),
                "tokens": sum(d.num_tokens for d in self.datums),
                "trained_tokens": sum(d.num_trained for d in self.datums),
                "truncated_tool_outputs": self.truncated_tool_outputs,
                "nonstandard_system_prompts": self.nonstandard_system_prompts}


def build_sft_data(dialogues: Sequence[Dialogue], renderer: Any, *, max_seq_tokens: int = 4096,
                   max_tool_response_tokens: int = 512) -> SFTData:
    """Cross-entropy datums (weights 1 on assistant tokens incl. end of turn, 0 elsewhere).

    Raises :class:`ConversationError` when every dialogue is over ``max_seq_tokens``.
    """
    formatter = AssistantFormatter(renderer)
    datums, dropped, truncated = [], [], 0
    for dialogue in dialogues:
        seq = dialogue_tokens(dialogue, renderer, formatter, max_tool_response_tokens)
        truncated += seq.truncated_tool_outputs
        if len(seq.tokens_T) > max_seq_tokens:
            dropped.append(dialogue.where)
            continue
        datums.append(make_datum(seq.tokens_T, seq.mask_T))
    if not datums:
        raise ConversationError(f"all {len(dialogues)} dialogues are longer than max_seq_tokens={max_seq_tokens}")
    nonstandard = sum(d.system != system_prompt(renderer.interpreter) for d in dialogues)
    return SFTData(tuple(datums), len(dialogues), tuple(dropped), truncated, nonstandard)


# ---------------------------------------------------------------- schedule and step


def learning_rate(step: int, total_steps: int, cfg: SFTConfig) -> float:
    """The learning rate of ``step`` (1-based): linear warm-up, then ``lr_schedule`` decay to 0."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    progress = (step - 1 - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    if cfg.lr_schedule == "linear":
        return cfg.lr * (1.0 - progress)
    if cfg.lr_schedule == "cosine":
        return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr


def total_steps(cfg: SFTConfig, num_datums: int) -> int:
    """``max_steps`` if set, else ``ceil(epochs * datums / batch_size)``."""
    return cfg.max_steps or max(1, math.ceil(cfg.epochs * num_datums / cfg.batch_size))


@dataclass
class SFTRun:
    """What a run holds: config, engine, datums, step count, running totals."""

    config: SFTConfig
    engine: Any
    datums: tuple[Datum, ...]
    total_steps: int
    cost: Any = None
    """A :class:`retool.cost.CostMeter` when the run has a ``--price-table``."""
    totals: dict[str, float] = dataclasses.field(default_factory=lambda: {"tokens/trained_total": 0.0})

    def checkpoint_state(self, step: int) -> runs.TrainerState:
        return runs.TrainerState(step, step * self.config.batch_size, dict(self.totals))

    def restore_state(self, state: runs.TrainerState) -> None:
        self.totals.update(state.totals)


def sft_step(run: SFTRun, step: int) -> dict[str, float]:
    """One SFT step: this step's batch → forward_backward(cross_entropy) → optim_step."""
    cfg, t0 = run.config, time.monotonic()
    batch = [run.datums[i] for i in runs.batch_indices(step, cfg.batch_size, len(run.datums), cfg.seed)]
    lr = learning_rate(step, run.total_steps, cfg)
    fb_future = run.engine.submit_forward_backward(batch, "cross_entropy")
    opt_future = run.engine.submit_optim_step(AdamParams(learning_rate=lr, beta1=cfg.beta1, beta2=cfg.beta2,
                                                         weight_decay=cfg.weight_decay,
                                                         grad_clip_norm=cfg.grad_clip_norm))
    fb, opt = fb_future.result(), opt_future.result()
    trained = float(sum(d.num_trained for d in batch))
    run.totals["tokens/trained_total"] += trained
    grad_norm = {"sft/grad_norm": opt.metrics["train/grad_norm"]} if "train/grad_norm" in opt.metrics else {}
    metrics = {  # a service engine reports no gradient norm unless its service does
        "sft/loss": fb.metrics["train/loss"], **grad_norm, "sft/lr": lr,
        "sft/epoch": step * cfg.batch_size / len(run.datums), "sft/sequences": float(len(batch)),
        "tokens/trained": trained, "tokens/sequence": float(sum(d.num_tokens for d in batch)),
        **run.totals, "time/step": time.monotonic() - t0,
    }
    metrics.update({k: v for k, v in opt.metrics.items() if k.startswith("engine/")})
    if run.cost is not None:
        metrics.update(run.cost.charge(metrics, run.totals))
    return metrics


# ---------------------------------------------------------------- a run


def build_run(cfg: SFTConfig, dialogues: Sequence[Dialogue]) -> tuple[SFTRun, SFTData]:
    """Load the engine and turn ``dialogues`` into datums."""
    cost = cost_meter(cfg, cfg.engine, cfg.model)  # a bad price table fails before the model loads
    engine = runs.load_engine(cfg, cfg.seed)
    renderer = Renderer(engine.get_tokenizer(), chat_template=cfg.chat_template, tools=True, model_name=cfg.model,
                        interpreter=cfg.interpreter)
    data = build_sft_data(dialogues, renderer, max_seq_tokens=cfg.max_seq_tokens,
                          max_tool_response_tokens=cfg.max_tool_response_tokens)
    return SFTRun(cfg, engine, data.datums, total_steps(cfg, len(data.datums)), cost), data


def sft(cfg: SFTConfig, *, resume: bool = False) -> Path:
    """Run (or resume) SFT as configured; return the run folder."""
    run_dir = Path(cfg.run_dir)
    cfg = runs.with_absolute_paths(cfg)
    runs.refuse_existing_run(run_dir, resume=resume)
    dialogues = load_dialogues(cfg.data)  # data errors surface before the model loads
    runs.check_model_folder(cfg.model)
    data_info = runs.data_fingerprint(Path(cfg.data))
    if resume:
        runs.check_same_data(run_dir, "sft_data.json", data_info)
    run, data = build_run(cfg, dialogues)
    ended: BaseException | None = None
    try:
        runs.create_run(run_dir, cfg)  # only now: a failed start or resume leaves the folder as it was
        _report_data(run_dir, data, data_info)
        runs.run_steps(runs.StepLoop(
            run_dir, cfg, run.total_steps, run.engine, step=lambda step: sft_step(run, step),
            progress_fields=_progress_fields, checkpoint_state=run.checkpoint_state,
            restore_state=run.restore_state, description="sft", stop=run.cost.stop_reason if run.cost else None),
            resume=resume)
    except BaseException as err:
        ended = err
        raise
    finally:
        close_training_client(run.engine, ended)
    if runs.latest_checkpoint(run_dir) is None:
        raise RuntimeError(f"{run_dir}: the run ended without a checkpoint")
    return run_dir


def _progress_fields(metrics: Mapping[str, float]) -> dict[str, float]:
    fields = {"loss": metrics["sft/loss"], "lr": metrics["sft/lr"]}
    if "cost/total" in metrics:
        fields["usd"] = metrics["cost/total"]
    return fields


def _report_data(run_dir: Path, data: SFTData, data_info: dict[str, str]) -> None:
    summary = data.summary()
    atomic_write_json(run_dir / "sft_data.json", {**data_info, **summary, "dropped": list(data.dropped_too_long)})
    print("sft data: " + ", ".join(f"{k} {v}" for k, v in summary.items()), file=sys.stderr)
    if data.dropped_too_long:
        print(f"warning: dropped {len(data.dropped_too_long)} dialogues over max_seq_tokens "
              f"(first: {data.dropped_too_long[0]}); listed in {run_dir / 'sft_data.json'}", file=sys.stderr)
    if data.nonstandard_system_prompts:
        print(f"note: {data.nonstandard_system_prompts} dialogues use a system prompt other than the RL "
              "rollout's for this --interpreter (retool.protocol.system_prompt)", file=sys.stderr)


# ---------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "sft",
        description="Cold-start SFT (ReTool's first stage) on OpenAI-format tool dialogues, with the loss on "
        "assistant tokens only (tool output and template tokens are masked). Writes RUN_DIR/metrics.jsonl and checkpoints in the layout "
        "of `retool train`, whose --init-from RUN_DIR starts RL from the result (use the same model, "
        "chat template and LoRA settings there). Flags override a --config TOML preset.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue the run in RUN_DIR from its last checkpoint (its saved config is used; "
                        "--max-steps may extend it, --max-cost raise its budget)")
    add_config_args(p, SFTConfig)
    p.set_defaults(func=_run_sft_command)


def _run_sft_command(args: argparse.Namespace) -> int:
    try:
        cfg = resumed_config(SFTConfig, args) if args.resume else config_from_args(SFTConfig, args)
        output_folder(cfg.run_dir, "--resume" if args.resume else "--run-dir")
        run_dir = sft(cfg, resume=bool(args.resume))
    except (ConfigError, ConversationError, TemplateError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"run folder: {run_dir}")
    return 0
