"""Eval results files: typed records, the one reader and the one appender.

A results file (``docs/formats.md``) is JSON Lines, written by ``retool eval``:

1. a header (:class:`ResultsHeader`) — what was evaluated and how: model, checkpoint,
   step, label, dataset and its fingerprint, mode, ``val_n``, seed, sampling and
   sandbox settings;
2. one line per finished problem (:class:`ProblemResult`), in completion order — every
   sample's full trajectory (:class:`~retool.types.Trajectory`), appended, flushed and
   fsynced as the problem finishes;
3. a summary line (:class:`EvalSummary`) once every problem is done — Average@k and its
   standard error, Pass@k, unbiased pass@k', Format, and the means of
   :class:`~retool.stats.TrajectoryStats` (code calls, turns, tokens, …).

Each record's ``to_json``/``from_json`` keeps the file's keys as they are. The reader
(:func:`read_results`, :func:`iter_results`) is shared by ``retool eval`` (resume),
``retool compare``, ``retool plot``, ``retool view`` and the demo; a damaged line raises
:class:`ResultsFileError` naming the file and the line. Lines are read by the one JSON
Lines reader (:mod:`retool.jsonl`): a last line cut off by a kill is dropped with a
warning on stderr. The appender
(:class:`ResultsFile`) resumes a file only when its header matches the run's, cuts the
torn line and the old summary, and keeps one :class:`~retool.stats.TrajectoryStats`
per finished problem — not its trajectories — so a large eval's summary costs little
memory.

Not covered: sampling (``retool.evaluate``), the statistics themselves
(:mod:`retool.stats`), training logs (``metrics.jsonl``, trajectory logs), and
rewriting or merging results files.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retool.config import ConfigError
from retool.jsonl import JsonlError, iter_jsonl
from retool.serialize import to_jsonable, trajectory_from_jsonable
from retool.stats import (
    TrajectoryStats,
    average_at_k,
    average_at_k_stderr,
    behaviour_figures,
    check_counts,
    pass_at_k_empirical,
    trajectory_stats,
    unbiased_pass_at_k,
)
from retool.types import Trajectory

MATCHED_HEADER_KEYS = ("model", "checkpoint", "step", "dataset_fingerprint", "mode", "val_n", "seed", "seeded",
                       "chat_template", "dtype", "sampling", "sandbox", "engine")
"""Header fields that must be equal for a run to resume (append to) an existing file."""
COMPARED_SETTINGS = ("model", "mode", "seed", "seeded", "seeding", "chat_template", "dtype", "sampling", "sandbox")
"""Header fields two evals that ``retool compare`` pairs may differ in (tool vs text on the same
problems is the central comparison); each difference is printed above the table. The problem
set and the samples per problem (``val_n``) must be equal instead."""


class ResultsFileError(ValueError):
    """A results file that cannot be read as one (with the file and, where known, the line)."""


# ---------------------------------------------------------------- the header


@dataclass(frozen=True)
class SamplingSettings:
    """The header's ``sampling``: how every sample was drawn, and its budgets."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_trajectory_tokens: int | None = None
    max_turn_tokens: int | None = None
    max_assistant_turns: int | None = None
    max_code_calls: int | None = None
    max_tool_response_tokens: int | None = None


@dataclass(frozen=True)
class SandboxSettings:
    """The header's ``sandbox`` (retool mode): limits of one code execution."""

    timeout_s: float | None = None
    memory_mb: int | None = None
    interpreter: str | None = dataclasses.field(default=None, metadata={"omit_if_none": True})
    """``stateful`` when each trajectory had one interpreter session; left out (``None``)
    for the default stateless interpreter, so such files stay byte for byte the same."""


