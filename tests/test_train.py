"""The RL trainer end to end on tiny models: config checks, data order, learning,
checkpoints, and exact resume after SIGKILL (mid-step and mid-checkpoint)."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from retool.cli import main as cli_main
from retool.config import ConfigError, make_config
from retool.log import read_metrics
from retool.runs import FAILPOINTS_ENV, batch_indices, latest_checkpoint, read_manifest, refill_indices
from retool.train import TrainConfig, train
from tests.tiny import DIGIT_QUESTION, boxed_digit_model_dir

pytestmark = pytest.mark.timeout(300)  # every test here loads a tiny model; the kill-and-resume test has its own, longer limit

REPO = Path(__file__).resolve().parents[1]


def digit_problems(path: Path, n: int = 6, answer: str = "2") -> Path:
    """Problems the boxed-digit model answers right about 1 time in 5 (it favours 2 a little)."""
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"d{i}", "question": DIGIT_QUESTION, "answer": answer}) + "\n")
    return path


def tiny_config(tmp_path: Path, **overrides) -> TrainConfig:
    values = dict(model=str(boxed_digit_model_dir()), chat_template="hermes",
                  train_data=str(digit_problems(tmp_path / "train.jsonl")), batch_size=2, group_size=4,
                  max_steps=3, max_turn_tokens=12, max_trajectory_tokens=800, sandbox_workers=2, mode="text",
                  run_dir=str(tmp_path / "run"), save_every=1, lora_rank=4, lora_alpha=8.0, lr=2e-3)
    values.update(overrides)
    return make_config(TrainConfig, **values)


# ---------------------------------------------------------------- config and data order


@pytest.mark.parametrize("flag, value, message", [
    ("--group-size", "1", "group_size must be >= 2"),
    ("--clip-high", "0.9", "clip_low <= 1 <= clip_high"),
    ("--max-turn-tokens", "9000", "max_turn_tokens must be smaller"),
    ("--sinks", "jsonl,mlflow", "unknown metric sink"),
])
def test_bad_config_is_rejected_before_any_model_loads(flag, value, message, capsys, tmp_path):
    code = cli_main(["train", "--model", str(tmp_path / "does-not-exist"), flag, value])
    assert code == 2
    assert message in capsys.readouterr().err


def _no_model_loads(monkeypatch):
    from retool import runs

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the inputs were checked")

    monkeypatch.setattr(runs, "load_training_client", refuse)


@pytest.mark.parametrize("case, message", [
    ("missing data", "error: --train-data {tmp}/nope.jsonl: no such file"),
    ("empty data", "error: --train-data {tmp}/empty.jsonl: holds no rows"),
    ("missing model", "error: --model {tmp}/no-model: no such folder"),
    ("bad golds", "error: {tmp}/golds.jsonl: 2 gold answer(s) the grader cannot use"),
])
def test_bad_inputs_are_one_line_before_any_model_loads_and_leave_no_run(case, message, tmp_path, capsys,
                                                                          monkeypatch):
    _no_model_loads(monkeypatch)
    (tmp_path / "empty.jsonl").write_text("")
    golds = tmp_path / "golds.jsonl"
    golds.write_text("".join(json.dumps({"id": f"g{i}", "question": "q", "answer": a}) + "\n"
                             for i, a in enumerate(["2", "$", "\\frac{1}{2"])))
    data = {"missing data": "nope.jsonl", "empty data": "empty.jsonl", "bad golds": "golds.jsonl"}.get(case)
    model = tmp_path / "no-model" if case == "missing model" else boxed_digit_model_dir()
    argv = ["train", "--model", str(model), "--chat-template", "hermes", "--run-dir", str(tmp_path / "run"),
            "--train-data", str(tmp_path / data) if data else str(digit_problems(tmp_path / "ok.jsonl"))]
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message.format(tmp=tmp_path)) and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()  # no half-made run folder
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_resume_from_elsewhere_and_refuse_changed_data_without_touching_the_run(tmp_path, capsys, monkeypatch):
    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    start.mkdir(), elsewhere.mkdir()
    monkeypatch.chdir(start)
    digit_problems(start / "train.jsonl", n=3)
    flags = ["train", "--model", str(boxed_digit_model_dir()), "--chat-template", "hermes", "--mode", "text",
             "--train-data", "train.jsonl", "--run-dir", "run", "--batch-size", "1", "--group-size", "2",
             "--max-steps", "1", "--max-turn-tokens", "8", "--max-trajectory-tokens", "400", "--lora-rank", "2",
             "--sandbox-workers", "1"]
    assert cli_main(flags) == 0
    saved = json.loads((start / "run" / "config.json").read_text())
    assert saved["train_data"] == str(start / "train.jsonl")  # absolute, so resume works from anywhere
    record = json.loads((start / "run" / "train_data.json").read_text())
    assert record["path"] == str(start / "train.jsonl") and len(record["sha256"]) == 64

    monkeypatch.chdir(elsewhere)
    assert cli_main(["train", "--resume", str(start / "run"), "--max-steps", "2"]) == 0
    assert [r["step"] for r in read_metrics(start / "run" / "metrics.jsonl")] == [1, 2]
    capsys.readouterr()

    run_files = {p: p.read_bytes() for p in (start / "run").rglob("*") if p.is_file()}
    digit_problems(start / "train.jsonl", n=4)  # the data changed under the run
    assert cli_main(["train", "--resume", str(start / "run"), "--max-steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "train.jsonl changed since" in err and "a resumed run must see the same data" in err
    assert len(err.strip().splitlines()) == 1
    assert {p: p.read_bytes() for p in (start / "run").rglob("*") if p.is_file()} == run_files
    (start / "train.jsonl").unlink()
    assert cli_main(["train", "--resume", str(start / "run"), "--max-steps", "3"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert (start / "run" / "config.json").read_bytes() == run_files[start / "run" / "config.json"]


def test_presets_parse_and_validate():
    from retool.config import load_toml

    presets = sorted((REPO / "configs").glob("*.toml"))
    assert presets
    for preset in presets:
        values = load_toml(TrainConfig, preset) if "sft" not in preset.name else None
        if values is not None:
            make_config(TrainConfig, **values)


def test_batches_cover_each_epoch_once_and_are_reproducible():
    n, b = 10, 4
    batches = [batch_indices(step, b, n, seed=42) for step in range(1, 6)]  # 20 positions = 2 epochs
    flat = [i for batch in batches for i in batch]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # a fresh shuffle per epoch
    assert batches == [batch_indices(step, b, n, seed=42) for step in range(1, 6)]
    assert batches != [batch_indices(step, b, n, seed=7) for step in range(1, 6)]


def test_refill_problems_are_distinct_and_reproducible():
    picks = refill_indices(step=3, round_=1, count=4, num_problems=10, seed=42)
    assert len(set(picks)) == 4 and all(0 <= i < 10 for i in picks)
    assert picks == refill_indices(step=3, round_=1, count=4, num_problems=10, seed=42)
    assert picks != refill_indices(step=3, round_=2, count=4, num_problems=10, seed=42)
    assert sorted(refill_indices(step=1, round_=1, count=50, num_problems=5, seed=0)) == list(range(5))


# ---------------------------------------------------------------- a real run


def test_tiny_run_writes_metrics_trajectories_and_checkpoints(tmp_path):
    cfg = tiny_config(tmp_path, max_steps=2, save_trajectories=True, mode="retool")
    run = train(cfg)
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward/mean", "reward/correct", "reward/format", "rollout/turns", "rollout/code_calls",
                "rollout/trajectory_tokens", "rollout/valid_tool_call_rate", "rollout/degenerate_group_rate",
                "sandbox/success_rate", "sandbox/latency_p95", "train/loss", "train/clip_frac",
                "train/sampler_logprob_diff", "train/grad_norm", "tokens/prefill", "tokens/sampled",
                "tokens/trained", "tokens/sampled_total", "sandbox/cpu_s", "sandbox/cpu_s_total", "time/step",
                "time/grade", "time/grade_max"):
        assert key in rows[0], key
    for row in rows:  # every trajectory was graded, the longest grading one of them
        assert 0 < row["time/grade_max"] <= row["time/grade"]
    assert rows[0]["reward/format"] > 0.5  # the boxed-digit model boxes its answers
    assert rows[1]["tokens/sampled_total"] == rows[0]["tokens/sampled"] + rows[1]["tokens/sampled"]
    assert rows[1]["sandbox/cpu_s_total"] == pytest.approx(rows[0]["sandbox/cpu_s"] + rows[1]["sandbox/cpu_s"])
    assert [m.step for m in read_manifest(run)] == [1, 2]
    assert latest_checkpoint(run)[0] == 2
    with gzip.open(run / "trajectories" / "step_000001.jsonl.gz", "rt") as f:
        lines = [json.loads(line) for line in f]
    assert len(lines) == cfg.batch_size * cfg.group_size
    assert {"step", "group", "index", "advantage", "trajectory"} <= set(lines[0])
    saved = json.loads((run / "config.json").read_text())
    assert saved["group_size"] == 4 and saved["chat_template"] == "hermes"
    with pytest.raises(ConfigError, match="already holds a run"):
        train(cfg)


def test_the_loop_learns_to_answer_the_rewarded_digit(tmp_path):
    """A bandit through the whole loop: gold answer 2 (base rate ~0.2); reward/correct must rise.

    Measured: 0.22 → 0.72 over 12 steps. (The sign-flipped loss failing the same kind
    of check is tested at the engine level, tests/test_engine_local.py.)
    """
    cfg = tiny_config(tmp_path, max_steps=12, batch_size=4, group_size=8, lr=3e-3, full_finetune=True,
                      save_every=100)
    rows = read_metrics(train(cfg) / "metrics.jsonl")
    first = sum(r["reward/correct"] for r in rows[:3]) / 3
    last = sum(r["reward/correct"] for r in rows[-3:]) / 3
    assert last > first + 0.2, [round(r["reward/correct"], 2) for r in rows]
    assert rows[-1]["reward/format"] > 0.8  # it learnt the answer, not to break the format


def test_dynamic_sampling_refills_until_the_groups_are_informative(tmp_path):
    """Groups of 2 at a ~0.2 success rate are mostly degenerate, so steps need refills;
    only the informative groups are trained, and every sampled group is saved."""
    cfg = tiny_config(tmp_path, max_steps=3, group_size=2, refill_rounds=3, save_trajectories=True,
                      save_every=100)
    run = train(cfg)
    rows = read_metrics(run / "metrics.jsonl")
    assert sum(r["rollout/refill_rounds"] for r in rows) >= 1, rows
    for row in rows:
        _, groups = saved_step_groups(run, row["step"])
        informative = sum(1 for rewards in groups.values() if len(set(rewards)) > 1)
        assert row["rollout/groups"] == len(groups) >= cfg.batch_size
        assert (row["rollout/groups"] > cfg.batch_size) == (row["rollout/refill_rounds"] > 0)
        assert row["train/groups"] == informative <= cfg.batch_size
        assert row["rollout/informative_group_rate"] == informative / len(groups)  # refills included
        assert row["train/datums"] == informative * cfg.group_size
        if row["rollout/refill_rounds"] < cfg.refill_rounds:
            assert informative == cfg.batch_size  # it stopped refilling because the batch was full
        assert ("train/loss" in row) == (informative > 0)  # no signal, no update


# ---------------------------------------------------------------- crash and resume


def run_cli(args: list[str], failpoints: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, FAILPOINTS_ENV: failpoints, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "retool", "train", *args], env=env, capture_output=True,
                          text=True, timeout=600)


def cli_args(cfg_dir: Path, run_dir: Path) -> list[str]:
    return ["--model", str(boxed_digit_model_dir()), "--chat-template", "hermes",
            "--train-data", str(digit_problems(cfg_dir / "train.jsonl")), "--batch-size", "2",
            "--group-size", "4", "--max-steps", "4", "--max-turn-tokens", "12", "--max-trajectory-tokens", "600",
            "--mode", "text",
            "--sandbox-workers", "2", "--run-dir", str(run_dir), "--save-every", "1", "--lora-rank", "4",
            "--lora-alpha", "8", "--lr", "5e-3", "--save-trajectories", "--refill-rounds", "1"]


def final_state(run: Path, step: int = 4) -> tuple[dict, dict]:
    engine = run / "checkpoints" / f"step_{step:06d}" / "engine"
    weights = load_file(engine / "adapter" / "adapter_model.safetensors")
    optimizer = torch.load(engine / "optimizer.pt", weights_only=True)
    return weights, optimizer


def problem_order(run: Path) -> list[list[str]]:
    order = []
    for path in sorted((run / "trajectories").glob("step_*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            order.append([json.loads(line)["trajectory"]["problem_id"] for line in f])
    return order


@pytest.mark.timeout(900)  # five training processes, each loading the model
def test_sigkill_mid_step_and_mid_checkpoint_then_resume_is_exact(tmp_path):
    reference = tmp_path / "reference"
    done = run_cli(cli_args(tmp_path, reference))
    assert done.returncode == 0, done.stderr[-2000:]

    crashed = tmp_path / "crashed"
    first = run_cli(cli_args(tmp_path, crashed), failpoints="after_rollout@2")
    assert first.returncode == -9
    assert [r["step"] for r in read_metrics(crashed / "metrics.jsonl")] == [1]
    second = run_cli(["--resume", str(crashed)], failpoints="checkpoint_write@3")
    assert second.returncode == -9
    assert latest_checkpoint(crashed)[0] == 2  # step 3's half-written checkpoint is not listed
    assert [r["step"] for r in read_metrics(crashed / "metrics.jsonl")] == [1, 2, 3]
    third = run_cli(["--resume", str(crashed)])
    assert third.returncode == 0, third.stderr[-2000:]

    steps = [r["step"] for r in read_metrics(crashed / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4]  # no duplicate rows, same numbering
    assert problem_order(crashed) == problem_order(reference)
    ref_rows, crash_rows = read_metrics(reference / "metrics.jsonl"), read_metrics(crashed / "metrics.jsonl")
    assert [r["reward/mean"] for r in crash_rows] == [r["reward/mean"] for r in ref_rows]
    ref_weights, ref_opt = final_state(reference)
    weights, opt = final_state(crashed)
    assert ref_weights.keys() == weights.keys()
    for name in ref_weights:
        torch.testing.assert_close(weights[name], ref_weights[name], atol=1e-6, rtol=0)
    for key, state in ref_opt["state"].items():
        for moment in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt["state"][key][moment], state[moment], atol=1e-6, rtol=0)


TIMING_METRICS = ("time/rollout", "time/train", "time/step", "time/weight_sync", "time/grade", "time/grade_max",
                  "time/reference",
                  "sandbox/latency_mean", "sandbox/latency_p50", "sandbox/latency_p95", "sandbox/cpu_s",
                  "sandbox/cpu_s_total")
"""Metrics that measure wall or CPU time; every other metric of a resumed run equals the uninterrupted one's."""

