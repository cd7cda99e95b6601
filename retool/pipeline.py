"""Sampling ahead of training with bounded staleness (``retool train --max-staleness K``).

With ``K = 0`` (the default) there is no pipeline: every step samples with the weights
it then trains, as before. With ``K >= 1`` the rollout of step ``t + K`` starts at the
start of step ``t``, on the sampler of the weights step ``t`` begins with (version
``t``), and runs on a worker thread while steps ``t .. t + K - 1`` train. Step ``t``
therefore trains groups sampled with version ``max(first, t - K)`` (``first``: the step
the run or the resume started at, whose first ``K`` steps all sample with its weights):
a lag of at most ``K`` versions, by construction.

**Pacing, not discard-and-resample.** A group is never started before the weights it is
allowed to use exist, so no group can be too stale and nothing is discarded
(``staleness/discarded`` is not logged: it would always be 0). tinker-cookbook's
asynchronous RL loop (``AsyncConfig.max_steps_off_policy``) lets sampler workers run
freely on the newest sampling client and drops, then re-samples, a group whose client
is more than that many steps old by the time the trainer takes it: sampling that is
thrown away, and a batch whose make-up depends on which groups happened to finish in
time. verl's one-step-off pipeline and prime-rl's strict async level instead fix the lag:
the rollout of the next step runs on the weights of the step before. That is the choice
here, for what this project promises: which problems a step trains, the seed of every
group and the weights it was sampled with are functions of the step alone, never of
thread timing, so a run is reproducible and ``--resume`` exact; when training is the
slower stage (the usual case for long multi-turn rollouts on a service it is the other
way round, and then the sampler waits for nothing either) the newest weights available
when step ``t + K``'s rollout could start are version ``t`` anyway. What is given up:
when sampling is much faster than training a free-running producer could use fresher
weights than ``t``; here the sampler idles instead (``time/rollout_wait`` shows how long
the trainer waited for the sampler, the other side).

**What each engine needs**: a sampler that keeps its version's weights while the trainer
updates the live ones: the ``local`` engine's ``frozen_sampler`` (a copy of the model
sharing the frozen base weights, its own LoRA tensors), Tinker's and PyTRIO's
``save_weights_and_get_sampling_client`` (a snapshot by design: an older sampling client
keeps sampling its weights while the service trains). Engines without one refuse
``--max-staleness > 0`` in their capabilities.

**Resume**: the groups of future steps are kept in the run's group store as they finish
(``RUN_DIR/rollouts/``) and stay there until a checkpoint at or after their step is listed.
A checkpoint after step ``c`` is saved at once, while the rollouts of steps ``c + 1 .. c +
K`` may still run, and is listed in ``manifest.json`` (so ``--resume`` finds it) only once
every group of those steps, sampled with weights older than the checkpoint's, is stored:
:meth:`Pipeline.ended` of the last step submitted when it was saved. Until then a crash
resumes from the checkpoint before it, whose groups are all still stored. So the trainer
never waits for the rollouts ahead to checkpoint, and a resumed run always finds every
group sampled with weights it cannot recompute: it reuses them and samples the rest.

**Correction**: nothing new: the PPO ratio is always taken against the logprobs the
sampler recorded with each token (``Datum.sampler_logprobs_N``), so a stale group is
weighted against its own behaviour policy; ``--behaviour-is`` adds the truncated
correction. :func:`staleness_metrics` logs the lag.

Not covered: ``--stream-groups`` together with ``K >= 1``, in-flight weight updates
within a trajectory (AReaL / PipelineRL), and verl (``retool verl-config --max-staleness 1``
writes verl's own one-step-off trainer instead). The vLLM engine keeps an adapter loaded
while any sampler or request of its version is alive (``retool.engines.vllm.adapters``).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from retool.types import NOT_SAMPLED, Trajectory

T = TypeVar("T")


class StalenessError(RuntimeError):
    """A group was trained more than ``--max-staleness`` versions after it was sampled (a bug)."""


def policy_versions(trajectories: Iterable[Trajectory]) -> list[int]:
    """The weight version of every sampled token of ``trajectories`` (unrecorded ones left out)."""
    return [v for t in trajectories for v in (t.versions_T or ()) if v != NOT_SAMPLED]


def staleness_metrics(step: int, trajectories: Sequence[Trajectory], max_staleness: int) -> dict[str, float]:
    """``staleness/mean`` and ``/max`` (token-weighted lag ``step - version`` of every
    sampled token) and ``staleness/share_lag_J`` for ``J = 0 .. max_staleness``."""
    lags = [step - v for v in policy_versions(trajectories)]
    if not lags:
        return {}
    counts = Counter(lags)
    out = {"staleness/mean": sum(lags) / len(lags), "staleness/max": float(max(lags))}
    out.update({f"staleness/share_lag_{j}": counts.get(j, 0) / len(lags) for j in range(max_staleness + 1)})
    return out


def check_within(step: int, trajectories: Iterable[Trajectory], max_staleness: int) -> None:
    """Raise :class:`StalenessError` unless every sampled token's version is ``>= step - max_staleness``."""
    versions = policy_versions(trajectories)
    if versions and min(versions) < step - max_staleness:
        raise StalenessError(f"step {step}: a group sampled with weights {min(versions)} is more than "
                             f"--max-staleness {max_staleness} versions old")


