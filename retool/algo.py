"""The RL algorithm as pure functions: advantages, datum assembly, losses, micro-batching.

Everything here takes numbers, records or tensors and returns numbers, records or
tensors; nothing holds state, touches a model or an optimiser. The engines call these
functions, and the tests check them against hand computations.

- **Advantages** (GRPO): ``r - mean(group)``, optionally divided by the group's std.
  A group whose rewards are all equal is *degenerate*: every advantage is 0 and it
  teaches nothing, so it is counted (``rollout/degenerate_group_rate``).
- **Datums**: a trajectory's tokens shifted into inputs/targets; the loss weight is the
  policy mask (1 = sampled by the policy, 0 = prompt, template or interpreter tokens),
  and advantages and sampler logprobs are 0 wherever the weight is 0.
- **Losses** (``LOSSES``, chosen by name): each maps trainer logprobs and a
  :class:`LossInputs` record to a per-token loss; :func:`token_mean` reduces it.
  Aggregation is the token mean over every trained token of one ``forward_backward``
  call, so micro-batches are each divided by the *whole* batch's token count and their
  gradients add up to the full-batch gradient exactly (up to float rounding).
- **Micro-batching**: :func:`plan_micro_batches` splits a batch under a token budget,
  either length-bucketed (padded rows of similar length) or packed (padding-free), and
  :func:`prefix_tree` merges sequences' equal prefixes for the ``prefix-tree`` packing.

- **Sampler-trainer correction** (off by default): :func:`behaviour_weights` truncates
  or masks the importance ratio ``pi_old / mu`` between the trainer's and the sampler's
  logprobs; the RL losses then use ``pi_theta / pi_old`` as their ratio.
- **Overlong trajectories** and **pass@k rewards** (off by default):
  :func:`overlong_penalty`, :func:`is_truncated`, :func:`passk_rewards`.
- **Learning-rate schedule** (constant by default): :func:`scheduled_lr`.
- **An anchor to the starting policy** (off by default, ``--kl-coef``): :func:`kl_anchored`
  lowers each trained token's advantage by ``coef x (sampler - reference logprob)``, a
  per-token KL penalty folded into the advantages (the seed and ReTool's reproduction
  train without one).

Deliberately left out: entropy bonuses, sequence-level aggregation, value functions.
torch is not imported here (the losses only call tensor methods), so the
command line stays fast to start.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from retool.types import Datum, StopReason, Trajectory

if TYPE_CHECKING:
    from torch import Tensor


# ---------------------------------------------------------------- advantages


def group_advantages(rewards_G: Sequence[float], normalize_std: bool = False,
                     eps: float = 1e-6) -> tuple[float, ...]:
    """GRPO advantages of one group: each reward minus the group mean.

    With ``normalize_std`` the centred rewards are divided by ``std + eps`` (population
    std), as in the original GRPO; the seed's default is plain centring. A degenerate
    group gets all zeros either way.
    """
    if not rewards_G:
        raise ValueError("a group needs at least one reward")
    if not all(math.isfinite(r) for r in rewards_G):
        raise ValueError(f"rewards must be finite, got {list(rewards_G)}")
    if is_degenerate(rewards_G):
        return (0.0,) * len(rewards_G)
    mean = statistics.fmean(rewards_G)
    scale = statistics.pstdev(rewards_G) + eps if normalize_std else 1.0
    return tuple((r - mean) / scale for r in rewards_G)


def passk_rewards(rewards_G: Sequence[float], k: int) -> tuple[float, ...]:
    """Pass@k-aware rewards of one group (PKPO, Walder & Karkhanis 2025; verl ``grpo_passk``).

    Sample ``i``'s new reward is the mean, over every ``k``-subset of the group that
    contains it, of the subset's best reward: the unbiased pass@k estimator's share of
    sample ``i``. With rewards sorted ascending, sample ``i`` at (1-based) rank ``p`` is
    the best of ``C(p-1, k-1)`` such subsets, and the sample at rank ``q > p`` is the
    best of ``C(q-2, k-2)``; so ``s_i = (C(p-1,k-1) r_i + sum_{q>p} C(q-2,k-2) r_(q)) /
    C(n-1,k-1)``. ``k = 1`` gives the rewards unchanged; a larger ``k`` moves credit
    from the best samples to the rest of a group that has one good answer. The result is
    group-centred like any reward (:func:`group_advantages`). Needs ``1 <= k < n``
    (``k = n`` gives every sample the group's best reward: no signal).
    """
    n = len(rewards_G)
    if not 1 <= k < n:
        raise ValueError(f"passk needs 1 <= k < group size, got k={k} for {n} rewards")
    order = sorted(range(n), key=lambda i: (rewards_G[i], i))
    sorted_r = [rewards_G[i] for i in order]
    total = math.comb(n - 1, k - 1)
    out = [0.0] * n
    for p, i in enumerate(order, start=1):
        above = sum(math.comb(q - 2, k - 2) * sorted_r[q - 1] for q in range(p + 1, n + 1)) if k >= 2 else 0.0
        out[i] = (math.comb(p - 1, k - 1) * sorted_r[p - 1] + above) / total
    return tuple(out)


ADVANTAGES = ("grpo", "passk")
"""``grpo``: group-centred rewards; ``passk``: :func:`passk_rewards` first, then centred."""


def is_degenerate(rewards_G: Sequence[float]) -> bool:
    """True when every reward of the group is equal, so all advantages are zero."""
    return max(rewards_G) - min(rewards_G) == 0.0


def count_degenerate_groups(rewards_BG: Sequence[Sequence[float]]) -> int:
    """How many of the groups are degenerate (for ``rollout/degenerate_group_rate``)."""
    return sum(1 for rewards_G in rewards_BG if is_degenerate(rewards_G))


# ---------------------------------------------------------------- learning-rate schedule


LR_SCHEDULES = ("constant", "cosine")
"""``constant``: the same learning rate every step; ``cosine``: from the full rate at the
first step along a half cosine to ``min_ratio`` of it at the last (:func:`scheduled_lr`)."""


def scheduled_lr(lr: float, step: int, max_steps: int, schedule: str = "constant", min_ratio: float = 0.0) -> float:
    """The learning rate of ``step`` (1-based) of a run of ``max_steps``.

    A function of the step alone, so a resumed run applies the rates the uninterrupted run
    would have; steps past ``max_steps`` (a run extended) keep the last step's rate.
    """
    if schedule == "constant":
        return lr
    if schedule != "cosine":
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; expected one of {', '.join(LR_SCHEDULES)}")
    progress = min(1.0, (step - 1) / (max_steps - 1)) if max_steps > 1 else 0.0
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


# ---------------------------------------------------------------- overlong trajectories


OVERLONG = ("none", "mask", "soft")
"""``none``: truncated trajectories are graded like any other (no box: -1); ``mask``:
they get loss weight 0 (no gradient; counted); ``soft``: DAPO's linear length penalty
(:func:`overlong_penalty`) is added to every reward before group-centring."""


def is_truncated(trajectory: Trajectory) -> bool:
    """True when a budget, not the policy, ended the trajectory (turn or trajectory tokens,
    turns or code calls ran out; or the prompt alone filled the budget)."""
    return trajectory.stop_reason is not StopReason.STOP


def policy_tokens(trajectory: Trajectory) -> int:
    """Tokens the policy sampled (mask 1): prompt, template and interpreter tokens never count."""
    return sum(trajectory.mask_T)


def policy_token_budget(max_trajectory_tokens: int, max_turn_tokens: int, max_assistant_turns: int,
                        prompt_len: int) -> int:
    """The most tokens the policy could sample in one trajectory: the trajectory budget
    less the prompt, and at most ``max_assistant_turns * max_turn_tokens``. Tool responses
    take room from the first bound, so a trajectory that calls tools stops earlier; the
    penalty measures only the policy's own tokens against this ceiling."""
    return max(1, min(max_trajectory_tokens - prompt_len, max_assistant_turns * max_turn_tokens))


def overlong_penalty(length: int, budget: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) of a response of ``length``
    policy tokens: 0 up to ``budget - buffer``, then falling linearly to -1 at ``budget``,
    -1 beyond. Added to the outcome reward. A buffer longer than the budget is cut to it."""
    if buffer < 1 or budget < 1:
        raise ValueError(f"overlong buffer and budget must be >= 1, got {buffer} and {budget}")
    buffer = min(buffer, budget)
    if length <= budget - buffer:
        return 0.0
    if length <= budget:
        return (budget - buffer - length) / buffer
    return -1.0


def sampler_nll(datums_D: Sequence[Datum]) -> float:
    """Mean ``-log mu`` of the sampled tokens over the trained tokens: a one-sample
    estimate of the sampling policy's entropy (exact in expectation at top_p 1), which
    every engine has (the services return no entropy). 0.0 without trained tokens."""
    pairs = [(lp, w) for d in datums_D for lp, w in zip(d.sampler_logprobs_N, d.weights_N) if w != 0]
    return -sum(lp for lp, _ in pairs) / len(pairs) if pairs else 0.0


# ---------------------------------------------------------------- datums


def make_datum(tokens_T: Sequence[int], mask_T: Sequence[int],
               logprobs_T: Sequence[float] | None = None, advantage: float = 0.0) -> Datum:
    """Shift a token sequence into a training :class:`Datum`.

    ``mask_T[t]`` is 1 when token ``t`` was sampled by the policy (or is supervised, for
    SFT) and 0 otherwise. Target ``t`` of the datum is token ``t + 1``; its weight is
    ``mask_T[t + 1]``, its advantage ``advantage`` where the weight is 1 and 0.0
    elsewhere, its sampler logprob ``logprobs_T[t + 1]`` (0.0 where the weight is 0).
    Pass ``logprobs_T=None`` for cross-entropy datums (no sampler logprobs, no
    advantages). The first token can never be trained (nothing predicts it), so a
    mask that marks it is rejected, as are masks with values other than 0 and 1.
    """
    lengths = {len(tokens_T), len(mask_T)} | ({len(logprobs_T)} if logprobs_T is not None else set())
    if len(lengths) != 1:
        raise ValueError("tokens_T, mask_T and logprobs_T must have the same length")
    if len(tokens_T) < 2:
        raise ValueError(f"a datum needs at least 2 tokens, got {len(tokens_T)}")
    if any(m not in (0, 1) for m in mask_T):
        raise ValueError("mask_T must contain only 0 and 1")
    if mask_T[0]:
        raise ValueError("mask_T[0] is 1, but the first token has no context to be trained from")
    weights_N = tuple(float(m) for m in mask_T[1:])
    if logprobs_T is None:
        return Datum(tuple(tokens_T[:-1]), tuple(tokens_T[1:]), weights_N)
    return Datum(
        input_tokens_N=tuple(tokens_T[:-1]),
        target_tokens_N=tuple(tokens_T[1:]),
        weights_N=weights_N,
        sampler_logprobs_N=tuple(lp if m else 0.0 for lp, m in zip(logprobs_T[1:], mask_T[1:])),
        advantages_N=tuple(advantage * w for w in weights_N),
    )


def trajectory_datum(trajectory: Trajectory, advantage: float) -> Datum:
    """The RL datum of one trajectory: its policy tokens carry ``advantage``."""
    return make_datum(trajectory.tokens_T, trajectory.mask_T, trajectory.logprobs_T, advantage)


def group_datums(group: Sequence[Trajectory], normalize_std: bool = False) -> tuple[Datum, ...]:
    """The datums of one group of trajectories of the same problem, GRPO-weighted."""
    advantages_G = group_advantages([t.grade.reward for t in group], normalize_std)
    return tuple(trajectory_datum(t, a) for t, a in zip(group, advantages_G))


def kl_anchored(datum: Datum, reference_logprobs_N: Sequence[float], coef: float) -> tuple[Datum, float, int]:
    """``datum`` with each trained token's advantage lowered by ``coef x (sampler logprob -
    reference logprob)``, and that log-ratio's sum and count over the trained tokens.

    A token the policy now samples more readily than the reference did is pushed back in
    proportion; the log-ratio's mean over sampled tokens estimates KL(sampler || reference)
    (the k1 estimator). Folding the penalty into the advantages, as Tinker's cookbook does,
    leaves every loss and engine as it is. Tokens of weight 0 keep advantage 0.
    """
    if len(reference_logprobs_N) != datum.num_tokens:
        raise ValueError(f"reference logprobs: {len(reference_logprobs_N)} entries for a datum of "
                         f"{datum.num_tokens} tokens")
    advantages_N, gap_sum, count = list(datum.advantages_N), 0.0, 0
    for i, weight in enumerate(datum.weights_N):
        if weight:
            gap = datum.sampler_logprobs_N[i] - reference_logprobs_N[i]
            advantages_N[i] -= coef * gap
            gap_sum, count = gap_sum + gap, count + 1
    return replace(datum, advantages_N=tuple(advantages_N)), gap_sum, count


# ---------------------------------------------------------------- losses


BEHAVIOUR_IS = ("off", "token-tis", "sequence-tis", "token-mask")
"""Corrections for the sampler-trainer mismatch (:func:`behaviour_weights`)."""

BEHAVIOUR_IS_KEYS = {"token-tis": "behaviour_token_cap", "sequence-tis": "behaviour_sequence_cap",
                     "token-mask": "behaviour_mask_threshold"}
"""The RL-loss config key that turns each correction on (its value is the cap or threshold)."""



@dataclass(frozen=True)
class LossInputs:
    """What a loss needs besides the trainer's logprobs, one entry per target token.

    ``sampler_logprobs_N`` and ``advantages_N`` are ``None`` for ``cross_entropy``.
    ``behaviour_weights_N`` (a sampler-trainer correction, :func:`behaviour_weights`)
    switches the RL losses to the decoupled form: their ratio becomes ``pi_theta /
    pi_old`` (``pi_old`` = the trainer's logprobs, detached) and the per-token loss is
    multiplied by the weights; ``None`` (the default) keeps ``pi_theta / mu``.
    """

    sampler_logprobs_N: Tensor | None = None
    advantages_N: Tensor | None = None
    behaviour_weights_N: Tensor | None = None

    def ratio(self, logprobs_N: Tensor) -> Tensor:
        """The policy ratio: ``pi_theta / mu``, or ``pi_theta / pi_old`` with behaviour weights."""
        if self.behaviour_weights_N is None:
            return (logprobs_N - self.sampler_logprobs_N).exp()
        return (logprobs_N - logprobs_N.detach()).exp()

    def weighted(self, loss_N: Tensor) -> Tensor:
        return loss_N if self.behaviour_weights_N is None else loss_N * self.behaviour_weights_N


@dataclass(frozen=True)
class LossTerms:
    """A loss's per-token output, before weighting and aggregation.

    ``clipped_N`` marks tokens whose gradient a clip zeroed (PPO); ``None`` for losses
    that never clip.
    """

    loss_N: Tensor
    clipped_N: Tensor | None = None


LossFn = Callable[["Tensor", LossInputs, Mapping[str, float]], LossTerms]


def ppo_loss(logprobs_N: Tensor, inputs: LossInputs, config: Mapping[str, float]) -> LossTerms:
    """PPO clipped surrogate with asymmetric ("clip-higher") ratio bounds.

    ``ratio = exp(logprob - sampler_logprob)``; per token
    ``loss = max(-A * ratio, -A * clip(ratio, clip_low_threshold, clip_high_threshold))``.
    With ``dual_clip = c > 1`` (Ye et al., 2020) the loss of a negative-advantage token
    is further capped at ``-A * c``, so one very unlikely sampled token cannot dominate.
    Config: ``clip_low_threshold`` (0.8), ``clip_high_threshold`` (1.28), ``dual_clip``
    (0 = off).
    """
    advantages_N = inputs.advantages_N
    ratio_N = inputs.ratio(logprobs_N)
    pg_loss1_N = -advantages_N * ratio_N
    pg_loss2_N = -advantages_N * ratio_N.clamp(config["clip_low_threshold"],
                                                config["clip_high_threshold"])
    loss_N = pg_loss1_N.maximum(pg_loss2_N)
    clipped_N = pg_loss2_N > pg_loss1_N
    c = config["dual_clip"]
    if c:
        pg_loss3_N = -advantages_N * c
        dual_N = (advantages_N < 0) & (pg_loss3_N < loss_N)
        loss_N = pg_loss3_N.where(dual_N, loss_N)
        clipped_N = clipped_N | dual_N
    return LossTerms(inputs.weighted(loss_N), clipped_N)


def importance_sampling_loss(logprobs_N: Tensor, inputs: LossInputs,
                             config: Mapping[str, float]) -> LossTerms:
    """REINFORCE corrected for the sampler: ``loss = -A * exp(logprob - sampler_logprob)``.

    No clipping; on-policy the ratio is ~1 and this is plain policy gradient. With
    behaviour weights: ``loss = -A * w * exp(logprob - pi_old)``.
    """
    return LossTerms(inputs.weighted(-inputs.advantages_N * inputs.ratio(logprobs_N)))


def cross_entropy_loss(logprobs_N: Tensor, inputs: LossInputs,
                       config: Mapping[str, float]) -> LossTerms:
    """Supervised next-token loss: ``loss = -logprob`` (weights select the tokens)."""
    return LossTerms(-logprobs_N)


LOSSES: dict[str, LossFn] = {
    "ppo": ppo_loss,
    "importance_sampling": importance_sampling_loss,
    "cross_entropy": cross_entropy_loss,
}
"""Loss functions by the name ``forward_backward(loss_fn=...)`` takes (Tinker's names)."""

BEHAVIOUR_DEFAULTS: dict[str, float] = {key: 0.0 for key in BEHAVIOUR_IS_KEYS.values()}
"""The sampler-trainer corrections every RL loss accepts, all off (0)."""

LOSS_DEFAULTS: dict[str, dict[str, float]] = {
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28, "dual_clip": 0.0, **BEHAVIOUR_DEFAULTS},
    "importance_sampling": dict(BEHAVIOUR_DEFAULTS),
    "cross_entropy": {},
}
"""Default ``loss_fn_config`` of each loss; a config may override only these keys."""

ENGINE_LOSS_KEYS: dict[str, float] = {"temperature": 1.0}
"""Config keys every loss accepts, used by the engine rather than the loss itself:
``temperature`` is the sampling temperature, so the trainer's logprobs are
``log_softmax(logits / temperature)`` like the sampler's."""

RL_LOSSES = frozenset({"ppo", "importance_sampling"})
"""Losses that need ``sampler_logprobs_N`` and ``advantages_N`` in every datum."""


def loss_config(loss_fn: str, overrides: Mapping[str, float] | None = None) -> dict[str, float]:
    """The full config of ``loss_fn``: its defaults updated by ``overrides``.

    Unknown loss names and unknown keys raise ``ValueError`` (a typo must not silently
    fall back to a default); so do clip bounds that do not bracket 1 and a dual clip
    that is neither 0 nor above 1.
    """
    if loss_fn not in LOSSES:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; choose one of {sorted(LOSSES)}")
    config = {**ENGINE_LOSS_KEYS, **LOSS_DEFAULTS[loss_fn]}
    unknown = set(overrides or {}) - set(config)
    if unknown:
        raise ValueError(f"unknown {loss_fn} config keys {sorted(unknown)}; known: {sorted(config)}")
    config.update({k: float(v) for k, v in (overrides or {}).items()})
    if config["temperature"] <= 0:
        raise ValueError("temperature must be > 0 (greedy samples have no trainable logprobs)")
    if loss_fn == "ppo":
        if not 0 < config["clip_low_threshold"] <= 1 <= config["clip_high_threshold"]:
            raise ValueError("ppo needs 0 < clip_low_threshold <= 1 <= clip_high_threshold")
        if config["dual_clip"] and config["dual_clip"] <= 1:
            raise ValueError("ppo dual_clip must be 0 (off) or > 1")
    _check_behaviour_config(config)
    return config


def _check_behaviour_config(config: Mapping[str, float]) -> None:
    on = [key for key in BEHAVIOUR_IS_KEYS.values() if config.get(key)]
    if len(on) > 1:
        raise ValueError(f"choose one sampler-trainer correction, got {on}")
    if on and not config[on[0]] > 1:
        raise ValueError(f"{on[0]} must be 0 (off) or > 1, got {config[on[0]]}")


def behaviour_correction_on(config: Mapping[str, float]) -> bool:
    """Whether a loss config asks for a sampler-trainer correction."""
    return any(config.get(key) for key in BEHAVIOUR_IS_KEYS.values())


def weighted_sum(loss_N: Tensor, weights_N: Tensor, normalizer: float) -> Tensor:
    """``sum(loss_N * weights_N) / normalizer``: one micro-batch's share of a token mean.

    Passing the whole batch's weight sum as ``normalizer`` to every micro-batch makes
    the micro-batch losses, and their gradients, add up to the full-batch token mean.
    """
    return (loss_N * weights_N).sum() / normalizer


def token_mean(loss_N: Tensor, weights_N: Tensor) -> Tensor:
    """The weighted mean of a per-token loss over the tokens with non-zero weight."""
    return weighted_sum(loss_N, weights_N, float(weights_N.sum()))


# ---------------------------------------------------------------- sampler-trainer mismatch


@dataclass(frozen=True)
class BehaviourWeights:
    """Per-token importance weights of one datum and what they did.

    ``ratio_N`` is ``pi_old / mu`` per token (sequence-level: the sequence's product,
    repeated); ``weight_N`` the factor the loss multiplies; ``limited_N`` marks tokens
    whose ratio was capped (TIS) or that were masked (weight 0).
    """

    ratio_N: Tensor
    weight_N: Tensor
    limited_N: Tensor


def behaviour_weights(old_logprobs_N: Tensor, sampler_logprobs_N: Tensor, trained_N: Tensor,
                      config: Mapping[str, float]) -> BehaviourWeights:
    """Importance weights ``pi_old / mu`` of one datum's trained tokens, truncated or masked.

    ``old_logprobs_N`` are the trainer's logprobs (``pi_old``, detached: with one update
    per batch they are the current policy's), ``sampler_logprobs_N`` the sampler's
    (``mu``); only ``trained_N`` tokens count. Exactly one config key is non-zero:
    ``behaviour_token_cap`` C: ``w_t = min(r_t, C)``; ``behaviour_sequence_cap`` C:
    ``w = min(prod_t r_t, C)`` for every token; ``behaviour_mask_threshold`` T:
    ``w_t = 1`` if ``1/T <= r_t <= T`` else 0 (TIS: Yao et al. 2025; masking: verl's
    rollout correction, slime's MIS). Untrained tokens get weight 0 and ratio 1.
    """
    log_ratio_N = (old_logprobs_N - sampler_logprobs_N).where(trained_N, 0.0)
    token_cap, sequence_cap = config.get("behaviour_token_cap", 0.0), config.get("behaviour_sequence_cap", 0.0)
    threshold = config.get("behaviour_mask_threshold", 0.0)
    if sum(1 for v in (token_cap, sequence_cap, threshold) if v) != 1:
        raise ValueError("behaviour_weights needs exactly one of behaviour_token_cap, behaviour_sequence_cap, "
                         "behaviour_mask_threshold")
    if sequence_cap:
        log_ratio_N = log_ratio_N.sum().expand_as(log_ratio_N)
    ratio_N = log_ratio_N.exp()
    if threshold:
        limited_N = (ratio_N > threshold) | (ratio_N < 1.0 / threshold)
        weight_N = (~limited_N).to(ratio_N.dtype)
    else:
        cap = token_cap or sequence_cap
        limited_N = ratio_N > cap
        weight_N = ratio_N.clamp(max=cap)
    return BehaviourWeights(ratio_N, weight_N * trained_N, limited_N & trained_N)


# ---------------------------------------------------------------- micro-batching


PACKINGS = ("bucketed", "packed", "shared-prefix", "prefix-tree")
"""``bucketed``: rows of similar length, right-padded to the longest in the micro-batch;
``packed``: every sequence of a micro-batch concatenated into one row (padding-free);
``shared-prefix``: packed, and the prompt prefix the sequences share is computed once
(planned like ``packed`` on the lengths after that prefix); ``prefix-tree``: packed as the
sequences' prefix tree (:func:`prefix_tree`), so every prefix two or more sequences share
is computed once — a group's question, and the opening its samples have in common —
planned on the tree's size."""


def plan_micro_batches(lengths_D: Sequence[int], token_budget: int, packing: str = "bucketed",
                       sequences_D: Sequence[Sequence[int]] | None = None) -> list[tuple[int, ...]]:
    """Split datums (given by length) into micro-batches of at most ``token_budget`` tokens.

    Datums are taken longest first. ``bucketed`` fills one micro-batch at a time, so
    each holds neighbouring lengths, and counts its padded size ``rows * longest``;
    ``packed`` and ``shared-prefix`` put each datum into the first micro-batch with room
    (first-fit decreasing) and count the sum of lengths. ``prefix-tree`` given the
    datums' token ``sequences_D`` takes them in the order of their tokens, so sequences
    that share a prefix sit next to each other, puts each into the first micro-batch with
    room and counts the micro-batch's prefix-tree nodes (without them, the sum of
    lengths: the tree is never larger). A datum longer than the budget
    gets a micro-batch of its own. Returns datum indices per micro-batch; every index
    appears exactly once.
    """
    if packing not in PACKINGS:
        raise ValueError(f"unknown packing {packing!r}; choose one of {PACKINGS}")
    if token_budget < 1:
        raise ValueError("token_budget must be >= 1")
    if packing == "prefix-tree" and sequences_D is not None:
        if [len(s) for s in sequences_D] != list(lengths_D):
            raise ValueError("packing 'prefix-tree' plans on the datums' token sequences, one per length")
        return _plan_tree(sequences_D, token_budget)
    order = sorted(range(len(lengths_D)), key=lambda i: (-lengths_D[i], i))
    plan: list[list[int]] = []
    for i in order:
        candidates = plan if packing != "bucketed" else plan[-1:]
        fits = [b for b in candidates if _cost([lengths_D[j] for j in b + [i]], packing) <= token_budget]
        if fits:
            fits[0].append(i)
        else:
            plan.append([i])
    return [tuple(batch) for batch in plan]


def _cost(lengths: list[int], packing: str) -> int:
    return sum(lengths) if packing != "bucketed" else len(lengths) * max(lengths)


def _plan_tree(sequences_D: Sequence[Sequence[int]], token_budget: int) -> list[tuple[int, ...]]:
    """First fit in token order, each micro-batch costed as its prefix tree's node count."""
    order = sorted(range(len(sequences_D)), key=lambda i: (tuple(sequences_D[i]), i))
    plan: list[tuple[list[int], _Trie]] = []
    for i in order:
        sequence = sequences_D[i]
        for batch, trie in plan:
            if trie.size + trie.new_nodes(sequence) <= token_budget:
                batch.append(i)
                trie.add(sequence)
                break
        else:
            trie = _Trie()
            trie.add(sequence)
            plan.append(([i], trie))
    return [tuple(batch) for batch, _ in plan]


class _Trie:
    """Node ids of token prefixes: ``children[(parent, token)]``, the root being -1."""

    def __init__(self) -> None:
        self.children: dict[tuple[int, int], int] = {}
        self.size = 0

    def new_nodes(self, sequence: Sequence[int]) -> int:
        """How many nodes adding ``sequence`` would create."""
        node = -1
        for depth, token in enumerate(sequence):
            node = self.children.get((node, token), -2)
            if node == -2:
                return len(sequence) - depth
        return 0

    def add(self, sequence: Sequence[int]) -> tuple[list[int], list[int]]:
        """Add ``sequence``; its node at each position, and the nodes it created."""
        node, path, created = -1, [], []
        for token in sequence:
            child = self.children.get((node, token))
            if child is None:
                child = self.children[(node, token)] = self.size
                self.size += 1
                created.append(child)
            path.append(child)
            node = child
        return path, created


@dataclass(frozen=True)
class PrefixTree:
    """Sequences merged into one tree of tokens: equal prefixes become one path.

    ``tokens_L``/``depths_L``/``parents_L`` describe the nodes in the order they were first
    met (a parent always before its children; the root's parent is -1); ``paths_D[d][p]``
    is the node of sequence ``d``'s token at position ``p``. A node's depth is its
    position in every sequence that passes through it, and what a causal model computes
    there depends only on its ancestors, so a packed row of the nodes in which each
    attends to its ancestors and itself gives every sequence's results at its own
    nodes (the local trainer's ``prefix-tree`` packing)."""

    tokens_L: tuple[int, ...]
    depths_L: tuple[int, ...]
    parents_L: tuple[int, ...]
    paths_D: tuple[tuple[int, ...], ...]


def prefix_tree(sequences_D: Sequence[Sequence[int]]) -> PrefixTree:
    """The prefix tree (trie) of token sequences (see :class:`PrefixTree`)."""
    trie = _Trie()
    tokens: list[int] = []
    depths: list[int] = []
    parents: list[int] = []
    paths = []
    for sequence in sequences_D:
        path, created = trie.add(sequence)
        for depth in range(len(path) - len(created), len(path)):  # its new nodes end its path
            tokens.append(sequence[depth])
            depths.append(depth)
            parents.append(path[depth - 1] if depth else -1)
        paths.append(tuple(path))
    return PrefixTree(tuple(tokens), tuple(depths), tuple(parents), tuple(paths))
