"""A scripted :class:`~retool.engines.base.SamplingClient` for rollout tests.

Each trajectory of a group follows its own script: a list of assistant-turn texts.
The first request (the group fork) returns turn 0 of every script; every later request
is matched to its trajectory by the marker ``[traj K]`` that turn 0 of script K must
contain, and to the turn by how many assistant turns the context already holds.

The sampler honours ``max_tokens`` (cutting the text, stop reason ``length``) and the
stop tokens (appending the end-of-turn token unless ``include_stop=False``, which
mimics engines that strip it). Logprobs are deterministic fake values. An optional
per-request ``delay_s`` stands in for generation time.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence

from retool.engines.base import SampledSequence, SampleResult, SamplingParams
from retool.types import StopReason


class ScriptedSampler:
    def __init__(self, tokenizer, scripts: Sequence[Sequence[str]], *, include_stop: bool = True,
                 delay_s: float = 0.0, generation_prompt: str = "<|im_start|>assistant"):
        self.tokenizer = tokenizer
        self.scripts = [list(s) for s in scripts]
        self.include_stop = include_stop
        self.delay_s = delay_s
        self.generation_prompt = generation_prompt
        self.requests: list[tuple[int, int, int]] = []
        """(context length, num_samples, max_tokens) of every request, in order."""

    async def sample(self, prompt_tokens: Sequence[int], num_samples: int,
                     sampling_params: SamplingParams) -> SampleResult:
        self.requests.append((len(prompt_tokens), num_samples, sampling_params.max_tokens))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        context = self.tokenizer.decode(list(prompt_tokens), skip_special_tokens=False)
        turn = context.count(self.generation_prompt) - 1
        if num_samples == len(self.scripts) and turn == 0:
            texts = [script[0] for script in self.scripts]
        else:
            match = re.search(r"\[traj (\d+)\]", context)
            assert match and num_samples == 1, f"unscripted request: {num_samples} samples, turn {turn}"
            texts = [self.scripts[int(match[1])][turn]]
        return SampleResult(tuple(self._sequence(t, sampling_params) for t in texts))

    def _sequence(self, text: str, params: SamplingParams) -> SampledSequence:
        tokens = list(self.tokenizer.encode(text, add_special_tokens=False))
        stop = StopReason.STOP
        if self.include_stop:
            tokens.append(params.stop_token_ids[0])
        if len(tokens) > params.max_tokens:
            tokens, stop = tokens[: params.max_tokens], StopReason.LENGTH
        logprobs = tuple(-0.1 * (1 + i % 7) for i in range(len(tokens)))
        return SampledSequence(tuple(tokens), logprobs, stop)
