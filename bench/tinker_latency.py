"""A latency-model Tinker service: the unmodified ``tinker`` SDK over real sockets, GPU work
replaced by time.

The HTTP plumbing (endpoints, protobuf bodies, futures, sequence ids) is
:class:`tests.fake_tinker_http.TinkerHTTPFake`'s; what the service *computes* is replaced:

- ``asample``: the tokens of :class:`bench.scale_policy.ScriptedPolicy`, answered after the
  time a batching server takes. Each request costs ``new_prefill / prefill_rate +
  sampled / decode_rate`` seconds of the server's whole throughput, and requests in flight
  share that throughput (processor sharing, :class:`ThroughputBudget`), none faster than
  one sequence decodes alone (``ttft + sampled / stream_decode_rate``). ``new_prefill`` is
  what a prefix cache leaves: prompt blocks seen before on the same sampler weights
  (:class:`PrefixCache`) are not prefilled again.
- ``forward_backward``: ``tokens / train_rate`` seconds, one at a time per model; the
  target logprobs returned are the sampler's own (the importance ratio is 1).
- ``optim_step``, ``save_weights_and_get_sampling_client``, ``save_weights_for_sampler``
  (named) and ``save_state``: fixed times.
- ``load_weights`` (resume from ``save_state``): a model with the saved step count.

Every request's time is divided by ``time_scale`` (a soak runs the model faster than real
time). Default rates (:class:`LatencyModel`) are the fastest credible public figures for a
4B model, so a client overhead goal is not met by a slow service; their sources are in
``docs/benchmarks.md`` (section "Reference-run rehearsal").

What the bench reads: :attr:`LatencyTinkerServer.calls` (each service call with the step
it belongs to and a digest of what was asked, to compare a resumed run with an
uninterrupted one), :meth:`LatencyTinkerServer.busy_s` (seconds during which at least
one request was in flight: the client is waiting on the service) and the token counters.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from bench.scale_policy import TIMEOUT_RATE, ScriptedPolicy
from tests.fake_tinker_http import TinkerHTTPFake, _forward_backward_from_proto, _forward_backward_proto, _sample_proto


@dataclass(frozen=True)
class LatencyModel:
    """The service's speeds. Defaults: the fastest credible public figures for a 4B model
    (sources in docs/benchmarks.md)."""

    prefill_rate: float = 100_000.0
    """Prompt tokens per second, whole server (compute-bound prefill on an H100)."""
    decode_rate: float = 20_000.0
    """Sampled tokens per second, whole server, many sequences batched."""
    stream_decode_rate: float = 400.0
    """Sampled tokens per second of one sequence alone (weight-bandwidth bound)."""
    ttft_s: float = 0.02
    """Time to first token of a request on an idle server."""
    train_rate: float = 160_000.0
    """Tokens per second of forward_backward (LoRA, 8 GPUs)."""
    optim_step_s: float = 0.05
    sampler_swap_s: float = 0.2
    """save_weights_and_get_sampling_client: a LoRA adapter handed to the sampler."""
    save_weights_s: float = 1.0
    """save_weights_for_sampler with a name (a persistent sampler checkpoint)."""
    save_state_s: float = 2.0
    """save_state: weights and Adam moments written."""
    prefix_cache_tokens: int = 4_000_000
    """Prompt tokens a sampler keeps cached (least recently used blocks are dropped)."""
    time_scale: float = 1.0
    """Every time above is divided by this (a soak runs the model faster than real time)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value < 0 or (value == 0 and f.name.endswith(("rate", "scale"))):
                raise ValueError(f"latency model: {f.name} must be {'> 0' if f.name.endswith(('rate', 'scale')) else '>= 0'}"
                                 f", got {value}")

    def scaled(self, seconds: float) -> float:
        return seconds / self.time_scale


