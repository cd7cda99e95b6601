"""The demo's RL stage, synchronous against sampling ahead (``--max-staleness K``), on any device.

What it measures: ``retool demo``'s own RL stage (the same config the demo builds: SmolLM2
with its cold-start SFT adapter, 2 problems x 8 trajectories a step, refills, the
difficulty pool, the real sandbox and grader) run once per entry of ``--order`` from the
same SFT adapter, each in a fresh run folder, alternating the modes so a drift of the
machine falls on both. Printed per run and per mode: seconds per step over steps ``2 .. N - K`` (step 1
loads and, with ``K >= 1``, also samples step 2; the last ``K`` steps only train), the
rollout's own time, the
training time and how long the trainer waited for the rollout; then the measured
steps/hour ratio against the synchronous runs beside the bound the two stages allow
(rollout and training fully overlapped: ``(rollout + train) / max(rollout, train)`` of
the synchronous steps).

On a CPU both stages share the same cores, so the bound is not reachable there; on a GPU
the sampler's decode loop and the trainer's kernels can overlap (one process, two
threads, one device). Runs the data and SFT stages first (kept in ``--work-dir`` and
reused when run again).

Usage::

    python bench/async_demo.py --device cuda --work-dir runs/async-demo
    python bench/async_demo.py --device cpu --steps 3 --sft-steps 2 --order 0 1   # a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.steady import steady_rows  # noqa: E402
from retool.config import make_config  # noqa: E402
from retool.demo import DemoConfig, make_data, run_rl, run_sft  # noqa: E402
from retool.log import read_metrics  # noqa: E402


def machine() -> str:
    """The device in words, with the load average (timings are only comparable on a calm machine)."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {gpu}, load {os.getloadavg()[0]:.2f}"


def run_figures(run_dir: Path, max_staleness: int) -> dict[str, float]:
    """Mean seconds per step, rollout, training and rollout wait over steps ``2 .. N - K``
    of one run (:func:`steady_rows`), and the sum of every step's time."""
    every = [r for r in read_metrics(run_dir / "metrics.jsonl") if "time/step" in r]
    rows = steady_rows(every, max_staleness)

    def mean(key: str, fallback: str | None = None) -> float:
        values = [r.get(key, r.get(fallback, 0.0) if fallback else 0.0) for r in rows]
        return statistics.fmean(values) if values else 0.0

    return {"steps": len(rows), "all_steps": sum(r["time/step"] for r in every), "step": mean("time/step"), "rollout": mean("time/rollout_ahead", "time/rollout"),
            "train": mean("time/train"), "wait": mean("time/rollout_wait", "time/rollout")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    parser.add_argument("--work-dir", type=Path, default=Path("runs/async-demo"), help="data, SFT and runs go here")
    parser.add_argument("--steps", type=int, default=6,
                        help="RL steps per run (default 6; the first and the last K are not counted)")
    parser.add_argument("--sft-steps", type=int, default=None, help="SFT steps (default: the demo's)")
    parser.add_argument("--order", type=int, nargs="+", default=[0, 1, 1, 0], metavar="K",
                        help="--max-staleness of each run, in order (default 0 1 1 0)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", type=Path, default=None, help="also write every run's figures here")
    args = parser.parse_args()
    if args.steps < max(args.order) + 2 or min(args.order) < 0:
        parser.error("--steps must be at least the largest K of --order + 2, and every K >= 0")

    base = make_config(DemoConfig, device=args.device, seed=args.seed, rl_steps=args.steps,
                       output_dir=str(args.work_dir))
    if args.sft_steps is not None:
        base = dataclasses.replace(base, sft_steps=args.sft_steps)
    out = args.work_dir
    print(f"machine: {machine()}", flush=True)
    paths = make_data(base, out)
    t0 = time.monotonic()
    sft_dir = run_sft(base, out, paths["sft"])
    print(f"SFT: {time.monotonic() - t0:.1f} s", flush=True)
    runs = []
    for i, k in enumerate(args.order):
        cfg = dataclasses.replace(base, rl_max_staleness=k)
        run_out = out / f"run{i}-k{k}"
        t0 = time.monotonic()
        run_rl(cfg, run_out, paths["rl"], sft_dir)
        figures = {"k": k, "wall": time.monotonic() - t0, **run_figures(run_out / "rl", max(args.order))}
        runs.append(figures)
        print(f"run {i} K={k}: {figures['wall']:.1f} s with loading, its {args.steps} steps {figures['all_steps']:.1f} s; "
              f"steps 2-{args.steps - max(args.order)}: {figures['step']:.2f} s/step, "
              f"rollout {figures['rollout']:.2f} s, train {figures['train']:.2f} s, "
              f"trainer waited for the rollout {figures['wait']:.2f} s; load {os.getloadavg()[0]:.2f}", flush=True)
    by_k = {k: [r for r in runs if r["k"] == k] for k in sorted(set(args.order))}
    sync = by_k.get(0)
    for k, rs in by_k.items():
        step = statistics.fmean(r["step"] for r in rs)
        line = f"K={k}: {step:.2f} s/step = {3600 / step:.0f} steps/hour over {len(rs)} run(s)"
        if sync and k:
            s_step = statistics.fmean(r["step"] for r in sync)
            s_roll = statistics.fmean(r["rollout"] for r in sync)
            s_train = statistics.fmean(r["train"] for r in sync)
            bound = (s_roll + s_train) / max(s_roll, s_train, 1e-9)
            line += f": {s_step / step:.2f}x the synchronous steps/hour (bound with full overlap {bound:.2f}x)"
        print(line, flush=True)
    at_end = machine()
    print(f"machine at the end: {at_end}")
    if args.json:
        args.json.write_text(json.dumps({"machine": at_end, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
