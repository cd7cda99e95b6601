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
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retool.algo import PACKINGS
from retool.config import ConfigError, option, require, validate_sections
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

# ---------------------------------------------------------------- settings sections


@dataclass(frozen=True)
class LocalSettings:
    """Settings of the local engine's sampler (``--local-*``; ``[local]`` in a preset)."""

    sample_window_s: float = option(0.01, "how long the sampler gathers concurrent requests into one "
                                          "generate call")
    max_sample_rows: int = option(64, "most sequences generated together in one generate call")
    prefix_cache: bool = option(True, "compute a prompt prefix the rows of a generate call share once")
    kv_cache_mb: int = option(1024, "memory for earlier sequences' KV, so a trajectory's next turn prefills "
                                    "only its new tokens; 0 = off")
    fast_sampling: bool = option(True, "the sampler's fast path (prefix cache, KV store, reserved decode room) on "
                                       "a tested transformers release; off = plain generate, same tokens, slower")

    def validate(self) -> None:
        require(self.sample_window_s >= 0, f"local_sample_window_s must be >= 0, got {self.sample_window_s}")
        require(self.max_sample_rows >= 1, f"local_max_sample_rows must be >= 1, got {self.max_sample_rows}")
        require(self.kv_cache_mb >= 0, f"local_kv_cache_mb must be >= 0, got {self.kv_cache_mb}")


@dataclass(frozen=True)
class ServiceSettings:
    """Settings of a Tinker-compatible service (``--tinker-*`` / ``--pytrio-*``; ``[tinker]`` /
    ``[pytrio]`` in a preset). The API key is never a setting: the SDK reads it from its
    own environment variable (``TINKER_API_KEY`` / ``PYTRIO_API_KEY``)."""

    base_url: str | None = option(None, "service URL; none = the SDK's own environment variable "
                                        "(TINKER_BASE_URL / PYTRIO_BASE_URL) or its default")
    sample_concurrency: int = option(64, "most sample requests in flight at once")
    retry_timeout_s: float | None = option(None, "how long the SDK keeps retrying a request that makes no progress "
                                                 "before it fails (its own retries; none = the SDK's default)")
    train_unembed: bool = option(False, "train a LoRA on the unembedding (output layer) too, as the SDKs' own "
                                        "default and the reference run do; off = retool's choice, attention and "
                                        "MLP only")
    adam_eps: float | None = option(None, "Adam epsilon sent to the service; none = retool's 1e-8 (the SDKs' "
                                          "default and the reference run's: 1e-12)")
    tokenizer: str | None = option(None, "local tokenizer folder (tokenizer.json + chat template) to load instead "
                                         "of the model's from the Hugging Face hub; the service is still asked "
                                         "for the model by name")

    def validate(self) -> None:
        require(self.adam_eps is None or self.adam_eps > 0, f"adam_eps must be > 0, got {self.adam_eps}")
        require(self.tokenizer is None or Path(self.tokenizer).is_dir(),
                f"tokenizer must be a folder of tokenizer files, got {self.tokenizer!r}")
        require(self.sample_concurrency >= 1, f"sample_concurrency must be >= 1, got {self.sample_concurrency}")
        require(self.retry_timeout_s is None or self.retry_timeout_s > 0,
                f"retry_timeout_s must be > 0, got {self.retry_timeout_s}")


