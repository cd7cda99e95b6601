"""Reports for humans: plots (``retool plot``) and the HTML trajectory viewer (``retool view``).

This package only reads what training and evaluation wrote (docs/formats.md); it never
runs a model. The readers below are shared by :mod:`retool.report.plots` and
:mod:`retool.report.view`:

- :func:`read_jsonl` — rows of a ``.jsonl`` or ``.jsonl.gz`` file, with line numbers in
  errors and tolerance for one truncated last line (a run killed mid-write).
- :func:`read_eval_results` — an eval results file split into header, problem rows and
  summary; an eval that was interrupted has no summary, and the caller decides whether
  to compute one with :func:`retool.stats.summarize`.
"""

from __future__ import annotations

import gzip
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path


class ReportInputError(ValueError):
    """An input file is not what the report expected (with the file and line named)."""


def read_jsonl(path: str | Path) -> list[dict]:
    """All JSON objects of a JSON Lines file (gzip-compressed when the name ends ``.gz``).

    Blank lines are skipped. A last line that is cut off (no newline and not valid JSON,
    as a crashed writer leaves it) is dropped with a warning on stderr; any other bad
    line raises :class:`ReportInputError` naming the file and line.
    """
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise ReportInputError(f"{path}: cannot read: {err}") from err
    lines = text.split("\n")
    rows = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if lineno == len(lines) and not text.endswith("\n"):
                print(f"warning: {path}:{lineno}: dropped a truncated last line", file=sys.stderr)
                continue
            raise ReportInputError(f"{path}:{lineno}: not valid JSON: {err}") from err
        if not isinstance(row, dict):
            raise ReportInputError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


@dataclass
class EvalResults:
    """One eval results file: its header, its problem rows and its summary (if finished)."""

    path: Path
    header: dict
    problems: list[dict] = field(default_factory=list)
    summary: dict | None = None

    @property
    def label(self) -> str:
        """The header's label, else ``base`` / ``step N`` from the step."""
        if self.header.get("label"):
            return str(self.header["label"])
        step = self.header.get("step")
        return "base" if step is None else f"step {step}"


def is_eval_results(rows: list[dict]) -> bool:
    """Whether rows look like an eval results file (first row is a header)."""
    return bool(rows) and rows[0].get("type") == "header"


def read_eval_results(path: str | Path, rows: list[dict] | None = None) -> EvalResults:
    """Parse an eval results file (or its already-read ``rows``).

    Raises :class:`ReportInputError` when the first row is not a header or a row has an
    unknown ``type``.
    """
    path = Path(path)
    rows = read_jsonl(path) if rows is None else rows
    if not is_eval_results(rows):
        raise ReportInputError(f"{path}: not an eval results file (first row is not a header)")
    results = EvalResults(path=path, header=rows[0])
    for lineno, row in enumerate(rows[1:], start=2):
        kind = row.get("type")
        if kind == "problem":
            results.problems.append(row)
        elif kind == "summary":
            results.summary = row
        else:
            raise ReportInputError(f"{path}: row {lineno}: unknown row type {kind!r}")
    return results
