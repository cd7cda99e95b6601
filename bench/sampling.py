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
    python bench/sampling.py --requests 16 --max-tokens 128 --loops

``--loops`` is the old path against the new ones on the demo's own rollout requests (the
tool prompts, the rollout's stop tokens, temperature 1, top-p 0.7): ``decode_loop=
generate`` (one HF ``generate`` per batch) against ``decode_loop=own`` (the sampler's
loop, finished rows dropped) and ``decode_loop=lean`` (that loop with lean decode steps:
merged weights, the shared prefix's KV read once), alternating ``--repeats`` times, with
the same sampled tokens. It prints tokens/s of each, the ratios, the load, and the bound of this
machine for the same tokens: matmul rate and memory bandwidth measured in the same run,
each step costing at least its FLOPs at that rate and its bytes (weights + the rows' KV)
at that bandwidth (``machine_bound``).

``--precision`` is the lean loop in fp32 against bf16 (``--local-precision``) on the same
rollout requests, alternating ``--repeats`` times, and a third variant, bf16 with an fp32
output layer (the head's product in fp32): tokens/s of each, the ratio to fp32, the
machine bound for each (bf16 halves the bytes of the weights and the KV; its matmul rate
is measured too), the merged copy's and a token's KV bytes, the process RSS, and the
mismatch PPO sees — mean and max |sampler - trainer (fp32)| logprob over the sampled
tokens (``train/sampler_logprob_diff``). ``--requests 64 --top-p 0.7`` is the held-out
eval's shape (the sampler's batches of 64 rows).

    python bench/sampling.py --requests 16 --max-tokens 128 --precision

``--distinct`` is the first turn of the RL rollout's groups (or the eval's samples): the
``--requests`` tool prompts each asked for ``--samples`` samples in one request (the demo's RL:
``--requests 2 --samples 8``; its eval's batches of 64 rows: ``--requests 32 --samples 2``), with
the lean prefill run once per distinct prompt and its KV copied to the request's rows
(``lean_decode.PREFILL_DISTINCT_ROWS``, the default) against every row prefilled, alternating
``--repeats`` times: tokens/s of each, the ratio, whether the same tokens were sampled, the load.

    python bench/sampling.py --requests 2 --samples 8 --max-tokens 128 --distinct

``--attention`` is the lean loop's attention both ways (``lean_decode.ATTENTION``) on the
rollout requests at the sampler's precision (``auto``: bf16 where the CPU has it): ``math``
(plain products of the queries with the prefix's and the rows' own keys, one softmax, the
path before) against ``flash`` (torch's CPU flash kernel over the own columns and over the
prefix, merged by log-sum-exp; the default), alternating ``--repeats`` times: tokens/s of
each, the ratio, whether the same tokens were sampled, the largest logprob difference, the
load. ``--samples 8`` asks each request for 8 samples (the RL groups' shape).

    python bench/sampling.py --requests 2 --samples 8 --max-tokens 256 --attention

``--as-filed`` is the demo's RL rollout (``--requests 2 --samples 8``: two groups of 8, T 1,
top-p 1, the rollout's stop tokens) three ways, alternating ``--repeats`` times: **as
filed** (the sampler the demo ran when its ~62 tokens/s were measured: HF ``generate`` in
fp32 on a worker thread beside the main thread's OpenMP team, ``retool.engines.openmp``'s
release switched off), the old loop on today's threading (``generate``, fp32, one team),
and the new default (the lean loop at ``--sampler-precision``, one team): tokens/s of each,
the ratios, and the machine bound of the new path's tokens at its precision.

    python bench/sampling.py --requests 2 --samples 8 --max-tokens 256 --as-filed

``--products`` is one lean decode step's matrix products alone (every layer's fused q/k/v,
o, fused gate/up and down, and the output layer, fp32) at 1-64 rows, with the weights in
oneDNN's packed layout (the lean step's) and in the plain one: milliseconds, GFLOP/s and
their share of the machine's matmul rate measured in the same run — how far the
products, most of a decode step, are from this CPU's arithmetic.

    python bench/sampling.py --products
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from retool.engines.base import SamplingParams
from retool.engines import LocalSettings
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
    parser.add_argument("--loops", action="store_true",
                        help="old path (HF generate) vs new (own decode loop) on the rollout's requests")
    parser.add_argument("--precision", action="store_true",
                        help="lean loop in fp32 vs bf16 (and bf16 with an fp32 head) on the rollout's requests")
    parser.add_argument("--variants", default="fp32,bf16,bf16-fp32-head",
                        help="--precision's variants, comma-separated (one alone: its process peak RSS is its own)")
    parser.add_argument("--top-p", type=float, default=0.7, help="nucleus of --loops and --precision")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs per variant (--decode, --loops, "
                                                              "--distinct)")
    parser.add_argument("--distinct", action="store_true",
                        help="the prefill of a request's samples once per distinct prompt vs every row (see above)")
    parser.add_argument("--samples", type=int, default=8, help="samples per request of --distinct and --attention")
    parser.add_argument("--attention", action="store_true",
                        help="the lean loop's attention: plain products vs the flash-kernel cascade (see above)")
    parser.add_argument("--as-filed", action="store_true",
                        help="the demo's rollout: the sampler as the demo ran it when filed vs today's old loop vs "
                             "the new default")
    parser.add_argument("--products", action="store_true",
                        help="one decode step's matrix products alone at 1-64 rows against the machine's matmul rate")
    parser.add_argument("--sampler-precision", default="auto", choices=("fp32", "bf16", "auto"),
                        help="--attention's lean loop precision (auto: bf16 where the CPU computes it natively)")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    grouped = args.distinct or args.attention or args.as_filed
    if args.products:
        return products(args)
    engine = LocalTrainingClient(LocalEngineConfig(model=args.model, device=args.device,
                                                   sampler=LocalSettings(max_sample_rows=args.requests * (
                                                       args.samples if grouped else 1))))
    sampler = engine.save_weights_for_sampler()
    sampler.kv_cache_bytes = 0  # the store of earlier turns is bench/multiturn.py's subject
    make = (tool_prompts if args.tool_prompts or args.loops or args.precision or args.distinct or args.attention
            or args.as_filed
            else prompts)
    prompts_P = make(engine.get_tokenizer(), args.requests)
    params = SamplingParams(max_tokens=args.max_tokens, stop_token_ids=(0,), seed=0)
    timed(all_at_once(sampler, prompts_P[:2], SamplingParams(max_tokens=2)))  # warm-up
    if args.decode:
        return decode_ab(sampler, prompts_P, args)
    if args.loops:
        return loops_ab(engine, sampler, prompts_P, args)
    if args.precision:
        return precision_ab(engine, sampler, prompts_P, args)
    if args.distinct:
        return distinct_ab(engine, sampler, prompts_P, args)
    if args.attention:
        return attention_ab(engine, sampler, prompts_P, args)
    if args.as_filed:
        return as_filed_ab(engine, sampler, prompts_P, args)

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


LOOPS = (("generate", "old path (HF generate)"), ("own", "own decode loop, model forward"),
         ("lean", "new path (lean decode steps)"))


def loops_ab(engine, sampler, prompts_P, args) -> None:
    """The old path (``decode_loop=generate``) vs ``own`` and the new ``lean``, same seeded rollout requests."""
    stops = _rollout_stops(engine)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, top_p=args.top_p, stop_token_ids=stops,
                            seed=0)
    seconds: dict[str, list[float]] = {loop: [] for loop, _ in LOOPS}
    tokens = {}
    for _ in range(args.repeats):
        for loop in seconds:
            sampler.decode_loop = loop
            start = time.perf_counter()
            tokens[loop] = asyncio.run(samples(sampler, prompts_P, params))
            seconds[loop].append(time.perf_counter() - start)
    rate, bandwidth = machine_rates()
    lengths = [len(t) for t in tokens["lean"]]
    bound_s = machine_bound(engine.model, prompts_P, lengths, rate, bandwidth)
    count = sum(lengths)
    mean_prompt = sum(map(len, prompts_P)) / len(prompts_P)
    print(f"{len(prompts_P)} rollout requests x <= {args.max_tokens} tokens (stop tokens {stops}), prompts of "
          f"{mean_prompt:.0f} tokens; {count} tokens sampled (rows of {min(lengths)}-{max(lengths)}); "
          f"torch threads {_threads()}; best of {args.repeats}")
    old = min(seconds["generate"])
    for loop, label in LOOPS:
        best = min(seconds[loop])
        print(f"{label}: {count / best:.1f} tok/s ({best:.1f} s; runs {', '.join(f'{s:.1f}' for s in seconds[loop])} s)"
              f"; {old / best:.2f}x the old path; same tokens as the old path: {tokens[loop] == tokens['generate']}")
    new = min(seconds["lean"])
    print(f"machine bound: {count / bound_s:.0f} tok/s ({bound_s:.2f} s at {rate / 1e9:.0f} GFLOP/s matmul and "
          f"{bandwidth / 1e9:.1f} GB/s memory, measured now); new path at {new / bound_s:.1f}x the bound's time")
    print(f"load average (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


def distinct_ab(engine, sampler, prompts_P, args) -> None:
    """Each request's rows prefilled once per distinct prompt vs every row, same seeded group requests."""
    from retool.engines.local import lean_decode
    stops = _rollout_stops(engine)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, top_p=1.0, stop_token_ids=stops, seed=0)
    sampler.decode_loop = "lean"

    async def groups() -> list:
        return [s.tokens for s in await sequences(sampler, prompts_P, params, args.samples)]

    variants = {"every row prefilled": False, "distinct prompts prefilled once": True}
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    tokens = {}
    for _ in range(args.repeats):
        for name, distinct in variants.items():
            lean_decode.PREFILL_DISTINCT_ROWS = distinct
            start = time.perf_counter()
            tokens[name] = asyncio.run(groups())
            seconds[name].append(time.perf_counter() - start)
    lean_decode.PREFILL_DISTINCT_ROWS = True
    (base, base_s), (new, new_s) = ((name, min(s)) for name, s in seconds.items())
    mean_prompt = sum(map(len, prompts_P)) / len(prompts_P)
    print(f"{len(prompts_P)} requests x {args.samples} samples x <= {args.max_tokens} tokens, prompts of "
          f"{mean_prompt:.0f} tokens; lean loop; torch threads {_threads()}; best of {args.repeats}")
    for name in variants:
        count, best = sum(map(len, tokens[name])), min(seconds[name])
        print(f"{name}: {count / best:.1f} tok/s ({count} tokens, {best:.1f} s; runs "
              f"{', '.join(f'{s:.1f}' for s in seconds[name])} s)")
    print(f"speed-up: {base_s / new_s:.2f}x; same tokens: {tokens[base] == tokens[new]}")
    print(f"load average (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


PRECISIONS = (("fp32", "fp32", None), ("bf16", "bf16", None), ("bf16-fp32-head", "bf16", "fp32"))
"""(label, sampler precision, head dtype override) of ``--precision``'s variants."""


def attention_ab(engine, sampler, prompts_P, args) -> None:
    """The lean loop with plain-product attention vs the flash-kernel cascade, same seeded requests."""
    from retool.engines.local import lean_decode, probe
    stops = _rollout_stops(engine)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, top_p=1.0, stop_token_ids=stops, seed=0)
    sampler.decode_loop = "lean"
    _set_precision(sampler, args.sampler_precision, None)


    seconds: dict[str, list[float]] = {"math": [], "flash": []}
    out = {}
    for _ in range(args.repeats):
        for kind in seconds:
            lean_decode.ATTENTION = kind
            start = time.perf_counter()
            out[kind] = asyncio.run(sequences(sampler, prompts_P, params, args.samples))
            seconds[kind].append(time.perf_counter() - start)
    lean_decode.ATTENTION = "flash"
    mean_prompt = sum(map(len, prompts_P)) / len(prompts_P)
    print(f"{len(prompts_P)} rollout requests x {args.samples} samples x <= {args.max_tokens} tokens, prompts of "
          f"{mean_prompt:.0f} tokens; lean loop at {sampler.dtype or 'the model dtype (fp32)'}; flash kernel "
          f"available: {lean_decode._cpu_flash_attention()}; torch threads {_threads()}; best of {args.repeats}")
    rate = {}
    for kind in seconds:
        count, best = sum(len(s.tokens) for s in out[kind]), min(seconds[kind])
        rate[kind] = count / best
        expanded = [p for p in prompts_P for _ in range(args.samples)]
        mean, worst = _mismatch(engine.model, expanded, out[kind], probe)
        print(f"{kind}: {rate[kind]:.1f} tok/s ({count} tokens, {best:.1f} s; runs "
              f"{', '.join(f'{s:.1f}' for s in seconds[kind])} s); |sampler - trainer (fp32)| logprob mean "
              f"{mean:.4f} max {worst:.4f}")
    common = [_common_length(a.tokens, b.tokens) for a, b in zip(out["math"], out["flash"])]
    diffs = [abs(x - y) for a, b, k in zip(out["math"], out["flash"], common)
             for x, y in zip(a.logprobs[:k], b.logprobs[:k])]
    print(f"flash / math: {rate['flash'] / rate['math']:.2f}x the tokens/s; rows identical: "
          f"{sum(k == len(a.tokens) == len(b.tokens) for a, b, k in zip(out['math'], out['flash'], common))} of "
          f"{len(common)}; tokens before a row's first difference: {sum(common)} of "
          f"{sum(len(a.tokens) for a in out['math'])}, their logprobs apart by {max(diffs, default=0):.2e} at most, "
          f"{sum(diffs) / max(len(diffs), 1):.2e} on average")
    print(f"load average (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


AS_FILED = (("as filed", "generate", "fp32", False), ("old loop, one team", "generate", "fp32", True),
            ("new default", "lean", None, True))
"""(label, decode loop, precision (None: ``--sampler-precision``), one OpenMP team) of ``--as-filed``."""


def as_filed_ab(engine, sampler, prompts_P, args) -> None:
    """The demo's rollout groups through the sampler as filed, the old loop today, and the new default."""
    import torch

    from retool.engines import openmp
    stops = _rollout_stops(engine)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, top_p=1.0, stop_token_ids=stops, seed=0)
    release = openmp.release_team

    async def groups() -> list:
        return [s.tokens for s in await sequences(sampler, prompts_P, params, args.samples)]

    seconds: dict[str, list[float]] = {label: [] for label, *_ in AS_FILED}
    tokens, dtypes = {}, {}
    for _ in range(args.repeats):
        for label, loop, precision, one_team in AS_FILED:
            sampler.decode_loop = loop
            _set_precision(sampler, precision or args.sampler_precision, None)
            dtypes[label] = sampler.dtype
            openmp.release_team = release if one_team else (lambda: False)
            torch.ones(1 << 18).add_(1)  # the main thread holds a team, as after the demo's SFT and training
            start = time.perf_counter()
            tokens[label] = asyncio.run(groups())
            seconds[label].append(time.perf_counter() - start)
    openmp.release_team = release
    sampler.decode_loop = "lean"
    new_dtype = dtypes["new default"]
    half = new_dtype is not None and new_dtype != torch.float32
    rate, bandwidth = machine_rates(new_dtype if half else None)
    lengths = [len(t) for t in tokens["new default"]]
    expanded = [p for p in prompts_P for _ in range(args.samples)]
    bound_s = machine_bound(engine.model, expanded, lengths, rate, bandwidth, element_bytes=2 if half else 4)
    mean_prompt = sum(map(len, prompts_P)) / len(prompts_P)
    print(f"{len(prompts_P)} rollout requests x {args.samples} samples x <= {args.max_tokens} tokens, prompts of "
          f"{mean_prompt:.0f} tokens; torch threads {_threads()}; best of {args.repeats}")
    rates = {}
    for label, loop, _, one_team in AS_FILED:
        count, best = sum(map(len, tokens[label])), min(seconds[label])
        rates[label] = count / best
        print(f"{label} ({loop}, {dtypes[label] or 'fp32'}, {'one OpenMP team' if one_team else 'two teams'}): "
              f"{rates[label]:.1f} tok/s ({count} tokens, {best:.1f} s; runs "
              f"{', '.join(f'{s:.1f}' for s in seconds[label])} s)")
    print(f"new default: {rates['new default'] / rates['as filed']:.2f}x the sampler as filed, "
          f"{rates['new default'] / rates['old loop, one team']:.2f}x the old loop on today's threading; "
          f"old loop on today's threading {rates['old loop, one team'] / rates['as filed']:.2f}x as filed")
    count = sum(lengths)
    print(f"machine bound of the new default's tokens: {count / bound_s:.0f} tok/s ({bound_s:.2f} s at "
          f"{rate / 1e9:.0f} GFLOP/s matmul in {new_dtype or 'fp32'} and {bandwidth / 1e9:.1f} GB/s memory, measured "
          f"now); new default at {count / rates['new default'] / bound_s:.1f}x the bound's time")
    print(f"load average (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


def _common_length(a, b) -> int:
    """How many leading tokens two sampled rows share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def precision_ab(engine, sampler, prompts_P, args) -> None:
    """The lean loop in fp32 vs bf16 (vs bf16 with an fp32 head), same seeded rollout requests."""
    import psutil
    import torch

    from retool.engines.local import lean_decode, probe
    from retool.peak_rss import own_peak_bytes
    stops = _rollout_stops(engine)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, top_p=args.top_p, stop_token_ids=stops,
                            seed=0)
    sampler.decode_loop = "lean"
    chosen = args.variants.split(",")
    variants = [v for v in PRECISIONS if v[0] in chosen]
    seconds: dict[str, list[float]] = {label: [] for label, _, _ in variants}
    results, merged_bytes, rss, kv_token = {}, {}, {}, {}
    for _ in range(args.repeats):
        for label, precision, head in variants:
            _set_precision(sampler, precision, head)
            start = time.perf_counter()
            results[label] = asyncio.run(sequences(sampler, prompts_P, params))
            seconds[label].append(time.perf_counter() - start)
            merged_bytes[label] = _lean_bytes(sampler._lean_weights, engine.model.dtype)
            kv_token[label] = sampler.kv_bytes_per_token
            rss[label] = psutil.Process().memory_info().rss
    lean_decode.HEAD_DTYPE = None
    rate, bandwidth = machine_rates()
    bf16_rate = machine_rates(torch.bfloat16)[0]
    mean_prompt = sum(map(len, prompts_P)) / len(prompts_P)
    print(f"{len(prompts_P)} rollout requests x <= {args.max_tokens} tokens, top-p {args.top_p}, prompts of "
          f"{mean_prompt:.0f} tokens; lean loop; torch threads {_threads()}; best of {args.repeats}")
    base = None
    for label, precision, _ in variants:
        lengths = [len(s.tokens) for s in results[label]]
        count, best = sum(lengths), min(seconds[label])
        half = precision == "bf16"
        bound_s = machine_bound(engine.model, prompts_P, lengths, bf16_rate if half else rate, bandwidth,
                                element_bytes=2 if half else 4)
        base = base or count / best
        mean, worst = _mismatch(engine.model, prompts_P, results[label], probe)
        print(f"{label}: {count / best:.1f} tok/s ({count} tokens, {best:.1f} s; runs "
              f"{', '.join(f'{s:.1f}' for s in seconds[label])} s); {count / best / base:.2f}x the first; bound "
              f"{count / bound_s:.0f} tok/s (at {(bf16_rate if half else rate) / 1e9:.0f} GFLOP/s); merged copy "
              f"{merged_bytes[label] / 2**20:.0f} MiB; KV {kv_token[label]} B/token; RSS "
              f"{rss[label] / 2**30:.2f} GiB; |sampler - trainer| logprob mean {mean:.4f} max {worst:.4f}")
    print(f"process peak RSS {own_peak_bytes() / 2**30:.2f} GiB; memory bandwidth {bandwidth / 1e9:.1f} GB/s; "
          f"load average (1, 5, 15 min): "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")


def _set_precision(sampler, precision: str, head: str | None) -> None:
    """Switch a sampler's decode dtype (and the head's) between runs; its merged copy is made again."""
    import torch

    from retool.engines.local import kv_cache, lean_decode

    lean_decode.HEAD_DTYPE = torch.float32 if head == "fp32" else None
    sampler.dtype = lean_decode.resolve_precision(precision, sampler.model.device)
    sampler.kv_bytes_per_token = kv_cache.kv_bytes_per_token(sampler.model, sampler.dtype)
    sampler.clear_kv_cache()


def _lean_bytes(weights, model_dtype) -> int:
    """Bytes a lean merged copy adds: its matrices (packed ones at their element size) and
    its embeddings when cast (in the model's dtype they are the model's own tensor)."""
    if weights is None:
        return 0
    tensors = [t for layer in weights.layers for t in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    tensors += [weights.head] + ([weights.embed] if weights.embed.dtype != model_dtype else [])
    return sum(t.numel() * t.element_size() for t in tensors)


async def sequences(sampler, prompts_P, params, n: int = 1) -> list:
    """All prompts' requests at once, ``n`` samples each; their sequences, prompt by prompt."""
    results = await asyncio.gather(*(sampler.sample(p, n, params) for p in prompts_P))
    return [s for r in results for s in r.sequences]


