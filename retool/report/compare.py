"""``retool compare BEFORE AFTER``: did training help, beyond the noise?

Reads two eval results files of the same problems (e.g. the SFT checkpoint and the RL
checkpoint, written by ``retool eval``) and prints, per metric, both values, their
difference and the *paired* standard error of the difference
(:func:`retool.stats.paired_difference`: per-problem ``after - before``, so the
difficulty of each problem, which both evals share, cancels). A difference larger than
two standard errors is flagged as significant.

Per-problem metrics (paired s.e.): accuracy (Average@k), format (boxed answers), used
the tool (share of samples with at least one executed call), code calls per sample,
tokens per sample (whole context, prompt included).
Pooled metrics: valid tool-call rate (calls that parsed and named the tool, over all call
attempts), as the training metric ``rollout/valid_tool_call_rate`` defines it (both read
:class:`retool.stats.TrajectoryStats`), and the NameError rate (executed calls that
failed with ``NameError`` — e.g. code relying on an earlier call's variables under the
stateless interpreter — over executed calls, ``rollout/name_error_rate``), each with a
paired, problem-clustered s.e. (:func:`retool.stats.paired_ratio_difference`; none when
a side has no denominator); so are the ReTool paper's behaviour figures
(:data:`retool.stats.BEHAVIOUR_FIGURES`: response tokens — sampled tokens only —, code
lines per call, share of calls that ran without error, position of the first call as a
fraction of the response, self-corrections per sample), as ``behaviour/*`` in training;
a figure one side has no denominator for (a text-mode eval makes no calls) is left out.

Two evals of different problem sets (another dataset fingerprint, a problem whose question
or answer differs, or, between two finished evals, a problem only one has) or with different
samples per problem (``val_n``) are refused with what differs. Different models, modes and
sampling or sandbox settings are legitimate — tool vs text on the same problems is the
central comparison — and each difference is printed above the table
(:data:`retool.results.COMPARED_SETTINGS`). Interrupted evals (no summary line yet) are
compared on the problems both finished; how many were left out is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from retool.report import ReportInputError, read_eval_results
from retool.results import COMPARED_SETTINGS, EvalResults, ProblemResult
from retool.stats import (
    BEHAVIOUR_FIGURES,
    COUNT_FIGURES,
    TrajectoryStats,
    paired_difference,
    paired_ratio_difference,
    trajectory_stats,
)

PAIRED_METRICS = {"accuracy": "correct_rate", "format": "format_rate", "used_tool": "used_tool_rate",
                  "code_calls": "code_calls_mean", "tokens": "tokens_mean"}
"""Per-problem metric → the :class:`~retool.stats.TrajectoryStats` figure it compares."""


@dataclass(frozen=True)
class MetricComparison:
    """One metric of two evals: values, difference, paired s.e. (``None`` when there is none)."""

    name: str
    before: float
    after: float
    stderr: float | None

    @property
    def difference(self) -> float:
        return self.after - self.before

    @property
    def z(self) -> float | None:
        """Difference over its standard error (``None`` without one or when it is 0)."""
        if not self.stderr:
            return None
        return self.difference / self.stderr

    @property
    def significant(self) -> bool:
        """Whether the difference exceeds two standard errors."""
        return self.z is not None and abs(self.z) > 2


@dataclass(frozen=True)
class Comparison:
    """The comparison of two eval files on their common problems."""

    before: Path
    after: Path
    problems: int
    only_before: int
    only_after: int
    metrics: tuple[MetricComparison, ...]
    differences: tuple[tuple[str, object, object], ...] = ()
    """``(setting, before, after)`` for each legitimate difference of the two evals' settings."""

    def metric(self, name: str) -> MetricComparison:
        return next(m for m in self.metrics if m.name == name)


