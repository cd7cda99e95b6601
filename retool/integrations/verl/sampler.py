"""retool's sampling client over verl's server manager.

verl's server manager (``LLMServerClient``) generates one sequence per call, token in,
token out: ``await generate(request_id, prompt_ids=…, sampling_params=…)`` returns a
``TokenOutput`` with ``token_ids``, ``log_probs`` and a ``stop_reason`` that is only
``completed``/``aborted`` — vLLM's ``stop`` and ``length`` are merged. This adapter
recovers retool's distinction from the tokens: a sequence whose last token is one of
the requested stop tokens ended on ``STOP``; one that filled ``max_tokens`` without it
was cut (``LENGTH``); anything shorter ended on the engine's own end-of-sequence
(``STOP``). An ``aborted`` generation is a :class:`TransientEngineError` (the rollout
reports it; verl's worker decides what to do).

Logprobs are always requested: the rollout keeps them aligned with the sampled tokens.

Not covered: stop strings (retool stops on tokens), multimodal inputs.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

from retool.engines.base import SampledSequence, SampleResult, SamplingParams, TransientEngineError
from retool.types import StopReason


class ServerManagerSampler:
    """``await sample(prompt_tokens, n, params)`` on verl's server manager.

    ``request_id`` is sticky for one trajectory (verl routes all turns of one request id
    to the same server, which keeps its prefix cache warm); ``extra_params`` are merged
    into every request's ``sampling_params`` (e.g. ``repetition_penalty``).
    """

    def __init__(self, server_manager: Any, *, request_id: str | None = None,
                 extra_params: dict[str, Any] | None = None) -> None:
        self.server_manager = server_manager
        self.request_id = request_id or uuid.uuid4().hex
        self.extra_params = dict(extra_params or {})

    async def sample(self, prompt_tokens: Sequence[int], num_samples: int,
                     sampling_params: SamplingParams) -> SampleResult:
        calls = [self._one(list(prompt_tokens), sampling_params, i) for i in range(num_samples)]
        return SampleResult(tuple(await asyncio.gather(*calls)))

    async def _one(self, prompt: list[int], params: SamplingParams, index: int) -> SampledSequence:
        request_id = self.request_id if index == 0 else f"{self.request_id}-{index}"
        output = await self.server_manager.generate(
            request_id=request_id, prompt_ids=prompt, sampling_params=verl_sampling_params(params, self.extra_params))
        if output.stop_reason == "aborted":
            raise TransientEngineError(f"verl aborted generation {request_id} at context length {len(prompt)}")
        tokens = tuple(int(t) for t in output.token_ids)
        if output.log_probs is None or len(output.log_probs) != len(tokens):
            got = None if output.log_probs is None else len(output.log_probs)
            raise RuntimeError(f"verl returned {len(tokens)} tokens but {got} logprobs "
                               "(is actor_rollout_ref.rollout.calculate_log_probs on?)")
        return SampledSequence(tokens, tuple(float(x) for x in output.log_probs),
                               stop_reason_of(tokens, params))


def verl_sampling_params(params: SamplingParams, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """retool's sampling settings in verl's ``sampling_params`` dict (vLLM/SGLang names)."""
    out: dict[str, Any] = {
        "max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1, "logprobs": True,
        "stop_token_ids": list(params.stop_token_ids),
    }
    if params.seed is not None:
        out["seed"] = params.seed
    out.update(extra or {})
    return out


def stop_reason_of(tokens: Sequence[int], params: SamplingParams) -> StopReason:
    """``STOP`` or ``LENGTH`` from the tokens (verl's ``completed`` merges the two)."""
    if tokens and tokens[-1] in params.stop_token_ids:
        return StopReason.STOP
    if len(tokens) >= params.max_tokens:
        return StopReason.LENGTH
    return StopReason.STOP