@dataclass(frozen=True)
class ResultsHeader:
    """The first line of a results file. Fields a file leaves out read as ``None``."""

    model: str | None = None
    checkpoint: str | None = None
    """The checkpoint folder, or ``None`` for the base model."""
    step: int | None = None
    label: str | None = None
    dataset: str | None = None
    dataset_path: str | None = None
    dataset_fingerprint: str | None = None
    """sha256 of every problem's id, question and answer, in file order."""
    dataset_problems: int | None = None
    mode: str | None = None
    val_n: int | None = None
    seed: int | None = None
    seeded: bool | None = None
    seeding: str | None = dataclasses.field(default=None, metadata={"omit_if_none": True})
    """How a seeded eval derived its request seeds: ``position`` (from the problem's seed and
    each request's place — the group fork, trajectory *i*'s turn *t* — as ``retool train``
    does). Left out for unseeded evals and for files written before it was recorded, whose
    requests were seeded from their context (``context``); a resumed file keeps its own."""
    chat_template: str | None = None
    dtype: str | None = None
    sampling: SamplingSettings | None = None
    sandbox: SandboxSettings | None = None
    """``None`` in text mode."""
    engine: str | None = None
    """The engine that sampled (``retool.engines``); files from before it was recorded: ``local``."""
    retool_version: str | None = None
    created: str | None = None
    regraded_from: str | None = dataclasses.field(default=None, metadata={"omit_if_none": True})
    """The results file this one was graded again from (``retool regrade``: absolute path);
    left out of the line otherwise, so files without it stay byte for byte the same."""

    @property
    def display_label(self) -> str:
        """The label, else ``base`` / ``step N`` from the step."""
        if self.label:
            return str(self.label)
        return "base" if self.step is None else f"step {self.step}"

    def to_json(self) -> dict:
        return {"type": "header", **_fields_of(self)}

    @classmethod
    def from_json(cls, row: Mapping) -> ResultsHeader:
        """Read a header row; raises ``ValueError`` for a step that is not an integer."""
        step = row.get("step")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise ValueError(f"header step must be an integer or null, got {step!r}")
        nested = {"sampling": SamplingSettings, "sandbox": SandboxSettings}
        values = {}
        for f in dataclasses.fields(cls):
            value = row.get(f.name)
            if f.name in nested and value is not None:
                value = _settings(nested[f.name], value)
            values[f.name] = value
        return cls(**values)

    def differences(self, other: ResultsHeader) -> list[str]:
        """``"key: file has X, this run has Y"`` for each resume-relevant field that differs."""
        return [f"{key}: file has {mine!r}, this run has {theirs!r}"
                for key, mine, theirs in self.changed(other, MATCHED_HEADER_KEYS)]

    def changed(self, other: ResultsHeader, keys: tuple[str, ...]) -> list[tuple[str, Any, Any]]:
        """``(key, mine, theirs)`` for each of ``keys`` that differs, nested settings as
        ``sampling.top_p``; a field one header leaves out reads ``"(not set)"``."""
        mine, theirs, missing = _flat(self, keys), _flat(other, keys), "(not set)"
        return [(key, mine.get(key, missing), theirs.get(key, missing))
                for key in sorted(mine.keys() | theirs.keys()) if mine.get(key, missing) != theirs.get(key, missing)]


def _fields_of(record: Any) -> dict:
    """A header record as a dict, nested settings too, without the ``omit_if_none`` fields
    that are ``None`` (so files written before such a field existed stay the same)."""
    out = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if f.metadata.get("omit_if_none") and value is None:
            continue
        out[f.name] = _fields_of(value) if dataclasses.is_dataclass(value) else value
    return out


def _settings(record: type, value: Mapping) -> Any:
    names = {f.name for f in dataclasses.fields(record)}
    return record(**{k: v for k, v in value.items() if k in names})


def _flat(header: ResultsHeader, keys: tuple[str, ...]) -> dict:
    """The fields ``keys``, nested settings as ``sampling.top_p`` (for readable differences)."""
    out = {}
    for key in keys:
        value = getattr(header, key)
        if key == "engine":
            value = value or "local"  # every file written before the engine was recorded
        if dataclasses.is_dataclass(value):
            nested = dataclasses.asdict(value)
            if isinstance(value, SandboxSettings) and value.interpreter is None:
                nested["interpreter"] = "stateless"  # the default, left out of the file
            out.update({f"{key}.{k}": v for k, v in nested.items()})
        else:
            out[key] = value
    return out


# ---------------------------------------------------------------- problem lines


