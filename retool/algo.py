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
  either length-bucketed (padded rows of similar length) or packed (padding-free).

Deliberately left out: a KL penalty against a reference model (the seed and ReTool's
reproduction train without one), entropy bonuses, sequence-level aggregation, value
functions. torch is not imported here (the losses only call tensor methods), so the
command line stays fast to start.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from retool.types import Datum, Trajectory

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


def is_degenerate(rewards_G: Sequence[float]) -> bool:
    """True when every reward of the group is equal, so all advantages are zero."""
    return max(rewards_G) - min(rewards_G) == 0.0


def count_degenerate_groups(rewards_BG: Sequence[Sequence[float]]) -> int:
    """How many of the groups are degenerate (for ``rollout/degenerate_group_rate``)."""
    return sum(1 for rewards_G in rewards_BG if is_degenerate(rewards_G))


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


# ---------------------------------------------------------------- losses


@dataclass(frozen=True)
class LossInputs:
    """What a loss needs besides the trainer's logprobs, one entry per target token.

    ``sampler_logprobs_N`` and ``advantages_N`` are ``None`` for ``cross_entropy``.
    """

    sampler_logprobs_N: Tensor | None = None
    advantages_N: Tensor | None = None


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
    ratio_N = (logprobs_N - inputs.sampler_logprobs_N).exp()
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
    return LossTerms(loss_N, clipped_N)


def importance_sampling_loss(logprobs_N: Tensor, inputs: LossInputs,
                             config: Mapping[str, float]) -> LossTerms:
    """REINFORCE corrected for the sampler: ``loss = -A * exp(logprob - sampler_logprob)``.

    No clipping; on-policy the ratio is ~1 and this is plain policy gradient.
    """
    ratio_N = (logprobs_N - inputs.sampler_logprobs_N).exp()
    return LossTerms(-inputs.advantages_N * ratio_N)


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

LOSS_DEFAULTS: dict[str, dict[str, float]] = {
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28, "dual_clip": 0.0},
    "importance_sampling": {},
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
    return config


def weighted_sum(loss_N: Tensor, weights_N: Tensor, normalizer: float) -> Tensor:
    """``sum(loss_N * weights_N) / normalizer``: one micro-batch's share of a token mean.

    Passing the whole batch's weight sum as ``normalizer`` to every micro-batch makes
    the micro-batch losses, and their gradients, add up to the full-batch token mean.
    """
    return (loss_N * weights_N).sum() / normalizer


def token_mean(loss_N: Tensor, weights_N: Tensor) -> Tensor:
    """The weighted mean of a per-token loss over the tokens with non-zero weight."""
    return weighted_sum(loss_N, weights_N, float(weights_N.sum()))


# ---------------------------------------------------------------- micro-batching


PACKINGS = ("bucketed", "packed", "shared-prefix")
"""``bucketed``: rows of similar length, right-padded to the longest in the micro-batch;
``packed``: every sequence of a micro-batch concatenated into one row (padding-free);
``shared-prefix``: packed, and the prompt prefix the sequences share is computed once
(planned like ``packed`` on the lengths after that prefix)."""


def plan_micro_batches(lengths_D: Sequence[int], token_budget: int,
                       packing: str = "bucketed") -> list[tuple[int, ...]]:
    """Split datums (given by length) into micro-batches of at most ``token_budget`` tokens.

    Datums are taken longest first. ``bucketed`` fills one micro-batch at a time, so
    each holds neighbouring lengths, and counts its padded size ``rows * longest``;
    ``packed`` and ``shared-prefix`` put each datum into the first micro-batch with room
    (first-fit decreasing) and count the sum of lengths. A datum longer than the budget gets a
    micro-batch of its own. Returns datum indices per micro-batch; every index appears
    exactly once.
    """
    if packing not in PACKINGS:
        raise ValueError(f"unknown packing {packing!r}; choose one of {PACKINGS}")
    if token_budget < 1:
        raise ValueError("token_budget must be >= 1")
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
