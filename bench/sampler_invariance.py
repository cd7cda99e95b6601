"""Does a seeded request sample the same tokens whatever shares its batch? Measured.

A seeded ``sample`` request draws every row with its own generator (seeded from the
request's seed and the sample index), so its draws do not depend on the other requests
in its batch. The *logits* the draws are taken from can: the local sampler lays a batch
out by what its rows share (a shared prefix computed once, each row's own columns padded
to the longest, the stored KV of an earlier turn reused), and each layout rounds
differently. This script measures how far that goes on the rollout's own prompts
(system prompt, tool declaration, an arithmetic question; ``--requests`` of them, each
asked for ``--samples`` samples at temperature 1 and top-p 1, as the demo's RL samples):

- **alone**: each request in a batch of its own, the KV store emptied before it (the
  reference);
- **together**: all requests in one batch, the store emptied first (the shared prefix
  is then the system prompt, not the whole prompt; rows padded to the longest);
- **again**: all requests once more, their prompts' KV now in the store (reused).

for each ``--precisions`` (``fp32``; ``auto`` = bf16 on a CPU with native bf16, else
fp32 again). Per variant it prints how many sequences are token for token the same as
alone, where the first different token sits in the others, and the largest logprob
difference over the tokens before it, plus the machine's load. Nothing is timed.

    python bench/sampler_invariance.py
    python bench/sampler_invariance.py --requests 8 --samples 4 --max-tokens 64 --init-from ADAPTER_DIR

``--init-from`` starts from a trained adapter (e.g. a demo run's SFT checkpoint,
``runs/demo/sft/checkpoints/step_000032/engine/adapter``) instead of the base model.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.sampling import tool_prompts  # noqa: E402 - the rollout's first-turn prompts
from retool.engines import LocalSettings  # noqa: E402
from retool.engines.base import SamplingParams  # noqa: E402
from retool.engines.local import LocalEngineConfig, LocalTrainingClient  # noqa: E402

Sample = tuple[tuple[int, ...], tuple[float, ...]]


async def _sample(sampler, prompts_P: list[list[int]], indices: list[int], samples: int,
                  max_tokens: int) -> dict[int, list[Sample]]:
    results = await asyncio.gather(*(
        sampler.sample(prompts_P[i], samples, SamplingParams(max_tokens=max_tokens, seed=1000 + i))
        for i in indices))
    return {i: [(s.tokens, s.logprobs) for s in r.sequences] for i, r in zip(indices, results)}


def compare(reference: dict[int, list[Sample]], got: dict[int, list[Sample]]) -> tuple[int, int, list[int], float]:
    """Sequences identical, sequences in all, the first differing position of each other
    one, and the largest logprob difference over the tokens before it."""
    same, total, firsts, largest = 0, 0, [], 0.0
    for i, rows in reference.items():
        for (tokens_a, logprobs_a), (tokens_b, logprobs_b) in zip(rows, got[i]):
            total += 1
            if tokens_a == tokens_b:
                same += 1
                agreed = len(tokens_a)
            else:
                agreed = next(j for j, (x, y) in enumerate(zip(tokens_a + (-1,), tokens_b + (-2,))) if x != y)
                firsts.append(agreed)
            largest = max([largest] + [abs(x - y) for x, y in zip(logprobs_a[:agreed], logprobs_b[:agreed])])
    return same, total, firsts, largest


def measure(args, precision: str) -> None:
    engine = LocalTrainingClient(LocalEngineConfig(
        model=args.model, init_from=args.init_from,
        sampler=LocalSettings(precision=precision, max_sample_rows=args.requests * args.samples)))
    sampler = engine.save_weights_for_sampler()
    prompts_P = tool_prompts(engine.get_tokenizer(), args.requests)
    indices = list(range(args.requests))
    alone: dict[int, list[Sample]] = {}
    for i in indices:
        sampler.clear_kv_cache()
        alone.update(asyncio.run(_sample(sampler, prompts_P, [i], args.samples, args.max_tokens)))
    sampler.clear_kv_cache()
    variants = {"together": asyncio.run(_sample(sampler, prompts_P, indices, args.samples, args.max_tokens)),
                "again (stored KV)": asyncio.run(_sample(sampler, prompts_P, indices, args.samples, args.max_tokens))}
    print(f"precision {precision} -> {sampler.precision}: {args.requests} requests x {args.samples} samples x "
          f"<= {args.max_tokens} tokens, prompts of {statistics.mean(map(len, prompts_P)):.0f} tokens")
    for name, got in variants.items():
        same, total, firsts, largest = compare(alone, got)
        where = (f"; the others part at token {min(firsts)}-{max(firsts)} (median {statistics.median(firsts):.0f})"
                 if firsts else "")
        print(f"  {name:18s}: {same}/{total} sequences the same as alone{where}; largest logprob difference "
              f"before that {largest:.2g}")
    engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bundled:smollm2")
    parser.add_argument("--init-from", default=None, help="an adapter or save_state folder to start from")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--precisions", default="fp32,auto", help="comma-separated: fp32, bf16, auto")
    args = parser.parse_args()
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for precision in args.precisions.split(","):
        measure(args, precision.strip())
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