ROUNDING_METRICS = ("weight_sync/max_abs_diff", "train/sampler_logprob_diff", "train/approx_kl")
"""Metrics that measure fp32 rounding (the sampler's and the trainer's logprobs of the same
tokens): ~1e-7 to 1e-6, and they move by that much with the rows a token was decoded beside
— the probe with whatever requests it was batched with (a lagged run's next rollout is in
flight then), a trajectory's turn with the rows of the running loop it joined (continuous
batching admits rows as they arrive from the sandbox). The tokens are the same (every row
draws from its own seeded generator). Compared to 1e-5."""


def saved_step_groups(run: Path, step: int) -> tuple[list[dict], dict[int, list[float]]]:
    """The saved trajectory lines of ``step`` and each group's rewards, by group."""
    with gzip.open(run / "trajectories" / f"step_{step:06d}.jsonl.gz", "rt") as f:
        lines = [json.loads(line) for line in f]
    groups: dict[int, list[float]] = {}
    for line in lines:
        groups.setdefault(line["group"], []).append(line["trajectory"]["grade"]["reward"])
    return lines, groups


def assert_resumed_like(reference: Path, resumed: Path, steps: int = 4) -> None:
    """A killed-and-resumed run of ``steps`` steps equals the uninterrupted one: every metric but
    the timings, the data order, the final weights and Adam moments."""
    ref_rows, rows = read_metrics(reference / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for ref, row in zip(ref_rows, rows):
        assert ref.keys() == row.keys()
        for name in ref.keys() - set(TIMING_METRICS):
            tolerance = 1e-5 if name in ROUNDING_METRICS else 1e-7
            assert row[name] == pytest.approx(ref[name], rel=1e-5, abs=tolerance), (row["step"], name)
    assert problem_order(resumed) == problem_order(reference)
    ref_weights, ref_opt = final_state(reference, steps)
    weights, opt = final_state(resumed, steps)
    for name in ref_weights:
        torch.testing.assert_close(weights[name], ref_weights[name], atol=1e-6, rtol=0)
    for key, state in ref_opt["state"].items():
        for moment in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt["state"][key][moment], state[moment], atol=1e-6, rtol=0)


