"""The online difficulty pool (``--curriculum difficulty``): its rule computed by hand, its
draws (seeded, distinct, floored), its checkpointed state, and an exact resume with it on."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from retool import curriculum, runs
from retool.config import ConfigError, make_config
from retool.curriculum import PoolState, draw, pool_metrics, record, weights
from retool.log import read_metrics
from retool.tasks import make_problems
from retool.train import TrainConfig, Trainer
from retool.types import Problem
from tests.test_train import TIMING_METRICS, final_state, problem_order, run_cli
from tests.tiny import DIGIT_QUESTION, boxed_digit_model_dir

ALL_RIGHT, ALL_WRONG, MIXED = [1.0] * 4, [-1.0] * 4, [1.0, -1.0, -1.0, -1.0]


def pool(n: int, family: str = "f") -> list[Problem]:
    return [Problem(f"{family}{i}", "q", "1", family) for i in range(n)]


# ---------------------------------------------------------------- the rule


def test_scores_follow_the_documented_moving_average():
    a, b = pool(2, "a"), pool(1, "b")
    state = record(PoolState(), [a[0]], [ALL_RIGHT])
    assert state.problems == {"a0": 0.5} and state.families == {"a": 0.5}
    assert list(weights(state, a + b, floor=0.1)) == [0.5, 0.5, 1.0]  # unseen a1 takes its family's score
    state = record(state, [a[0], a[1]], [MIXED, ALL_WRONG])
    # a0: 0.5·0.5 + 0.5·1 = 0.75, family 0.5 → 0.75; a1 starts at the family's 0.75 → 0.375, family → 0.375
    assert state.problems == {"a0": 0.75, "a1": 0.375} and state.families == {"a": 0.375}
    for _ in range(6):
        state = record(state, [a[1]], [ALL_WRONG])
    assert weights(state, a, floor=0.1)[1] == 0.1  # the floor: never starved
    assert record(state, [a[1]], [MIXED]).problems["a1"] > 0.5  # one informative group doubles its chance again


def test_metrics_count_seen_problems_and_the_floor():
    problems = pool(4)
    state = PoolState({"f0": 0.0625, "f1": 1.0}, {"f": 0.5})
    assert pool_metrics(state, problems, floor=0.1) == {
        "curriculum/seen_problems": 2.0, "curriculum/mean_weight": pytest.approx((0.1 + 1.0 + 0.5 + 0.5) / 4),
        "curriculum/floor_share": 0.25}


def test_record_refuses_groups_that_do_not_match_their_problems():
    with pytest.raises(ValueError):
        record(PoolState(), pool(2), [ALL_RIGHT])


def test_state_survives_a_json_round_trip_exactly():
    state = PoolState()
    for step in range(5):
        state = record(state, pool(3), [MIXED, ALL_RIGHT, ALL_WRONG][step % 3:] + [MIXED] * (step % 3))
    assert PoolState.from_json(json.loads(json.dumps(state.to_json()))) == state


# ---------------------------------------------------------------- draws


def test_draws_are_seeded_distinct_and_skip_what_the_step_took():
    problems, state = pool(20), PoolState()
    first = draw(state, problems, 8, seed=3, step=1, round_=0, floor=0.1)
    assert first == draw(state, problems, 8, seed=3, step=1, round_=0, floor=0.1)
    assert len(set(first)) == 8
    assert first != draw(state, problems, 8, seed=3, step=2, round_=0, floor=0.1)
    assert first != draw(state, problems, 8, seed=4, step=1, round_=0, floor=0.1)
    refill = draw(state, problems, 20, seed=3, step=1, round_=1, floor=0.1, exclude=first)
    assert len(refill) == 12 and not set(refill) & set(first)  # only what is left, never more
    assert draw(state, problems, 4, seed=3, step=1, round_=2, floor=0.1, exclude=range(20)) == []


def test_problems_that_teach_nothing_are_drawn_less_but_still_drawn():
    easy, hard = pool(50, "easy"), pool(50, "hard")
    state = PoolState()
    for _ in range(3):  # every easy group came back G/G three times, every hard one mixed
        state = record(state, [easy[0], hard[0]], [ALL_RIGHT, MIXED])
    problems = easy + hard
    picked = [i for step in range(1, 401) for i in draw(state, problems, 1, seed=0, step=step, round_=0, floor=0.1)]
    easy_share = sum(i < 50 for i in picked) / len(picked)
    # expected share 50·0.125 / (50·0.125 + 50·1) ≈ 0.11
    assert 0.05 < easy_share < 0.2, easy_share


def test_a_word_problem_story_that_still_comes_back_mixed_outdraws_the_stories_already_learnt():
    problems = [p for p in make_problems(400, 0, "rl") if "/word_problem/" in p.data_source]
    cartons = [p for p in problems if p.data_source.endswith("/cartons")]
    others = [p for p in problems if not p.data_source.endswith("/cartons")]
    state = PoolState()
    for i in range(3):  # three groups of each learnt story all right, one cartons group mixed
        state = record(state, others[4 * i:4 * i + 4] + cartons[i:i + 1], [ALL_RIGHT] * 4 + [MIXED])
    picked = [problems[i] for step in range(1, 201)
              for i in draw(state, problems, 1, seed=0, step=step, round_=0, floor=0.1)]
    share = sum(p in cartons for p in picked) / len(picked)
    # about a fifth of the stories' problems are cartons; their story scores 1, the others 0.125
    assert share > 0.5, (share, len(cartons), len(problems))


def test_no_curriculum_keeps_the_seeded_epoch_order():
    cfg = make_config(TrainConfig, batch_size=3)
    problems = pool(7)
    plain = Trainer(cfg, engine=None, rollout=None, problems=problems, sandbox=None)
    assert plain.pool is None
    assert plain.choose(2, 0, 3, []) == runs.batch_indices(2, 3, 7, cfg.seed)
    assert plain.choose(2, 1, 2, []) == runs.refill_indices(2, 1, 2, 7, cfg.seed)
    assert plain.checkpoint_state(2).curriculum is None
    on = Trainer(make_config(TrainConfig, curriculum="difficulty"), engine=None, rollout=None, problems=problems,
                 sandbox=None)
    assert on.pool == PoolState()


def test_the_flag_is_checked():
    with pytest.raises(ConfigError, match="curriculum_floor"):
        make_config(TrainConfig, curriculum="difficulty", curriculum_floor=0.0)
    with pytest.raises(ConfigError, match="curriculum"):
        make_config(TrainConfig, curriculum="easy-first")
    assert curriculum.CURRICULA == ("none", "difficulty")


# ---------------------------------------------------------------- a real run, killed and resumed


def mixed_problems(path: Path) -> Path:
    """Four problems the boxed-digit model answers right ~1 time in 5, four it never does."""
    with open(path, "w") as f:
        for i in range(8):
            answer, family = ("2", "digit") if i % 2 else ("100", "never")
            f.write(json.dumps({"id": f"p{i}", "question": DIGIT_QUESTION, "answer": answer,
                                "data_source": family}) + "\n")
    return path


def curriculum_args(tmp_path: Path, run_dir: Path) -> list[str]:
    return ["--model", str(boxed_digit_model_dir()), "--chat-template", "hermes",
            "--train-data", str(mixed_problems(tmp_path / "mixed.jsonl")), "--batch-size", "2",
            "--group-size", "4", "--max-steps", "4", "--max-turn-tokens", "12", "--max-trajectory-tokens", "600",
            "--mode", "text", "--sandbox-workers", "2", "--run-dir", str(run_dir), "--save-every", "1",
            "--lora-rank", "4", "--lora-alpha", "8", "--lr", "5e-3", "--save-trajectories", "--refill-rounds", "1",
            "--curriculum", "difficulty", "--seed", "5"]


@pytest.mark.timeout(900)  # three training processes, each loading the model
def test_sigkill_mid_step_then_resume_draws_and_trains_exactly_alike(tmp_path):
    reference = tmp_path / "reference"
    done = run_cli(curriculum_args(tmp_path, reference))
    assert done.returncode == 0, done.stderr[-2000:]
    crashed = tmp_path / "crashed"
    assert run_cli(curriculum_args(tmp_path, crashed), failpoints="after_rollout@3").returncode == -9
    resumed = run_cli(["--resume", str(crashed)])
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    ref_rows, rows = read_metrics(reference / "metrics.jsonl"), read_metrics(crashed / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for ref, row in zip(ref_rows, rows):
        assert ref.keys() == row.keys()
        for name in ref.keys() - set(TIMING_METRICS):
            assert row[name] == pytest.approx(ref[name], rel=1e-5, abs=1e-7), (row["step"], name)
    assert rows[-1]["curriculum/seen_problems"] >= 2
    assert problem_order(crashed) == problem_order(reference)
    last = runs.read_trainer_state(runs.checkpoint_dir(crashed, 4))
    assert last.curriculum == runs.read_trainer_state(runs.checkpoint_dir(reference, 4)).curriculum
    assert set(last.curriculum["families"]) <= {"digit", "never"}
    ref_weights, ref_opt = final_state(reference)
    weights_, opt = final_state(crashed)
    for name in ref_weights:
        torch.testing.assert_close(weights_[name], ref_weights[name], atol=1e-6, rtol=0)
    for key, state in ref_opt["state"].items():
        for moment in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt["state"][key][moment], state[moment], atol=1e-6, rtol=0)


def test_a_checkpoint_carries_the_pool_and_a_resume_restores_it(tmp_path):
    problems = pool(4)
    trainer = Trainer(make_config(TrainConfig, curriculum="difficulty"), engine=None, rollout=None, problems=problems,
                      sandbox=None)
    trainer.pool = record(trainer.pool, problems[:2], [ALL_RIGHT, MIXED])
    folder = tmp_path / "checkpoints" / "step_000003"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps(dataclasses.asdict(trainer.checkpoint_state(3))))
    resumed = Trainer(trainer.config, engine=None, rollout=None, problems=problems, sandbox=None)
    resumed.restore_state(runs.read_trainer_state(folder))
    assert resumed.pool == trainer.pool
    assert resumed.choose(4, 0, 2, []) == trainer.choose(4, 0, 2, [])
