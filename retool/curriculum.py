"""An online difficulty pool: which problems an RL step rolls out (``retool train --curriculum``).

GRPO learns only from a group whose rewards differ: a problem the policy solves G/G or
0/G gives every trajectory advantage 0 and costs a whole group's rollout for nothing.
With ``--curriculum difficulty`` the trainer draws each problem in proportion to the
chance that its next group comes back *mixed*, estimated from the results so far.

The rule (pure functions over :class:`PoolState`, which checkpoints hold):

- a trajectory *succeeds* when its reward is positive (the grader's +1); a group is
  *informative* when its rewards are not all equal;
- every *family* of problems (their ``data_source``: one arithmetic kind, or one level of
  it) keeps discounted counts of its trajectories, successes, groups and informative
  groups; before a group is added its family's counts are multiplied by :data:`DECAY`,
  so the estimate follows the policy as it learns. Every problem keeps its own counts;
- a family's success rate ``p`` has the posterior Beta(1 + successes, 1 + failures), and
  the chance a group of ``G`` is mixed is ``1 − P(0 of G) − P(G of G)`` under the
  beta-binomial — near 1 for ``p`` around one half, near 0 for ``p`` near 0 or 1, and
  lower while ``p`` is uncertain. A family whose problems differ (some always solved,
  some never: each group G/G or 0/G although ``p`` is one half) is caught by its own
  record: its predicted chance is only a prior of weight :data:`PRIOR_GROUPS` groups for
  its observed informative share, ``(informative + PRIOR_GROUPS·predicted) / (groups +
  PRIOR_GROUPS)``;
- a problem already rolled out is judged by its own counts on top of its family's
  posterior scaled down to :data:`PRIOR_TRIALS` trajectories (one G/G group makes it
  unlikely to be mixed next time, whatever its family does);
- a problem's draw weight is ``max(floor, chance) ** sharpness`` (``--curriculum-sharpness``,
  1 by default): a sharpness above 1 favours the likeliest-mixed problems more strongly
  (at 4 a problem at chance 0.9 weighs 16× one at 0.45); a step's problems are
  ``batch_size`` distinct ones drawn without replacement with probability proportional to
  their weights, from a generator seeded by (run seed, step, round); a refill round
  (``--refill-rounds``) draws from the problems not yet rolled out in that step, after the
  earlier rounds' groups have been recorded.

Before anything is recorded every problem weighs the same (the uniform prior's chance,
7/9 for ``G = 8``). The floor (``--curriculum-floor``, 0.1 by default) keeps every problem
drawable — at least ``floor ** sharpness`` of a sure-mixed problem's weight — so a family
the policy has since forgotten (or learnt) can come back; with a high sharpness that takes
many steps. Everything is a function of the run's seed and the recorded results, so a
resumed run draws exactly what the uninterrupted run drew.

Not covered: difficulty labels given with the data, families other than ``data_source``,
and sharing what one family taught about another (each level of a kind learns alone).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from retool.algo import is_degenerate
from retool.config import ConfigError
from retool.types import Problem

if TYPE_CHECKING:
    import numpy as np

CURRICULA = ("none", "difficulty")
"""``none``: the seeded shuffle per epoch (and uniform refills); ``difficulty``: this pool."""

DECAY = 0.8
"""What a family's counts keep each time one of its groups is added (the newest group weighs 1)."""

PRIOR_GROUPS = 1.0
"""How many groups the beta-binomial prediction weighs against a family's observed informative share."""

PRIOR_TRIALS = 4.0
"""At most how many trajectories a family's posterior weighs beside a rolled-out problem's own."""

_STREAM = 0x0C0FFEE
"""Keeps the pool's draws apart from the other generators seeded by (seed, step, round)."""


@dataclass(frozen=True)
class Counts:
    """Trajectories, successes, groups and informative groups (discounted for a family)."""

    trials: float = 0.0
    successes: float = 0.0
    groups: float = 0.0
    informative: float = 0.0

    def add(self, rewards_G: Sequence[float], keep: float = 1.0) -> Counts:
        """These counts times ``keep``, plus the group ``rewards_G``."""
        return Counts(keep * self.trials + len(rewards_G), keep * self.successes + sum(r > 0 for r in rewards_G),
                      keep * self.groups + 1, keep * self.informative + (not is_degenerate(rewards_G)))

    def to_json(self) -> list[float]:
        return [self.trials, self.successes, self.groups, self.informative]


@dataclass(frozen=True)
class PoolState:
    """What the pool has seen: counts per problem id and per family, and the group size.

    Problems and families never rolled out are absent; ``group_size`` is 0 until a group is recorded.
    """

    problems: Mapping[str, Counts] = field(default_factory=dict)
    families: Mapping[str, Counts] = field(default_factory=dict)
    group_size: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"problems": {k: c.to_json() for k, c in self.problems.items()},
                "families": {k: c.to_json() for k, c in self.families.items()}, "group_size": self.group_size}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PoolState:
        """The state :meth:`to_json` wrote; :class:`~retool.config.ConfigError` (a one-line error of
        ``retool train``) for another layout: a checkpoint of the earlier rule."""
        if "group_size" not in data:
            raise ConfigError("the checkpoint's difficulty pool was written by an earlier version of the rule "
                             "(moving averages, not counts); resume it with that version or start a new run")
        return cls({str(k): Counts(*map(float, v)) for k, v in data["problems"].items()},
                   {str(k): Counts(*map(float, v)) for k, v in data["families"].items()}, int(data["group_size"]))


