"""The online difficulty pool (``--curriculum difficulty``): its rule computed by hand, its
draws (seeded, distinct, floored), its checkpointed state, and an exact resume with it on."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from retool import curriculum, runs
from retool.config import ConfigError, make_config
from retool.curriculum import (DECAY, PRIOR_GROUPS, PRIOR_TRIALS, Counts, PoolState, draw, mixed_chance,
                               pool_metrics, record, weights)
from retool.log import read_metrics
from retool.train import TrainConfig, Trainer
from retool.types import Problem
from tests.test_train import TIMING_METRICS, final_state, problem_order, run_cli
from tests.tiny import DIGIT_QUESTION, boxed_digit_model_dir

ALL_RIGHT, ALL_WRONG, MIXED = [1.0] * 4, [-1.0] * 4, [1.0, -1.0, -1.0, -1.0]


def pool(n: int, family: str = "f") -> list[Problem]:
    return [Problem(f"{family}{i}", "q", "1", family) for i in range(n)]


def beta_binomial_mixed(alpha: float, beta: float, g: int) -> float:
    """1 − P(0 of g) − P(g of g) by the explicit sum of the beta-binomial pmf (scipy-free)."""
    def log_b(a, b):
        return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    pmf = [math.comb(g, k) * math.exp(log_b(k + alpha, g - k + beta) - log_b(alpha, beta)) for k in range(g + 1)]
    assert sum(pmf) == pytest.approx(1.0)
    return sum(pmf[1:-1])


# ---------------------------------------------------------------- the rule


def test_the_mixed_chance_is_the_beta_binomial_and_peaks_at_one_half():
    assert mixed_chance(1, 1, 8) == pytest.approx(7 / 9)  # uniform prior: every count 0..8 equally likely
    for alpha, beta in ((3.0, 5.0), (17.0, 1.0), (0.5, 0.5), (40.0, 40.0)):
        assert mixed_chance(alpha, beta, 8) == pytest.approx(beta_binomial_mixed(alpha, beta, 8))
    assert mixed_chance(40, 40, 8) > mixed_chance(60, 20, 8) > mixed_chance(76, 4, 8)
    assert mixed_chance(40, 40, 8) > mixed_chance(1, 1, 8) > mixed_chance(0.5, 0.5, 8)  # uncertainty lowers it


def test_counts_are_discounted_per_family_and_kept_per_problem():
    a = pool(2, "a")
    state = record(PoolState(), [a[0]], [MIXED])
    assert state.problems == {"a0": Counts(4, 1, 1, 1)} and state.families == {"a": Counts(4, 1, 1, 1)}
    assert state.group_size == 4
    state = record(state, [a[1]], [ALL_RIGHT])
    assert state.families["a"] == Counts(DECAY * 4 + 4, DECAY * 1 + 4, DECAY + 1, DECAY)
    assert state.problems == {"a0": Counts(4, 1, 1, 1), "a1": Counts(4, 4, 1, 0)}


def test_weights_follow_the_documented_formulas():
    a, b = pool(3, "a"), pool(1, "b")
    state = record(PoolState(), [a[0], a[1]], [MIXED, ALL_RIGHT])
    fam = state.families["a"]  # 8 trials, 5 successes, 2 groups, 1 informative (the second after one DECAY)
    predicted = mixed_chance(1 + fam.successes, 1 + fam.trials - fam.successes, 4)
    fresh = (fam.informative + PRIOR_GROUPS * predicted) / (fam.groups + PRIOR_GROUPS)
    scale = PRIOR_TRIALS / (2 + fam.trials)
    alpha, beta = scale * (1 + fam.successes), scale * (1 + fam.trials - fam.successes)
    expected = [mixed_chance(alpha + 1, beta + 3, 4), mixed_chance(alpha + 4, beta, 4), fresh, mixed_chance(1, 1, 4)]
    assert list(weights(state, a + b, floor=0.01)) == pytest.approx(expected)
    assert expected[1] < 0.5 < expected[0]  # the problem solved 4/4 is unlikely to be mixed next time
    assert weights(state, a + b, floor=0.6)[1] == 0.6  # the floor: never starved


def test_a_family_whose_groups_are_never_mixed_sinks_though_its_success_rate_is_one_half():
    split = pool(8, "split")  # half its problems always solved, half never: p = 1/2, every group 0/G or G/G
    state = PoolState()
    for i in range(8):
        state = record(state, [split[i]], [ALL_RIGHT if i % 2 else ALL_WRONG])
    fam = state.families["split"]
    assert fam.successes / fam.trials == pytest.approx(0.5, abs=0.1)
    assert weights(state, [Problem("fresh", "q", "1", "split")], floor=0.1)[0] < 0.2  # predicted 0.8 alone


def test_metrics_count_seen_problems_the_floor_and_the_expected_share():
    problems = pool(4)
    state = record(PoolState(), problems[:1], [ALL_RIGHT])
    for sharpness in (1.0, 4.0):
        chances_N = np.asarray(curriculum.chances(state, problems))
        weights_N = weights(state, problems, floor=0.1, sharpness=sharpness)
        assert pool_metrics(state, problems, floor=0.1, sharpness=sharpness) == {
            "curriculum/seen_problems": 1.0, "curriculum/mean_weight": pytest.approx(weights_N.mean()),
            "curriculum/floor_share": pytest.approx(float((chances_N <= 0.1).mean())),
            "curriculum/expected_informative": pytest.approx((weights_N * chances_N).sum() / weights_N.sum())}


def test_sharpness_raises_the_floored_chance_to_its_power_and_favours_the_likeliest_mixed():
    a, b = pool(20, "a"), pool(20, "b")
    state = PoolState()
    for i in range(3):  # family a: groups mixed; family b: all right
        state = record(state, [a[i], b[i]], [[1.0, -1.0, 1.0, -1.0], ALL_RIGHT])
    plain, sharp = weights(state, a + b, floor=0.1), weights(state, a + b, floor=0.1, sharpness=4.0)
    assert list(sharp) == pytest.approx(list(plain**4))
    assert sharp[3] / sharp[23] == pytest.approx((plain[3] / plain[23]) ** 4)
    def share_of_a(sharpness: float) -> float:
        picked = [i for step in range(1, 301)
                  for i in draw(state, a + b, 1, seed=0, step=step, round_=0, floor=0.1, sharpness=sharpness)]
        return sum(i < 20 for i in picked) / len(picked)
    assert share_of_a(4.0) > share_of_a(1.0)


def test_record_refuses_groups_that_do_not_match_their_problems():
    with pytest.raises(ValueError):
        record(PoolState(), pool(2), [ALL_RIGHT])


def test_state_survives_a_json_round_trip_exactly():
    state = PoolState()
    for step in range(5):
        state = record(state, pool(3), [MIXED, ALL_RIGHT, ALL_WRONG][step % 3:] + [MIXED] * (step % 3))
    assert PoolState.from_json(json.loads(json.dumps(state.to_json()))) == state


def test_a_checkpoint_of_the_earlier_rule_is_refused_with_a_reason():
    with pytest.raises(ConfigError, match="earlier version"):
        PoolState.from_json({"problems": {"a0": 0.5}, "families": {"a": 0.5}})


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
    for i in range(3):  # every easy group came back G/G three times, every hard one mixed
        state = record(state, [easy[i], hard[i]], [ALL_RIGHT, [1.0, -1.0, 1.0, -1.0]])
    problems = easy + hard
    picked = [i for step in range(1, 401) for i in draw(state, problems, 1, seed=0, step=step, round_=0, floor=0.1)]
    easy_share = sum(i < 50 for i in picked) / len(picked)
    weights_N = weights(state, problems, floor=0.1)
    expected = weights_N[:50].sum() / weights_N.sum()
    assert expected < 0.2 and weights_N[:50].min() >= 0.1
    assert abs(easy_share - expected) < 0.06, (easy_share, expected)


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
    with pytest.raises(ConfigError, match="curriculum_sharpness"):
        make_config(TrainConfig, curriculum="difficulty", curriculum_sharpness=0.0)
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
