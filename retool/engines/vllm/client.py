"""``VLLMSamplingClient``: the sampling role, served by a vLLM server over HTTP.

Prompts go out as token ids (``/v1/completions`` with a list of ids), sampled token ids
and their logprobs come back (``return_token_ids``); text is never re-tokenised. Each
of a request's ``num_samples`` sequences is its own HTTP request with its own seed, so
every sequence is reproducible whatever the server batches it with, and all of them
are in flight at once (vLLM's continuous batching does the batching).

Seeds: a request with ``SamplingParams.seed`` gets ``hash(seed, sample index)`` per
sequence; one without gets ``hash(client seed, generation, context tokens, occurrence)``
— the generation is the training step's adapter version, so a training run's samples
depend on (run seed, step, problem context, sample index) only, and a resumed run
draws the same ones.

Logprob contract (``retool.engines.base``: ``log_softmax(logits / T)`` before top-k/top-p):
the server's ``--logprobs-mode`` is fixed when it starts. ``raw_logprobs`` meet the
contract at T = 1 (and greedy, whose contract is T = 1) with any top-k/top-p;
``processed_logprobs`` (after temperature and the filters) meet it at any T > 0 with
top_p = 1 and top_k = 0. A strict client (training) refuses a request its server's mode
cannot serve exactly; a lenient one (evaluation, which ignores logprobs) serves anything.

Stops: ``stop_token_ids`` (or the model's end-of-sequence ids when empty) end a
sequence, which then *includes* that token with ``StopReason.STOP``; ``max_tokens`` gives
``LENGTH``. ``ignore_eos`` keeps vLLM from stopping on anything else.

Failures: a connection error or a 5xx answer while the server is alive is a
:class:`TransientEngineError` (the trainer retries the rollout); a managed server that
has died is a :class:`~retool.engines.vllm.server.ServerError` naming its exit code and
last log lines; a 4xx answer is a ``ValueError`` with the server's message.

Not covered: stop strings, prompt logprobs, streaming (time to first token is measured
in ``bench/vllm.py`` with a 1-token request).
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import Any

import aiohttp

from retool.engines.base import SampledSequence, SampleResult, SamplingParams, TransientEngineError
from retool.engines.vllm.adapters import AdapterLeases
from retool.engines.vllm.server import FAILED_REQUEST_GRACE_S
from retool.seeding import context_digest, derive_seed
from retool.types import StopReason

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


def logprobs_mode_for(temperature: float, top_p: float, top_k: int = 0) -> str:
    """The server mode whose logprobs meet the contract for these training settings;
    ``ValueError`` when neither does."""
    if temperature == 1.0:
        return "raw_logprobs"
    if top_p == 1.0 and top_k == 0:
        return "processed_logprobs"
    raise ValueError(f"engine vllm cannot return exact logprobs at temperature {temperature} with "
                     f"top_p {top_p}/top_k {top_k} (raw logprobs are at T 1, processed ones are after "
                     "top-p/top-k): train at temperature 1 or with top_p 1")


def mode_problem(mode: str, params: SamplingParams) -> str | None:
    """Why a server in ``mode`` would not return contract logprobs for ``params``."""
    if mode == "raw_logprobs" and params.temperature not in (0.0, 1.0):
        return f"raw logprobs are at temperature 1, the request samples at {params.temperature}"
    if mode == "processed_logprobs" and (params.temperature == 0 or params.top_p < 1 or params.top_k):
        return "processed logprobs are taken after top-p/top-k (and need temperature > 0)"
    return None


class VLLMSamplingClient:
    """Samples from one model name (the base model or a loaded adapter) on a vLLM server.

    With ``leases`` (the training client's :class:`~retool.engines.vllm.adapters.AdapterLeases`)
    the client holds its adapter on the server from now until :meth:`close` (or until it is
    garbage-collected), and each request holds it while in flight. ``seen`` shares the
    per-context occurrence counts (the seeds) with other clients of the same weights."""

    def __init__(self, url: str, model_name: str, *, stop_token_ids: Sequence[int], mode: str,
                 strict: bool, seed: int = 42, generation: int = 0, timeout_s: float = 900.0,
                 server: Any = None, leases: AdapterLeases | None = None, seen: Counter | None = None) -> None:
        self.url, self.model_name, self.mode, self.strict = url.rstrip("/"), model_name, mode, strict
        self.default_stop_ids = tuple(sorted(stop_token_ids))
        self.seed, self.generation, self.timeout_s, self.server = seed, generation, timeout_s, server
        self._seen: Counter = seen if seen is not None else Counter()
        self.leases = leases
        self._release = None
        if leases is not None:
            leases.acquire(model_name)
            self._release = weakref.finalize(self, leases.release, model_name)

    def close(self) -> None:
        """Give up this client's hold on its adapter (no request may follow); safe twice."""
        if self._release is not None:
            self._release()

    def _hold(self) -> None:
        """Hold the adapter for one request (:class:`~retool.engines.vllm.adapters.AdapterGoneError` once gone)."""
        if self.leases is not None:
            self.leases.acquire(self.model_name)

    def _unhold(self) -> None:
        if self.leases is not None:
            self.leases.release(self.model_name)

    async def sample(self, prompt_tokens: Sequence[int], num_samples: int,
                     sampling_params: SamplingParams) -> SampleResult:
        """``num_samples`` seeded continuations, all requested at once."""
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        problem = mode_problem(self.mode, sampling_params)
        if problem and self.strict:
            raise ValueError(f"engine vllm: {problem}; the server runs with --logprobs-mode {self.mode}")
        base_seed = sampling_params.seed
        if base_seed is None:
            context = context_digest(prompt_tokens)
            occurrence, self._seen[context] = self._seen[context], self._seen[context] + 1
            base_seed = derive_seed(self.seed, self.generation, context, occurrence)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            sequences = await asyncio.gather(*(
                self._one(session, list(prompt_tokens), sampling_params, derive_seed(base_seed, i))
                for i in range(num_samples)))
        return SampleResult(tuple(sequences))

    async def compute_logprobs(self, tokens: Sequence[int], start: int) -> tuple[float, ...]:
        """The server's teacher-forced logprobs of ``tokens[start:]`` under this client's
        adapter (vLLM's ``prompt_logprobs``; the weight-sync guard's probe)."""
        body = {"model": self.model_name, "prompt": [int(t) for t in tokens], "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": 0, "seed": self.seed}
        self._hold()
        try:
            text = await asyncio.to_thread(post_json, f"{self.url}/v1/completions", body, self.timeout_s)
        except (RuntimeError, OSError):
            self._check_server()  # a server that died says so, with its exit code and log
            raise
        finally:
            self._unhold()
        return prompt_logprobs(json.loads(text)["choices"][0], tokens, start)

    def request_body(self, prompt: list[int], params: SamplingParams, seed: int) -> dict[str, Any]:
        return {"model": self.model_name, "prompt": prompt, "max_tokens": params.max_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k or -1,
                "seed": seed, "n": 1, "logprobs": 0,
                "stop_token_ids": list(params.stop_token_ids or self.default_stop_ids), "ignore_eos": True,
                "skip_special_tokens": False, "return_token_ids": True, "return_tokens_as_token_ids": True}

    async def _one(self, session: Any, prompt: list[int], params: SamplingParams, seed: int) -> SampledSequence:
        self._hold()
        try:
            async with session.post(f"{self.url}/v1/completions",
                                    json=self.request_body(prompt, params, seed)) as response:
                text = await response.text()
                status = response.status
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as err:
            self._check_server()
            raise TransientEngineError(f"vLLM server {self.url}: {type(err).__name__}: {err}") from err
        finally:
            self._unhold()
        if status >= 500:
            self._check_server()
            raise TransientEngineError(f"vLLM server {self.url} answered {status}: {text[:300]}")
        if status != 200:
            raise ValueError(f"vLLM server {self.url} refused the request ({status}): {text[:500]}")
        return parse_choice(json.loads(text)["choices"][0], set(params.stop_token_ids or self.default_stop_ids))

    def _check_server(self) -> None:
        if self.server is not None:
            self.server.check_alive(grace_s=FAILED_REQUEST_GRACE_S)


def parse_choice(choice: dict[str, Any], stop_ids: set[int]) -> SampledSequence:
    """One ``/v1/completions`` choice as a :class:`SampledSequence` (ids from
    ``token_ids``, else from ``token_id:N`` strings)."""
    logprobs = choice["logprobs"]
    ids = choice.get("token_ids")
    if ids is None:
        ids = [int(t.split(":", 1)[1]) for t in logprobs["tokens"]]
    values = [float(v) for v in logprobs["token_logprobs"]]
    if len(values) != len(ids):
        raise ValueError(f"vLLM returned {len(ids)} tokens but {len(values)} logprobs")
    stopped = choice["finish_reason"] == "stop"
    if stopped and (not ids or ids[-1] not in stop_ids):  # the stop token should be included
        raise ValueError(f"vLLM stopped without a stop token at the end (finish {choice['finish_reason']}, "
                         f"stop_reason {choice.get('stop_reason')})")
    return SampledSequence(tuple(ids), tuple(values), StopReason.STOP if stopped else StopReason.LENGTH)


# ---------------------------------------------------------------- adapters


def prompt_logprobs(choice: dict[str, Any], tokens: Sequence[int], start: int) -> tuple[float, ...]:
    """The logprob of each of ``tokens[start:]`` from a completion choice's ``prompt_logprobs``
    (one ``{token id: {"logprob": ...}}`` entry per prompt token, ``None`` first)."""
    entries = choice.get("prompt_logprobs")
    if not entries or len(entries) != len(tokens):
        raise RuntimeError("engine vllm: the server returned no prompt logprob per token (prompt_logprobs)")
    try:
        return tuple(float(entries[i][str(int(tokens[i]))]["logprob"]) for i in range(start, len(tokens)))
    except (KeyError, TypeError) as err:
        raise RuntimeError(f"engine vllm: a prompt logprob is missing from the server's answer ({err})") from None


def post_json(url: str, body: dict[str, Any], timeout_s: float = 300.0) -> str:
    """POST ``body`` and return the answer's text; ``RuntimeError`` on any non-200."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read().decode()
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"{url} answered {err.code}: {err.read().decode(errors='replace')[:500]}") from None


def load_adapter(url: str, name: str, path: str) -> None:
    """Have the server load the PEFT folder ``path`` (on the server's disk) as model ``name``."""
    post_json(f"{url}/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})


def unload_adapter(url: str, name: str) -> None:
    post_json(f"{url}/v1/unload_lora_adapter", {"lora_name": name})
