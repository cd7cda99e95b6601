"""``retool regrade``: grade every recorded final answer again with the current grader.

After a ``math_verify`` upgrade, a change of :mod:`retool.reward` or a fixed gold answer,
what was sampled need not be sampled again: every trajectory keeps the text that was
graded. Two sources:

- an eval results file (``retool regrade RESULTS.jsonl [--output NEW.jsonl]``): the golds
  are the file's own ``answer``s, or those of ``--data`` (a fixed data file, matched by
  problem id); the new file has the same format, each sample carrying its new grade, the
  summary recomputed (only when the original had one) and the header's ``regraded_from``
  naming the original. Default output: ``NAME.regraded.jsonl`` beside it.
- a run folder (``retool regrade RUN_DIR [--train-data PATH] [--output-dir DIR]``): every
  ``trajectories/step_NNNNNN.jsonl.gz`` is graded again against the run's data file
  (``config.json``'s ``train_data``, or ``--train-data``) and copied to
  ``RUN_DIR/regraded/`` (or ``--output-dir``) with the rows' ``trajectory.grade`` replaced,
  ``original_grade`` and ``regraded_from`` added. ``advantage`` stays what training used.

The original files are only read; outputs are written atomically (:mod:`retool.atomic`),
so a failure leaves an earlier output as it was. What changed is printed: each verdict
flip (correct / incorrect / no answer / grader error), and the correct and formatted counts
and Average@k (the mean over problems — over groups, for a run — of the share correct)
before and after.

The graded text is the one the rollout graded (:func:`final_text`): the last turn's
text. One case the record leaves ambiguous: a trajectory that ended on its budget right
after a tool call. The rollout graded that turn's text when the tool message did not fit
and an empty text otherwise; here the turn's text is graded when the recorded grade found
an answer in it, and the empty text when it did not (so a trajectory that had no answer
keeps none).

Not covered: new rewards for training (advantages are not recomputed), answers graded
against anything but the recorded final text, editing files in place.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from retool.atomic import atomic_open
from retool.data import DataError, problems_fingerprint, read_problems
from retool.flag_checks import UnwritableOutputError, output_file, output_folder
from retool.grader_pool import GraderPool
from retool.results import ProblemResult, ResultsFileError, is_results_file, read_results, summarize
from retool.reward import GoldAnswerError, try_grade_many
from retool.runs import data_fingerprint
from retool.trajectory_log import TrajectoryLogError, TrajectoryLogRow, read_trajectory_log, write_trajectory_log
from retool.types import Grade, Trajectory


class RegradeError(ValueError):
    """An input or output regrade cannot use; the message is the one line the user sees."""


@dataclass(frozen=True)
class Regraded:
    """One trajectory graded again: where it sits, its old and its new grade."""

    where: str
    """``problem P #K`` (eval sample K, 0-based) or ``step S · group G · #K`` (run row)."""
    group: str
    """What Average@k averages over: the problem (eval) or the step's group (run)."""
    before: Grade
    after: Grade
    gold: str = ""
    """The gold answer graded against now."""

    @property
    def flipped(self) -> bool:
        return verdict(self.before) != verdict(self.after)


@dataclass(frozen=True)
class RegradeReport:
    """What one regrade did: its input, what it wrote, and every trajectory's two grades."""

    source: Path
    written: tuple[Path, ...]
    items: tuple[Regraded, ...]
    notes: tuple[str, ...] = ()

    @property
    def flips(self) -> list[Regraded]:
        return [item for item in self.items if item.flipped]

    def count(self, which: str, attr: str) -> int:
        return sum(bool(getattr(getattr(item, which), attr)) for item in self.items)

    def average(self, which: str) -> float:
        """Average@k: the mean over groups of the share of correct trajectories."""
        groups: dict[str, list[bool]] = {}
        for item in self.items:
            groups.setdefault(item.group, []).append(getattr(item, which).correct)
        return sum(sum(v) / len(v) for v in groups.values()) / len(groups) if groups else 0.0


@dataclass(frozen=True)
class Golds:
    """The gold answers of a data file, by problem id, and what an eval header records of it."""

    path: str
    answers: dict[str, str]
    fingerprint: str
    """:func:`retool.data.problems_fingerprint` of the whole file."""


def verdict(grade: Grade) -> str:
    """``correct``, ``incorrect``, ``no answer`` or ``grader error``."""
    if grade.correct:
        return "correct"
    if not grade.formatted:
        return "no answer"
    return "grader error" if grade.grader_error else "incorrect"


def final_text(trajectory: Trajectory) -> str:
    """The text the rollout graded (:mod:`retool.rollout`): the last turn's, with the one
    ambiguous case resolved as the module docstring says."""
    if not trajectory.turns:
        return ""
    last = trajectory.turns[-1]
    if last.exchange is None or trajectory.grade.answer is not None:
        return last.text
    return ""