@dataclass(frozen=True)
class ProblemResult:
    """One problem's line: the problem, its ``val_n`` trajectories, and how they were drawn."""

    problem_id: str
    question: str
    answer: str
    samples: tuple[Trajectory, ...]
    index: int | None = None
    """The problem's position in the dataset."""
    seed: int | None = None
    """The problem's derived sampling seed."""
    sampler_requests: int | None = None
    time_s: float | None = None

    @property
    def num_correct(self) -> int:
        return sum(t.grade.correct for t in self.samples)

    @property
    def num_formatted(self) -> int:
        return sum(t.grade.formatted for t in self.samples)

    def to_json(self) -> dict:
        """The line's JSON; optional fields that are ``None`` are left out."""
        row = {"type": "problem", "index": self.index, "problem_id": self.problem_id, "question": self.question,
               "answer": self.answer, "seed": self.seed, "samples": to_jsonable(self.samples),
               "num_correct": self.num_correct, "num_formatted": self.num_formatted,
               "sampler_requests": self.sampler_requests, "time_s": self.time_s}
        return {k: v for k, v in row.items() if v is not None or k not in _OPTIONAL_PROBLEM_KEYS}

    @classmethod
    def from_json(cls, row: Mapping) -> ProblemResult:
        """Read a problem row; raises ``ValueError`` naming the sample that is not a trajectory."""
        samples = row["samples"]
        if not isinstance(samples, list):
            raise ValueError(f"problem {row['problem_id']!r}: samples is not a list")
        return cls(problem_id=row["problem_id"], question=row["question"], answer=row["answer"],
                   samples=tuple(_trajectory(row["problem_id"], n, s) for n, s in enumerate(samples, start=1)),
                   **{k: row.get(k) for k in _OPTIONAL_PROBLEM_KEYS})


_OPTIONAL_PROBLEM_KEYS = ("index", "seed", "sampler_requests", "time_s")


def _trajectory(problem_id: str, n: int, data: Any) -> Trajectory:
    try:
        return trajectory_from_jsonable(data)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"problem {problem_id!r} sample {n}: not a valid trajectory: {err!r}") from None


# ---------------------------------------------------------------- the summary


@dataclass(frozen=True)
class EvalSummary:
    """The last line: the eval's statistics over every problem (definitions: :mod:`retool.stats`)."""

    average_at_k: float
    pass_at_k: float
    pass_at_k_unbiased: dict[int, float]
    """Unbiased pass@k' for k' = 1..k (string keys in the file)."""
    format: float
    reward: float
    code_calls: float
    tool_call_attempts: float
    used_tool_rate: float
    turns: float
    tokens: float
    sampled_tokens: float
    average_at_k_stderr: float
    k: int
    num_problems: int
    num_samples: int
    num_correct: int
    num_formatted: int
    num_solved: int
    stop_reasons: dict[str, int]
    behaviour: dict[str, float] | None = None
    """:func:`retool.stats.behaviour_figures` (response length, call rate, code lines per
    call, call success rate, first-call position, self-corrections); ``None`` in files
    written before it was recorded."""

    def to_json(self) -> dict:
        row = {"type": "summary", **{key: getattr(self, name) for key, name in _SUMMARY_KEYS
                                     if key not in _OPTIONAL_SUMMARY_KEYS or getattr(self, name) is not None}}
        row["pass@k_unbiased"] = {str(j): p for j, p in self.pass_at_k_unbiased.items()}
        return row

    @classmethod
    def from_json(cls, row: Mapping) -> EvalSummary:
        values = {name: row[key] for key, name in _SUMMARY_KEYS if key not in _OPTIONAL_SUMMARY_KEYS}
        values.update({name: row.get(key) for key, name in _SUMMARY_KEYS if key in _OPTIONAL_SUMMARY_KEYS})
        values["pass_at_k_unbiased"] = {int(j): p for j, p in row["pass@k_unbiased"].items()}
        return cls(**values)


_SUMMARY_KEYS = tuple((f.name.replace("_at_", "@"), f.name) for f in dataclasses.fields(EvalSummary))
"""(JSON key, field) in the file's order: ``average@k`` ↔ ``average_at_k``, …"""
_OPTIONAL_SUMMARY_KEYS = ("behaviour",)
"""Summary keys older files lack: read as ``None``, and left out of the line when ``None``
(so such files read and write back byte for byte)."""


def summarize(samples_P: Iterable[Sequence[Trajectory]]) -> EvalSummary:
    """The summary of an eval from each problem's samples (dataset order).

    ``k`` is the smallest sample count over problems (equal counts are the normal case).
    Raises ``ValueError`` for no problems or a problem without samples.
    """
    return summary_of_stats([trajectory_stats(samples) for samples in samples_P])


