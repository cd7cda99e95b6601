"""``retool verl-config``: a ready launch folder for running ReTool on verl.

From retool's own training flags or preset (``--config configs/*.toml``; every default
is the seed's run) plus the cluster's shape, it writes::

    OUT/
      train.parquet, val.parquet   problems in verl's row layout, agent_name = "retool"
      agent_loop.yaml              verl's agent-loop registry entry, with retool's budgets
      reward_fn.py                 verl's custom reward hook (retool's grader)
      run.sh                       python -m verl.trainer.main_ppo <every setting>
                                   (one_step_off_policy.main_ppo with --max-staleness 1)

Every setting that decides the algorithm is written explicitly, including those whose
verl default differs from the seed's run without any error to flag it: GRPO without a
critic, no std normalisation, no KL, AdamW weight decay 0 and betas (0.9, 0.95), no
gradient clipping and no dual clip (written as a 1e9 bound: verl has no "off"), LoRA
alpha 32, one update per step over the whole batch, sampled validation (n = 12,
temperature 1.0, top-p 0.7). ``tests/verl`` composes the result with verl's own Hydra
config and checks each value.

Refused, because the verl run would silently differ: text mode (the agent loop always
declares the tool), the ``importance_sampling`` loss, dynamic sampling
(``refill_rounds``), dropping degenerate groups, the difficulty curriculum, and retool's ``--advantage passk``,
``--overlong``, ``--behaviour-is`` and ``--kl-coef`` (not mapped to verl's own options).

``--max-staleness 1`` writes verl's own one-step-off trainer instead of the synchronous
one (``verl.experimental.one_step_off_policy.main_ppo``, shipped by the pinned verl
0.9.1): step t + 1's rollout runs on separate rollout GPUs (``--rollout-gpus`` of each
node; the rest train) with the weights of step t while step t trains — the same fixed lag
of one version as ``retool train --max-staleness 1``; the PPO ratio is taken against the
rollout's own logprobs (``algorithm.rollout_correction.bypass_mode``), as retool's is.
``--max-staleness`` above 1 is refused: verl 0.9.1's other mode, the fully-async trainer
(``verl.experimental.fully_async_policy``), bounds staleness by a share of samples
(``async_training.staleness_threshold``), not by a number of versions.

Not covered: Megatron (FSDP only), verl's reference-model and critic settings (GRPO
without KL uses neither).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from retool.config import ConfigError, add_config_args, config_from_args, option, require
from retool.data import DataError, load_problems
from retool.flag_checks import output_folder
from retool.protocol import build_messages
from retool.rollout import RolloutBudgets
from retool.train import TrainConfig

ROLLOUT_ENGINES = ("vllm", "sglang")
OFF = 1e9
"""verl's stand-in for "no bound" where it has no switch (grad clip, dual-clip constant)."""


@dataclass
class VerlSettings:
    """Where and how verl runs a ReTool run (the flags ``retool verl-config`` adds to
    ``retool train``'s; ``docs/verl.md`` lists them)."""

    RENAMED: ClassVar[dict[str, str]] = {"out": "output_dir"}
    """Old names of settings, refused with a pointer to the new (``retool.config``)."""

    output_dir: str = option("verl-launch", "launch folder to write")
    val_data: str = option("aime25", "validation problems (bundled set or file)")
    val_samples: int = option(12, "samples per validation problem")
    val_temperature: float = option(1.0, "validation sampling temperature")
    val_top_p: float = option(0.7, "validation nucleus sampling")
    test_every: int = option(10, "validate every N steps")
    nnodes: int = option(1, "nodes in the Ray cluster")
    gpus_per_node: int = option(8, "GPUs per node")
    rollout_engine: str = option("vllm", "verl's rollout server", choices=ROLLOUT_ENGINES)
    tensor_parallel: int = option(1, "tensor-parallel size of one rollout server")
    rollout_gpus: int = option(0, "with --max-staleness 1: GPUs of each node for verl's separate rollout servers, "
                                  "the others train (0 = half of --gpus-per-node)")
    gpu_memory_utilization: float = option(0.6, "share of GPU memory the rollout server may take")
    max_prompt_tokens: int = option(1024, "longest prompt (verl's data.max_prompt_length; longer rows are dropped)")
    agent_workers: int = option(8, "verl agent-loop workers (each holds one sandbox)")
    sandbox_url: str | None = option(None, "a `retool sandbox serve` URL; none = a warm sandbox in each worker")
    project: str = option("retool", "project name for verl's loggers")


