"""A worker thread's torch products beside another thread's OpenMP team, and with one team at a time.

torch's CPU work runs in libgomp's OpenMP regions; libgomp keeps a team of worker threads
for every thread that started a region, and once the teams' threads outnumber the CPUs
each region wakes its workers through the kernel. The sampler decodes on a worker thread
after the main thread has loaded the model (and, in RL, trained), so this measures, in one
run, the same work three ways:

- on the main thread (its own team only);
- on a worker thread with ``asyncio.to_thread`` after the main thread ran a region (two
  teams: the sampler's path before ``retool.engines.openmp``);
- on a worker thread with ``openmp.on_worker_thread`` (the caller's team released first:
  the sampler's path now).

The work: one parallel element-wise op (an add of 200k floats: the cost of a region), and
the products of a lean decode step at 16 rows (the 30 layers' four weight matrices of
SmolLM2-135M in oneDNN's blocked layout; bf16 where the CPU has it natively, else fp32).
Prints microseconds per call of each, the ratios to the main thread, and the load.

    python bench/openmp_teams.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16, help="rows of the decode step's products")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds of the three ways")
    args = parser.parse_args()

    import torch

    from retool.engines import openmp
    from retool.engines.local.lean_decode import _linear, _packed, native_bf16

    dtype = torch.bfloat16 if native_bf16("cpu") else torch.float32
    shapes = [(576 + 2 * 192, 576), (576, 576), (2 * 1536, 576), (576, 1536)]  # qkv, o, gate_up, down
    generator = torch.Generator().manual_seed(0)
    weights = [_packed(torch.randn(out, inp, generator=generator).to(dtype)) for _ in range(30) for out, inp in shapes]
    inputs = {inp: torch.randn(args.rows, inp, generator=generator) for inp in (576, 1536)}
    vector = torch.randn(200_000, generator=generator)

    def per_call(fn, calls: int) -> float:
        for _ in range(max(3, calls // 20)):
            fn()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls * 1e6

    def region() -> float:
        return per_call(lambda: vector + vector, 2000)

    def step() -> float:
        return per_call(lambda: [_linear(inputs[inp], w) for w, (_, inp) in zip(weights, shapes * 30)], 20)

    def measure() -> tuple[float, float]:
        return region(), step()

    async def worker(call) -> tuple[float, float]:
        return await call(measure)

    results: dict[str, list[tuple[float, float]]] = {"main thread": [], "worker, two teams": [],
                                                     "worker, one team": []}
    for _ in range(args.repeats):
        measure()  # the main thread holds a team, as after loading a model or training
        results["main thread"].append(measure())
        results["worker, two teams"].append(asyncio.run(worker(asyncio.to_thread)))
        measure()
        results["worker, one team"].append(asyncio.run(worker(openmp.on_worker_thread)))
    print(f"torch threads {torch.get_num_threads()}, libgomp {'found' if openmp._libgomp() else 'absent'}; "
          f"decode step: {len(weights)} products at {args.rows} rows, {dtype}; best of {args.repeats}")
    base = [min(r[i] for r in results["main thread"]) for i in (0, 1)]
    for name, runs in results.items():
        best = [min(r[i] for r in runs) for i in (0, 1)]
        print(f"{name:>18}: region {best[0]:7.1f} us ({best[0] / base[0]:.2f}x the main thread)   "
              f"decode-step products {best[1] / 1e3:6.1f} ms ({best[1] / base[1]:.2f}x)")
    print(f"load average (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
