"""The ``retool grade`` command: JSONL ``{"response", "gold"}`` lines in, grades out.

It streams its input in batches (``--batch-size`` lines graded together, then written),
keeps output lines in input order, and turns each bad line — invalid JSON or UTF-8, a
missing or mistyped field, a gold ``math_verify`` cannot parse — into an ``{"line",
"error"}`` record, a message on stderr and exit code 1, while the other lines are still
graded. Bad options are refused before any file is opened, and ``--output`` is written
atomically (:mod:`retool.atomic`): a failed or interrupted run leaves an existing output
file as it was. Input with no lines to grade is an error (exit code 1), not an empty success. Not here: what an answer is and how it is rewarded (:mod:`retool.reward`), and
how ``math_verify`` runs (:mod:`retool.grader_pool`; this command owns one pool, sized
by ``--workers``, for its whole run).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from retool.atomic import atomic_open
from retool.flag_checks import UnwritableOutputError, output_file
from retool.grader_pool import DEFAULT_TIMEOUT_S, GraderPool
from retool.reward import ANSWER_WINDOW_CHARS, GoldAnswerError, try_grade_many


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``retool grade`` command."""
    parser = subparsers.add_parser(
        "grade",
        description=(
            'Reads JSONL lines {"response": ..., "gold": ...} and writes, for each input '
            'line, one JSONL line {"line", "reward", "correct", "formatted", "answer", '
            '"grader_error"} in input order. The answer is the last \\boxed{} in the last '
            f"{ANSWER_WINDOW_CHARS} characters of the response, checked with math_verify. "
            'A bad line (invalid JSON, a missing field, an unparsable gold) becomes '
            '{"line": N, "error": ...} on stdout and a message on stderr; the other lines '
            "are still graded, and the exit code is 1. Blank lines are skipped."
        ),
    )
    parser.add_argument("--input", type=Path, help="JSONL file to read (default: stdin)")
    parser.add_argument("--output", type=Path, help="JSONL file to write (default: stdout)")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"wall-clock bound of one verification, in (0, {MAX_TIMEOUT_S:g}] seconds "
                             "(default: %(default)s)")
    parser.add_argument("--workers", type=int, default=None,
                        help="grader processes (default: min(8, CPU count))")
    parser.add_argument("--no-fast-path", action="store_true",
                        help="send plain-integer pairs to math_verify too")
    parser.add_argument("--batch-size", type=int, default=512,
                        help="lines graded together before their results are written")
    parser.set_defaults(func=_run_grade_command)


MAX_TIMEOUT_S = 3600.0
"""The largest ``--timeout-s`` accepted: one verification longer than an hour is a mistake."""