@dataclass
class VerlConfig(VerlSettings, TrainConfig):
    """``retool train``'s settings (model, data, batch and group, budgets, optimiser,
    adapter, clip, steps, seed) plus :class:`VerlSettings`. The local engine's own
    settings (device, dtype, packing, the ``local`` section) do not apply to verl and are
    ignored; ``micro_batch_tokens`` becomes ``ppo_max_token_len_per_gpu`` (at least one
    whole sequence)."""

    def validate(self) -> None:
        """``retool train``'s own rules (:meth:`TrainConfig.validate_settings`; the sinks,
        engine and price table are verl's business), then what verl adds or cannot map."""
        self.validate_settings()
        for name in ("val_samples", "test_every", "nnodes", "gpus_per_node", "tensor_parallel", "max_prompt_tokens",
                     "agent_workers"):
            require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        require(self.val_temperature >= 0 and 0 < self.val_top_p <= 1,
                "val_temperature must be >= 0 (0 = greedy) and val_top_p in (0, 1]")
        require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]")
        require(self.gpus_per_node % self.tensor_parallel == 0, "tensor_parallel must divide gpus_per_node")
        require(self.mode == "retool", "verl runs retool mode only (the agent loop always declares the tool)")
        require(self.interpreter == "stateless", "verl runs the stateless interpreter only (its agent loop "
                "does not hold a session per trajectory); drop --interpreter stateful")
        require(self.loss == "ppo", "verl-config writes the PPO-clip loss only (loss = ppo)")
        require(self.refill_rounds == 0 and not self.drop_degenerate_groups,
                "dynamic sampling / dropping degenerate groups has no verl equivalent here")
        require(not self.stream_groups, "--stream-groups is retool train's own pipeline (verl schedules its own "
                "rollout and update); leave it off")
        require(self.max_staleness <= 1, "--max-staleness above 1 has no verl equivalent here: verl 0.9.1's "
                "one-step-off trainer (--max-staleness 1) lags one version; its fully-async trainer bounds "
                "staleness by a share of samples, not versions; use --max-staleness 0 or 1")
        if self.max_staleness:
            rollout = self.one_step_off_rollout_gpus()
            require(0 < rollout < self.gpus_per_node and rollout % self.tensor_parallel == 0,
                    f"--max-staleness 1 splits each node's GPUs between rollout and training: --rollout-gpus must "
                    f"be in 1..{self.gpus_per_node - 1} and a multiple of --tensor-parallel, got {rollout}")
        require(self.curriculum == "none", "the difficulty curriculum has no verl equivalent here (verl's "
                "dataloader draws the batches); drop --curriculum")
        require(self.advantage == "grpo" and self.overlong == "none" and self.behaviour_is == "off",
                "--advantage passk, --overlong and --behaviour-is are not mapped to verl's settings here; "
                "leave them at grpo / none / off")
        require(self.kl_coef == 0, "--kl-coef is not mapped to verl's settings here (its KL in the reward and "
                "KL loss are not retool's per-token advantage penalty); leave it at 0")


    def one_step_off_rollout_gpus(self) -> int:
        """The rollout GPUs of each node with ``--max-staleness 1`` (``--rollout-gpus``, or half)."""
        return self.rollout_gpus or self.gpus_per_node // 2


SYNC_TRAINER = "verl.trainer.main_ppo"
ONE_STEP_OFF_TRAINER = "verl.experimental.one_step_off_policy.main_ppo"