def compare(before_path: str | Path, after_path: str | Path) -> Comparison:
    """Compare two eval results files; raises :class:`ReportInputError` on bad input."""
    before, after = read_eval_results(before_path), read_eval_results(after_path)
    problems_before = {p.problem_id: p for p in before.problems}
    problems_after = {p.problem_id: p for p in after.problems}
    common = [pid for pid in problems_before if pid in problems_after]
    _refuse_different_problems(before, after, common)
    if not common:
        raise ReportInputError(f"{before_path} and {after_path} share no problem")
    stats_before = [_stats(problems_before[pid]) for pid in common]
    stats_after = [_stats(problems_after[pid]) for pid in common]
    metrics = [_paired(name, figure, stats_before, stats_after) for name, figure in PAIRED_METRICS.items()]
    metrics.append(_valid_tool_call_rate(stats_before, stats_after))
    metrics.append(_name_error_rate(stats_before, stats_after))
    pooled = [_pooled(name, num, den, stats_before, stats_after)
              for name, (num, den) in BEHAVIOUR_FIGURES.items() if name not in BEHAVIOUR_SHOWN_ELSEWHERE]
    metrics += [m for m in pooled if m is not None]
    return Comparison(Path(before_path), Path(after_path), len(common), len(problems_before) - len(common),
                      len(problems_after) - len(common), tuple(metrics),
                      tuple(before.header.changed(after.header, COMPARED_SETTINGS)))


def _refuse_different_problems(before: EvalResults, after: EvalResults, common: list[str]) -> None:
    """Raise :class:`ReportInputError` saying what differs when the two evals do not pair up:
    another problem set or another number of samples per problem."""
    what = f"{before.path} and {after.path}"
    hb, ha = before.header, after.header
    if hb.dataset_fingerprint and ha.dataset_fingerprint and hb.dataset_fingerprint != ha.dataset_fingerprint:
        raise ReportInputError(f"{what} evaluate different problem sets (dataset {hb.dataset} "
                               f"{hb.dataset_fingerprint[:12]}, {hb.dataset_problems} problems vs {ha.dataset} "
                               f"{ha.dataset_fingerprint[:12]}, {ha.dataset_problems} problems); compare evals "
                               "of the same dataset")
    by_id_before = {p.problem_id: p for p in before.problems}
    by_id_after = {p.problem_id: p for p in after.problems}
    for pid in common:
        pb, pa = by_id_before[pid], by_id_after[pid]
        if (pb.question, pb.answer) != (pa.question, pa.answer):
            field = "question" if pb.question != pa.question else "answer"
            raise ReportInputError(f"{what} evaluate different problem sets: problem {pid!r} has another "
                                   f"{field} in each; compare evals of the same dataset")
    only = by_id_before.keys() ^ by_id_after.keys()
    if before.summary is not None and after.summary is not None and only:
        raise ReportInputError(f"{what} evaluate different problem sets: {len(only)} problem(s) in only one "
                               f"of them (e.g. {sorted(only)[0]!r}); compare evals of the same dataset")
    if hb.val_n is not None and ha.val_n is not None and hb.val_n != ha.val_n:
        raise ReportInputError(f"{what} draw different numbers of samples per problem (val_n {hb.val_n} vs "
                               f"{ha.val_n}); compare evals run with the same --val-n")
    for pid in common:
        nb, na = len(by_id_before[pid].samples), len(by_id_after[pid].samples)
        if nb != na:
            raise ReportInputError(f"{what} draw different numbers of samples per problem ({nb} vs {na} "
                                   f"for {pid!r}); compare evals run with the same --val-n")


def _stats(problem: ProblemResult) -> TrajectoryStats:
    if not problem.samples:
        raise ReportInputError(f"problem {problem.problem_id!r} has no samples")
    return trajectory_stats(problem.samples)


def _paired(name: str, figure: str, before: list[TrajectoryStats], after: list[TrajectoryStats]) -> MetricComparison:
    a, b = [getattr(s, figure) for s in before], [getattr(s, figure) for s in after]
    _, stderr = paired_difference(a, b)
    return MetricComparison(name, sum(a) / len(a), sum(b) / len(b), stderr)