class ThroughputBudget:
    """Processor sharing of one server's throughput between requests in flight.

    A job needs ``work`` seconds of the whole server and may not finish sooner than
    ``floor_s``: its rate is at most ``work / floor_s`` of the server. The capacity (1.0)
    is water-filled between jobs; :meth:`run` blocks until the caller's job is done.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._jobs: dict[int, list[Any]] = {}  # id -> [remaining work, max rate, rate, done event]
        self._last = time.monotonic()
        self._next_id = 0
        self._closed = False
        threading.Thread(target=self._loop, daemon=True, name="latency-budget").start()

    def run(self, work: float, floor_s: float) -> None:
        done = threading.Event()
        if work <= 0:
            return
        with self._cond:
            self._advance()
            self._jobs[self._next_id] = [work, work / floor_s if floor_s > 0 else float("inf"), 0.0, done]
            self._next_id += 1
            self._share()
            self._cond.notify()
        done.wait()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for job in self._jobs.values():
                job[3].set()
            self._cond.notify()

    def _advance(self) -> None:
        now = time.monotonic()
        elapsed, self._last = now - self._last, now
        for key, job in list(self._jobs.items()):
            job[0] -= job[2] * elapsed
            if job[0] <= 1e-9:
                job[3].set()
                del self._jobs[key]

    def _share(self) -> None:
        capacity, jobs = 1.0, sorted(self._jobs.values(), key=lambda j: j[1])
        for i, job in enumerate(jobs):
            job[2] = min(job[1], capacity / (len(jobs) - i))
            capacity -= job[2]

    def _loop(self) -> None:
        with self._cond:
            while not self._closed:
                self._advance()
                self._share()
                waits = [job[0] / job[2] for job in self._jobs.values() if job[2] > 0]
                self._cond.wait(timeout=min(waits) + 1e-4 if waits else None)


class PrefixCache:
    """Which prompt blocks a sampler has seen, least recently used first out (as vLLM's
    automatic prefix caching keeps KV blocks, keyed by the chain of block hashes)."""

    BLOCK = 64

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = max(1, capacity_tokens // self.BLOCK)
        self._blocks: collections.OrderedDict[tuple[str, bytes], None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def lookup_and_add(self, namespace: str, tokens: list[int]) -> int:
        """How many leading tokens were cached; then all full blocks of ``tokens`` are."""
        data = np.asarray(tokens, dtype=np.int32).tobytes()
        digest, hit, cached = b"", True, 0
        with self._lock:
            for start in range(0, len(tokens) - len(tokens) % self.BLOCK, self.BLOCK):
                digest = hashlib.blake2b(digest + data[start * 4:(start + self.BLOCK) * 4], digest_size=16).digest()
                key = (namespace, digest)
                if hit and key in self._blocks:
                    cached += self.BLOCK
                    self._blocks.move_to_end(key)
                    continue
                hit = False
                self._blocks[key] = None
                if len(self._blocks) > self.capacity:
                    self._blocks.popitem(last=False)
        return cached


@dataclass(frozen=True)
class ServiceCall:
    """One service call as the bench compares them: the training step it belongs to, the
    endpoint and a digest of what was asked."""

    step: int
    endpoint: str
    digest: str


class LatencyTinkerServer(TinkerHTTPFake):
    """A Tinker-compatible HTTP server on 127.0.0.1 whose work is time; a context manager."""

    def __init__(self, root: str | Path, tokenizer: Any, model: LatencyModel = LatencyModel(),
                 timeout_rate: float = TIMEOUT_RATE) -> None:
        super().__init__(root)
        self.model = model
        self.policy = ScriptedPolicy(tokenizer, timeout_rate)
        self.budget = ThroughputBudget()
        self.cache = PrefixCache(model.prefix_cache_tokens)
        self.calls: list[ServiceCall] = []
        self.tokens = collections.Counter()
        """prefill (prompt tokens asked), prefill_new (after the cache), sampled, trained."""
        self.step_marks: list[tuple[float, float, int | None]] = []
        """(time, :meth:`busy_s`, step) at the end of every optim_step (the step boundaries;
        step counts from 1), and with step ``None`` at a client's first timed request."""
        self._run_starting = True
        self._states: dict[str, tuple[str, int]] = {}  # save_state path -> optim steps
        self._busy_lock = threading.Lock()
        self._in_flight = 0
        self._busy_since = 0.0
        self._busy_total = 0.0
        self._last_done: tuple[str, float] | None = None
        self.gaps: collections.Counter = collections.Counter()
        """Seconds with nothing in flight, by (endpoint served last, endpoint that ended
        the gap): where the client's own work sits in a step."""

    def __exit__(self, *exc: object) -> None:
        self.budget.close()
        super().__exit__(*exc)

    def new_client(self) -> None:
        """A new client process (a resume) starts: its first timed request opens a step
        (the restart is no idle gap of a step)."""
        self._run_starting = True
        self._last_done = None

    def busy_s(self) -> float:
        """Seconds so far during which at least one request was being served."""
        with self._busy_lock:
            extra = time.monotonic() - self._busy_since if self._in_flight else 0.0
            return self._busy_total + extra

    def _timed(self, endpoint: str, seconds: float, work: Any = None, started: float | None = None) -> None:
        """Hold the request for ``seconds`` (scaled) or, with ``work`` = (work, floor), its
        share of the sampling budget; counted as busy time from ``started`` (when its
        handling began: the policy's own compute is the service's time, not the client's).
        An idle gap before it is added to :attr:`gaps` under (the endpoint that ended
        last, this one)."""
        now = time.monotonic()
        started = now if started is None else started
        if self._run_starting:  # a client's first step starts with its first timed request
            self._run_starting = False
            self.step_marks.append((started, self.busy_s(), None))
        with self._busy_lock:
            if self._in_flight == 0:  # (a request that ended since ``started`` already counted that time)
                self._busy_since = max(started, self._last_done[1]) if self._last_done else started
                if self._last_done is not None:
                    self.gaps[(self._last_done[0], endpoint)] += self._busy_since - self._last_done[1]
            self._in_flight += 1
        try:
            if work is not None:  # the time already spent computing counts toward the floor
                self.budget.run(self.model.scaled(work[0]), max(0.0, self.model.scaled(work[1]) - (now - started)))
            elif seconds > 0:
                time.sleep(self.model.scaled(seconds))
        finally:
            with self._busy_lock:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._busy_total += time.monotonic() - self._busy_since
                    self._last_done = (endpoint, time.monotonic())

    def _record(self, step: int, endpoint: str, payload: bytes) -> None:
        digest = hashlib.blake2b(payload, digest_size=12).hexdigest()
        with self._lock:
            self.calls.append(ServiceCall(step, endpoint, digest))

    # ------------------------------------------------------------ endpoints

    def answer(self, endpoint: str, body: dict[str, Any]) -> Any:
        if endpoint == "load_weights":
            return self._future(endpoint, body, self._load_weights)
        if endpoint == "save_weights":
            return self._future(endpoint, body, self._save_state)
        if endpoint == "forward_backward":  # sent as protobuf
            return self._future(endpoint, _forward_backward_from_proto(body["_raw"]), self._forward_backward)
        return super().answer(endpoint, body)

    def _future(self, endpoint: str, body: dict[str, Any], compute: Any) -> dict[str, Any]:
        if endpoint != "asample":
            return super()._future(endpoint, body, compute)
        request_id = f"asample-{uuid.uuid4().hex[:12]}"
        result = compute(body)  # outside the per-model lock: samples run concurrently
        with self._lock:
            self._results[request_id] = result
            self.executed[endpoint] += 1
        return {"request_id": request_id, "model_id": None,
                "sample_sequence_ids": [uuid.uuid4().hex for _ in range(int(body.get("num_samples", 1)))]}

    def _create_model(self, body: dict[str, Any]) -> dict[str, Any]:
        from tinker import types

        request = types.CreateModelRequest.model_validate(body)
        model_id = f"model-{uuid.uuid4().hex[:8]}"
        self._trainers[model_id] = SimpleNamespace(model=request.base_model, steps=0)
        return {"model_id": model_id, "type": "create_model"}

    def _load_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        if body["path"] not in self._states:
            raise _not_found(body["path"])
        model_id = body.get("model_id") or f"{body['session_id']}:train:{body['model_seq_id']}"
        base, steps = self._states[body["path"]]
        self._trainers[model_id] = SimpleNamespace(model=body.get("base_model") or base, steps=steps)
        return {"path": body["path"], "model_id": model_id, "type": "load_weights"}

    def _forward_backward(self, body: dict[str, Any]) -> bytes:
        data, loss_fn, _config = body["request"]
        trainer = self._trainers[body["model_id"]]
        tokens = sum(len(d.model_input.to_ints()) for d in data)
        self.tokens["trained"] += tokens
        self._record(trainer.steps, "forward_backward", repr([(d.model_input.to_ints(), sorted(
            (k, v.tolist()) for k, v in d.loss_fn_inputs.items())) for d in data]).encode())
        self._timed("forward_backward", tokens / self.model.train_rate)
        outputs = [{"logprobs": _sampler_logprobs(d)} for d in data]
        return _forward_backward_proto(SimpleNamespace(metrics={"loss:sum": 0.0}, loss_fn_outputs=outputs))

    def _optim_step(self, body: dict[str, Any]) -> dict[str, Any]:
        trainer = self._trainers[body["model_id"]]
        self._record(trainer.steps, "optim_step", repr(sorted(body.get("adam_params", {}).items())).encode())
        self._timed("optim_step", self.model.optim_step_s)
        trainer.steps += 1
        self.step_marks.append((time.monotonic(), self.busy_s(), trainer.steps))
        return {"metrics": {}, "type": "optim_step"}

    def _save_state(self, body: dict[str, Any]) -> dict[str, Any]:
        trainer = self._trainers[body["model_id"]]
        self._timed("save_state", self.model.save_state_s)
        path = f"tinker://latency/weights/{body['path']}"
        self._states[path] = (trainer.model, trainer.steps)
        return {"path": path, "type": "save_weights"}

    def _save_weights_for_sampler(self, body: dict[str, Any]) -> dict[str, Any]:
        trainer = self._trainers[body["model_id"]]
        if not body.get("path"):  # ephemeral: the next step's sampler
            self._timed("sampler_swap", self.model.sampler_swap_s)
            session_id = f"sampler-{uuid.uuid4().hex[:8]}"
            self._samplers[session_id] = (trainer.steps, trainer.model, None)
            return {"sampling_session_id": session_id, "type": "save_weights_for_sampler"}
        self._timed("save_weights_for_sampler", self.model.save_weights_s)
        path = f"tinker://latency/sampler_weights/{body['path']}"
        self._states[path] = (trainer.model, trainer.steps)
        return {"path": path, "type": "save_weights_for_sampler"}

    def _create_sampling_session(self, body: dict[str, Any]) -> dict[str, Any]:
        path = body.get("model_path")
        base, steps = self._states[path] if path in self._states else (body.get("base_model"), 0)
        if base is None:
            raise _not_found(str(path))
        session_id = f"sampler-{uuid.uuid4().hex[:8]}"
        self._samplers[session_id] = (steps, base, path)
        return {"type": "create_sampling_session", "sampling_session_id": session_id}

    def _sample(self, body: dict[str, Any]) -> bytes:
        from tinker import types

        started = time.monotonic()
        request = types.SampleRequest.model_validate(body)
        steps = self._samplers[request.sampling_session_id][0]
        prompt = request.prompt.to_ints()
        params = request.sampling_params
        self._record(steps, "asample", repr((prompt, request.num_samples, params.seed, params.max_tokens,
                                             params.temperature, params.stop)).encode())
        seeds = [params.seed] if request.num_samples == 1 else [None] * request.num_samples
        sequences = [self.policy.sample(prompt, seed, params.max_tokens, _stop_ids(params.stop)) for seed in seeds]
        cached = self.cache.lookup_and_add(request.sampling_session_id, prompt)
        sampled = sum(len(tokens) for tokens, _, _ in sequences)
        self.tokens.update(prefill=len(prompt), prefill_new=len(prompt) - cached, sampled=sampled)
        for tokens, _, _ in sequences:  # decoded blocks are cached too
            self.cache.lookup_and_add(request.sampling_session_id, prompt + tokens)
        m = self.model
        prefill_s = (len(prompt) - cached) / m.prefill_rate
        longest = max(len(tokens) for tokens, _, _ in sequences)
        self._timed("asample", 0, (prefill_s + sampled / m.decode_rate, m.ttft_s + prefill_s + longest / m.stream_decode_rate),
                    started)
        return _sample_proto(SimpleNamespace(sequences=[SimpleNamespace(tokens=t, logprobs=lp, stop_reason=r)
                                                        for t, lp, r in sequences]))


def _sampler_logprobs(datum: Any) -> np.ndarray:
    """The datum's sampling logprobs (its target count if it sent none: zeros)."""
    inputs = datum.loss_fn_inputs
    if "logprobs" in inputs:
        return np.asarray(inputs["logprobs"].tolist(), dtype=np.float32)
    return np.zeros(len(inputs["target_tokens"].tolist()), dtype=np.float32)


def _stop_ids(stop: Any) -> list[int]:
    """The stop token ids of a request (Qwen3.5's ``<|im_end|>`` when it sent none)."""
    ids = [s for s in (stop or []) if isinstance(s, int)]
    return ids or [248046]


def _not_found(path: str) -> Exception:
    from tests.fake_tinker_http import _HTTPError

    return _HTTPError(404, f"latency-model service: no checkpoint {path}")


def replace_model(model: LatencyModel, **changes: Any) -> LatencyModel:
    """``model`` with some fields changed (flags left at ``None`` keep their default)."""
    return dataclasses.replace(model, **{k: v for k, v in changes.items() if v is not None})
