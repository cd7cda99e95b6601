"""Outcome reward: the boxed final answer, graded by ``math_verify`` (SPEC §4.3).

What it does
    1. Answer extraction (:func:`extract_boxed`): in the last 300 characters of the
       final assistant turn, take the *last* ``\\boxed{``; its content up to the
       matching ``}`` is the answer. Braces are counted TeX-style (``\\{`` and ``\\}``
       are escaped characters, not groups). If that last box does not close inside the
       window there is no answer, even when an earlier box did close: the model's final
       word is what counts. An empty box is no answer either. Only the braced form
       ``\\boxed{...}`` is read: ``math_verify``'s own boxed extraction recognises only
       that form too, and the system prompt asks for exactly ``\\boxed{<answer>}`` —
       ``\\boxed 5``, ``\\boxed {5}`` and ``\\fbox{5}`` are not answers.
    2. Grading: ``verify(parse(f"${gold}$"), parse(f"${answer}$"))`` with
       ``math_verify``'s defaults (lenient: ``10\\%`` equals 10, ``x=4`` equals 4,
       units in ``\\text{}`` are dropped). Correct → reward +1, otherwise −1; no answer →
       −1 with ``formatted=False``. The verdict is exactly ``math_verify``'s, including
       where it departs from mathematical truth (``tests/test_reward.py`` lists those
       cases); this module does not second-guess it.
    3. Errors: a timeout, a crashed grader process, or an exception that
       ``math_verify`` swallowed while grading the prediction makes the answer
       incorrect but formatted, with ``Grade.grader_error`` set (the trainer counts
       these as ``reward/grader_errors``). A gold answer ``math_verify`` cannot parse is
       a data bug: it raises :class:`GoldAnswerError`. :func:`check_gold` /
       :func:`check_golds` confirm before training that each gold answer, boxed, grades
       as correct against itself.

How it runs
    ``math_verify`` bounds its own time with ``signal.alarm``, which only works on the
    main thread. Here it runs with its timeouts off inside a small pool of grader
    *subprocesses* (:class:`GraderPool`), each fed one verification at a time through a
    pipe; the parent waits at most ``timeout_s`` for the verdict and otherwise kills
    that process (SIGKILL, then reaps it) and starts a replacement. So grading works the
    same from any thread, from asyncio (:func:`agrade`, :func:`agrade_many`) and from
    inside other processes — daemonic ``multiprocessing`` workers included, because the
    workers are plain ``subprocess`` children, not ``multiprocessing`` ones. They are
    started lazily (≈1 s each, the ``math_verify``/``sympy`` import), reused across
    calls, replaced when killed, and shut down at interpreter exit; a process that forks
    gets a fresh pool in the child and never touches the parent's workers. Each worker
    runs under an address-space limit (2 GiB by default) so a runaway answer cannot eat
    the machine's memory within its time slice.

    A fast path answers without a worker when both the answer and the gold are plain
    decimal integers (``[+-]?[0-9]{1,50}``): they are compared as integers. The table in
    ``tests/test_reward.py`` checks that its verdicts equal ``math_verify``'s; it can be
    switched off (``GraderPool(fast_path=False)``, ``retool grade --no-fast-path``).

Non-goals: partial credit, format or length shaping, LLM judges, answers outside a
box (``math_verify``'s last-number fallback is deliberately not used), and containing a
grader that stalls while holding the GIL of an orphaned worker (the pipe closing ends an
idle orphan; a busy one stops at its memory limit or when its computation ends).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO

from retool.types import Grade

ANSWER_WINDOW_CHARS = 300
"""Only this many trailing characters of the final assistant turn are searched."""

DEFAULT_TIMEOUT_S = 5.0
"""Wall-clock bound of one verification (gold parse + answer parse + comparison), the
same 5 s ``math_verify`` uses for each of its own steps."""

WORKER_STARTUP_TIMEOUT_S = 120.0
"""How long a new grader process may take to import ``math_verify`` (≈1 s when idle)."""

DEFAULT_WORKER_MEMORY_BYTES = 2 << 30
"""Address-space limit of one grader process (it needs ≈70 MB for normal answers)."""

_BOX_OPEN = "\\boxed{"
_PLAIN_INTEGER = re.compile(r"[+-]?[0-9]{1,50}")


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


def plain_integer_verdict(answer: str, gold: str) -> bool | None:
    """The fast path: ``answer == gold`` when both are plain integers, else ``None``."""
    answer, gold = answer.strip(), gold.strip()
    if _PLAIN_INTEGER.fullmatch(answer) and _PLAIN_INTEGER.fullmatch(gold):
        return int(answer) == int(gold)
    return None


def boxed(answer: str) -> str:
    """``\\boxed{answer}`` — the response a perfect model would give."""
    return f"{_BOX_OPEN}{answer}}}"


# ---------------------------------------------------------------- the worker process

_WORKER_BOOT = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from retool.reward import _worker_main; _worker_main(int(sys.argv[2]))"
)


def _worker_main(memory_bytes: int) -> None:
    """Entry point of a grader subprocess: answer ``(answer, gold)`` requests on stdin.

    Replies on the original stdout, which is then pointed at /dev/null so that stray
    prints cannot corrupt the protocol. Exits when stdin closes.
    """
    import resource

    replies = Connection(os.dup(1), readable=False)
    requests = Connection(os.dup(0), writable=False)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    verify_pair = _load_math_verify()
    replies.send(("ready", os.getpid()))
    while True:
        try:
            answer, gold = requests.recv()
        except EOFError:
            return
        replies.send(verify_pair(answer, gold))


def _load_math_verify():
    """Import ``math_verify`` with its timeouts off; return the worker's verify function."""
    import functools

    from math_verify import parse, verify

    errors = _record_swallowed_exceptions("math_verify")

    @functools.lru_cache(maxsize=4096)
    def parse_gold(gold: str) -> list:
        return parse(f"${gold}$", parsing_timeout=None, raise_on_error=True)

    def verify_pair(answer: str, gold: str) -> tuple:
        try:
            gold_parsed = parse_gold(gold)
        except Exception as exc:  # noqa: BLE001 - reported to the caller as a data error
            return ("gold_error", f"math_verify cannot parse it ({type(exc).__name__}: {exc})")
        if not gold_parsed:
            return ("gold_error", "math_verify extracts nothing from it")
        errors.clear()
        answer_parsed = parse(f"${answer}$", parsing_timeout=None)
        correct = bool(verify(gold_parsed, answer_parsed, timeout_seconds=None))
        return ("ok", correct, None if correct or not errors else errors[0])

    return verify_pair


