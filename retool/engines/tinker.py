"""The ``tinker`` and ``pytrio`` engines: train and sample on a Tinker-compatible service.

One adapter, two flavours (:data:`TINKER`, :data:`PYTRIO`), each over its official SDK
(``tinker`` 0.38, ``pytrio`` 0.2), imported only when that engine is chosen. The
service samples, runs forward/backward and applies Adam; this process runs the
rollouts, the sandbox and the grader, exactly as with the local engine.

**The loss.** Ours is the token mean over the trained tokens of one ``forward_backward``
call (interpreter tokens weigh 0). The services differ:

- Tinker documents ``ppo``/``importance_sampling``/``cross_entropy`` as a token *sum*
  with no weight input for the RL losses (a masked token gets advantage 0). The adapter
  sends advantages (cross-entropy: weights) multiplied by ``weight / N``, ``N`` the
  call's trained tokens: the service's sum is then our mean, token by token (PPO's clip
  decision does not depend on the advantage's scale), so the gradient is the local
  engine's.
- PyTRIO does not document it. Its 0.2.9 client counts whole-batch totals
  (``total_active_tokens``: targets that are not ``-100``) before it micro-batches,
  sends them with every chunk and reports ``loss_mean = loss_sum / token_count``, so
  its server divides the summed loss by the active-token count of the call
  (*inferred* from the client code, not documented). The adapter therefore sends
  unscaled advantages and marks untrained targets ``-100``; weights must be 0 or 1.
  ``tests/test_denominator_probe.py`` tells the candidate denominators apart by the
  update each would cause and checks the inference against the live service when a key
  is present; until then the gradient equals the local engine's only if it holds.

**Distinct samples.** Tinker has an open report that one seeded request for ``n > 1``
samples returns identical sequences. :func:`plan_requests` never sends that: Tinker gets
``n`` single-sample requests seeded from the sample index (replayable; each prefills the
prompt, which Tinker's prefix cache may serve), PyTRIO one request with ``seed=None``
(distinct, not replayable; one prefill). Requests, splits, prompt tokens prefilled and
cached are counted (:data:`USAGE_METRICS`) for the cost meter.

Both: no dual-clip, no temperature input (a training temperature must be 1), LoRA only
(all linear layers; the service's own alpha), top-p < 1 only in evaluation (neither
SDK documents its logprobs as taken before the nucleus filter). These are declared in
the registry's ``Capabilities`` and refused before anything loads.

**On-policy, overlapped.** ``save_weights_for_sampler`` returns a sampling client on
the current weights through the SDK's ephemeral ``save_weights_and_get_sampling_client``
(the trainer asks for one every step; no named checkpoint per step);
``submit_forward_backward`` and ``submit_optim_step`` hand both calls to the SDK before
either finishes (the SDK orders them); ``sample`` calls run in a thread pool, so many
are in flight. The metrics the local engine reports (``train/loss``,
``train/sampler_logprob_diff``, ``train/approx_kl``, ``train/clip_frac``) are computed
here from the logprobs the service returns, with ``retool.algo``'s losses.

**Faults.** The SDKs retry transient failures themselves (Tinker: its HTTP client, its
request layer and futures, and its sampling ``RetryConfig`` with the progress timeout;
PyTRIO: ``pytrio.configure`` retries; ``retry_timeout_s`` sets the sampling timeout of
both); the adapter adds no second layer around a request. The SDKs' own retries are
counted in ``engine/retries`` (:mod:`retool.engines.sdk_retries`). What still fails
once the SDK gives up is counted in ``engine/errors`` and, when it may pass later (a
timeout, 408/429/5xx), raised as ``TransientEngineError``: the trainer then re-runs the
rollout (``--max-retries``; counted in ``engine/retries`` too). An ``optim_step`` is
never re-sent. An authentication error or an unknown model stops the run at once with
one line. Inputs are checked for
non-finite values before anything is sent, so a poisoned batch never reaches the service.
Because ``optim_step`` is sent before ``forward_backward`` has answered, a step that fails
on the service may have been applied there; the run then stops and ``--resume`` restores
the service state of the last checkpoint, so no half-applied step survives a resume.

**Checkpoints.** ``save_state`` asks the service to save its state (weights and Adam
moments) and sampler weights, and writes only ``engine.json`` with both service paths;
``load_state`` creates the SDK training client from that state with its optimizer
(Tinker 0.38 deprecates ``TrainingClient.load_state``; both SDKs offer
``create_training_client_from_state_with_optimizer``). A fresh run on the service is
created only on first use or :meth:`ServiceTrainingClient.start`, so a resume never
makes one it would throw away. Ending a run closes the SDK session (:func:`close_service`).

**Secrets.** The API key is read by the SDK from its environment variable; the adapter
never reads it except to scrub it from error messages.

Not covered: full fine-tuning, custom losses, the services' other losses (cispo, dro,
...), images, stop strings.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import logging
import math
import os
import shutil
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request
import uuid
import zipfile
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from retool import algo
from retool.atomic import atomic_write_json
from retool.bundled import resolve_model_name
from retool.config import ConfigError
from retool.engines import EngineSampler, ServiceSettings
from retool.engines.base import (
    ENGINE_STATE_FILE,
    AdamParams,
    EngineCheckpoint,
    ForwardBackwardOutput,
    OptimStepOutput,
    SampledSequence,
    SampleResult,
    SamplingParams,
    TransientEngineError,
)
from retool.engines.sdk_retries import RetryCounter, close_pytrio, unwatch_tinker, watch_pytrio, watch_tinker
from retool.seeding import derive_seed
from retool.types import Datum, StopReason

log = logging.getLogger(__name__)

IGNORE_TARGET = -100
"""PyTRIO's target id for a position that is neither trained nor counted."""

STATE_FORMAT = 1

CLOSE_WAIT_S = 10.0
"""How long ending a run waits for Tinker to finish its session (it retries that request
for minutes when the service is gone); the SDK's own cleanup carries on after that."""



