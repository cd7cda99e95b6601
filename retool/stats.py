"""Evaluation statistics: pass@k, Average@k and the summary line of an eval run.

Definitions (those of the seed's report, plus the unbiased estimator):

- **Average@k** — the mean, over problems, of the fraction of a problem's k samples that
  are correct. With the same k for every problem this equals correct samples / all
  samples (the seed's "85 of 360 generations"); it is the estimate of pass@1.
- **Pass@k** — the fraction of problems with at least one correct sample among their k.
- **unbiased pass@k'** for k' ≤ k — Chen et al. (2021), "Evaluating Large Language Models
  Trained on Code", eq. 1: per problem ``1 - C(n-c, k') / C(n, k')`` averaged over
  problems, computed as a product so it never forms huge binomials.
- **Format** — the fraction of samples whose answer had a closed ``\\boxed{}``.
- **stderr** of Average@k — the standard error across problems (sample std with ddof=1
  over the per-problem accuracies, divided by √problems): the noise of the problem set,
  not of the sampling.

- **paired difference** of two evals of the same problems (:func:`paired_difference`) —
  the mean over problems of ``after - before`` and its standard error (sample std of
  the per-problem differences over √problems). Pairing removes the problem-difficulty
  variance both evals share, so it is the honest "did training help" test
  (``retool compare``).

Everything here is a pure function of counts or of :class:`~retool.types.Trajectory`
records. Not covered: bootstrap confidence intervals, per-difficulty breakdowns.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from retool.serialize import trajectory_from_jsonable
from retool.types import Trajectory


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased probability that at least one of k samples drawn from n is correct.

    ``n`` samples were drawn, ``c`` of them correct; returns ``1 - C(n-c, k) / C(n, k)``
    evaluated as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``, which stays accurate for large n.
    Raises ``ValueError`` unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def average_at_k(counts: Sequence[tuple[int, int]]) -> float:
    """Mean over problems of ``c / n``; ``counts`` holds one ``(n, c)`` per problem."""
    _check_counts(counts)
    return sum(c / n for n, c in counts) / len(counts)


def pass_at_k_empirical(counts: Sequence[tuple[int, int]]) -> float:
    """Fraction of problems with at least one correct sample (the seed's Pass@k)."""
    _check_counts(counts)
    return sum(1 for _, c in counts if c > 0) / len(counts)


def unbiased_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> float:
    """Mean over problems of :func:`pass_at_k` ``(n, c, k)``."""
    _check_counts(counts)
    return sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)


def average_at_k_stderr(counts: Sequence[tuple[int, int]]) -> float:
    """Standard error of :func:`average_at_k` across problems (0.0 for one problem)."""
    _check_counts(counts)
    return _mean_and_stderr([c / n for n, c in counts])[1]


def paired_difference(before: Sequence[float], after: Sequence[float]) -> tuple[float, float]:
    """Mean of ``after[i] - before[i]`` over problems and its standard error.

    ``before`` and ``after`` hold one per-problem value each (e.g. the fraction of a
    problem's samples that are correct), in the same problem order. The standard error
    is ``std(differences, ddof=1) / sqrt(problems)`` (0.0 for one problem). Raises
    ``ValueError`` for empty or unequal-length inputs.
    """
    if len(before) != len(after):
        raise ValueError(f"paired_difference: {len(before)} values before, {len(after)} after")
    if not before:
        raise ValueError("paired_difference: no problems")
    return _mean_and_stderr([b - a for a, b in zip(before, after)])