def trainer_module(cfg: VerlConfig) -> str:
    """The verl entry point ``run.sh`` runs: the synchronous trainer, or the one-step-off one."""
    return ONE_STEP_OFF_TRAINER if cfg.max_staleness else SYNC_TRAINER


def one_step_off_overrides(cfg: VerlConfig) -> list[tuple[str, Any]]:
    """What verl's one-step-off trainer adds (``--max-staleness 1``): its config's parent
    found by package (its own file names a path relative to a verl checkout), the
    rollout's GPUs apart from the trainer's (``trainer.n_gpus_per_node``: the rest), the
    rollout's logprobs as the PPO's old ones, and the settings its config marks as required."""
    rollout = cfg.one_step_off_rollout_gpus()
    return [
        ("hydra.searchpath", ["pkg://verl.trainer.config"]),
        ("actor_rollout_ref.hybrid_engine", False),
        ("rollout.nnodes", cfg.nnodes),
        ("rollout.n_gpus_per_node", rollout),
        ("actor_rollout_ref.rollout.free_cache_engine", False),
        ("algorithm.rollout_correction.bypass_mode", True),
    ]


def agent_loop_settings(cfg: VerlConfig) -> dict[str, Any]:
    """The agent-loop YAML entry's fields (``LoopSettings`` of the agent loop): the run's
    :class:`~retool.rollout.RolloutBudgets`, the sandbox URL and the chat template."""
    budgets = {f.name: getattr(cfg, f.name) for f in fields(RolloutBudgets)}
    return {**budgets, "sandbox_url": cfg.sandbox_url, "chat_template": cfg.chat_template, "enable_thinking": False}


