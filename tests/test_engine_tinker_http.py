"""``retool train --engine tinker`` through the whole, unmodified Tinker SDK, against a
local HTTP server that speaks Tinker's API (``tests/fake_tinker_http.py``).

Faults are injected below the SDK — HTTP 429/500/408 answers, dropped connections, an
answer lost after the request was carried out — so the SDK's own machinery retries them
(its HTTP client, its request layer, its futures, its sampling retry handler); the run
counts those retries in ``engine/retries`` and never re-sends anything itself. A 401
stops the run with one line. What this does not cover: PyTRIO (its SDK has its own
transport: ``tests/test_engine_pytrio_http.py``), and resume/export over HTTP (``load_weights`` and weight downloads are not served; the
in-process fake covers them)."""

from __future__ import annotations

import pytest

import tinker  # noqa: F401 -- the test extra pins the SDK: missing, these tests fail, never skip

from retool.cli import main as cli_main
from retool.log import read_metrics
from tests.fake_tinker_http import TinkerHTTPFake
from tests.test_engine_tinker import train_args

pytestmark = pytest.mark.timeout(240)  # a tiny model trains over HTTP, with the SDK's retry backoffs
SECRET = "tml-planted-http-secret-5555555555"


@pytest.fixture
def fake(tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", SECRET)
    with TinkerHTTPFake(tmp_path / "service") as server:
        yield server


def http_train_args(tmp_path, fake: TinkerHTTPFake, steps: int = 2) -> list[str]:
    # the HTTP fake serves no prompt logprobs (compute_logprobs): these runs test the SDK's retries, and the
    # weight-sync guard runs against the in-process fake (tests/test_weight_sync.py)
    return train_args(tmp_path, tmp_path / "run", "tinker", steps=steps) + ["--tinker-base-url", fake.url,
                                                                         "--weight-sync-check-every", "0"]


def test_faults_below_the_sdk_are_retried_by_it_counted_and_applied_once(tmp_path, fake, capsys):
    fake.fail("asample", 429)
    fake.fail("asample", 500)
    fake.fail("asample", "drop")
    fake.fail("forward_backward", 500)
    fake.fail("optim_step", "applied-500")  # carried out, answer lost: the SDK re-sends the same sequence id
    fake.fail("retrieve_future", 408)
    fake.fail("save_weights_for_sampler", "drop")
    counted = 6  # the 429 on a sample request is backpressure: the SDK waits and re-sends, and reports nothing
    assert cli_main(http_train_args(tmp_path, fake)) == 0, capsys.readouterr().err
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert sum(r["engine/errors"] for r in rows) == 0  # the SDK absorbed every fault
    assert fake.hits["asample"] == fake.executed["asample"] + 3  # each fault re-sent once
    retries = sum(r["engine/retries"] for r in rows)
    assert retries == counted, (retries, dict(fake.hits))
    # retool sent one optim_step a step; the SDK re-sent the one whose answer was lost,
    # and the service carried out each sequence id once: two updates, as without faults
    assert fake.hits["optim_step"] == 3 and fake.executed["optim_step"] == 2
    assert fake.service.training_clients[-1].local.optim_steps == 2
    print(f"\nHTTP faults: 7 injected, engine/retries {retries:g}, requests {dict(fake.hits)}")

    captured = capsys.readouterr()
    assert SECRET not in captured.out + captured.err
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file() and path.suffix != ".gz":
            assert SECRET.encode() not in path.read_bytes(), path


def test_a_fault_free_run_counts_no_retries(tmp_path, fake, capsys):
    assert cli_main(http_train_args(tmp_path, fake, steps=1)) == 0, capsys.readouterr().err
    row = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert row["engine/retries"] == 0 and row["engine/errors"] == 0
    assert fake.executed["optim_step"] == fake.hits["optim_step"] == 1
    # the run finished its session: the SDK's heartbeat, config refresh and telemetry for
    # it stopped, so they cannot retry into a later run's count once this server is gone
    assert [status for _, status in fake.finished] == ["success"]


def test_the_progress_timeout_retool_sets_is_the_sdks(tmp_path, fake, capsys):
    """``--tinker-retry-timeout-s`` is the SDK's own ``RetryConfig.progress_timeout``: a
    sample request that makes no progress for that long is given up by the SDK; retool
    counts the error and the trainer re-runs the rollout (never the update)."""
    fake.fail("asample", "delay:8")
    args = http_train_args(tmp_path, fake, steps=1) + ["--tinker-retry-timeout-s", "2"]
    assert cli_main(args) == 0, capsys.readouterr().err
    row = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert row["engine/errors"] >= 1 and row["engine/retries"] >= 1
    assert fake.executed["optim_step"] == 1
    assert "No progress made in 2" in capsys.readouterr().err  # the SDK's own message, via the rollout retry


@pytest.mark.parametrize("endpoint", ["client/config", "create_session", "create_model"])
def test_a_401_stops_the_run_with_one_line(endpoint, tmp_path, fake, capsys):
    fake.fail(endpoint, 401)
    assert cli_main(http_train_args(tmp_path, fake)) == 2
    err = capsys.readouterr().err
    assert "refused the credentials" in err and "TINKER_API_KEY" in err and SECRET not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [err.strip().splitlines()[-1]]
    assert "Traceback" not in err
    assert fake.hits[endpoint] == 1  # not retried
    # a session that was opened is finished even though the run could not start
    assert [status for _, status in fake.finished] == (["errored"] if endpoint == "create_model" else [])
