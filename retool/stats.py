"""Evaluation statistics: pass@k, Average@k, paired differences, and trajectory totals.

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

- **behaviour figures** (:func:`behaviour_figures`) — the ReTool paper's analyses of
  *how* the model uses the tool, pooled over trajectories: response length, call rate,
  code lines per call, share of calls that ran without error, position of the first call,
  self-corrections.

- **trajectory totals** (:class:`TrajectoryStats`) — correct, formatted, reward, turns,
  call attempts, valid and executed calls, tokens, stop reasons of a set of
  trajectories: the one aggregation behind the training metrics and the eval summary
  (:mod:`retool.results`), which only name its figures differently.

Everything here is a pure function of counts or of :class:`~retool.types.Trajectory`
records. Not covered: bootstrap confidence intervals, per-difficulty breakdowns.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields

from retool.types import ExecStatus, ExecutionResult, InvalidToolCall, ToolCall, Trajectory


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
    check_counts(counts)
    return sum(c / n for n, c in counts) / len(counts)


def pass_at_k_empirical(counts: Sequence[tuple[int, int]]) -> float:
    """Fraction of problems with at least one correct sample (the seed's Pass@k)."""
    check_counts(counts)
    return sum(1 for _, c in counts if c > 0) / len(counts)


def unbiased_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> float:
    """Mean over problems of :func:`pass_at_k` ``(n, c, k)``."""
    check_counts(counts)
    return sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)


def average_at_k_stderr(counts: Sequence[tuple[int, int]]) -> float:
    """Standard error of :func:`average_at_k` across problems (0.0 for one problem)."""
    check_counts(counts)
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


def proportion_difference(first: tuple[int, int], last: tuple[int, int]) -> tuple[float, float]:
    """``last`` rate minus ``first`` rate, each given as ``(hits, total)``, and the
    difference's standard error for two independent samples,
    ``sqrt(p(1-p)/n + q(1-q)/m)`` (NaN, NaN when either sample is empty)."""
    (a, n), (b, m) = first, last
    if not n or not m:
        return math.nan, math.nan
    p, q = a / n, b / m
    return q - p, math.sqrt(p * (1 - p) / n + q * (1 - q) / m)


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