def overrides(cfg: VerlConfig, folder: str, train_rows: int) -> list[tuple[str, Any]]:
    """Every ``key=value`` of ``run.sh``, in order (``folder`` prefixes the written files)."""
    grad_clip = cfg.grad_clip_norm if cfg.grad_clip_norm is not None else OFF
    response_tokens = cfg.max_trajectory_tokens  # the loop's budget includes the prompt: this always fits
    steps_per_epoch = max(train_rows // cfg.batch_size, 1)
    sinks = [s for s in cfg.sinks if s != "jsonl"]
    return [
        # ---- the algorithm: GRPO, token-mean PPO-clip, no KL, no critic
        ("algorithm.adv_estimator", "grpo"),
        ("algorithm.norm_adv_by_std_in_grpo", cfg.normalize_std),
        ("algorithm.use_kl_in_reward", False),
        ("actor_rollout_ref.actor.use_kl_loss", False),
        ("actor_rollout_ref.actor.entropy_coeff", 0.0),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla"),
        ("actor_rollout_ref.actor.loss_agg_mode", "token-mean"),
        ("actor_rollout_ref.actor.clip_ratio", round(1 - cfg.clip_low, 10)),
        ("actor_rollout_ref.actor.clip_ratio_low", round(1 - cfg.clip_low, 10)),
        ("actor_rollout_ref.actor.clip_ratio_high", round(cfg.clip_high - 1, 10)),
        ("actor_rollout_ref.actor.clip_ratio_c", cfg.dual_clip if cfg.dual_clip is not None else OFF),
        ("actor_rollout_ref.actor.ppo_epochs", 1),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", cfg.batch_size),
        ("actor_rollout_ref.actor.use_dynamic_bsz", True),
        ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
         max(cfg.micro_batch_tokens, cfg.max_prompt_tokens + response_tokens)),
        # ---- the optimiser: AdamW (0.9, 0.95), constant lr, no decay, no clipping
        ("actor_rollout_ref.actor.optim.lr", cfg.lr),
        ("actor_rollout_ref.actor.optim.betas", [cfg.beta1, cfg.beta2]),
        ("actor_rollout_ref.actor.optim.weight_decay", cfg.weight_decay),
        ("actor_rollout_ref.actor.optim.clip_grad", grad_clip),
        ("actor_rollout_ref.actor.grad_clip", grad_clip),
        ("actor_rollout_ref.actor.optim.lr_scheduler_type", "constant"),
        ("actor_rollout_ref.actor.optim.lr_warmup_steps", 0),
        ("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", 0.0),
        # ---- the model and adapter
        ("actor_rollout_ref.model.path", cfg.model),
        ("actor_rollout_ref.model.lora_rank", 0 if cfg.full_finetune else cfg.lora_rank),
        ("actor_rollout_ref.model.lora_alpha", cfg.lora_alpha),
        ("actor_rollout_ref.model.target_modules", cfg.lora_targets),
        ("actor_rollout_ref.model.enable_gradient_checkpointing", cfg.gradient_checkpointing),
        ("actor_rollout_ref.model.use_remove_padding", True),
        # ---- rollout: group size, sampling, the agent loop
        ("actor_rollout_ref.rollout.name", cfg.rollout_engine),
        ("actor_rollout_ref.rollout.mode", "async"),
        ("actor_rollout_ref.rollout.n", cfg.group_size),
        ("actor_rollout_ref.rollout.temperature", cfg.temperature),
        ("actor_rollout_ref.rollout.top_p", cfg.top_p),
        ("actor_rollout_ref.rollout.top_k", -1),
        ("actor_rollout_ref.rollout.do_sample", True),
        ("actor_rollout_ref.rollout.calculate_log_probs", True),
        ("actor_rollout_ref.rollout.tensor_model_parallel_size", cfg.tensor_parallel),
        ("actor_rollout_ref.rollout.gpu_memory_utilization", cfg.gpu_memory_utilization),
        ("actor_rollout_ref.rollout.load_format", "safetensors"),
        ("actor_rollout_ref.rollout.layered_summon", not cfg.full_finetune),
        ("actor_rollout_ref.rollout.val_kwargs.n", cfg.val_samples),
        ("actor_rollout_ref.rollout.val_kwargs.temperature", cfg.val_temperature),
        ("actor_rollout_ref.rollout.val_kwargs.top_p", cfg.val_top_p),
        ("actor_rollout_ref.rollout.val_kwargs.top_k", -1),
        ("actor_rollout_ref.rollout.val_kwargs.do_sample", cfg.val_temperature > 0),
        ("actor_rollout_ref.rollout.agent.num_workers", cfg.agent_workers),
        ("actor_rollout_ref.rollout.agent.default_agent_loop", "retool"),
        ("actor_rollout_ref.rollout.agent.agent_loop_config_path", f"{folder}/agent_loop.yaml"),
        ("reward.custom_reward_function.path", f"{folder}/reward_fn.py"),
        ("reward.custom_reward_function.name", "compute_score"),
        # ---- data: batch size, lengths, order
        ("data.train_files", f"{folder}/train.parquet"),
        ("data.val_files", f"{folder}/val.parquet"),
        ("data.train_batch_size", cfg.batch_size),
        ("data.max_prompt_length", cfg.max_prompt_tokens),
        ("data.max_response_length", response_tokens),
        ("data.return_raw_chat", True),
        ("data.filter_overlong_prompts", True),
        ("data.truncation", "error"),
        ("data.shuffle", True),
        ("data.seed", cfg.seed),
        # ---- the trainer: cluster shape, length, checkpoints, validation, logs
        ("trainer.nnodes", cfg.nnodes),
        ("trainer.n_gpus_per_node", cfg.gpus_per_node - (cfg.one_step_off_rollout_gpus() if cfg.max_staleness else 0)),
        ("trainer.total_training_steps", cfg.max_steps),
        ("trainer.total_epochs", math.ceil(cfg.max_steps / steps_per_epoch)),
        ("trainer.save_freq", cfg.save_every),
        ("trainer.test_freq", cfg.test_every),
        ("trainer.val_before_train", True),
        ("trainer.critic_warmup", 0),
        ("trainer.project_name", cfg.project),
        ("trainer.experiment_name", cfg.run_name or Path(cfg.run_dir).name),
        ("trainer.default_local_dir", cfg.run_dir),
        ("trainer.logger", ["console", *sinks]),
    ] + (one_step_off_overrides(cfg) if cfg.max_staleness else [])


