"""The weight-sync guard (``retool.weight_sync``): a real tiny-model run passes it, a
sampler that keeps old weights is caught with one line, a step that applied no update
expects identical logprobs, and the service engines' probe runs on the fake services."""

from __future__ import annotations

import os

import pytest

from retool.engines import engine_spec
from retool.log import read_metrics
from retool.train import build_trainer, train, train_step
from retool.weight_sync import Probe, WeightSyncError, WeightSyncGuard
from tests.fake_tinker import FakeService, install
from tests.test_train import digit_problems, tiny_config

pytestmark = pytest.mark.timeout(300)  # tiny models load


def test_a_tiny_local_run_passes_the_guard_and_reports_it(tmp_path):
    rows = read_metrics(train(tiny_config(tmp_path, max_steps=3, save_every=100)) / "metrics.jsonl")
    assert [r["weight_sync/changed"] for r in rows] == [0.0, 1.0, 1.0]  # the first check has nothing before it
    for row in rows:
        assert 0 <= row["weight_sync/max_abs_diff"] <= 1e-3
        assert 0 < row["time/weight_sync"] < row["time/step"]


def test_a_sampler_that_skips_the_re_merge_stops_the_run_with_one_line(tmp_path, monkeypatch):
    """The stale-merge bug: the lean decode steps keep the LoRA merge of the first weights."""
    from retool.engines.local import lean_decode

    real, first = lean_decode.decode_weights, []

    def merged_once(model, previous=None, dtype=None):
        first or first.append(real(model, dtype=dtype))
        return first[0]

    monkeypatch.setattr(lean_decode, "decode_weights", merged_once)
    trainer = build_trainer(tiny_config(tmp_path))
    try:
        train_step(trainer, 1)
        with pytest.raises(WeightSyncError) as caught:
            train_step(trainer, 2)
    finally:
        trainer.sandbox is None or trainer.sandbox.close()
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("weight-sync check failed on engine local at step 2: ")
    assert "max |Δlogprob|" in message and "tolerance 0.001" in message


def test_a_step_without_an_update_expects_identical_logprobs(tmp_path):
    """Gold answer 77: the digit model never says it, every group is degenerate and
    dropped, no optim_step runs; the next check must find the same logprobs."""
    cfg = tiny_config(tmp_path, train_data=str(digit_problems(tmp_path / "never.jsonl", answer="77")),
                      drop_degenerate_groups=True, max_steps=2, save_every=100)
    rows = read_metrics(train(cfg) / "metrics.jsonl")
    assert [r["train/datums"] for r in rows] == [0.0, 0.0]
    assert [r["weight_sync/changed"] for r in rows] == [0.0, 0.0]


class ScriptedSide:
    """One side of the probe with scripted logprobs, for the guard's own rules."""

    def __init__(self, *answers: tuple[float, ...]) -> None:
        self.answers = list(answers)

    def compute_logprobs(self, tokens, start):
        return self.answers.pop(0)


class ScriptedSampler(ScriptedSide):
    async def compute_logprobs(self, tokens, start):
        return self.answers.pop(0)


def guard() -> WeightSyncGuard:
    return WeightSyncGuard("local", Probe((1, 2, 3, 4), 2), tolerance=1e-3)


def test_an_update_below_the_tolerance_must_still_move_the_sampler():
    g = guard()
    trainer = ScriptedSide((-1.0, -2.0), (-1.0002, -2.0))
    g.check(1, trainer, ScriptedSampler((-1.0, -2.0)))
    with pytest.raises(WeightSyncError, match="at step 2: the trainer's weights changed since step 1 .* the "
                                              "sampler kept the old weights"):
        g.check(2, trainer, ScriptedSampler((-1.0, -2.0)))