@dataclass(frozen=True)
class TrajectoryStats:
    """The per-trajectory figures of a set of trajectories, as totals.

    One aggregation for every reader: the training metrics
    (:func:`retool.rollout.rollout_metrics`: ``reward/correct``, ``rollout/code_calls``,
    ``rollout/valid_tool_call_rate``, …), the eval summary (:func:`retool.results.summarize`:
    ``format``, ``code_calls``, ``turns``, …) and ``retool compare`` all read these
    fields and the means below. Totals add up: ``a + b`` is the record of both sets, so
    an eval keeps one small record per problem instead of its trajectories.
    """

    trajectories: int = 0
    correct: int = 0
    formatted: int = 0
    reward: float = 0.0
    """Sum of the rewards (:func:`math.fsum`)."""
    grader_errors: int = 0
    turns: int = 0
    tool_call_attempts: int = 0
    """Every call attempt, invalid and over-budget ones included."""
    valid_tool_calls: int = 0
    """Attempts that parsed and named the tool (run or answered "budget spent")."""
    code_calls: int = 0
    """Calls that ran in the sandbox (:attr:`Trajectory.num_code_calls`)."""
    name_error_calls: int = 0
    """Calls that ran and failed with ``NameError`` — with the stateless interpreter, mostly
    code that assumed a variable of an earlier call still exists."""
    state_lost_calls: int = 0
    """Calls of the stateful interpreter that ran in a fresh one (the earlier one timed
    out, ran out of memory, ...; :attr:`ExecutionResult.state_lost`)."""
    used_tool: int = 0
    """Trajectories with at least one call that ran."""
    tokens: int = 0
    """Whole contexts, prompt included (as the trajectory budget counts them)."""
    sampled_tokens: int = 0
    """Policy tokens (mask sum)."""
    code_lines: int = 0
    """Non-blank code lines of the valid calls."""
    ok_calls: int = 0
    """Calls that ran without an error (status ``ok``)."""
    first_call_position: float = 0.0
    """Sum over trajectories with a call that ran of where the first one ends, as a
    fraction of the trajectory's sampled tokens (:func:`first_call_position`)."""
    self_corrections: int = 0
    """Calls that ran without error right after a call that failed or was invalid."""
    invalid_calls: dict[str, int] = field(default_factory=dict)
    """Invalid call attempts by reason, in order of first appearance."""
    stop_reasons: dict[str, int] = field(default_factory=dict)
    """Trajectories by stop reason, in order of first appearance."""

    def __add__(self, other: TrajectoryStats) -> TrajectoryStats:
        sums = {f.name: getattr(self, f.name) + getattr(other, f.name)
                for f in fields(self) if f.name not in ("invalid_calls", "stop_reasons")}
        return TrajectoryStats(**sums, invalid_calls=_add_counts(self.invalid_calls, other.invalid_calls),
                               stop_reasons=_add_counts(self.stop_reasons, other.stop_reasons))

    @property
    def correct_rate(self) -> float:
        return self.correct / self.trajectories

    @property
    def format_rate(self) -> float:
        return self.formatted / self.trajectories

    @property
    def reward_mean(self) -> float:
        return self.reward / self.trajectories

    @property
    def turns_mean(self) -> float:
        return self.turns / self.trajectories

    @property
    def code_calls_mean(self) -> float:
        return self.code_calls / self.trajectories

    @property
    def tool_call_attempts_mean(self) -> float:
        return self.tool_call_attempts / self.trajectories

    @property
    def used_tool_rate(self) -> float:
        return self.used_tool / self.trajectories

    @property
    def tokens_mean(self) -> float:
        return self.tokens / self.trajectories

    @property
    def sampled_tokens_mean(self) -> float:
        return self.sampled_tokens / self.trajectories

    @property
    def valid_tool_call_rate(self) -> float:
        """Valid calls over call attempts, pooled; 1.0 when nothing was attempted."""
        return self.valid_tool_calls / self.tool_call_attempts if self.tool_call_attempts else 1.0

    @property
    def name_error_rate(self) -> float:
        """Share of the calls that ran that failed with ``NameError``; 0.0 without calls."""
        return self.name_error_calls / self.code_calls if self.code_calls else 0.0

    @property
    def budget_exhausted_calls(self) -> int:
        """Valid calls answered "budget spent" instead of running."""
        return self.valid_tool_calls - self.code_calls


def trajectory_stats(trajectories: Iterable[Trajectory]) -> TrajectoryStats:
    """The totals of :class:`TrajectoryStats` over ``trajectories`` (all zero for none)."""
    trajectories = list(trajectories)
    attempts = [turn.exchange.call for t in trajectories for turn in t.turns if turn.exchange is not None]
    results = [turn.exchange.result for t in trajectories for turn in t.turns
               if turn.exchange is not None and turn.exchange.result is not None]
    return TrajectoryStats(
        trajectories=len(trajectories),
        correct=sum(t.grade.correct for t in trajectories),
        formatted=sum(t.grade.formatted for t in trajectories),
        reward=math.fsum(t.grade.reward for t in trajectories),
        grader_errors=sum(t.grade.grader_error is not None for t in trajectories),
        turns=sum(len(t.turns) for t in trajectories),
        tool_call_attempts=len(attempts),
        valid_tool_calls=sum(isinstance(call, ToolCall) for call in attempts),
        code_calls=sum(t.num_code_calls for t in trajectories),
        name_error_calls=sum(map(is_name_error, results)),
        state_lost_calls=sum(r.state_lost is not None for r in results),
        used_tool=sum(t.num_code_calls > 0 for t in trajectories),
        tokens=sum(len(t.tokens_T) for t in trajectories),
        sampled_tokens=sum(sum(t.mask_T) for t in trajectories),
        code_lines=sum(code_lines(call.code) for call in attempts if isinstance(call, ToolCall)),
        ok_calls=sum(r.ok for r in results),
        first_call_position=math.fsum(p for p in map(first_call_position, trajectories) if p is not None),
        self_corrections=sum(map(self_corrections, trajectories)),
        invalid_calls=dict(Counter(call.reason for call in attempts if isinstance(call, InvalidToolCall))),
        stop_reasons=dict(Counter(t.stop_reason.value for t in trajectories)),
    )


