"""Sampling ahead of training (``--max-staleness K``, ``retool/pipeline.py``): the weight
version of every token and the lag of every trained group on the local engine and the
Tinker fake, a reproducible data order, a hand-computed PPO loss on a group sampled with
older weights, the staleness metrics, refusals before anything loads, and SIGKILL/resume."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from pathlib import Path

import pytest
import torch

import tests.test_train as test_train
from retool import algo, pipeline
from retool.config import ConfigError, make_config
from retool.engines import AdamParams, SamplingParams
from retool.engines.local import LocalEngineConfig, LocalTrainingClient
from retool.log import read_metrics
from retool.train import TrainConfig, build_trainer, train
from retool.types import NOT_SAMPLED, Grade, Trajectory
from tests.fake_tinker import FAKE_LORA_ALPHA, FakeService, install
from tests.test_engine_tinker import PPO, one_torch_thread  # noqa: F401 (one_torch_thread: autouse)
from tests.test_train import assert_resumed_like, cli_args, problem_order, run_cli, saved_step_groups, tiny_config
from tests.tiny import boxed_digit_model_dir

pytestmark = pytest.mark.timeout(300)

PIPELINE_TIMINGS = ("time/rollout_wait", "time/rollout_ahead")


def sampled_versions(run: Path, step: int) -> list[int]:
    """The weight version of every sampled token of ``step``'s saved trajectories."""
    lines, _ = saved_step_groups(run, step)
    out = []
    for line in lines:
        t = line["trajectory"]
        assert all((v == NOT_SAMPLED) == (not m) for v, m in zip(t["versions_T"], t["mask_T"]))
        out += [v for v in t["versions_T"] if v != NOT_SAMPLED]
    return out


def assert_lagged(run: Path, max_staleness: int) -> list[dict]:
    """Every step ``t`` trained groups sampled with weights ``max(1, t - K)``, and logged that lag."""
    rows = read_metrics(run / "metrics.jsonl")
    for row in rows:
        step = row["step"]
        version = max(1, step - max_staleness)
        assert set(sampled_versions(run, step)) == {version}, step
        assert row["staleness/mean"] == row["staleness/max"] == step - version
        assert row[f"staleness/share_lag_{step - version}"] == 1.0
        assert sum(row[f"staleness/share_lag_{j}"] for j in range(max_staleness + 1)) == pytest.approx(1.0)
    return rows


# ---------------------------------------------------------------- the metrics and the bound, by hand


def trajectory(versions: tuple[int, ...]) -> Trajectory:
    mask = tuple(int(v != NOT_SAMPLED) for v in versions)
    return Trajectory("p", 1, tuple(range(1, len(versions) + 1)), mask, (0.0,) * len(versions), (),
                      Grade(1.0, True, True), versions_T=versions)


def test_staleness_metrics_weigh_every_sampled_token():
    ts = [trajectory((NOT_SAMPLED, 4, 4, 4)), trajectory((NOT_SAMPLED, 5, NOT_SAMPLED, 5))]
    assert pipeline.staleness_metrics(5, ts, 2) == {
        "staleness/mean": 3 / 5, "staleness/max": 1.0, "staleness/share_lag_0": 2 / 5,
        "staleness/share_lag_1": 3 / 5, "staleness/share_lag_2": 0.0}
    pipeline.check_within(5, ts, 1)
    with pytest.raises(pipeline.StalenessError, match="step 6: a group sampled with weights 4 is more than "
                                                      "--max-staleness 1"):
        pipeline.check_within(6, ts, 1)
    assert pipeline.staleness_metrics(5, [trajectory((NOT_SAMPLED,))], 1) == {}