def mixed_chance(alpha: float, beta: float, group_size: int) -> float:
    """``1 − P(0 of G) − P(G of G)`` for successes ~ BetaBinomial(G, alpha, beta)."""
    log_b = _log_beta(alpha, beta)
    all_right = math.exp(_log_beta(alpha + group_size, beta) - log_b)
    all_wrong = math.exp(_log_beta(alpha, beta + group_size) - log_b)
    return max(0.0, 1.0 - all_right - all_wrong)


def _log_beta(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


def family_chance(family: Counts, group_size: int) -> float:
    """A fresh problem's chance of a mixed group: the prediction from the family's success
    rate, blended with its observed informative share."""
    predicted = mixed_chance(1 + family.successes, 1 + family.trials - family.successes, group_size)
    return (family.informative + PRIOR_GROUPS * predicted) / (family.groups + PRIOR_GROUPS)


def problem_chance(own: Counts, family: Counts, group_size: int) -> float:
    """A rolled-out problem's chance of a mixed group: its own counts on a scaled family prior."""
    alpha, beta = 1 + family.successes, 1 + family.trials - family.successes
    scale = min(1.0, PRIOR_TRIALS / (alpha + beta))
    return mixed_chance(scale * alpha + own.successes, scale * beta + own.trials - own.successes, group_size)


def chances(state: PoolState, problems: Sequence[Problem]) -> list[float]:
    """Every problem's estimated chance that its next group has mixed rewards."""
    size = state.group_size or 8  # before any group: every problem the same (the uniform prior's chance)
    fresh: dict[str, float] = {}
    out = []
    for p in problems:
        family = state.families.get(p.data_source, Counts())
        own = state.problems.get(p.id)
        if own is not None:
            out.append(problem_chance(own, family, size))
            continue
        if p.data_source not in fresh:
            fresh[p.data_source] = family_chance(family, size)
        out.append(fresh[p.data_source])
    return out


def weights(state: PoolState, problems: Sequence[Problem], floor: float, sharpness: float = 1.0) -> np.ndarray:
    """The draw weight of every problem: ``max(floor, chance of a mixed group) ** sharpness``."""
    import numpy as np

    return np.maximum(np.asarray(chances(state, problems), dtype=np.float64), floor) ** sharpness


def draw(state: PoolState, problems: Sequence[Problem], count: int, *, seed: int, step: int, round_: int,
         floor: float, exclude: Iterable[int] = (), sharpness: float = 1.0) -> list[int]:
    """Indices of ``count`` distinct problems (fewer if fewer remain), drawn with probability
    proportional to :func:`weights` from those not in ``exclude``; seeded by (seed, step, round)."""
    import numpy as np

    weights_N = weights(state, problems, floor, sharpness)
    weights_N[list(exclude)] = 0.0
    available = int(np.count_nonzero(weights_N))
    if available == 0 or count <= 0:
        return []
    rng = np.random.default_rng([seed, step, round_, _STREAM])
    chosen = rng.choice(len(problems), size=min(count, available), replace=False, p=weights_N / weights_N.sum())
    return [int(i) for i in chosen]


def record(state: PoolState, problems: Sequence[Problem], rewards_BG: Sequence[Sequence[float]]) -> PoolState:
    """``state`` after the groups of ``problems`` (in order) came back with ``rewards_BG``."""
    own, families = dict(state.problems), dict(state.families)
    size = state.group_size
    for problem, rewards_G in zip(problems, rewards_BG, strict=True):
        own[problem.id] = own.get(problem.id, Counts()).add(rewards_G)
        families[problem.data_source] = families.get(problem.data_source, Counts()).add(rewards_G, DECAY)
        size = len(rewards_G)
    return replace(state, problems=own, families=families, group_size=size)


def pool_metrics(state: PoolState, problems: Sequence[Problem], floor: float,
                 sharpness: float = 1.0) -> dict[str, float]:
    """``curriculum/*`` metrics: problems seen so far, mean weight, share of problems at the floor,
    and the informative share a draw from these weights should give (``Σ w·chance / Σ w``)."""
    import numpy as np

    chances_N = np.asarray(chances(state, problems), dtype=np.float64)
    weights_N = weights(state, problems, floor, sharpness)
    return {"curriculum/seen_problems": float(len(state.problems)),
            "curriculum/mean_weight": float(weights_N.mean()),
            "curriculum/floor_share": float(np.mean(chances_N <= floor)),
            "curriculum/expected_informative": float((weights_N * chances_N).sum() / weights_N.sum())}