def summary_of_stats(stats_P: Sequence[TrajectoryStats]) -> EvalSummary:
    """The summary from each problem's :class:`~retool.stats.TrajectoryStats` (dataset order)."""
    counts = [(s.trajectories, s.correct) for s in stats_P]
    check_counts(counts)
    total = sum(stats_P, TrajectoryStats())
    k = min(n for n, _ in counts)
    return EvalSummary(
        average_at_k=average_at_k(counts), pass_at_k=pass_at_k_empirical(counts),
        pass_at_k_unbiased={j: unbiased_pass_at_k(counts, j) for j in range(1, k + 1)},
        format=total.format_rate, reward=total.reward_mean, code_calls=total.code_calls_mean,
        tool_call_attempts=total.tool_call_attempts_mean, used_tool_rate=total.used_tool_rate,
        turns=total.turns_mean, tokens=total.tokens_mean, sampled_tokens=total.sampled_tokens_mean,
        average_at_k_stderr=average_at_k_stderr(counts), k=k, num_problems=len(counts),
        num_samples=total.trajectories, num_correct=total.correct, num_formatted=total.formatted,
        num_solved=sum(1 for _, c in counts if c > 0), stop_reasons=total.stop_reasons,
        behaviour=behaviour_figures(total))


# ---------------------------------------------------------------- reading


@dataclass(frozen=True)
class EvalResults:
    """One results file read whole: header, problems (file order), summary if finished."""

    path: Path
    header: ResultsHeader
    problems: tuple[ProblemResult, ...]
    summary: EvalSummary | None
    """``None`` for an eval that was interrupted."""

    @property
    def label(self) -> str:
        return self.header.display_label


@dataclass(frozen=True)
class ResultsLine:
    """One record of a results file, where it is and where it ends (byte offset)."""

    lineno: int
    end: int
    record: ResultsHeader | ProblemResult | EvalSummary
    terminated: bool = True
    """Whether the line ends with its newline (a complete last line may not)."""


def read_results(path: str | Path) -> EvalResults:
    """Read a whole results file (plain or ``.gz``); raises :class:`ResultsFileError`."""
    path = Path(path)
    header, problems, summary = None, [], None
    for line in iter_results(path):
        if isinstance(line.record, ResultsHeader):
            header = line.record
        elif isinstance(line.record, ProblemResult):
            problems.append(line.record)
        else:
            summary = line.record
    if header is None:
        raise ResultsFileError(f"{path} is not an eval results file (it holds no complete line)")
    return EvalResults(path, header, tuple(problems), summary)


def iter_results(path: str | Path) -> Iterator[ResultsLine]:
    """The records of a results file one line at a time: the header, problems, the summary.

    Nothing for a file without a complete line. Raises :class:`ResultsFileError` when the
    first line is not a header, a line is not valid JSON or not a valid record, a problem
    appears twice, or a line follows the summary.
    """
    path = Path(path)
    seen: set[str] = set()
    header_read, summary_at = False, None
    for lineno, end, row, terminated in _json_lines(path):
        if summary_at is not None:
            raise ResultsFileError(f"{path}:{summary_at}: a summary line before the end of the file")
        kind = row.get("type")
        if not header_read and kind != "header":
            raise ResultsFileError(f"{path} is not an eval results file (its first line is not a header)")
        parse = _PARSERS.get(kind) if header_read else ResultsHeader.from_json
        if parse is None:
            raise ResultsFileError(f"{path}:{lineno}: unexpected line type {kind!r}")
        record = _parsed(path, lineno, kind, parse, row)
        if isinstance(record, ProblemResult):
            if record.problem_id in seen:
                raise ResultsFileError(f"{path}:{lineno}: problem {record.problem_id!r} appears twice")
            seen.add(record.problem_id)
        header_read, summary_at = True, lineno if kind == "summary" else None
        yield ResultsLine(lineno, end, record, terminated)


_PARSERS = {"problem": ProblemResult.from_json, "summary": EvalSummary.from_json}
"""How each line after the header is read, by its ``type``."""


def _parsed(path: Path, lineno: int, kind: str, parse: Any, row: dict) -> Any:
    try:
        return parse(row)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        detail = str(err) if isinstance(err, ValueError) else repr(err)
        raise ResultsFileError(f"{path}:{lineno}: not a valid {kind} line: {detail}") from None


def _json_lines(path: Path) -> Iterator[tuple[int, int, dict, bool]]:
    """``(line number, byte offset after the line, object, has its newline)`` of each complete line."""
    try:
        for line in iter_jsonl(path):
            yield line.lineno, line.end, line.row, line.terminated
    except JsonlError as err:
        raise ResultsFileError(str(err)) from None


def is_results_file(path: str | Path) -> bool:
    """Whether the first complete line of ``path`` is a results header (``False`` if unreadable)."""
    try:
        first = next(iter_jsonl(path), None)
    except JsonlError:
        return False
    return first is not None and first.row.get("type") == "header"


