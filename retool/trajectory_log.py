"""Trajectory logs: the typed row, the one reader and the one writer.

A trajectory log (``RUN_DIR/trajectories/step_NNNNNN.jsonl.gz``, ``retool train
--save-trajectories``; docs/formats.md) holds one JSON line per trajectory of a step:
``{"step", "group", "index", "advantage", "trajectory"}``. ``retool regrade`` writes a
copy with two more keys, ``original_grade`` and ``regraded_from``. Each line is one
:class:`TrajectoryLogRow`; keys a file leaves out read as ``None`` (the two regrade keys
are left out when ``None``, so files stay byte for byte as they were).

Read by ``retool view``, ``retool regrade`` and ``retool replay`` through
:func:`read_trajectory_log`, which reads lines by the one JSON Lines rule
(:mod:`retool.jsonl`) and raises :class:`TrajectoryLogError` naming the file and line of
a bad row — or :class:`NotATrajectoryLog` for a file whose rows are not trajectory-log
rows at all (an eval results file, metrics). Written by :func:`write_trajectory_log`.

Not covered: eval results files (:mod:`retool.results`), the trajectory's own encoding
(:mod:`retool.serialize`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from retool.atomic import atomic_open
from retool.jsonl import JsonlError, iter_jsonl
from retool.serialize import to_jsonable, trajectory_from_jsonable
from retool.types import Grade, Trajectory


class TrajectoryLogError(ValueError):
    """A trajectory log that cannot be read (the message names the file and, where known, the line)."""


class NotATrajectoryLog(TrajectoryLogError):
    """A readable JSON Lines file whose rows are not trajectory-log rows (or that has none)."""


@dataclass(frozen=True)
class TrajectoryLogRow:
    """One trajectory of a training step, where it sat in the step, and its advantage."""

    trajectory: Trajectory
    step: int | None = None
    group: int | None = None
    """Position of its group in the step's batch."""
    index: int | None = None
    """Position in its group."""
    advantage: float | None = None
    original_grade: Grade | None = None
    """The grade before ``retool regrade`` (only in a regraded copy)."""
    regraded_from: str | None = None
    """The log a regraded copy was made from."""

    @property
    def where(self) -> str:
        """``step S · group G · #I`` — how reports name this row."""
        return f"step {self.step} · group {self.group} · #{self.index}"

    def to_json(self) -> dict:
        row = {"step": self.step, "group": self.group, "index": self.index, "advantage": self.advantage,
               "trajectory": to_jsonable(self.trajectory)}
        if self.original_grade is not None:
            row["original_grade"] = to_jsonable(self.original_grade)
        if self.regraded_from is not None:
            row["regraded_from"] = self.regraded_from
        return row

    @classmethod
    def from_json(cls, row: dict) -> TrajectoryLogRow:
        """Raises ``KeyError``/``TypeError``/``ValueError`` for a row that is not a valid one."""
        grade = row.get("original_grade")
        return cls(trajectory=trajectory_from_jsonable(row["trajectory"]), step=row.get("step"),
                   group=row.get("group"), index=row.get("index"), advantage=row.get("advantage"),
                   original_grade=Grade(**grade) if isinstance(grade, dict) else None,
                   regraded_from=row.get("regraded_from"))


def read_trajectory_log(path: str | Path) -> list[TrajectoryLogRow]:
    """Every row of a trajectory log (plain or ``.gz``), in file order."""
    path = Path(path)
    try:
        lines = list(iter_jsonl(path))
    except JsonlError as err:
        raise TrajectoryLogError(str(err)) from None
    if not lines or not all(isinstance(line.row.get("trajectory"), dict) for line in lines):
        raise NotATrajectoryLog(f"{path}: not a trajectory log (every row needs a 'trajectory' object)")
    rows = []
    for line in lines:
        try:
            rows.append(TrajectoryLogRow.from_json(line.row))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise TrajectoryLogError(f"{path}:{line.lineno}: not a valid trajectory-log row: {err!r}") from None
    return rows


def write_trajectory_log(path: Path, rows: Iterable[TrajectoryLogRow]) -> Path:
    """Write ``rows`` atomically to ``path`` (gzip-compressed when the name ends ``.gz``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, compress=path.name.endswith(".gz")) as f:
        for row in rows:
            f.write(json.dumps(row.to_json()) + "\n")
    return path