@dataclass(frozen=True)
class Flavour:
    """What differs between the two SDKs (checked in their 0.38.0 / 0.2.9 wheels)."""

    name: str
    """The engine name and the SDK's package name."""
    key_env: str
    url_env: str
    token_sum: bool
    """The service sums the loss over tokens (Tinker, documented); else it divides by the
    call's active targets (PyTRIO, inferred from its client)."""
    create_returns_future: bool
    """``ServiceClient.create_*`` return futures (Tinker) rather than clients (PyTRIO)."""
    split_seeded: bool
    """How a seeded request for ``n > 1`` samples is sent so that its samples differ
    (:func:`plan_requests`): as ``n`` single-sample requests with seeds derived from the
    sample index (Tinker), or as one request with ``seed=None`` (PyTRIO)."""

    def sdk(self) -> Any:
        try:
            return importlib.import_module(self.name)
        except ImportError as err:
            raise ConfigError(f"engine {self.name} needs its SDK ({err}); install it with: "
                              f"pip install 'retool-rl[{self.name}]'") from None

    def types(self) -> Any:
        self.sdk()
        return importlib.import_module(f"{self.name}.types")


TINKER = Flavour("tinker", "TINKER_API_KEY", "TINKER_BASE_URL", token_sum=True, create_returns_future=True,
                split_seeded=True)
PYTRIO = Flavour("pytrio", "PYTRIO_API_KEY", "PYTRIO_BASE_URL", token_sum=False, create_returns_future=False,
                split_seeded=False)
FLAVOURS = {f.name: f for f in (TINKER, PYTRIO)}


# ---------------------------------------------------------------- conversions (pure)


def sdk_datum(flavour: Flavour, datum: Datum, loss_fn: str, total_weight: float) -> Any:
    """Our :class:`~retool.types.Datum` as the SDK's ``Datum`` for ``loss_fn``, scaled so
    that the service's reduction of the call gives our token mean (module docstring)."""
    t = flavour.types()
    weights_N = datum.weights_N
    targets_N = list(datum.target_tokens_N)
    if flavour.token_sum:
        scale_N = [w / total_weight for w in weights_N]
    else:
        if any(w not in (0.0, 1.0) for w in weights_N):
            raise ValueError(f"engine {flavour.name} takes loss weights of 0 or 1 only")
        targets_N = [tok if w else IGNORE_TARGET for tok, w in zip(targets_N, weights_N)]
        scale_N = list(weights_N)
    inputs: dict[str, Any] = {"target_tokens": np.asarray(targets_N, dtype=np.int64)}
    if loss_fn == "cross_entropy":
        inputs["weights"] = np.asarray(scale_N, dtype=np.float32)
    else:
        inputs["logprobs"] = np.asarray(datum.sampler_logprobs_N, dtype=np.float32)
        inputs["advantages"] = np.asarray([a * s for a, s in zip(datum.advantages_N, scale_N)], dtype=np.float32)
    return t.Datum(model_input=t.ModelInput.from_ints(list(datum.input_tokens_N)),
                   loss_fn_inputs={k: t.TensorData.from_numpy(v) for k, v in inputs.items()})


def sdk_loss_config(loss_fn: str, config: Mapping[str, float]) -> dict[str, float] | None:
    """The ``loss_fn_config`` the service takes: PPO's clip bounds, nothing else."""
    if loss_fn != "ppo":
        return None
    return {"clip_low_threshold": config["clip_low_threshold"], "clip_high_threshold": config["clip_high_threshold"]}


@dataclass(frozen=True)
class SampleRequest:
    """One request as sent to the service: how many samples, with which parameters."""

    num_samples: int
    params: SamplingParams


def plan_requests(flavour: Flavour, num_samples: int, params: SamplingParams) -> tuple[SampleRequest, ...]:
    """The requests that give ``num_samples`` *distinct* samples, whatever the service
    does with one seed and ``num_samples > 1`` (Tinker has an open report of identical
    sequences then). One sample, or no seed: one request as asked. A seeded request for
    several: Tinker gets ``n`` single-sample requests seeded ``derive_seed(seed, i)``
    (as the vLLM engine does), PyTRIO one request with ``seed=None`` (module docstring)."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if num_samples == 1 or params.seed is None:
        return (SampleRequest(num_samples, params),)
    if not flavour.split_seeded:
        return (SampleRequest(num_samples, dataclasses.replace(params, seed=None)),)
    return tuple(SampleRequest(1, dataclasses.replace(params, seed=derive_seed(params.seed, i)))
                 for i in range(num_samples))


def sdk_sampling_params(flavour: Flavour, params: SamplingParams) -> Any:
    """Ours as the SDK's ``SamplingParams``: top_k "off" is 0 here, -1 there; no stop
    ids means the model's end-of-sequence tokens (``stop=None``)."""
    return flavour.types().SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1, seed=params.seed,
        stop=list(params.stop_token_ids) if params.stop_token_ids else None)


def sdk_adam_params(flavour: Flavour, adam: AdamParams) -> Any:
    """Ours as the SDK's ``AdamParams``: ``eps`` always passed (their default is 1e-12,
    ours 1e-8); ``grad_clip_norm`` "off" is ``None`` here, 0 there."""
    return flavour.types().AdamParams(learning_rate=adam.learning_rate, beta1=adam.beta1, beta2=adam.beta2,
                                      eps=adam.eps, weight_decay=adam.weight_decay,
                                      grad_clip_norm=adam.grad_clip_norm or 0.0)


def from_sdk_sequence(tokens: Sequence[int], logprobs: Sequence[float] | None, stop_reason: str) -> SampledSequence:
    """One sampled sequence in our terms; the stop token stays in ``tokens`` (both SDKs
    return it, as our contract wants)."""
    if logprobs is None or len(logprobs) != len(tokens):
        raise ValueError("the service returned a sequence without one logprob per token")
    reason = StopReason.LENGTH if str(stop_reason) in ("length", "max_tokens") else StopReason.STOP
    return SampledSequence(tuple(int(t) for t in tokens), tuple(float(lp) for lp in logprobs), reason)


