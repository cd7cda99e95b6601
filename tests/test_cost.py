"""What a run costs (``retool.cost``): price tables, sandbox CPU seconds, ``--price-table``
and ``--max-cost`` of train and sft on any engine (here the local one), eval's cost line,
and run folders saved when the two flags were service settings."""

from __future__ import annotations

import json

import pytest

from retool.cli import main as cli_main
from retool.config import ConfigError
from retool.cost import Prices, load_prices
from retool.log import read_metrics
from retool.runs import latest_checkpoint
from retool.types import ExecStatus, ExecutionResult

pytestmark = pytest.mark.timeout(240)  # tiny models load and train a few steps


def price_table(tmp_path, text: str):
    path = tmp_path / "prices.toml"
    path.write_text(text)
    return path


def test_the_sandbox_cpu_hour_is_priced_with_the_tokens(tmp_path):
    table = price_table(tmp_path, "[local]\nprefill = 1.0\nsample = 2.0\ntrain = 3.0\nsandbox_cpu_hour = 36.0\n")
    prices = load_prices(table, "local", "any")
    assert prices == Prices(1.0, 2.0, 3.0, 36.0)
    step = {"tokens/prefill": 1e6, "tokens/sampled": 1e6, "tokens/trained": 1e6, "sandbox/cpu_s": 100.0}
    assert prices.step_cost(step) == pytest.approx(1.0 + 2.0 + 3.0 + 36.0 * 100 / 3600)
    with pytest.raises(ConfigError, match="no \\[vllm\\] table"):
        load_prices(table, "vllm", "any")
    bad = price_table(tmp_path, "[local]\nsandbox_cpu_hour = -1\n")
    with pytest.raises(ConfigError, match="numbers >= 0"):
        load_prices(bad, "local", "any")


def test_sandbox_metrics_sum_the_cpu_seconds_of_a_window():
    from retool.sandbox import SandboxMetrics

    metrics = SandboxMetrics()
    metrics.record(ExecutionResult(ExecStatus.OK, cpu_s=0.25), 0.1)
    metrics.record(ExecutionResult(ExecStatus.TIMEOUT, cpu_s=1.5), 2.0)
    assert metrics.snapshot(reset=True)["sandbox/cpu_s"] == pytest.approx(1.75)
    assert metrics.snapshot()["sandbox/cpu_s"] == 0.0