def test_a_sampler_that_moves_without_an_update_is_caught_and_checks_run_every_n_steps():
    g = guard()
    g.check(1, ScriptedSide((-1.0, -2.0)), ScriptedSampler((-1.0, -2.0)))
    with pytest.raises(WeightSyncError, match="no update was applied since step 1, but the sampler's logprobs moved"):
        g.check(2, ScriptedSide((-1.0, -2.0)), ScriptedSampler((-1.0, -2.0001)))
    # A service's two sampling clients of the same weights may differ by noise: only the stale
    # direction (trainer moved, sampler bit-identical) stops a run there.
    service = WeightSyncGuard("tinker", Probe((1, 2, 3), 1), 0.25, repeatable=False)
    service.check(1, ScriptedSide((-1.0, -2.0)), ScriptedSampler((-1.0, -2.0)))
    assert service.check(2, ScriptedSide((-1.0, -2.0)), ScriptedSampler((-1.0, -2.0001)))["weight_sync/changed"] == 0
    with pytest.raises(WeightSyncError, match="the sampler kept the old weights"):
        service.check(3, ScriptedSide((-1.1, -2.0)), ScriptedSampler((-1.0, -2.0001)))
    assert not engine_spec("tinker").capabilities.weight_sync_repeatable
    assert engine_spec("local").capabilities.weight_sync_repeatable
    every = WeightSyncGuard("local", Probe((1, 2, 3), 1), 1e-3, every=3)
    assert every.check(2, ScriptedSide(), ScriptedSampler()) == {}  # not due: neither side is asked
    assert every.check(3, ScriptedSide((-1.0, -1.0)), ScriptedSampler((-1.0, -1.0)))["weight_sync/max_abs_diff"] == 0


@pytest.mark.parametrize("flavour", ["tinker", "pytrio"])
def test_the_service_engines_probe_passes_and_a_kept_sampling_client_is_caught(flavour, tmp_path, monkeypatch):
    """The fake services answer the SDKs' compute_logprobs (sampler) and forward (trainer)
    with the real types; keeping step 1's sampling client after an update is caught."""
    install(FakeService(tmp_path / "service", flavour), monkeypatch)
    trainer = build_trainer(tiny_config(tmp_path, engine=flavour, lora_rank=4, lora_alpha=32.0, lr=1e-2))
    try:
        swap, kept = trainer.engine.save_weights_for_sampler, []

        def keep_the_first(name=None):
            kept or kept.append(swap())
            return kept[0]

        monkeypatch.setattr(trainer.engine, "save_weights_for_sampler", keep_the_first)
        metrics, _ = train_step(trainer, 1)
        assert metrics["weight_sync/max_abs_diff"] <= 1e-4  # the fake's sampler and trainer are one stack
        with pytest.raises(WeightSyncError, match=f"on engine {flavour} at step 2: "):
            train_step(trainer, 2)
    finally:
        trainer.sandbox is None or trainer.sandbox.close()


def test_the_cost_of_a_check_against_the_step_on_the_tiny_model(tmp_path):
    """Measured, not asserted beyond sanity: the check's share of a step (printed)."""
    rows = read_metrics(train(tiny_config(tmp_path, max_steps=3, save_every=100)) / "metrics.jsonl")
    check = sum(r["time/weight_sync"] for r in rows) / len(rows)
    step = sum(r["time/step"] for r in rows) / len(rows)
    print(f"\nweight-sync check {check * 1e3:.1f} ms per step vs step {step * 1e3:.0f} ms: ratio {check / step:.3f} "
          f"(load {os.getloadavg()[0]:.2f})")
    assert check < step


def test_non_finite_logprobs_and_a_side_that_fails_are_one_line_errors():
    with pytest.raises(WeightSyncError, match="max |Δlogprob| nan > tolerance"):
        guard().check(1, ScriptedSide((-1.0, float("nan"))), ScriptedSampler((-1.0, -2.0)))
    with pytest.raises(WeightSyncError, match="the sampler returned 1 logprobs for the probe's 2 answer tokens"):
        guard().check(1, ScriptedSide((-1.0, -2.0)), ScriptedSampler((-1.0,)))

    class Down(ScriptedSampler):
        async def compute_logprobs(self, tokens, start):
            raise RuntimeError("http://127.0.0.1:8000/v1/completions answered 503:\n busy")

    with pytest.raises(WeightSyncError, match="at step 1: the probe could not be scored: .* answered 503: busy$"):
        guard().check(1, ScriptedSide((-1.0, -2.0)), Down())