def from_sdk_sample_response(response: Any) -> SampleResult:
    return SampleResult(tuple(from_sdk_sequence(s.tokens, s.logprobs, s.stop_reason) for s in response.sequences))


def target_logprobs(output: Any) -> tuple[tuple[float, ...], ...]:
    """Per datum, the trainer's logprob of every target from a ``ForwardBackwardOutput``."""
    return tuple(tuple(float(v) for v in o["logprobs"].tolist()) for o in output.loss_fn_outputs)


def loss_metrics(data: Sequence[Datum], logprobs_D: Sequence[Sequence[float]], loss_fn: str,
                 config: Mapping[str, float]) -> dict[str, float]:
    """The local engine's ``train/*`` metrics, from the logprobs the service returned."""
    import torch  # heavy: only these metrics need it (the service holds the model)

    weights_N = torch.tensor([w for d in data for w in d.weights_N], dtype=torch.float64)
    mask_N = weights_N != 0
    # an untrained target's logprob is meaningless (PyTRIO: an ignored -100 target): 0 there
    logprobs_N = torch.tensor([lp if w else 0.0 for lp_N, d in zip(logprobs_D, data) for lp, w in zip(lp_N, d.weights_N)],
                              dtype=torch.float64)
    inputs = algo.LossInputs()
    if loss_fn in algo.RL_LOSSES:
        inputs = algo.LossInputs(torch.tensor([v for d in data for v in d.sampler_logprobs_N], dtype=torch.float64),
                                 torch.tensor([v for d in data for v in d.advantages_N], dtype=torch.float64))
    terms = algo.LOSSES[loss_fn](logprobs_N, inputs, config)
    tokens = int(mask_N.sum())
    out = {"train/loss": float(algo.token_mean(terms.loss_N, weights_N)), "train/tokens": float(tokens),
           "train/sequences": float(len(data)), "train/micro_batches": 1.0}
    if inputs.sampler_logprobs_N is not None:
        diff_N = (logprobs_N - inputs.sampler_logprobs_N)[mask_N]
        out["train/sampler_logprob_diff"] = float(diff_N.abs().sum()) / tokens
        out["train/approx_kl"] = float((diff_N.exp() - 1 - diff_N).sum()) / tokens
    if terms.clipped_N is not None:
        out["train/clip_frac"] = float((terms.clipped_N & mask_N).sum()) / tokens
    return out


# ---------------------------------------------------------------- errors


class ServiceError(ConfigError):
    """The service refused the run itself (authentication, an unknown model): stop at once."""


def _scrub(flavour: Flavour, text: str) -> str:
    key = os.environ.get(flavour.key_env, "")
    return text.replace(key, "***") if len(key) >= 4 else text


def _kind(err: BaseException) -> str:
    """``auth``, ``transient`` or ``other``, from the SDK exception's class and status."""
    name = type(err).__name__
    status = getattr(err, "status_code", 0) or 0
    if status in (401, 403) or name in ("AuthenticationError", "PermissionDeniedError", "AuthError"):
        return "auth"
    if (status in (408, 429) or status >= 500 or isinstance(err, (TimeoutError, ConnectionError))
            or name in ("APIConnectionError", "APITimeoutError") or getattr(err, "retryable", False)):
        return "transient"
    return "other"


USAGE_METRICS = ("engine/sample_requests", "engine/split_requests", "engine/unseeded_requests",
                 "engine/checkpoints", "tokens/prefill_service", "tokens/prefill_cached")
"""What the service was asked for since the last step, in its own units: requests sent,
the extra ones splitting made, seeded requests sent unseeded, persistent checkpoints
saved, prompt tokens it prefilled (every request's prompt, per sample) and of those the
ones it reported as cached (Tinker: ``prompt_cache_hit_tokens``, plus the shared prompt
of a multi-sample request, which Tinker documents as billed cached)."""


class InFlight:
    """How long at least one of this client's service requests was outstanding: the union
    of the requests' spans, from just before the SDK call to its answer (or failure).

    :meth:`take` returns that time and the wall time it was counted over since the last
    take (the first window: since the first request), and starts a new window:
    ``time/service_busy`` and ``time/service_window`` of the step whose ``optim_step``
    answer took them. The rest of the window
    (``window - busy``) is the client's own work with nothing in flight — rollout
    bookkeeping, sandbox calls, grading, datums, metrics, checkpoints — measured from the
    client's side (the SDK's own serialization counts as in flight), so it needs no help
    from the service (``bench/scale.py --service``)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock, self._lock = clock, threading.Lock()
        self._count, self._busy_since, self._busy = 0, 0.0, 0.0
        self._window_start: float | None = None

    def enter(self) -> None:
        with self._lock:
            if self._count == 0:
                self._busy_since = self._clock()
                if self._window_start is None:
                    self._window_start = self._busy_since
            self._count += 1

    def exit(self) -> None:
        with self._lock:
            self._count -= 1
            if self._count == 0:
                self._busy += self._clock() - self._busy_since

    def take(self) -> tuple[float, float]:
        """``(busy, window)`` seconds since the last take; a new window starts now."""
        with self._lock:
            now = self._clock()
            if self._window_start is None:
                return 0.0, 0.0
            busy = self._busy + (now - self._busy_since if self._count else 0.0)
            window, self._window_start, self._busy = now - self._window_start, now, 0.0
            if self._count:
                self._busy_since = now
            return busy, window


@dataclass
class _Counters:
    errors: int = 0
    retries: int = 0

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        self.sdk = RetryCounter()
        """The SDK's own retries (:func:`retool.engines.sdk_retries.watch_tinker`)."""
        self.usage = dict.fromkeys(USAGE_METRICS, 0.0)
        self.in_flight = InFlight()

    def add(self, amounts: Mapping[str, float]) -> None:
        with self.lock:
            for key, amount in amounts.items():
                self.usage[key] += amount

    def take(self) -> dict[str, float]:
        sdk_retries = self.sdk.take()
        busy, window = self.in_flight.take()
        with self.lock:
            out = {"engine/errors": float(self.errors), "engine/retries": float(self.retries + sdk_retries),
                   **self.usage, "time/service_busy": busy, "time/service_window": window}
            self.errors = self.retries = 0
            self.usage = dict.fromkeys(USAGE_METRICS, 0.0)
        return out


