"""Where a code call's wait for the sandbox comes from, at the reference run's load shape.

A call's *wait* is its end-to-end latency minus its own run time in the sandbox
(``sandbox/queue_wait_*``): queueing for one of the workers, plus the hand-over (the
request to the warm parent, the fork, the reply back). At the reference run's size the
64 trajectories' first turns end close together, so their calls come in bursts. This
bench fires bursts of the scripted policy's own snippets (``bench/scale_policy.py``:
plain, sympy and numpy mixes; some that raise; none that time out) at a real
:class:`retool.sandbox.Sandbox` and splits the wait:

- **hand-over**: one call at a time on the otherwise idle sandbox (nothing to queue for);
- **bursts at W workers** for each ``--workers`` W: if the wait falls as W grows, the
  calls were queueing for a worker; if it stays while each call's run time grows, the
  cores are the limit (more workers only share the same CPUs).

With ``--loops N`` every burst has ``N`` snippets beside it that spin until their timeout
(``--loop-timeout-s``), as the reference run's 2-3 % of calls at the 30 s timeout do, and
each worker count runs twice in the same run: with the service presets' ``demote_after_s``
(1 s: a call past it runs at nice 19) and without it (``None``, the sandbox's default),
so the short calls' wait and run time show what the demotion buys against the same load.

Every figure is printed beside the first setting's (same run) with the machine's load
average. Not covered: the calls of a live run interleave with sampling and grading
on the same cores (``bench/scale.py`` measures that).

Usage::

    nice -n 10 python bench/scale_sandbox.py                       # 8, 16 and 32 workers
    python bench/scale_sandbox.py --workers 8 64 --bursts 3 --burst 64
    python bench/scale_sandbox.py --workers 16 32 --loops 6            # spinning calls beside, demotion on / off
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scale_policy import ENDLESS, TIMEOUT_RATE, make_problems, snippet  # noqa: E402
from retool.sandbox import Sandbox, SandboxConfig  # noqa: E402
from retool.sandbox.metrics import percentile  # noqa: E402


@dataclass(frozen=True)
class Figures:
    """One setting's calls: wait and run time percentiles (seconds), calls per second."""

    label: str
    calls: int
    wait_p50: float
    wait_p95: float
    run_p50: float
    run_p95: float
    calls_per_s: float


def burst_snippets(count: int, seed: int) -> list[str]:
    """``count`` snippets as the scripted policy writes them, the never-ending ones left out
    (they would only measure the timeout)."""
    rng, problems = random.Random(seed), make_problems(64, seed)
    out: list[str] = []
    while len(out) < count:
        code = snippet(rng.choice(problems).question, rng)
        if code != ENDLESS:
            out.append(code)
    return out


async def _timed(sandbox: Sandbox, code: str, timeout_s: float) -> tuple[float, float]:
    start = time.monotonic()
    result = await sandbox.run(code, timeout_s=timeout_s)
    return time.monotonic() - start, result.wall_s


DEMOTE_AFTER_S = 1.0
"""``SandboxConfig.demote_after_s`` with the demotion on (the service presets' value)."""
SPIN_LEAD_S = 1.5
"""How long the spinning calls run before each burst comes (past the sandbox's 1 s
``demote_after_s``: a call at a 30 s timeout spends nearly all of it there)."""


async def _bursts(sandbox: Sandbox, snippets: list[list[str]], timeout_s: float, *,
                  one_at_a_time: bool, loops: int = 0, loop_timeout_s: float = 5.0
                  ) -> tuple[list[tuple[float, float]], float]:
    """(latency, run) of every call and the seconds it all took; ``loops`` spinning calls
    start just before each burst and run beside it to their timeout (not counted)."""
    start, out = time.monotonic(), []
    for burst in snippets:
        spinners = [asyncio.ensure_future(sandbox.run(ENDLESS, timeout_s=loop_timeout_s)) for _ in range(loops)]
        if spinners:
            await asyncio.sleep(SPIN_LEAD_S)  # already spinning, as a call at a 30 s timeout mostly is
        if one_at_a_time:
            for code in burst:
                out.append(await _timed(sandbox, code, timeout_s))
        else:
            out += await asyncio.gather(*(_timed(sandbox, code, timeout_s) for code in burst))
        await asyncio.gather(*spinners)
    return out, time.monotonic() - start