@dataclass(frozen=True)
class VLLMSettings:
    """Settings of the vLLM engine's server (``--vllm-*``; ``[vllm]`` in a preset)."""

    url: str | None = option(None, "use this running vLLM server (e.g. http://host:8000) instead of starting "
                                   "one; training with it needs --vllm-adapter-dir")
    adapter_dir: str | None = option(None, "folder for adapters the server hot-loads, at the same path on both "
                                           "sides (default: a temporary folder, for a server retool starts)")
    venv: str = option(".venv-vllm", "environment whose `vllm` starts the server (scripts/setup.sh --vllm)")
    kv_cache_gib: int = option(2, "KV cache memory of a CPU server in GiB (VLLM_CPU_KVCACHE_SPACE, whole GiB)")
    gpu_memory_utilization: float = option(0.35, "share of GPU memory a GPU server takes (the trainer shares "
                                                 "the GPU)")
    max_model_len: int = option(0, "longest sequence the server accepts; 0 = the model's own limit")
    startup_timeout_s: float = option(900.0, "how long to wait for a started server to become healthy")
    request_timeout_s: float = option(900.0, "how long one sampling request may take")
    extra_args: str = option("", "more `vllm serve` arguments, space-separated")

    def validate(self) -> None:
        require(self.kv_cache_gib > 0, f"vllm_kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        require(0 < self.gpu_memory_utilization <= 1,
                f"vllm_gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        require(self.max_model_len >= 0, f"vllm_max_model_len must be >= 0, got {self.max_model_len}")
        require(self.startup_timeout_s > 0 and self.request_timeout_s > 0, "vllm timeouts must be > 0")
        require(self.url is None or self.url.startswith(("http://", "https://")),
                f"vllm_url must start with http:// or https://, got {self.url!r}")


# ---------------------------------------------------------------- the registry


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
                                    train_temperature=False)
"""A Tinker-style service: LoRA only, no dual-clip, no temperature input, and logprobs it
does not document as taken before top-p, so no top-p < 1 in training. No sampler-trainer
correction: its losses are ``-A * exp(logprob - sampler_logprob)`` (PPO: clipped) with
per-token advantages fixed before the call, so a weight ``min(pi_old / mu, C)`` that
needs the trainer's logprobs of the same call cannot be expressed."""

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


def _engine_module(engine: str) -> Any:
    spec = engine_spec(engine)
    try:
        return importlib.import_module(spec.module)
    except ImportError as err:
        hint = f"; install it with: {spec.install}" if spec.install else ""
        raise ConfigError(f"engine {engine}: cannot import {spec.module} ({err}){hint}") from None


# ---------------------------------------------------------------- config


@dataclass
class EngineChoice:
    """Which engine a command runs on, and each engine's settings section."""

    engine: str = option("local", "training/sampling engine (see docs/engines.md)", choices=ENGINE_NAMES)
    local: LocalSettings = option(LocalSettings(), "settings of the local engine (--engine local)")
    tinker: ServiceSettings = option(ServiceSettings(), "settings of the Tinker service (--engine tinker)")
    pytrio: ServiceSettings = option(ServiceSettings(), "settings of the PyTRIO service (--engine pytrio)")
    vllm: VLLMSettings = option(VLLMSettings(), "settings of the vLLM engine (--engine vllm)")

    def engine_settings(self) -> Any:
        """The settings section of the chosen engine."""
        return getattr(self, self.engine)

    def validate_engine(self) -> None:
        engine_spec(self.engine)
        validate_sections(self)

    @staticmethod
    def upgrade_saved(data: dict[str, Any]) -> dict[str, Any]:
        """A run folder's saved config in today's layout: ``price_table`` and ``max_cost``
        were service settings (``tinker.max_cost``) and are now the command's own."""
        for name in ("tinker", "pytrio"):
            section = data.get(name)
            if not isinstance(section, dict):
                continue
            for key in ("price_table", "max_cost"):
                value = section.pop(key, None)
                if value is not None and data.get("engine") == name:
                    data.setdefault(key, value)
        return data