# ---------------------------------------------------------------- the paper's behaviour figures


def code_lines(code: str) -> int:
    """Non-blank lines of a snippet."""
    return sum(1 for line in code.splitlines() if line.strip())


def first_call_position(trajectory: Trajectory) -> float | None:
    """Where the first call that ran ends, as a fraction of the trajectory's sampled
    tokens (the call closes its turn, so: the sampled tokens up to and including that
    turn over all sampled tokens); ``None`` without such a call."""
    total = sum(turn.num_tokens for turn in trajectory.turns)
    done = 0
    for turn in trajectory.turns:
        done += turn.num_tokens
        if turn.exchange is not None and turn.exchange.result is not None:
            return done / total if total else 0.0
    return None


def self_corrections(trajectory: Trajectory) -> int:
    """Calls that ran without error right after a call that failed (ran with an error,
    timed out, ...) or was invalid: code that fixes an earlier failed call."""
    exchanges = [turn.exchange for turn in trajectory.turns if turn.exchange is not None]
    failed = [e.result is None or not e.result.ok for e in exchanges]
    return sum(1 for i in range(1, len(exchanges)) if failed[i - 1] and exchanges[i].result is not None
               and exchanges[i].result.ok)


BEHAVIOUR_FIGURES: dict[str, tuple[str, str]] = {
    "response_tokens": ("sampled_tokens", "trajectories"),
    "call_rate": ("used_tool", "trajectories"),
    "code_lines_per_call": ("code_lines", "valid_tool_calls"),
    "call_success_rate": ("ok_calls", "code_calls"),
    "first_call_position": ("first_call_position", "used_tool"),
    "self_corrections": ("self_corrections", "trajectories"),
}
"""The ReTool paper's behaviour analyses as pooled ratios of :class:`TrajectoryStats`
totals, ``name: (numerator, denominator)``: response length (sampled tokens only),
share of trajectories with a call that ran, code lines per valid call, share of calls
that ran without error, where the first call ends (fraction of the response), and
self-corrections per trajectory."""

COUNT_FIGURES = ("response_tokens", "code_lines_per_call", "self_corrections")
"""Behaviour figures that are counts (the others are shares)."""


def behaviour_figures(stats: TrajectoryStats) -> dict[str, float]:
    """Each :data:`BEHAVIOUR_FIGURES` ratio of ``stats``; a figure whose denominator is 0
    (no calls, say) is left out."""
    return {name: getattr(stats, num) / getattr(stats, den)
            for name, (num, den) in BEHAVIOUR_FIGURES.items() if getattr(stats, den)}


def is_name_error(result: ExecutionResult) -> bool:
    """Whether a call failed with an uncaught ``NameError`` (the last line of its traceback)."""
    lines = result.stderr.strip().splitlines()
    return result.status is ExecStatus.ERROR and bool(lines) and lines[-1].startswith("NameError: ")


def _add_counts(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    out = dict(a)
    for key, count in b.items():
        out[key] = out.get(key, 0) + count
    return out


def check_counts(counts: Sequence[tuple[int, int]]) -> None:
    """Raise ``ValueError`` for no problems or a problem's impossible ``(n, c)``."""
    if not counts:
        raise ValueError("no problems to summarise")
    for n, c in counts:
        if n < 1 or not 0 <= c <= n:
            raise ValueError(f"bad per-problem counts: {n} samples, {c} correct")
