"""The weight-sync guard: after each sampler swap, is the sampler on the trainer's weights?

The stale-adapter bug — the sampler silently keeps old weights after an update while
every metric looks fine — hit verl and ms-swift in 2026. This guard catches it. After
the step's sampler swap (``save_weights_for_sampler``) it scores one fixed probe
sequence teacher-forced on both sides and checks two things:

1. the sampler's logprobs of the probe's answer tokens equal the trainer's within the
   engine's tolerance (``Capabilities.weight_sync_tolerance``);
2. against the previous check: if the trainer's logprobs changed (an update was
   applied), the sampler's changed too; if they did not (a step that applied no update —
   every group dropped, no ``optim_step``), the sampler's are identical.

Check 2 catches a stale sampler even when one update moves the logprobs by less than
the tolerance. A failure raises :class:`WeightSyncError`, one line naming the engine,
the step, the max |Δlogprob| seen and the tolerance; ``retool train`` stops with it.

The probe (:func:`build_probe`) comes from the run's own chat template and tokenizer: a
rendered user turn and a fixed short answer. Each side scores it
with its own ``compute_logprobs(tokens, start)`` — the logprob of every token from
``start`` on, given the tokens before it, at temperature 1:

- ``local``: the trainer runs the model's forward pass; the sampler runs its own decode
  path with the answer tokens forced — the lean steps' merged LoRA weights, the very
  copy that goes stale if a merge is skipped;
- ``vllm``: the trainer as ``local``; the sampler asks the server for the prompt
  logprobs under the adapter name it samples with;
- ``tinker`` / ``pytrio``: the SDK's ``SamplingClient.compute_logprobs`` and the
  training client's ``forward`` (cross-entropy targets; no gradient) — both services
  give a trainer-side forward, so both sides are compared as on the local engines.

The last check's logprobs go into each checkpoint (``trainer_state.json``), so a resumed
run compares against the same previous check as an unbroken one.

On a service (``tinker``, ``pytrio``: ``Capabilities.weight_sync_repeatable`` false) rule 2
keeps only its first half: a sampler whose logprobs are bit-identical to the previous
check's while the trainer's moved kept the old weights. The second half would stop a paid
run on numerical noise between two sampling clients of the same weights, which the
services do not document as absent.

Not covered: what the probe does not exercise (a stale *part* of the weights the probe's
tokens barely touch shows up only as a small change); a service whose trainer-side
``forward`` is not deterministic would make rule 2 see an update that did not happen (a
noisy re-scoring of stale weights passes rule 2 there; rule 1 still bounds it).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from retool.engines import engine_spec, openmp

PROBE_QUESTION = "What is 6 times 7?"
PROBE_ANSWER = "The answer is \\boxed{42}."
"""The probe's fixed conversation: the question is a user turn in the run's chat
template, the answer is the scored continuation."""

BF16_SAMPLER_TOLERANCE = 1.0
"""The tolerance of a local sampler that decodes in bfloat16 (``--local-precision bf16``)
against a float32 trainer. bf16 rounding alone moves the probe's logprobs by up to 0.10 on
SmolLM2's base weights and 0.30 on the demo's SFT adapter (mean 0.10 over its 10 answer
tokens), while a sampler on the wrong weights (the base model against that adapter) is
off by 5.2 (mean 2.0): 1.0 keeps a margin of 3x on the one and 5x on the other. A stale
sampler — one step behind — is caught by rule 2 (its logprobs did not move while the
trainer's did), at any tolerance."""

HALF_PRECISION_TOLERANCE = BF16_SAMPLER_TOLERANCE
"""The tolerance of an engine that trains and samples in bfloat16 (``local``/``vllm``
on a GPU): the fp32 figures of the capabilities assume float32 weights. The same as a
bf16 sampler's, for the same reason: the sampler merges the adapter into bf16 matrices
while the trainer adds it beside them, and on an H200 (the demo's SFT adapter, bf16
weights) the two differed by 0.124 at step 1, where 0.1 stopped the run."""


class WeightSyncError(RuntimeError):
    """The sampler is not on the trainer's current weights; the message is one line."""


class ProbeSampler(Protocol):
    async def compute_logprobs(self, tokens: Sequence[int], start: int) -> tuple[float, ...]: ...


class ProbeTrainer(Protocol):
    def compute_logprobs(self, tokens: Sequence[int], start: int) -> tuple[float, ...]: ...


@dataclass(frozen=True)
class Probe:
    """A fixed token sequence; ``tokens[start:]`` (the answer) are scored."""

    tokens: tuple[int, ...]
    start: int

    def __post_init__(self) -> None:
        if not 0 < self.start < len(self.tokens):
            raise ValueError(f"a probe needs a prompt and an answer, got start {self.start} of {len(self.tokens)}")


def build_probe(renderer: Any) -> Probe:
    """The probe of a run: :data:`PROBE_QUESTION` as a user turn in the renderer's chat
    template (no system prompt, no tool declaration: a short prompt keeps the check cheap,
    and every token of it already passes through the weights under test), then
    :data:`PROBE_ANSWER`'s tokens."""
    text = renderer.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROBE_QUESTION}], chat_template=renderer.chat_template, tokenize=False,
        add_generation_prompt=True, enable_thinking=renderer.enable_thinking)
    prompt = renderer.encode(text)
    return Probe(tuple(prompt) + tuple(renderer.encode(PROBE_ANSWER)), len(prompt))


