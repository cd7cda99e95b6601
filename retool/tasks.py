"""A synthetic, tool-worthy arithmetic task: the CPU demo's problems and cold-start data.

Small models cannot multiply five-digit numbers, reduce ``7^613 mod 9973`` or count
the divisors of 83,160 in their heads, but a short Python snippet can (every snippet
starts with the same ``import math`` line, :data:`PRELUDE`). This module
draws such problems (integer answers, several operations and paraphrases) and writes:

- :func:`make_problems` — :class:`~retool.types.Problem` records for RL training
  (split ``rl``) and held-out evaluation (split ``test``);
- :func:`make_sft_conversations` — OpenAI-format tool dialogues for cold-start SFT
  (split ``sft``): system prompt, question, a short plan with one ``code_interpreter``
  call, the call's real output from :class:`retool.sandbox.Sandbox`, and a final answer
  ending in ``\\boxed{N}``. With ``interpreter="stateful"`` the dialogue has two calls
  in one interpreter session: the first defines the question's numbers (and an
  intermediate result) as variables, the second computes the answer from those
  variables without redefining them — what a model needs to see to rely on state.
  With ``recovery_share`` (stateless only), that share of the dialogues first makes a
  mistaken call (:func:`mistakes`: an unclosed or extra parenthesis, ``math.`` left out,
  digits summed as strings), gets the sandbox's real traceback, and then makes the right
  call: the mistaken message carries ``"weight": 0`` (:mod:`retool.dialogues`), so the
  model is trained on reading an error and correcting it, never on making it.

The three splits are disjoint by construction: every problem's split is a hash of its
operation and operands (never of its wording), so a test problem never reappears,
reworded, in SFT or RL data, whatever the seeds. Draws are deterministic in
``(n, seed, split, kinds)``.

Difficulty (see ``docs/sft.md`` for the measured calibration): the operands are far
beyond mental arithmetic, so without the tool a small model scores near zero; with the
tool the work is to set the snippet up from the question — trivial for a bare product,
error-prone for the word problems, whose numbers must go to the right places. A
difficulty level per kind (:func:`make_problems`' ``difficulty``, ``retool task-data
--difficulty``; :data:`MAX_LEVEL`) gives the operands more digits to copy, so an RL split
can hold problems a cold start fails more often; level 0, the default, is the calibrated task.

Non-goals: problems with non-integer answers, solutions of more than two calls, natural-language
variety beyond a few paraphrases per operation.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from retool.atomic import atomic_write_jsonl
from retool.flag_checks import UnwritableOutputError, output_file
from retool.protocol import INTERPRETERS, TOOL_NAME, check_interpreter, system_prompt
from retool.sandbox import Sandbox, SandboxConfig
from retool.types import Problem

SPLITS = ("sft", "rl", "test")
"""``sft``: cold-start dialogues; ``rl``: RL training problems; ``test``: held out."""

DATA_SOURCE = "synthetic-arithmetic"


@dataclass(frozen=True)
class Draw:
    """One drawn problem with the snippet that solves it.

    ``key`` identifies the mathematics (operation and operands) and decides the split;
    ``plan`` is the assistant's short text before the call and ``conclusion`` the final
    answer's sentence (without the box).
    """

    kind: str
    key: tuple[int, ...]
    question: str
    code: str
    answer: int
    plan: str
    conclusion: str


# ---------------------------------------------------------------- operations

def _plan(what: str) -> str:
    """The assistant's text before the call: what to compute, stated before the code that computes it.

    Stating the expression first gives a small model a copy path question → plan → code
    (measured in ``docs/sft.md``: with generic plans it wrote prose into the ``code`` argument).
    """
    return f"I need {what}{_PLAN_TAIL}"


_PLAN_TAIL = ". That is error-prone by hand, so I will compute it with Python."
"""What every stateless plan says after the expression (:func:`_retry` repeats the part before it)."""


PRELUDE = "import math\n"
"""The first line of every stateless snippet and of every stateful dialogue's first call.

