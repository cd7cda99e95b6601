"""A scripted policy with the reference run's shape, for the latency-model service.

The reference run (Qwen3.5-4B, LoRA 32, 8 problems x 8 trajectories of at most 8,192
tokens, at most 4 code calls, 200 steps) sampled about 1,380 tokens per trajectory
(its 20-step bill: 1.77M sampled tokens / 20 steps / 64 trajectories), and its
trajectories average about 2,200 tokens with a long tail to the budget. This policy
writes trajectories of that shape, as text the real Qwen3.5 tokenizer encodes:

- problems of three kinds (:func:`make_problems`) whose answers the policy computes
  from the question text it reads in the prompt, so the real grader grades them;
- per trajectory a plan drawn from the request's seed: 0-4 code calls (mean ~1.6),
  turn lengths log-normal around ~540 tokens (some run past the 1,024-token turn cap
  and are cut there), some malformed calls, a final ``\\boxed{}`` answer that is right
  about half the time;
- real snippets the real sandbox runs: plain arithmetic, sympy and numpy variants,
  a few that raise, a few with long output (cut to the tool-response budget) and a
  rare one that loops until the sandbox's timeout.

Later turns find their plan again from the first assistant turn, which names it
(``attempt N``), so a trajectory's turns are a pure function of (prompt, seed): a resumed
run asks for, and gets, the same tokens as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from dataclasses import dataclass
from typing import Any

TURN_MEDIAN_TOKENS = 470
"""Median tokens of one assistant turn (log-normal, sigma :data:`TURN_SIGMA`, at most
:data:`TURN_MAX_TOKENS`): mean ~520, so 1.6 calls + 1 answer turn ~ 1,400 sampled tokens
per trajectory, the reference run's."""
TURN_SIGMA = 0.55
TURN_MAX_TOKENS = 960
RUNAWAY_RATE = 0.03
"""Share of turns that run past the 1,024-token turn cap (cut there: the trajectory ends)."""
RUNAWAY_TOKENS = 1400
CALL_COUNTS = (0, 1, 2, 3, 4)
CALL_WEIGHTS = (0.12, 0.38, 0.30, 0.12, 0.08)
"""How many code calls a plan makes: mean 1.66, up to the reference run's 4."""
MALFORMED_RATE = 0.06
"""Share of calls written with a broken tool-call block (the rollout answers an error)."""
ERROR_RATE = 0.06
"""Share of calls whose snippet raises."""
LONG_OUTPUT_RATE = 0.04
"""Share of calls that print far more than the tool-response budget."""
TIMEOUT_RATE = 0.004
"""Share of calls that loop until the sandbox's timeout (about one per 2.5 steps); the
reference run reported 2-3 % (``ScriptedPolicy(timeout_rate=...)``, ``bench/scale.py
--timeout-rate``)."""
CORRECT_RATE = 0.5

_WORDS = ("so", "the", "sum", "term", "we", "check", "each", "case", "then", "value", "count", "next",
          "factor", "this", "gives", "since", "prime", "mod", "so that", "note", "remainder", "divisor",
          "square", "integer", "total", "compute", "formula", "pattern", "again", "carefully", "step")


@dataclass(frozen=True)
class Problem:
    """One training problem: its question text and its integer answer."""

    id: str
    question: str
    answer: int


def make_problems(count: int, seed: int = 0) -> list[Problem]:
    """``count`` problems of the three kinds, parameters drawn from ``seed``."""
    rng = random.Random(seed)
    problems = []
    for i in range(count):
        kind = i % 3
        if kind == 0:
            n = rng.randint(20, 400)
            question = f"Find the sum of the squares of the integers from 1 to {n}."
        elif kind == 1:
            n = rng.randint(1_000, 5_000_000)
            question = f"How many positive divisors does {n} have?"
        else:
            a, b, p = rng.randint(2, 99), rng.randint(100, 5_000), rng.choice((97, 101, 997, 1009, 7919))
            question = f"What is the remainder when {a}^{b} is divided by {p}?"
        problems.append(Problem(f"scale-{i:04d}", question, solve(question)))
    return problems