def _option_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the options, checked before any file is opened (``None``: nothing)."""
    if not (math.isfinite(args.timeout_s) and 0 < args.timeout_s <= MAX_TIMEOUT_S):
        return f"--timeout-s must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {args.timeout_s:g}"
    if args.workers is not None and args.workers < 1:
        return f"--workers must be >= 1 (or left out for the default), got {args.workers}"
    if args.batch_size < 1:
        return f"--batch-size must be >= 1, got {args.batch_size}"
    if args.input is not None and not args.input.is_file():
        return f"--input {args.input}: no such file"
    if args.output is not None:
        try:
            output_file(args.output, "--output")
        except UnwritableOutputError as err:
            return str(err)
    return None


def _run_grade_command(args: argparse.Namespace) -> int:
    error = _option_error(args)
    if error is not None:
        print(f"retool grade: error: {error}", file=sys.stderr)
        return 2
    try:
        with (
            _open_in(args.input) as source,
            _open_out(args.output) as sink,
            GraderPool(args.workers, fast_path=not args.no_fast_path) as pool,
        ):
            counts = _grade_stream(pool, source, sink, args.batch_size, args.timeout_s)
    except OSError as error:
        print(f"retool grade: error: {error}", file=sys.stderr)
        return 2
    if counts["lines"] == 0:
        print(f"retool grade: error: nothing was graded: {args.input or 'stdin'} holds no JSONL lines "
              '(expected {"response": ..., "gold": ...} per line)', file=sys.stderr)
        return 1
    print(
        f"retool grade: {counts['lines']} lines, {counts['correct']} correct, "
        f"{counts['unformatted']} without a boxed answer, {counts['grader_errors']} "
        f"grader errors, {counts['bad']} bad lines",
        file=sys.stderr,
    )
    return 1 if counts["bad"] else 0


def _grade_stream(pool: GraderPool, source: IO[bytes], sink: IO[str], batch_size: int,
                  timeout_s: float) -> dict[str, int]:
    """Grade JSONL from ``source`` into ``sink`` batch by batch; the tallies."""
    counts = {"lines": 0, "correct": 0, "unformatted": 0, "grader_errors": 0, "bad": 0}
    for batch in _batches(_numbered_lines(source), batch_size):
        for record in _grade_batch(pool, batch, timeout_s):
            _tally(counts, record)
            sink.write(json.dumps(record, ensure_ascii=False) + "\n")
        sink.flush()
    return counts


def _open_in(path: Path | None) -> IO[bytes]:
    """Bytes, so that a line that is not UTF-8 is one bad line, not a crash."""
    return open(path, "rb") if path else _Borrowed(sys.stdin.buffer)  # type: ignore[return-value]


def _open_out(path: Path | None) -> IO[str]:
    """An existing file is replaced only when grading finishes (:func:`retool.atomic.atomic_open`)."""
    return atomic_open(path) if path else _Borrowed(sys.stdout)  # type: ignore[return-value]


class _Borrowed:
    """A context manager around stdin/stdout that does not close them."""

    def __init__(self, stream: IO):
        self.stream = stream

    def __enter__(self) -> IO:
        return self.stream

    def __exit__(self, *exc_info: object) -> None:
        if self.stream.writable():
            self.stream.flush()


def _numbered_lines(source: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    for number, line in enumerate(source, start=1):
        if line.strip():
            yield number, line


def _batches(items: Iterable, size: int) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _grade_batch(pool: GraderPool, batch: list[tuple[int, bytes]], timeout_s: float) -> list[dict]:
    """Grade one batch of numbered JSONL lines; one output record per line, in order."""
    records: list[dict] = [{}] * len(batch)
    pairs: list[tuple[int, str, str]] = []
    for slot, (number, line) in enumerate(batch):
        try:
            pairs.append((slot, *_read_pair(line)))
        except ValueError as error:
            records[slot] = _bad_line(number, str(error))
    outcomes = try_grade_many([p[1] for p in pairs], [p[2] for p in pairs], timeout_s=timeout_s,
                              pool=pool)
    for (slot, _, _), outcome in zip(pairs, outcomes):
        number = batch[slot][0]
        if isinstance(outcome, GoldAnswerError):
            records[slot] = _bad_line(number, str(outcome))
        else:
            records[slot] = {"line": number, "reward": outcome.reward, "correct": outcome.correct,
                             "formatted": outcome.formatted, "answer": outcome.answer,
                             "grader_error": outcome.grader_error}
    return records


def _read_pair(line: bytes) -> tuple[str, str]:
    """``(response, gold)`` from one JSONL line; ``ValueError`` with a clear reason."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ValueError(f"not valid UTF-8 ({error})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"invalid JSON ({error})") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    missing = [key for key in ("response", "gold") if key not in record]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    response, gold = record["response"], record["gold"]
    if not isinstance(response, str):
        raise ValueError(f'"response" must be a string, got {type(response).__name__}')
    if isinstance(gold, (int, float)) and not isinstance(gold, bool):
        gold = str(gold)  # JSON numbers are unambiguous golds
    if not isinstance(gold, str):
        raise ValueError(f'"gold" must be a string or number, got {type(gold).__name__}')
    return response, gold


def _bad_line(number: int, reason: str) -> dict:
    print(f"retool grade: line {number}: {reason}", file=sys.stderr)
    return {"line": number, "error": reason}


def _tally(counts: dict[str, int], record: dict) -> None:
    counts["lines"] += 1
    if "error" in record:
        counts["bad"] += 1
        return
    counts["correct"] += record["correct"]
    counts["unformatted"] += not record["formatted"]
    counts["grader_errors"] += record["grader_error"] is not None