With the import only where a kind needs it (gcd, lcm) and a ``n = …`` line only in the
divisor snippets, RL on seed 11 of the demo taught the model to start every snippet with
``print(`` — the first token of most kinds — and those kinds then failed with ``NameError``
(docs/demo-history.md). One shared first line, and operands written inline, leave no kind with a
setup line of its own to drop.
"""


def _snippet(line: str) -> str:
    """A stateless call's code: the shared prelude, then one line that prints the answer."""
    return PRELUDE + line


def _up(limit: int, level: int) -> int:
    """An operand's upper bound at difficulty ``level``: ``level`` more digits (level 0: today's bound)."""
    return limit * 10**level


def _product(rng: random.Random, level: int = 0) -> Draw:
    a, b = rng.randint(100, _up(99_999, level)), rng.randint(1_000, _up(99_999, level))
    question = rng.choice((f"What is {a} × {b}?", f"Compute the product of {a} and {b}.",
                           f"Multiply {a} by {b}. What is the result?"))
    return Draw("product", (a, b), question, _snippet(f"print({a} * {b})"), a * b, _plan(f"{a} * {b}"),
                f"{a} × {b} = {a * b}.")


def _modpow(rng: random.Random, level: int = 0) -> Draw:
    base, exponent, modulus = rng.randint(2, _up(99, level)), rng.randint(50, 999), rng.randint(7, _up(9_999, level))
    answer = pow(base, exponent, modulus)
    question = rng.choice((f"What is the remainder when {base}^{exponent} is divided by {modulus}?",
                           f"Find {base}^{exponent} mod {modulus}."))
    return Draw("modpow", (base, exponent, modulus), question, _snippet(f"print(pow({base}, {exponent}, {modulus}))"),
                answer, _plan(f"pow({base}, {exponent}, {modulus})"), f"The remainder is {answer}.")


def _digit_sum_power(rng: random.Random, level: int = 0) -> Draw:
    base, exponent = rng.randint(2, _up(30, level)), rng.randint(20, 300)
    answer = sum(map(int, str(base**exponent)))
    question = rng.choice((f"What is the sum of the digits of {base}^{exponent}?",
                           f"Find the digit sum of {base} raised to the power {exponent}."))
    code = _snippet(f"print(sum(int(d) for d in str({base} ** {exponent})))")
    return Draw("digit_sum_power", (base, exponent), question, code, answer,
                _plan(f"the digit sum of {base} ** {exponent}"),
                f"The digit sum of {base}^{exponent} is {answer}.")


def _divisors(rng: random.Random, level: int = 0) -> Draw:
    n = rng.randint(1_000, _up(99_999, min(level, 1)))  # the snippet loops up to n: at most 10^6
    answer = sum(1 if d * d == n else 2 for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    question = rng.choice((f"How many positive divisors does {n} have?",
                           f"Count the positive integers that divide {n}."))
    code = _snippet(f"print(sum(1 for d in range(1, {n} + 1) if {n} % d == 0))")
    return Draw("divisors", (n,), question, code, answer, _plan(f"the number of divisors of {n}"),
                f"{n} has {answer} divisors.")


def _range_sum(rng: random.Random, level: int = 0) -> Draw:
    a = rng.randint(10, _up(9_999, level))
    b = a + rng.randint(100, _up(99_999, level))
    question = rng.choice((f"What is the sum of all integers from {a} to {b} inclusive?",
                           f"Add up every whole number from {a} through {b}."))
    return Draw("range_sum", (a, b), question, _snippet(f"print(sum(range({a}, {b} + 1)))"), (a + b) * (b - a + 1) // 2,
                _plan(f"sum(range({a}, {b} + 1))"), f"The sum is {(a + b) * (b - a + 1) // 2}.")


def _gcd_operands(rng: random.Random, level: int) -> tuple[int, int]:
    """Two numbers with a non-trivial common factor."""
    g = rng.randint(2, 400)
    return g * rng.randint(10, _up(999, level)), g * rng.randint(10, _up(999, level))


def _gcd(rng: random.Random, level: int = 0) -> Draw:
    a, b = _gcd_operands(rng, level)
    question = rng.choice((f"What is the greatest common divisor of {a} and {b}?", f"Find gcd({a}, {b})."))
    return Draw("gcd", (a, b), question, _snippet(f"print(math.gcd({a}, {b}))"), math.gcd(a, b),
                _plan(f"math.gcd({a}, {b})"), f"The greatest common divisor is {math.gcd(a, b)}.")


def _lcm(rng: random.Random, level: int = 0) -> Draw:
    a, b = _gcd_operands(rng, level)
    question = rng.choice((f"What is the least common multiple of {a} and {b}?", f"Find lcm({a}, {b})."))
    return Draw("lcm", (a, b), question, _snippet(f"print(math.lcm({a}, {b}))"), math.lcm(a, b),
                _plan(f"math.lcm({a}, {b})"), f"The least common multiple is {math.lcm(a, b)}.")


def _multiples_sum(rng: random.Random, level: int = 0) -> Draw:
    k, n = rng.randint(3, 97), rng.randint(1_000, _up(99_999, min(level, 1)))  # the snippet loops up to n
    answer = sum(range(0, n, k))
    question = rng.choice((f"What is the sum of all positive multiples of {k} that are less than {n}?",
                           f"Add up all the multiples of {k} below {n}."))
    code = _snippet(f"print(sum(x for x in range(1, {n}) if x % {k} == 0))")
    return Draw("multiples_sum", (k, n), question, code, answer,
                _plan(f"the sum of the multiples of {k} below {n}"), f"The sum is {answer}.")


class _Story(NamedTuple):
    """A word problem's story: its question and the snippet's expression over ``a, b, c``."""

    name: str
    template: str
    expression: str
    solve: Callable[[int, int, int], int]


_STORIES = (
    _Story("warehouse", "A warehouse holds {a} crates with {b} bottles in each crate. During a move, {c} bottles "
           "break. How many bottles are left?", "{a} * {b} - {c}", lambda a, b, c: a * b - c),
    _Story("printer", "A printer prints {a} pages per minute for {b} minutes, then another {c} pages. "
           "How many pages does it print in total?", "{a} * {b} + {c}", lambda a, b, c: a * b + c),
    _Story("cartons", "A farm packs {a} eggs into cartons of {b}, and sells each full carton for {c} cents. "
           "How many cents does it earn from the full cartons?", "({a} // {b}) * {c}", lambda a, b, c: (a // b) * c),
    _Story("pencils", "A school orders {a} boxes of pencils with {b} pencils per box and shares them equally among "
           "{c} classes. How many pencils does each class get (whole pencils only)?", "({a} * {b}) // {c}",
           lambda a, b, c: (a * b) // c),
    _Story("route", "A cyclist rides {a} metres every day for {b} days and has {c} metres still to go. "
           "How long is the whole route in metres?", "{a} * {b} + {c}", lambda a, b, c: a * b + c),
)
"""The word problems' stories. Each story is its own ``data_source``
(``synthetic-arithmetic/word_problem/cartons``): the stories differ in difficulty — a cold
start can learn four and get one systematically wrong — so a difficulty curriculum keeps
drawing the story whose groups still come back mixed."""


def _word_problem(rng: random.Random, level: int = 0) -> Draw:
    index = rng.randrange(len(_STORIES))
    story = _STORIES[index]
    a, b, c = rng.randint(100, _up(9_999, level)), rng.randint(12, _up(999, level)), rng.randint(13, _up(999, level))
    answer = story.solve(a, b, c)
    formula = story.expression.format(a=a, b=b, c=c)
    return Draw("word_problem", (index, a, b, c), story.template.format(a=a, b=b, c=c), _snippet(f"print({formula})"),
                answer, _plan(formula), f"The answer is {answer}.")


KINDS: dict[str, Callable[[random.Random, int], Draw]] = {
    "product": _product,
    "modpow": _modpow,
    "digit_sum_power": _digit_sum_power,
    "divisors": _divisors,
    "range_sum": _range_sum,
    "gcd": _gcd,
    "lcm": _lcm,
    "multiples_sum": _multiples_sum,
    "word_problem": _word_problem,
}
"""Problem generators by name; each draws one :class:`Draw` from a seeded ``Random`` at a
difficulty level (:data:`MAX_LEVEL`)."""

MAX_LEVEL = 2
"""The highest difficulty level. Level ``L`` gives the operands a model must copy into its
snippet ``L`` more digits (the same draws as level 0 otherwise; ``divisors`` and
``multiples_sum``, whose snippets loop up to ``n``, stop at one more digit). Level 0 is the
calibrated task of ``docs/sft.md`` and the default."""

MIX: dict[str, float] = {
    "product": 1.0,
    "modpow": 1.0,
    "digit_sum_power": 1.0,
    "divisors": 1.0,
    "range_sum": 1.0,
    "gcd": 0.5,
    "lcm": 0.5,
    "multiples_sum": 1.0,
    "word_problem": 2.0,
}
"""Default sampling weights of the kinds (calibrated in ``docs/sft.md``)."""


def stateful_steps(draw: Draw) -> tuple[str, str, str]:
    """The two calls of a stateful dialogue: (code that defines the question's numbers as
    variables and prints them — after the :data:`PRELUDE`, as every first call — what the
    second call computes, code that computes the answer from those variables only). The
    second snippet fails alone (``NameError``)."""
    key = draw.key
    if draw.kind == "word_problem":
        setup = f"a, b, c = {key[1]}, {key[2]}, {key[3]}\nprint(a, b, c)"
        what = _STORIES[key[0]].expression.format(a="a", b="b", c="c")
        second = f"print({what})"
    else:
        setup, what, second = _STATEFUL_STEPS[draw.kind](*key)
    return PRELUDE + setup, what, second


_STATEFUL_STEPS: dict[str, Callable[..., tuple[str, str, str]]] = {
    "product": lambda a, b: (f"a, b = {a}, {b}\nprint(a, b)", "the product a * b", "print(a * b)"),
    "modpow": lambda base, exponent, modulus: (
        f"base, exponent, modulus = {base}, {exponent}, {modulus}\nprint(base, exponent, modulus)",
        "pow(base, exponent, modulus)", "print(pow(base, exponent, modulus))"),
    "digit_sum_power": lambda base, exponent: (
        f"n = {base} ** {exponent}\nprint(len(str(n)), 'digits')", "the digit sum of n",
        "print(sum(int(d) for d in str(n)))"),
    "divisors": lambda n: (
        f"n = {n}\ndivisors = [d for d in range(1, n + 1) if n % d == 0]\nprint(divisors[:6])",
        "how many divisors there are", "print(len(divisors))"),
    "range_sum": lambda a, b: (
        f"numbers = range({a}, {b} + 1)\nprint(len(numbers), 'numbers')", "the sum of numbers",
        "print(sum(numbers))"),
    "gcd": lambda a, b: (f"a, b = {a}, {b}\nprint(a, b)", "math.gcd(a, b)", "print(math.gcd(a, b))"),
    "lcm": lambda a, b: (f"a, b = {a}, {b}\nprint(a, b)", "math.lcm(a, b)", "print(math.lcm(a, b))"),
    "multiples_sum": lambda k, n: (
        f"multiples = [x for x in range(1, {n}) if x % {k} == 0]\nprint(len(multiples), 'multiples')",
        "the sum of multiples", "print(sum(multiples))"),
}
"""Per kind, from the draw's operands: (setup call without the :data:`PRELUDE`, what the second
call computes, second call)."""


# ---------------------------------------------------------------- drawing


_MAX_MISSES = 5_000
"""Consecutive draws without a new problem of the split after which the space counts as exhausted."""


def split_of(draw: Draw) -> str:
    """The split a problem belongs to: a hash of its operation and operands (20/40/40 %)."""
    digest = hashlib.sha256(f"{draw.kind}:{draw.key}".encode()).digest()
    bucket = int.from_bytes(digest[:4], "big") % 10
    return "test" if bucket < 2 else "sft" if bucket < 6 else "rl"


def parse_difficulty(text: str) -> dict[str, int]:
    """``"product=1,word_problem=2"`` → levels by kind; a bare ``"1"`` sets every kind; ``""`` none.

    Raises ``ValueError`` naming the bad entry (an unknown kind, a level outside 0..:data:`MAX_LEVEL`).
    """
    text = text.strip()
    if not text:
        return {}
    if "=" not in text:
        return check_difficulty(dict.fromkeys(KINDS, _level(text, text)))
    levels = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        kind, sep, value = entry.partition("=")
        if not sep:
            raise ValueError(f"difficulty entry {entry!r}: write kind=level (e.g. product=1)")
        levels[kind.strip()] = _level(value, entry)
    return check_difficulty(levels)


def _level(value: str, entry: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise ValueError(f"difficulty entry {entry!r}: the level must be an integer 0..{MAX_LEVEL}") from None


def check_difficulty(levels: Mapping[str, int]) -> dict[str, int]:
    """``levels`` if every kind is known and every level in 0..:data:`MAX_LEVEL`, else ``ValueError``."""
    unknown = sorted(set(levels) - set(KINDS))
    if unknown:
        raise ValueError(f"difficulty: unknown problem kind(s) {unknown}; choose from {sorted(KINDS)}")
    bad = {k: v for k, v in levels.items() if not 0 <= v <= MAX_LEVEL}
    if bad:
        raise ValueError(f"difficulty: levels must be 0..{MAX_LEVEL}, got {bad}")
    return dict(levels)


def draw_problems(n: int, seed: int, split: str, kinds: Sequence[str] | None = None,
                  difficulty: Mapping[str, int] | None = None) -> list[Draw]:
    """``n`` distinct draws of ``split``, kinds weighted by :data:`MIX` (or uniform over ``kinds``),
    each kind at its level in ``difficulty`` (:data:`MAX_LEVEL`; absent kinds: level 0)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    names = list(kinds) if kinds else list(MIX)
    unknown = sorted(set(names) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown problem kind(s) {unknown}; choose from {sorted(KINDS)}")
    weights = [MIX.get(k, 1.0) if not kinds else 1.0 for k in names]
    levels = check_difficulty(difficulty or {})
    rng = random.Random(f"retool-arithmetic/{seed}/{split}")
    draws: dict[tuple[str, tuple[int, ...]], Draw] = {}
    misses = 0
    while misses < _MAX_MISSES:
        kind = rng.choices(names, weights)[0]
        draw = KINDS[kind](rng, levels.get(kind, 0))
        if split_of(draw) != split or (draw.kind, draw.key) in draws:
            misses += 1
            continue
        draws[draw.kind, draw.key], misses = draw, 0
        if len(draws) == n:
            return list(draws.values())
    raise ValueError(f"could only draw {len(draws)} distinct {split} problems of kinds {names}; ask for fewer")


def make_problems(n: int, seed: int = 0, split: str = "test", kinds: Sequence[str] | None = None,
                  difficulty: Mapping[str, int] | None = None) -> list[Problem]:
    """``n`` distinct problems of ``split`` (``rl`` to train on, ``test`` held out), each kind
    at its ``difficulty`` level (default 0, see :data:`MAX_LEVEL`).

    Ids are ``arith-<kind>-<hash>``: stable across calls and unique within a split. The
    ``data_source`` names the kind (``synthetic-arithmetic/product``), and a word problem's
    also its story (``synthetic-arithmetic/word_problem/cartons``), so a difficulty
    curriculum (``retool train --curriculum difficulty``) learns per kind and per story.
    """
    return [_problem(d) for d in draw_problems(n, seed, split, kinds, difficulty)]


def _problem(draw: Draw) -> Problem:
    digest = hashlib.sha256(f"{draw.kind}:{draw.key}".encode()).hexdigest()[:10]
    return Problem(f"arith-{draw.kind}-{digest}", draw.question, str(draw.answer), _data_source(draw))


def _data_source(draw: Draw) -> str:
    """The problem's family: ``synthetic-arithmetic/<kind>``, and ``/<story>`` for a word problem."""
    if draw.kind == "word_problem":
        return f"{DATA_SOURCE}/{draw.kind}/{_STORIES[draw.key[0]].name}"
    return f"{DATA_SOURCE}/{draw.kind}"


# ---------------------------------------------------------------- SFT dialogues


def make_sft_conversations(n: int, seed: int = 0, *, kinds: Sequence[str] | None = None,
                           sandbox: Any = None, interpreter: str = "stateless",
                           recovery_share: float = 0.0) -> list[dict[str, Any]]:
    """``n`` OpenAI-format tool dialogues for cold-start SFT (split ``sft``).

    Each is ``{"id", "answer", "messages"}`` with messages system
    (:func:`retool.protocol.system_prompt` of ``interpreter``), user, then for
    ``stateless`` one assistant turn (plan + one ``code_interpreter`` call) and its tool
    message, for ``stateful`` two such pairs whose second call uses the variables of the
    first (:func:`stateful_steps`; both run in one sandbox session), and a final
    assistant turn (the answer, ending with ``\\boxed{N}``). Tool messages are the real
    observations of :class:`retool.sandbox.Sandbox` (``sandbox``; one is started and
    closed otherwise). Raises ``RuntimeError`` if a snippet's output is not its answer
    (a generator bug).

    ``recovery_share`` (``stateless`` only): the share of dialogues, drawn with a seeded
    generator of their own (the problems are the same whatever the share), whose first
    call is one of :func:`mistakes` of the snippet, answered by its real traceback and
    followed by ``"I fix it"`` and the right call; that first assistant message has
    ``"weight": 0`` (context, not trained on). Raises ``RuntimeError`` if a mistake runs
    without an error (a generator bug).
    """
    check_interpreter(interpreter)
    if not 0.0 <= recovery_share <= 1.0:
        raise ValueError(f"recovery_share must be in [0, 1], got {recovery_share}")
    if recovery_share and interpreter != "stateless":
        raise ValueError("recovery dialogues are stateless (a stateful dialogue already makes both of its calls)")
    draws = draw_problems(n, seed, "sft", kinds)
    if interpreter == "stateless":
        calls = [[(d.plan, d.code)] for d in draws]
    else:
        calls = [_stateful_calls(d) for d in draws]
    mistaken = [False] * len(draws)
    if recovery_share:
        rng = random.Random(f"retool-arithmetic/{seed}/sft-recovery")
        for i, draw in enumerate(draws):
            if rng.random() < recovery_share:
                mistaken[i] = True
                calls[i] = [(draw.plan, rng.choice(mistakes(draw.code))), (_retry(draw), draw.code)]
    observations = _run_all([[code for _, code in steps] for steps in calls], sandbox, interpreter == "stateful",
                            mistaken)
    return [_conversation(d, _named_error(steps, obs) if wrong else steps, obs, interpreter, mistaken=wrong)
            for d, steps, obs, wrong in zip(draws, calls, observations, mistaken)]


def _retry(draw: Draw) -> str:
    """The text of a recovery dialogue's second call: the error (``{error}``, filled in from the
    traceback) and the plan's first sentence again, which states what the call computes."""
    need = draw.plan.removesuffix(_PLAN_TAIL)
    if need == draw.plan:
        raise RuntimeError(f"generator bug: plan {draw.plan!r} does not end as _plan writes it")
    return f"The code raised {{error}}. I fix it: {need}."


def mistakes(code: str) -> list[str]:
    """Mistaken versions of a stateless snippet, each raising in the sandbox: the last
    parenthesis left out or doubled (``SyntaxError``), ``math.`` left out before
    ``gcd``/``lcm`` (``NameError``), digits summed without ``int`` (``TypeError``) — the
    kinds of mistake the demo's model makes in its RL rollouts (``docs/demo-history.md``)."""
    line = code.removeprefix(PRELUDE)
    out = [PRELUDE + line[:-1], PRELUDE + line + ")"]
    if "math." in line:
        out.append(PRELUDE + line.replace("math.", ""))
    if "int(d) for d" in line:
        out.append(PRELUDE + line.replace("int(d) for d", "d for d"))
    return out


def _named_error(steps: list[tuple[str, str]], observations: list[str]) -> list[tuple[str, str]]:
    """A recovery dialogue's steps with the exception's name (the traceback's last line) in the retry's text."""
    last = [line for line in observations[0].splitlines() if line.strip()][-1]
    error = last.split(":")[0].strip()
    return [steps[0], (steps[1][0].replace("{error}", error), steps[1][1])]


def _stateful_calls(draw: Draw) -> list[tuple[str, str]]:
    """The (plan, code) pairs of a stateful dialogue. Each plan states what its call computes,
    as the stateless plan does: the first repeats the stateless plan (the expression with the
    question's numbers), the second names the expression over the variables. With a generic
    first plan ("I will put the numbers into variables") the cold start chose the wrong
    kind's setup for many questions: 23 % held-out after SFT on demo seed 7 (docs/demo-history.md)."""
    setup, what, compute = stateful_steps(draw)
    return [(f"{draw.plan} Its numbers go into Python variables first; they stay defined for the next call.",
             setup),
            (f"Now I compute {what} from the variables already defined.", compute)]


def _run_all(snippets: list[list[str]], sandbox: Any, stateful: bool,
             mistaken: list[bool] | None = None) -> list[list[str]]:
    """The observations of each dialogue's snippets, run in order (in one session when ``stateful``);
    where ``mistaken``, the first snippet must fail and the others succeed, elsewhere every one."""
    async def dialogue(sb: Any, codes: list[str]) -> list[Any]:
        if not stateful:
            return [await sb.run(code, timeout_s=10.0) for code in codes]
        async with sb.session() as session:
            return [await session.run(code, timeout_s=10.0) for code in codes]

    async def run(sb: Any) -> list[list[Any]]:
        return await asyncio.gather(*(dialogue(sb, codes) for codes in snippets))

    if sandbox is not None:
        results = asyncio.run(run(sandbox))
    else:
        with Sandbox(SandboxConfig(timeout_s=10.0, workers=4)) as sb:
            results = asyncio.run(run(sb))
    for codes, outcomes, wrong in zip(snippets, results, mistaken or [False] * len(snippets)):
        for k, (code, result) in enumerate(zip(codes, outcomes)):
            if wrong and k == 0:
                if result.status.value != "error":
                    raise RuntimeError(f"generator bug: the mistaken snippet {code!r} ended {result.status.value}, "
                                       "not with an error")
            elif not result.ok:
                raise RuntimeError(f"generator snippet failed in the sandbox ({result.status.value}): {code!r}\n"
                                   f"{result.observation}")
    return [[r.observation for r in outcomes] for outcomes in results]


def _conversation(draw: Draw, steps: list[tuple[str, str]], observations: list[str],
                  interpreter: str, *, mistaken: bool = False) -> dict[str, Any]:
    if observations[-1].strip() != str(draw.answer):
        raise RuntimeError(f"generator bug: {steps[-1][1]!r} printed {observations[-1]!r}, expected {draw.answer}")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system_prompt(interpreter)},
        {"role": "user", "content": draw.question},
    ]
    for i, ((plan, code), observation) in enumerate(zip(steps, observations)):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": TOOL_NAME, "arguments": json.dumps({"code": code})}}
        message: dict[str, Any] = {"role": "assistant", "content": plan, "tool_calls": [call]}
        if mistaken and i == 0:
            message["weight"] = 0  # context: the model learns the correction, not the mistake
        messages += [message,
                     {"role": "tool", "tool_call_id": f"call_{i}", "name": TOOL_NAME, "content": observation}]
    messages.append({"role": "assistant", "content": f"{draw.conclusion}\n\n\\boxed{{{draw.answer}}}"})
    return {"id": _problem(draw).id, "answer": str(draw.answer), "messages": messages}


# ---------------------------------------------------------------- files and CLI


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    """Write rows as JSON Lines atomically (a reader never sees half a file); return the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_jsonl(path, rows)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "task-data",
        description="Write the synthetic tool-worthy arithmetic task. Split 'sft' writes OpenAI-format "
        "tool dialogues for `retool sft` (tool outputs from the real sandbox); splits 'rl' and 'test' "
        "write problem rows {id, question, answer, data_source} for `retool train` and evaluation. "
        "The splits never share a problem.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--split", choices=SPLITS, default="sft", help="which split to write")
    p.add_argument("--n", type=int, default=400, help="number of dialogues or problems")
    p.add_argument("--seed", type=int, default=0, help="seed of the draw")
    p.add_argument("--kinds", default=None,
                   help=f"comma-separated problem kinds (default: the calibrated mix of {', '.join(KINDS)})")
    p.add_argument("--difficulty", default="",
                   help=f"splits 'rl' and 'test': harder operands per kind, kind=level,... or one level for "
                        f"every kind (0..{MAX_LEVEL}; level L adds L digits; default: level 0, the calibrated task)")
    p.add_argument("--output", type=Path, required=True, help="the JSONL file to write")
    p.add_argument("--recovery-share", type=float, default=0.0,
                   help="split 'sft', stateless only: the share of dialogues whose first call is a mistake "
                        "(its real traceback, then the right call; the mistaken message has weight 0, so it "
                        "is context, not trained on)")
    p.add_argument("--interpreter", choices=INTERPRETERS, default="stateless",
                   help="split 'sft' only: 'stateful' writes two-call dialogues whose second call uses the "
                        "variables of the first (one interpreter session), with the stateful system prompt")
    p.set_defaults(func=_run_task_data)


def _run_task_data(args: argparse.Namespace) -> int:
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()] if args.kinds else None
    try:
        output_file(args.output, "--output")
        if args.split == "sft" and args.difficulty.strip():
            raise ValueError("--difficulty applies to the 'rl' and 'test' splits; SFT dialogues use level 0")
        if args.split != "sft" and args.recovery_share:
            raise ValueError("--recovery-share applies to the 'sft' split (dialogues)")
        if args.split == "sft":
            rows: list[dict[str, Any]] = make_sft_conversations(args.n, args.seed, kinds=kinds,
                                                                interpreter=args.interpreter,
                                                                recovery_share=args.recovery_share)
        else:
            difficulty = parse_difficulty(args.difficulty)
            rows = [_problem_row(p) for p in make_problems(args.n, args.seed, args.split, kinds, difficulty)]
    except (ValueError, UnwritableOutputError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    count = write_jsonl(args.output, rows)
    what = "dialogues" if args.split == "sft" else "problems"
    print(f"wrote {count} {args.split} {what} to {args.output}")
    return 0


def _problem_row(p: Problem) -> dict[str, str]:
    return {"id": p.id, "question": p.question, "answer": p.answer, "data_source": p.data_source}