def solve(question: str) -> int:
    """The answer of a :func:`make_problems` question, from its text."""
    numbers = [int(x) for x in re.findall(r"\d+", question)]
    if "sum of the squares" in question:
        n = numbers[-1]
        return n * (n + 1) * (2 * n + 1) // 6
    if "positive divisors" in question:
        return _divisor_count(numbers[0])
    if "remainder when" in question:
        a, b, p = numbers
        return pow(a, b, p)
    raise ValueError(f"not a scale problem: {question[:80]!r}")


def _divisor_count(n: int) -> int:
    count, d = 1, 2
    while d * d <= n:
        power = 0
        while n % d == 0:
            n //= d
            power += 1
        count *= power + 1
        d += 1
    return count * (2 if n > 1 else 1)


ENDLESS = "total = 0\nwhile True:\n    total += 1"
"""The snippet that never ends (it runs to the sandbox's timeout)."""


def snippet(question: str, rng: random.Random, timeout_rate: float = TIMEOUT_RATE) -> str:
    """A real snippet for the question: plain, sympy or numpy; some raise, some print
    long output, a share ``timeout_rate`` never ends.

    One draw decides the kind. Above the default rate the extra timeouts come from the
    top of the draw's range, after the plain snippet's own draws, so a higher rate turns
    some plain calls into endless loops and changes nothing else the trajectory draws."""
    roll = rng.random()
    if roll < min(timeout_rate, TIMEOUT_RATE):
        return ENDLESS
    if TIMEOUT_RATE <= roll < TIMEOUT_RATE + ERROR_RATE:
        return rng.choice(("print(undefined_total)", "values = [1, 2, 3]\nprint(values[7])", "print(1 / 0)"))
    if TIMEOUT_RATE + ERROR_RATE <= roll < TIMEOUT_RATE + ERROR_RATE + LONG_OUTPUT_RATE:
        return "print([k * k for k in range(1, 3000)])"
    code = _plain(question, rng)
    return ENDLESS if roll >= 1.0 - max(0.0, timeout_rate - TIMEOUT_RATE) else code


def _plain(question: str, rng: random.Random) -> str:
    """The snippet that computes the question's answer, in one of three styles."""
    numbers = [int(x) for x in re.findall(r"\d+", question)]
    style = rng.choice(("plain", "sympy", "numpy"))
    if "sum of the squares" in question:
        n = numbers[-1]
        return {"plain": f"print(sum(k * k for k in range(1, {n} + 1)))",
                "sympy": f"import sympy as sp\nk = sp.symbols('k')\nprint(sp.summation(k**2, (k, 1, {n})))",
                "numpy": f"import numpy as np\na = np.arange(1, {n} + 1, dtype=np.int64)\nprint(int((a * a).sum()))"}[style]
    if "positive divisors" in question:
        n = numbers[0]
        return {"plain": f"n = {n}\nprint(sum(2 if d * d != n else 1 for d in range(1, int(n**0.5) + 1) if n % d == 0))",
                "sympy": f"import sympy\nprint(sympy.divisor_count({n}))",
                "numpy": f"import numpy as np\nd = np.arange(1, {n} + 1)\nprint(int((({n} % d) == 0).sum()))"}[style]
    a, b, p = numbers
    return {"plain": f"print(pow({a}, {b}, {p}))",
            "sympy": f"import sympy\nprint(sympy.Integer({a})**{b} % {p})",
            "numpy": f"import numpy as np\nr = 1\nfor _ in range({b}):\n    r = int(np.int64(r) * {a} % {p})\nprint(r)"}[style]


def tool_call(code: str, malformed: bool) -> str:
    """A call as Qwen3.5's template writes one; a malformed one loses its ``</parameter>``."""
    close = "" if malformed else "</parameter>\n"
    return f"<tool_call>\n<function=code_interpreter>\n<parameter=code>\n{code}\n{close}</function>\n</tool_call>"