def _valid_tool_call_rate(before: list[TrajectoryStats], after: list[TrajectoryStats]) -> MetricComparison:
    """Pooled over every sample, as the training metric of the same name."""
    rates = [sum(side, TrajectoryStats()).valid_tool_call_rate for side in (before, after)]
    try:
        _, stderr = paired_ratio_difference([(s.valid_tool_calls, s.tool_call_attempts) for s in before],
                                            [(s.valid_tool_calls, s.tool_call_attempts) for s in after])
    except ValueError:  # a side made no call attempt: its rate is 1.0 by definition
        stderr = None
    return MetricComparison("valid_tool_call_rate", rates[0], rates[1], stderr)


def _name_error_rate(before: list[TrajectoryStats], after: list[TrajectoryStats]) -> MetricComparison:
    """Pooled over every executed call, as the training metric ``rollout/name_error_rate``."""
    rates = [sum(side, TrajectoryStats()).name_error_rate for side in (before, after)]
    try:
        _, stderr = paired_ratio_difference([(s.name_error_calls, s.code_calls) for s in before],
                                            [(s.name_error_calls, s.code_calls) for s in after])
    except ValueError:  # a side ran no code
        stderr = None
    return MetricComparison("name_error_rate", rates[0], rates[1], stderr)


def _pooled(name: str, num: str, den: str, before: list[TrajectoryStats],
            after: list[TrajectoryStats]) -> MetricComparison | None:
    """A behaviour figure pooled over every sample, as the training metric ``behaviour/<name>``;
    ``None`` (left out of the table) when a side has no denominator (no calls, say)."""
    totals = [sum(side, TrajectoryStats()) for side in (before, after)]
    if not all(getattr(t, den) for t in totals):
        return None
    _, stderr = paired_ratio_difference([(getattr(s, num), getattr(s, den)) for s in before],
                                        [(getattr(s, num), getattr(s, den)) for s in after])
    return MetricComparison(name, *(getattr(t, num) / getattr(t, den) for t in totals), stderr)


BEHAVIOUR_SHOWN_ELSEWHERE = ("call_rate",)
"""Behaviour figures the table has under another name (``used_tool``)."""

COUNT_METRICS = ("code_calls", "tokens", *COUNT_FIGURES)
"""Metrics shown as numbers (the others are shares, shown in %)."""


def format_table(result: Comparison) -> str:
    """A Markdown table of the comparison (pasteable into docs)."""
    lines = ["| metric | before | after | difference | paired s.e. | z | > 2 s.e. |",
             "|---|---|---|---|---|---|---|"]
    for m in result.metrics:
        pct = m.name not in COUNT_METRICS
        fmt = (lambda x: f"{100 * x:.1f}%") if pct else (lambda x: f"{x:.2f}")
        diff = f"{100 * m.difference:+.1f} pts" if pct else f"{m.difference:+.2f}"
        se = "—" if m.stderr is None else (f"{100 * m.stderr:.1f} pts" if pct else f"{m.stderr:.2f}")
        z = "—" if m.z is None else f"{m.z:+.2f}"
        lines.append(f"| {m.name} | {fmt(m.before)} | {fmt(m.after)} | {diff} | {se} | {z} | "
                     f"{'yes' if m.significant else 'no'} |")
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compare",
        description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("before", type=Path, help="eval results file of the earlier model (e.g. after SFT)")
    p.add_argument("after", type=Path, help="eval results file of the later model (e.g. after RL)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON instead of a table")
    p.set_defaults(func=_run_compare)


def _run_compare(args: argparse.Namespace) -> int:
    try:
        result = compare(args.before, args.after)
    except ReportInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"before": str(result.before), "after": str(result.after), "problems": result.problems,
                          "differences": {key: {"before": b, "after": a} for key, b, a in result.differences},
                          "metrics": {m.name: {"before": m.before, "after": m.after, "difference": m.difference,
                                               "stderr": m.stderr, "z": m.z, "significant": m.significant}
                                      for m in result.metrics}}, indent=2))
        return 0
    print(f"{result.before} -> {result.after}: {result.problems} common problems"
          + (f" ({result.only_before} only before, {result.only_after} only after)"
             if result.only_before or result.only_after else ""))
    for key, before, after in result.differences:
        print(f"differs: {key}: {before!r} before, {after!r} after")
    print(format_table(result))
    return 0
