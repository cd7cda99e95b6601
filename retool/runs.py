"""The run folder of ``retool train`` and ``retool sft``: its files, checkpoints and loop.

A run folder (``RUN_DIR``, described in ``docs/formats.md``) holds:

- ``config.json`` — the full resolved config (:func:`create_run`);
- ``metrics.jsonl`` — one row per step (:class:`retool.log.MetricsLogger`), plus the
  folders of remote sinks (``tensorboard/``, ``swanlog/``, ``wandb/``);
- ``trajectories/step_NNNNNN.jsonl.gz`` — every trajectory of a step, when asked
  (:func:`save_trajectories`, RL only);
- ``checkpoints/step_NNNNNN/`` — ``engine/`` (the engine's ``save_state`` folder) and
  ``trainer_state.json`` (:class:`TrainerState`), written to a ``.partial`` folder and
  renamed into place (:func:`save_checkpoint`);
- ``manifest.json`` — the checkpoints, listed only once complete (and, sampling ahead,
  once the groups sampled ahead of them are stored), so a crash before that leaves the
  previous one as the newest;
- ``sft_data.json`` — the SFT data checksum and conversion counts (SFT only, written by
  :mod:`retool.sft`);
- ``rollouts/step_NNNNNN/`` — the finished trajectory groups of the RL step in progress
  (:class:`GroupStore`), so a crash mid-step loses only the groups still running;
  removed when the step is done (sampling ahead: once a checkpoint at or after it is listed).

This module creates the folder (refusing to overwrite a run unless resuming), saves,
lists and finds checkpoints, resolves what ``--init-from``, ``--checkpoint`` and
``--resume`` point at (:func:`resolve_checkpoint`), fixes the data order
(:func:`batch_indices`) and runs the step loop train and SFT share (:func:`run_steps`:
logger, progress bar, checkpoints every N steps and at the last step, resume). The
steps themselves stay in :mod:`retool.train` and :mod:`retool.sft`.

Not covered: what is inside ``engine/`` (the engine's own format), eval results files
(:mod:`retool.evaluate`), the byte-level atomic writes (:mod:`retool.atomic`), and
several processes writing one run folder (the last writer wins; nothing locks it).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from retool.atomic import atomic_open, atomic_write_json, replace_folder
from retool.config import ConfigError, config_to_dict, save_config
from retool.engines import ModelConfig, TrainingClient, load_training_client
from retool.log import MetricsLogger, StepProgress
from retool.serialize import to_jsonable, trajectory_from_jsonable
from retool.trajectory_log import TrajectoryLogRow, write_trajectory_log
from retool.types import TokenUsage

CHECKPOINT_PREFIX = "step_"

# ---------------------------------------------------------------- failpoints


FAILPOINTS_ENV = "RETOOL_FAILPOINTS"
"""Comma-separated ``name@step`` pairs; the process SIGKILLs itself on reaching one.

