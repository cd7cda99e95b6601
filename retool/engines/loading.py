"""Building engines: a training client for ``retool train``/``sft``, a sampler only for ``retool eval``.

Each engine module provides ``create_training_client(**options)`` (its own options),
``training_client(cfg, seed, init_from)`` (from a :class:`~retool.engines.settings.ModelConfig`)
and ``sampler(request)`` (from a :class:`SamplerRequest`, returning an :class:`EngineSampler`).
Not covered: releasing a client (:mod:`retool.engines.closing`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from retool.engines.base import EngineCheckpoint, SamplingClient, TrainingClient
from retool.engines.registry import engine_module
from retool.engines.settings import ModelConfig


@dataclass(frozen=True)
class SamplerRequest:
    """What a sampler-only engine loads: a model and, optionally, trained weights."""

    model: str
    checkpoint: EngineCheckpoint | None = None
    """The checkpoint's record; ``None`` samples the base model."""
    checkpoint_dir: str | None = None
    """The folder ``save_state`` wrote (with ``checkpoint``)."""
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 42
    settings: Any = None
    """The engine's settings section (``None``: its defaults)."""


@dataclass(frozen=True)
class EngineSampler:
    """A loaded sampler: its tokenizer, the client, and what releases it."""

    tokenizer: Any
    sampler: SamplingClient
    close: Callable[[], None] = lambda: None


def create_training_client(engine: str, **options: Any) -> TrainingClient:
    """Build the training client of ``engine`` from that engine's own options."""
    return engine_module(engine).create_training_client(**options)


def load_training_client(cfg: ModelConfig, seed: int, init_from: str | None = None) -> TrainingClient:
    """The training client ``cfg`` describes (its engine, model, adapter and settings),
    starting from the weights of the checkpoint folder ``init_from`` when given (the run
    layer resolves ``cfg.init_from`` to that folder)."""
    return engine_module(cfg.engine).training_client(cfg, seed, init_from)


def load_sampler(engine: str, request: SamplerRequest) -> EngineSampler:
    """A sampler only (no optimiser, no training state) for ``retool eval``."""
    return engine_module(engine).sampler(request)