def _record_swallowed_exceptions(logger_name: str) -> list[str]:
    """Collect the exceptions a library catches and logs (with traceback) at DEBUG.

    ``math_verify`` returns False/[] instead of raising and logs the exception; this
    turns such a logged exception into ``Grade.grader_error`` while the verdict stays
    ``math_verify``'s. (It catches most internal failures — even a MemoryError deep in
    sympy — without logging, so this fires rarely.) Nothing is printed.
    """
    import logging

    errors: list[str] = []

    class _Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.exc_info and record.exc_info[1] is not None:
                exc = record.exc_info[1]
                errors.append(f"{type(exc).__name__}: {exc}"[:300])

    logger = logging.getLogger(logger_name)
    logger.handlers[:] = [_Recorder()]
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    return errors


# ---------------------------------------------------------------- the parent side


class _WorkerLost(Exception):
    """The worker timed out or died; it has been killed and reaped."""


class _Worker:
    """One grader subprocess with a request pipe and a reply pipe."""

    def __init__(self, memory_bytes: int):
        request_r, request_w = os.pipe()
        reply_r, reply_w = os.pipe()
        package_root = str(Path(__file__).resolve().parent.parent)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _WORKER_BOOT, package_root, str(memory_bytes)],
                stdin=request_r,
                stdout=reply_w,
                env=_worker_env(),
                start_new_session=True,  # a terminal's Ctrl-C goes to the parent only
            )
        finally:
            os.close(request_r)
            os.close(reply_w)
        self.requests = Connection(request_w, readable=False)
        self.replies = Connection(reply_r, writable=False)
        self.ready = False

    def run(self, answer: str, gold: str, timeout_s: float) -> tuple:
        """Send one verification and wait at most ``timeout_s`` for its verdict."""
        self.wait_ready()
        self.requests.send((answer, gold))
        if not self.replies.poll(timeout_s):
            self.kill()
            raise _WorkerLost(f"timeout after {timeout_s:g} s")
        return self._recv()

    def wait_ready(self) -> None:
        if self.ready:
            return
        if not self.replies.poll(WORKER_STARTUP_TIMEOUT_S):
            self.kill()
            raise RuntimeError(
                f"grader process did not start within {WORKER_STARTUP_TIMEOUT_S:g} s"
            )
        self._recv()
        self.ready = True

    def _recv(self) -> tuple:
        try:
            return self.replies.recv()
        except (EOFError, OSError):
            code = self.kill()
            raise _WorkerLost(f"grader process died (exit code {code})") from None

    def kill(self) -> int | None:
        """SIGKILL the process (if alive), reap it, close the pipes; the exit code."""
        if self.proc.poll() is None:
            self.proc.kill()
        code = self.proc.wait()
        self.requests.close()
        self.replies.close()
        return code

    def close(self) -> None:
        """Ask the process to exit (stdin EOF) without waiting for it."""
        if not self.requests.closed:
            self.requests.close()


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = "1"
    return env


