"""The difficulty pool's informative share on a simulated policy, against a uniform draw and the earlier rule.

No model runs: each RL problem of the demo's arithmetic task (``retool.tasks``, split
``rl``) gets a fixed success rate, drawn around its kind's rate from a Beta with
concentration ``c`` (``--concentration``: 1 gives all-or-nothing problems, as the demo's
cold start shows, larger values problems alike within their kind), and a group of ``G``
is ``G`` coin flips. Every rule then draws the demo's RL stage — ``--steps`` steps ×
``--batch-size`` problems, up to ``--refill-rounds`` refills while fewer than
``batch_size`` groups are mixed — through the trainer's own loop shape, and the share of
rolled-out groups with mixed rewards is averaged over ``--seeds`` seeds. The rules:

- ``uniform``: problems drawn uniformly without replacement (what ``--curriculum none`` does
  for a single epoch);
- ``earlier``: the moving average of each problem's and kind's informativeness
  (``s ← 0.5·s + 0.5·x``, unseen problems at their kind's score, floor 0.1) — the rule
  ``--curriculum difficulty`` used before, kept here for the comparison;
- ``difficulty``: :mod:`retool.curriculum` as it is (``--curriculum-sharpness 1``), and
  ``difficulty^4`` at sharpness 4 (the demo's default).

The default kind rates are one cold start's after-SFT rates (the default seed's eval);
this measures the drawing rule on a policy that does not learn, not what RL buys.

    .venv/bin/python bench/curriculum_sim.py [--concentration 1] [--seeds 16]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retool import curriculum, tasks  # noqa: E402
from retool.algo import is_degenerate  # noqa: E402
from retool.types import Problem  # noqa: E402

RATES = {"digit_sum_power": 0.82, "divisors": 1.0, "gcd": 1.0, "lcm": 1.0, "modpow": 1.0, "multiples_sum": 0.3,
         "product": 0.82, "range_sum": 0.68, "word_problem": 0.33}


class Earlier:
    """The earlier rule: moving averages of informativeness (rate 0.5), families start at 1."""

    def __init__(self) -> None:
        self.problems: dict[str, float] = {}
        self.families: dict[str, float] = {}

    def weights(self, problems: Sequence[Problem], floor: float) -> np.ndarray:
        scores = [self.problems.get(p.id, self.families.get(p.data_source, 1.0)) for p in problems]
        return np.maximum(np.asarray(scores), floor)

    def record(self, problems: Sequence[Problem], rewards_BG: Sequence[Sequence[float]]) -> None:
        for p, rewards_G in zip(problems, rewards_BG, strict=True):
            x = 0.0 if is_degenerate(rewards_G) else 1.0
            family = self.families.get(p.data_source, 1.0)
            self.problems[p.id] = 0.5 * self.problems.get(p.id, family) + 0.5 * x
            self.families[p.data_source] = 0.5 * family + 0.5 * x


class Current:
    """:mod:`retool.curriculum` behind the same two calls, at a given sharpness."""

    def __init__(self, sharpness: float = 1.0) -> None:
        self.state = curriculum.PoolState()
        self.sharpness = sharpness

    def weights(self, problems: Sequence[Problem], floor: float) -> np.ndarray:
        return curriculum.weights(self.state, problems, floor, self.sharpness)

    def record(self, problems: Sequence[Problem], rewards_BG: Sequence[Sequence[float]]) -> None:
        self.state = curriculum.record(self.state, problems, rewards_BG)


class Uniform:
    def weights(self, problems: Sequence[Problem], floor: float) -> np.ndarray:
        return np.ones(len(problems))

    def record(self, problems: Sequence[Problem], rewards_BG: Sequence[Sequence[float]]) -> None:
        pass


RULES: dict[str, Callable[[], object]] = {"uniform": Uniform, "earlier": Earlier, "difficulty": Current,
                                          "difficulty^4": lambda: Current(4.0)}


def success_rates(problems: Sequence[Problem], concentration: float, rng: random.Random) -> dict[str, float]:
    """Each problem's fixed success rate, Beta-distributed around its kind's rate."""
    rates = {}
    for p in problems:
        mean = min(max(RATES[p.data_source.rsplit("/", 1)[1]], 1e-3), 1 - 1e-3)
        rates[p.id] = rng.betavariate(mean * concentration, (1 - mean) * concentration)
    return rates


def simulate(rule_name: str, seed: int, args: argparse.Namespace) -> tuple[int, int]:
    """(groups rolled out, informative groups) of one simulated RL stage."""
    problems = tasks.make_problems(args.problems, seed, "rl")
    rng = random.Random(seed)
    rates = success_rates(problems, args.concentration, rng)
    rule = RULES[rule_name]()
    groups = informative = 0
    for step in range(1, args.steps + 1):
        taken: list[int] = []
        results: list[list[float]] = []
        for round_ in range(args.refill_rounds + 1):
            missing = args.batch_size - sum(not is_degenerate(r) for r in results)
            if missing <= 0:
                break
            weights_N = rule.weights(problems, 0.1)
            weights_N[taken] = 0.0
            draw_rng = np.random.default_rng([seed, step, round_])
            chosen = [int(i) for i in draw_rng.choice(len(problems), missing, replace=False, p=weights_N / weights_N.sum())]
            taken += chosen
            batch = [problems[i] for i in chosen]
            rewards = [[1.0 if rng.random() < rates[p.id] else -1.0 for _ in range(args.group_size)] for p in batch]
            rule.record(batch, rewards)
            results += rewards
        groups += len(results)
        informative += sum(not is_degenerate(r) for r in results)
    return groups, informative


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concentration", type=float, default=1.0)
    parser.add_argument("--seeds", type=int, default=16)
    parser.add_argument("--problems", type=int, default=400)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--refill-rounds", type=int, default=2)
    args = parser.parse_args()
    shares = {}
    for name in RULES:
        totals = [simulate(name, 100 + s, args) for s in range(args.seeds)]
        groups, informative = sum(g for g, _ in totals), sum(i for _, i in totals)
        shares[name] = informative / groups
        print(f"{name:>12}: {informative}/{groups} groups informative ({shares[name]:.1%}), "
              f"{groups / args.seeds:.1f} groups per run", flush=True)
    print(f"against the earlier rule: difficulty {shares['difficulty'] / shares['earlier']:.2f}x, difficulty^4 "
          f"{shares['difficulty^4'] / shares['earlier']:.2f}x  (load {os.getloadavg()})")


if __name__ == "__main__":
    main()
