"""The run layer without a model: atomic writes, the manifest, the one checkpoint
resolver, and the shared step loop driven by a fake engine (checkpoints, resume)."""

from __future__ import annotations

import dataclasses

import gzip
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from retool import runs
from retool.atomic import (atomic_open, atomic_write_bytes, atomic_write_json, atomic_write_jsonl, atomic_write_text,
                           replace_folder)
from retool.config import ConfigError
from retool.log import read_metrics

# ---------------------------------------------------------------- atomic writes


def test_atomic_writes_replace_the_file_and_leave_no_temporary(tmp_path):
    path = tmp_path / "f.json"
    atomic_write_text(path, "old")
    atomic_write_json(path, {"a": [1, 2]})
    assert json.loads(path.read_text()) == {"a": [1, 2]}
    atomic_write_bytes(tmp_path / "b.bin", b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.bin", "f.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    atomic_write_jsonl(path, [{"x": 1}])

    def rows():
        yield {"x": 2}
        raise RuntimeError("generator died")

    with pytest.raises(RuntimeError, match="generator died"):
        atomic_write_jsonl(path, rows())
    assert path.read_text() == '{"x": 1}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["rows.jsonl"]


def _kill_before_rename(monkeypatch):
    """Make every atomic write die just before its rename, as a kill at that moment would."""
    import retool.atomic

    def killed(src, dst):
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(retool.atomic.os, "replace", killed)


def test_config_view_and_demo_summaries_survive_a_kill_mid_write(tmp_path, monkeypatch):
    """config.json, sft_data.json (atomic_write_json), view.html and the demo's summary files
    are rewritten atomically: a kill during the write leaves the previous content whole."""
    from retool import demo
    from retool.config import save_config
    from retool.report import view
    from retool.report.compare import Comparison, MetricComparison
    from retool.sft import SFTConfig

    for name in ("config.json", "view.html", "summary.json", "summary.md"):
        (tmp_path / name).write_text(f"previous {name}")
    monkeypatch.setattr("retool.report.plots.plot_checkpoints", lambda *a, **k: [])
    monkeypatch.setattr("retool.report.plots.plot_training", lambda *a, **k: [])
    monkeypatch.setattr("retool.report.view.write_view", lambda *a, **k: tmp_path / "view.html")
    _kill_before_rename(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        save_config(SFTConfig(), tmp_path / "config.json")
    with pytest.raises(KeyboardInterrupt):
        gain = Comparison(tmp_path / "a", tmp_path / "b", 1, 0, 0, (MetricComparison("accuracy", 0.5, 0.5, None),))
        demo.report(demo.DemoConfig(), tmp_path, {}, gain, tmp_path)
    monkeypatch.undo()
    _kill_before_rename(monkeypatch)
    fixtures = Path(__file__).parent / "fixtures" / "report" / "run"
    with pytest.raises(KeyboardInterrupt):
        view.write_view([fixtures], tmp_path / "view.html")
    for name in ("config.json", "view.html", "summary.json", "summary.md"):
        assert (tmp_path / name).read_text() == f"previous {name}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "summary.json", "summary.md", "view.html"]


def test_jsonl_counts_rows_keeps_unicode_and_compresses(tmp_path):
    assert atomic_write_jsonl(tmp_path / "a.jsonl", [{"q": "π"}, {"q": "x"}]) == 2
    assert (tmp_path / "a.jsonl").read_text(encoding="utf-8") == '{"q": "π"}\n{"q": "x"}\n'
    atomic_write_jsonl(tmp_path / "a.jsonl.gz", [{"q": "π"}], compress=True)
    with gzip.open(tmp_path / "a.jsonl.gz", "rt", encoding="utf-8") as f:
        assert [json.loads(line) for line in f] == [{"q": "π"}]


def test_streamed_binary_write_and_bad_mode(tmp_path):
    with atomic_open(tmp_path / "b", "wb") as f:
        f.write(b"abc")
    assert (tmp_path / "b").read_bytes() == b"abc"
    with pytest.raises(ValueError, match="whole files"):
        with atomic_open(tmp_path / "c", "a"):
            pass


def test_replace_folder_swaps_whole_folders(tmp_path):
    target, staging = tmp_path / "ckpt", tmp_path / ".ckpt.partial"
    target.mkdir()
    (target / "old.txt").write_text("old")
    staging.mkdir()
    (staging / "sub").mkdir()
    (staging / "sub" / "new.txt").write_text("new")
    assert replace_folder(staging, target) == target
    assert [p.relative_to(target).as_posix() for p in sorted(target.rglob("*"))] == ["sub", "sub/new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# ---------------------------------------------------------------- checkpoints and the resolver


@dataclass
class FakeEngine:
    """Saves and loads a counter the way an engine's save_state/load_state do."""

    value: int = 0
    loaded: list = field(default_factory=list)

    def save_state(self, path: Path) -> Path:
        path.mkdir(parents=True)
        (path / "engine.json").write_text(json.dumps({"value": self.value}))
        return path

    def load_state(self, path: Path) -> None:
        self.value = json.loads((Path(path) / "engine.json").read_text())["value"]
        self.loaded.append(Path(path))


def save(run_dir: Path, step: int, engine: FakeEngine | None = None) -> Path:
    return runs.save_checkpoint(run_dir, engine or FakeEngine(step), runs.TrainerState(step, 2 * step, {"t": 1.0}))


def test_checkpoints_are_listed_in_the_manifest_and_only_complete_ones_count(tmp_path):
    run = tmp_path / "run"
    assert runs.read_manifest(run) == [] and runs.latest_checkpoint(run) is None
    save(run, 2)
    folder = save(run, 1)
    save(run, 2)  # saving a step again replaces its entry
    assert folder == run / "checkpoints" / "step_000001"
    assert [(e.step, e.path) for e in runs.read_manifest(run)] == [(1, "checkpoints/step_000001"),
                                                                  (2, "checkpoints/step_000002")]
    assert runs.read_trainer_state(folder) == runs.TrainerState(1, 2, {"t": 1.0})
    (run / "checkpoints" / "step_000002" / "trainer_state.json").unlink()
    latest = runs.latest_checkpoint(run)
    assert latest == runs.Checkpoint(1, folder, folder / "engine") and latest[0] == 1 and latest.run_dir == run
    assert [c.step for c in runs.list_checkpoints(run)] == [1]
    assert not list((run / "checkpoints").glob(".*"))  # no staging folders left


def test_a_kill_mid_checkpoint_leaves_the_previous_one_newest(tmp_path):
    import subprocess
    import sys

    run = tmp_path / "run"
    save(run, 1)
    script = ("import sys; from pathlib import Path; from tests.test_runs import save; "
              "save(Path(sys.argv[1]), 2)")
    env = {**os.environ, runs.FAILPOINTS_ENV: "checkpoint_write@2",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", script, str(run)], env=env, capture_output=True, timeout=120)
    assert done.returncode == -9
    assert runs.latest_checkpoint(run).step == 1
    assert not (run / "checkpoints" / "step_000002").exists()


def test_one_resolver_for_run_checkpoint_and_engine_folders(tmp_path):
    run = tmp_path / "run"
    save(run, 3)
    newest = save(run, 7)
    for path in (run, newest, newest / "engine"):
        found = runs.resolve_checkpoint(path)
        assert (found.step, found.folder, found.engine_dir) == (7, newest, newest / "engine")
    assert runs.resolve_init_from(str(run)) == str(newest / "engine")
    bare = tmp_path / "adapter"
    bare.mkdir()
    assert runs.resolve_init_from(str(bare)) == str(bare)  # a bare adapter folder is used as it is
    assert runs.resolve_init_from(None) is None
    loose = tmp_path / "weights"
    FakeEngine().save_state(loose)
    assert runs.resolve_checkpoint(loose) == runs.Checkpoint(None, loose, loose)
    (tmp_path / "x").mkdir()
    assert runs.resolve_checkpoint(str(tmp_path / "x" / ".." / "run")).resolved().folder == newest.resolve()


@pytest.mark.parametrize("setup, message", [
    (lambda d: None, "checkpoint {d}: no such folder"),
    (lambda d: d.mkdir(), "checkpoint {d}: neither a run folder with checkpoints nor a checkpoint folder"),
    (lambda d: (d.mkdir(), (d / "manifest.json").write_text('{"checkpoints": []}')),
     "checkpoint {d}: the run lists no complete checkpoint yet"),
    (lambda d: (d.mkdir(), (d / "manifest.json").write_text("{")), "checkpoint {d}: unreadable manifest.json"),
])
def test_resolver_errors_name_the_flag_and_the_path(tmp_path, setup, message):
    folder = tmp_path / "ckpt"
    setup(folder)
    with pytest.raises(ConfigError) as err:
        runs.resolve_checkpoint(folder)
    assert str(err.value).startswith(message.format(d=folder))


def test_an_existing_run_is_refused_unless_resuming(tmp_path):
    run = tmp_path / "run"
    runs.refuse_existing_run(run, resume=False)  # nothing there yet
    save(run, 1)
    with pytest.raises(ConfigError, match=f"already holds a run; pass --resume {run} or choose another --run-dir"):
        runs.refuse_existing_run(run, resume=False)
    runs.refuse_existing_run(run, resume=True)


# ---------------------------------------------------------------- the step loop


@dataclass
class Config:
    sinks: tuple[str, ...] = ("jsonl",)
    run_name: str | None = None
    save_every: int = 2


@dataclass
class CountingTrainer:
    """A trainer whose step adds 1 to the engine's counter and to a running total."""

    engine: FakeEngine = field(default_factory=FakeEngine)
    totals: dict = field(default_factory=lambda: {"steps_total": 0.0})
    crash_at: int | None = None

    def step(self, step: int) -> dict[str, float]:
        if step == self.crash_at:
            raise KeyboardInterrupt
        self.engine.value += 1
        self.totals["steps_total"] += 1
        return {"value": float(self.engine.value), **self.totals}

    def loop(self, run_dir: Path, last_step: int) -> runs.StepLoop:
        return runs.StepLoop(run_dir, Config(), last_step, self.engine, step=self.step,
                             progress_fields=lambda m: {"value": m["value"]},
                             checkpoint_state=lambda s: runs.TrainerState(s, 3 * s, dict(self.totals)),
                             restore_state=lambda state: self.totals.update(state.totals))


def test_the_loop_checkpoints_every_n_steps_and_at_the_last(tmp_path):
    run = tmp_path / "run"
    runs.run_steps(CountingTrainer().loop(run, 5), resume=False)
    assert [e.step for e in runs.read_manifest(run)] == [2, 4, 5]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert runs.read_trainer_state(run / "checkpoints" / "step_000004") == runs.TrainerState(4, 12,
                                                                                               {"steps_total": 4.0})


def test_resume_restores_engine_and_totals_and_drops_later_rows(tmp_path, capsys):
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        runs.run_steps(CountingTrainer(crash_at=4).loop(run, 5), resume=False)
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    resumed = CountingTrainer()
    runs.run_steps(resumed.loop(run, 5), resume=True)
    assert "resumed" in capsys.readouterr().err
    assert resumed.engine.loaded == [run / "checkpoints" / "step_000002" / "engine"]
    rows = read_metrics(run / "metrics.jsonl")
    assert [(r["step"], r["value"], r["steps_total"]) for r in rows] == [(s, s, s) for s in range(1, 6)]
    fresh = CountingTrainer()
    runs.run_steps(fresh.loop(tmp_path / "empty", 1), resume=True)  # resuming a run without checkpoints
    assert fresh.engine.loaded == [] and runs.latest_checkpoint(tmp_path / "empty").step == 1


@dataclass
class LaggingTrainer(CountingTrainer):
    """A trainer whose checkpoint after step ``c`` can be resumed from only once step
    ``c + lag`` has run (the rollouts sampled ahead of it stored), or never for ``broken``."""

    lag: int = 2
    broken: tuple[int, ...] = ()
    done: int = 0
    asked: list = field(default_factory=list)
    listed: list = field(default_factory=list)

    def step(self, step: int) -> dict[str, float]:
        self.done = step
        return super().step(step)

    def ready(self, step: int, wait: bool) -> bool:
        self.asked.append((step, wait))
        return step not in self.broken and (wait or self.done >= step + self.lag)

    def loop(self, run_dir: Path, last_step: int) -> runs.StepLoop:
        return dataclasses.replace(super().loop(run_dir, last_step), checkpoint_ready=self.ready,
                                   checkpoint_listed=self.listed.append)


def test_a_checkpoint_is_listed_only_once_it_can_be_resumed_from(tmp_path, capsys):
    """Saved at once, listed (and so found by --resume) only once what it waits for is
    stored; a crash before that resumes from the checkpoint before it; the run's end waits
    for the rest; one that can never be resumed from stays unlisted, with one line."""
    run = tmp_path / "run"
    trainer = LaggingTrainer(crash_at=6)
    with pytest.raises(KeyboardInterrupt):
        runs.run_steps(trainer.loop(run, 7), resume=False)
    assert (run / "checkpoints" / "step_000004" / "trainer_state.json").is_file()  # saved ...
    assert [e.step for e in runs.read_manifest(run)] == [2] == trainer.listed  # ... not listed: step 6 never ran
    assert (2, False) in trainer.asked and not any(wait for _, wait in trainer.asked)
    resumed = LaggingTrainer()
    runs.run_steps(resumed.loop(run, 7), resume=True)
    assert resumed.engine.loaded == [run / "checkpoints" / "step_000002" / "engine"]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6, 7]
    assert [e.step for e in runs.read_manifest(run)] == [2, 4, 6, 7] and resumed.listed == [4, 6, 7]
    assert (6, True) in resumed.asked and (7, True) in resumed.asked  # the run's end waited for them
    assert "not listed" not in capsys.readouterr().err
    broken = LaggingTrainer(broken=(4,))
    runs.run_steps(broken.loop(tmp_path / "broken", 5), resume=False)
    assert [e.step for e in runs.read_manifest(tmp_path / "broken")] == [2, 5] == broken.listed
    assert capsys.readouterr().err.count("not listed") == 1


def test_a_checkpoint_ready_after_a_step_is_listed_before_that_steps_own_is_written(tmp_path):
    """With one step sampled ahead (lag 1), checkpoint ``c`` can be resumed from once step
    ``c + 1`` has run: it is listed before checkpoint ``c + 1`` is written, so a crash while
    writing that one resumes from ``c`` whatever the timing of the rollouts ahead."""
    run = tmp_path / "run"
    trainer = LaggingTrainer(lag=1)
    listed_when_written = []

    def save_state(path: Path) -> Path:
        listed_when_written.append([e.step for e in runs.read_manifest(run)])
        return FakeEngine.save_state(trainer.engine, path)

    trainer.engine.save_state = save_state
    loop = dataclasses.replace(trainer.loop(run, 4), config=Config(save_every=1))
    runs.run_steps(loop, resume=False)
    assert listed_when_written == [[], [1], [1, 2], [1, 2, 3]]
    assert [e.step for e in runs.read_manifest(run)] == [1, 2, 3, 4]


def test_data_order_is_the_step_number():
    assert runs.batch_indices(3, 2, 5, seed=1) == runs.batch_indices(3, 2, 5, seed=1)
    assert sorted(i for s in (1, 2) for i in runs.batch_indices(s, 2, 4, seed=0)) == [0, 1, 2, 3]