def _translate(flavour: Flavour, counters: _Counters, what: str, err: BaseException,
               retryable: bool = True) -> BaseException:
    """The exception the trainer sees for an SDK failure (counted in ``engine/errors``)."""
    kind = _kind(err)
    message = _scrub(flavour, f"engine {flavour.name}: {what} failed ({type(err).__name__}: {err})")
    with counters.lock:
        counters.errors += 1
        if kind == "transient" and retryable:
            counters.retries += 1
    if kind == "auth":
        return ServiceError(_scrub(flavour, f"engine {flavour.name}: the service refused the credentials "
                                             f"({type(err).__name__}); set {flavour.key_env} to a valid API key"))
    if kind == "transient" and retryable:
        return TransientEngineError(message)
    return RuntimeError(message)


def _call(flavour: Flavour, counters: _Counters, what: str, fn: Callable[[], Any], retryable: bool = True) -> Any:
    """``fn()`` (an SDK call), counted as in flight while it runs; an SDK failure
    translated (:func:`_translate`)."""
    counters.in_flight.enter()
    try:
        return fn()
    except (ConfigError, ValueError, FloatingPointError):
        raise
    except Exception as err:
        raise _translate(flavour, counters, what, err, retryable) from None
    finally:
        counters.in_flight.exit()


# ---------------------------------------------------------------- sampling


class ServiceSamplingClient:
    """A service sampling client with fixed weights, behind our ``SamplingClient``."""

    def __init__(self, flavour: Flavour, sdk_client: Any, pool: ThreadPoolExecutor, counters: _Counters) -> None:
        self.flavour, self.sdk_client, self._pool, self._counters = flavour, sdk_client, pool, counters

    async def sample(self, prompt_tokens: Sequence[int], num_samples: int,
                     sampling_params: SamplingParams) -> SampleResult:
        """``num_samples`` distinct samples, in the requests :func:`plan_requests` plans,
        all in flight at once; what they cost is counted (:data:`USAGE_METRICS`)."""
        t = self.flavour.types()
        prompt = t.ModelInput.from_ints([int(x) for x in prompt_tokens])
        requests = plan_requests(self.flavour, num_samples, sampling_params)
        loop = asyncio.get_running_loop()
        responses = await asyncio.gather(*(
            loop.run_in_executor(self._pool, self._sample_blocking, prompt, r.num_samples,
                                 sdk_sampling_params(self.flavour, r.params))
            for r in requests))
        self._counters.add(request_usage(len(prompt_tokens), sampling_params.seed, requests, responses))
        return SampleResult(tuple(s for r in responses for s in from_sdk_sample_response(r).sequences))

    async def compute_logprobs(self, tokens: Sequence[int], start: int) -> tuple[float, ...]:
        """The service sampler's teacher-forced logprobs of ``tokens[start:]`` (the SDK's
        ``compute_logprobs``; the weight-sync guard's probe, ``retool.weight_sync``)."""
        prompt = self.flavour.types().ModelInput.from_ints([int(x) for x in tokens])
        loop = asyncio.get_running_loop()
        scores = await loop.run_in_executor(self._pool, lambda: _call(
            self.flavour, self._counters, "compute_logprobs", lambda: self.sdk_client.compute_logprobs(prompt).result()))
        if scores is None or len(scores) != len(tokens) or any(s is None for s in scores[start:]):
            raise RuntimeError(f"engine {self.flavour.name}: compute_logprobs returned no logprob for some tokens")
        return tuple(float(s) for s in scores[start:])

    def _sample_blocking(self, prompt: Any, num_samples: int, params: Any) -> Any:
        kwargs = {"return_text": False} if self.flavour is PYTRIO else {}  # tokens are the source of truth
        return _call(self.flavour, self._counters, "sample",
                     lambda: self.sdk_client.sample(prompt=prompt, num_samples=num_samples,
                                                    sampling_params=params, **kwargs).result())


def request_usage(prompt_len: int, seed: int | None, requests: Sequence[SampleRequest],
                  responses: Sequence[Any]) -> dict[str, float]:
    """What one ``sample`` call asked of the service, in :data:`USAGE_METRICS` terms.
    Tinker (its responses carry ``prompt_cache_hit_tokens``) prefills the prompt once per
    sample and documents the other samples of one request as cached; PyTRIO reports the
    ``input_tokens`` of each call and nothing cached."""
    prefilled = cached = 0
    for request, response in zip(requests, responses):
        if hasattr(response, "prompt_cache_hit_tokens"):
            prefilled += prompt_len * request.num_samples
            cached += min(int(response.prompt_cache_hit_tokens or 0), prompt_len)
            cached += (request.num_samples - 1) * prompt_len
        else:
            prefilled += int(getattr(response, "input_tokens", 0) or prompt_len)
    unseeded = seed is not None and all(r.params.seed is None for r in requests)
    return {"engine/sample_requests": float(len(requests)), "engine/split_requests": float(len(requests) - 1),
            "engine/unseeded_requests": float(unseeded), "tokens/prefill_service": float(prefilled),
            "tokens/prefill_cached": float(cached)}


# ---------------------------------------------------------------- training


