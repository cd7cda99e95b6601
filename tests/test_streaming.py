"""Streaming within a step (``--stream-groups``, ``retool/streaming.py``): the averaging
rule by hand, the calls' order on the local engine, a streamed step against the
synchronous one on the local engine and the Tinker/PyTRIO fakes (same gradient up to the
logged scale, same metrics), the weight version of every token, refusals, and a SIGKILL
mid-step that resumes exactly."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from retool import algo, streaming
from retool.config import ConfigError, make_config
from retool.engines import AdamParams
from retool.engines.local import LocalEngineConfig, LocalTrainingClient
from retool.log import read_metrics
from retool.train import TrainConfig, _policy_budget, build_trainer, train, train_step
from retool.types import NOT_SAMPLED
from tests.fake_tinker import FAKE_LORA_ALPHA, FakeService, install
from tests.test_engine_tinker import PPO, one_torch_thread, rel, rl_datums  # noqa: F401 (one_torch_thread: autouse)
from tests.test_train import assert_resumed_like, cli_args, run_cli, saved_step_groups, tiny_config
from tests.tiny import boxed_digit_model_dir

pytestmark = pytest.mark.timeout(300)


# ---------------------------------------------------------------- the rule, by hand


def test_each_call_is_scaled_to_its_share_of_the_fixed_divisor():
    a = algo.make_datum([5, 6, 7, 8], [0, 1, 1, 1], [-1.0] * 4, advantage=0.5)  # 3 trained targets
    b = algo.make_datum([5, 6, 7], [0, 0, 1], [-1.0] * 3, advantage=-2.0)  # 1
    share, (sa, sb) = streaming.scaled([a, b], divisor=16)
    assert share == 4 / 16
    assert sa.advantages_N == tuple(x * 0.25 for x in a.advantages_N)
    assert sb.advantages_N == tuple(x * 0.25 for x in b.advantages_N)
    assert (sa.weights_N, sa.sampler_logprobs_N) == (a.weights_N, a.sampler_logprobs_N)
    assert streaming.token_divisor(batch_size=8, group_size=4, policy_budget=100) == 3200
    with pytest.raises(ValueError, match="loss weights of 0 or 1"):
        streaming.scaled([dataclasses.replace(a, weights_N=(0.0, 0.5, 1.0))], 16)


def test_call_metrics_merge_into_one_calls():
    calls = [(0.25, {"train/loss": 0.5, "train/tokens": 2.0, "train/clip_frac": 0.5, "train/micro_batches": 1.0,
                     "train/behaviour_ratio_max": 1.5}),
             (0.5, {"train/loss": -1.0, "train/tokens": 6.0, "train/clip_frac": 0.0, "train/micro_batches": 2.0,
                    "train/behaviour_ratio_max": 1.2})]
    merged = streaming.merged_metrics(calls)
    # each call's loss unscaled (0.5 / 0.25 = 2, -1 / 0.5 = -2), then the token mean (2*2 - 2*6) / 8
    assert merged == {"train/loss": -1.0, "train/tokens": 8.0, "train/clip_frac": 0.125,
                      "train/micro_batches": 3.0, "train/behaviour_ratio_max": 1.5}


def test_groups_are_sent_in_rollout_order_whichever_ends_first():
    """On the real local engine: groups added out of order (and one twice, as a retried
    round does) are trained in (round, position) order, once each, then one optim_step."""
    engine = LocalTrainingClient(LocalEngineConfig(model=str(boxed_digit_model_dir()), lora_rank=4, seed=0))
    groups = {key: rl_datums(2, seed) for seed, key in enumerate([(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)])}
    with streaming.StreamedUpdate(engine, "ppo", PPO, 1000.0, list) as stream:
        for key in [(0, 2), (0, 0), (0, 2), (0, 1), (1, 1), (0, 0), (1, 0)]:
            stream.add(*key, groups[key])
        metrics = stream.finish(AdamParams(learning_rate=1e-2))
    assert stream.datums == [d for key in sorted(groups) for d in groups[key]]
    assert metrics["train/stream_calls"] == 5 and metrics["train/optim_steps"] == 1
    assert metrics["train/sequences"] == 10


# ---------------------------------------------------------------- a streamed step against the synchronous one


def off_policy(trajectory, reward: float):
    """``trajectory`` with the given reward and sampler logprobs moved +-0.4 (so PPO clips)."""
    logprobs = tuple(lp + 0.4 * (-1) ** k if m else lp
                     for k, (lp, m) in enumerate(zip(trajectory.logprobs_T, trajectory.mask_T)))
    grade = dataclasses.replace(trajectory.grade, reward=reward)
    return dataclasses.replace(trajectory, logprobs_T=logprobs, grade=grade)


def recorded_grads(trainer, monkeypatch) -> list:
    """The gradient at each optim_step: the fake service records it; on the local engine
    the real submit_optim_step is wrapped to copy it first."""
    if trainer.config.engine != "local":
        return []
    seen: list = []
    real = trainer.engine.submit_optim_step

    def record(adam):
        seen.append([p.grad.detach().clone() for p in trainer.engine.params])
        return real(adam)

    monkeypatch.setattr(trainer.engine, "submit_optim_step", record)
    return seen


@pytest.mark.parametrize("engine, kl_coef", [("local", 0.0), ("local", 0.5), ("tinker", 0.0), ("pytrio", 0.0)])
def test_a_streamed_step_is_the_synchronous_gradient_times_its_logged_scale(engine, kl_coef, tmp_path, monkeypatch):
    """Two trainers on one engine are fed the same trajectories (groups that end in reverse order, rewards
    that make every group informative, sampler logprobs moved so PPO clips); step 1 runs
    synchronously on both, step 2 streamed on one: its gradient is the synchronous one times N / D, and its
    loss, clip fraction, KL and token count are the synchronous step's — with ``--kl-coef`` too, each
    group's penalty toward the starting weights taken as it ends."""
    service = None
    if engine != "local":
        service = FakeService(tmp_path / "service", engine)
        install(service, monkeypatch)
    common = dict(lora_rank=4, lora_alpha=FAKE_LORA_ALPHA, seed=3, max_steps=2, lr=1e-2, batch_size=3,
                  kl_coef=kl_coef)
    sync = build_trainer(tiny_config(tmp_path, engine=engine, run_dir=str(tmp_path / "sync"), **common))
    streamed = build_trainer(tiny_config(tmp_path, engine=engine, run_dir=str(tmp_path / "streamed"), **common))
    sync.rollout.sampler = sync.engine.save_weights_for_sampler()
    sampled = asyncio.run(sync.rollout.groups(sync.problems, 4))
    groups = {p.id: [off_policy(t, reward=float((i + j) % 3 == 0)) for j, t in enumerate(g)]
              for i, (p, g) in enumerate(zip(sync.problems, sampled))}
    started: list[str] = []
    ended: list[str] = []

    async def same_group(problem, group_size, **kwargs):
        started.append(problem.id)
        await asyncio.sleep(0.05 * (3 - len(started)))  # the first started ends last
        ended.append(problem.id)
        return list(groups[problem.id])

    sync_grads, streamed_grads = recorded_grads(sync, monkeypatch), recorded_grads(streamed, monkeypatch)
    for trainer in (sync, streamed):
        trainer.rollout.group = same_group
    streamed.config.stream_groups = False
    for trainer in (sync, streamed):
        train_step(trainer, 1)
    streamed.config.stream_groups = True
    theirs, _ = train_step(sync, 2)
    started.clear(), ended.clear()
    ours, _ = train_step(streamed, 2)
    assert ended == started[::-1]

    divisor = streaming.token_divisor(3, 4, _policy_budget(streamed.config, None))
    scale = theirs["train/tokens"] / divisor
    assert ours["train/stream_scale"] == pytest.approx(scale, rel=1e-12) and 0 < scale < 1
    assert ours["train/stream_calls"] == 3
    assert theirs["train/clip_frac"] > 0
    for key in ("train/loss", "train/clip_frac", "train/approx_kl", "train/sampler_logprob_diff", "train/tokens",
                "train/sequences", "train/sampler_nll", "reward/mean",
                *(("train/kl_reference",) if kl_coef else ())):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-7), key
    assert ("train/kl_reference" in ours) == bool(kl_coef)
    if service is not None:  # what the service saw: the gradient summed over the step's calls
        (sync_run, streamed_run) = service.training_clients
        sync_grads, streamed_grads = sync_run.grads, streamed_run.grads
        norms = (sync_run.grad_norms[-1], streamed_run.grad_norms[-1])
    else:
        norms = (theirs["train/grad_norm"], ours["train/grad_norm"])
    grad_rel = rel(streamed_grads[-1], [g * scale for g in sync_grads[-1]])
    print(f"\nstreamed vs sync {engine}: scale {scale:.4g}, grad_rel {grad_rel:.1e}, grad_norm "
          f"{norms[1]:.6g} vs {norms[0]:.6g} x scale")
    assert grad_rel < 1e-5
    assert norms[1] == pytest.approx(norms[0] * scale, rel=1e-5)
    for trainer in (sync, streamed):
        if trainer.sandbox is not None:
            trainer.sandbox.close()


