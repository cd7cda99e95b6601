"""Outcome reward: the boxed final answer, graded by ``math_verify``.

This module is the reward's policy, top to bottom:
    1. Answer extraction (:func:`extract_boxed`): in the last 300 characters of the
       final assistant turn, take the *last* ``\\boxed{``; its content up to the
       matching ``}`` is the answer. Braces are counted TeX-style (``\\{`` and ``\\}``
       are escaped characters, not groups). If that last box does not close inside the
       window there is no answer, even when an earlier box did close: the model's final
       word is what counts. An empty box is no answer either. Only the braced form
       ``\\boxed{...}`` is read: ``math_verify``'s own boxed extraction recognises only
       that form too, and the system prompt asks for exactly ``\\boxed{<answer>}`` —
       ``\\boxed 5``, ``\\boxed {5}`` and ``\\fbox{5}`` are not answers.
    2. Grading (:func:`grade`, :func:`grade_many`, :func:`agrade`, :func:`agrade_many`):
       ``verify(parse(f"${gold}$"), parse(f"${answer}$"))`` with ``math_verify``'s
       defaults (lenient: ``10\\%`` equals 10, ``x=4`` equals 4, units in ``\\text{}``
       are dropped). Correct → reward +1, otherwise −1; no answer → −1 with
       ``formatted=False``. The verdict is exactly ``math_verify``'s, including where it
       departs from mathematical truth (``tests/test_reward.py`` lists those cases);
       this module does not second-guess it.
    3. Errors: a timeout, a crashed grader process, or an exception that
       ``math_verify`` swallowed while grading the prediction makes the answer
       incorrect but formatted, with ``Grade.grader_error`` set (the trainer counts
       these as ``reward/grader_errors``). A gold answer ``math_verify`` cannot parse is
       a data bug: it raises :class:`GoldAnswerError`. :func:`check_gold` /
       :func:`check_golds` confirm before training that each gold answer, boxed, grades
       as correct against itself.

Not here: *how* ``math_verify`` runs is :mod:`retool.grader_pool` — killable worker
processes with a wall-clock bound per verification, because ``math_verify``'s own
signal-based timeouts fail off the main thread — and the ``retool grade`` command is
:mod:`retool.grade_command`. The entry points use the process-wide
:func:`~retool.grader_pool.default_pool` unless given a ``pool``.

Non-goals: partial credit, format or length shaping, LLM judges, answers outside a
box (``math_verify``'s last-number fallback is deliberately not used).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from retool.grader_pool import DEFAULT_TIMEOUT_S, GraderPool, Verdict, default_pool
from retool.types import Grade

ANSWER_WINDOW_CHARS = 300
"""Only this many trailing characters of the final assistant turn are searched."""

_BOX_OPEN = "\\boxed{"


class GoldAnswerError(ValueError):
    """A reference answer that cannot serve as gold: a data bug, not a model error."""

    def __init__(self, gold: object, reason: str):
        super().__init__(f"gold answer {gold!r}: {reason}")
        self.gold = gold
        self.reason = reason


# ---------------------------------------------------------------- extraction


def extract_boxed(text: str, window: int = ANSWER_WINDOW_CHARS) -> str | None:
    """Return the content of the last ``\\boxed{...}`` in the last ``window`` characters.

    ``None`` when the window holds no ``\\boxed{``, when the last one does not close
    within the window, or when its content is blank. The content is returned stripped
    of surrounding whitespace; nested braces are kept (``\\boxed{\\frac{1}{2}}`` →
    ``\\frac{1}{2}``).
    """
    tail = text[-window:] if window > 0 else text
    start = tail.rfind(_BOX_OPEN)
    if start < 0:
        return None
    content = _braced_group(tail, start + len(_BOX_OPEN))
    if content is None or not content.strip():
        return None
    return content.strip()


def _braced_group(text: str, begin: int) -> str | None:
    """The text from ``begin`` up to the ``}`` closing an already-open ``{``, or None."""
    depth = 1
    i = begin
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # an escaped character (\{, \}, \\) never opens or closes a group
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
        i += 1
    return None


def boxed(answer: str) -> str:
    """``\\boxed{answer}`` — the response a perfect model would give."""
    return f"{_BOX_OPEN}{answer}}}"


# ---------------------------------------------------------------- grading


def grade(
    response: str, gold: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, pool: GraderPool | None = None
) -> Grade:
    """Grade one final assistant turn against its gold answer.

    +1 when the last ``\\boxed{}`` of the last 300 characters is ``math_verify``-equal
    to ``gold``; −1 otherwise. Raises :class:`GoldAnswerError` for an unparsable gold.
    At most ``timeout_s`` seconds are spent verifying (plus waiting for a free worker).
    """
    outcome = try_grade_many([response], [gold], timeout_s=timeout_s, pool=pool)[0]
    if isinstance(outcome, GoldAnswerError):
        raise outcome
    return outcome


def grade_many(
    responses: Sequence[str], golds: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S,
    pool: GraderPool | None = None,
) -> list[Grade]:
    """Grade ``responses[i]`` against ``golds[i]`` in parallel; results in input order.

    Raises :class:`GoldAnswerError` (naming the index) if any gold is unparsable.
    """
    outcomes = try_grade_many(responses, golds, timeout_s=timeout_s, pool=pool)
    for i, outcome in enumerate(outcomes):
        if isinstance(outcome, GoldAnswerError):
            raise GoldAnswerError(outcome.gold, f"golds[{i}]: {outcome.reason}")
    return outcomes  # type: ignore[return-value]


def try_grade_many(
    responses: Sequence[str], golds: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S,
    pool: GraderPool | None = None,
) -> list[Grade | GoldAnswerError]:
    """Like :func:`grade_many`, but a bad gold is returned in its slot, not raised.

    A response without an answer is graded without consulting its gold.
    """
    if len(responses) != len(golds):
        raise ValueError(f"{len(responses)} responses but {len(golds)} golds")
    for value in (*responses, *golds):
        if not isinstance(value, str):
            raise TypeError(f"responses and golds must be str, got {type(value).__name__}")
    answers = [extract_boxed(response) for response in responses]
    answered = [i for i, answer in enumerate(answers) if answer is not None]
    verdicts = (default_pool() if pool is None else pool).verify_many(
        [answers[i] for i in answered], [golds[i] for i in answered], timeout_s=timeout_s
    )
    outcomes: list[Grade | GoldAnswerError] = [
        Grade(reward=-1.0, correct=False, formatted=False, answer=None) for _ in responses
    ]
    for i, verdict in zip(answered, verdicts):
        outcomes[i] = _to_grade(answers[i], golds[i], verdict)  # type: ignore[arg-type]
    return outcomes


def _to_grade(answer: str, gold: str, verdict: Verdict) -> Grade | GoldAnswerError:
    if verdict.gold_error is not None:
        return GoldAnswerError(gold, verdict.gold_error)
    reward = 1.0 if verdict.correct else -1.0
    return Grade(reward, verdict.correct, True, answer, grader_error=verdict.grader_error)


async def agrade(response: str, gold: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Grade:
    """:func:`grade` for asyncio code: runs in a thread, never blocks the event loop."""
    return await asyncio.to_thread(grade, response, gold, timeout_s=timeout_s)


async def agrade_many(
    responses: Sequence[str], golds: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[Grade]:
    """:func:`grade_many` for asyncio code."""
    return await asyncio.to_thread(grade_many, responses, golds, timeout_s=timeout_s)


# ---------------------------------------------------------------- gold answers


def check_golds(
    golds: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[GoldAnswerError | None]:
    """Check many gold answers in parallel: ``None`` for each good one, else its error.

    A gold is good when it is a non-empty string that ``math_verify`` parses and that,
    boxed, grades as correct against itself within ``timeout_s``.
    """
    problems: list[GoldAnswerError | None] = [_gold_shape_error(g) for g in golds]
    todo = [i for i, problem in enumerate(problems) if problem is None]
    responses = [boxed(golds[i]) for i in todo]
    outcomes = try_grade_many(responses, [golds[i] for i in todo], timeout_s=timeout_s)
    for i, outcome in zip(todo, outcomes):
        problems[i] = _self_check_error(golds[i], outcome)
    return problems


def check_gold(gold: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Raise :class:`GoldAnswerError` unless ``gold`` grades correct against itself."""
    problem = check_golds([gold], timeout_s=timeout_s)[0]
    if problem is not None:
        raise problem


def _gold_shape_error(gold: object) -> GoldAnswerError | None:
    if not isinstance(gold, str):
        return GoldAnswerError(gold, f"must be a string, got {type(gold).__name__}")
    if not gold.strip():
        return GoldAnswerError(gold, "is empty")
    if len(boxed(gold)) > ANSWER_WINDOW_CHARS:
        return GoldAnswerError(gold, f"is longer than the {ANSWER_WINDOW_CHARS}-character answer window")
    return None


def _self_check_error(gold: str, outcome: Grade | GoldAnswerError) -> GoldAnswerError | None:
    if isinstance(outcome, GoldAnswerError) or outcome.correct:
        return outcome if isinstance(outcome, GoldAnswerError) else None
    if not outcome.formatted:
        return GoldAnswerError(gold, "its braces do not balance, so \\boxed{gold} has no answer")
    detail = f" ({outcome.grader_error})" if outcome.grader_error else ""
    return GoldAnswerError(gold, f"does not grade as correct against itself{detail}")