class ServiceTrainingClient:
    """Our ``TrainingClient`` over a service's SDK training client (module docstring)."""

    def __init__(self, flavour: Flavour, service: Any, sdk_client: Any, model: str, lora_rank: int,
                 tokenizer: Any, sample_concurrency: int = 64, retry_timeout_s: float | None = None,
                 counters: _Counters | None = None, create: Callable[[], Any] | None = None) -> None:
        """``sdk_client`` is the SDK's training client, or ``None`` with ``create``: then
        the run on the service is created on first use, so a resume that starts with
        :meth:`load_state` never creates a fresh run it would throw away."""
        self.flavour, self.service, self._sdk_client, self._create = flavour, service, sdk_client, create
        self.retry_timeout_s = retry_timeout_s
        self.model, self.lora_rank, self.tokenizer = model, lora_rank, tokenizer
        self.optim_steps = 0
        self.counters = counters or _Counters()
        self._sample_pool = ThreadPoolExecutor(sample_concurrency, thread_name_prefix=f"{flavour.name}-sample")
        self._result_pool = ThreadPoolExecutor(2, thread_name_prefix=f"{flavour.name}-result")
        self._pending_gradient = False
        self._closed = False
        self.adam_eps: float | None = None
        """Adam's epsilon for the service, replacing the trainer's (``--tinker-adam-eps``)."""

    def start(self) -> None:
        """Create the run on the service now rather than on first use, so that a refused
        model or key stops a new run before it writes anything (``retool train`` calls
        this unless it resumes from a checkpoint)."""
        self.sdk_client  # noqa: B018 - the property creates it

    @property
    def sdk_client(self) -> Any:
        """The SDK's training client (created now if it was deferred)."""
        if self._sdk_client is None:
            if self._create is None:
                raise RuntimeError(f"engine {self.flavour.name}: no training client to create")
            self._sdk_client = self._create()
        return self._sdk_client

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ------------------------------------------------------------ forward/backward and optim

    def forward_backward(self, data: Sequence[Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, float] | None = None) -> ForwardBackwardOutput:
        return self.submit_forward_backward(data, loss_fn, loss_fn_config).result()

    def optim_step(self, adam_params: AdamParams = AdamParams()) -> OptimStepOutput:
        return self.submit_optim_step(adam_params).result()

    def submit_forward_backward(self, data: Sequence[Datum], loss_fn: str,
                                loss_fn_config: Mapping[str, float] | None = None) -> Future[ForwardBackwardOutput]:
        """Check, convert and send the whole batch in one SDK call; the future converts
        the answer and computes the metrics."""
        config = algo.loss_config(loss_fn, loss_fn_config)
        if config["temperature"] != 1.0:
            raise ValueError(f"engine {self.flavour.name} trains at temperature 1 only (it takes no temperature)")
        if config.get("dual_clip"):
            raise ValueError(f"engine {self.flavour.name} has no PPO dual-clip")
        if algo.behaviour_correction_on(config):
            raise ValueError(f"engine {self.flavour.name} has no sampler-trainer correction (--behaviour-is)")
        total_weight = _check_data(data, loss_fn)
        sdk_data = [sdk_datum(self.flavour, d, loss_fn, total_weight) for d in data]
        sdk_future = self._submit("forward_backward", lambda: self.sdk_client.forward_backward(
            sdk_data, loss_fn, sdk_loss_config(loss_fn, config)))
        self._pending_gradient = True
        return self._result_pool.submit(self._finish_forward_backward, sdk_future, data, loss_fn, config)

    def _submit(self, what: str, fn: Callable[[], Any]) -> Any:
        """Send a request whose answer is an SDK future; it stays in flight (``time/service_busy``)
        until :meth:`_answer` has its result."""
        self.counters.in_flight.enter()
        try:
            return _call(self.flavour, self.counters, what, fn, retryable=False)
        except BaseException:
            self.counters.in_flight.exit()
            raise

    def _answer(self, what: str, sdk_future: Any) -> Any:
        try:
            return _call(self.flavour, self.counters, what, sdk_future.result, retryable=False)
        finally:
            self.counters.in_flight.exit()

    def _finish_forward_backward(self, sdk_future: Any, data: Sequence[Datum], loss_fn: str,
                                 config: Mapping[str, float]) -> ForwardBackwardOutput:
        output = self._answer("forward_backward", sdk_future)
        logprobs_D = target_logprobs(output)
        if [len(lp) for lp in logprobs_D] != [d.num_tokens for d in data]:
            raise RuntimeError(f"engine {self.flavour.name}: forward_backward returned logprobs of the wrong shape")
        metrics = loss_metrics(data, logprobs_D, loss_fn, config)
        # every token of every datum goes through forward and backward (Tinker bills these)
        metrics["tokens/forward_backward"] = float(sum(d.num_tokens for d in data))
        if not math.isfinite(metrics["train/loss"]):
            raise FloatingPointError(f"non-finite loss {metrics['train/loss']} from the service")
        return ForwardBackwardOutput(logprobs_D, metrics)

    def submit_optim_step(self, adam_params: AdamParams) -> Future[OptimStepOutput]:
        """Send one optimizer step (never re-sent: a failure may have been applied)."""
        if not self._pending_gradient:
            raise RuntimeError("optim_step called without a preceding forward_backward")
        self._pending_gradient = False
        if self.adam_eps is not None:
            adam_params = dataclasses.replace(adam_params, eps=self.adam_eps)
        sdk_future = self._submit("optim_step", lambda: self.sdk_client.optim_step(
            sdk_adam_params(self.flavour, adam_params)))
        return self._result_pool.submit(self._finish_optim_step, sdk_future, adam_params)

    def _finish_optim_step(self, sdk_future: Any, adam_params: AdamParams) -> OptimStepOutput:
        response = self._answer("optim_step (it may or may not have been applied)", sdk_future)
        self.optim_steps += 1
        metrics = {"train/lr": adam_params.learning_rate, "train/optim_steps": float(self.optim_steps)}
        for key, value in (response.metrics or {}).items():
            if key.split(":")[0].endswith("grad_norm"):
                metrics["train/grad_norm"] = float(value)
        metrics.update(self.counters.take())
        return OptimStepOutput(metrics)

    def compute_logprobs(self, tokens: Sequence[int], start: int) -> tuple[float, ...]:
        """The trainer's teacher-forced logprobs of ``tokens[start:]``: the SDK's ``forward``
        (no gradient) with cross-entropy targets (the weight-sync guard's probe)."""
        t = self.flavour.types()
        datum = t.Datum(model_input=t.ModelInput.from_ints([int(x) for x in tokens[:-1]]), loss_fn_inputs={
            "target_tokens": t.TensorData.from_numpy(np.asarray(tokens[1:], dtype=np.int64)),
            "weights": t.TensorData.from_numpy(np.ones(len(tokens) - 1, dtype=np.float32))})
        output = _call(self.flavour, self.counters, "forward",
                       lambda: self.sdk_client.forward([datum], "cross_entropy").result())
        return target_logprobs(output)[0][start - 1:]

    # ------------------------------------------------------------ sampling and checkpoints

    def save_weights_for_sampler(self, name: str | None = None) -> ServiceSamplingClient:
        """A sampling client on the current weights, through the SDK's ephemeral
        ``save_weights_and_get_sampling_client`` (as tinker-cookbook's RL loop does): no
        named, persistent sampler checkpoint per step. ``name`` is not used. Tinker's
        snapshot lives in the session only; PyTRIO 0.2.9 saves a temporary checkpoint
        (its own 6-hour TTL) under a generated name."""
        if self.flavour is TINKER:
            kwargs: dict[str, Any] = {}
            if self.retry_timeout_s is not None:
                from tinker.lib.retry_handler import RetryConfig  # optional SDK: only this flavour has it

                kwargs["retry_config"] = RetryConfig(progress_timeout=self.retry_timeout_s)
            fn = lambda: self.sdk_client.save_weights_and_get_sampling_client(**kwargs).result()  # noqa: E731
        else:
            fn = lambda: self.sdk_client.save_weights_and_get_sampling_client()  # noqa: E731
        sdk_sampler = _call(self.flavour, self.counters, "save_weights_and_get_sampling_client", fn)
        return ServiceSamplingClient(self.flavour, sdk_sampler, self._sample_pool, self.counters)

    def save_state(self, path: str | Path) -> Path:
        """Save the service state (weights + Adam moments) and sampler weights; write
        ``engine.json`` pointing at both. Nothing else is stored locally."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        name = f"retool-{self.optim_steps:06d}-{uuid.uuid4().hex[:8]}"
        state = _call(self.flavour, self.counters, "save_state", lambda: self.sdk_client.save_state(name).result().path)
        sampler = _call(self.flavour, self.counters, "save_weights_for_sampler",
                        lambda: self.sdk_client.save_weights_for_sampler(name + "-sampler").result().path)
        self.counters.add({"engine/checkpoints": 2.0})  # counted into the next step's metrics
        atomic_write_json(folder / ENGINE_STATE_FILE, {
            "format": STATE_FORMAT, "engine": self.flavour.name, "model": self.model, "weights": state,
            "optimizer": state, "sampler_weights": sampler, "full_finetune": False,
            "lora": {"rank": self.lora_rank, "targets": "all-linear"}, "optim_steps": self.optim_steps})
        return folder

    def load_state(self, path: str | Path) -> None:
        """Continue from a ``save_state`` folder: a new SDK training client created from
        the service state with its optimizer (the SDKs' replacement of ``load_state``)."""
        checkpoint = _read_checkpoint(self.flavour, path)
        self._sdk_client = _create(self.flavour, self.counters, "create_training_client_from_state_with_optimizer",
                                   lambda: self.service.create_training_client_from_state_with_optimizer(
                                       checkpoint.optimizer))
        self.optim_steps = int(_engine_json(path).get("optim_steps", 0))
        self._pending_gradient = False

    def close(self, status: str = "success") -> None:
        """End the run's use of the service: stop counting SDK retries for it, release
        the thread pools and close the SDK's session (:func:`close_service`). A second
        call does nothing."""
        if self._closed:
            return
        self._closed = True
        unwatch_tinker(self.counters.sdk)
        self._sample_pool.shutdown(wait=False, cancel_futures=True)
        self._result_pool.shutdown(wait=False, cancel_futures=True)
        close_service(self.flavour, self.service, status)


def _check_data(data: Sequence[Datum], loss_fn: str) -> float:
    """Reject what the service would choke on, before sending: returns the trained weight."""
    if not data:
        raise ValueError("forward_backward needs at least one datum")
    for i, d in enumerate(data):
        fields = [d.weights_N] + ([d.sampler_logprobs_N, d.advantages_N] if loss_fn in algo.RL_LOSSES else [])
        if any(len(f) != d.num_tokens for f in fields):
            raise ValueError(f"datum {i}: every per-token field needs {d.num_tokens} entries")
        if not all(math.isfinite(v) for f in fields for v in f):
            raise FloatingPointError(f"datum {i} has a non-finite weight, sampler logprob or advantage; "
                                     "nothing was sent to the service")
    total_weight = sum(sum(d.weights_N) for d in data)
    if not total_weight > 0:
        raise ValueError("no datum has a trained token (all weights are 0)")
    return total_weight


# ---------------------------------------------------------------- building clients


def _create(flavour: Flavour, counters: _Counters, what: str, fn: Callable[[], Any]) -> Any:
    """Call a ``create_*`` method (Tinker's return futures, PyTRIO's clients); a failure
    (an unknown model, a missing checkpoint) stops the run with one line."""
    result = _setup(flavour, counters, what, fn)
    return _setup(flavour, counters, what, result.result) if flavour.create_returns_future else result


def _setup(flavour: Flavour, counters: _Counters, what: str, fn: Callable[[], Any]) -> Any:
    """Call ``fn`` while setting up; any failure stops the run with one line."""
    try:
        return _call(flavour, counters, what, fn, retryable=False)
    except RuntimeError as err:
        raise ServiceError(str(err)) from None


def _sampling_client(flavour: Flavour, service: Any, model: str, path: str | None,
                     retry_timeout_s: float | None = None) -> Any:
    """A sampling client on saved weights ``path`` (or the base model): the two SDKs take
    ``model_path``/``base_model`` in opposite orders, so both go by keyword. Tinker's
    retries are configured per sampling client (``RetryConfig``), PyTRIO's per process
    (:func:`service_client`)."""
    counters = _Counters()
    if flavour is TINKER:
        kwargs: dict[str, Any] = {"model_path": path} if path else {"base_model": model}
        if retry_timeout_s is not None:
            from tinker.lib.retry_handler import RetryConfig  # optional SDK: only this flavour has it

            kwargs["retry_config"] = RetryConfig(progress_timeout=retry_timeout_s)
        return _create(flavour, counters, "create_sampling_client", lambda: service.create_sampling_client(**kwargs))
    return _create(flavour, counters, "create_sampling_client",
                   lambda: service.create_sampling_client(base_model=model, model_path=path))


def service_client(flavour: Flavour, base_url: str | None = None, retry_timeout_s: float | None = None,
                   retries: RetryCounter | None = None) -> Any:
    """The SDK's ``ServiceClient``; the SDK reads the API key from its environment. With
    ``retries``, the SDK's own retries are counted there from the start (its session is
    opened now, so a refused key stops here)."""
    sdk = flavour.sdk()
    if flavour is PYTRIO and retry_timeout_s is not None:
        sdk.configure(training_retry_timeout_seconds=retry_timeout_s, sampling_retry_timeout_seconds=retry_timeout_s)
    if flavour is TINKER:
        service = _setup(flavour, _Counters(), "connecting", lambda: sdk.ServiceClient(base_url=base_url))
        if retries is not None:
            _setup(flavour, _Counters(), "connecting", lambda: watch_tinker(service, retries))
        return service
    if base_url:
        sdk.configure(base_url=base_url)
    if retries is not None:
        return _setup(flavour, _Counters(), "connecting", lambda: watch_pytrio(retries, sdk.ServiceClient))
    return _setup(flavour, _Counters(), "connecting", lambda: sdk.ServiceClient())


def close_service(flavour: Flavour, service: Any, status: str = "success") -> None:
    """Close a ``ServiceClient`` when a run ends (``status``: success, errored or
    interrupted). Tinker's ``close`` marks the session finished on the service and stops
    the SDK's background loops for it — session heartbeat, dynamic-config refresh,
    telemetry flushes — which would otherwise run (and retry against a service that is
    gone) until the process exits; it waits at most :data:`CLOSE_WAIT_S`. PyTRIO 0.2.9
    has no public ``close``: :func:`retool.engines.sdk_retries.close_pytrio` ends its
    service session (``ENDED``/``CANCELLED``) and stops the heartbeats of the training and
    sampling runs made from it. A failure to close is logged once as a warning (secrets
    scrubbed); the run's outcome stands."""
    try:
        if flavour is PYTRIO:
            close_pytrio(service, status)
            return
        close = getattr(service, "close", None)
        if close is not None:
            close(status).result(timeout=CLOSE_WAIT_S)
    except Exception as err:  # noqa: BLE001 - a session that cannot be finished expires on the service
        log.warning("closing the %s session (%s) failed: %s: %s; it expires on the service",
                    flavour.name, status, type(err).__name__, _scrub(flavour, str(err)))


def _engine_json(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / ENGINE_STATE_FILE).read_text())


