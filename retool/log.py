"""Metric sinks and progress display for training and evaluation runs.

:class:`MetricsLogger` writes one row per step to ``RUN_DIR/metrics.jsonl`` always, and
to SwanLab, Weights & Biases or TensorBoard when chosen (``sinks=("jsonl", "wandb")``).
Those three are optional packages: choosing one that is not installed raises a
:class:`SinkUnavailable` naming the ``pip install`` to run, before training starts.
Their offline modes work without network (``SWANLAB_MODE=offline`` is set by default
here, ``WANDB_MODE=offline`` likewise unless the user set it).

Resume: created with ``resume_step=N``, the logger first drops every JSONL row with
``step > N`` (rows a crashed run wrote after its last checkpoint), so a resumed run
never duplicates a step. Remote sinks resume their run where the package supports it.

:class:`StepProgress` is a rich progress bar with step, reward, tokens/s and ETA; when
the output is not a terminal it prints one plain line per step instead.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import secrets
import time
from pathlib import Path
from typing import Any, Mapping

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from retool.atomic import atomic_write_text
from retool.jsonl import read_jsonl

SINKS = ("jsonl", "swanlab", "wandb", "tensorboard")
_PIP_NAME = {"swanlab": "swanlab", "wandb": "wandb", "tensorboard": "tensorboard"}


class SinkUnavailable(RuntimeError):
    """A chosen metric sink's package is not installed."""


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a ``metrics.jsonl`` in file order (an empty list when the file does not exist).

    The one metrics reader (``retool plot`` keeps the last row per step of what it returns).
    Read by the one JSON Lines rule (:mod:`retool.jsonl`): a cut-off last line is dropped
    with a warning; any other bad line raises :class:`~retool.jsonl.JsonlError` naming it.
    """
    path = Path(path)
    return read_jsonl(path) if path.exists() else []


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible rather than dropping
    return value


class _JsonlSink:
    def __init__(self, run_dir: Path, resume_step: int | None):
        self.path = run_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        self.file = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


class _SwanlabSink:
    def __init__(self, run_dir: Path, project: str, name: str, config: dict, resume: bool):
        import swanlab  # optional: only the swanlab sink needs it

        os.environ.setdefault("SWANLAB_MODE", "offline")
        self.run = swanlab.init(project=project, experiment_name=name, config=config,
                                logdir=str(run_dir / "swanlog"), resume="allow" if resume else None)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class _WandbSink:
    def __init__(self, run_dir: Path, project: str, name: str, config: dict, resume: bool):
        import wandb  # optional: only the wandb sink needs it

        os.environ.setdefault("WANDB_MODE", "offline")
        id_file = run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(8)
        id_file.write_text(run_id)
        self.run = wandb.init(project=project, name=name, config=config, dir=str(run_dir),
                              id=run_id, resume="allow" if resume else None)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class _TensorboardSink:
    def __init__(self, run_dir: Path, *_):
        from torch.utils.tensorboard import SummaryWriter  # heavy (torch): only the tensorboard sink needs it

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


_REMOTE = {"swanlab": _SwanlabSink, "wandb": _WandbSink, "tensorboard": _TensorboardSink}


def check_sinks(sinks: tuple[str, ...]) -> None:
    """Raise before training if a sink is unknown or its package is missing."""
    for sink in sinks:
        if sink not in SINKS:
            raise ValueError(f"unknown metric sink {sink!r}; choose from {', '.join(SINKS)}")
        if sink != "jsonl" and importlib.util.find_spec(_PIP_NAME[sink]) is None:
            raise SinkUnavailable(f"metric sink {sink!r} needs: pip install {_PIP_NAME[sink]}")


class MetricsLogger:
    """Fan one row of metrics per step out to the chosen sinks."""

    def __init__(self, run_dir: Path, *, sinks: tuple[str, ...] = ("jsonl",), project: str = "retool-rl",
                 run_name: str = "run", config: dict | None = None, resume_step: int | None = None):
        check_sinks(sinks)
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.sinks: list[Any] = [_JsonlSink(run_dir, resume_step)]
        for sink in sinks:
            if sink != "jsonl":
                self.sinks.append(_REMOTE[sink](run_dir, project, run_name, config or {},
                                                resume_step is not None))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StepProgress:
    """A progress bar over steps showing reward, tokens/s and ETA.

    On a terminal it is a live rich bar; otherwise (CI, redirected output) each
    :meth:`update` prints one plain line so logs stay readable.
    """

    def __init__(self, total: int, *, start: int = 0, description: str = "train"):
        self.console = Console(stderr=True)
        self.total, self.start, self.t0 = total, start, time.monotonic()
        self.live = self.console.is_terminal
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=self.console,
            disable=not self.live,
        )
        self.task = self.progress.add_task(description, total=total, completed=start, info="")

    def __enter__(self) -> "StepProgress":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def update(self, step: int, **fields: float) -> None:
        """Mark ``step`` done; ``fields`` (e.g. reward=0.3, tok_s=95) are shown beside the bar."""
        info = "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
        self.progress.update(self.task, completed=step, info=info)
        if not self.live:
            elapsed = time.monotonic() - self.t0
            done = max(step - self.start, 1)
            eta = elapsed / done * (self.total - step)
            self.console.print(f"step {step}/{self.total}  {info}  eta {eta:.0f}s", highlight=False)