def test_max_cost_needs_a_price_table_and_a_positive_budget(tmp_path, capsys):
    for flags, message in ((["--max-cost", "5"], "max_cost needs a price_table"),
                           (["--price-table", "x.toml", "--max-cost", "0"], "max_cost must be > 0")):
        assert cli_main(["train", *flags, "--run-dir", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    from tests.test_sft import openai_row
    from tests.tiny import tiny_model_dir

    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps(openai_row()) + "\n")
    table = price_table(tmp_path, "[tinker]\ntrain = 1.0\n")  # no [local] table: one line, nothing written
    assert cli_main(["sft", "--price-table", str(table), "--data", str(data), "--model", str(tiny_model_dir()),
                     "--run-dir", str(tmp_path / "sft")]) == 2
    err = capsys.readouterr().err
    assert "has no [local] table" in err and "Traceback" not in err
    assert not (tmp_path / "sft").exists()


def test_local_train_is_priced_and_max_cost_stops_after_a_checkpoint(tmp_path, capsys):
    from tests.test_engine_tinker import run_to_max_cost

    run, _ = run_to_max_cost(tmp_path, "local", capsys)

    # a larger budget on --resume carries on from the checkpoint, with the bill so far
    assert cli_main(["train", "--resume", str(run), "--max-cost", "100"]) == 0, capsys.readouterr().err
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[-1]["cost/total"] == pytest.approx(sum(r["cost/step"] for r in rows))


def test_train_sums_the_sandbox_cpu_seconds_into_a_total():
    from retool.train import _add_totals

    totals = {"tokens/prefill_total": 0.0, "tokens/sampled_total": 0.0, "tokens/trained_total": 0.0}
    _add_totals(totals, 10, 4, 4.0, 0.5)
    _add_totals(totals, 10, 4, 4.0, 0.25)
    assert totals["sandbox/cpu_s_total"] == pytest.approx(0.75) and totals["tokens/prefill_total"] == 20


def test_sft_is_priced_and_stops_before_the_budget(tmp_path, capsys):
    from tests.test_sft import openai_row
    from tests.tiny import tiny_model_dir

    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps(openai_row()) + "\n")
    table = price_table(tmp_path, "[local]\ntrain = 1000.0\n")
    run = tmp_path / "sft"
    flags = ["sft", "--model", str(tiny_model_dir()), "--chat-template", "hermes", "--data", str(data),
             "--run-dir", str(run), "--batch-size", "1", "--max-steps", "6", "--save-every", "10",
             "--lora-rank", "4", "--price-table", str(table)]
    assert cli_main(flags + ["--max-cost", "1000"]) == 0, capsys.readouterr().err
    rows = read_metrics(run / "metrics.jsonl")
    trained = rows[0]["tokens/trained"]
    assert [r["cost/step"] for r in rows] == pytest.approx([trained * 1000 / 1e6] * 6)
    assert rows[-1]["cost/total"] == pytest.approx(6 * trained * 1000 / 1e6)

    budget = 2.5 * trained * 1000 / 1e6  # two steps fit, a third would pass it
    run2 = tmp_path / "sft2"
    flags[flags.index(str(run))] = str(run2)
    assert cli_main(flags + ["--max-cost", str(budget)]) == 0, capsys.readouterr().err
    assert [r["step"] for r in read_metrics(run2 / "metrics.jsonl")] == [1, 2]
    assert latest_checkpoint(run2)[0] == 2
    assert "would pass --max-cost" in capsys.readouterr().err


def test_eval_reports_what_its_tokens_and_sandbox_cpu_cost(tmp_path):
    from retool.evaluate import evaluate, format_summary
    from tests.test_evaluate import scripted_eval

    table = price_table(tmp_path, "[local]\nprefill = 1.0\nsample = 2.0\nsandbox_cpu_hour = 3600.0\n")
    cfg, model = scripted_eval(tmp_path, price_table=str(table))
    report = evaluate(cfg, model)
    assert report.usage.prefill > 0 and report.usage.sampled > 0 and report.sandbox_cpu_s >= 0
    assert report.cost == pytest.approx((report.usage.prefill + 2 * report.usage.sampled) / 1e6
                                        + report.sandbox_cpu_s)
    assert "cost of this run" in format_summary(report)
    (tmp_path / "unpriced").mkdir()
    cfg, model = scripted_eval(tmp_path / "unpriced")
    report = evaluate(cfg, model)
    assert report.cost is None and "cost" not in format_summary(report)


def test_a_run_saved_with_the_old_service_settings_resumes(tmp_path):
    from retool.engines import EngineChoice

    saved = {"engine": "tinker", "tinker": {"base_url": None, "price_table": "p.toml", "max_cost": 9.0},
             "pytrio": {"price_table": None, "max_cost": None}}
    upgraded = EngineChoice.upgrade_saved(saved)
    assert upgraded["price_table"] == "p.toml" and upgraded["max_cost"] == 9.0
    assert upgraded["tinker"] == {"base_url": None} and upgraded["pytrio"] == {}


# ---------------------------------------------------------------- each service in its own units

REFERENCE_20_STEPS = {"tokens/prefill": 4.34e6, "tokens/trained": 1.66e6, "tokens/sampled": 1.77e6}
"""The reference run's token counts over its first 20 steps (on PyTRIO)."""