def paired_ratio_difference(before: Sequence[tuple[float, float]],
                            after: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Difference of two pooled ratios on the same problems, and its standard error.

    Each side holds one ``(numerator, denominator)`` per problem (e.g. a problem's valid
    tool calls and its call attempts, over all its samples), in the same problem order;
    the ratio is ``sum(numerators) / sum(denominators)``, as the training metric pools
    it. The standard error treats each problem as a cluster and pairs the two evals by
    problem, through the delta method: problem ``i`` contributes
    ``u_i = (num_i - ratio * den_i) / mean(den)`` on each side, and the s.e. is that of
    the paired differences of ``u``, like :func:`paired_difference`. Raises
    ``ValueError`` for unequal lengths, no problems, or a side whose denominators sum to 0.
    """
    if len(before) != len(after):
        raise ValueError(f"paired_ratio_difference: {len(before)} problems before, {len(after)} after")
    if not before:
        raise ValueError("paired_ratio_difference: no problems")
    sides = []
    for name, pairs in (("before", before), ("after", after)):
        total_num, total_den = sum(n for n, _ in pairs), sum(d for _, d in pairs)
        if total_den <= 0:
            raise ValueError(f"paired_ratio_difference: the denominators {name} sum to {total_den}")
        ratio, mean_den = total_num / total_den, total_den / len(pairs)
        sides.append((ratio, [(n - ratio * d) / mean_den for n, d in pairs]))
    (ratio_before, u_before), (ratio_after, u_after) = sides
    _, stderr = _mean_and_stderr([b - a for a, b in zip(u_before, u_after)])
    return ratio_after - ratio_before, stderr


def _mean_and_stderr(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error (sample std, ddof=1, over √n; 0.0 for one value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(variance / len(values))


def summarize(problem_rows: Iterable[Mapping]) -> dict:
    """The fields of an eval results file's summary line (docs/formats.md).

    ``problem_rows`` are the ``{"type": "problem", ...}`` rows of an eval: each needs a
    ``"samples"`` list of :class:`Trajectory` records or their JSON form (as written by
    :func:`retool.serialize.to_jsonable`). The caller adds ``"type": "summary"``.

    ``k`` is the smallest sample count over problems (equal counts are the normal case);
    unbiased pass@k' is reported for k' = 1..k under string keys. The means follow the
    rollout metrics of the same names: ``code_calls`` counts calls that ran in the
    sandbox, ``tool_call_attempts`` every call attempt (invalid ones too), ``tokens`` the
    whole context (prompt included, as the trajectory budget counts it),
    ``sampled_tokens`` the policy tokens (mask sum). Raises ``ValueError`` for no problems or a problem
    without samples.
    """
    samples_P = [[_as_trajectory(s) for s in row["samples"]] for row in problem_rows]
    counts = [(len(samples), sum(t.grade.correct for t in samples)) for samples in samples_P]
    _check_counts(counts)
    every = [t for samples in samples_P for t in samples]
    k = min(n for n, _ in counts)
    return {
        "average@k": average_at_k(counts),
        "pass@k": pass_at_k_empirical(counts),
        "pass@k_unbiased": {str(j): unbiased_pass_at_k(counts, j) for j in range(1, k + 1)},
        "format": _mean(t.grade.formatted for t in every),
        "reward": _mean(t.grade.reward for t in every),
        "code_calls": _mean(t.num_code_calls for t in every),
        "tool_call_attempts": _mean(_attempts(t) for t in every),
        "used_tool_rate": _mean(t.num_code_calls > 0 for t in every),
        "turns": _mean(len(t.turns) for t in every),
        "tokens": _mean(len(t.tokens_T) for t in every),
        "sampled_tokens": _mean(sum(t.mask_T) for t in every),
        "average@k_stderr": average_at_k_stderr(counts),
        "k": k,
        "num_problems": len(counts),
        "num_samples": len(every),
        "num_correct": sum(c for _, c in counts),
        "num_formatted": sum(t.grade.formatted for t in every),
        "num_solved": sum(1 for _, c in counts if c > 0),
        "stop_reasons": dict(Counter(t.stop_reason.value for t in every)),
    }


def _as_trajectory(sample: Trajectory | Mapping) -> Trajectory:
    return sample if isinstance(sample, Trajectory) else trajectory_from_jsonable(dict(sample))


def _attempts(trajectory: Trajectory) -> int:
    return sum(1 for turn in trajectory.turns if turn.exchange is not None)


def _check_counts(counts: Sequence[tuple[int, int]]) -> None:
    if not counts:
        raise ValueError("no problems to summarise")
    for n, c in counts:
        if n < 1 or not 0 <= c <= n:
            raise ValueError(f"bad per-problem counts: {n} samples, {c} correct")


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values)