def test_the_pipeline_runs_each_step_once_in_order_on_the_version_it_was_due():
    seen: list[tuple[int, int, int | None]] = []

    def job(step, version, before):
        seen.append((step, version, before))
        return step

    ahead = pipeline.Pipeline[int](max_staleness=2, last_step=5, chained=True)
    assert [ahead.advance(step, job) for step in (3, 4, 5)] == [3, 4, 5]  # a run resumed at step 3
    assert seen == [(3, 3, None), (4, 3, 3), (5, 3, 4)]
    assert [ahead.version_of(s, first=3) for s in (3, 4, 5, 6)] == [3, 3, 3, 4]
    failing = pipeline.Pipeline[int](max_staleness=1, last_step=3)
    with pytest.raises(ZeroDivisionError):
        failing.advance(1, lambda step, version, before: 1 // (step - 1))
    with pytest.raises(ValueError, match="max_staleness >= 1"):
        pipeline.Pipeline[int](max_staleness=0, last_step=3)


def test_unchained_rollouts_of_later_steps_run_while_an_earlier_one_is_held():
    """Nothing passes between the rollouts (no difficulty pool): step 1's rollout, held
    up (a sandbox call running to its timeout), does not hold step 2's, which ends first
    on the version it was due; chained, step 2 would wait for step 1 (the probe: the
    same jobs deadlock-free only unchained)."""
    step2_done = threading.Event()
    versions: dict[int, tuple[int, object]] = {}

    def job(step, version, before):
        versions[step] = (version, before)
        if step == 1:
            assert step2_done.wait(10), "step 2's rollout did not run while step 1's was held"
        else:
            step2_done.set()
        return step

    ahead = pipeline.Pipeline[int](max_staleness=1, last_step=3)
    assert [ahead.advance(step, job) for step in (1, 2, 3)] == [1, 2, 3]
    assert versions == {1: (1, None), 2: (1, None), 3: (2, None)}
    finished: list[int] = []

    def chained_job(step, version, before):
        if step == 1:
            time.sleep(0.3)  # unchained, step 2 would start meanwhile and fail below
        else:
            assert finished == [1] and before == 1, "a chained rollout started before the one it continues"
        finished.append(step)
        return step

    chained = pipeline.Pipeline[int](max_staleness=1, last_step=2, chained=True)
    assert [chained.advance(step, chained_job) for step in (1, 2)] == [1, 2]
    unchained = pipeline.Pipeline[int](max_staleness=1, last_step=2)
    finished.clear()
    with pytest.raises(AssertionError, match="started before"):  # the probe sees an unchained start
        [unchained.advance(step, chained_job) for step in (1, 2)]


def test_a_checkpoint_waits_for_no_rollout_and_is_ready_once_those_ahead_have_ended():
    """What a checkpoint after step 1 waits for (the rollouts of steps 2-3, sampled ahead
    with older weights) is told by ``ended``, without waiting: false while one is held, true
    once all have ended, never for one that failed, nor for a step not yet submitted."""
    release, failing = threading.Event(), {3}

    def job(step, version, before):
        if step == 3:
            assert release.wait(10)
        if step in failing:
            raise OSError("the service went away")
        return step

    ahead = pipeline.Pipeline[int](max_staleness=2, last_step=5)
    assert ahead.advance(1, job) == 1 and ahead.submitted == 3
    assert not ahead.ended(3) and not ahead.ended(4)  # step 3 held; step 4 not submitted
    deadline = time.monotonic() + 10
    while not ahead.ended(2):  # step 2's rollout ends on its own while step 3's is held
        assert time.monotonic() < deadline
        time.sleep(0.01)
    release.set()
    ahead.drain()
    assert not ahead.ended(3)  # step 3 failed: a checkpoint waiting for it is never ready
    failing.clear()
    clean = pipeline.Pipeline[int](max_staleness=2, last_step=5)
    assert clean.advance(1, job) == 1
    clean.drain()
    assert clean.ended(3) and clean.advance(2, job) == 2 and clean.ended(4)


# ---------------------------------------------------------------- whole runs


@pytest.mark.parametrize("extra", [{}, {"refill_rounds": 2}, {"drop_degenerate_groups": True},
                                   {"curriculum": "difficulty", "refill_rounds": 1}],
                         ids=["plain", "refills", "drop-degenerate", "curriculum"])
def test_a_lagged_run_on_the_local_engine_records_versions_and_is_reproducible(tmp_path, extra):
    runs = [train(tiny_config(tmp_path, run_dir=str(tmp_path / name), max_steps=4, max_staleness=1,
                              save_trajectories=True, save_every=2, **extra)) for name in ("a", "b")]
    rows = assert_lagged(runs[0], 1)
    assert problem_order(runs[0]) == problem_order(runs[1])  # the data order does not depend on thread timing
    for row, again in zip(rows, read_metrics(runs[1] / "metrics.jsonl")):
        for name in row.keys() - set(test_train.TIMING_METRICS) - set(PIPELINE_TIMINGS):
            # as a resumed run is compared: the sampler's logprobs round with the rows beside them
            tolerance = 1e-5 if name in test_train.ROUNDING_METRICS else 1e-7
            assert again[name] == pytest.approx(row[name], rel=1e-5, abs=tolerance), (row["step"], name)
    for row in rows:
        _, groups = saved_step_groups(runs[0], row["step"])
        informative = sum(1 for rewards in groups.values() if len(set(rewards)) > 1)
        if extra:
            assert row["train/groups"] == informative <= 2
    assert not list((runs[0] / "rollouts").glob("step_00000[12]"))  # covered by checkpoint 2, then dropped


def test_k0_builds_no_pipeline_and_logs_no_staleness(tmp_path):
    cfg = tiny_config(tmp_path, max_steps=1)
    assert cfg.max_staleness == 0
    trainer = build_trainer(cfg)
    assert trainer.pipeline is None
    run = train(cfg)
    assert not any(k.startswith("staleness/") for row in read_metrics(run / "metrics.jsonl") for k in row)


@pytest.mark.parametrize("engine", ["tinker", "pytrio"])
def test_a_lagged_run_on_the_service_fakes(tmp_path, monkeypatch, engine):
    """The service's older sampling clients keep sampling their snapshot while it trains."""
    service = FakeService(tmp_path / "service", engine)
    install(service, monkeypatch)
    run = train(tiny_config(tmp_path, engine=engine, lora_alpha=FAKE_LORA_ALPHA, max_steps=4, max_staleness=2,
                            save_trajectories=True, save_every=100))
    rows = assert_lagged(run, 2)
    assert [r["train/optim_steps"] for r in rows] == [1.0, 2.0, 3.0, 4.0]  # one update a step, none waited out


# ---------------------------------------------------------------- the loss of a group sampled with older weights


def test_ppo_of_a_stale_group_is_against_its_own_sampler_logprobs():
    """A frozen sampler of weights v samples; the live model takes an update (weights v+1);
    forward_backward's PPO loss on that sample is the hand-computed clipped surrogate of
    the trainer's v+1 logprobs against the sampler's recorded v logprobs."""
    engine = LocalTrainingClient(LocalEngineConfig(model=str(boxed_digit_model_dir()), lora_rank=4, seed=0))
    frozen = engine.frozen_sampler()
    prompt = engine.get_tokenizer().encode("2+2=")
    before = asyncio.run(frozen.sample(prompt, 1, SamplingParams(max_tokens=6, seed=1))).sequences[0]
    tokens, mask = list(prompt) + list(before.tokens), [0] * len(prompt) + [1] * len(before.tokens)
    sampled = algo.make_datum(tokens, mask, [0.0] * len(prompt) + list(before.logprobs), advantage=1.0)
    engine.forward_backward([sampled], "ppo", PPO)
    engine.optim_step(AdamParams(learning_rate=0.05))  # the live weights move on; the frozen sampler's do not
    again = asyncio.run(frozen.sample(prompt, 1, SamplingParams(max_tokens=6, seed=1))).sequences[0]
    assert again.tokens == before.tokens and again.logprobs == pytest.approx(before.logprobs, abs=1e-5)

    trainer_lp = engine.compute_logprobs(tokens, len(prompt))
    assert max(abs(a - b) for a, b in zip(trainer_lp, before.logprobs)) > 1e-3  # the weights did move
    advantage = -0.7
    datum = algo.make_datum(tokens, mask, [0.0] * len(prompt) + list(before.logprobs), advantage=advantage)
    out = engine.forward_backward([datum], "ppo", PPO)
    losses = []
    for new, old in zip(trainer_lp, before.logprobs):
        ratio = math.exp(new - old)
        clipped = min(max(ratio, PPO["clip_low_threshold"]), PPO["clip_high_threshold"])
        losses.append(max(-advantage * ratio, -advantage * clipped))
    assert out.metrics["train/loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-4)
    engine.optim_step(AdamParams(learning_rate=0.0))


def test_the_frozen_sampler_shares_the_base_weights_and_copies_the_adapter():
    engine = LocalTrainingClient(LocalEngineConfig(model=str(boxed_digit_model_dir()), lora_rank=4, seed=0))
    frozen = engine.frozen_sampler()
    live = dict(engine.model.named_parameters())
    for name, p in frozen.model.named_parameters():
        assert (p is live[name]) == (not live[name].requires_grad), name
        assert torch.equal(p, live[name])


# ---------------------------------------------------------------- refusals


def test_engines_without_a_frozen_sampler_refuse_before_anything_loads(tmp_path, monkeypatch):
    import dataclasses

    from retool.engines import registry
    from retool.integrations.verl.launch import VerlConfig

    make_config(TrainConfig, engine="vllm", max_staleness=2, model=str(tmp_path))  # its adapters are leased
    without = dataclasses.replace(registry.ENGINES["vllm"], capabilities=dataclasses.replace(
        registry.ENGINES["vllm"].capabilities, max_staleness=False))
    monkeypatch.setitem(registry.ENGINES, "vllm", without)  # an engine whose sampler cannot keep its weights
    with pytest.raises(ConfigError, match=r"^engine vllm does not support --max-staleness > 0 \("):
        make_config(TrainConfig, engine="vllm", max_staleness=1, model=str(tmp_path))
    make_config(TrainConfig, engine="vllm", model=str(tmp_path))  # 0: accepted
    make_config(VerlConfig, max_staleness=1)  # verl's one-step-off trainer (tests/verl)
    with pytest.raises(ConfigError, match="^--max-staleness above 1 has no verl equivalent here: verl 0.9.1's"):
        make_config(VerlConfig, max_staleness=2)
    with pytest.raises(ConfigError, match="--rollout-gpus must be in 1..7 and a multiple of --tensor-parallel, got 3"):
        make_config(VerlConfig, max_staleness=1, rollout_gpus=3, tensor_parallel=2)
    setup_verl = Path(__file__).resolve().parents[1] / "scripts" / "setup_verl.sh"
    assert '"verl==0.9.1"' in setup_verl.read_text()  # the version that refusal names is the pinned one
    with pytest.raises(ConfigError, match="--stream-groups with --max-staleness > 0 is not supported"):
        make_config(TrainConfig, stream_groups=True, max_staleness=1, model=str(tmp_path))
    with pytest.raises(ConfigError, match="max_staleness must be >= 0"):
        make_config(TrainConfig, max_staleness=-1, model=str(tmp_path))


def test_a_bad_max_staleness_is_one_line_on_the_command_line(tmp_path):
    done = run_cli(["--model", str(tmp_path / "nowhere"), "--max-staleness", "-2"])
    assert done.returncode == 2 and done.stderr.strip().splitlines() == ["error: max_staleness must be >= 0, got -2"]


# ---------------------------------------------------------------- SIGKILL and resume


@pytest.fixture(scope="module")
def lagged_reference(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("lagged")
    done = run_cli([*cli_args(folder, folder / "reference"), "--max-staleness", "1"])
    assert done.returncode == 0, done.stderr[-2000:]
    return folder, folder / "reference"


@pytest.mark.timeout(900)  # two training processes (and the reference), each loading the model
@pytest.mark.parametrize("failpoint", ["group_saved@3", "after_rollout@2", "checkpoint_write@2",
                                       "checkpoint_saved@2"])
def test_sigkill_anywhere_in_a_lagged_run_resumes_exactly(lagged_reference, failpoint, monkeypatch):
    """Killed while step 3's groups are sampled ahead (during step 2's update), as step 2's
    rollout ended (during step 1's), while checkpoint 2 is written, or once it is written
    but not yet listed (step 3's rollout, sampled ahead of it, may still run): the resumed
    run starts from the newest listed checkpoint, reuses the stored groups of the steps
    sampled with older weights and gives the uninterrupted run's data order, versions,
    metrics, weights and Adam moments."""
    folder, reference = lagged_reference
    crashed = folder / f"crashed-{failpoint.replace('@', '-')}"
    first = run_cli([*cli_args(folder, crashed), "--max-staleness", "1"], failpoints=failpoint)
    assert first.returncode == -9, first.stderr[-2000:]
    second = run_cli(["--resume", str(crashed)])
    assert second.returncode == 0, second.stderr[-2000:]
    assert "reused" in second.stderr
    if failpoint == "checkpoint_saved@2":
        assert "from step 1" in second.stderr  # checkpoint 2 was saved, not listed
    monkeypatch.setattr(test_train, "TIMING_METRICS", (*test_train.TIMING_METRICS, *PIPELINE_TIMINGS))
    assert_resumed_like(reference, crashed)
    for step in (1, 2, 3, 4):
        assert sampled_versions(crashed, step) == sampled_versions(reference, step)
    assert_lagged(crashed, 1)


@pytest.mark.timeout(900)
def test_sigkill_in_a_lagged_run_with_the_difficulty_pool_resumes_exactly(tmp_path, monkeypatch):
    """The pool a checkpoint saves is the one after its own step's rollout, not after the
    rollouts done ahead: the resumed run draws the uninterrupted run's problems."""
    args = ["--max-staleness", "1", "--curriculum", "difficulty"]
    reference, crashed = tmp_path / "reference", tmp_path / "crashed"
    done = run_cli([*cli_args(tmp_path, reference), *args])
    assert done.returncode == 0, done.stderr[-2000:]
    first = run_cli([*cli_args(tmp_path, crashed), *args], failpoints="checkpoint_write@3")
    assert first.returncode == -9, first.stderr[-2000:]
    second = run_cli(["--resume", str(crashed)])
    assert second.returncode == 0, second.stderr[-2000:]
    monkeypatch.setattr(test_train, "TIMING_METRICS", (*test_train.TIMING_METRICS, *PIPELINE_TIMINGS))
    assert_resumed_like(reference, crashed)
