"""Metric sinks: JSONL always, resume without duplicates, offline remote sinks."""

from __future__ import annotations

import json
import time

import pytest

from retool.log import MetricsLogger, SinkUnavailable, StepProgress, check_sinks, read_metrics


def test_jsonl_rows_and_nonfinite_values(tmp_path):
    with MetricsLogger(tmp_path) as log:
        log.log(1, {"reward/mean": 0.5, "train/loss": float("nan")})
        log.log(2, {"reward/mean": -0.25})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows == [{"step": 1, "reward/mean": 0.5, "train/loss": "nan"},
                    {"step": 2, "reward/mean": -0.25}]


def test_resume_drops_rows_after_checkpoint(tmp_path):
    with MetricsLogger(tmp_path) as log:
        for step in range(1, 8):
            log.log(step, {"x": step})
    with MetricsLogger(tmp_path, resume_step=5) as log:
        log.log(6, {"x": 60})
    assert [(r["step"], r["x"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        (1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (6, 60)]


def test_fresh_run_starts_a_new_file(tmp_path):
    with MetricsLogger(tmp_path) as log:
        log.log(1, {"x": 1})
    with MetricsLogger(tmp_path) as log:
        log.log(1, {"x": 2})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "x": 2}]


def test_torn_last_line_is_ignored_but_corruption_is_not(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "x"')
    assert read_metrics(path) == [{"step": 1}]
    path.write_text('{"step": 1, "x\n{"step": 2}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:1"):
        read_metrics(path)


def test_unknown_or_missing_sink_fails_early(monkeypatch):
    with pytest.raises(ValueError, match="unknown metric sink 'mlflow'"):
        check_sinks(("jsonl", "mlflow"))
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: None if n == "wandb" else real(n))
    with pytest.raises(SinkUnavailable, match="pip install wandb"):
        check_sinks(("wandb",))


def test_tensorboard_sink_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, sinks=("jsonl", "tensorboard")) as log:
        log.log(1, {"reward/mean": 0.25})
        log.log(2, {"reward/mean": 0.75})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("reward/mean")] == [0.25, 0.75]


def test_wandb_offline_run_records_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("swanlab")  # its W&B importer reads the offline log back
    from wandb.proto import wandb_internal_pb2

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with MetricsLogger(tmp_path, sinks=("jsonl", "wandb"), run_name="t", config={"lr": 1.0}) as log:
        log.log(1, {"reward/mean": 0.5})
        log.log(2, {"reward/mean": 0.75})
    (path,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    for _ in range(100):  # wandb's service may still be writing the log when finish() returns
        records = [wandb_internal_pb2.Record.FromString(raw)
                   for raw in _datastore_records(path, "swanlab.converter.wb.wbdatastore", "WBDataStoreReader")]
        kinds = [r.WhichOneof("record_type") for r in records]
        if "exit" in kinds:
            break
        time.sleep(0.1)
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            rows.append((items["_step"], items["reward/mean"]))
    assert rows == [(1, 0.5), (2, 0.75)], (kinds, path.stat().st_size)


def test_swanlab_offline_run_records_metrics(tmp_path, monkeypatch):
    pytest.importorskip("swanlab")
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record

    monkeypatch.setenv("SWANLAB_MODE", "offline")
    with MetricsLogger(tmp_path, sinks=("jsonl", "swanlab"), run_name="t") as log:
        log.log(1, {"reward/mean": 0.5})
        log.log(2, {"reward/mean": 0.75})
    (path,) = (tmp_path / "swanlog").glob("run-*/run-*.swanlab")
    rows = []
    for raw in _datastore_records(path, "swanlab.sdk.internal.core_python.store", "DataStoreReader"):
        record = Record()
        record.ParseFromString(raw)
        if record.HasField("scalar") and record.scalar.key == "reward/mean":
            rows.append((record.scalar.step, record.scalar.value.number))
    assert rows == [(1, 0.5), (2, 0.75)]


def _datastore_records(path, module: str, reader: str) -> list[bytes]:
    """Every record of a W&B / SwanLab offline log (LevelDB log format), read back with the
    reader swanlab ships (its W&B importer reads ``.wandb`` files)."""
    import importlib

    store = getattr(importlib.import_module(module), reader)()
    records = []
    store.open(path)
    try:
        while (raw := store.scan()) is not None:
            records.append(raw)
    finally:
        store.close()
    return records


def test_progress_prints_plain_lines_off_terminal(capsys):
    with StepProgress(total=3) as bar:
        bar.update(1, reward=0.5)
        bar.update(2, reward=-0.25)
    err = capsys.readouterr().err
    assert "step 1/3" in err and "reward=0.5" in err and "step 2/3" in err