Used by the crash/resume tests to kill a run at an exact point (mid-step, or halfway
through a checkpoint write) instead of racing a timer. Names: ``after_rollout``,
``checkpoint_write``. Unset in normal use.
"""


def failpoint(name: str, step: int) -> None:
    """SIGKILL this process if ``name@step`` is listed in ``$RETOOL_FAILPOINTS``."""
    wanted = os.environ.get(FAILPOINTS_ENV, "")
    if wanted and f"{name}@{step}" in wanted.split(","):
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------- data order


def batch_indices(step: int, batch_size: int, num_problems: int, seed: int) -> list[int]:
    """Indices of the problems of ``step`` (1-based): a fresh seeded shuffle per epoch.

    A pure function of its arguments, so a resumed run sees exactly the batches the
    uninterrupted run would have seen (the "data cursor" is the step number).
    """
    import numpy as np  # 30-100 ms to import: kept off `retool train --help` and `retool sft --help`

    start = (step - 1) * batch_size
    out = []
    for position in range(start, start + batch_size):
        epoch, offset = divmod(position, num_problems)
        order = np.random.default_rng([seed, epoch]).permutation(num_problems)
        out.append(int(order[offset]))
    return out


def refill_indices(step: int, round_: int, count: int, num_problems: int, seed: int) -> list[int]:
    """Problems for refill round ``round_`` (1-based) of ``step``: ``count`` distinct ones at random.

    Dynamic sampling draws them from the whole set (they may repeat problems of the main
    order); a pure function like :func:`batch_indices`, so a resumed run refills alike.
    """
    import numpy as np  # as in batch_indices

    rng = np.random.default_rng([seed, step, round_])
    return [int(i) for i in rng.choice(num_problems, size=min(count, num_problems), replace=False)]


# ---------------------------------------------------------------- the folder


def refuse_existing_run(run_dir: Path, *, resume: bool) -> None:
    """Raise :class:`ConfigError` when ``run_dir`` already holds checkpoints and this is no resume."""
    if not resume and read_manifest(run_dir):
        raise ConfigError(f"{run_dir} already holds a run; pass --resume {run_dir} or choose another --run-dir")


def create_run(run_dir: Path, cfg: Any) -> None:
    """Create ``run_dir`` (if needed) and write the resolved ``cfg`` to its ``config.json``.

    Called only once every input has been checked and the model has loaded, so a bad input
    leaves no half-made run folder and a failed ``--resume`` leaves ``config.json`` as it was.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.json")


PATH_FIELDS = ("train_data", "data", "model", "init_from", "chat_template")
"""Config fields that may name a local file or folder; saved absolute (:func:`with_absolute_paths`)."""


def with_absolute_paths(cfg: Any) -> Any:
    """``cfg`` with every :data:`PATH_FIELDS` value that names an existing file or folder made
    absolute, so ``--resume`` works from any directory. Names (``bundled:smollm2``, hub ids,
    bundled data sets and templates) are kept as they are."""
    changes = {}
    for name in PATH_FIELDS:
        value = getattr(cfg, name, None)
        if not isinstance(value, str) or not value or "{" in value:
            continue  # unset, or inline Jinja source
        path = Path(value).expanduser()
        if name == "chat_template" and not (path.suffix in (".jinja", ".j2") or "/" in value):
            continue  # a bundled template's name
        if path.exists() and not value.startswith("bundled:"):
            changes[name] = str(path.resolve())
    return dataclasses.replace(cfg, **changes) if changes else cfg


def check_model_folder(model: str, flag: str = "--model") -> None:
    """Refuse a ``model`` written as a local path (absolute, ``./``, ``../``, ``~`` or with more
    than one ``/``) that is not a folder: a hub id is ``org/name``."""
    path_like = model.startswith(("/", ".", "~")) or model.count("/") > 1 or "\\" in model
    if path_like and not Path(model).expanduser().is_dir():
        raise ConfigError(f"{flag} {model}: no such folder; give a model folder, a Hugging Face id "
                          "(org/name) or bundled:smollm2")


