"""``LocalSamplingClient``: concurrent ``sample`` calls merged into batched decode calls.

Requests that arrive together (a batch starts once none has come for ``sample_window_s``,
at most ``sample_gather_s`` after the first) are grouped by sampling settings
(``max_tokens`` and ``seed`` may differ) and run as one batch per group of at most
``max_rows`` rows, in a worker thread so that other trajectories' sandbox calls proceed
meanwhile. On the lean loop the batch is continuous (``continuous_batching``, on by
default): rows join the running decode loop as others finish — the batch's later rows
and the next turns of trajectories whose code calls came back — within ``max_rows`` and
the KV budget, and each request is answered as soon as its rows are done; otherwise a
batch's rows run in chunks, one after another, each until its longest row ends. Each batch picks a layout for its rows (plain left padding, a shared prefix
computed once, or stored KV of earlier turns; ``kv_cache``), then decodes them with the
sampler's own loop (``decode_loop``, the default: finished rows leave the batch) or one
HF ``generate`` call (``decode_loop="generate"``), draws tokens with ``decoding``'s
sampler and cuts rows at stop tokens and budgets. After every batch the freed memory
goes back to the system (``memory``).

Not covered: how tokens are drawn and seeded (``decoding``), the KV layouts
(``kv_cache``), anything touching HF cache internals (``hf_compat``), new weights (the
model is the trainer's; the trainer calls :meth:`LocalSamplingClient.clear_kv_cache`).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from retool.engines import openmp
from retool.engines.base import SampledSequence, SampleResult, SamplingParams
from retool.engines.local import decoding, hf_compat, kv_cache, lean_decode, memory, probe
from retool.engines.settings import LocalSettings
from retool.engines.local.base_spill import BaseSpill
from retool.engines.local.decode_loop import Admitted, decode
from retool.engines.local.model import default_stop_token_ids, model_mode


DECODE_LOOPS = ("lean", "own", "generate")
"""``lean``: the sampler's decode loop with lean decode steps (``lean_decode``: merged
weights, the shared prefix's KV read once; Llama/Qwen-style models, others get ``own``);
``own``: the same loop through the model's forward pass (``decode_loop.decode``; drops
finished rows); ``generate``: one HF ``generate`` call per batch (the first path)."""


@dataclass(eq=False)
class _Request:
    prompt: tuple[int, ...]
    num_samples: int
    params: SamplingParams
    future: asyncio.Future
    sequences: dict[int, SampledSequence] = field(default_factory=dict)
    """Its rows' sequences by sample index, as they finish."""

    def answer(self) -> None:
        """Resolve the request once every one of its rows is in (on its event loop's thread)."""
        if len(self.sequences) == self.num_samples and not self.future.done():
            self.future.set_result(SampleResult(tuple(self.sequences[i] for i in range(self.num_samples))))


Row = tuple[_Request, int]
"""A request and one of its sample indices: one row of a decode batch."""


@dataclass(eq=False)
class _Stream:
    """The rows of a continuous batch not yet taken in: the batch's own, in order, and
    those of requests of the same settings that arrived while it runs
    (``LocalSamplingClient.sample``), taken first — mostly trajectories' next turns, whose
    earlier turn's KV is still in the store, and which bring a trajectory to its end.
    Each queue is only appended to on the right (the event loop's thread) and taken from
    on the left (the decode thread)."""

    key: tuple
    waiting: collections.deque = field(default_factory=collections.deque)
    joined: collections.deque = field(default_factory=collections.deque)
    requests: list[_Request] = field(default_factory=list)

    def add(self, request: _Request, *, joining: bool = False) -> None:
        self.requests.append(request)
        (self.joined if joining else self.waiting).extend((request, i) for i in range(request.num_samples))

    def head(self) -> tuple[collections.deque, Row] | None:
        """The queue the next row comes from, and that row (it stays there until taken)."""
        queue = self.joined or self.waiting
        return (queue, queue[0]) if queue else None

    def __bool__(self) -> bool:
        return bool(self.joined or self.waiting)


@dataclass(eq=False)
class _LoopQueue:
    """The requests of one event loop waiting for a batch, the task that runs them, and
    the continuous batch it runs now (if any)."""

    pending: list[_Request] = field(default_factory=list)
    runner: asyncio.Task | None = None
    stream: _Stream | None = None


