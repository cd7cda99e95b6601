"""Reports for humans: plots (``retool plot``) and the HTML trajectory viewer (``retool view``).

This package only reads what training and evaluation wrote (docs/formats.md); it never
runs a model. The readers below are shared by :mod:`retool.report.plots`,
:mod:`retool.report.view` and :mod:`retool.report.compare`:

- :func:`read_jsonl` — rows of a ``.jsonl`` or ``.jsonl.gz`` file (training metrics and
  trajectory logs), with line numbers in errors and tolerance for one truncated last
  line (a run killed mid-write).
- :func:`read_eval_results` — an eval results file as typed records, through the one
  reader :func:`retool.results.read_results`, its errors raised as
  :class:`ReportInputError`; an eval that was interrupted has no summary, and the caller
  decides whether to compute one with :func:`retool.results.summarize`.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

from retool.results import EvalResults, ResultsFileError, read_results


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


def read_eval_results(path: str | Path) -> EvalResults:
    """Read an eval results file; any problem with it raises :class:`ReportInputError`."""
    try:
        return read_results(path)
    except ResultsFileError as err:
        raise ReportInputError(str(err)) from None