def data_fingerprint(path: Path) -> dict[str, str]:
    """``{"path": absolute path, "sha256": of its bytes}``: what a run records of its data file."""
    path = Path(path).resolve()
    return {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def check_same_data(run_dir: Path, record: str, fingerprint: dict[str, str]) -> None:
    """Refuse a resume whose data file differs from the one the run started with (recorded in
    ``RUN_DIR/record`` as :func:`data_fingerprint` wrote it; nothing recorded: nothing to compare)."""
    saved_path = Path(run_dir) / record
    if not saved_path.is_file():
        return
    saved = json.loads(saved_path.read_text())
    if saved.get("sha256") != fingerprint["sha256"]:
        raise ConfigError(f"{fingerprint['path']} changed since {run_dir} started (sha256 "
                          f"{str(saved.get('sha256'))[:12]} → {fingerprint['sha256'][:12]}); a resumed run must see "
                          f"the same data: restore the file, or start a new run with another --run-dir")


def save_trajectories(run_dir: Path, step: int, groups_with_advantages: list) -> Path:
    """Write every trajectory of a step to ``trajectories/step_NNNNNN.jsonl.gz``."""
    path = run_dir / "trajectories" / f"{CHECKPOINT_PREFIX}{step:06d}.jsonl.gz"
    rows = (TrajectoryLogRow(trajectory, step=step, group=g, index=i, advantage=advantage)
            for g, (group, advantages) in enumerate(groups_with_advantages)
            for i, (trajectory, advantage) in enumerate(zip(group, advantages)))
    return write_trajectory_log(path, rows)


# ---------------------------------------------------------------- finished groups of an unfinished step


@dataclass(frozen=True)
class GroupKey:
    """Where a trajectory group sits in a run: step, rollout round (0 = the batch, then
    refills), position in that round, and its problem."""

    step: int
    round: int
    index: int
    problem_id: str


@dataclass(frozen=True)
class StoredGroup:
    """A finished group of a step that has not finished: its trajectories and token usage."""

    trajectories: tuple
    usage: TokenUsage


class GroupStore:
    """The finished trajectory groups of the step in progress, kept on disk so a crash
    mid-step loses only the groups still running (``RUN_DIR/rollouts/step_NNNNNN/``).

    A group is written atomically as it finishes, with the fingerprint of what produced
    it — its :class:`GroupKey` and ``run_fingerprint`` (the run's config, which with the
    step fixes the weights it was sampled with: resume is exact). :meth:`load` returns it
    only when all of that matches; a resumed step reuses it instead of sampling again.
    :meth:`clear` drops a step's groups once the step is done; with ``--max-staleness`` the
    groups of later steps are kept too, until :meth:`clear_through` a checkpoint's step.
    """

    def __init__(self, run_dir: Path, run_fingerprint: str) -> None:
        self.folder, self.fingerprint = Path(run_dir) / "rollouts", run_fingerprint

    def _path(self, key: GroupKey) -> Path:
        return self.folder / f"{CHECKPOINT_PREFIX}{key.step:06d}" / f"group_{key.round:02d}_{key.index:04d}.json.gz"

    def save(self, key: GroupKey, trajectories: Any, usage: TokenUsage) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        row = {"key": dataclasses.asdict(key), "fingerprint": self.fingerprint, "usage": usage.to_json(),
               "trajectories": to_jsonable(list(trajectories))}
        with atomic_open(path, compress=True) as f:
            f.write(json.dumps(row))

    def load(self, key: GroupKey) -> StoredGroup | None:
        """The stored group at ``key`` if it was made by this run for this key, else ``None``."""
        path = self._path(key)
        if not path.is_file():
            return None
        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                row = json.load(f)
        except (OSError, EOFError, json.JSONDecodeError):
            return None  # unreadable: roll the group out again
        if row.get("key") != dataclasses.asdict(key) or row.get("fingerprint") != self.fingerprint:
            return None
        return StoredGroup(tuple(trajectory_from_jsonable(t) for t in row["trajectories"]),
                           TokenUsage.from_json(row["usage"]))

    def clear(self, step: int) -> None:
        shutil.rmtree(self.folder / f"{CHECKPOINT_PREFIX}{step:06d}", ignore_errors=True)

    def clear_through(self, step: int) -> None:
        """Drop the groups of every step up to ``step``."""
        for folder in self.folder.glob(f"{CHECKPOINT_PREFIX}*"):
            number = folder.name[len(CHECKPOINT_PREFIX):]
            if number.isdigit() and int(number) <= step:
                shutil.rmtree(folder, ignore_errors=True)


def run_fingerprint(cfg: Any) -> str:
    """A digest of a run's config, without what ``--resume`` may change (``max_steps``)."""
    settings = {k: v for k, v in config_to_dict(cfg).items() if k not in ("max_steps", "run_dir")}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------- manifest


@dataclass(frozen=True)
class ManifestEntry:
    """One checkpoint listed in ``manifest.json``."""

    step: int
    path: str
    """The checkpoint folder, relative to the run folder."""
    time: float
    """When it was listed (Unix seconds)."""


def read_manifest(run_dir: Path) -> list[ManifestEntry]:
    """The checkpoints listed in ``RUN_DIR/manifest.json`` (oldest first; none without the file)."""
    path = Path(run_dir) / "manifest.json"
    if not path.exists():
        return []
    return [ManifestEntry(e["step"], e["path"], e["time"]) for e in json.loads(path.read_text())["checkpoints"]]


def _list_in_manifest(run_dir: Path, entry: ManifestEntry) -> None:
    """Add (or replace, by step) ``entry`` in ``manifest.json``, atomically."""
    entries = [e for e in read_manifest(run_dir) if e.step != entry.step] + [entry]
    rows = [dataclasses.asdict(e) for e in sorted(entries, key=lambda e: e.step)]
    atomic_write_json(run_dir / "manifest.json", {"checkpoints": rows})


# ---------------------------------------------------------------- checkpoints


class Checkpoint(NamedTuple):
    """A checkpoint found on disk: ``(step, folder, engine_dir)``."""

    step: int | None
    """Its training step; ``None`` for a folder that does not say (no ``trainer_state.json``,
    no ``step_N`` name)."""
    folder: Path
    """The checkpoint folder (``checkpoints/step_NNNNNN``, or a bare engine folder)."""
    engine_dir: Path
    """The folder the engine's ``save_state`` wrote (``engine.json`` + adapter or weights)."""

    def resolved(self) -> Checkpoint:
        """The same checkpoint with absolute, symlink-free paths."""
        return self._replace(folder=self.folder.resolve(), engine_dir=self.engine_dir.resolve())

    @property
    def run_dir(self) -> Path | None:
        """The run folder holding it, if it sits in one's ``checkpoints/``."""
        return self.folder.parent.parent if self.folder.parent.name == "checkpoints" else None


@dataclass(frozen=True)
class TrainerState:
    """``trainer_state.json``: what a resumed loop needs besides the engine's own state."""

    step: int
    data_cursor: int
    """Problems (or dialogues) consumed so far: ``step * batch_size``."""
    totals: dict[str, float]
    """Running totals logged every step (``tokens/*_total``)."""
    curriculum: dict[str, Any] | None = None
    """The difficulty pool's state (:meth:`retool.curriculum.PoolState.to_json`); ``None`` without one."""
    weight_sync: dict[str, Any] | None = None
    """The weight-sync guard's last check (:meth:`retool.weight_sync.WeightSyncGuard.state`); ``None``: none."""


def read_trainer_state(folder: Path) -> TrainerState:
    """The ``trainer_state.json`` of the checkpoint ``folder``."""
    state = json.loads((folder / "trainer_state.json").read_text())
    return TrainerState(int(state["step"]), int(state["data_cursor"]), dict(state["totals"]), state.get("curriculum"),
                        state.get("weight_sync"))


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """``RUN_DIR/checkpoints/step_NNNNNN``."""
    return run_dir / "checkpoints" / f"{CHECKPOINT_PREFIX}{step:06d}"


def save_checkpoint(run_dir: Path, engine: Any, state: TrainerState, *, listed: bool = True) -> Path:
    """Write ``checkpoints/step_NNNNNN`` (engine state + ``trainer_state.json``) atomically,
    then list it in ``manifest.json`` (with ``listed=False`` not yet: :func:`list_checkpoint`
    does, once it can be resumed from); return the folder."""
    final = checkpoint_dir(run_dir, state.step)
    staging = final.with_name(f".{final.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    engine.save_state(staging / "engine")
    failpoint("checkpoint_write", state.step)
    (staging / "trainer_state.json").write_text(json.dumps(dataclasses.asdict(state), indent=2))
    replace_folder(staging, final)
    if listed:
        list_checkpoint(run_dir, state.step)
    return final


def list_checkpoint(run_dir: Path, step: int) -> None:
    """List the saved checkpoint of ``step`` in ``manifest.json``: from now on
    :func:`latest_checkpoint` (and so ``--resume``) finds it."""
    _list_in_manifest(run_dir, ManifestEntry(step, str(checkpoint_dir(run_dir, step).relative_to(run_dir)),
                                             time.time()))


def is_complete(folder: Path) -> bool:
    """Whether a checkpoint folder holds both its trainer state and its engine state."""
    return (folder / "trainer_state.json").is_file() and (folder / "engine" / "engine.json").is_file()


def list_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """The complete checkpoints the manifest of ``run_dir`` lists, oldest first."""
    found = [(e.step, Path(run_dir) / e.path) for e in read_manifest(run_dir)]
    return [Checkpoint(step, folder, folder / "engine") for step, folder in found if is_complete(folder)]


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The newest complete checkpoint of a run (``None`` when it has none yet)."""
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


def checkpoint_step(folder: Path) -> int | None:
    """The step of a checkpoint folder: from ``trainer_state.json``, else its ``step_N`` name."""
    state = folder / "trainer_state.json"
    if state.is_file():
        return int(json.loads(state.read_text())["step"])
    match = re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", folder.resolve().name)
    return int(match[1]) if match else None


def resolve_checkpoint(path: str | Path, *, flag: str = "checkpoint", bare_folder: bool = False) -> Checkpoint:
    """The checkpoint ``path`` points at (for ``--checkpoint``, ``--init-from``).

    A run folder (with ``manifest.json``) means its newest complete checkpoint; a
    ``checkpoints/step_N`` folder or its ``engine/`` sub-folder means that checkpoint; a
    folder with ``engine.json`` is an engine folder. With ``bare_folder`` any other folder
    is taken as an engine folder too (e.g. a bare PEFT adapter). Errors are
    :class:`ConfigError` starting ``"{flag} {path}: "``.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"{flag} {path}: no such folder")
    try:
        latest = latest_checkpoint(folder)
    except (json.JSONDecodeError, KeyError) as err:
        raise ConfigError(f"{flag} {path}: unreadable manifest.json ({err})") from None
    if latest is not None:
        return latest
    if (folder / "manifest.json").is_file():
        raise ConfigError(f"{flag} {path}: the run lists no complete checkpoint yet")
    if (folder / "engine" / "engine.json").is_file():
        return Checkpoint(checkpoint_step(folder), folder, folder / "engine")
    if (folder / "engine.json").is_file() and folder.resolve().name == "engine":
        parent = folder.resolve().parent
        return Checkpoint(checkpoint_step(parent), parent, folder)
    if (folder / "engine.json").is_file() or bare_folder:
        return Checkpoint(checkpoint_step(folder), folder, folder)
    raise ConfigError(f"{flag} {path}: neither a run folder with checkpoints nor a checkpoint folder "
                      "(expected manifest.json, engine/engine.json or engine.json)")


def resolve_init_from(path: str | None) -> str | None:
    """The engine folder ``--init-from`` loads: a run folder's newest checkpoint's ``engine/``,
    a checkpoint's ``engine/``, or the folder itself (an engine or bare adapter folder)."""
    if path is None:
        return None
    return str(resolve_checkpoint(path, flag="init_from", bare_folder=True).engine_dir)


# ---------------------------------------------------------------- the step loop


@dataclass(frozen=True)
class StepLoop:
    """What :func:`run_steps` needs from a trainer (RL or SFT)."""

    run_dir: Path
    config: Any
    """The run's config dataclass: ``sinks``, ``run_name``, ``save_every``; logged to remote sinks."""
    last_step: int
    engine: Any
    """The training engine (``save_state``/``load_state``)."""
    step: Callable[[int], Mapping[str, float]]
    """Run one step (1-based) and return its metrics."""
    progress_fields: Callable[[Mapping[str, float]], dict[str, float]]
    """The numbers shown beside the progress bar, from a step's metrics."""
    checkpoint_state: Callable[[int], TrainerState]
    """The trainer state to save with a checkpoint after this step."""
    restore_state: Callable[[TrainerState], None]
    """Put a resumed checkpoint's trainer state (its totals) back."""
    checkpoint_ready: Callable[[int, bool], bool] | None = None
    """``(step, wait)``: whether the checkpoint saved after ``step`` can be resumed from yet
    (with ``wait``, once what it waits for has ended; the run is ending). A checkpoint is
    listed in ``manifest.json`` only then. ``None``: at once. Sampling ahead
    (``--max-staleness``) needs it: a checkpoint is ready once the groups of the steps
    sampled ahead of it, with weights older than its own, are all stored."""
    checkpoint_listed: Callable[[int], None] | None = None
    """Told the step of each checkpoint once it is listed (the trainer drops the stored
    groups that no resume can need any more)."""
    description: str = "train"
    stop: Callable[[Mapping[str, float]], str | None] | None = None
    """Why to end the run after this step (e.g. its cost budget), or ``None`` to go on;
    the run then checkpoints and ends cleanly."""


def run_steps(loop: StepLoop, *, resume: bool) -> None:
    """Run the steps after the newest checkpoint (``resume``) or from step 1, logging each
    and checkpointing every ``save_every`` steps and at the last step.

    On resume the engine and trainer state come from the newest complete checkpoint (none
    yet: step 1) and metric rows written after it are dropped.

    A checkpoint is saved at once and listed in ``manifest.json`` once the loop's
    ``checkpoint_ready`` says it can be resumed from, checked after every step; the steps
    go on meanwhile. A crash before that resumes from the checkpoint before it. When the
    run ends, it waits for what the checkpoints still wait for and lists them.
    """
    start = _restore(loop) if resume else 0
    cfg, run_dir = loop.config, loop.run_dir
    logger = MetricsLogger(run_dir, sinks=cfg.sinks, run_name=cfg.run_name or run_dir.name,
                           config=dataclasses.asdict(cfg), resume_step=start if resume else None)
    saved: list[int] = []  # checkpoints saved and not listed yet
    with logger, StepProgress(loop.last_step, start=start, description=loop.description) as progress:
        for step in range(start + 1, loop.last_step + 1):
            metrics = loop.step(step)
            logger.log(step, metrics)
            # The step has consumed its own rollout: the checkpoints waiting for it are listed
            # before this step's is written, so a crash while writing it resumes from them.
            saved = _list_ready(loop, saved, wait=False)
            reason = loop.stop(metrics) if loop.stop is not None else None
            if step % cfg.save_every == 0 or step == loop.last_step or reason:
                save_checkpoint(run_dir, loop.engine, loop.checkpoint_state(step), listed=False)
                failpoint("checkpoint_saved", step)
                saved.append(step)
            saved = _list_ready(loop, saved, wait=False)
            progress.update(step, **loop.progress_fields(metrics))
            if reason:
                print(f"step {step}: {reason}", file=sys.stderr)
                break
        for step in _list_ready(loop, saved, wait=True):
            print(f"checkpoint {step} is not listed: a rollout of a later step, sampled ahead with older weights, "
                  f"failed; --resume starts from the checkpoint before it", file=sys.stderr)


def _list_ready(loop: StepLoop, saved: list[int], *, wait: bool) -> list[int]:
    """List the checkpoints of ``saved`` that can be resumed from (waiting for them with
    ``wait``), oldest first; return those that cannot yet."""
    waiting = []
    for step in saved:
        if loop.checkpoint_ready is not None and not loop.checkpoint_ready(step, wait):
            waiting.append(step)
            continue
        list_checkpoint(loop.run_dir, step)
        if loop.checkpoint_listed is not None:
            loop.checkpoint_listed(step)
    return waiting


def _restore(loop: StepLoop) -> int:
    """Load the newest complete checkpoint into the loop's engine and trainer; return its step."""
    latest = latest_checkpoint(loop.run_dir)
    if latest is None:
        return 0
    loop.engine.load_state(latest.engine_dir)
    loop.restore_state(read_trainer_state(latest.folder))
    print(f"resumed {loop.run_dir} from step {latest.step}", file=sys.stderr)
    return latest.step


def load_engine(cfg: ModelConfig, seed: int) -> TrainingClient:
    """The training client of ``cfg``'s engine, starting from the ``--init-from`` weights
    (a run folder's newest checkpoint, or a checkpoint folder) when given."""
    return load_training_client(cfg, seed, resolve_init_from(cfg.init_from))