def _read_checkpoint(flavour: Flavour, path: str | Path) -> EngineCheckpoint:
    checkpoint = EngineCheckpoint.read(path)
    if checkpoint.engine != flavour.name:
        raise ConfigError(f"{path} was written by the {checkpoint.engine} engine, not {flavour.name}")
    return checkpoint


def load_tokenizer(model: str, folder: str | None = None) -> Any:
    """The model's Hugging Face tokenizer, loaded here (the service holds the model): from
    the local ``folder`` when given (offline), else by the model's name."""
    from transformers import AutoTokenizer  # heavy: only the tokenizer needs it

    tokenizer = AutoTokenizer.from_pretrained(folder or resolve_model_name(model))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def create_training_client(flavour: Flavour | str = TINKER, *, model: str, lora_rank: int = 32, seed: int | None = None,
                           base_url: str | None = None, init_from: str | None = None,
                           sample_concurrency: int = 64, retry_timeout_s: float | None = None,
                           train_unembed: bool = False, tokenizer: str | None = None) -> ServiceTrainingClient:
    """A training client on the service: a fresh LoRA adapter on ``model`` (with the
    unembedding trained too when ``train_unembed``), or the weights (not the optimizer)
    of the checkpoint folder ``init_from``; ``tokenizer``: a local tokenizer folder instead of
    the model's from the hub. The run on the service is created on first
    use (:class:`ServiceTrainingClient`); connecting and the API key are checked now."""
    flavour = FLAVOURS[flavour] if isinstance(flavour, str) else flavour
    counters = _Counters()
    service = service_client(flavour, base_url, retry_timeout_s, counters.sdk)
    try:
        if init_from:
            checkpoint = _read_checkpoint(flavour, init_from)
            what, fn = "create_training_client_from_state", lambda: service.create_training_client_from_state(
                checkpoint.weights)
        else:
            what = f"create_lora_training_client({model})"
            fn = lambda: service.create_lora_training_client(  # noqa: E731
                base_model=model, rank=lora_rank, seed=seed, train_unembed=train_unembed)
        loaded = load_tokenizer(model, tokenizer)
    except BaseException:
        unwatch_tinker(counters.sdk)
        close_service(flavour, service, "errored")
        raise
    return ServiceTrainingClient(flavour, service, None, model, lora_rank, loaded, sample_concurrency,
                                 retry_timeout_s, counters, create=lambda: _create(flavour, counters, what, fn))