# ---------------------------------------------------------------- appending


@dataclass(frozen=True)
class _Done:
    """What the summary and the progress bar keep of one finished problem."""

    index: int
    stats: TrajectoryStats


class ResultsFile:
    """A results file opened for appending, with the problems it already holds.

    :meth:`open` checks an existing file's header against this run's, drops a torn last
    line and an old summary line, and remembers the finished problems; :meth:`append`
    adds one problem line durably; :meth:`finish` appends the summary of every problem
    in the file. Nothing is written before :meth:`prepare` (or the first append).
    """

    def __init__(self, path: Path, header: ResultsHeader, done: dict[str, _Done], *, fresh: bool,
                 keep: int, end_line: bool = False) -> None:
        self.path, self.header, self.done = path, header, done
        self._fresh, self._keep, self._end_line = fresh, keep, end_line
        self._prepared = False

    @classmethod
    def open(cls, path: str | Path, header: ResultsHeader, index_of: Mapping[str, int], *,
             overwrite: bool) -> ResultsFile:
        """Read and check an existing file (``index_of``: problem id → dataset position).

        Raises ``ConfigError`` when the file's header differs from ``header`` in a
        matched field, :class:`ResultsFileError` when the file is damaged or a problem
        has other than ``header.val_n`` samples.
        """
        path = Path(path)
        lines = iter_results(path) if path.exists() and not overwrite else iter(())
        old, done, keep, end_line = None, {}, 0, False
        for line in lines:
            if isinstance(line.record, ResultsHeader):
                old = line.record
                _check_header(path, old, header)
            elif isinstance(line.record, ProblemResult):
                done[line.record.problem_id] = _done(path, line, index_of, header.val_n)
            if not isinstance(line.record, EvalSummary):
                keep, end_line = line.end, not line.terminated
        if old is None:
            return cls(path, header, {}, fresh=True, keep=0)
        return cls(path, old, done, fresh=False, keep=keep, end_line=end_line)

    def prepare(self) -> None:
        """Start a new file with its header, or cut an old one after its last problem line."""
        if self._prepared:
            return
        if self._fresh:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _write_line(self.path, self.header.to_json(), mode="wb")
        elif self.path.stat().st_size != self._keep:
            os.truncate(self.path, self._keep)
        if self._end_line:  # a complete last line written without its newline
            with open(self.path, "ab") as f:
                f.write(b"\n")
        self._prepared = True

    def append(self, problem: ProblemResult) -> None:
        """Write one problem line (flushed and fsynced) and remember the problem."""
        self.prepare()
        _write_line(self.path, problem.to_json())
        self.done[problem.problem_id] = _Done(problem.index, trajectory_stats(problem.samples))

    def summary(self) -> EvalSummary:
        """The summary of every problem in the file, in dataset order."""
        done = sorted(self.done.values(), key=lambda d: d.index)
        return summary_of_stats([d.stats for d in done])

    def finish(self) -> EvalSummary:
        """Append the summary line and return it."""
        self.prepare()
        summary = self.summary()
        _write_line(self.path, summary.to_json())
        return summary

    def running_average(self) -> float:
        """Average@k of the problems done so far (0.0 before the first)."""
        done = list(self.done.values())
        return sum(d.stats.correct_rate for d in done) / len(done) if done else 0.0


def _check_header(path: Path, old: ResultsHeader, new: ResultsHeader) -> None:
    diffs = old.differences(new)
    if diffs:
        raise ConfigError(f"{path} holds an eval with other settings, so it cannot be resumed:\n  "
                          + "\n  ".join(diffs) + "\nPass --output NEW.jsonl for a separate file, "
                          "or --overwrite to discard this one.")


def _done(path: Path, line: ResultsLine, index_of: Mapping[str, int], val_n: int | None) -> _Done:
    problem = line.record
    if val_n is not None and len(problem.samples) != val_n:
        raise ResultsFileError(f"{path}:{line.lineno}: problem {problem.problem_id!r} has "
                               f"{len(problem.samples)} samples, expected {val_n}")
    index = index_of.get(problem.problem_id, problem.index)
    return _Done(len(index_of) if index is None else index, trajectory_stats(problem.samples))


def _write_line(path: Path, row: dict, mode: str = "ab") -> None:
    """Append (or, with ``mode="wb"``, start the file with) one line, flushed and fsynced."""
    with open(path, mode) as f:
        f.write((json.dumps(row) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())
