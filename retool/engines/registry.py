"""The engine registry: engine name → where it lives, what it supports, how to install it.

:data:`ENGINES` maps a name to an :class:`EngineSpec`; the engine's module is imported
only when it is chosen (:func:`engine_module`), so importing :mod:`retool.engines` stays
cheap. Not covered: checking a run against an engine (:mod:`retool.engines.capabilities`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from retool.algo import PACKINGS
from retool.config import ConfigError
from retool.engines.base import Capabilities


@dataclass(frozen=True)
class EngineSpec:
    """One engine: where it lives, what it supports, how to install it."""

    module: str
    """Imported only when the engine is chosen."""
    summary: str
    capabilities: Capabilities
    install: str | None = None
    """What to run when the module's own dependencies are missing."""
    reads: tuple[str, ...] = ()
    """Other engines whose checkpoint folders it loads as its own (same files)."""


SERVICE_CAPABILITIES = Capabilities(full_finetune=False, dual_clip=False, behaviour_is=False, train_top_p=False,
                                    train_temperature=False, weight_sync_tolerance=0.25,
                                    weight_sync_repeatable=False, kl_anchor=False)
"""A Tinker-style service: LoRA only, no dual-clip, no temperature input, and logprobs it
does not document as taken before top-p, so no top-p < 1 in training. No sampler-trainer
correction: its losses are ``-A * exp(logprob - sampler_logprob)`` (PPO: clipped) with
per-token advantages fixed before the call, so a weight ``min(pi_old / mu, C)`` that
needs the trainer's logprobs of the same call cannot be expressed. Its sampler and trainer are separate inference stacks whose
numerics the services do not document, hence the weight-sync guard's loose 0.25 (not
measured against either service). No KL anchor (``--kl-coef``): retool keeps no sampler of the
starting weights on a service to score the rollouts with."""

ENGINES: dict[str, EngineSpec] = {
    "local": EngineSpec(
        module="retool.engines.local",
        summary="PyTorch + transformers + PEFT on the CPU or one GPU",
        capabilities=Capabilities(packings=PACKINGS),
        reads=("vllm",),
    ),
    "vllm": EngineSpec(
        module="retool.engines.vllm",
        summary="the local PEFT trainer; rollouts and evals sampled by a vLLM server (LoRA hot-swap)",
        capabilities=Capabilities(full_finetune=False, packings=PACKINGS),
        install="bash scripts/setup.sh --vllm",
        reads=("local",),
    ),
    "tinker": EngineSpec(
        module="retool.engines.tinker",
        summary="Tinker's training service through its SDK (LoRA; the service samples and trains)",
        capabilities=SERVICE_CAPABILITIES,
        install="pip install 'retool-rl[tinker]'",
    ),
    "pytrio": EngineSpec(
        module="retool.engines.pytrio",
        summary="PyTRIO, a Tinker-compatible training service, through its SDK (LoRA)",
        capabilities=SERVICE_CAPABILITIES,
        install="pip install 'retool-rl[pytrio]'",
    ),
}
"""Engine name → :class:`EngineSpec`."""

ENGINE_NAMES = tuple(ENGINES)


def engine_spec(engine: str) -> EngineSpec:
    """The registry entry of ``engine``; an unknown name is a ``ConfigError``."""
    if engine not in ENGINES:
        raise ConfigError(f"unknown engine {engine!r}; available: {', '.join(ENGINES)}")
    return ENGINES[engine]


def engine_module(engine: str) -> Any:
    """The module of ``engine``, imported now; a missing dependency is a ``ConfigError`` with its install line."""
    spec = engine_spec(engine)
    try:
        return importlib.import_module(spec.module)
    except ImportError as err:
        hint = f"; install it with: {spec.install}" if spec.install else ""
        raise ConfigError(f"engine {engine}: cannot import {spec.module} ({err}){hint}") from None
