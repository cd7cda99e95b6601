"""Batched vs one-at-a-time sampling throughput of the local engine.

Runs the same set of concurrent ``sample`` requests twice on the bundled
SmolLM2-135M-Instruct (or ``--model``): once awaited one after another (baseline: each
request is its own ``generate`` call) and once all at once through ``asyncio.gather``
(the local sampler merges them into batched ``generate`` calls, as it does for the
per-trajectory rollout tasks). Prints generated tokens per second for both and their
ratio. Every request asks for exactly ``--max-tokens`` tokens (stop token ``0``, never
emitted by the chat model in practice), so both runs do the same work.

``--tool-prompts`` renders the prompts as the RL rollout does (system prompt and tool
declaration, ≈400 tokens shared by every request, then an arithmetic question) and
adds a third run: merged batches with the sampler's shared-prefix cache turned off,
which isolates what computing the shared prefix once buys.

``--decode`` measures the decode step alone: merged batches at the rollout's top-p 0.7
with HF's plain path (the KV cache re-concatenated at every step, top-p by sorting the
vocabulary) against the sampler's default (reserved KV room, top-p over the 256 most
likely tokens), alternating ``--repeats`` times; both must sample the same tokens.

    python bench/sampling.py --requests 16 --max-tokens 32
    python bench/sampling.py --requests 16 --max-tokens 64 --tool-prompts
    python bench/sampling.py --requests 8 --max-tokens 128 --tool-prompts --decode
"""

from __future__ import annotations

import argparse
import asyncio
import time

from retool.engines.base import SamplingParams
from retool.engines.local import LocalEngineConfig, LocalTrainingClient

QUESTIONS = [
    "What is 17 * 23?", "Name a prime larger than 100.", "Solve x + 3 = 10.",
    "What is the derivative of x^2?", "How many sides has a hexagon?",
    "Compute 2 to the power 10.", "What is the square root of 144?", "Is 91 prime?",
]


def prompts(tokenizer, n: int) -> list[list[int]]:
    chats = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + " " * (i // len(QUESTIONS))}]
             for i in range(n)]
    return [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True)["input_ids"])
            for c in chats]


def tool_prompts(tokenizer, n: int) -> list[list[int]]:
    """The rollout's own prompts: system prompt + tool declaration + an arithmetic question."""
    from retool.protocol import SYSTEM_PROMPT
    from retool.render import Renderer
    from retool.tasks import make_problems

    renderer = Renderer(tokenizer, chat_template="hermes", tools=True)
    return [renderer.prompt_tokens([{"role": "system", "content": SYSTEM_PROMPT},
                                    {"role": "user", "content": p.question}])
            for p in make_problems(n, seed=1, split="test")]


async def one_at_a_time(sampler, prompts_P, params) -> int:
    tokens = 0
    for prompt in prompts_P:
        result = await sampler.sample(prompt, 1, params)
        tokens += len(result.sequences[0].tokens)
    return tokens


async def all_at_once(sampler, prompts_P, params) -> int:
    results = await asyncio.gather(*(sampler.sample(p, 1, params) for p in prompts_P))
    return sum(len(r.sequences[0].tokens) for r in results)


def timed(coroutine) -> tuple[int, float]:
    start = time.perf_counter()
    tokens = asyncio.run(coroutine)
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bundled:smollm2")
    parser.add_argument("--requests", type=int, default=16, help="concurrent sample requests")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tool-prompts", action="store_true",
                        help="the rollout's ~400-token tool prompts, and a run without the prefix cache")
    parser.add_argument("--decode", action="store_true",
                        help="only compare the decode-step optimisations with HF's plain path")
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs per variant (--decode)")
    args = parser.parse_args()

    engine = LocalTrainingClient(LocalEngineConfig(model=args.model, device=args.device,
                                                   max_sample_rows=args.requests))
    sampler = engine.save_weights_for_sampler()
    sampler.kv_cache_bytes = 0  # the store of earlier turns is bench/multiturn.py's subject
    make = tool_prompts if args.tool_prompts else prompts
    prompts_P = make(engine.get_tokenizer(), args.requests)
    params = SamplingParams(max_tokens=args.max_tokens, stop_token_ids=(0,), seed=0)
    timed(all_at_once(sampler, prompts_P[:2], SamplingParams(max_tokens=2)))  # warm-up
    if args.decode:
        return decode_ab(sampler, prompts_P, args)

    calls = sampler.calls
    base_tokens, base_s = timed(one_at_a_time(sampler, prompts_P, params))
    base_calls, calls = sampler.calls - calls, sampler.calls
    batch_tokens, batch_s = timed(all_at_once(sampler, prompts_P, params))
    batch_calls = sampler.calls - calls
    if args.tool_prompts:
        sampler.prefix_cache = False
        plain_tokens, plain_s = timed(all_at_once(sampler, prompts_P, params))

    mean_prompt = sum(map(len, prompts_P)) / len(prompts_P)
    print(f"model {args.model} on {engine.device}; {args.requests} requests x {args.max_tokens} tokens, "
          f"prompts of {mean_prompt:.0f} tokens")
    print(f"one at a time : {base_tokens} tokens in {base_s:.1f} s = {base_tokens / base_s:.1f} tok/s "
          f"({base_calls} generate calls)")
    print(f"merged batches: {batch_tokens} tokens in {batch_s:.1f} s = {batch_tokens / batch_s:.1f} tok/s "
          f"({batch_calls} generate calls)")
    print(f"speed-up: {(batch_tokens / batch_s) / (base_tokens / base_s):.2f}x")
    if args.tool_prompts:
        print(f"merged, no prefix cache: {plain_tokens} tokens in {plain_s:.1f} s = "
              f"{plain_tokens / plain_s:.1f} tok/s; prefix cache speed-up {plain_s / batch_s:.2f}x")


async def samples(sampler, prompts_P, params) -> list[tuple[int, ...]]:
    results = await asyncio.gather(*(sampler.sample(p, 1, params) for p in prompts_P))
    return [r.sequences[0].tokens for r in results]


def decode_ab(sampler, prompts_P, args) -> None:
    """HF's plain decode path vs the sampler's defaults, same seeded requests."""
    params = SamplingParams(max_tokens=args.max_tokens, top_p=0.7, stop_token_ids=(0,), seed=0)
    variants = {"HF plain (concatenated KV, sorted top-p)": (False, 0),
                "reserved KV + top-p over 256 candidates": (True, 256)}
    seconds = {name: [] for name in variants}
    tokens = {}
    for _ in range(args.repeats):
        for name, (reserve, candidates) in variants.items():
            sampler.reserve_kv, sampler.nucleus_candidates = reserve, candidates
            start = time.perf_counter()
            tokens[name] = asyncio.run(samples(sampler, prompts_P, params))
            seconds[name].append(time.perf_counter() - start)
    mean_prompt = sum(map(len, prompts_P)) / len(prompts_P)
    print(f"{len(prompts_P)} merged requests x {args.max_tokens} tokens, prompts of {mean_prompt:.0f} tokens, "
          f"best of {args.repeats}")
    (base, base_s), (new, new_s) = ((name, min(s)) for name, s in seconds.items())
    count = sum(map(len, tokens[base]))
    for name, best in ((base, base_s), (new, new_s)):
        print(f"{name}: {count} tokens in {best:.1f} s = {count / best:.1f} tok/s "
              f"(runs: {', '.join(f'{s:.1f}' for s in seconds[name])} s)")
    print(f"speed-up: {base_s / new_s:.2f}x; same tokens: {tokens[base] == tokens[new]}")


if __name__ == "__main__":
    main()