def test_sigkill_mid_rollout_reuses_the_finished_groups(tmp_path, monkeypatch):
    from retool.config import config_from_dict
    from retool.engines.local import LocalSamplingClient

    reference = tmp_path / "reference"
    assert run_cli(cli_args(tmp_path, reference)).returncode == 0

    crashed = tmp_path / "crashed"
    first = run_cli(cli_args(tmp_path, crashed), failpoints="group_saved@2")
    assert first.returncode == -9
    finished = list((crashed / "rollouts" / "step_000002").glob("group_*.json.gz"))
    assert len(finished) == 1  # killed as the first group of step 2 was kept

    calls = []
    real_sample = LocalSamplingClient.sample

    async def counted(self, prompt_tokens, num_samples, params):
        calls.append(num_samples)
        return await real_sample(self, prompt_tokens, num_samples, params)

    monkeypatch.setattr(LocalSamplingClient, "sample", counted)
    saved = json.loads((crashed / "config.json").read_text())
    train(config_from_dict(TrainConfig, {**saved, "max_steps": 2}), resume=True)  # step 2 only, in this process
    step2 = read_metrics(crashed / "metrics.jsonl")[-1]
    assert step2["step"] == 2
    # text mode: one request per group (the fork), so one call per group not finished before the kill
    assert len(calls) == step2["rollout/groups"] - len(finished)
    assert not (crashed / "rollouts" / "step_000002").exists()  # dropped once the step was done

    assert run_cli(["--resume", str(crashed), "--max-steps", "4"]).returncode == 0  # steps 3 and 4
    assert_resumed_like(reference, crashed)