class LocalSamplingClient:
    """Samples with the local model, merging concurrent ``sample`` calls into batches.

    Calls from several event loops at once (rollouts of two steps on their own threads,
    ``--max-staleness``) are batched per loop: each loop's requests wait in its own queue
    and are answered on it, and the lock runs one batch at a time.

    ``calls`` counts ``generate`` calls (it drives the seeded sampling stream);
    ``rows`` counts the sequences generated so far, ``prompt_tokens`` the prompt tokens
    they were conditioned on (prefill, counted once per sequence) and ``sampled_tokens``
    the tokens returned; ``prefix_cached_tokens`` counts the prompt tokens whose
    computation the shared-prefix cache saved.

    Shared-prefix cache (``prefix_cache``, on by default): when the rows of one
    ``generate`` call share a prompt prefix of at least ``kv_cache.MIN_SHARED_PREFIX``
    tokens (the system prompt and tool declaration; a GRPO group's whole question), that
    prefix is run once (the HF paths repeat its KV for every row; the lean steps read one
    copy for all rows); rows are laid out
    ``[prefix, padding, own tokens]`` so the prefix sits at the same positions in every
    row. The prefill — 80 % of sampling time for short turns under a long prompt — then
    costs one prefix plus the rows' own tokens. Models whose cache is not pure attention
    (sliding-window or linear-attention layers) fall back to plain left padding.

    KV store (``kv_cache_mb`` > 0): after each ``generate`` the KV cache of every row
    (its prompt and sampled tokens but the last) and of a shared prefix is kept, keyed
    by those tokens, in an LRU store (``kv_store``) of at most ``kv_cache_mb`` (a row
    after a stored system prompt keeps only its own columns). When every row of a call
    continues a stored sequence (a trajectory's next turn; a new question after the
    stored system prompt), only the new tokens are prefilled — if that costs less than
    the shared-prefix layout: on the lean path from one copy of the stored KV, through
    the lean weights, the prefix all rows share read once (``kv_cache.restored_layout``);
    on the HF paths rows are laid out ``[padding, stored tokens, padding, new tokens]``
    in an HF cache. ``kv_reused_tokens``
    counts the prompt tokens it saved. :meth:`clear_kv_cache` empties it (the training
    client calls it whenever the weights change).

    Decode steps: ``reserve_kv`` (on) lets each attention layer's cache grow into
    reserved room rather than being re-concatenated at every step (HF's default), and
    top-p looks at the ``nucleus_candidates`` (256) most likely tokens instead of sorting
    the vocabulary (HF's warper when the nucleus is wider; 0 always uses it). Both give
    the same samples as the plain HF path; ``bench/sampling.py --tool-prompts --decode``
    measures them.

    Decode loop (``decode_loop``): ``own`` prefills once and calls the model once per
    token itself (``decode_loop.decode``), dropping rows that hit a stop token or their
    budget from the batch, so that a batch's late steps cost only the rows still running;
    ``lean`` (default) is that loop with lean decode steps (``lean_decode``: LoRA merged
    into a copy of the weights once per weight version, fused and oneDNN-packed products,
    the shared prefix's KV read once for all rows; Llama/Qwen2/Qwen3 models, others get
    ``own``); ``generate`` is one HF ``generate`` call per batch, which computes every row
    until the last one finishes. All draw the same tokens with the same logprobs (up to
    float rounding); ``bench/sampling.py --loops`` compares them. The merged copy costs
    the model's weights once more in memory (538 MB for SmolLM2-135M in fp32); a
    ``frozen`` sampler (``retool eval``'s, whose weights never change) frees the model's
    matrices instead, in either precision, and computes every shared prefix through the
    copy too (:meth:`_release_model`).

    Precision (``precision``): ``fp32`` (default) decodes with the trainer's weights as
    they are. ``bf16`` makes the lean loop's merged copy in bfloat16 (half its memory: 310
    vs 513 MiB for SmolLM2-135M), and with it the KV cache, the KV store (its budget
    counts bf16 bytes) and the shared prefix's forward; the residual stream, softmaxes and
    logits stay fp32. Tokens are drawn from that bf16 model and the logprobs returned are
    its own, a little off the fp32 trainer's (``docs/benchmarks.md``: mean 0.02 nats on
    SmolLM2). The ``own`` and ``generate`` loops refuse bf16 (``LocalSettings.validate``);
    a model the lean loop does not cover decodes in fp32 with a warning. ``auto`` is bf16
    where :func:`lean_decode.native_bf16` (``avx512_bf16``/AMX, or a bf16 GPU), else fp32;
    ``precision`` (the property) says which one runs.

    Fast path: the prefix cache, the KV store, reserved room and the own decode loop
    reach into transformers' cache internals (``hf_compat``). With ``fast_sampling`` off, or on
    a transformers release outside ``hf_compat.TESTED_TRANSFORMERS``, all of them are off
    and every call is a plain left-padded ``generate``: the same tokens, slower.

    Memory: a batch's KV cache is bounded by ``batch_kv_mb`` (512 MB): the rows of a
    group are cut into batches whose KV — each row's own columns padded to the longest
    plus its budget, the shared prefix once on the lean path — fits it (``_chunks``),
    besides ``max_rows``. The KV store is bounded by ``kv_cache_mb`` (512 MB). glibc
    keeps the memory that a batch's KV caches and logits free in per-thread arenas, and
    the process can grow by about a batch's KV at every batch; the sampler caps the
    arenas at two and trims them after every batch (``memory``). With ``spill_base`` the
    trainer's frozen layer matrices leave memory while this sampler holds its merged copy
    (``base_spill``; the trainer reads them back with :meth:`restore_base`), and shared
    prefixes are computed through that copy. ``docs/benchmarks.md`` has the demo eval's
    measured peaks.
    """

    def __init__(self, model: Any, tokenizer: Any, lock: threading.Lock, *, seed: int = 42,
                 settings: LocalSettings = LocalSettings(), frozen: bool = False) -> None:
        settings.validate()
        self.frozen = frozen
        self.released_bytes = 0
        """Bytes of the model's matrices freed once the lean step had its own copy (``frozen``)."""
        if settings.decode_loop not in DECODE_LOOPS:
            raise ValueError(f"decode_loop must be one of {', '.join(DECODE_LOOPS)}, got {settings.decode_loop!r}")
        self.model, self.tokenizer, self._lock = model, tokenizer, lock
        self.seed, self.window_s, self.max_rows = seed, settings.sample_window_s, settings.max_sample_rows
        self.gather_s, self.continuous = settings.sample_gather_s, settings.continuous_batching
        self.fast = hf_compat.fast_path_enabled(settings.fast_sampling)
        self.prefix_cache = settings.prefix_cache and self.fast
        self.prefix_cached_tokens = 0
        self.kv_store = kv_cache.KVStore(settings.kv_cache_mb * 2**20 if self.fast else 0)
        self.batch_kv_bytes = settings.batch_kv_mb * 2**20
        self.reserve_kv = self.fast
        self.decode_loop = settings.decode_loop if self.fast else "generate"
        self.dtype = self._decode_dtype(settings.precision)
        self.kv_bytes_per_token = kv_cache.kv_bytes_per_token(model, self.dtype)
        self.nucleus_candidates = 256
        self._lean_weights: lean_decode.DecodeWeights | None = None
        self.base_spill: BaseSpill | None = None
        """The trainer's frozen layer matrices, freed while this sampler holds its merged copy
        (``LocalSettings.spill_base``; set by the training client, :mod:`base_spill`)."""
        self._spilled_version: tuple = ()
        self.kv_reused_tokens = 0
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.default_stop_ids = tuple(sorted(default_stop_token_ids(model, tokenizer)))
        memory.limit_arenas()
        self.calls = 0
        self.rows = 0
        self.prompt_tokens = 0
        self.sampled_tokens = 0
        self._queues: dict[asyncio.AbstractEventLoop, _LoopQueue] = {}
        """Each event loop's waiting requests (an entry lives while its loop has any)."""

    def _decode_dtype(self, precision: str) -> Any:
        """The lean steps' dtype for ``precision`` (``None``: the model's own): bf16 only on
        the lean loop (``auto`` falls back to the model's dtype on the others; an explicit
        bf16 there is refused by ``LocalSettings.validate``, or here when the fast path is
        off for an untested transformers release)."""
        dtype = lean_decode.resolve_precision(precision, self.model.device)
        if dtype is None or dtype == self.model.dtype:
            return None
        if self.decode_loop != "lean":
            if precision == "bf16":
                raise ValueError("precision bf16 needs the lean decode loop, which is off here (fast sampling off "
                                 "or an untested transformers release)")
            return None
        return dtype

    @property
    def precision(self) -> str:
        """What the sampler decodes in now: ``bf16`` or ``fp32`` (the model's own weights;
        bfloat16 for a bf16 model), for logs and run records."""
        return "bf16" if (self.dtype or self.model.dtype) == torch.bfloat16 else "fp32"

    @property
    def kv_cache_bytes(self) -> int:
        """The KV store's memory budget; 0 turns it off."""
        return self.kv_store.budget_bytes

    @kv_cache_bytes.setter
    def kv_cache_bytes(self, value: int) -> None:
        self.kv_store.resize(value)

    def clear_kv_cache(self) -> None:
        """Forget every stored KV cache and the lean step's merged weights (they belong to
        the weights that made them; a frozen sampler that freed the model's matrices keeps
        its copy, the only one left)."""
        self.kv_store.clear()
        if not self.released_bytes:
            self._lean_weights = None

    async def compute_logprobs(self, tokens: Sequence[int], start: int) -> tuple[float, ...]:
        """Teacher-forced logprobs of ``tokens[start:]`` through this sampler's decode path (the
        weight-sync guard's probe, ``retool.weight_sync``)."""
        return await openmp.on_worker_thread(probe.sampler_logprobs, self, tokens, start)

    async def sample(self, prompt_tokens: Sequence[int], num_samples: int,
                     sampling_params: SamplingParams) -> SampleResult:
        """``num_samples`` continuations of ``prompt_tokens`` (see ``base.SamplingClient``).

        Returned tokens include the stop token when one ended the sequence.
        """
        prompt = tuple(int(t) for t in prompt_tokens)
        if not prompt or min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(f"prompt_tokens must be non-empty ids in [0, {self.vocab_size})")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if any(not 0 <= t < self.vocab_size for t in sampling_params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be ids in [0, {self.vocab_size})")
        loop = asyncio.get_running_loop()
        request = _Request(prompt, num_samples, sampling_params, loop.create_future())
        queue = self._queues.setdefault(loop, _LoopQueue())  # only this loop's thread touches its entry
        if queue.stream is not None and queue.stream.key == _settings_key(sampling_params):
            queue.stream.add(request, joining=True)  # joins the running batch at its next free rows
            return await request.future
        queue.pending.append(request)
        if queue.runner is None or queue.runner.done():
            queue.runner = loop.create_task(self._drain(loop, queue))
        return await request.future

    async def _drain(self, loop: asyncio.AbstractEventLoop, queue: _LoopQueue) -> None:
        """Run batches of ``loop``'s requests until none is waiting; new requests join the
        next batch. The loop's queue is dropped when it empties.

        A failing ``generate`` fails every request of its batch (the callers see the
        exception); the runner then carries on with the requests that came in meanwhile.
        """
        try:
            while queue.pending:
                await self._gather(loop, queue)
                batch, queue.pending = queue.pending, []
                try:
                    await self._run_batch(loop, queue, batch)
                except asyncio.CancelledError:
                    _fail(batch + queue.pending + _joined(queue), RuntimeError("the sampler was cancelled"))
                    queue.pending = []
                    raise
                except Exception as exc:
                    _fail(batch + _joined(queue), exc)
                finally:
                    queue.stream = None
        finally:
            if not queue.pending and self._queues.get(loop) is queue:
                del self._queues[loop]

    async def _gather(self, loop: asyncio.AbstractEventLoop, queue: _LoopQueue) -> None:
        """Wait while requests keep coming: until none has arrived for ``window_s``, at
        most ``gather_s`` in all. After a batch, the trajectories it answered come back
        one by one from their code calls (a sandbox of a few workers answers them over a
        second or so); a batch started at the first arrival would decode a few rows for
        up to a whole turn while the others wait behind it."""
        deadline = loop.time() + self.gather_s
        seen = -1
        while len(queue.pending) != seen:
            seen = len(queue.pending)
            left = deadline - loop.time()
            if left <= 0:
                return
            await asyncio.sleep(min(self.window_s, left))

    async def _run_batch(self, loop: asyncio.AbstractEventLoop, queue: _LoopQueue, batch: list[_Request]) -> None:
        for group in _group_by_settings(batch):
            if self.continuous and self.decode_loop == "lean":
                await self._run_stream(loop, queue, group)
                continue
            rows = [(r, i) for r in group for i in range(r.num_samples)]
            for chunk in self._chunks(rows):
                sequences = await openmp.on_worker_thread(self._generate, chunk)
                await asyncio.to_thread(memory.release_free_memory)  # the batch's KV and logits are gone now
                for (request, i), sequence in zip(chunk, sequences):
                    request.sequences[i] = sequence
                for request, _ in chunk:  # answered now, not after the other chunks
                    request.answer()

    async def _run_stream(self, loop: asyncio.AbstractEventLoop, queue: _LoopQueue, group: list[_Request]) -> None:
        """The rows of ``group`` as one continuous batch (``continuous``): rows join the decode
        loop as others finish, within ``max_rows`` and the KV budget, and each request is
        answered as soon as its rows are done, so its trajectory's next turn can join the
        same loop (``sample`` adds requests of the same settings to ``queue.stream``). A
        row whose prompt does not start with the loop's shared prefix waits for the next
        loop, started when this one ends."""
        stream = queue.stream = _Stream(_settings_key(group[0].params))
        for request in group:
            stream.add(request)

        def finished(row: Row, sequence: SampledSequence) -> None:  # on the decode thread
            request, i = row
            request.sequences[i] = sequence
            if not loop.is_closed():  # closed: the caller was cancelled and waits for nothing
                loop.call_soon_threadsafe(request.answer)

        while stream:
            await openmp.on_worker_thread(self._generate_stream, stream, finished, loop)
            await asyncio.to_thread(memory.release_free_memory)  # the batch's KV and logits are gone now
        queue.stream = None

    def _chunks(self, rows: list[tuple[_Request, int]]) -> list[list[tuple[_Request, int]]]:
        """``rows`` in order, as batches of at most ``max_rows`` whose KV cache (estimated
        by :meth:`_kv_bytes`) fits ``batch_kv_bytes``, at least one row each; as many
        batches as filling each in turn needs, of even sizes where they fit (not 63 + 1)."""
        chunks = self._fill(rows, self.max_rows)
        if len(chunks) > 1:
            even = self._fill(rows, -(-len(rows) // len(chunks)))
            chunks = even if len(even) == len(chunks) else chunks
        return chunks

    def _fill(self, rows: list[tuple[_Request, int]], most: int) -> list[list[tuple[_Request, int]]]:
        """``rows`` in order, each batch filled while it has fewer than ``most`` rows and fits."""
        chunks: list[list[tuple[_Request, int]]] = []
        current: list[tuple[_Request, int]] = []
        shared = 0
        for row in rows:
            prompt = row[0].prompt
            with_row = min(shared, kv_cache.common_prefix([current[0][0].prompt, prompt])) if current else len(prompt)
            if current and (len(current) == most
                            or 0 < self.batch_kv_bytes < self._kv_bytes(current + [row], with_row)):
                chunks.append(current)
                current, with_row = [], len(prompt)
            current.append(row)
            shared = with_row
        return chunks + [current] if current else chunks

    def _kv_bytes(self, rows: list[tuple[_Request, int]], shared: int) -> int:
        """The KV memory of decoding ``rows`` (whose prompts share ``shared`` leading tokens)
        together: each row's own columns (its prompt after that prefix, padded to the
        longest, and the largest budget), plus the prefix once on the lean path (the HF
        paths keep it in every row)."""
        if self.decode_loop != "lean":
            shared = 0
        own = max(len(r.prompt) for r, _ in rows) - shared + max(r.params.max_tokens for r, _ in rows)
        return (len(rows) * own + shared) * self.kv_bytes_per_token

    def _generate(self, rows: list[tuple[_Request, int]]) -> list[SampledSequence]:
        """One ``generate`` call for rows (request, sample index) that share sampling settings."""
        params = rows[0][0].params
        stop_ids = params.stop_token_ids or self.default_stop_ids
        device = self.model.device
        prompts = [r.prompt for r, _ in rows]
        max_tokens_R = [r.params.max_tokens for r, _ in rows]
        seeds = decoding.row_seeds(self.seed, self.calls, [(r.params.seed, i) for r, i in rows])
        sampler = decoding.RowSampler(params, decoding.row_generators(seeds, device), self.nucleus_candidates)
        with self._lock, torch.no_grad(), model_mode(self.model, train=False):
            lean = self._lean() if self.decode_loop == "lean" else None
            cache, input_ids, attention_mask, prefix_saved, reused = self._layout(prompts, lean)
            if self.reserve_kv and lean is None:
                cache = hf_compat.with_reserved_room(cache, self.model.config, max(max_tokens_R))
            if self.decode_loop != "generate":
                sequences = self._decode(cache, input_ids, attention_mask, prompts, sampler, max_tokens_R,
                                         set(stop_ids), lean)
            else:
                sequences = self._generate_call(cache, input_ids, attention_mask, prompts, sampler, max_tokens_R,
                                                stop_ids)
            self.calls += 1
            self.prefix_cached_tokens += prefix_saved
            self.kv_reused_tokens += reused
        self.rows += len(rows)
        self.prompt_tokens += sum(len(p) for p in prompts)
        self.sampled_tokens += sum(len(s.tokens) for s in sequences)
        return sequences

    def _generate_stream(self, stream: _Stream, finished: Callable[[Row, SampledSequence], None],
                         loop: asyncio.AbstractEventLoop) -> None:
        """One continuous decode loop over the rows of ``stream`` (they share sampling
        settings), for event loop ``loop``: the first ones that fit (``max_rows``,
        ``batch_kv_bytes``), then more from its head as rows finish, while they start with
        the loop's shared prefix and no other event loop's requests wait for the sampler
        (rollouts of two steps at once take turns, as with batches); ``finished(row,
        sequence)`` as each row ends. Rows it leaves stay in ``stream``."""
        waiting = list(stream.joined) + list(stream.waiting)
        shared = kv_cache.shared_prefix_length([r.prompt for r, _ in waiting]) if self.prefix_cache else 0
        rows: list[Row] = self._take(stream, 0, 0, shared, ())
        params = rows[0][0].params
        stop_ids = set(params.stop_token_ids or self.default_stop_ids)
        prompts = [r.prompt for r, _ in rows]
        call, device = self.calls, self.model.device
        sampler = decoding.RowSampler(params, decoding.row_generators(self._row_seeds(call, rows), device),
                                      self.nucleus_candidates)
        done: set[int] = set()

        def answer(row: int, tokens: list[int], logprobs: list[float]) -> None:
            done.add(row)
            finished(rows[row], decoding.finish_row(tokens, logprobs, rows[row][0].params.max_tokens, stop_ids))

        def on_finished(row_kv: Any, row: int, tokens: list[int], logprobs: list[float], prompt_mask: Any) -> None:
            if self.kv_cache_bytes:
                kv_cache.store_row(self.kv_store, row_kv(), prompt_mask, prompts[row], tuple(tokens))
            answer(row, tokens, logprobs)

        with self._lock, torch.no_grad(), model_mode(self.model, train=False):
            lean = self._lean()
            cache, input_ids, attention_mask, prefix_saved, reused = self._layout(prompts, lean, most=shared)
            prefix = cache if isinstance(cache, kv_cache.Restored) else kv_cache.Restored()
            prefix_tokens = prompts[0][:prefix.prefix_len]

            def admit(step: lean_decode.LeanCache, running: int) -> list[Admitted]:
                if any(queue.pending for other, queue in list(self._queues.items()) if other is not loop):
                    return []
                taken = self._take(stream, running, step.capacity, len(prefix_tokens), prefix_tokens)
                hits = [kv_cache.stored_hit(self.kv_store, r.prompt, len(prefix_tokens)) for r, _ in taken]
                stored = [(row, hit) for row, hit in zip(taken, hits) if hit is not None]
                whole = [row for row, hit in zip(taken, hits) if hit is None]
                admissions = [([row for row, _ in stored], [hit for _, hit in stored])] if stored else []
                admissions += [(whole, None)] if whole else []
                return [self._admitted(lean, step, these, these_hits, rows, prompts, sampler, call, len(prefix_tokens))
                        for these, these_hits in admissions]

            max_tokens_R = [r.params.max_tokens for r, _ in rows]
            results = decode(self.model, cache, input_ids, attention_mask, sampler, max_tokens_R, stop_ids,
                             on_finished=on_finished, lean=lean, admit=admit if lean is not None else None)
            self.calls += 1
            self.prefix_cached_tokens += prefix_saved
            self.kv_reused_tokens += reused
        for row, (tokens, logprobs) in enumerate(results):
            if row not in done:  # a cache that is not pure attention ends its rows only here
                answer(row, tokens, logprobs)
        self.rows += len(rows)
        self.prompt_tokens += sum(len(p) for p in prompts)
        self.sampled_tokens += sum(min(len(t), r.params.max_tokens) for (t, _), (r, _) in zip(results, rows))

    def _admitted(self, lean: lean_decode.DecodeWeights, step: lean_decode.LeanCache, taken: list[Row],
                  hits: list[tuple[int, tuple[int, ...]]] | None, rows: list[Row], prompts: list[tuple[int, ...]],
                  sampler: decoding.RowSampler, call: int, keep: int) -> Admitted:
        """``taken`` prefilled against the running loop's shared prefix (its first ``keep``
        tokens), numbered after ``rows``: from each row's stored KV (``hits``, one
        :func:`kv_cache.stored_hit` a row), or whole after the prefix (``hits`` ``None``)."""
        new_prompts = [r.prompt for r, _ in taken]
        start, ids, mask, saved = kv_cache.admitted_layout(self.kv_store, new_prompts, hits, keep, tuple(step.prefix),
                                                           self.tokenizer.pad_token_id, self.model.device)
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        budgets = [r.params.max_tokens for r, _ in taken]
        new, logits_B = lean_decode.LeanCache.prefill(lean, start, ids, mask, positions, max(budgets))
        sampler.generators_R += decoding.row_generators(self._row_seeds(call, rows + taken)[len(rows):],
                                                        self.model.device)
        rows.extend(taken)
        prompts.extend(new_prompts)
        self.kv_reused_tokens += saved
        self.prefix_cached_tokens += keep * len(taken)
        return Admitted(new, logits_B, list(mask), budgets, positions[:, -1] + 1)

    def _take(self, stream: _Stream, running: int, capacity: int, shared: int, prefix: tuple[int, ...]) -> list[Row]:
        """Rows from the head of ``stream`` that can decode beside ``running`` rows whose
        own columns have room for ``capacity``: at most ``max_rows`` in all, their KV within
        ``batch_kv_bytes`` (the first row always, when nothing runs), each starting with
        ``prefix`` (the loop's shared prefix, ``shared`` tokens; none yet at the start)."""
        taken: list[Row] = []
        while (head := stream.head()) is not None and running + len(taken) < self.max_rows:
            queue, row = head
            if row[0].prompt[:len(prefix)] != prefix:
                break
            own = max([capacity] + [len(r.prompt) - shared + r.params.max_tokens for r, _ in taken + [row]])
            kv = ((running + len(taken) + 1) * own + shared) * self.kv_bytes_per_token
            if 0 < self.batch_kv_bytes < kv and (running or taken):
                break
            taken.append(queue.popleft())  # the row peeked at: only this thread takes from the left
        return taken

    def _row_seeds(self, call: int, rows: list[Row]) -> list[int]:
        return decoding.row_seeds(self.seed, call, [(r.params.seed, i) for r, i in rows])

    def _decode(self, cache: Any, input_ids: Any, attention_mask: Any, prompts: list[tuple[int, ...]],
                sampler: decoding.RowSampler, max_tokens_R: list[int], stop_ids: set[int],
                lean: lean_decode.DecodeWeights | None) -> list[SampledSequence]:
        """The rows sampled by the sampler's own decode loop (lean steps with ``lean``
        weights); each finished row's KV goes to the store."""
        def keep_kv(row_kv: Any, row: int, tokens: list[int], logprobs: list[float], prompt_mask: Any) -> None:
            if self.kv_cache_bytes:
                kv_cache.store_row(self.kv_store, row_kv(), prompt_mask, prompts[row], tuple(tokens))

        rows_R = decode(self.model, cache, input_ids, attention_mask, sampler, max_tokens_R, stop_ids,
                        on_finished=keep_kv, lean=lean)
        return [decoding.finish_row(tokens, logprobs, budget, stop_ids)
                for (tokens, logprobs), budget in zip(rows_R, max_tokens_R)]

    def _generate_call(self, cache: Any, input_ids: Any, attention_mask: Any, prompts: list[tuple[int, ...]],
                       sampler: decoding.RowSampler, max_tokens_R: list[int],
                       stop_ids: Sequence[int]) -> list[SampledSequence]:
        """The rows sampled by one HF ``generate`` call (``decode_loop="generate"``)."""
        width = input_ids.shape[1]
        config = decoding.generation_config(max(max_tokens_R), stop_ids, self.tokenizer.pad_token_id)
        out = self.model.generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
            logits_processor=LogitsProcessorList([sampler]),
            stopping_criteria=StoppingCriteriaList([decoding.RowBudget(width, max_tokens_R, input_ids.device)]),
            **hf_compat.generate_cache_kwargs(cache))
        new_tokens = out.sequences[:, width:]
        logprobs = sampler.taken_logprobs(new_tokens)
        sequences = [decoding.finish_row(new_tokens[k].tolist(), logprobs[k].tolist(), max_tokens_R[k],
                                         set(stop_ids)) for k in range(len(prompts))]
        self._store_rows(out, attention_mask, prompts, sequences)
        return sequences

    def _layout(self, prompts: list[tuple[int, ...]], lean: lean_decode.DecodeWeights | None,
                most: int | None = None) -> tuple[Any, Any, Any, int, int]:
        """Cache, input ids, attention mask, and the prompt tokens saved by the prefix cache
        and by the KV store, for one call: stored KV of earlier turns, else a shared prefix
        computed once, else plain left padding. With ``lean`` the cache is a
        ``kv_cache.Restored`` for the lean prefill (the prefix once, not repeated per
        row; at most ``most`` tokens of it), else an HF cache (``None``: none)."""
        pad, device = self.tokenizer.pad_token_id, self.model.device
        shared = kv_cache.shared_prefix_length(prompts) if self.prefix_cache else 0
        if most is not None:
            shared = min(shared, most)
        if lean is not None:
            stored = kv_cache.restored_layout(self.kv_store, prompts, shared, pad, device, most=most)
        else:
            stored = kv_cache.stored_layout(self.kv_store, prompts, shared, pad, device)
        if stored is not None:
            cache, input_ids, attention_mask, reused = stored
            return cache, input_ids, attention_mask, 0, reused
        prefix = self._prefix_kv(prompts[0][:shared], lean) if shared else None
        if prefix is None:
            shared = 0
        input_ids, attention_mask = kv_cache.left_pad(prompts, pad, device, keep=shared)
        if prefix is None:
            cache = None
        else:
            cache = kv_cache.Restored(prefix) if lean is not None else kv_cache.repeated_cache(prefix, len(prompts))
        return cache, input_ids, attention_mask, shared * (len(prompts) - 1), 0

    def _lean(self) -> lean_decode.DecodeWeights | None:
        """The lean step's weights for the model's current weights (merged again only
        after they changed, or in another dtype), or ``None`` for a model it does not cover
        (then a bf16 sampler decodes in the model's own dtype: the loop falls back to
        ``own``). A ``frozen`` sampler frees the model's matrices after the first merge
        (:meth:`_release_model`) and merges no more."""
        if self.released_bytes:
            return self._lean_weights
        spill = self.base_spill
        if spill is not None and spill.out:
            if self._lean_weights is not None and self._spilled_version == lean_decode.weight_version(self.model, trained_only=True):
                return self._lean_weights
            self._lean_weights = None  # stale: its memory goes before the model's matrices come back
            spill.restore()
        self._lean_weights = lean_decode.decode_weights(self.model, self._lean_weights, self.dtype)
        if self._lean_weights is None and self.dtype is not None:
            warnings.warn(f"precision bf16: the lean decode loop does not cover {type(self.model).__name__}; the "
                          "sampler decodes in the model's own dtype", RuntimeWarning, stacklevel=2)
            self.dtype = None
            self.kv_bytes_per_token = kv_cache.kv_bytes_per_token(self.model)
        if self.frozen and self._lean_weights is not None:
            self._release_model()
        elif spill is not None and self._lean_weights is not None:
            self._spilled_version = lean_decode.weight_version(self.model, trained_only=True)
            spill.release()
            memory.release_free_memory()
        return self._lean_weights

    def restore_base(self) -> None:
        """Put the model's spilled layer matrices back (``base_spill``) before anything but
        this sampler's lean steps runs the model; the caller holds the shared lock."""
        if self.base_spill is not None:
            self.base_spill.restore()

    def stop_spilling(self) -> None:
        """Put the model's matrices back for good and spill no more (a frozen copy made for
        sampling during training shares them); the caller holds the shared lock."""
        if self.base_spill is not None:
            self.base_spill.close()
            self.base_spill = None

    def _release_model(self) -> None:
        """Free the model's weight matrices (every parameter of two or more dimensions:
        the layers' products, LoRA's A and B, the embeddings) once the lean step holds its
        merged copy: every path of a frozen sampler reads that copy (the prefill, the
        steps, the shared prefix, the probe), so the model's matrices only cost memory —
        540 MB for SmolLM2-135M in fp32. What the copy shared with the model (an fp32
        copy's embeddings and norms) becomes a copy of its own first, and the vectors
        (RMSNorm weights, biases) stay, each as a copy of its own: a model loaded from
        safetensors holds its weights as slices of the memory-mapped file, and one slice
        left alive keeps the whole file mapped and resident (513 MB of the eval's memory
        before the copies). Only for a sampler whose weights never change (``frozen``:
        ``retool eval``'s sampler-only engine); a training engine's sampler merges again
        after every update and keeps them."""
        self._lean_weights = lean_decode.apart_from(self._lean_weights, self.model)
        freed = 0
        for parameter in self.model.parameters():
            if parameter.dim() >= 2 and parameter.numel():
                freed += parameter.numel() * parameter.element_size()
                parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)
            else:
                parameter.data = parameter.data.clone()
        for buffer in self.model.buffers():
            buffer.data = buffer.data.clone()
        self.released_bytes = max(freed, 1)
        memory.release_free_memory()

    def _prefix_kv(self, prefix: tuple[int, ...], lean: lean_decode.DecodeWeights | None) -> Any:
        """The KV of ``prefix`` (one row), or ``None`` when the model's cache is not pure
        attention (then the prefix cache and store stay off). Lean weights in another dtype
        than the model's (bf16) compute it themselves, so that the prefix is the same bf16
        model as the steps after it, and so do a frozen sampler's, whose model holds no
        matrices once it has its copy."""
        if lean is not None and (lean.dtype is not None or self.frozen or self.base_spill is not None):
            kv = lean_decode.prefix_kv(lean, torch.tensor(prefix, device=self.model.device))
            self.kv_store.remember(prefix, kv)
            return kv
        kv = kv_cache.prefix_kv(self.model, prefix, self.kv_store)
        if kv is None:
            self.prefix_cache = False
            self.kv_cache_bytes = 0
        return kv

    def _store_rows(self, out: Any, attention_mask: Any, prompts: list[tuple[int, ...]],
                    sequences: list[SampledSequence]) -> None:
        """Keep each row's KV in the store (which turns off for a cache that is not pure attention)."""
        if not self.kv_cache_bytes:
            return
        cache = hf_compat.cache_of(out)
        if cache is None:
            return
        if not kv_cache.store_rows(self.kv_store, cache, attention_mask, prompts, [s.tokens for s in sequences]):
            self.kv_cache_bytes = 0


def _fail(requests: list[_Request], exc: BaseException) -> None:
    for r in requests:
        if not r.future.done():
            r.future.set_exception(exc)


def _settings_key(p: SamplingParams) -> tuple:
    """What rows must share to decode in one batch: every setting but ``max_tokens`` and
    ``seed`` (every row draws with its own generator)."""
    return (p.temperature, p.top_p, p.top_k, p.stop_token_ids)


def _group_by_settings(requests: list[_Request]) -> list[list[_Request]]:
    """Requests that may share a ``generate`` call: equal :func:`_settings_key`."""
    groups: dict[tuple, list[_Request]] = {}
    for r in requests:
        groups.setdefault(_settings_key(r.params), []).append(r)
    return list(groups.values())


def _joined(queue: _LoopQueue) -> list[_Request]:
    """Requests that joined the loop's running continuous batch after it started."""
    return list(queue.stream.requests) if queue.stream is not None else []
