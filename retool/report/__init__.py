"""Reports for humans: plots (``retool plot``) and the HTML trajectory viewer (``retool view``).

This package only reads what training and evaluation wrote (docs/formats.md); it never
runs a model. The readers below are shared by :mod:`retool.report.plots`,
:mod:`retool.report.view` and :mod:`retool.report.compare`:

- :func:`read_jsonl` — rows of a ``.jsonl`` or ``.jsonl.gz`` file through the one JSON
  Lines reader (:mod:`retool.jsonl`), its errors raised as :class:`ReportInputError`.
- :func:`read_eval_results` — an eval results file as typed records, through the one
  reader :func:`retool.results.read_results`, its errors raised as
  :class:`ReportInputError`; an eval that was interrupted has no summary, and the caller
  decides whether to compute one with :func:`retool.results.summarize`.
"""

from __future__ import annotations

from pathlib import Path

from retool import jsonl
from retool.results import EvalResults, ResultsFileError, read_results


class ReportInputError(ValueError):
    """An input file is not what the report expected (with the file and line named)."""


def read_jsonl(path: str | Path) -> list[dict]:
    """All JSON objects of a JSON Lines file, by the one rule of :mod:`retool.jsonl` (a
    cut-off last line dropped with a warning); any other problem raises
    :class:`ReportInputError` naming the file and line."""
    try:
        return jsonl.read_jsonl(path)
    except jsonl.JsonlError as err:
        raise ReportInputError(str(err)) from None


def read_eval_results(path: str | Path) -> EvalResults:
    """Read an eval results file; any problem with it raises :class:`ReportInputError`."""
    try:
        return read_results(path)
    except ResultsFileError as err:
        raise ReportInputError(str(err)) from None
