"""The algorithm's pure functions against hand computations."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from retool import algo
from retool.types import Datum, Grade, StopReason, Trajectory

# ---------------------------------------------------------------- advantages


def test_group_advantages_are_centred_rewards():
    assert algo.group_advantages([1.0, -1.0, -1.0, 1.0]) == (1.0, -1.0, -1.0, 1.0)
    assert algo.group_advantages([1.0, -1.0, -1.0, -1.0]) == pytest.approx((1.5, -0.5, -0.5, -0.5))


def test_group_advantages_std_normalisation():
    # mean -0.5, population std sqrt(0.75)
    std = math.sqrt(0.75)
    got = algo.group_advantages([1.0, -1.0, -1.0, -1.0], normalize_std=True, eps=0.0)
    assert got == pytest.approx((1.5 / std, -0.5 / std, -0.5 / std, -0.5 / std))


def test_degenerate_groups_get_zero_advantages_and_are_counted():
    assert algo.group_advantages([-1.0] * 8) == (0.0,) * 8
    assert algo.group_advantages([1.0] * 8, normalize_std=True) == (0.0,) * 8
    assert algo.count_degenerate_groups([[1, 1], [1, -1], [-1, -1], [0.5]]) == 3


def test_group_advantages_reject_bad_rewards():
    with pytest.raises(ValueError):
        algo.group_advantages([])
    with pytest.raises(ValueError):
        algo.group_advantages([1.0, float("nan")])


# ---------------------------------------------------------------- datums


def _trajectory(reward: float) -> Trajectory:
    # prompt 3 tokens | sampled 2 | interpreter 2 | sampled 2
    return Trajectory(
        problem_id="p", prompt_len=3,
        tokens_T=(10, 11, 12, 20, 21, 30, 31, 22, 23),
        mask_T=(0, 0, 0, 1, 1, 0, 0, 1, 1),
        logprobs_T=(0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3, -0.4),
        turns=(), grade=Grade(reward=reward, correct=reward > 0, formatted=True),
        stop_reason=StopReason.STOP)


def test_trajectory_datum_shifts_and_masks():
    d = algo.trajectory_datum(_trajectory(1.0), advantage=0.75)
    assert d.input_tokens_N == (10, 11, 12, 20, 21, 30, 31, 22)
    assert d.target_tokens_N == (11, 12, 20, 21, 30, 31, 22, 23)
    assert d.weights_N == (0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0)
    assert d.sampler_logprobs_N == (0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3, -0.4)
    assert d.advantages_N == (0.0, 0.0, 0.75, 0.75, 0.0, 0.0, 0.75, 0.75)
    assert d.num_trained == 4


def test_datum_zeroes_logprobs_and_advantages_off_policy():
    d = algo.make_datum([1, 2, 3, 4], [0, 1, 0, 1], [-9.0, -1.0, -9.0, -2.0], advantage=-2.0)
    assert d.sampler_logprobs_N == (-1.0, 0.0, -2.0)
    assert d.advantages_N == (-2.0, 0.0, -2.0)


def test_group_datums_use_group_centred_advantages():
    datums = algo.group_datums([_trajectory(1.0), _trajectory(-1.0), _trajectory(-1.0), _trajectory(-1.0)])
    policy_advantages = [d.advantages_N[-1] for d in datums]
    assert policy_advantages == pytest.approx([1.5, -0.5, -0.5, -0.5])


def test_sft_datum_has_no_rl_fields():
    d = algo.make_datum([1, 2, 3], [0, 1, 1])
    assert d.weights_N == (1.0, 1.0) and d.sampler_logprobs_N == () and d.advantages_N == ()


@pytest.mark.parametrize("tokens, mask, logprobs", [
    ([1, 2, 3], [0, 1], None),          # length mismatch
    ([1, 2, 3], [0, 1, 1], [0.0]),      # logprob length mismatch
    ([1], [0], None),                   # too short
    ([1, 2], [1, 1], None),             # first token cannot be trained
    ([1, 2], [0, 2], None),             # not a 0/1 mask
])
def test_make_datum_rejects_malformed_input(tokens, mask, logprobs):
    with pytest.raises(ValueError):
        algo.make_datum(tokens, mask, logprobs)


def test_datum_record_checks_lengths():
    with pytest.raises(ValueError):
        Datum((1, 2), (2, 3), (1.0,))
    with pytest.raises(ValueError):
        Datum((1, 2), (2, 3), (1.0, 1.0), sampler_logprobs_N=(0.0,), advantages_N=(1.0, 1.0))


# ---------------------------------------------------------------- losses


def _inputs(sampler, adv):
    return algo.LossInputs(torch.tensor(sampler), torch.tensor(adv))


def test_ppo_loss_hand_computed_with_clip_higher():
    cfg = algo.loss_config("ppo")
    ratios = [1.5, 1.5, 0.5, 0.5, 1.1]
    adv = [1.0, -1.0, 1.0, -1.0, 2.0]
    logprobs = torch.tensor([math.log(r) for r in ratios], requires_grad=True)
    terms = algo.ppo_loss(logprobs, _inputs([0.0] * 5, adv), cfg)
    # A>0, r=1.5 -> clipped at 1.28; A<0, r=1.5 -> unclipped 1.5;
    # A>0, r=0.5 -> unclipped -0.5; A<0, r=0.5 -> clipped at 0.8; r=1.1 inside -> -2.2
    assert terms.loss_N.tolist() == pytest.approx([-1.28, 1.5, -0.5, 0.8, -2.2])
    assert terms.clipped_N.tolist() == [True, False, False, True, False]
    terms.loss_N.sum().backward()
    # d(-A r)/d logprob = -A r where unclipped, 0 where clipped
    assert logprobs.grad.tolist() == pytest.approx([0.0, 1.5, -0.5, 0.0, -2.2])


def test_ppo_dual_clip_caps_negative_advantage_losses():
    cfg = algo.loss_config("ppo", {"dual_clip": 10.0})
    logprobs = torch.tensor([math.log(20.0), math.log(20.0), math.log(5.0)], requires_grad=True)
    terms = algo.ppo_loss(logprobs, _inputs([0.0] * 3, [-1.0, 1.0, -1.0]), cfg)
    assert terms.loss_N.tolist() == pytest.approx([10.0, -1.28, 5.0])
    assert terms.clipped_N.tolist() == [True, True, False]
    terms.loss_N.sum().backward()
    assert logprobs.grad.tolist() == pytest.approx([0.0, 0.0, 5.0])


def test_importance_sampling_loss_hand_computed():
    logprobs = torch.tensor([math.log(0.5), math.log(0.25)], requires_grad=True)
    sampler = [math.log(0.25), math.log(0.25)]
    terms = algo.importance_sampling_loss(logprobs, _inputs(sampler, [1.0, -3.0]), {})
    assert terms.loss_N.tolist() == pytest.approx([-2.0, 3.0])
    assert terms.clipped_N is None
    terms.loss_N.sum().backward()
    assert logprobs.grad.tolist() == pytest.approx([-2.0, 3.0])


def test_cross_entropy_token_mean_hand_computed():
    logprobs = torch.tensor([-1.0, -2.0, -4.0])
    weights = torch.tensor([1.0, 0.0, 1.0])
    loss = algo.token_mean(algo.cross_entropy_loss(logprobs, algo.LossInputs(), {}).loss_N, weights)
    assert loss.item() == pytest.approx(2.5)


def test_micro_batch_shares_add_up_to_the_token_mean():
    loss_N = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    weights_N = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
    full = algo.token_mean(loss_N, weights_N)
    parts = (algo.weighted_sum(loss_N[:2], weights_N[:2], 4.0)
             + algo.weighted_sum(loss_N[2:], weights_N[2:], 4.0))
    assert parts.item() == pytest.approx(full.item()) == pytest.approx(3.0)


def test_loss_registry_and_config_validation():
    assert set(algo.LOSSES) == {"ppo", "importance_sampling", "cross_entropy"}
    assert algo.loss_config("ppo") == {"temperature": 1.0, "clip_low_threshold": 0.8,
                                       "clip_high_threshold": 1.28, "dual_clip": 0.0,
                                       "behaviour_token_cap": 0.0, "behaviour_sequence_cap": 0.0,
                                       "behaviour_mask_threshold": 0.0}
    for bad in [("dpo", None), ("ppo", {"clip_lo": 0.8}), ("ppo", {"clip_low_threshold": 1.2}),
                ("ppo", {"dual_clip": 0.5}), ("cross_entropy", {"temperature": 0.0}),
                ("importance_sampling", {"clip_low_threshold": 0.8})]:
        with pytest.raises(ValueError):
            algo.loss_config(*bad)


# ---------------------------------------------------------------- micro-batching


def test_bucketed_plan_respects_padded_budget():
    lengths = [10, 3, 9, 4, 25, 2]
    plan = algo.plan_micro_batches(lengths, token_budget=20, packing="bucketed")
    assert sorted(i for batch in plan for i in batch) == list(range(6))
    assert plan[0] == (4,)  # longer than the budget: alone
    for batch in plan[1:]:
        assert len(batch) * max(lengths[i] for i in batch) <= 20
    assert plan[1] == (0, 2)  # the two long ones share a bucket


def test_packed_plan_sums_lengths():
    plan = algo.plan_micro_batches([10, 3, 9, 4, 2], token_budget=14, packing="packed")
    assert plan == [(0, 3), (2, 1, 4)]
    with pytest.raises(ValueError):
        algo.plan_micro_batches([1], 10, packing="zip")


# ---------------------------------------------------------------- pass@k advantages


def test_passk_rewards_hand_computed_binary_group():
    # n=4, k=2: the correct sample is the best of its 3 pairs (1); each wrong one shares
    # 1 of its 3 pairs with the correct one (1/3)
    assert algo.passk_rewards([1.0, 0.0, 0.0, 0.0], 2) == pytest.approx((1.0, 1 / 3, 1 / 3, 1 / 3))


def test_passk_rewards_hand_computed_graded_rewards():
    # pairs {0,1}: 1, {0,2}: 0.5, {1,2}: 1 -> each sample's mean over its two pairs
    assert algo.passk_rewards([0.5, 1.0, 0.0], 2) == pytest.approx((0.75, 1.0, 0.75))
    # n=4, k=3: triples of {-1, -1, 1, -1}: any triple with sample 2 is 1, the one without is -1
    assert algo.passk_rewards([-1.0, -1.0, 1.0, -1.0], 3) == pytest.approx((1 / 3, 1 / 3, 1.0, 1 / 3))


def test_passk_one_is_grpo_and_bad_k_is_refused():
    assert algo.passk_rewards([0.3, -1.0, 2.0], 1) == (0.3, -1.0, 2.0)
    for k in (0, 3):
        with pytest.raises(ValueError, match="1 <= k < group size"):
            algo.passk_rewards([0.3, -1.0, 2.0], k)


# ---------------------------------------------------------------- overlong trajectories


def test_overlong_penalty_hand_computed():
    assert [algo.overlong_penalty(n, 100, 20) for n in (10, 80, 90, 100, 120)] == pytest.approx(
        [0.0, 0.0, -0.5, -1.0, -1.0])
    assert algo.overlong_penalty(30, 40, 100) == pytest.approx(-0.75)  # buffer cut to the budget: -30/40
    with pytest.raises(ValueError):
        algo.overlong_penalty(10, 100, 0)


def test_policy_token_budget_and_length_count_only_policy_tokens():
    assert algo.policy_token_budget(8192, 1024, 6, 500) == 6144
    assert algo.policy_token_budget(2000, 1024, 6, 500) == 1500
    t = _trajectory(1.0)
    assert algo.policy_tokens(t) == 4  # 2 + 2 sampled; prompt and interpreter tokens excluded
    assert not algo.is_truncated(t)
    for reason in (StopReason.LENGTH, StopReason.BUDGET, StopReason.PROMPT):
        assert algo.is_truncated(dataclasses.replace(t, stop_reason=reason))


def test_sampler_nll_is_the_mean_negative_sampler_logprob_of_trained_tokens():
    d = algo.trajectory_datum(_trajectory(1.0), 0.5)
    assert algo.sampler_nll([d, d]) == pytest.approx((0.1 + 0.2 + 0.3 + 0.4) / 4)
    assert algo.sampler_nll([]) == 0.0


# ---------------------------------------------------------------- sampler-trainer correction


RATIOS = [2.5, 1.2, 0.4, 9.0]
TRAINED = torch.tensor([True, True, True, False])


def _behaviour(config):
    sampler = torch.full((4,), -1.0)
    old = torch.tensor([math.log(r) for r in RATIOS]) + sampler
    return algo.behaviour_weights(old, sampler, TRAINED, config)


def test_token_tis_caps_each_ratio():
    w = _behaviour({"behaviour_token_cap": 2.0})
    assert w.ratio_N.tolist() == pytest.approx([2.5, 1.2, 0.4, 1.0])  # untrained: ratio 1
    assert w.weight_N.tolist() == pytest.approx([2.0, 1.2, 0.4, 0.0])
    assert w.limited_N.tolist() == [True, False, False, False]


def test_sequence_tis_caps_the_product_over_trained_tokens():
    w = _behaviour({"behaviour_sequence_cap": 2.0})  # 2.5 * 1.2 * 0.4 = 1.2
    assert w.weight_N.tolist() == pytest.approx([1.2, 1.2, 1.2, 0.0])
    assert not w.limited_N.any()
    w = _behaviour({"behaviour_sequence_cap": 1.1})
    assert w.weight_N.tolist() == pytest.approx([1.1, 1.1, 1.1, 0.0])
    assert w.limited_N.tolist() == [True, True, True, False]


def test_token_mask_drops_tokens_outside_the_threshold_band():
    w = _behaviour({"behaviour_mask_threshold": 2.0})  # keep 1/2 <= r <= 2
    assert w.weight_N.tolist() == [0.0, 1.0, 0.0, 0.0]
    assert w.limited_N.tolist() == [True, False, True, False]


def test_behaviour_config_takes_one_correction_above_one():
    assert algo.loss_config("ppo", {"behaviour_token_cap": 2.0})["behaviour_token_cap"] == 2.0
    with pytest.raises(ValueError, match="choose one"):
        algo.loss_config("ppo", {"behaviour_token_cap": 2.0, "behaviour_mask_threshold": 2.0})
    with pytest.raises(ValueError, match="> 1"):
        algo.loss_config("importance_sampling", {"behaviour_sequence_cap": 0.5})
    with pytest.raises(ValueError, match="exactly one"):
        _behaviour({})


@pytest.mark.parametrize("loss_fn", ["ppo", "importance_sampling"])
def test_behaviour_weights_make_the_ratio_pi_theta_over_pi_old(loss_fn):
    # sampler logprobs far off (ratio vs mu = 3): without weights PPO clips token 0;
    # with weights the ratio is pi_theta / pi_old = 1, so the loss is -A * w and so is its gradient
    logprobs = torch.tensor([math.log(0.3), math.log(0.3)], requires_grad=True)
    inputs = algo.LossInputs(torch.tensor([math.log(0.1)] * 2), torch.tensor([1.0, -2.0]),
                             behaviour_weights_N=torch.tensor([2.0, 0.5]))
    terms = algo.LOSSES[loss_fn](logprobs, inputs, algo.loss_config(loss_fn))
    assert terms.loss_N.tolist() == pytest.approx([-2.0, 1.0])
    terms.loss_N.sum().backward()
    assert logprobs.grad.tolist() == pytest.approx([-2.0, 1.0])
    if loss_fn == "ppo":
        assert not terms.clipped_N.any()


def test_the_kl_anchor_lowers_each_trained_tokens_advantage_by_its_log_ratio():
    datum = Datum(input_tokens_N=(1, 2, 3, 4), target_tokens_N=(2, 3, 4, 5), weights_N=(0.0, 1.0, 1.0, 0.0),
                  sampler_logprobs_N=(0.0, -0.5, -2.0, 0.0), advantages_N=(0.0, 1.0, 1.0, 0.0))
    anchored, gap_sum, count = algo.kl_anchored(datum, (-9.0, -1.0, -1.5, -9.0), 0.2)
    # log-ratios 0.5 (now likelier than at the start: pushed back) and -0.5 (less likely: pushed up)
    assert anchored.advantages_N == pytest.approx((0.0, 0.9, 1.1, 0.0))
    assert (gap_sum, count) == (pytest.approx(0.0), 2)
    assert anchored.sampler_logprobs_N == datum.sampler_logprobs_N and anchored.weights_N == datum.weights_N
    assert algo.kl_anchored(datum, (-9.0, -0.5, -2.0, -9.0), 0.2)[0] == datum  # the start's policy: no penalty
    with pytest.raises(ValueError, match="3 entries for a datum of 4 tokens"):
        algo.kl_anchored(datum, (0.0, 0.0, 0.0), 0.2)
