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
- ``submit_forward_backward`` and ``submit_optim_step`` return futures, so an engine
  behind a network can take both calls before the first has finished (as Tinker's
  futures allow); a local engine may finish each at once (:func:`run_now`). The
  blocking ``forward_backward``/``optim_step`` are the same calls, awaited.
- Failures that may pass on a retry raise :class:`TransientEngineError`; nothing else
  does.
- ``save_state`` writes a folder with an ``engine.json`` (:class:`EngineCheckpoint`):
  local files, or a pointer to a service's checkpoint.

What each engine supports is declared as :class:`Capabilities` in the registry
(``retool.engines.ENGINES``), with its settings section and how to build it.

This module only declares records and protocols; it imports nothing heavy.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from retool.types import Datum, StopReason

T = TypeVar("T")


class TransientEngineError(RuntimeError):
    """A failure that may pass if the same call is made again: a network error, a rate
    limit, a server that is restarting.

    Engines raise it (or a subclass) for exactly these, after any retrying their own SDK
    does; the rollout retries a rollout that failed with it, and every other exception
    is a real error that stops the step at once.
    """


@dataclass(frozen=True)
class Capabilities:
    """What an engine supports, declared as data and checked once before anything loads
    (``retool.engines.check_supported``); ``docs/engines.md`` has the generated table."""

    lora: bool = True
    """Trains a LoRA adapter."""
    full_finetune: bool = True
    """Trains every weight."""
    losses: tuple[str, ...] = ("ppo", "importance_sampling", "cross_entropy")
    """Loss names of ``retool.algo.LOSSES`` it computes."""
    dual_clip: bool = True
    """PPO's dual-clip constant."""
    behaviour_is: bool = True
    """A sampler-trainer correction (``--behaviour-is``): needs the trainer's own logprobs
    inside the loss, before the advantages are weighted."""
    packings: tuple[str, ...] = ("bucketed",)
    """Micro-batch layouts (``retool.algo.PACKINGS``) it honours."""
    train_top_p: bool = True
    """Samples training rollouts with top_p < 1 and still returns unfiltered logprobs."""
    train_temperature: bool = True
    """Trains at a temperature other than 1 (the trainer's logprobs at that temperature)."""
    resume: bool = True
    """``save_state``/``load_state`` restore the optimiser too (exact ``--resume``)."""
    training: bool = True
    """Has a training client at all (a sampler-only engine evaluates only)."""
    weight_sync_tolerance: float | None = 1e-3
    """The weight-sync guard's bound on max |sampler - trainer logprob| of its probe in
    float32 (``retool.weight_sync``); ``None``: the engine cannot run the check."""
    weight_sync_repeatable: bool = True
    """Scoring the same tokens on the same weights gives the same floats on both sides, so
    the guard may also require identical probe logprobs after a step that applied no
    update (a service whose numerics are not documented as repeatable is ``False``: only
    a sampler whose logprobs did not move while the trainer's did is flagged)."""
    stream_groups: bool = True
    """Takes ``forward_backward`` calls while its sampler is still sampling with the same
    weights, and losses positively homogeneous in the advantages (``--stream-groups``)."""
    max_staleness: bool = True
    """Hands out a sampler that keeps its weights while the trainer updates (``--max-staleness``
    > 0: sampling ahead of training, ``retool.pipeline``)."""
    kl_anchor: bool = True
    """Keeps its starting weights and scores datums under them (``keep_reference`` and
    ``reference_logprobs``: ``--kl-coef`` > 0)."""


ENGINE_STATE_FILE = "engine.json"
"""The file every ``save_state`` folder holds: an :class:`EngineCheckpoint` plus the
engine's own fields."""


@dataclass(frozen=True)
class EngineCheckpoint:
    """What an engine's checkpoint folder holds, as its ``engine.json`` records it.

    A local engine keeps everything in the folder (``weights`` and ``optimizer`` are file
    names in it); a service engine keeps a small folder that points at the service's own
    checkpoint (``weights`` and ``optimizer`` are service paths). Folders written before
    the ``engine`` key existed are the local engine's.
    """

    engine: str
    model: str
    weights: str
    """``adapter`` (a PEFT folder), ``model.safetensors`` or a service path."""
    optimizer: str | None
    """What restores the Adam moments (a file or a service path); ``None``: weights only."""
    full_finetune: bool = False
    lora: Mapping[str, Any] | None = None
    """The adapter's shape: ``rank``, ``alpha``, ``dropout``, ``targets``."""

    @classmethod
    def read(cls, folder: str | Path) -> EngineCheckpoint:
        """Read ``folder/engine.json``; ``FileNotFoundError`` when it is not a checkpoint."""
        path = Path(folder) / ENGINE_STATE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{folder} is not a checkpoint folder (no {ENGINE_STATE_FILE})")
        meta = json.loads(path.read_text())
        full = bool(meta.get("full_finetune", False))
        return cls(engine=meta.get("engine", "local"), model=meta.get("model") or meta["config"]["model"],
                   weights=meta.get("weights", "model.safetensors" if full else "adapter"),
                   optimizer=meta.get("optimizer", "optimizer.pt"), full_finetune=full, lora=meta.get("lora"))


def run_now(fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
    """Call ``fn`` now and return a finished future holding its result or its exception
    (how an engine whose calls complete at once meets the ``submit_*`` contract)."""
    future: Future[T] = Future()
    try:
        future.set_result(fn(*args, **kwargs))
    except Exception as err:  # handed to whoever awaits the future, as an SDK future would
        future.set_exception(err)
    return future



@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (Tinker's ``SamplingParams``).

    ``temperature`` 0 means greedy decoding (logprobs are then those of the
    temperature-1 distribution). ``top_k`` 0 and ``top_p`` 1.0 disable those filters.
    ``stop_token_ids`` end a sequence when sampled; empty means the model's
    end-of-sequence tokens. ``seed`` makes a request reproducible: the same seed, prompt
    and settings draw the same random numbers, on the local engine whichever other
    requests share its batch, so the tokens are the same wherever the logits are. The
    local sampler's batch layout (what its rows share, their padding, KV reused from an
    earlier turn) changes the logits' float rounding: in fp32 by ~5e-5 (a token rarely
    changes), in bf16 by up to tenths of a nat, so tokens can part (3 of 32 sequences
    of <= 64 tokens with the demo's SFT adapter, 31 of 32 with the base model;
    ``bench/sampler_invariance.py``). ``None`` draws from the engine's own seeded stream.
    Stop *strings* are not supported: rollouts stop on tokens.
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


CLOSE_STATUSES = ("success", "errored", "interrupted")
"""How a run ended, as ``TrainingClient.close`` is told (Tinker's session statuses)."""


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

    def submit_forward_backward(self, data: Sequence[Datum], loss_fn: str,
                                loss_fn_config: Mapping[str, float] | None = None) -> Future[ForwardBackwardOutput]:
        """``forward_backward`` as a future: returns once the call is taken, not done."""
        ...

    def submit_optim_step(self, adam_params: AdamParams) -> Future[OptimStepOutput]:
        """``optim_step`` as a future; applies after every earlier submitted call."""
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

    def close(self, status: str = "success") -> None:
        """End the run's use of the client and release what it holds (a server it started,
        an SDK session, caches); ``status`` is one of :data:`CLOSE_STATUSES`, which a
        service records with its session. A second call does nothing. A failure raises;
        :func:`retool.engines.close_training_client` reports it once."""
        ...
