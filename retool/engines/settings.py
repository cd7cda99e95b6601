"""Engine settings: which engine a command runs on, each engine's section, and the model.

:class:`EngineChoice` is the ``engine`` field and one small frozen section per engine
(:class:`LocalSettings`, :class:`ServiceSettings`, :class:`VLLMSettings`): ``--local-*``
flags under their own heading in ``--help``, a ``[local]`` table in a TOML preset,
validated with the rest. :class:`ModelConfig` adds the model and its adapter, shared by
``retool train`` and ``retool sft``. Not covered: what an engine supports
(:mod:`retool.engines.capabilities`) and building one (:mod:`retool.engines.loading`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retool.algo import PACKINGS
from retool.config import option, require, validate_sections
from retool.engines.registry import ENGINE_NAMES, engine_spec

TRAIN_PRECISIONS = ("auto", "fp32", "bf16")
"""Arithmetic of the local trainer's forward and backward (``LocalEngineConfig.train_precision``)."""

DEFAULT_MODEL = "Qwen/Qwen3.5-4B"
"""The model ``retool train``, ``sft`` and ``eval`` use when none is given: the reference
run's. The demo passes its own (``bundled:smollm2``); engines take the model they are given."""


@dataclass(frozen=True)
class LocalSettings:
    """Settings of the local engine's sampler (``--local-*``; ``[local]`` in a preset),
    handed as one record to ``LocalEngineConfig.sampler`` and ``LocalSamplingClient``."""

    sample_window_s: float = option(0.05, "how long the sampler waits for another request before it starts a "
                                          "batch (each arrival waits again, up to local_sample_gather_s)")
    sample_gather_s: float = option(1.0, "most time the sampler keeps gathering requests that keep arriving into "
                                         "one batch")
    max_sample_rows: int = option(64, "most sequences generated together in one generate call")
    continuous_batching: bool = option(True, "lean decode loop: rows join a running batch as others finish (the "
                                             "batch's later rows, and next turns of the same settings), within "
                                             "local_max_sample_rows and local_batch_kv_mb; off = each batch's rows "
                                             "in chunks, one after another")
    prefix_cache: bool = option(True, "compute a prompt prefix the rows of a generate call share once")
    kv_cache_mb: int = option(512, "memory for earlier sequences' KV, so a trajectory's next turn prefills "
                                   "only its new tokens (a shared system prompt is kept once); 0 = off")
    batch_kv_mb: int = option(512, "most memory one decode batch's KV cache may take: a batch holds fewer "
                                   "rows (down to one) when theirs would take more; 0 = no limit")
    fast_sampling: bool = option(True, "the sampler's fast path (prefix cache, KV store, reserved decode room, "
                                       "own decode loop) on a tested transformers release; off = plain generate, "
                                       "same tokens, slower")
    decode_loop: str = option("lean", "lean = the sampler's decode loop with lean steps (merged LoRA weights, "
                                      "shared prefix read once; Llama/Qwen models, others get own); own = that "
                                      "loop through the model's forward (drops finished rows from the batch); "
                                      "generate = one HF generate call per batch, the first path",
                              choices=("lean", "own", "generate"))
    precision: str = option("fp32", "number format the sampler decodes in: fp32 = the trainer's weights as they "
                                    "are (float32 on a CPU); bf16 = a bfloat16 copy of the merged weights, KV "
                                    "cache and KV store (half the memory, faster products on a CPU with native "
                                    "bf16: avx512_bf16/AMX; lean decode loop only; logprobs are the bf16 "
                                    "model's); auto = bf16 where the CPU or GPU computes bf16 natively, else "
                                    "fp32", choices=("fp32", "bf16", "auto"))
    spill_base: bool = option(False, "while the sampler decodes from its merged copy (LoRA, lean loop), move the "
                                     "trainer's frozen layer matrices out of memory to a temporary file and read "
                                     "them back for training: the same results, the model's layer weights less "
                                     "memory during sampling (425 MB for SmolLM2-135M in fp32); off under "
                                     "--max-staleness > 0 or where the temporary folder is in memory")

    def validate(self) -> None:
        require(self.sample_window_s >= 0, f"local_sample_window_s must be >= 0, got {self.sample_window_s}")
        require(self.sample_gather_s >= 0, f"local_sample_gather_s must be >= 0, got {self.sample_gather_s}")
        require(self.max_sample_rows >= 1, f"local_max_sample_rows must be >= 1, got {self.max_sample_rows}")
        require(self.kv_cache_mb >= 0, f"local_kv_cache_mb must be >= 0, got {self.kv_cache_mb}")
        require(self.batch_kv_mb >= 0, f"local_batch_kv_mb must be >= 0, got {self.batch_kv_mb}")
        require(self.precision in ("fp32", "bf16", "auto"),
                f"local_precision must be fp32, bf16 or auto, got {self.precision!r}")
        require(self.precision != "bf16" or (self.decode_loop == "lean" and self.fast_sampling),
                "local_precision bf16 needs local_decode_loop lean and local_fast_sampling on (the other decode "
                "paths run the trainer's own fp32 model)")


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

    model: str = option(DEFAULT_MODEL, "HF model id, local folder, or bundled:smollm2")
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
                          "padding-free row), shared-prefix (packed, shared prompt prefix computed once: "
                          "2-3x faster for short turns under a long prompt) or prefix-tree (packed as the "
                          "sequences' prefix tree: every prefix two or more share runs once, e.g. a group's "
                          "question and its samples' common opening); pure-attention models only; a row's "
                          "attention grows with its length squared, so keep micro_batch_tokens ~1-2k on a CPU",
                          choices=PACKINGS)
    logprob_chunk_tokens: int = option(0, "compute the output layer and log-softmax this many tokens at a time, "
                                          "recomputed in the backward (logits memory N x vocabulary instead of "
                                          "micro-batch x vocabulary; same values); 0 = full logits; local and "
                                          "vllm engines (services compute logprobs on their side)")
    prefix_once: bool = option(False, "with packing shared-prefix or prefix-tree: run the prompt prefix all "
                                      "sequences of a training call share once per call, not once per micro-batch "
                                      "(same values; local engine only)")
    train_precision: str = option("fp32", "arithmetic of the training forward/backward: fp32; bf16 (autocast over "
                                          "fp32 weights, head, loss and Adam in fp32: ~2x faster on a CPU with "
                                          "native bf16, many times slower on one without); auto = bf16 on CUDA or "
                                          "a CPU with native bf16, else fp32; local and vllm engines",
                                  choices=TRAIN_PRECISIONS)
    init_from: str | None = option(None, "start from these weights: an SFT/RL run folder or a checkpoint folder")

    def validate_model(self) -> None:
        """Reject bad model/adapter/engine values (raises ``retool.config.ConfigError``)."""
        self.validate_engine()
        for name in ("lora_rank", "micro_batch_tokens"):
            require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        require(self.logprob_chunk_tokens >= 0, f"logprob_chunk_tokens must be >= 0, got {self.logprob_chunk_tokens}")
        require(self.lora_alpha > 0, f"lora_alpha must be > 0, got {self.lora_alpha}")
        require(self.train_precision in TRAIN_PRECISIONS,
                f"train_precision must be one of {', '.join(TRAIN_PRECISIONS)}, got {self.train_precision!r}")
        require(self.dtype in ("auto", "float32", "bfloat16"),
                f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        require(bool(self.lora_targets.strip()), "lora_targets must name at least one module (or all-linear)")