# ---------------------------------------------------------------- a whole run: versions, refills, refusals


@pytest.mark.parametrize("dropping", [{"refill_rounds": 3}, {"drop_degenerate_groups": True}],
                         ids=["refills", "drop-degenerate"])
def test_a_streamed_run_trains_only_informative_groups_and_records_versions(tmp_path, dropping):
    cfg = tiny_config(tmp_path, max_steps=3, group_size=2, save_trajectories=True, save_every=100,
                      stream_groups=True, **dropping)
    run = train(cfg)
    rows = read_metrics(run / "metrics.jsonl")
    assert sum(r["rollout/refill_rounds"] for r in rows) >= (1 if cfg.refill_rounds else 0), rows
    for row in rows:
        lines, groups = saved_step_groups(run, row["step"])
        for line in lines:
            t = line["trajectory"]
            assert t["versions_T"] == [row["step"] if m else NOT_SAMPLED for m in t["mask_T"]]
        informative = sum(1 for rewards in groups.values() if len(set(rewards)) > 1)
        assert row["train/groups"] == informative <= cfg.batch_size
        assert row["train/datums"] == informative * cfg.group_size
        assert row.get("train/stream_calls", 0) == informative  # one forward_backward per trained group
        assert ("train/loss" in row) == (informative > 0)


