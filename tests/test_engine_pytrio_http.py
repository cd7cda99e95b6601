"""``retool train --engine pytrio`` through the whole, unmodified PyTRIO SDK, against a
local HTTP server that speaks PyTRIO's Control and Actor APIs
(``tests/fake_pytrio_http.py``).

Faults are injected below the SDK — HTTP 429/500 answers, dropped connections, slow
answers, an event carried out but answered 500 — so the SDK's own machinery retries them
(its Control and Actor request retries, its sampling stream retries); the run counts
those retries in ``engine/retries`` (:mod:`retool.engines.sdk_retries`) and never
re-sends anything itself. An ``optim_step`` re-sent by the SDK carries the same event id,
which the Actor deduplicates (``409 event_exists``): it is applied once. A 401 stops the
run with one line. The SDK's retry delays are shortened here (``pytrio.configure``) to
keep these tests fast; what is retried, and how often, is the SDK's own. Not covered:
resume/export over HTTP (the in-process fake in ``tests/fake_tinker.py`` covers them).
"""

from __future__ import annotations

import pytest

import pytrio  # the test extra pins the SDK: missing, these tests fail, never skip
from pytrio.config import config as pytrio_config

from retool.cli import main as cli_main
from retool.log import read_metrics
from tests.fake_pytrio_http import PytrioHTTPFake
from tests.test_engine_tinker import train_args

pytestmark = pytest.mark.timeout(120)
SECRET = "pytrio-planted-http-secret-7777777777"


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """The fake server, and the SDK configured for it (it reads ``PYTRIO_API_KEY`` when it
    is imported, so the key is configured directly; everything is restored after)."""
    saved = pytrio_config.configuration.model_copy(deep=True)
    saved_key = pytrio_config.auth_state.api_key
    monkeypatch.setenv("PYTRIO_API_KEY", SECRET)  # what retool scrubs from its messages
    pytrio.configure(api_key=SECRET, home=str(tmp_path / "home"), retry_initial_delay_seconds=0.05,
                     retry_max_delay_seconds=0.2)
    try:
        with PytrioHTTPFake(tmp_path / "service", SECRET) as server:
            yield server
    finally:
        for name in type(saved).model_fields:
            setattr(pytrio_config.configuration, name, getattr(saved, name))
        pytrio_config.auth_state.api_key = saved_key


def http_train_args(tmp_path, fake: PytrioHTTPFake, steps: int = 2) -> list[str]:
    # the HTTP fake serves no prompt logprobs (compute_logprobs): these runs test the SDK's retries, and the
    # weight-sync guard runs against the in-process fake (tests/test_weight_sync.py)
    return train_args(tmp_path, tmp_path / "run", "pytrio", steps=steps) + ["--pytrio-base-url", fake.url,
                                                                         "--weight-sync-check-every", "0"]


def assert_no_secret(tmp_path, captured) -> None:
    """Not in retool's output, its run folder, nor the SDK's own files (its telemetry spool)."""
    assert SECRET not in captured.out + captured.err
    for path in [*(tmp_path / "run").rglob("*"), *(tmp_path / "home").rglob("*")]:
        if path.is_file() and path.suffix != ".gz":
            assert SECRET.encode() not in path.read_bytes(), path


def test_a_fault_free_run_counts_no_retries(tmp_path, fake, capsys):
    assert cli_main(http_train_args(tmp_path, fake, steps=1)) == 0, capsys.readouterr().err
    row = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert row["engine/retries"] == 0 and row["engine/errors"] == 0, dict(fake.hits)
    assert fake.executed["trainer.optimize_step"] == fake.hits["trainer.optimize_step"] == 1
    assert_no_secret(tmp_path, capsys.readouterr())
    with capsys.disabled():
        print(f"\nrequests {dict(fake.hits)}")


def test_faults_below_the_sdk_are_retried_by_it_counted_and_applied_once(tmp_path, fake, capsys):
    pytrio.configure(actor_event_polling_timeout_seconds=1)  # a poll answered later than this is re-sent
    fake.fail("sample", 429)
    fake.fail("sample", 500)
    fake.fail("sample", "drop")
    fake.fail("sampling-runs", 503)
    fake.fail("trainer.forward_backward", 500)
    fake.fail("trainer.optimize_step", "applied-500")  # carried out, answer lost: the SDK re-sends the event id
    fake.fail("trainer.save_weights", "drop")
    fake.fail("events/get", "delay:3")
    assert cli_main(http_train_args(tmp_path, fake, steps=1)) == 0, capsys.readouterr().err
    row = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert row["engine/errors"] == 0  # the SDK absorbed every fault
    assert row["engine/retries"] == 8, (row["engine/retries"], str(dict(fake.hits)))
    assert fake.hits["sample"] == fake.executed["sample"] + 3  # each fault re-sent once
    # retool sent one optim_step; the SDK re-sent it with the same event id, which the
    # Actor answered 409 event_exists: one update, as without faults
    assert fake.hits["trainer.optimize_step"] == 2 and fake.executed["trainer.optimize_step"] == 1
    assert fake.service.training_clients[-1].local.optim_steps == 1
    assert_no_secret(tmp_path, capsys.readouterr())
    with capsys.disabled():
        print(f"\nHTTP faults: 8 injected, engine/retries {row['engine/retries']:g}, requests {dict(fake.hits)}")


@pytest.mark.parametrize("endpoint", ["api-key/verify", "service-sessions", "training-runs"])
def test_a_401_stops_the_run_with_one_line(endpoint, tmp_path, fake, capsys):
    fake.fail(endpoint, 401)
    assert cli_main(http_train_args(tmp_path, fake)) == 2
    err = capsys.readouterr().err
    assert "refused the credentials" in err and "PYTRIO_API_KEY" in err and SECRET not in err, err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [err.strip().splitlines()[-1]]
    assert "Traceback" not in err
    assert fake.hits[endpoint] == 1  # not retried
    assert not list((tmp_path / "run").rglob("metrics.jsonl"))


def test_the_retry_timeout_retool_sets_is_the_sdks(tmp_path, fake, capsys):
    """``--pytrio-retry-timeout-s`` is the SDK's own ``*_retry_timeout_seconds``: a sample
    request still failing that long after its first failure is given up by the SDK;
    retool counts the error and the trainer re-runs the rollout (never the update)."""
    fake.fail_for("sample", 503, seconds=0.8)  # a sample request failing in its first 0.3 s is given up
    args = http_train_args(tmp_path, fake, steps=1) + ["--pytrio-retry-timeout-s", "0.5", "--max-retries", "4"]
    assert cli_main(args) == 0, capsys.readouterr().err
    row = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert row["engine/errors"] >= 1 and row["engine/retries"] > row["engine/errors"], row
    assert fake.executed["trainer.optimize_step"] == 1
    captured = capsys.readouterr()
    assert "503" in captured.err  # the SDK's error, via the rollout retry
    assert_no_secret(tmp_path, captured)