def test_a_stored_group_is_reused_only_by_the_same_run_and_key(tmp_path):
    from retool.runs import GroupKey, GroupStore, run_fingerprint
    from retool.types import (ExecStatus, ExecutionResult, Grade, StopReason, TokenUsage, ToolCall, ToolExchange,
                              Trajectory, Turn)

    exchange = ToolExchange(ToolCall("print(2)"), ExecutionResult(ExecStatus.OK, stdout="2\n", cpu_s=0.25), "2",
                            latency_s=0.1)
    trajectory = Trajectory("p0", 2, (1, 2, 3, 4), (0, 0, 1, 1), (0.0, 0.0, -0.5, -0.25),
                            (Turn("call", 1, StopReason.STOP, exchange), Turn("\\boxed{2}", 1, StopReason.STOP)),
                            Grade(1.0, True, True, "2"), StopReason.STOP)
    store = GroupStore(tmp_path, run_fingerprint(tiny_config(tmp_path)))
    key = GroupKey(step=3, round=1, index=0, problem_id="p0")
    store.save(key, [trajectory], TokenUsage(prefill=10, sampled=4))
    stored = store.load(key)
    assert stored.trajectories == (trajectory,) and stored.usage == TokenUsage(prefill=10, sampled=4)
    assert TokenUsage.from_json({"prefill": 10, "sampled": 4}) == stored.usage  # a group stored before `trained`
    assert store.load(GroupKey(step=3, round=1, index=0, problem_id="p1")) is None  # another problem
    assert store.load(GroupKey(step=4, round=1, index=0, problem_id="p0")) is None  # another step
    other = GroupStore(tmp_path, run_fingerprint(tiny_config(tmp_path, lr=1e-3)))
    assert other.load(key) is None  # another run's settings
    assert GroupStore(tmp_path, run_fingerprint(tiny_config(tmp_path, max_steps=9))).load(key) is not None
    store.clear(3)
    assert store.load(key) is None

    # reusing it counts its tokens and its sandbox call in the step, as if sampled now

    from retool.rollout import UsageMeter
    from retool.runs import StoredGroup
    from retool.sandbox import Sandbox, SandboxConfig
    from retool.train import Trainer

    class Rollout:
        usage = UsageMeter()

    with Sandbox(SandboxConfig(workers=1)) as sandbox:
        trainer = Trainer(tiny_config(tmp_path), engine=None, rollout=Rollout(), problems=[], sandbox=sandbox)
        trainer.reuse(StoredGroup((trajectory,), TokenUsage(prefill=10, sampled=4)))
        metrics = sandbox.metrics(reset=True)
    assert trainer.rollout.usage.total == TokenUsage(prefill=10, sampled=4) and trainer.reused_groups == 1
    assert metrics["sandbox/calls"] == 1 and metrics["sandbox/success_rate"] == 1.0
    assert metrics["sandbox/latency_mean"] == pytest.approx(0.1)
    assert metrics["sandbox/cpu_s"] == pytest.approx(0.25)  # its CPU time is counted (and priced) again


