"""The one JSON Lines reader: every ``.jsonl`` / ``.jsonl.gz`` file retool reads goes through it.

One rule for a damaged file, whoever reads it (training metrics, trajectory logs, eval
results, SFT dialogues):

- blank lines are skipped;
- each other line must be one JSON object; a bad line raises :class:`JsonlError` naming
  the file and the line;
- except the **last** line when it has no newline and is not valid JSON: that is a write
  cut off by a kill (every writer here ends a line with its newline in the same write).
  What is complete before it is returned, and one warning line on stderr names the file
  and the line dropped. A last line without its newline that *is* a whole JSON object is
  complete and kept.

:func:`iter_jsonl` also gives each line's number and the byte offset just after it, so
an appender (:class:`retool.results.ResultsFile`) can cut a file after its last
complete line. Not covered: what the objects mean (each format's own reader does that)
and writing.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO


class JsonlError(ValueError):
    """A JSON Lines file that cannot be read (the message names the file and, where known, the line)."""


@dataclass(frozen=True)
class JsonlLine:
    """One complete line of a JSON Lines file."""

    lineno: int
    """1-based line number in the (decompressed) file."""
    end: int
    """Byte offset just after this line (its newline included, when it has one)."""
    row: dict
    terminated: bool = True
    """Whether the line ends with its newline (only the last line may not)."""


def iter_jsonl(path: str | Path) -> Iterator[JsonlLine]:
    """Each complete JSON object line of ``path`` (gzip-compressed when the name ends ``.gz``)."""
    path = Path(path)
    end = 0
    try:
        with _open(path) as f:
            for lineno, raw in enumerate(f, start=1):
                end += len(raw)
                if not raw.strip():
                    continue
                terminated = raw.endswith(b"\n")
                row = _decode(path, lineno, raw, last_unterminated=not terminated)
                if row is not None:
                    yield JsonlLine(lineno, end, row, terminated)
    except (OSError, EOFError) as err:
        raise JsonlError(f"{path}: cannot read: {err}") from err


def read_jsonl(path: str | Path) -> list[dict]:
    """All JSON objects of ``path``, by the rule in this module's docstring."""
    return [line.row for line in iter_jsonl(path)]


def _open(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def _decode(path: Path, lineno: int, raw: bytes, *, last_unterminated: bool) -> dict | None:
    """The line's object; ``None`` for a cut-off last line (after saying so once)."""
    try:
        row = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        if last_unterminated:
            print(f"warning: {path}:{lineno}: dropped a cut-off last line (a writer killed mid-write)",
                  file=sys.stderr)
            return None
        raise JsonlError(f"{path}:{lineno}: not valid JSON ({err})") from None
    if not isinstance(row, dict):
        raise JsonlError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
    return row