def grade_again(trajectories: Sequence[Trajectory], golds: Sequence[str], where: Sequence[str],
                pool=None) -> list[Grade]:
    """The current grader's grade of each trajectory's final text against its gold."""
    outcomes = try_grade_many([final_text(t) for t in trajectories], list(golds), pool=pool)
    for outcome, place in zip(outcomes, where):
        if isinstance(outcome, GoldAnswerError):
            raise RegradeError(f"{place}: {outcome}")
    return outcomes  # type: ignore[return-value]


# ---------------------------------------------------------------- eval results files


def regrade_results(source: Path, output: Path, golds: Golds | None = None, pool=None) -> RegradeReport:
    """Grade an eval results file again into ``output`` (see the module docstring); with
    ``golds``, the header names that data file (path, fingerprint, problem count)."""
    try:
        results = read_results(source)
    except ResultsFileError as err:
        raise RegradeError(str(err)) from None
    if not results.problems:
        raise RegradeError(f"{source} holds no finished problem to grade again")
    answers = {p.problem_id: _gold(golds, p.problem_id, p.answer) for p in results.problems}
    flat = [(p, n, t) for p in results.problems for n, t in enumerate(p.samples)]
    where = [f"problem {p.problem_id} #{n}" for p, n, _ in flat]
    grades = iter(grade_again([t for _, _, t in flat], [answers[p.problem_id] for p, _, _ in flat], where, pool))
    problems = [dataclasses.replace(p, answer=answers[p.problem_id],
                                    samples=tuple(dataclasses.replace(t, grade=next(grades)) for t in p.samples))
                for p in results.problems]
    header = dataclasses.replace(results.header, regraded_from=str(source.resolve()))
    if golds is not None:
        header = dataclasses.replace(header, dataset_path=golds.path, dataset_fingerprint=golds.fingerprint,
                                     dataset_problems=len(golds.answers))
    rows = [header.to_json(), *(p.to_json() for p in problems)]
    if results.summary is not None:
        rows.append(summarize([p.samples for p in _dataset_order(problems)]).to_json())
    _write_jsonl(output, rows)
    items = [Regraded(w, p.problem_id, old.grade, new.grade, answers[p.problem_id])
             for w, (p, n, old), new in zip(where, flat, (t for p in problems for t in p.samples))]
    return RegradeReport(source, (output,), tuple(items))


def _dataset_order(problems: list[ProblemResult]) -> list[ProblemResult]:
    return sorted(problems, key=lambda p: (p.index is None, p.index or 0))


def _gold(golds: Golds | None, problem_id: str, recorded: str) -> str:
    if golds is None:
        return recorded
    if problem_id not in golds.answers:
        raise RegradeError(f"problem {problem_id!r} is not in {golds.path}: pass the data the answers were sampled for")
    return golds.answers[problem_id]


# ---------------------------------------------------------------- run folders


def regrade_run(run_dir: Path, output_dir: Path, data: str | None = None, pool=None) -> RegradeReport:
    """Grade every saved trajectory file of a run again into ``output_dir``."""
    files = sorted((run_dir / "trajectories").glob("step_*.jsonl.gz"))
    if not files:
        raise RegradeError(f"{run_dir} holds no trajectories/step_*.jsonl.gz (was it trained with --save-trajectories?)")
    if output_dir.resolve() == (run_dir / "trajectories").resolve():
        raise RegradeError(f"--output-dir {output_dir} is the run's own trajectories folder: choose another")
    data, notes = _run_data(run_dir, data)
    golds = _read_golds(data)
    staged = [_regrade_file(path, golds, pool) for path in files]
    output_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path, (rows, _) in zip(files, staged):
        written.append(output_dir / path.name)
        try:
            write_trajectory_log(written[-1], rows)
        except OSError as err:
            raise RegradeError(f"cannot write {written[-1]}: {err}") from None
    items = tuple(item for _, found in staged for item in found)
    return RegradeReport(run_dir, tuple(written), items, tuple(notes))


def _run_data(run_dir: Path, data: str | None) -> tuple[str, list[str]]:
    """The data file to take golds from, and a note when it changed since the run."""
    config_path = run_dir / "config.json"
    config = _json_file(config_path) if config_path.is_file() else {}
    if data is not None:
        return data, []
    if not config.get("train_data"):
        raise RegradeError(f"{run_dir}: no config.json naming train_data; pass --train-data PATH")
    data, notes = str(config["train_data"]), []
    record = run_dir / "train_data.json"
    if record.is_file() and Path(data).is_file():
        if _json_file(record).get("sha256") != data_fingerprint(Path(data))["sha256"]:
            notes.append(f"note: {data} changed since the run started (its sha256 differs from train_data.json)")
    return data, notes


