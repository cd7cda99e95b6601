"""Second turns with and without the sampler's KV store (reuse of earlier turns' KV).

A rollout's turn 2 re-sends the whole trajectory so far — system prompt, tool
declaration, question, the turn-1 reply — plus a short tool message. Without the store
every such request prefills that context again; with it (the default) the sampler finds
the KV it kept from turn 1 and prefills only the new tokens. This script samples turn 1
for ``--requests`` rollout prompts (SmolLM2-135M + Hermes tool prompts, as the RL
rollout renders them), then times the same batch of turn-2 requests twice on the same
engine and weights: store off (baseline) and store on. Sampling is seeded, so both runs
draw the same tokens; the script checks that and prints both times, their ratio and
the prompt tokens the store saved.

    python bench/multiturn.py --requests 8 --first-tokens 64 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import time

from retool.engines.base import SamplingParams
from retool.engines import LocalSettings
from retool.engines.local import LocalEngineConfig, LocalTrainingClient

TOOL_MESSAGE = "<|im_start|>user\n<tool_response>\n1707336\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


async def batch(sampler, prompts_P, params):
    results = await asyncio.gather(*(sampler.sample(p, 1, params) for p in prompts_P))
    return [r.sequences[0] for r in results]


def timed(sampler, prompts_P, params):
    start = time.perf_counter()
    sequences = asyncio.run(batch(sampler, prompts_P, params))
    return sequences, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bundled:smollm2")
    parser.add_argument("--requests", type=int, default=8, help="trajectories (concurrent requests per turn)")
    parser.add_argument("--first-tokens", type=int, default=64, help="tokens of each turn-1 reply")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens sampled in turn 2")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()

    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from sampling import tool_prompts  # the rollout's own prompts

    engine = LocalTrainingClient(LocalEngineConfig(model=args.model, device=args.device,
                                                   sampler=LocalSettings(max_sample_rows=args.requests)))
    sampler, tokenizer = engine.save_weights_for_sampler(), engine.get_tokenizer()
    first_P = tool_prompts(tokenizer, args.requests)
    first = asyncio.run(batch(sampler, first_P, SamplingParams(max_tokens=args.first_tokens, stop_token_ids=(0,),
                                                                seed=1)))
    message = tokenizer.encode(TOOL_MESSAGE, add_special_tokens=False)
    second_P = [p + list(s.tokens) + message for p, s in zip(first_P, first)]
    params = SamplingParams(max_tokens=args.max_tokens, stop_token_ids=(0,), seed=2)

    budget = sampler.kv_cache_bytes
    sampler.kv_cache_bytes = 0  # baseline: every turn-2 request prefills its whole context
    plain, plain_s = timed(sampler, second_P, params)
    sampler.kv_cache_bytes = budget
    reused_before = sampler.kv_reused_tokens
    stored, stored_s = timed(sampler, second_P, params)
    reused = sampler.kv_reused_tokens - reused_before

    context = sum(map(len, second_P)) / len(second_P)
    same = sum(a.tokens == b.tokens for a, b in zip(plain, stored))
    print(f"model {args.model} on {engine.device}; {args.requests} turn-2 requests of {context:.0f} context "
          f"tokens ({len(message)} new after turn 1) x {args.max_tokens} tokens")
    print(f"store off (baseline): {plain_s:.2f} s")
    print(f"store on            : {stored_s:.2f} s  ({reused} prompt tokens reused = "
          f"{reused / sum(map(len, second_P)):.0%} of the prefill)")
    print(f"speed-up: {plain_s / stored_s:.2f}x; identical samples {same}/{len(plain)}")


if __name__ == "__main__":
    main()