@dataclass
class ModelConfig(EngineChoice):
    """Which model a training engine holds and how it is adapted.

    The fields ``retool train`` and ``retool sft`` share (both configs subclass this), so
    an SFT run and the RL run that continues from it (``--init-from``) are described by
    the same settings; :func:`load_training_client` builds the engine from them.
    """

    model: str = option("Qwen/Qwen3.5-4B", "HF model id, local folder, or bundled:smollm2")
    chat_template: str | None = option(None, "chat-template override: 'hermes', a .jinja file, or Jinja source")
    device: str = option("auto", "auto, cpu, cuda or cuda:N")
    dtype: str = option("auto", "auto (fp32 on CPU, bf16 on GPU), float32 or bfloat16")
    full_finetune: bool = option(False, "train all weights instead of a LoRA adapter")
    lora_rank: int = option(32, "LoRA rank")
    lora_alpha: float = option(32.0, "LoRA alpha (scale = alpha / rank)")
    lora_targets: str = option("all-linear", "LoRA target modules: all-linear or comma-separated names")
    gradient_checkpointing: bool = option(False, "recompute activations to save memory")
    micro_batch_tokens: int = option(4096, "token budget of one forward/backward micro-batch")
    packing: str = option("bucketed", "micro-batch layout: bucketed (padded rows, any model), packed (one "
                          "padding-free row) or shared-prefix (packed, shared prompt prefix computed once: "
                          "2-3x faster for short turns under a long prompt; pure-attention models only; "
                          "a row's attention grows with its length squared, so keep micro_batch_tokens "
                          "~1-2k on a CPU)",
                          choices=PACKINGS)
    logprob_chunk_tokens: int = option(0, "compute the output layer and log-softmax this many tokens at a time, "
                                          "recomputed in the backward (logits memory N x vocabulary instead of "
                                          "micro-batch x vocabulary; same values); 0 = full logits; local and "
                                          "vllm engines (services compute logprobs on their side)")
    init_from: str | None = option(None, "start from these weights: an SFT/RL run folder or a checkpoint folder")

    def validate_model(self) -> None:
        """Reject bad model/adapter/engine values (raises ``retool.config.ConfigError``)."""
        self.validate_engine()
        for name in ("lora_rank", "micro_batch_tokens"):
            require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        require(self.logprob_chunk_tokens >= 0, f"logprob_chunk_tokens must be >= 0, got {self.logprob_chunk_tokens}")
        require(self.lora_alpha > 0, f"lora_alpha must be > 0, got {self.lora_alpha}")
        require(self.dtype in ("auto", "float32", "bfloat16"),
                f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        require(bool(self.lora_targets.strip()), "lora_targets must name at least one module (or all-linear)")


# ---------------------------------------------------------------- what an engine supports


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


# ---------------------------------------------------------------- building engines


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
    return _engine_module(engine).create_training_client(**options)


def load_training_client(cfg: ModelConfig, seed: int, init_from: str | None = None) -> TrainingClient:
    """The training client ``cfg`` describes (its engine, model, adapter and settings),
    starting from the weights of the checkpoint folder ``init_from`` when given (the run
    layer resolves ``cfg.init_from`` to that folder)."""
    return _engine_module(cfg.engine).training_client(cfg, seed, init_from)


def close_training_client(engine: Any, error: BaseException | None = None) -> None:
    """Release what a training client holds when its run ends (``error``: what ended it,
    ``None`` for a normal end). A service engine ends its SDK session there (Tinker:
    the session is finished and the SDK's background heartbeat, config refresh and
    telemetry stop); an engine without a ``close`` holds nothing to release. Never
    raises: the run's own outcome stands."""
    close = getattr(engine, "close", None)
    if close is None:
        return
    if error is None:
        status = "success"
    elif isinstance(error, Exception):
        status = "errored"
    else:  # KeyboardInterrupt, SystemExit
        status = "interrupted"
    try:
        close(status)
    except Exception:  # noqa: BLE001 - closing is best effort
        pass


def load_sampler(engine: str, request: SamplerRequest) -> EngineSampler:
    """A sampler only (no optimiser, no training state) for ``retool eval``."""
    return _engine_module(engine).sampler(request)


__all__ = [
    "ENGINES", "ENGINE_NAMES", "AdamParams", "Capabilities", "EngineCheckpoint", "EngineChoice", "EngineSampler",
    "EngineSpec", "ForwardBackwardOutput", "LocalSettings", "ModelConfig", "OptimStepOutput", "Requirements",
    "SampleResult", "SampledSequence", "SamplerRequest", "SamplingClient", "SamplingParams", "ServiceSettings",
    "TrainingClient", "TransientEngineError", "VLLMSettings", "capabilities_table", "check_supported",
    "close_training_client", "create_training_client", "engine_spec", "load_sampler", "load_training_client",
    "reads_checkpoint", "run_now",
]