class Pipeline(Generic[T]):
    """Rollouts of later steps run on worker threads while the caller trains;
    :meth:`advance` at the start of every step submits what is due and returns the
    step's result.

    ``job(step, version, previous)`` produces step ``step``'s result on the sampler of
    ``version``. With ``chained`` (state that a step's rollout changes — the difficulty
    pool — must pass to the next one), each job waits for the one before and gets its
    result as ``previous`` (``None`` for the first), so that state passes in step order
    whatever the trainer does meanwhile. Without it (the default: nothing passes), every
    submitted job starts at once and ``previous`` is always ``None``: up to ``K + 1``
    rollouts are in flight together, so while one step's rollout waits for its slowest
    trajectory (a sandbox call running to its timeout) the sampler keeps serving the
    next steps' trajectories. Which weights each step samples with is the same either way.
    """

    def __init__(self, max_staleness: int, last_step: int, *, chained: bool = False) -> None:
        if max_staleness < 1:
            raise ValueError(f"a pipeline needs max_staleness >= 1, got {max_staleness}")
        self.max_staleness, self.last_step, self.chained = max_staleness, last_step, chained
        self._results: dict[int, Future[T]] = {}
        self._submitted = 0
        """The last step whose job was submitted (0: none yet)."""
        self._last: Future[T] | None = None
        self._closed = threading.Event()

    def version_of(self, step: int, first: int) -> int:
        """The weight version step ``step`` samples with when the pipeline started at ``first``."""
        return max(first, step - self.max_staleness)

    def advance(self, step: int, job: Callable[[int, int, T | None], T]) -> T:
        """At the start of ``step`` (its weights are version ``step``): submit the rollouts
        due now — steps ``step .. step + K`` at the first call, then ``step + K`` — and
        wait for ``step``'s. Raises what its job raised."""
        ahead = range(step if not self._submitted else self._submitted + 1, min(step + self.max_staleness,
                                                                                self.last_step) + 1)
        for later in ahead:
            self._submit(later, step, job)
        return self._results.pop(step).result()

    def _submit(self, step: int, version: int, job: Callable[[int, int, T | None], T]) -> None:
        previous, result = (self._last if self.chained else None), Future()

        def work() -> None:
            before = previous.result() if previous is not None else None  # its failure: this one's too
            if self._closed.is_set():
                raise RuntimeError("the pipeline was closed")
            result.set_result(job(step, version, before))

        def run() -> None:
            try:
                work()
            except BaseException as err:  # handed to whoever waits for this step
                result.set_exception(err)

        self._results[step], self._last, self._submitted = result, result, step
        threading.Thread(target=run, name=f"rollout-step-{step}", daemon=True).start()

    @property
    def submitted(self) -> int:
        """The last step whose rollout was submitted (0: none yet)."""
        return self._submitted

    def ended(self, through: int) -> bool:
        """Whether the rollout of every step up to ``through`` has ended without an error
        (its groups are then all stored); those already taken by :meth:`advance` have."""
        return through <= self._submitted and all(
            future.done() and future.exception() is None for step, future in list(self._results.items())
            if step <= through)

    def drain(self) -> None:
        """Wait for every rollout in flight. A failed one is not raised here: the step that
        needs it raises it."""
        for future in list(self._results.values()):
            future.exception()

    def close(self) -> None:
        """Start no further rollout; those running end on their own (daemon threads)."""
        self._closed.set()


def frozen_sampler(engine: Any) -> Any:
    """A sampler that keeps the engine's current weights while the engine trains on: the
    engine's ``frozen_sampler()`` where its ``save_weights_for_sampler`` shares the live
    weights (``local``), else ``save_weights_for_sampler()`` (a service's snapshot)."""
    freeze = getattr(engine, "frozen_sampler", None)
    return freeze() if freeze is not None else engine.save_weights_for_sampler()
