"""Streaming within a step (``retool train --stream-groups``): each group's
``forward_backward`` is taken as soon as the group has ended, and the step's one
``optim_step`` once every group has, so the update overlaps the rollout's tail. No
staleness: every group is still sampled with the step's weights.

**The averaging.** The engine contract divides each ``forward_backward`` call by its own
trained tokens, so per-group calls of the synchronous loss would weigh a short group's
tokens more than a long group's. The synchronous step divides by the step's trained
tokens ``N``, which is known only once the last group has ended, too late for the calls
already taken. Streaming therefore divides by a number fixed before the step,
:func:`token_divisor` ``D`` = batch size x group size x the policy-token budget of one
trajectory (the most the step can train): each call's advantages are multiplied by its
own trained tokens over ``D`` (:func:`scaled`), so the calls add up to ``token sum / D``
(Dr. GRPO's constant normaliser; Tinker's own losses are token sums). Every token keeps
the weight it has in the synchronous step relative to every other token: the streamed
gradient is the synchronous one times ``N / D`` (logged as ``train/stream_scale``, at
most 1), the same direction with a smaller norm. Adam divides by the gradient's running
scale, so a constant factor would change nothing; ``N / D`` varies with the step's
lengths, so a step of long answers moves the weights a little more than one of short
answers, as with a token sum. ``train/grad_norm`` is the scaled gradient's and
``--grad-clip-norm`` clips the scaled gradient. This rests on the losses being
positively homogeneous in the advantages (PPO-clip, dual-clip and importance sampling
are: the clip decision depends on the advantage's sign only) and on 0/1 loss weights.

**Order.** Groups are trained in rollout order (round, then position): a group's call is
taken once it and every group before it have ended. The calls, their contents and the
order their gradients add up are then the same whichever group ends first, so a run is
reproducible and a step resumed after a crash (its finished groups reused from the group
store) gives the update the uninterrupted step gave.

**Metrics** (:func:`merged_metrics`): the per-call figures are combined into what one
synchronous call reports: ``train/loss`` the token mean of the unscaled loss, counts
summed, per-token rates token-weighted, maxima the maximum.

Not covered: training on groups sampled with older weights (off-policy pipelining), and
splitting one group across calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

from retool.engines import AdamParams, TrainingClient
from retool.engines.base import ForwardBackwardOutput
from retool.types import Datum, Trajectory

SUMMED = ("train/tokens", "train/sequences", "train/micro_batches")
"""Per-call counts: the step's is their sum."""
MAXED = ("train/behaviour_ratio_max",)
"""Per-call maxima: the step's is their maximum."""


def token_divisor(batch_size: int, group_size: int, policy_budget: int) -> int:
    """``D``: the trained tokens a step can hold at most, fixed before the step."""
    return batch_size * group_size * policy_budget


def trained_weight(datums: Sequence[Datum]) -> float:
    """What one ``forward_backward`` call divides by: its datums' summed loss weights."""
    return float(sum(sum(d.weights_N) for d in datums))


def scaled(datums: Sequence[Datum], divisor: float) -> tuple[float, list[Datum]]:
    """``datums`` as one call's share of ``token sum / divisor``: every advantage times
    ``share`` = the call's trained weight over ``divisor``; returns ``(share, datums)``."""
    if any(w not in (0.0, 1.0) for d in datums for w in d.weights_N):
        raise ValueError("streaming needs loss weights of 0 or 1")
    share = trained_weight(datums) / divisor
    return share, [dataclasses.replace(d, advantages_N=tuple(a * share for a in d.advantages_N)) for d in datums]


def merged_metrics(calls: Sequence[tuple[float, Mapping[str, float]]]) -> dict[str, float]:
    """The metrics one synchronous call on every call's datums reports, from each call's
    ``(share, metrics)``; ``train/loss`` is unscaled (the token mean of the loss)."""
    tokens_C = [m["train/tokens"] for _, m in calls]
    total = sum(tokens_C)
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for _, m in calls for k in m):
        having = [(share, m, n) for (share, m), n in zip(calls, tokens_C) if key in m]
        if key in SUMMED:
            out[key] = sum(m[key] for _, m, _ in having)
        elif key in MAXED:
            out[key] = max(m[key] for _, m, _ in having)
        elif key == "train/loss":
            out[key] = sum(m[key] / share * n for share, m, n in having) / total
        else:
            out[key] = sum(m[key] * n for _, m, n in having) / sum(n for _, _, n in having)
    return out


Group = list[Trajectory]

GroupKey = tuple[int, int]
"""``(round, position)`` of a group in its step's rollout."""


class StreamedUpdate:
    """One step's update, taken group by group: :meth:`add` each group as it ends (any
    order), then :meth:`finish`. Use as a context manager (its worker thread ends on exit).

    ``datums_of`` turns a group into its datums (none: the group is not trained). The
    ``forward_backward`` calls run on one worker thread in rollout order, so the rollout's
    event loop keeps sampling while the local engine computes; a group added again (a
    retried rollout round hands its finished groups back) is ignored.
    """

    def __init__(self, engine: TrainingClient, loss: str, loss_config: Mapping[str, float], divisor: float,
                 datums_of: Callable[[Group], list[Datum]]) -> None:
        self.engine, self.loss, self.loss_config = engine, loss, dict(loss_config)
        self.divisor, self.datums_of = divisor, datums_of
        self.datums: list[Datum] = []
        """Every datum trained so far, unscaled, in the order they were sent."""
        self._ready: dict[GroupKey, Group] = {}
        self._next: GroupKey = (0, 0)
        self._calls: list[tuple[float, Future[Future[ForwardBackwardOutput]]]] = []
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stream-groups")

    def __enter__(self) -> StreamedUpdate:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)

    def add(self, round_: int, index: int, group: Group) -> None:
        """Group ``index`` of rollout round ``round_`` has ended: send every group now due."""
        key = (round_, index)
        if round_ > self._next[0]:  # rounds run one after another: the earlier one is complete
            self._next = (round_, 0)
        if key < self._next or key in self._ready:
            return
        self._ready[key] = group
        while self._next in self._ready:
            self._send(self._ready.pop(self._next))
            self._next = (self._next[0], self._next[1] + 1)

    def _send(self, group: Group) -> None:
        datums = self.datums_of(group)
        if not datums:
            return
        share, sent = scaled(datums, self.divisor)
        self.datums += datums
        self._calls.append((share, self._worker.submit(self.engine.submit_forward_backward, sent, self.loss,
                                                       self.loss_config)))

    def finish(self, adam: AdamParams) -> dict[str, float]:
        """Wait for every ``forward_backward``, apply one ``optim_step`` (none when nothing
        was trained) and return the step's update metrics, with ``train/stream_scale``
        (``N / D``) and ``train/stream_calls``. Raises what a call raised, the update not
        applied; groups still waiting for an earlier one are a bug (``RuntimeError``)."""
        if self._ready:
            raise RuntimeError(f"groups {sorted(self._ready)} ended but an earlier group never did")
        submitted = [(share, future.result()) for share, future in self._calls]
        if not submitted:
            return {}
        for _, future in submitted:  # a call that already failed (a local engine's): no optim_step at all
            if future.done() and future.exception() is not None:
                future.result()
        opt_future = self.engine.submit_optim_step(adam)  # taken before the calls are done, as services allow
        calls = [(share, future.result().metrics) for share, future in submitted]
        opt = opt_future.result()
        return {**merged_metrics(calls), **opt.metrics, "train/stream_calls": float(len(calls)),
                "train/stream_scale": trained_weight(self.datums) / self.divisor}