@dataclass(frozen=True)
class Plan:
    """What one trajectory does: its id (named in its first turn), calls, turn lengths, answer."""

    attempt: int
    calls: int
    turn_tokens: tuple[int, ...]
    correct: bool


def make_plan(attempt: int) -> Plan:
    rng = random.Random(attempt)
    calls = rng.choices(CALL_COUNTS, CALL_WEIGHTS)[0]
    mu = math.log(TURN_MEDIAN_TOKENS)
    turns = tuple(RUNAWAY_TOKENS if rng.random() < RUNAWAY_RATE
                  else min(TURN_MAX_TOKENS, max(24, int(rng.lognormvariate(mu, TURN_SIGMA)))) for _ in range(calls + 1))
    return Plan(attempt, calls, turns, rng.random() < CORRECT_RATE)


class ScriptedPolicy:
    """Sampled text for a prompt, as the service's answer to a sample request."""

    def __init__(self, tokenizer: Any, timeout_rate: float = TIMEOUT_RATE) -> None:
        if not 0.0 <= timeout_rate <= 0.5:
            raise ValueError(f"timeout_rate must be in [0, 0.5], got {timeout_rate:g}")
        self.tokenizer = tokenizer
        self.timeout_rate = timeout_rate
        self._sentences = self._sentence_pool()

    def _sentence_pool(self) -> list[tuple[str, int]]:
        rng = random.Random(1234)
        pool = []
        for _ in range(400):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 16))]
            words.insert(rng.randint(0, len(words)), str(rng.randint(2, 9999)))
            text = " ".join(words).capitalize() + ". "
            pool.append((text, len(self.tokenizer.encode(text, add_special_tokens=False))))
        return pool

    def text(self, context: str, seed: int | None) -> str:
        """The next assistant turn for a decoded context that ends with the generation prompt."""
        question = _question(context)
        assistants = context.split("<|im_start|>assistant\n")
        turn = len(assistants) - 2
        if turn == 0:
            attempt = seed if seed is not None else int(hashlib.sha1(context.encode()).hexdigest()[:8], 16)
        else:
            found = re.search(r"\(attempt (\d+)\)", assistants[1])
            attempt = int(found[1]) if found else 0
        plan = make_plan(attempt % (1 << 31))
        rng = random.Random(f"{plan.attempt}-{turn}")
        words = plan.turn_tokens[min(turn, len(plan.turn_tokens) - 1)]
        head = f"Let me work through this carefully (attempt {plan.attempt}). " if turn == 0 else ""
        body = head + self._filler(words, rng)
        if turn < plan.calls:
            return body + "\n\n" + tool_call(snippet(question, rng, self.timeout_rate), rng.random() < MALFORMED_RATE)
        answer = solve(question)
        return body + f"\n\nSo the answer is:\n\\boxed{{{answer if plan.correct else answer + rng.randint(1, 9)}}}"

    def _filler(self, tokens: int, rng: random.Random) -> str:
        out, total = [], 0
        while total < tokens:
            text, n = rng.choice(self._sentences)
            out.append(text)
            total += n
        return "".join(out).rstrip()

    def sample(self, prompt: list[int], seed: int | None, max_tokens: int,
               stop_ids: list[int]) -> tuple[list[int], list[float], str]:
        """(tokens, logprobs, stop reason) for one sample request."""
        context = self.tokenizer.decode(prompt, skip_special_tokens=False)
        tokens = self.tokenizer.encode(self.text(context, seed), add_special_tokens=False) + [stop_ids[0]]
        reason = "stop"
        if len(tokens) > max_tokens:
            tokens, reason = tokens[:max_tokens], "length"
        rng = random.Random(hash_tokens(prompt) ^ (seed or 0))
        return tokens, [-rng.random() * 2.0 for _ in tokens], reason


def _question(context: str) -> str:
    user = context.split("<|im_start|>user\n", 1)[1]
    return user.split("<|im_end|>", 1)[0]


def hash_tokens(tokens: list[int]) -> int:
    return int(hashlib.blake2b(json.dumps(tokens).encode(), digest_size=8).hexdigest(), 16)