def test_versions_round_trip_and_old_trajectories_read_as_unrecorded():
    from retool.serialize import to_jsonable, trajectory_from_jsonable
    from retool.types import Grade, Trajectory

    t = Trajectory("p", 2, (1, 2, 3, 4), (0, 0, 1, 1), (0.0, 0.0, -0.5, -0.1), (), Grade(1.0, True, True),
                   versions_T=(NOT_SAMPLED, NOT_SAMPLED, 7, 7))
    row = to_jsonable(t)
    assert trajectory_from_jsonable(row) == t
    del row["versions_T"]  # a file written before versions were recorded
    assert trajectory_from_jsonable(row).versions_T is None
    assert "versions_T" not in to_jsonable(trajectory_from_jsonable(row))  # and it is written back unchanged
    with pytest.raises(ValueError, match="versions_T has 3 entries, tokens_T 4"):
        dataclasses.replace(t, versions_T=(7, 7, 7))


def test_an_engine_that_cannot_stream_refuses_before_anything_loads(monkeypatch, tmp_path):
    from retool.engines import ENGINES, Capabilities
    from retool.engines.registry import EngineSpec
    from retool.integrations.verl.launch import VerlConfig

    monkeypatch.setitem(ENGINES, "batch-only", EngineSpec(module="no.such.module", summary="trains a whole batch",
                                                          capabilities=Capabilities(stream_groups=False)))
    with pytest.raises(ConfigError, match=r"^engine batch-only does not support --stream-groups"):
        make_config(TrainConfig, engine="batch-only", stream_groups=True, model=str(tmp_path))
    make_config(TrainConfig, engine="batch-only", model=str(tmp_path))  # off: accepted
    with pytest.raises(ConfigError, match="--stream-groups is retool train's own pipeline"):
        make_config(VerlConfig, stream_groups=True)


@pytest.mark.timeout(900)  # three training processes, each loading the model
def test_sigkill_mid_streamed_step_resumes_exactly(tmp_path):
    """Killed as step 2's first group was kept (its forward_backward may be under way): the
    resumed run reuses that group and gives the uninterrupted run's metrics, weights and
    Adam moments."""
    reference = tmp_path / "reference"
    done = run_cli([*cli_args(tmp_path, reference), "--stream-groups"])
    assert done.returncode == 0, done.stderr[-2000:]
    crashed = tmp_path / "crashed"
    first = run_cli([*cli_args(tmp_path, crashed), "--stream-groups"], failpoints="group_saved@2")
    assert first.returncode == -9
    assert len(list((crashed / "rollouts" / "step_000002").glob("group_*.json.gz"))) == 1
    second = run_cli(["--resume", str(crashed)])
    assert second.returncode == 0, second.stderr[-2000:]
    assert "reused 1 trajectory group(s)" in second.stderr

    assert all("train/stream_scale" in r for r in read_metrics(crashed / "metrics.jsonl") if "train/loss" in r)
    assert_resumed_like(reference, crashed)