def _shut_down(workers: set[_Worker], owner_pid: int, grace_s: float = 2.0) -> None:
    """Stop every worker: EOF first, SIGKILL after ``grace_s``; reap all. Owner only."""
    if os.getpid() != owner_pid:
        return  # a forked child must never touch its parent's workers
    for worker in list(workers):
        worker.close()
    deadline = time.monotonic() + grace_s
    for worker in list(workers):
        try:
            worker.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        worker.kill()
    workers.clear()


@dataclass(frozen=True)
class _Verdict:
    correct: bool
    error: str | None = None


class GraderPool:
    """Grades answers with ``math_verify`` in a pool of killable subprocesses.

    Thread-safe; usable from asyncio through :func:`asyncio.to_thread` (see
    :func:`agrade`). Workers start lazily on first use, are reused, and are stopped by
    :meth:`close`, by ``with GraderPool() as pool:``, or at interpreter exit.

    Args:
        num_workers: grader processes (default: ``$RETOOL_GRADER_WORKERS`` or
            ``min(8, cpu count)``).
        fast_path: compare plain integers directly, without a worker.
        memory_bytes: address-space limit per worker (0 = none).
    """

    def __init__(
        self,
        num_workers: int | None = None,
        *,
        fast_path: bool = True,
        memory_bytes: int = DEFAULT_WORKER_MEMORY_BYTES,
    ):
        self.num_workers = _default_num_workers() if num_workers is None else num_workers
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        self.fast_path = fast_path
        self.memory_bytes = memory_bytes
        self._reset_state()

    def _reset_state(self) -> None:
        self._pid = os.getpid()
        # LIFO: a lone caller keeps reusing the warmest worker; the others start only
        # when there is concurrent work for them.
        self._slots: queue.LifoQueue[_Worker | None] = queue.LifoQueue()
        for _ in range(self.num_workers):
            self._slots.put(None)
        self._workers: set[_Worker] = set()
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._closed = False
        self._finalizer = weakref.finalize(self, _shut_down, self._workers, self._pid)

    def _check_owner(self) -> None:
        """After a fork, the child forgets the parent's workers and starts its own."""
        if os.getpid() != self._pid:
            self._finalizer.detach()
            self._reset_state()
        if self._closed:
            raise RuntimeError("GraderPool is closed")

    # ------------------------------------------------------------ public API

    def grade(self, response: str, gold: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Grade:
        """Grade one final assistant turn against its gold answer (see module doc)."""
        outcome = self.try_grade_many([response], [gold], timeout_s=timeout_s)[0]
        if isinstance(outcome, GoldAnswerError):
            raise outcome
        return outcome

    def grade_many(
        self, responses: Sequence[str], golds: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> list[Grade]:
        """Grade ``responses[i]`` against ``golds[i]`` in parallel; results in order.

        Raises :class:`GoldAnswerError` (naming the index) if any gold is unparsable.
        """
        outcomes = self.try_grade_many(responses, golds, timeout_s=timeout_s)
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, GoldAnswerError):
                raise GoldAnswerError(outcome.gold, f"golds[{i}]: {outcome.reason}")
        return outcomes  # type: ignore[return-value]

    def try_grade_many(
        self, responses: Sequence[str], golds: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> list[Grade | GoldAnswerError]:
        """Like :meth:`grade_many`, but a bad gold is returned in its slot, not raised."""
        if len(responses) != len(golds):
            raise ValueError(f"{len(responses)} responses but {len(golds)} golds")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        for value in (*responses, *golds):
            if not isinstance(value, str):
                raise TypeError(f"responses and golds must be str, got {type(value).__name__}")
        self._check_owner()
        answers = [extract_boxed(response) for response in responses]
        verdicts = self._verdicts(answers, golds, timeout_s)
        return [_to_grade(a, v) for a, v in zip(answers, verdicts)]

    def start(self) -> None:
        """Start every worker now and wait until all are ready (else: lazily)."""
        self._check_owner()
        taken = [self._slots.get() for _ in range(self.num_workers)]
        try:
            for i, worker in enumerate(taken):
                if worker is None or worker.proc.poll() is not None:
                    self._discard(worker)
                    taken[i] = self._spawn()  # all start in parallel: Popen does not wait
            for worker in taken:
                worker.wait_ready()
        finally:
            for worker in taken:
                self._slots.put(worker)

    def close(self) -> None:
        """Stop and reap every worker. Idempotent; the pool cannot be used afterwards."""
        self._closed = True
        if self._executor is not None and os.getpid() == self._pid:
            self._executor.shutdown(wait=True)
        self._finalizer()

    def __enter__(self) -> GraderPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals

    def _verdicts(
        self, answers: Sequence[str | None], golds: Sequence[str], timeout_s: float
    ) -> list[_Verdict | GoldAnswerError | None]:
        """One verdict per pair: ``None`` without an answer, fast path, else a worker."""
        verdicts: list[_Verdict | GoldAnswerError | None] = [None] * len(answers)
        pending = []
        for i, (answer, gold) in enumerate(zip(answers, golds)):
            fast = plain_integer_verdict(answer, gold) if answer and self.fast_path else None
            if fast is not None:
                verdicts[i] = _Verdict(fast)
            elif answer is not None:
                pending.append(i)
        slow = self._map(lambda i: self._verify(answers[i], golds[i], timeout_s), pending)
        for i, verdict in zip(pending, slow):
            verdicts[i] = verdict
        return verdicts

    def _map(self, fn, items: Sequence) -> Iterator:
        if len(items) <= 1:
            return map(fn, items)
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.num_workers, "retool-grader")
        return self._executor.map(fn, items)

    def _verify(self, answer: str, gold: str, timeout_s: float) -> _Verdict | GoldAnswerError:
        try:
            reply = self._with_worker(lambda worker: worker.run(answer, gold, timeout_s))
        except _WorkerLost as lost:
            return _Verdict(False, str(lost))
        if reply[0] == "gold_error":
            return GoldAnswerError(gold, reply[1])
        return _Verdict(reply[1], reply[2])

    def _with_worker(self, fn):
        """Run ``fn(worker)`` on a checked-out worker; replace the worker if it is lost."""
        worker = self._slots.get()
        try:
            if worker is None or worker.proc.poll() is not None:
                self._discard(worker)
                worker = self._spawn()
            return fn(worker)
        except BaseException:
            # Lost, failed to start, or interrupted between request and reply (its
            # late reply would answer the next request): never reuse it.
            self._discard(worker)
            worker = None
            raise
        finally:
            self._slots.put(worker)

    def _discard(self, worker: _Worker | None) -> None:
        if worker is not None:
            worker.kill()
            self._workers.discard(worker)

    def _spawn(self) -> _Worker:
        worker = _Worker(self.memory_bytes)
        self._workers.add(worker)
        return worker


def _to_grade(answer: str | None, verdict: _Verdict | GoldAnswerError | None) -> Grade | GoldAnswerError:
    if isinstance(verdict, GoldAnswerError):
        return verdict
    if answer is None or verdict is None:
        return Grade(reward=-1.0, correct=False, formatted=False, answer=answer)
    reward = 1.0 if verdict.correct else -1.0
    return Grade(reward, verdict.correct, True, answer, grader_error=verdict.error)


def _default_num_workers() -> int:
    configured = os.environ.get("RETOOL_GRADER_WORKERS")
    if configured:
        return int(configured)
    return min(8, os.cpu_count() or 1)


# ---------------------------------------------------------------- module-level API

_default_pool: GraderPool | None = None
_default_pool_lock = threading.Lock()


def default_pool() -> GraderPool:
    """The process-wide pool behind :func:`grade` and friends (created on first use)."""
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None or _default_pool._closed:
            _default_pool = GraderPool()
        return _default_pool


def _forget_default_pool_in_child() -> None:
    global _default_pool, _default_pool_lock
    _default_pool = None  # the parent's workers stay the parent's
    _default_pool_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_default_pool_in_child)
