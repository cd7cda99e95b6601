"""The difficulty pool's informative share on a simulated policy, against a uniform draw and a candidate rule.

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
- ``difficulty``: :mod:`retool.curriculum` as it is (moving averages of informativeness);
- ``chance`` and ``chance^4``: a candidate tried and *not adopted* (see ``docs/train.md``):
  each kind keeps discounted success counts (×0.8 per new group), the chance that a group
  of ``G`` is mixed is ``1 − P(0 of G) − P(G of G)`` under the beta-binomial of
  Beta(1 + successes, 1 + failures), tempered by the kind's observed informative share
  (the prediction weighs as one group); a rolled-out problem adds its own counts to its
  kind's posterior scaled to 4 trajectories; the draw weight is ``max(0.1, chance) ** k``
  with ``k`` 1 or 4. On the real demo model it did worse than ``difficulty``.

The default kind rates are one cold start's after-SFT rates (the default seed's eval);
this measures the drawing rule on a policy that does not learn, not what RL buys.

    .venv/bin/python bench/curriculum_sim.py [--concentration 1] [--seeds 16]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retool import curriculum, tasks  # noqa: E402
from retool.algo import is_degenerate  # noqa: E402
from retool.types import Problem  # noqa: E402

RATES = {"digit_sum_power": 0.82, "divisors": 1.0, "gcd": 1.0, "lcm": 1.0, "modpow": 1.0, "multiples_sum": 0.3,
         "product": 0.82, "range_sum": 0.68, "word_problem": 0.33}


@dataclass(frozen=True)
class Counts:
    """Trajectories, successes, groups and informative groups."""

    trials: float = 0.0
    successes: float = 0.0
    groups: float = 0.0
    informative: float = 0.0

    def add(self, rewards_G: Sequence[float], keep: float) -> Counts:
        return Counts(keep * self.trials + len(rewards_G), keep * self.successes + sum(r > 0 for r in rewards_G),
                      keep * self.groups + 1, keep * self.informative + (not is_degenerate(rewards_G)))


def mixed_chance(alpha: float, beta: float, group_size: int) -> float:
    """``1 − P(0 of G) − P(G of G)`` for successes ~ BetaBinomial(G, alpha, beta)."""
    def log_beta(a: float, b: float) -> float:
        return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    base = log_beta(alpha, beta)
    return max(0.0, 1 - math.exp(log_beta(alpha + group_size, beta) - base)
               - math.exp(log_beta(alpha, beta + group_size) - base))


class Chance:
    """The candidate rule (module docstring) at sharpness ``k``."""

    def __init__(self, k: float = 1.0, group_size: int = 8) -> None:
        self.k, self.group_size = k, group_size
        self.problems: dict[str, Counts] = {}
        self.families: dict[str, Counts] = {}

    def chance(self, p: Problem) -> float:
        family = self.families.get(p.data_source, Counts())
        alpha, beta = 1 + family.successes, 1 + family.trials - family.successes
        own = self.problems.get(p.id)
        if own is None:
            predicted = mixed_chance(alpha, beta, self.group_size)
            return (family.informative + predicted) / (family.groups + 1)
        scale = min(1.0, 4 / (alpha + beta))
        return mixed_chance(scale * alpha + own.successes, scale * beta + own.trials - own.successes, self.group_size)

    def weights(self, problems: Sequence[Problem], floor: float) -> np.ndarray:
        return np.maximum(np.asarray([self.chance(p) for p in problems]), floor) ** self.k

    def record(self, problems: Sequence[Problem], rewards_BG: Sequence[Sequence[float]]) -> None:
        for p, rewards_G in zip(problems, rewards_BG, strict=True):
            self.problems[p.id] = self.problems.get(p.id, Counts()).add(rewards_G, 1.0)
            self.families[p.data_source] = self.families.get(p.data_source, Counts()).add(rewards_G, 0.8)


class Current:
    """:mod:`retool.curriculum` behind the same two calls."""

    def __init__(self) -> None:
        self.state = curriculum.PoolState()

    def weights(self, problems: Sequence[Problem], floor: float) -> np.ndarray:
        return curriculum.weights(self.state, problems, floor)

    def record(self, problems: Sequence[Problem], rewards_BG: Sequence[Sequence[float]]) -> None:
        self.state = curriculum.record(self.state, problems, rewards_BG)


class Uniform:
    def weights(self, problems: Sequence[Problem], floor: float) -> np.ndarray:
        return np.ones(len(problems))

    def record(self, problems: Sequence[Problem], rewards_BG: Sequence[Sequence[float]]) -> None:
        pass


RULES: dict[str, Callable[[], object]] = {"uniform": Uniform, "difficulty": Current, "chance": Chance,
                                          "chance^4": lambda: Chance(4.0)}


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
    print(f"against difficulty: chance {shares['chance'] / shares['difficulty']:.2f}x, chance^4 "
          f"{shares['chance^4'] / shares['difficulty']:.2f}x, uniform {shares['uniform'] / shares['difficulty']:.2f}x  "
          f"(load {os.getloadavg()})")


if __name__ == "__main__":
    main()