def hydra_value(value: Any) -> str:
    """One value in Hydra's override grammar."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        return str(value)
    text = str(value)
    if any(c in text for c in " ,[]{}()'\"=:\\") or text in ("true", "false", "null") or _is_number(text):
        return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return text


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def run_script(pairs: Sequence[tuple[str, Any]], module: str = SYNC_TRAINER) -> str:
    """``run.sh``: one ``python -m MODULE`` (verl's trainer) with every override on its own line."""
    lines = [f"    {_shell_word(f'{key}={hydra_value(value)}')}" for key, value in pairs]
    return ("#!/usr/bin/env bash\n"
            "# Written by `retool verl-config`; see docs/verl.md. Extra Hydra overrides may follow: bash run.sh key=value\n"
            "set -euo pipefail\n"
            'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"\n'
            f"python -m {module} \\\n" + " \\\n".join(lines) + ' \\\n    "$@"\n')


def _shell_word(text: str) -> str:
    """Shell-quote one override; a ``$HERE/`` path stays expandable (double quotes)."""
    if "=$HERE/" in text and not any(c in text for c in '"`\\!'):
        return '"' + text.replace("$HERE", "${HERE}") + '"'
    return shlex.quote(text)


def verl_rows(problems: Sequence[Any], split: str) -> list[dict[str, Any]]:
    """Problems in verl's RLHFDataset row layout, with ``agent_name`` = ``retool``."""
    return [{"data_source": p.data_source or split, "prompt": build_messages(p.question, tools=True),
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": p.answer},
             "extra_info": {"id": p.id, "question": p.question, "index": i, "split": split},
             "agent_name": "retool"} for i, p in enumerate(problems)]


def write_launch_folder(cfg: VerlConfig) -> Path:
    """Write the launch folder for ``cfg`` and return its path."""
    # pyarrow: heavy, only writing the launch folder needs it
    import pyarrow as pa
    import pyarrow.parquet as pq


    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, val = load_problems(cfg.train_data), load_problems(cfg.val_data)
    for name, problems, split in (("train", train, "train"), ("val", val, "test")):
        pq.write_table(pa.Table.from_pylist(verl_rows(problems, split)), out / f"{name}.parquet")
    (out / "agent_loop.yaml").write_text(agent_loop_yaml(cfg))
    (out / "reward_fn.py").write_text('"""verl reward hook: retool\'s grader (written by `retool verl-config`)."""\n'
                                      "from retool.integrations.verl.reward_fn import compute_score  # noqa: F401\n")
    script = out / "run.sh"
    script.write_text(run_script(overrides(cfg, "$HERE", len(train)), trainer_module(cfg)))
    script.chmod(0o755)
    return out


def agent_loop_yaml(cfg: VerlConfig) -> str:
    entry = {"name": "retool", "_target_": "retool.integrations.verl.agent_loop.RetoolAgentLoop",
             **agent_loop_settings(cfg)}
    # JSON values are valid YAML flow scalars (null, true, numbers, quoted strings).
    body = "\n".join(f"  {key}: {json.dumps(value)}" for key, value in entry.items())
    return "# verl agent-loop registry entry (actor_rollout_ref.rollout.agent.agent_loop_config_path)\n- " + body[2:] + "\n"


# ---------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "verl-config",
        description=__doc__.split("\n\n")[0] + " Flags override a --config TOML preset; defaults are the seed's run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_args(p, VerlConfig)
    p.set_defaults(func=_run_command)


def _run_command(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(VerlConfig, args)
        output_folder(cfg.output_dir, "--output-dir")
        out = write_launch_folder(cfg)
    except (ConfigError, DataError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"verl launch folder: {out}  (run: bash {out}/run.sh)")
    return 0