def _json_file(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise RegradeError(f"{path}: unreadable: {err}") from None
    if not isinstance(value, dict):
        raise RegradeError(f"{path}: expected a JSON object")
    return value


def _read_golds(data: str) -> Golds:
    try:
        found = read_problems(data)
        return Golds(str(found.path), {p.id: p.answer for p in found.problems}, problems_fingerprint(found.problems))
    except (DataError, OSError) as err:
        raise RegradeError(f"gold answers from {data}: {err}") from None


def _regrade_file(path: Path, golds: Golds, pool) -> tuple[list[TrajectoryLogRow], list[Regraded]]:
    try:
        rows = read_trajectory_log(path)
    except TrajectoryLogError as err:
        raise RegradeError(str(err)) from None
    answers = [_gold(golds, r.trajectory.problem_id, "") for r in rows]
    grades = grade_again([r.trajectory for r in rows], answers, [r.where for r in rows], pool)
    out = [dataclasses.replace(r, trajectory=dataclasses.replace(r.trajectory, grade=g),
                               original_grade=r.trajectory.grade, regraded_from=str(path.resolve()))
           for r, g in zip(rows, grades)]
    items = [Regraded(f"{r.where} (problem {r.trajectory.problem_id})", f"{r.step}/{r.group}", r.trajectory.grade,
                      g, gold) for r, g, gold in zip(rows, grades, answers)]
    return out, items


# ---------------------------------------------------------------- writing and printing


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(path, "wb", compress=path.name.endswith(".gz")) as f:
            for row in rows:
                f.write((json.dumps(row) + "\n").encode())
    except OSError as err:
        raise RegradeError(f"cannot write {path}: {err}") from None


def print_report(report: RegradeReport, out=None) -> None:
    """What changed: each verdict flip, then counts and Average@k before → after."""
    out = out or sys.stdout
    for note in report.notes:
        print(note, file=out)
    flips = report.flips
    print(f"graded {len(report.items)} trajectories of {report.source} again; wrote "
          + ", ".join(map(str, report.written[:3])) + (" …" if len(report.written) > 3 else ""), file=out)
    print(f"verdict flips: {len(flips)}", file=out)
    for item in flips:
        print(f"  {item.where}: {verdict(item.before)} → {verdict(item.after)} "
              f"(answer {item.before.answer!r} → {item.after.answer!r}, gold {item.gold!r})", file=out)
    for name, attr in (("correct", "correct"), ("formatted", "formatted")):
        print(f"{name}: {report.count('before', attr)} → {report.count('after', attr)}", file=out)
    print(f"Average@k: {report.average('before'):.4f} → {report.average('after'):.4f}", file=out)


def register(subparsers) -> None:
    """Add ``retool regrade``."""
    parser = subparsers.add_parser(
        "regrade",
        description="Grade every recorded final answer of an eval results file or of a run's saved "
                    "trajectories again with the current grader, write the result to a NEW file (the "
                    "original is never changed) and print what changed.")
    parser.add_argument("source", type=Path, metavar="RESULTS_OR_RUN_DIR",
                        help="an eval results file (retool eval) or a run folder with trajectories/")
    parser.add_argument("--output", type=Path, help="eval: the new results file (default: NAME.regraded.jsonl)")
    parser.add_argument("--output-dir", type=Path, help="run: the folder of regraded copies (default: RUN_DIR/regraded)")
    parser.add_argument("--train-data", "--data", dest="data", metavar="PATH",
                        help="take the gold answers from this data file (by problem id) instead of the "
                             "run's train_data / the eval file's own answers")
    parser.set_defaults(func=_run)


def default_output(source: Path) -> Path:
    """``X.jsonl[.gz]`` → ``X.regraded.jsonl[.gz]`` beside it."""
    name = source.name
    for suffix in (".jsonl.gz", ".jsonl"):
        if name.endswith(suffix):
            return source.with_name(name[: -len(suffix)] + ".regraded" + suffix)
    return source.with_name(name + ".regraded.jsonl")


def _run(args: argparse.Namespace) -> int:
    try:
        report = _regrade(args)
    except (RegradeError, UnwritableOutputError) as err:
        print(f"retool regrade: error: {err}", file=sys.stderr)
        return 2
    print_report(report)
    return 0


def _regrade(args: argparse.Namespace) -> RegradeReport:
    source: Path = args.source
    if source.is_dir():
        if args.output is not None:
            raise RegradeError("--output is for an eval results file; a run folder takes --output-dir")
        output_dir = args.output_dir or source / "regraded"
        output_folder(output_dir, "--output-dir")
        with GraderPool() as pool:
            return regrade_run(source, output_dir, args.data, pool)
    if not source.is_file():
        raise RegradeError(f"{source}: no such file or folder")
    if args.output_dir is not None:
        raise RegradeError("--output-dir is for a run folder; an eval results file takes --output")
    if not is_results_file(source):
        raise RegradeError(f"{source} is not an eval results file (its first line is not a header)")
    output = args.output or default_output(source)
    if output.resolve() == source.resolve():
        raise RegradeError(f"--output {output} is the original file: regrade never changes it; choose another")
    output_file(output, "--output")
    golds = _read_golds(args.data) if args.data else None
    with GraderPool() as pool:
        return regrade_results(source, output, golds, pool)
