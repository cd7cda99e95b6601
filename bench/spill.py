"""What ``--local-spill-base`` saves and costs: one RL step of the demo's shape, without and with.

The demo's RL step on SmolLM2-135M + LoRA r32: 16 rollout rows (2 questions x 8) of the
rollout's own prompts (system prompt, tool declaration, a question: ~400 tokens) sampled
for ``--max-tokens`` tokens at temperature 1, then one PPO ``forward_backward`` of a
batch of the demo's shape (``bench/train_memory.demo_batch``), then ``optim_step``; ``--steps``
such steps. Each variant runs in a fresh child process, variants alternated
``--repeats`` times. A child samples its memory every 20 ms (PSS from
``/proc/self/smaps_rollup``) and reports the peak while sampling and while training, the
seconds of each phase, and what it sampled and trained; the parent checks that both
variants trained the same to the bit and sampled the same tokens (logprobs within 1e-4),
and prints each figure with its ratio spilled/plain and the load.

    python bench/spill.py                 # 2 steps, 64 new tokens, 2 repeats
    python bench/spill.py --steps 3 --max-tokens 128
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def pss_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


class Sampler(threading.Thread):
    """The process's PSS every 20 ms; ``phase`` names what the readings count towards."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.phase, self.peaks, self.stop = "", {}, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            if self.phase:
                self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), pss_kib())


def child(spill: bool, steps: int, max_tokens: int, out_file: str) -> None:
    import torch

    from bench.sampling import tool_prompts
    from bench.train_memory import demo_batch
    from retool.engines import LocalSettings
    from retool.engines.base import SamplingParams
    from retool.engines.local import LocalEngineConfig, LocalTrainingClient

    engine = LocalTrainingClient(LocalEngineConfig(
        model="bundled:smollm2", packing="shared-prefix", device="cpu", dtype="float32", micro_batch_tokens=1280,
        logprob_chunk_tokens=256, gradient_checkpointing=True, prefix_once=True, seed=42,
        sampler=LocalSettings(precision="fp32", spill_base=spill)))
    prompts = tool_prompts(engine.get_tokenizer(), 2)
    data = demo_batch(engine.vocab_size)
    memory = Sampler()
    memory.start()
    sampled, trained, seconds = [], [], {"sample": 0.0, "train": 0.0}

    async def rollout(step: int):
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.7, stop_token_ids=(0,), seed=step)
        return await asyncio.gather(*(engine.sampler.sample(p, 8, params) for p in prompts))

    for step in range(steps):
        memory.phase, start = "sample", time.perf_counter()
        results = asyncio.run(rollout(step))
        seconds["sample"] += time.perf_counter() - start
        sampled += [(s.tokens, s.logprobs) for r in results for s in r.sequences]
        memory.phase, start = "train", time.perf_counter()
        out = engine.forward_backward(data, "ppo")
        engine.optim_step()
        seconds["train"] += time.perf_counter() - start
        trained.append(out.logprobs_D)
    memory.phase = ""
    memory.stop.set()
    torch.save({"peaks": memory.peaks, "seconds": seconds, "sampled": sampled, "trained": trained,
                "params": [p.detach().clone() for p in engine.params]}, out_file)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child[0] == "1", int(args.child[1]), int(args.child[2]), args.child[3])
        return 0
    import torch

    runs: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            for spill in ((False, True) if repeat % 2 == 0 else (True, False)):
                out_file = os.path.join(folder, f"{int(spill)}-{repeat}.pt")
                subprocess.run([sys.executable, __file__, "--child", str(int(spill)), str(args.steps),
                                str(args.max_tokens), out_file], check=True, stderr=subprocess.DEVNULL)
                runs[spill].append(torch.load(out_file, weights_only=False))
    plain, spilled = runs[False][0], runs[True][0]
    same_training = all(a == b for a, b in zip(plain["trained"], spilled["trained"])) and all(
        torch.equal(a, b) for a, b in zip(plain["params"], spilled["params"]))
    same_tokens = [a[0] for a in plain["sampled"]] == [b[0] for b in spilled["sampled"]]
    logprob_gap = max((abs(x - y) for a, b in zip(plain["sampled"], spilled["sampled"]) for x, y in zip(a[1], b[1])),
                      default=0.0)
    print(f"{args.steps} steps of 16 rows x {args.max_tokens} new tokens + one PPO step of the demo's shape, "
          f"{args.repeats} runs each, medians; load {os.getloadavg()[0]:.2f}")
    for what, unit, get in (("PSS peak while sampling", "MiB", lambda r: r["peaks"]["sample"] / 1024),
                            ("PSS peak while training", "MiB", lambda r: r["peaks"]["train"] / 1024),
                            ("sampling time", "s", lambda r: r["seconds"]["sample"]),
                            ("training time (with the read back)", "s", lambda r: r["seconds"]["train"])):
        a = statistics.median(get(r) for r in runs[False])
        b = statistics.median(get(r) for r in runs[True])
        print(f"  {what:36s} plain {a:8.1f} {unit}   spilled {b:8.1f} {unit}   ratio {b / a:.2f}x")
    print(f"  training the same to the bit: {same_training}; the same sampled tokens: {same_tokens}; "
          f"largest logprob difference {logprob_gap:.2e}")
    return 0 if same_training and same_tokens and logprob_gap <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