@dataclass(frozen=True)
class ProbeScores:
    """One check's logprobs of the probe's answer tokens, on each side."""

    step: int
    sampler: tuple[float, ...]
    trainer: tuple[float, ...]


def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """max |a - b| over the pairs; ``nan`` when any pair is not finite."""
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return math.nan if not all(math.isfinite(d) for d in diffs) else max(diffs, default=0.0)


@dataclass
class WeightSyncGuard:
    """Runs the check every ``every`` steps (0 = never) for engine ``engine``.

    Metrics of a check: ``weight_sync/max_abs_diff`` (sampler vs trainer),
    ``weight_sync/changed`` (1 when the weights changed since the previous check; 0 at
    the first) and ``time/weight_sync`` (seconds, both sides)."""

    engine: str
    probe: Probe
    tolerance: float
    every: int = 1
    repeatable: bool = True
    """Both sides give the same floats for the same weights (``Capabilities.weight_sync_repeatable``):
    only then does a sampler that moved after a step without an update stop the run."""
    previous: ProbeScores | None = None

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def check(self, step: int, trainer: ProbeTrainer, sampler: ProbeSampler) -> dict[str, float]:
        """The check after step ``step``'s swap: its metrics, or :class:`WeightSyncError`."""
        if not self.due(step):
            return {}
        t0 = time.monotonic()
        try:
            sampler_lp, trainer_lp = asyncio.run(self._score(trainer, sampler))
        except WeightSyncError:
            raise
        except (RuntimeError, OSError, ValueError) as err:  # a server or service that failed to answer
            raise WeightSyncError(f"weight-sync check on engine {self.engine} at step {step}: the probe could "
                                  f"not be scored: {' '.join(str(err).split())}") from err
        scores = ProbeScores(step, sampler_lp, trainer_lp)
        diff = max_abs_diff(scores.sampler, scores.trainer)
        if not math.isfinite(diff) or diff > self.tolerance:
            raise WeightSyncError(f"{self._where(step)}: the sampler's logprobs of the probe differ from the "
                                  f"trainer's by max |Δlogprob| {diff:.3g} > tolerance {self.tolerance:g}: the "
                                  "sampler is not on the trainer's current weights")
        changed = self._changed(step, scores, diff)
        self.previous = scores
        return {"weight_sync/max_abs_diff": diff, "weight_sync/changed": float(changed),
                "time/weight_sync": time.monotonic() - t0}

    def _changed(self, step: int, scores: ProbeScores, diff: float) -> bool:
        """Whether the weights changed since the previous check, as the trainer says; the
        sampler must agree exactly."""
        before = self.previous
        if before is None:
            return False
        trainer_moved = max_abs_diff(scores.trainer, before.trainer)
        sampler_moved = max_abs_diff(scores.sampler, before.sampler)
        if trainer_moved > 0 and sampler_moved == 0:
            raise WeightSyncError(f"{self._where(step)}: the trainer's weights changed since step {before.step} "
                                  f"(its logprobs moved by up to {trainer_moved:.3g}) but the sampler's logprobs "
                                  f"are identical to step {before.step}'s: the sampler kept the old weights "
                                  f"(max |Δlogprob| sampler vs trainer {diff:.3g}, tolerance {self.tolerance:g})")
        if trainer_moved == 0 and sampler_moved > 0 and self.repeatable:
            raise WeightSyncError(f"{self._where(step)}: no update was applied since step {before.step}, but the "
                                  f"sampler's logprobs moved by up to {sampler_moved:.3g} (max |Δlogprob| sampler "
                                  f"vs trainer {diff:.3g}, tolerance {self.tolerance:g})")
        return trainer_moved > 0

    def state(self) -> dict[str, Any] | None:
        """The last check, for a checkpoint (so a resumed run compares as an unbroken one)."""
        before = self.previous
        return None if before is None else {"step": before.step, "sampler": list(before.sampler),
                                            "trainer": list(before.trainer)}

    def restore(self, state: dict[str, Any]) -> None:
        """Take back the last check that :meth:`state` wrote."""
        self.previous = ProbeScores(int(state["step"]), tuple(state["sampler"]), tuple(state["trainer"]))

    def _where(self, step: int) -> str:
        return f"weight-sync check failed on engine {self.engine} at step {step}"

    async def _score(self, trainer: ProbeTrainer, sampler: ProbeSampler) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Both sides' logprobs of the probe, one after the other; the trainer's in a worker
        thread, as a sampler's are, with one OpenMP team at a time (``retool.engines.openmp``:
        torch's parallel regions on a thread beside another thread's team ran several times
        slower, bench/weight_sync.py, bench/openmp_teams.py)."""
        tokens, start = self.probe.tokens, self.probe.start
        sampler_lp = self._checked(tuple(await sampler.compute_logprobs(tokens, start)), "sampler")
        trainer_lp = await openmp.on_worker_thread(trainer.compute_logprobs, tokens, start)
        return sampler_lp, self._checked(tuple(trainer_lp), "trainer")

    def _checked(self, scores: tuple[float, ...], side: str) -> tuple[float, ...]:
        want = len(self.probe.tokens) - self.probe.start
        if len(scores) != want:
            raise WeightSyncError(f"weight-sync check on engine {self.engine}: the {side} returned {len(scores)} "
                                  f"logprobs for the probe's {want} answer tokens")
        return scores


def guard_for(engine: str, every: int, renderer: Any, tolerance: float | None, *, half_precision: bool = False,
              bf16_sampler: bool = False) -> WeightSyncGuard | None:
    """The guard of a run (``None`` with ``every`` 0): ``tolerance`` ``None`` takes the
    engine's (:class:`~retool.engines.base.Capabilities`), or
    :data:`HALF_PRECISION_TOLERANCE` when the weights are half precision, or
    :data:`BF16_SAMPLER_TOLERANCE` when only the sampler is (``bf16_sampler``)."""
    if every == 0:
        return None
    capabilities = engine_spec(engine).capabilities
    if tolerance is None:
        engine_tolerance = capabilities.weight_sync_tolerance
        if engine_tolerance is None:
            raise ValueError(f"engine {engine} has no weight-sync check")
        floor = BF16_SAMPLER_TOLERANCE if bf16_sampler else HALF_PRECISION_TOLERANCE if half_precision else 0.0
        tolerance = max(engine_tolerance, floor)
    return WeightSyncGuard(engine, build_probe(renderer), tolerance, every, capabilities.weight_sync_repeatable)