def _rollout_stops(engine) -> tuple[int, ...]:
    """The stop tokens of the RL rollout's turns (Hermes template, tools declared)."""
    from retool.render import Renderer

    return Renderer(engine.get_tokenizer(), chat_template="hermes", tools=True).stop_token_ids


def _mismatch(model, prompts_P, sequences_P, probe) -> tuple[float, float]:
    """Mean and max |sampler - trainer| logprob over every sampled token (temperature 1:
    the sampler's logprobs are the unfiltered policy's, as the trainer's)."""
    diffs = []
    for prompt, seq in zip(prompts_P, sequences_P):
        trainer = probe.model_logprobs(model, list(prompt) + list(seq.tokens), len(prompt))
        diffs += [abs(a - b) for a, b in zip(seq.logprobs, trainer, strict=True)]
    return sum(diffs) / len(diffs), max(diffs)


def products(args) -> None:
    """One lean decode step's matrix products alone (every layer's fused q/k/v, o, fused
    gate/up and down, then the output layer; the model's own weights, fp32) at 1-64 rows:
    milliseconds, GFLOP/s and the share of this machine's matmul rate, with the weights in
    oneDNN's packed layout (what the lean step runs) and in the plain one."""
    import torch

    from retool.engines.local import lean_decode
    from retool.engines.local.model import load_model

    model, _ = load_model(args.model, device="cpu", dtype="float32")
    weights = lean_decode.decode_weights(model)
    plain = []  # (out, in) matrices in the lean step's order, plain layout
    for layer in lean_decode.decoder_of(model).layers:
        q, k, v, o, gate, up, down = (m.weight.detach() for m in lean_decode._layer_linears(layer))
        plain += [torch.cat([q, k, v]), o, torch.cat([gate, up]), down]
    plain.append(model.get_output_embeddings().weight.detach())
    packed = [m for layer in weights.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [weights.head]
    flops_per_row = 2 * sum(w.numel() for w in plain)
    rate, _ = machine_rates()
    print(f"one decode step's products of {args.model} (fp32, {len(weights.layers)} layers and the output layer, "
          f"{flops_per_row / 1e6:.0f} MFLOP a row); matmul rate now {rate / 1e9:.0f} GFLOP/s; torch threads "
          f"{_threads()}")
    for rows in (1, 4, 8, 16, 32, 64):
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in plain}
        steps = {"packed": lambda: [lean_decode._linear(inputs[p.shape[1]], w) for p, w in zip(plain, packed)],
                 "plain": lambda: [torch.nn.functional.linear(inputs[p.shape[1]], p) for p in plain]}
        line = [f"{rows:2d} rows:"]
        for label, step in steps.items():
            step()
            seconds = min(_timed_once(step) for _ in range(max(3, args.repeats)))
            achieved = flops_per_row * rows / seconds
            line.append(f"{label} {seconds * 1e3:6.1f} ms, {achieved / 1e9:4.0f} GFLOP/s "
                        f"({achieved / rate:.2f} of the matmul rate)")
        print("  ".join(line))
    print(f"load average (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def machine_rates(dtype=None) -> tuple[float, float]:
    """(matmul FLOP/s in ``dtype``, default fp32; memory bytes/s) of this machine now: best
    of a few runs of a 1024^3 matmul and of summing a 256 MB tensor."""
    import torch

    dtype = dtype or torch.float32
    a, b = torch.randn(1024, 1024).to(dtype), torch.randn(1024, 1024).to(dtype)
    big = torch.randn(64 * 2**20)
    matmul = min(_timed_once(lambda: a @ b) for _ in range(5))
    read = min(_timed_once(big.sum) for _ in range(5))
    return 2 * 1024**3 / matmul, big.nbytes / read


def _timed_once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def machine_bound(model, prompts_P, lengths_R, rate: float, bandwidth: float, element_bytes: int = 4) -> float:
    """Seconds the work cannot beat on this machine: a prefill of every distinct prompt's
    tokens (the shared prefix once; rows that repeat a prompt, a group's samples, share its
    prefill, as the lean loop's) at ``rate``, then per decode step, for the rows still running,
    the larger of its FLOPs at ``rate`` and its bytes (all weights + those rows' KV, at
    ``element_bytes`` a number) at ``bandwidth``."""
    from retool.engines.local import kv_cache

    config = model.config
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = params * element_bytes
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_token_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element_bytes
    distinct = list(dict.fromkeys(tuple(p) for p in prompts_P))
    shared = kv_cache.shared_prefix_length(distinct)
    prefill_tokens = shared + sum(len(p) - shared for p in distinct)
    seconds = 2 * params * prefill_tokens / rate
    for step in range(1, max(lengths_R)):
        running = [len(p) + step for p, n in zip(prompts_P, lengths_R) if n > step]
        flops = 2 * params * len(running)
        moved = weight_bytes + kv_token_bytes * sum(running)
        seconds += max(flops / rate, moved / bandwidth)
    return seconds


if __name__ == "__main__":
    main()