def measure(label: str, workers: int, snippets: list[list[str]], timeout_s: float, *,
            one_at_a_time: bool = False, loops: int = 0, loop_timeout_s: float = 5.0,
            demote: bool = False) -> Figures:
    """Run ``snippets`` (bursts) on a fresh sandbox of ``workers`` workers, warmed first;
    ``demote``: ``demote_after_s`` :data:`DEMOTE_AFTER_S`, else ``None`` (the sandbox's default)."""
    config = SandboxConfig(workers=workers, timeout_s=timeout_s, demote_after_s=DEMOTE_AFTER_S if demote else None)
    with Sandbox(config) as sandbox:
        asyncio.run(_bursts(sandbox, [snippets[0][:workers]], timeout_s, one_at_a_time=False))  # warm-up
        calls, seconds = asyncio.run(_bursts(sandbox, snippets, timeout_s, one_at_a_time=one_at_a_time,
                                             loops=loops, loop_timeout_s=loop_timeout_s))
    waits = sorted(max(0.0, latency - run) for latency, run in calls)
    runs = sorted(run for _, run in calls)
    return Figures(label, len(calls), percentile(waits, 50), percentile(waits, 95), percentile(runs, 50),
                   percentile(runs, 95), len(calls) / seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 16, 32], help="worker counts to compare")
    parser.add_argument("--burst", type=int, default=64, help="calls fired together (the reference run's 64 "
                                                              "trajectories' first calls)")
    parser.add_argument("--bursts", type=int, default=3, help="bursts per setting")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="each call's sandbox timeout")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loops", type=int, default=0,
                        help="spinning calls beside each burst (then each worker count runs with the demotion on "
                             "and off)")
    parser.add_argument("--loop-timeout-s", type=float, default=5.0, help="the spinning calls' timeout")
    args = parser.parse_args(argv)
    if min(args.workers + [args.burst, args.bursts]) < 1 or args.timeout_s <= 0:
        parser.error("--workers, --burst and --bursts must be >= 1 and --timeout-s > 0")
    if args.loops < 0 or args.loop_timeout_s <= 0:
        parser.error("--loops must be >= 0 and --loop-timeout-s > 0")
    if args.loops and min(args.workers) <= args.loops:
        parser.error(f"--workers must each be > --loops ({args.loops}): the spinning calls hold that many workers")
    code = burst_snippets(args.burst * args.bursts, args.seed)
    snippets = [code[i:i + args.burst] for i in range(0, len(code), args.burst)]
    print(f"{args.bursts} bursts of {args.burst} calls (the scripted policy's snippets; timeout-bound ones "
          f"left out, {100 * TIMEOUT_RATE:.1f} % of them); cores {os.cpu_count()}; load {os.getloadavg()}")
    rows = [measure("hand-over (one call at a time)", args.workers[0], snippets[:1], args.timeout_s,
                    one_at_a_time=True)]
    if args.loops:
        print(f"beside each burst: {args.loops} calls spinning to their {args.loop_timeout_s:g} s timeout; each "
              f"worker count with the sandbox's demotion (nice 19 after {DEMOTE_AFTER_S:g} s) and without")
        rows = []
        for w in args.workers:
            for demote in (False, True):
                rows.append(measure(f"{w} workers, {args.loops} spinning, demotion {'on' if demote else 'off'}", w,
                                    snippets, args.timeout_s, loops=args.loops, loop_timeout_s=args.loop_timeout_s,
                                    demote=demote))
    else:
        rows += [measure(f"bursts, {w} workers", w, snippets, args.timeout_s) for w in args.workers]
    base = rows[0 if args.loops else 1]
    print(f"{'setting':<40} {'calls':>5} {'wait_p50':>8} {'wait_p95':>8} {'run_p50':>7} {'run_p95':>7} "
          f"{'calls/s':>7} {'wait_p95 vs first':>17} {'run_p95 vs first':>16}")
    for r in rows:
        print(f"{r.label:<40} {r.calls:5d} {r.wait_p50:8.3f} {r.wait_p95:8.3f} {r.run_p50:7.3f} {r.run_p95:7.3f} "
              f"{r.calls_per_s:7.1f} {r.wait_p95 / base.wait_p95 if base.wait_p95 else 0:16.2f}x "
              f"{r.run_p95 / base.run_p95 if base.run_p95 else 0:15.2f}x")
    print(f"load {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