def training_client(cfg: Any, seed: int, init_from: str | None, flavour: Flavour = TINKER) -> ServiceTrainingClient:
    """The training client a ``retool train``/``retool sft`` config describes."""
    if cfg.lora_targets != "all-linear":
        raise ConfigError(f"engine {flavour.name} trains every linear layer: leave --lora-targets all-linear")
    settings = getattr(cfg, flavour.name)
    client = create_training_client(flavour, model=cfg.model, lora_rank=cfg.lora_rank, seed=seed,
                                    base_url=settings.base_url, init_from=init_from,
                                    sample_concurrency=settings.sample_concurrency,
                                    retry_timeout_s=settings.retry_timeout_s, train_unembed=settings.train_unembed,
                                    tokenizer=settings.tokenizer)
    client.adam_eps = settings.adam_eps
    return client


def sampler(request: Any, flavour: Flavour = TINKER) -> Any:
    """A sampler only, for ``retool eval``: the base model, or a checkpoint's sampler weights."""

    settings = request.settings or ServiceSettings()
    service = service_client(flavour, settings.base_url, settings.retry_timeout_s)
    path = None
    if request.checkpoint is not None:
        _read_checkpoint(flavour, request.checkpoint_dir)
        path = _engine_json(request.checkpoint_dir)["sampler_weights"]
    pool = ThreadPoolExecutor(settings.sample_concurrency, thread_name_prefix=f"{flavour.name}-sample")
    sdk_sampler = _sampling_client(flavour, service, request.model, path, settings.retry_timeout_s)
    client = ServiceSamplingClient(flavour, sdk_sampler, pool, _Counters())

    def close() -> None:
        pool.shutdown(wait=False)
        close_service(flavour, service)

    return EngineSampler(load_tokenizer(request.model, settings.tokenizer), client, close=close)


