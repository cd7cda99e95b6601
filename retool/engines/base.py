"""The two roles every training backend plays, shaped like the Tinker API.

The trainer talks to a backend only through these two interfaces, which mirror the
Tinker API that the seed's training service (PyTRIO) clones:

- a **training client**: ``forward_backward(data, loss_fn, loss_fn_config)`` computes
  the trainer's logprobs of every target token and accumulates the gradient of the
  chosen loss (``retool.algo.LOSSES``); ``optim_step(adam_params)`` applies one Adam
  update; ``save_state``/``load_state`` checkpoint everything an exact resume needs;
  ``save_weights_for_sampler`` hands back a sampling client that samples with the
  current weights.
- a **sampling client**: ``await sample(prompt_tokens, num_samples, sampling_params)``
  returns ``num_samples`` continuations with per-token logprobs and a stop reason.

Contract shared by every engine:

- Sampler logprobs are ``log_softmax(logits / temperature)`` of the sampled token,
  taken *before* top-k/top-p filtering, i.e. the logprob under the unmodified policy at
  the sampling temperature, which is what the trainer recomputes.
- A sequence that ends on a stop token *includes* that token (with its logprob) and has
  ``stop_reason == StopReason.STOP``; one cut by ``max_tokens`` has ``LENGTH``.
- Losses are aggregated as the token mean over all trained tokens (non-zero weight) of
  one ``forward_backward`` call; calling it twice before ``optim_step`` adds the two
  gradients.
- A non-finite loss or gradient raises ``FloatingPointError``; the pending gradient is
  discarded and the weights stay untouched.

This module only declares records and protocols; it imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from retool.algo import PACKINGS
from retool.config import option, require
from retool.types import Datum, StopReason



@dataclass
class ModelConfig:
    """Which model a training engine holds and how it is adapted.

    The fields ``retool train`` and ``retool sft`` share (both configs subclass this), so
    an SFT run and the RL run that continues from it (``--init-from``) are described by
    the same settings; ``retool.train.load_engine`` builds the engine from them.
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
    init_from: str | None = option(None, "start from these weights: an SFT/RL run folder or a checkpoint folder")

    def validate_model(self) -> None:
        """Reject bad model/adapter values (raises ``retool.config.ConfigError``)."""
        for name in ("lora_rank", "micro_batch_tokens"):
            require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        require(self.lora_alpha > 0, f"lora_alpha must be > 0, got {self.lora_alpha}")
        require(self.dtype in ("auto", "float32", "bfloat16"),
                f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        require(bool(self.lora_targets.strip()), "lora_targets must name at least one module (or all-linear)")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (Tinker's ``SamplingParams``).

    ``temperature`` 0 means greedy decoding (logprobs are then those of the
    temperature-1 distribution). ``top_k`` 0 and ``top_p`` 1.0 disable those filters.
    ``stop_token_ids`` end a sequence when sampled; empty means the model's
    end-of-sequence tokens. ``seed`` makes a request reproducible: the same seed, prompt
    and settings give the same tokens (on the local engine whichever other requests
    share its batch); ``None`` draws from the engine's own seeded stream. Stop *strings*
    are not supported: rollouts stop on tokens.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@dataclass(frozen=True)
class SampledSequence:
    """One sampled continuation: its tokens, their sampler logprobs, why it ended.

    ``tokens`` include the stop token when ``stop_reason`` is ``STOP``.
    """

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    stop_reason: StopReason


@dataclass(frozen=True)
class SampleResult:
    """The answer to one ``sample`` call: ``num_samples`` sequences, in order."""

    sequences: tuple[SampledSequence, ...]


@dataclass(frozen=True)
class AdamParams:
    """Adam hyper-parameters of one ``optim_step`` (Tinker's ``AdamParams``).

    Defaults are the seed's: lr 4e-5, betas (0.9, 0.95). ``weight_decay`` > 0 makes it
    AdamW (decoupled decay). ``grad_clip_norm`` clips the global gradient norm before
    the step; ``None`` only measures it.
    """

    learning_rate: float = 4e-5
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float | None = None

    def __post_init__(self) -> None:
        if self.learning_rate < 0 or self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(f"invalid AdamParams {self}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"Adam betas must be in [0, 1), got ({self.beta1}, {self.beta2})")
        if self.grad_clip_norm is not None and self.grad_clip_norm <= 0:
            raise ValueError("grad_clip_norm must be > 0 or None")


@dataclass(frozen=True)
class ForwardBackwardOutput:
    """What one ``forward_backward`` call returns.

    ``logprobs_D`` holds, per datum and in input order, the trainer's logprob of every
    target token (at the loss config's temperature). ``metrics`` (slash-namespaced,
    ``train/...``): ``loss`` (token mean), ``tokens`` (trained tokens), ``sequences``,
    ``micro_batches``, and for RL losses ``sampler_logprob_diff`` (mean
    |sampler - trainer logprob| over trained tokens) and ``approx_kl`` (k3 estimate of
    KL(sampler || trainer)); for PPO ``clip_frac`` (share of trained tokens whose
    gradient a clip zeroed).
    """

    logprobs_D: tuple[tuple[float, ...], ...]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class OptimStepOutput:
    """What one ``optim_step`` returns: ``train/grad_norm`` (before clipping),
    ``train/lr`` and ``train/optim_steps`` (updates applied so far)."""

    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class SamplingClient(Protocol):
    """Samples continuations of token prompts with some fixed weights."""

    async def sample(self, prompt_tokens: Sequence[int], num_samples: int,
                     sampling_params: SamplingParams) -> SampleResult:
        """``num_samples`` independent continuations of ``prompt_tokens``.

        Safe to call concurrently from many asyncio tasks; engines may batch the calls.
        """
        ...


@runtime_checkable
class TrainingClient(Protocol):
    """Holds trainable weights and their optimiser state."""

    def get_tokenizer(self) -> Any:
        """The Hugging Face tokenizer of the model being trained."""
        ...

    def forward_backward(self, data: Sequence[Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, float] | None = None) -> ForwardBackwardOutput:
        """Compute trainer logprobs and accumulate the gradient of ``loss_fn`` over ``data``.

        ``loss_fn`` is a key of ``retool.algo.LOSSES``; ``loss_fn_config`` overrides its
        defaults (``retool.algo.loss_config``). Blocks until done.
        """
        ...

    def optim_step(self, adam_params: AdamParams) -> OptimStepOutput:
        """Apply one Adam update with the accumulated gradient, then clear it."""
        ...

    def save_state(self, path: str | Path) -> Path:
        """Write weights, optimiser moments and RNG states to the folder ``path``."""
        ...

    def load_state(self, path: str | Path) -> None:
        """Restore exactly what ``save_state`` wrote (weights, optimiser, RNG states)."""
        ...

    def save_weights_for_sampler(self, name: str | None = None) -> SamplingClient:
        """A sampling client that samples with the weights as they are now."""
        ...
