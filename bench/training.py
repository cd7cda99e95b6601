"""Shared-prefix packing vs padded batches: one ``forward_backward`` on real SFT dialogues.

Every RL trajectory and every cold-start dialogue starts with the same few hundred
tokens (system prompt and tool declaration; a GRPO group also shares its question),
while the trained part is short. ``packing='shared-prefix'`` computes that prefix once
per micro-batch instead of once per sequence. This script builds one batch of
synthetic tool dialogues (``retool.tasks``, the demo's cold-start data, rendered with
the rollout's own token layout by ``retool.sft``) and times one forward + backward of
the bucketed baseline and of each other layout on the same engine and weights. It
prints seconds per call, trained tokens per second, the ratio against ``bucketed``
and the largest logprob difference (all layouts compute the same function).

    python bench/training.py --batch-size 4 --repeats 2
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from retool.engines.local import LocalEngineConfig, LocalTrainingClient
from retool.render import Renderer
from retool.sft import build_sft_data, parse_dialogue
from retool.tasks import make_sft_conversations


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bundled:smollm2")
    p.add_argument("--chat-template", default="hermes")
    p.add_argument("--batch-size", type=int, default=4, help="dialogues in the batch")
    p.add_argument("--repeats", type=int, default=2, help="timed calls per layout (the fastest is kept)")
    p.add_argument("--packings", default="bucketed,packed,shared-prefix")
    args = p.parse_args()

    engine = LocalTrainingClient(LocalEngineConfig(model=args.model, lora_rank=32, lora_alpha=32.0))
    renderer = Renderer(engine.get_tokenizer(), chat_template=args.chat_template, tools=True)
    rows = make_sft_conversations(args.batch_size, seed=7)
    data = build_sft_data([parse_dialogue(r) for r in rows], renderer)
    datums = data.datums
    tokens = sum(d.num_tokens for d in datums)
    trained = sum(d.num_trained for d in datums)
    print(f"batch: {len(datums)} dialogues, {tokens} tokens ({tokens // len(datums)} per dialogue), "
          f"{trained} trained")

    results: dict[str, tuple[float, list]] = {}
    for packing in [x.strip() for x in args.packings.split(",")]:
        engine.config = dataclasses.replace(engine.config, packing=packing)
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = engine.forward_backward(datums, "cross_entropy")
            best = min(best, time.perf_counter() - t0)
            engine._discard_gradient()
        results[packing] = (best, out.logprobs_D)
    base_s, base_lp = results.get("bucketed", next(iter(results.values())))
    for packing, (seconds, logprobs) in results.items():
        diff = max(abs(a - b) for lp_a, lp_b in zip(base_lp, logprobs) for a, b in zip(lp_a, lp_b))
        print(f"{packing:>14}: {seconds:6.2f} s per forward_backward, {trained / seconds:7.1f} trained tok/s, "
              f"{tokens / seconds:7.1f} tok/s; speed-up vs bucketed {base_s / seconds:.2f}x; "
              f"max |logprob diff| {diff:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