def test_docs_list_every_flag():
    from retool.config import markdown_table

    assert markdown_table(TrainConfig) in (REPO / "docs" / "cli.md").read_text()


@pytest.mark.parametrize("stream_groups", [False, True], ids=["sync", "streamed"])
def test_a_non_finite_update_stops_the_run_with_the_step(tmp_path, stream_groups):
    """A NaN in the sampler logprobs makes the PPO loss non-finite: the run stops, says where
    (streamed: the poisoned group's call fails, so no optim_step follows the others')."""
    from retool.train import StepError, build_trainer, train_step

    trainer = build_trainer(tiny_config(tmp_path, stream_groups=stream_groups))
    real_group = trainer.rollout.group

    async def poisoned(problem, group_size, **kwargs):
        import dataclasses

        group = await real_group(problem, group_size, **kwargs)
        bad = group[0]
        logprobs = tuple(float("nan") if m else lp for lp, m in zip(bad.logprobs_T, bad.mask_T))
        group[0] = dataclasses.replace(bad, logprobs_T=logprobs, grade=dataclasses.replace(bad.grade, reward=1.0))
        return group

    trainer.rollout.group = poisoned
    before = [p.detach().clone() for p in trainer.engine.params]
    with pytest.raises(StepError, match="step 1: the update failed and was not applied"):
        train_step(trainer, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.engine.params))


