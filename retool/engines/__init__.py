"""Training and sampling engines behind one Tinker-shaped interface (``retool.engines.base``).

The registry :data:`ENGINES` maps an engine name to an :class:`EngineSpec`: the module
that implements it (imported only when the engine is chosen, so importing this package
stays cheap), its settings section, and what it supports (:class:`Capabilities`). A
command chooses its engine once, by name, from its config's ``engine`` field:

- :func:`check_supported` refuses, with one line and before any model or service is
  touched, a setting the engine cannot honour (a loss, dual-clip, a packing, top-p or
  a temperature other than 1 in training, full fine-tuning, …);
- :func:`load_training_client` builds a training client for ``retool train``/``sft``;
- :func:`load_sampler` builds a *sampler only* (a tokenizer and a sampling client) for
  ``retool eval``: no optimiser, no training state.

An engine module provides ``create_training_client(**options)`` (its own options),
``training_client(cfg, seed, init_from)`` (from a :class:`ModelConfig`) and
``sampler(request)`` (from a :class:`SamplerRequest`, returning an
:class:`EngineSampler`).

Engines: ``local`` — PyTorch + transformers + PEFT on the CPU or one GPU
(``retool.engines.local``); ``tinker`` and ``pytrio`` — a Tinker-compatible training
service through its official SDK (``retool.engines.tinker``, one adapter, two flavours);
``vllm`` — the local PEFT trainer, sampling from a vLLM server with the adapter
hot-loaded after every update (``retool.engines.vllm``).

Each engine's settings are one small section of the command's config (a frozen
dataclass, e.g. :class:`LocalSettings`): ``--local-*`` flags shown under their own
heading in ``--help``, a ``[local]`` table in a TOML preset, validated with the rest.

One module per job, all re-exported here: :mod:`~retool.engines.settings` (the sections,
:class:`EngineChoice`, :class:`ModelConfig`, :data:`DEFAULT_MODEL`),
:mod:`~retool.engines.registry` (:data:`ENGINES`), :mod:`~retool.engines.capabilities`
(:func:`check_supported`), :mod:`~retool.engines.loading` (:func:`load_training_client`,
:func:`load_sampler`) and :mod:`~retool.engines.closing` (:func:`close_training_client`).
"""

from __future__ import annotations

from retool.engines.base import (
    AdamParams,
    Capabilities,
    EngineCheckpoint,
    ForwardBackwardOutput,
    OptimStepOutput,
    SampledSequence,
    SampleResult,
    SamplingClient,
    SamplingParams,
    TrainingClient,
    TransientEngineError,
    run_now,
)
from retool.engines.capabilities import CAPABILITY_COLUMNS, Requirements, capabilities_table, check_supported, reads_checkpoint
from retool.engines.closing import close_training_client
from retool.engines.loading import (
    EngineSampler,
    SamplerRequest,
    create_training_client,
    load_sampler,
    load_training_client,
)
from retool.engines.registry import ENGINE_NAMES, ENGINES, SERVICE_CAPABILITIES, EngineSpec, engine_spec
from retool.engines.settings import (
    DEFAULT_MODEL,
    EngineChoice,
    LocalSettings,
    ModelConfig,
    ServiceSettings,
    VLLMSettings,
)


__all__ = [
    "CAPABILITY_COLUMNS", "DEFAULT_MODEL", "ENGINES", "ENGINE_NAMES", "SERVICE_CAPABILITIES", "AdamParams", "Capabilities", "EngineCheckpoint", "EngineChoice", "EngineSampler",
    "EngineSpec", "ForwardBackwardOutput", "LocalSettings", "ModelConfig", "OptimStepOutput", "Requirements",
    "SampleResult", "SampledSequence", "SamplerRequest", "SamplingClient", "SamplingParams", "ServiceSettings",
    "TrainingClient", "TransientEngineError", "VLLMSettings", "capabilities_table", "check_supported",
    "close_training_client", "create_training_client", "engine_spec", "load_sampler", "load_training_client",
    "reads_checkpoint", "run_now",
]
