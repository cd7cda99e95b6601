"""Benchmark: grading throughput of retool.reward against plain math_verify.

Baseline (measured in the same run): ``verify(parse(f"${gold}$"), parse(f"${answer}$"))``
called serially on the main thread with math_verify's defaults — what a simple reward
function does. Measured against it:

- ``pool, fast path``   — ``reward.grade_many`` on a ``GraderPool`` (extraction +
  worker processes + the plain-integer shortcut);
- ``pool, no fast path`` — the same with every pair sent to math_verify in a worker.

Two answer sets: integers (AIME/DAPO-style; half correct) and MATH-500 (each problem's
own gold answer, and the next problem's answer as a wrong one). The pool is started
before timing; its start-up is printed separately. Verdict disagreements with the
baseline are counted (expected: 0).

Usage:
    python bench/reward.py [--data PATH] [--limit N] [--n-int N] [--workers N]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from retool.grader_pool import GraderPool  # noqa: E402
from retool.reward import boxed, extract_boxed, grade_many  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = next(
    (p for p in (REPO / "retool/assets/data/math500.jsonl", REPO.parent / "shared/data/math500.jsonl")
     if p.exists()),
    REPO / "retool/assets/data/math500.jsonl",
)


def integer_pairs(n: int, seed: int = 42) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    golds = [str(rng.randrange(1000)) for _ in range(n)]
    answers = [g if i % 2 == 0 else str(rng.randrange(1000)) for i, g in enumerate(golds)]
    return [f"Computing... so the answer is {boxed(a)}." for a in answers], golds


def math500_pairs(path: Path, limit: int | None) -> tuple[list[str], list[str]]:
    with open(path, encoding="utf-8") as f:
        golds = [json.loads(line)["answer"] for line in f if line.strip()][:limit]
    wrong = golds[1:] + golds[:1]
    responses = [f"Therefore {boxed(a)}" for a in golds + wrong]
    return responses, golds + golds


def serial_math_verify(responses: list[str], golds: list[str]) -> list[bool]:
    from math_verify import parse, verify

    verdicts = []
    for response, gold in zip(responses, golds):
        answer = extract_boxed(response)
        verdicts.append(answer is not None and verify(parse(f"${gold}$"), parse(f"${answer}$")))
    return verdicts


def timed(fn, *args):
    started = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - started


def bench_set(name: str, responses: list[str], golds: list[str], pools: dict[str, GraderPool]) -> None:
    baseline, base_s = timed(serial_math_verify, responses, golds)
    n = len(responses)
    print(f"\n{name}: {n} answers, {sum(baseline)} correct per math_verify")
    print(f"  {'grader':<28}{'seconds':>9}{'answers/s':>12}{'vs serial':>11}{'disagree':>10}")
    print(f"  {'math_verify, serial':<28}{base_s:>9.2f}{n / base_s:>12.1f}{1.0:>10.2f}x{0:>10}")
    for label, pool in pools.items():
        grades, seconds = timed(functools.partial(grade_many, pool=pool), responses, golds)
        disagree = sum(g.correct != b for g, b in zip(grades, baseline))
        print(f"  {label:<28}{seconds:>9.2f}{n / seconds:>12.1f}{base_s / seconds:>10.2f}x{disagree:>10}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="MATH-500 JSONL (field 'answer')")
    parser.add_argument("--limit", type=int, default=None, help="use the first N MATH-500 problems")
    parser.add_argument("--n-int", type=int, default=1000, help="integer answers to grade")
    parser.add_argument("--workers", type=int, default=None, help="grader processes (default: min(8, CPUs))")
    args = parser.parse_args()
    if not args.data.exists():
        parser.error(f"no MATH-500 file at {args.data}; pass --data")

    pools = {"pool, fast path": GraderPool(args.workers), "pool, no fast path": GraderPool(args.workers, fast_path=False)}
    for pool in pools.values():
        _, start_s = timed(pool.start)
    print(f"{pools['pool, fast path'].num_workers} grader processes; starting one pool took {start_s:.2f} s")
    bench_set("integer answers", *integer_pairs(args.n_int), pools)
    bench_set("MATH-500 answers", *math500_pairs(args.data, args.limit), pools)
    for pool in pools.values():
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