@pytest.mark.parametrize("preset", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_presets_are_valid_train_configs(preset):
    from retool.config import load_toml, make_config

    cfg = make_config(TrainConfig, **load_toml(TrainConfig, preset))
    assert cfg.max_turn_tokens < cfg.max_trajectory_tokens


def test_every_packing_the_flag_accepts_is_one_the_planner_runs(capsys):
    from retool import algo

    for packing in algo.PACKINGS:
        cfg = make_config(TrainConfig, packing=packing)
        plan = algo.plan_micro_batches([5, 3, 8], token_budget=16, packing=cfg.packing)
        assert sorted(i for batch in plan for i in batch) == [0, 1, 2], packing
    with pytest.raises(SystemExit):
        cli_main(["train", "--packing", "zip"])
    assert "argument --packing: invalid choice: 'zip'" in capsys.readouterr().err


# ---------------------------------------------------------------- overlong, pass@k, sampler-trainer correction


def saved_trajectories(run: Path, step: int = 1) -> list[dict]:
    with gzip.open(run / "trajectories" / f"step_{step:06d}.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f]


def test_overlong_mask_trains_no_truncated_trajectory(tmp_path):
    # 2 tokens per turn: every answer is cut off, so every trajectory is masked and nothing is trained
    cfg = tiny_config(tmp_path, max_steps=1, max_turn_tokens=2, overlong="mask")
    row = read_metrics(train(cfg) / "metrics.jsonl")[0]
    assert row["rollout/truncated"] == row["train/overlong_masked"] == cfg.batch_size * cfg.group_size
    assert row["train/datums"] == 0 and "train/loss" not in row


def test_overlong_soft_penalises_before_centring_and_passk_reshapes_the_rewards(tmp_path):
    from retool import algo

    cfg = tiny_config(tmp_path, max_steps=1, max_turn_tokens=4, max_assistant_turns=1,
                      overlong="soft", overlong_buffer=3, advantage="passk", passk=2, save_trajectories=True)
    run = train(cfg)
    row = read_metrics(run / "metrics.jsonl")[0]
    lines = saved_trajectories(run)
    groups: dict[int, list[dict]] = {}
    for line in lines:
        groups.setdefault(line["group"], []).append(line)
    penalised = 0
    for members in groups.values():
        members.sort(key=lambda line: line["index"])
        shaped = []
        for line in members:
            t = line["trajectory"]
            length = sum(t["mask_T"])
            budget = min(800 - t["prompt_len"], 4)  # one turn of 4 tokens
            penalty = algo.overlong_penalty(length, budget, 3)
            penalised += penalty < 0
            shaped.append(t["grade"]["reward"] + penalty)
        expected = algo.group_advantages(algo.passk_rewards(shaped, 2))
        assert [line["advantage"] for line in members] == pytest.approx(expected)
    assert row["train/overlong_penalised"] == penalised > 0
    assert "train/sampler_nll" in row and "train/entropy" in row


def _group_of_calls(codes: list[str | None]) -> list:
    """One rollout group of the 6 x 7 problem, every answer wrong (41): trajectory K calls the
    interpreter with ``codes[K]`` (``None``: seed 83's broken call, one ``}`` where ``))`` belonged)."""
    from retool.render import Renderer
    from retool.rollout import Rollout, RolloutConfig
    from retool.reward import agrade
    from retool.sandbox import Sandbox, SandboxConfig
    from retool.types import Problem
    from tests.scripted import ScriptedSampler
    from tests.tokenizers import qwen25_tokenizer

    broken = ('<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(sum(x for x in range(1, 85) '
              'if x % 6 == 0"}}}\n</tool_call>')
    scripts = []
    for k, code in enumerate(codes):
        body = json.dumps({"name": "code_interpreter", "arguments": {"code": code}})
        call = broken if code is None else f"<tool_call>\n{body}\n</tool_call>"
        scripts.append([f"[traj {k}] Let me compute.\n{call}", "So it is \\boxed{41}."])
    tokenizer = qwen25_tokenizer()
    with Sandbox(SandboxConfig(timeout_s=5.0, workers=2)) as sandbox:
        rollout = Rollout(Renderer(tokenizer), ScriptedSampler(tokenizer, scripts), sandbox, agrade, RolloutConfig())
        return list(asyncio.run(rollout.group(Problem(id="p", question="What is 6 times 7?", answer="42"),
                                              len(codes))))


def test_an_all_wrong_group_teaches_against_malformed_calls_only_with_the_penalty():
    """Outcome rewards alone give a group of wrong answers no gradient, however broken its calls
    (seed 83's demo lost a kind's call format this way); the penalty makes the broken calls
    the worse ones, and the refill count and the dropped groups follow the same rewards."""
    from retool import algo
    from retool.train import _missing_groups, _shaped_rewards, _trained_groups

    group = _group_of_calls([None, "print(6*7-1)", None, "print(41)"])
    assert [t.num_invalid_calls for t in group] == [1, 0, 1, 0]
    assert [t.grade.reward for t in group] == [-1.0] * 4

    outcome = make_config(TrainConfig, drop_degenerate_groups=True)
    (rewards,), metrics = _shaped_rewards(outcome, [group])
    assert rewards == [-1.0] * 4 and "train/invalid_call_penalised" not in metrics
    assert _trained_groups(outcome, [group], [algo.group_advantages(rewards)], [algo.is_degenerate(rewards)]) == []
    assert _missing_groups(outcome, [group]) == outcome.batch_size

    shaped = make_config(TrainConfig, drop_degenerate_groups=True, invalid_call_penalty=0.5)
    (rewards,), metrics = _shaped_rewards(shaped, [group])
    assert rewards == [-1.5, -1.0, -1.5, -1.0] and metrics["train/invalid_call_penalised"] == 2.0
    advantages = algo.group_advantages(rewards)
    assert advantages == pytest.approx((-0.25, 0.25, -0.25, 0.25))
    assert _trained_groups(shaped, [group], [advantages], [algo.is_degenerate(rewards)]) == [(group, advantages)]
    assert _missing_groups(shaped, [group]) == shaped.batch_size - 1


def test_a_cosine_schedule_sets_each_steps_rate_from_the_step_alone(tmp_path):
    """The rate each optimiser step gets, as the engine logs it, follows the half cosine from
    --lr to --lr-min-ratio x --lr; an interrupted run resumes with the rates it would have had."""
    from retool import algo

    assert [algo.scheduled_lr(1.0, s, 5, "cosine", 0.1) for s in (1, 3, 5, 9)] == pytest.approx([1.0, 0.55, 0.1, 0.1])
    assert algo.scheduled_lr(2e-3, 4, 1, "cosine") == 2e-3 and algo.scheduled_lr(2e-3, 4, 9) == 2e-3
    with pytest.raises(ValueError, match="unknown learning-rate schedule 'linear'"):
        algo.scheduled_lr(1.0, 1, 3, "linear")
    with pytest.raises(ConfigError, match=r"lr_min_ratio must be in \[0, 1\], got 1.5"):
        TrainConfig(lr_min_ratio=1.5).validate()

    cfg = tiny_config(tmp_path, lr_schedule="cosine", lr_min_ratio=0.25)
    rates = [row["train/lr"] for row in read_metrics(train(cfg) / "metrics.jsonl")]
    assert rates == pytest.approx([2e-3, 2e-3 * 0.625, 2e-3 * 0.25])


def test_the_invalid_call_penalty_is_bounded(capsys):
    with pytest.raises(ConfigError, match=r"invalid_call_penalty must be in \[0, 2\]"):
        TrainConfig(invalid_call_penalty=-0.5).validate()
    assert cli_main(["train", "--invalid-call-penalty", "3"]) == 2
    assert "invalid_call_penalty must be in [0, 2] (rewards are +-1), got 3.0" in capsys.readouterr().err


def test_services_refuse_the_sampler_trainer_correction_before_anything_loads():
    for engine in ("tinker", "pytrio"):
        with pytest.raises(ConfigError, match=f"engine {engine} does not support --behaviour-is"):
            TrainConfig(engine=engine, behaviour_is="token-tis").validate()
    with pytest.raises(ConfigError, match="--passk must be in"):
        TrainConfig(advantage="passk", passk=8, group_size=8).validate()


def test_trajectory_files_are_written_in_the_background_in_step_order_and_a_failed_write_raises_at_the_join(tmp_path):
    from retool.trajectory_log import read_trajectory_log
    from retool.train import TrajectoryWriter
    from retool.types import Grade, Trajectory

    def group(step: int) -> list:
        trajectory = Trajectory(problem_id=f"p{step}", prompt_len=1, tokens_T=(1, 2), mask_T=(0, 1),
                                logprobs_T=(0.0, -0.5), turns=(), grade=Grade(1.0, True, True, "2"))
        return [([trajectory, trajectory], (0.5, -0.5))]

    writer = TrajectoryWriter()
    for step in (1, 2, 3):
        writer.submit(tmp_path, step, group(step))
    writer.join()
    for step in (1, 2, 3):
        rows = read_trajectory_log(tmp_path / "trajectories" / f"step_{step:06d}.jsonl.gz")
        assert [(r.step, r.index, r.advantage, r.trajectory.problem_id) for r in rows] == [
            (step, 0, 0.5, f"p{step}"), (step, 1, -0.5, f"p{step}")]
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    writer.submit(blocked, 4, group(4))  # trajectories/ cannot be made under a file
    with pytest.raises(OSError):
        writer.close()
    writer.join()  # the failure was reported once; nothing is pending


def test_the_kl_anchor_is_refused_where_it_cannot_run(capsys):
    for engine in ("tinker", "pytrio"):
        with pytest.raises(ConfigError, match=f"engine {engine} does not support --kl-coef > 0"):
            TrainConfig(engine=engine, kl_coef=0.1).validate()
    assert cli_main(["train", "--kl-coef", "-0.1"]) == 2
    assert "kl_coef must be >= 0, got -0.1" in capsys.readouterr().err


def test_a_kl_anchored_run_resumes_exactly_against_the_weights_it_started_from(tmp_path):
    """``--kl-coef``: the reference is the run's starting weights, kept before a resume loads its
    checkpoint, so a run stopped after step 1 and resumed scores, penalises and trains exactly as
    one that ran through; the penalty is logged (0 at step 1, where the sampler is the reference)."""
    from retool.config import config_from_dict

    through = tiny_config(tmp_path, kl_coef=0.5, lr=5e-3, run_dir=str(tmp_path / "through"))
    train(through)
    train(tiny_config(tmp_path, kl_coef=0.5, lr=5e-3, run_dir=str(tmp_path / "stopped"), max_steps=1))
    saved = json.loads((tmp_path / "stopped" / "config.json").read_text())
    train(config_from_dict(TrainConfig, {**saved, "max_steps": 3}), resume=True)
    assert_resumed_like(tmp_path / "through", tmp_path / "stopped", steps=3)
    kl = [row["train/kl_reference"] for row in read_metrics(tmp_path / "through" / "metrics.jsonl")
          if "train/kl_reference" in row]
    assert len(kl) >= 2 and abs(kl[0]) < 1e-5 and max(abs(x) for x in kl[1:]) > 1e-4  # a step with no datums logs none
