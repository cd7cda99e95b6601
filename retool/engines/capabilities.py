"""What a run asks of its engine (:class:`Requirements`), checked against what the engine
supports (:class:`~retool.engines.base.Capabilities`, in :data:`~retool.engines.registry.ENGINES`)
before any model or service is touched; and the capability table of ``docs/engines.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from retool.config import ConfigError
from retool.engines.base import Capabilities
from retool.engines.registry import ENGINES, engine_spec


@dataclass(frozen=True)
class Requirements:
    """What a run asks of its engine, checked against its :class:`Capabilities`."""

    training: bool = True
    full_finetune: bool = False
    loss: str | None = None
    dual_clip: bool = False
    behaviour_is: bool = False
    packing: str = "bucketed"
    train_top_p: float = 1.0
    train_temperature: float = 1.0
    resume: bool = False
    weight_sync: bool = False
    stream_groups: bool = False
    max_staleness: bool = False
    kl_anchor: bool = False


def reads_checkpoint(engine: str, written_by: str) -> bool:
    """Whether ``engine`` loads a checkpoint folder that ``written_by`` wrote."""
    return written_by == engine or written_by in engine_spec(engine).reads


def check_supported(engine: str, needs: Requirements) -> None:
    """Refuse, with one ``ConfigError`` line, what ``engine`` cannot do for this run."""
    caps = engine_spec(engine).capabilities
    problems = [what for ok, what in (
        (caps.training or not needs.training, "training (it only samples: use it with retool eval)"),
        (caps.full_finetune or not needs.full_finetune, "full fine-tuning (use a LoRA adapter)"),
        (caps.lora or needs.full_finetune or not needs.training, "LoRA adapters (use --full-finetune)"),
        (needs.loss is None or needs.loss in caps.losses, f"the {needs.loss} loss"),
        (caps.dual_clip or not needs.dual_clip, "PPO dual-clip (leave --dual-clip unset)"),
        (caps.behaviour_is or not needs.behaviour_is,
         "--behaviour-is (its losses take no trainer-side pi_old to weight tokens by; use --behaviour-is off)"),
        (needs.packing in caps.packings, f"--packing {needs.packing} (use {' or '.join(caps.packings)})"),
        (caps.train_top_p or needs.train_top_p == 1.0, "top_p < 1 in training rollouts (use --top-p 1)"),
        (caps.train_temperature or needs.train_temperature == 1.0, "a training temperature other than 1"),
        (caps.resume or not needs.resume, "--resume (its checkpoints hold no optimiser state)"),
        (caps.weight_sync_tolerance is not None or not needs.weight_sync,
         "the weight-sync check (use --weight-sync-check-every 0)"),
        (caps.stream_groups or not needs.stream_groups,
         "--stream-groups (it cannot train while it samples; leave --stream-groups off)"),
        (caps.max_staleness or not needs.max_staleness,
         "--max-staleness > 0 (its sampler cannot keep older weights while it trains; use --max-staleness 0)"),
        (caps.kl_anchor or not needs.kl_anchor,
         "--kl-coef > 0 (retool does not score rollouts under the starting weights on it; use --kl-coef 0)"),
    ) if not ok]
    if problems:
        raise ConfigError(f"engine {engine} does not support {problems[0]}")


CAPABILITY_COLUMNS: tuple[tuple[str, Callable[[Capabilities], str]], ...] = (
    ("LoRA", lambda c: _yes(c.lora)),
    ("full fine-tuning", lambda c: _yes(c.full_finetune)),
    ("losses", lambda c: ", ".join(c.losses)),
    ("dual-clip", lambda c: _yes(c.dual_clip)),
    ("behaviour IS", lambda c: _yes(c.behaviour_is)),
    ("packing", lambda c: ", ".join(c.packings)),
    ("top-p < 1 in training", lambda c: _yes(c.train_top_p)),
    ("temperature ≠ 1 in training", lambda c: _yes(c.train_temperature)),
    ("exact resume", lambda c: _yes(c.resume)),
    ("weight-sync tolerance", lambda c: "no check" if c.weight_sync_tolerance is None else
     f"{c.weight_sync_tolerance:g}" + ("" if c.weight_sync_repeatable else " (not repeatable: stale rule only)")),
    ("streaming (`--stream-groups`)", lambda c: _yes(c.stream_groups)),
    ("sampling ahead (`--max-staleness`)", lambda c: _yes(c.max_staleness)),
    ("KL anchor (`--kl-coef`)", lambda c: _yes(c.kl_anchor)),
)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def capabilities_table() -> str:
    """A Markdown table of every engine's capabilities (``docs/engines.md`` holds it)."""
    rows = ["| engine | " + " | ".join(name for name, _ in CAPABILITY_COLUMNS) + " |",
            "|---" * (len(CAPABILITY_COLUMNS) + 1) + "|"]
    for name, spec in ENGINES.items():
        cells = [show(spec.capabilities) for _, show in CAPABILITY_COLUMNS]
        rows.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"