atexit.register(lambda: _default_pool is not None and _default_pool.close())


def grade(response: str, gold: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Grade:
    """Grade one final assistant turn against its gold answer.

    +1 when the last ``\\boxed{}`` of the last 300 characters is ``math_verify``-equal
    to ``gold``; −1 otherwise. Raises :class:`GoldAnswerError` for an unparsable gold.
    At most ``timeout_s`` seconds are spent verifying (plus waiting for a free worker).
    """
    return default_pool().grade(response, gold, timeout_s=timeout_s)


def grade_many(
    responses: Sequence[str], golds: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[Grade]:
    """Grade many answers in parallel (see :func:`grade`); results in input order."""
    return default_pool().grade_many(responses, golds, timeout_s=timeout_s)


async def agrade(response: str, gold: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Grade:
    """:func:`grade` for asyncio code: runs in a thread, never blocks the event loop."""
    return await asyncio.to_thread(grade, response, gold, timeout_s=timeout_s)


async def agrade_many(
    responses: Sequence[str], golds: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[Grade]:
    """:func:`grade_many` for asyncio code."""
    return await asyncio.to_thread(grade_many, responses, golds, timeout_s=timeout_s)


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
    outcomes = default_pool().try_grade_many(responses, [golds[i] for i in todo], timeout_s=timeout_s)
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


# ---------------------------------------------------------------- `retool grade`


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``retool grade`` command."""
    parser = subparsers.add_parser(
        "grade",
        help="grade model answers against gold answers (JSONL in, JSONL out)",
        description=(
            'Reads JSONL lines {"response": ..., "gold": ...} and writes, for each input '
            'line, one JSONL line {"line", "reward", "correct", "formatted", "answer", '
            '"grader_error"} in input order. The answer is the last \\boxed{} in the last '
            f"{ANSWER_WINDOW_CHARS} characters of the response, checked with math_verify. "
            'A bad line (invalid JSON, a missing field, an unparsable gold) becomes '
            '{"line": N, "error": ...} on stdout and a message on stderr; the other lines '
            "are still graded, and the exit code is 1. Blank lines are skipped."
        ),
    )
    parser.add_argument("--input", type=Path, help="JSONL file to read (default: stdin)")
    parser.add_argument("--output", type=Path, help="JSONL file to write (default: stdout)")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                        help="wall-clock bound of one verification (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=None,
                        help="grader processes (default: min(8, CPU count))")
    parser.add_argument("--no-fast-path", action="store_true",
                        help="send plain-integer pairs to math_verify too")
    parser.add_argument("--batch-size", type=int, default=512,
                        help="lines graded together before their results are written")
    parser.set_defaults(func=_run_grade_command)


def _run_grade_command(args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise SystemExit("retool grade: --batch-size must be >= 1")
    try:
        with (
            _open_in(args.input) as source,
            _open_out(args.output) as sink,
            GraderPool(args.workers, fast_path=not args.no_fast_path) as pool,
        ):
            counts = _grade_stream(pool, source, sink, args.batch_size, args.timeout_s)
    except OSError as error:
        print(f"retool grade: {error}", file=sys.stderr)
        return 2
    print(
        f"retool grade: {counts['lines']} lines, {counts['correct']} correct, "
        f"{counts['unformatted']} without a boxed answer, {counts['grader_errors']} "
        f"grader errors, {counts['bad']} bad lines",
        file=sys.stderr,
    )
    return 1 if counts["bad"] else 0


def _grade_stream(pool: GraderPool, source: IO[bytes], sink: IO[str], batch_size: int,
                  timeout_s: float) -> dict[str, int]:
    """Grade JSONL from ``source`` into ``sink`` batch by batch; the tallies."""
    counts = {"lines": 0, "correct": 0, "unformatted": 0, "grader_errors": 0, "bad": 0}
    for batch in _batches(_numbered_lines(source), batch_size):
        for record in _grade_batch(pool, batch, timeout_s):
            _tally(counts, record)
            sink.write(json.dumps(record, ensure_ascii=False) + "\n")
        sink.flush()
    return counts


def _open_in(path: Path | None) -> IO[bytes]:
    """Bytes, so that a line that is not UTF-8 is one bad line, not a crash."""
    return open(path, "rb") if path else _Borrowed(sys.stdin.buffer)  # type: ignore[return-value]


def _open_out(path: Path | None) -> IO[str]:
    return open(path, "w", encoding="utf-8") if path else _Borrowed(sys.stdout)  # type: ignore[return-value]


class _Borrowed:
    """A context manager around stdin/stdout that does not close them."""

    def __init__(self, stream: IO):
        self.stream = stream

    def __enter__(self) -> IO:
        return self.stream

    def __exit__(self, *exc_info: object) -> None:
        if self.stream.writable():
            self.stream.flush()


def _numbered_lines(source: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    for number, line in enumerate(source, start=1):
        if line.strip():
            yield number, line


def _batches(items: Iterable, size: int) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _grade_batch(pool: GraderPool, batch: list[tuple[int, bytes]], timeout_s: float) -> list[dict]:
    """Grade one batch of numbered JSONL lines; one output record per line, in order."""
    records: list[dict] = [{}] * len(batch)
    pairs: list[tuple[int, str, str]] = []
    for slot, (number, line) in enumerate(batch):
        try:
            pairs.append((slot, *_read_pair(line)))
        except ValueError as error:
            records[slot] = _bad_line(number, str(error))
    outcomes = pool.try_grade_many([p[1] for p in pairs], [p[2] for p in pairs], timeout_s=timeout_s)
    for (slot, _, _), outcome in zip(pairs, outcomes):
        number = batch[slot][0]
        if isinstance(outcome, GoldAnswerError):
            records[slot] = _bad_line(number, str(outcome))
        else:
            records[slot] = {"line": number, "reward": outcome.reward, "correct": outcome.correct,
                             "formatted": outcome.formatted, "answer": outcome.answer,
                             "grader_error": outcome.grader_error}
    return records


def _read_pair(line: bytes) -> tuple[str, str]:
    """``(response, gold)`` from one JSONL line; ``ValueError`` with a clear reason."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ValueError(f"not valid UTF-8 ({error})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"invalid JSON ({error})") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    missing = [key for key in ("response", "gold") if key not in record]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    response, gold = record["response"], record["gold"]
    if not isinstance(response, str):
        raise ValueError(f'"response" must be a string, got {type(response).__name__}')
    if isinstance(gold, (int, float)) and not isinstance(gold, bool):
        gold = str(gold)  # JSON numbers are unambiguous golds
    if not isinstance(gold, str):
        raise ValueError(f'"gold" must be a string or number, got {type(gold).__name__}')
    return response, gold


def _bad_line(number: int, reason: str) -> dict:
    print(f"retool grade: line {number}: {reason}", file=sys.stderr)
    return {"line": number, "error": reason}


def _tally(counts: dict[str, int], record: dict) -> None:
    counts["lines"] += 1
    if "error" in record:
        counts["bad"] += 1
        return
    counts["correct"] += record["correct"]
    counts["unformatted"] += not record["formatted"]
    counts["grader_errors"] += record["grader_error"] is not None
