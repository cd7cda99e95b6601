"""An online difficulty pool: which problems an RL step rolls out (``retool train --curriculum``).

GRPO learns only from a group whose rewards differ: a problem the policy solves G/G or
0/G gives every trajectory advantage 0 and costs a whole group's rollout for nothing.
With ``--curriculum difficulty`` the trainer draws problems by how informative their
recent groups were, so fewer of those groups are spent on what the policy already always
solves or always fails.

The rule (pure functions over :class:`PoolState`, which checkpoints hold):

- a group is *informative* when its rewards are not all equal (``x = 1``), else ``x = 0``;
- every problem has a score, an exponential moving average of its groups' ``x`` with
  weight :data:`RATE` for the newest: ``s ← (1 − RATE)·s + RATE·x``; so does every
  *family* of problems (their ``data_source``, e.g. one arithmetic kind or one
  word-problem story), starting at 1;
- a problem's draw weight is ``max(floor, s)`` where ``s`` is its own score, or its
  family's score while it has never been rolled out (an unseen problem is as
  promising as its family has lately been);
- a step's problems are ``batch_size`` distinct ones drawn without replacement with
  probability proportional to their weights, from a generator seeded by (run seed,
  step, round); a refill round (``--refill-rounds``) draws from the problems not yet
  rolled out in that step, after the earlier rounds' groups have been recorded.

With :data:`RATE` 0.5 a problem or family whose groups came back all right or all wrong
three times in a row is drawn 8× less often than a fresh one, one informative group
doubles its chance again, and the floor (``--curriculum-floor``, 0.1 by default) keeps
every problem drawable, so nothing starves and a problem the policy has since
forgotten (or learnt) can come back. Everything is a function of the run's seed and
the recorded results, so a resumed run draws exactly what the uninterrupted run drew.

Not covered: a target success rate (a problem at 1/G and one at G/2 weigh the same),
difficulty labels given with the data, and families other than ``data_source``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from retool.algo import is_degenerate
from retool.types import Problem

if TYPE_CHECKING:
    import numpy as np  # numpy: 30-100 ms to import, kept off retool train --help

CURRICULA = ("none", "difficulty")
"""``none``: the seeded shuffle per epoch (and uniform refills); ``difficulty``: this pool."""

RATE = 0.5
"""Weight of a group's result in its problem's and family's moving average."""

_STREAM = 0x0C0FFEE
"""Keeps the pool's draws apart from the other generators seeded by (seed, step, round)."""


@dataclass(frozen=True)
class PoolState:
    """What the pool has seen: the moving-average informativeness of each problem and family.

    Problems and families never rolled out are absent (a family then scores 1).
    """

    problems: Mapping[str, float] = field(default_factory=dict)
    families: Mapping[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, dict[str, float]]:
        return {"problems": dict(self.problems), "families": dict(self.families)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PoolState:
        return cls({str(k): float(v) for k, v in data["problems"].items()},
                   {str(k): float(v) for k, v in data["families"].items()})


def weights(state: PoolState, problems: Sequence[Problem], floor: float) -> np.ndarray:
    """The draw weight of every problem: ``max(floor, own score, or its family's while unseen)``."""
    import numpy as np  # numpy: 30-100 ms to import, kept off retool train --help

    scores = [state.problems.get(p.id, state.families.get(p.data_source, 1.0)) for p in problems]
    return np.maximum(np.asarray(scores, dtype=np.float64), floor)


def draw(state: PoolState, problems: Sequence[Problem], count: int, *, seed: int, step: int, round_: int,
         floor: float, exclude: Iterable[int] = ()) -> list[int]:
    """Indices of ``count`` distinct problems (fewer if fewer remain), drawn with probability
    proportional to :func:`weights` from those not in ``exclude``; seeded by (seed, step, round)."""
    import numpy as np  # numpy: 30-100 ms to import, kept off retool train --help

    weights_N = weights(state, problems, floor)
    weights_N[list(exclude)] = 0.0
    available = int(np.count_nonzero(weights_N))
    if available == 0 or count <= 0:
        return []
    rng = np.random.default_rng([seed, step, round_, _STREAM])
    chosen = rng.choice(len(problems), size=min(count, available), replace=False, p=weights_N / weights_N.sum())
    return [int(i) for i in chosen]


def record(state: PoolState, problems: Sequence[Problem], rewards_BG: Sequence[Sequence[float]]) -> PoolState:
    """``state`` after the groups of ``problems`` (in order) came back with ``rewards_BG``."""
    scores, families = dict(state.problems), dict(state.families)
    for problem, rewards_G in zip(problems, rewards_BG, strict=True):
        x = 0.0 if is_degenerate(rewards_G) else 1.0
        family = families.get(problem.data_source, 1.0)
        scores[problem.id] = (1 - RATE) * scores.get(problem.id, family) + RATE * x
        families[problem.data_source] = (1 - RATE) * family + RATE * x
    return PoolState(scores, families)


def pool_metrics(state: PoolState, problems: Sequence[Problem], floor: float) -> dict[str, float]:
    """``curriculum/*`` metrics: problems seen so far, mean weight, share of problems at the floor."""
    import numpy as np  # numpy: 30-100 ms to import, kept off retool train --help

    weights_N = weights(state, problems, floor)
    return {"curriculum/seen_problems": float(len(state.problems)),
            "curriculum/mean_weight": float(weights_N.mean()),
            "curriculum/floor_share": float(np.mean(weights_N <= floor))}