# ---------------------------------------------------------------- export


EXPORT_TTL_S = 3600
"""Lifetime of Tinker's temporary external-weights export (deleted after the download)."""


def export_adapter(flavour: Flavour, engine_dir: str | Path, output: str | Path, base_url: str | None = None) -> Path:
    """Download the adapter of a ``save_state`` folder's checkpoint and write it to
    ``output`` as a PEFT adapter for the Hugging Face model (:func:`retool.export.build_peft_adapter`).

    Tinker 0.38 downloads a training checkpoint the way its own ``tinker checkpoint
    download`` and tinker-cookbook's ``weights.download`` do (sampler checkpoints cannot
    be downloaded there): a training client from the saved state writes a temporary
    external-weights export (``save_weights_external``, one hour's TTL), ``RestClient``
    signs one URL per file, and the export is deleted afterwards. PyTRIO: the sampler
    checkpoint is looked up among the user's checkpoints and downloaded as one archive
    (tar or zip), which is unpacked.
    """
    from retool.export import build_peft_adapter  # import cycle: retool.export imports this module

    _read_checkpoint(flavour, engine_dir)
    meta = _engine_json(engine_dir)
    counters = _Counters()
    service = service_client(flavour, base_url)
    status = "errored"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            _export(flavour, service, counters, meta, Path(tmp), base_url)
            try:
                folder = build_peft_adapter(tmp, meta["model"], output)
            except (RuntimeError, ValueError, OSError) as err:
                raise RuntimeError(f"engine {flavour.name}: the downloaded adapter of {meta['weights']} is not a "
                                   f"PEFT adapter for {meta['model']}: {err}") from None
        status = "success"
    finally:
        close_service(flavour, service, status)
    return folder


def _export(flavour: Flavour, service: Any, counters: _Counters, meta: dict[str, Any], output: Path,
            base_url: str | None) -> None:
    if flavour is TINKER:
        trainer = _create(flavour, counters, "create_training_client_from_state",
                          lambda: service.create_training_client_from_state(meta["weights"]))
        name = f"retool-export-{uuid.uuid4().hex[:8]}"
        path = _call(flavour, counters, "save_weights_external",
                     lambda: trainer.save_weights_external(name, ttl_seconds=EXPORT_TTL_S).result().path)
        rest = flavour.sdk().RestClient(base_url=base_url)
        try:
            urls = _call(flavour, counters, "get_external_weights_urls",
                         lambda: rest.get_external_weights_urls(path).result().urls)
            for relative, url in urls.items():
                _download(url, output, relative)
        finally:
            _delete_export(flavour, rest, path)
    else:
        rest = service.create_rest_client()
        checkpoint_id = _pytrio_checkpoint_id(flavour, rest, meta["sampler_weights"])
        with tempfile.TemporaryDirectory() as tmp:
            archive = Path(tmp) / "checkpoint"
            _call(flavour, counters, "download_checkpoint",
                  lambda: rest.download_checkpoint(checkpoint_id, archive).result())
            _unpack(archive, output)


def _delete_export(flavour: Flavour, rest: Any, path: str) -> None:
    try:
        rest.delete_checkpoint_from_tinker_path(path).result()
    except Exception as err:  # noqa: BLE001 - the export expires by itself
        print(_scrub(flavour, f"engine {flavour.name}: could not delete the temporary export {path} ({err}); "
                              f"it expires in {EXPORT_TTL_S} s"), file=sys.stderr)


def _download(url: str, folder: Path, relative: str) -> None:
    """One signed URL's file into ``folder`` (a name that leaves it is refused)."""
    target = (folder / relative).resolve()
    if not target.is_relative_to(folder.resolve()):
        raise RuntimeError(f"the service named a file outside the download folder: {relative!r}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with urllib.request.urlopen(url) as response, open(target, "wb") as f:  # noqa: S310 - the service's signed URL
        shutil.copyfileobj(response, f)


def _pytrio_checkpoint_id(flavour: Flavour, rest: Any, path: str, page: int = 100) -> str:
    offset = 0
    while True:
        listing = _call(flavour, _Counters(), "list_user_checkpoints",
                        lambda: rest.list_user_checkpoints(limit=page, offset=offset).result())
        for checkpoint in listing.checkpoints:
            if checkpoint.path == path:
                return checkpoint.checkpoint_id
        if len(listing.checkpoints) < page:
            raise RuntimeError(f"engine {flavour.name}: no checkpoint {path} among this account's checkpoints "
                               "(expired or deleted?)")
        offset += page


def _unpack(archive: Path, output: Path) -> None:
    """Unpack a tar or zip archive into ``output``, flattening a single top folder."""
    with tempfile.TemporaryDirectory() as tmp:
        if tarfile.is_tarfile(archive):
            with tarfile.open(archive) as tar:
                tar.extractall(tmp, filter="data")
        elif zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as z:
                z.extractall(tmp)
        else:
            raise RuntimeError(f"the downloaded checkpoint {archive.name} is neither a tar nor a zip archive")
        found = sorted(Path(tmp).rglob("adapter_config.json"))
        source = found[0].parent if found else Path(tmp)
        for item in source.iterdir():
            shutil.move(str(item), output / item.name)