def test_pytrio_is_priced_in_policy_tokens_on_the_reference_runs_counts(tmp_path):
    table = price_table(tmp_path, '[pytrio]\nprefill = 0.2\nsample = 0.6\ntrain = 0.5\n')
    prices = load_prices(table, "pytrio", "Qwen/Qwen3.5-4B")
    assert prices.units == "policy_tokens"
    # by hand: 4.34 M x 0.2 + 1.77 M x 0.6 + 1.66 M x 0.5 = 0.868 + 1.062 + 0.83
    assert prices.step_cost(REFERENCE_20_STEPS) == pytest.approx(2.76)
    # Tinker's counts (cached prefill, every forward/backward token) play no part in these units
    assert prices.step_cost({**REFERENCE_20_STEPS, "tokens/prefill_cached": 4e6, "tokens/forward_backward": 9e6,
                             "engine/checkpoints": 4}) == pytest.approx(2.76)


def test_a_price_table_names_its_units_and_only_their_prices(tmp_path):
    with pytest.raises(ConfigError, match="units 'dollars'"):
        load_prices(price_table(tmp_path, '[tinker]\nunits = "dollars"\n'), "tinker", "m")
    with pytest.raises(ConfigError, match="need units = \"tinker_billing\""):
        load_prices(price_table(tmp_path, '[pytrio]\nprefill_cached = 0.1\n'), "pytrio", "m")
    with pytest.raises(ConfigError, match="numbers >= 0"):
        load_prices(price_table(tmp_path, '[tinker]\nunits = "tinker_billing"\ncheckpoint = true\n'), "tinker", "m")
    tinker = load_prices(price_table(tmp_path, '[tinker]\nunits = "tinker_billing"\nprefill_cached = 0.5\n'
                                               '[tinker."m"]\ncheckpoint = 2.0\n'), "tinker", "m")
    assert (tinker.units, tinker.prefill_cached, tinker.checkpoint) == ("tinker_billing", 0.5, 2.0)


def test_tinker_is_priced_as_its_billing_events_bill_it(tmp_path, monkeypatch, capsys):
    """Two steps on the fake Tinker service, which records what Tinker's billing would
    (its documented event types: prefill cached and not, sampled and trained tokens,
    checkpoints). The bill computed by hand from those events equals the meter's total,
    but for the run's last checkpoint (two operations), which lands after the last step."""
    import tinker

    from tests.fake_tinker import FakeService, install
    from tests.test_engine_tinker import train_args

    service = FakeService(tmp_path / "service", "tinker")
    install(service, monkeypatch)
    usd = {"prefill": 2.0, "prefill_cached": 0.4, "sample": 5.0, "train": 3.0, "checkpoint": 0.01}
    table = price_table(tmp_path, '[tinker]\nunits = "tinker_billing"\n'
                                  + "".join(f"{k} = {v}\n" for k, v in usd.items()))
    run = tmp_path / "run"
    assert cli_main(train_args(tmp_path, run, "tinker") + ["--price-table", str(table)]) == 0, \
        capsys.readouterr().err
    rows = read_metrics(run / "metrics.jsonl")

    t = tinker.types
    per_event = {t.TrainingBillingEvent: lambda e: e.token_count * usd["train"] / 1e6,
                 t.SamplingSampleBillingEvent: lambda e: e.token_count * usd["sample"] / 1e6,
                 t.SamplingPrefillBillingEvent: lambda e: e.token_count * usd[
                     "prefill_cached" if e.cached else "prefill"] / 1e6,
                 t.CheckpointBillingEvent: lambda e: e.count * usd["checkpoint"]}
    bill = sum(per_event[type(e)](e) for e in service.billing)
    last_checkpoint = 2 * usd["checkpoint"]
    assert rows[-1]["cost/total"] == pytest.approx(bill - last_checkpoint, rel=1e-9)
    trained = sum(e.token_count for e in service.billing if isinstance(e, t.TrainingBillingEvent))
    policy = sum(r["tokens/trained"] for r in rows)
    cached = sum(e.token_count for e in service.billing if isinstance(e, t.SamplingPrefillBillingEvent) and e.cached)
    print(f"\ntinker bill {bill:.6f} USD from {len(service.billing)} events; meter {rows[-1]['cost/total']:.6f} "
          f"(+ last checkpoint {last_checkpoint}); forward/backward tokens {trained} vs policy tokens {policy:g} "
          f"({trained / policy:.2f}x); cached prefill {cached}")
    assert trained > policy  # every datum token is billed, not only the trained ones
