"""The killable worker pool that runs ``math_verify`` for :mod:`retool.reward`.

Why it exists
    ``math_verify`` bounds its own time with ``signal.alarm``, which only works on the
    main thread: called from a trainer's threads or from asyncio's ``to_thread`` its
    timeouts fail. Here it runs with its timeouts off inside a small pool of grader
    *subprocesses* (:class:`GraderPool`), each fed one verification at a time through a
    pipe; the parent waits at most ``timeout_s`` for the verdict and otherwise kills
    that process (SIGKILL, then reaps it) and starts a replacement. So grading works the
    same from any thread, from asyncio and from inside other processes — daemonic
    ``multiprocessing`` workers included, because the workers are plain ``subprocess``
    children, not ``multiprocessing`` ones. They are started lazily (≈1 s each, the
    ``math_verify``/``sympy`` import), reused across calls, replaced when killed, and
    shut down at interpreter exit; a process that forks gets a fresh pool in the child
    and never touches the parent's workers. Each worker runs under an address-space
    limit (2 GiB by default) so a runaway answer cannot eat the machine's memory within
    its time slice.

What it covers
    :meth:`GraderPool.verify_many`: for each ``(answer, gold)`` pair of strings,
    ``verify(parse(f"${gold}$"), parse(f"${answer}$"))`` with ``math_verify``'s defaults,
    returned as a :class:`Verdict` — correct or not, a grading failure (timeout, dead
    worker, an exception ``math_verify`` swallowed) as ``grader_error``, a gold answer
    ``math_verify`` cannot parse as ``gold_error``. A fast path answers without a worker
    when both strings are plain decimal integers (``[+-]?[0-9]{1,50}``): they are
    compared as integers. ``tests/test_reward.py`` checks that its verdicts equal
    ``math_verify``'s; it can be switched off (``GraderPool(fast_path=False)``,
    ``retool grade --no-fast-path``).

What it does not cover
    Finding the answer in a response, turning a verdict into a reward, and treating a
    bad gold as a data bug: that policy is :mod:`retool.reward`'s, and this module
    imports nothing from it. Nor does it contain a grader that stalls while holding the
    GIL of an orphaned worker (the pipe closing ends an idle orphan; a busy one stops at
    its memory limit or when its computation ends).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import queue
import re
import resource
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

DEFAULT_TIMEOUT_S = 5.0
"""Wall-clock bound of one verification (gold parse + answer parse + comparison), the
same 5 s ``math_verify`` uses for each of its own steps."""

WORKER_STARTUP_TIMEOUT_S = 120.0
"""How long a new grader process may take to import ``math_verify`` (≈1 s when idle)."""

DEFAULT_WORKER_MEMORY_BYTES = 2 << 30
"""Address-space limit of one grader process (it needs ≈70 MB for normal answers)."""

_PLAIN_INTEGER = re.compile(r"[+-]?[0-9]{1,50}")


@dataclass(frozen=True)
class Verdict:
    """What verifying one ``(answer, gold)`` pair found."""

    correct: bool
    grader_error: str | None = None
    """Why grading failed (timeout, dead worker, an exception ``math_verify`` swallowed);
    then ``correct`` is False."""
    gold_error: str | None = None
    """Why ``math_verify`` cannot use the gold answer; then there is no verdict and
    ``correct`` is False."""


def plain_integer_verdict(answer: str, gold: str) -> bool | None:
    """The fast path: ``answer == gold`` when both are plain integers, else ``None``."""
    answer, gold = answer.strip(), gold.strip()
    if _PLAIN_INTEGER.fullmatch(answer) and _PLAIN_INTEGER.fullmatch(gold):
        return int(answer) == int(gold)
    return None


# ---------------------------------------------------------------- the worker process

_WORKER_BOOT = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from retool.grader_pool import _worker_main; _worker_main(int(sys.argv[2]))"
)


def _worker_main(memory_bytes: int) -> None:
    """Entry point of a grader subprocess: answer ``(answer, gold)`` requests on stdin.

    Replies on the original stdout, which is then pointed at /dev/null so that stray
    prints cannot corrupt the protocol. Exits when stdin closes.
    """
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
    from math_verify import parse, verify  # heavy (sympy): only the grader's worker process needs it

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
    turns such a logged exception into ``Verdict.grader_error`` while the verdict stays
    ``math_verify``'s. (It catches most internal failures — even a MemoryError deep in
    sympy — without logging, so this fires rarely.) Nothing is printed.
    """
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


class GraderPool:
    """Verifies answers with ``math_verify`` in a pool of killable subprocesses.

    Thread-safe; usable from asyncio through :func:`asyncio.to_thread` (as
    :func:`retool.reward.agrade` does). Workers start lazily on first use, are reused,
    and are stopped by :meth:`close`, by ``with GraderPool() as pool:``, or at
    interpreter exit.

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

    def verify_many(
        self, answers: Sequence[str], golds: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> list[Verdict]:
        """Verify ``answers[i]`` against ``golds[i]`` in parallel; verdicts in order.

        Each verification takes at most ``timeout_s`` seconds (plus waiting for a free
        worker); past it the worker is killed and the verdict is a ``grader_error``.
        """
        if len(answers) != len(golds):
            raise ValueError(f"{len(answers)} answers but {len(golds)} golds")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._check_owner()
        verdicts: list[Verdict | None] = [None] * len(answers)
        pending = []
        for i, (answer, gold) in enumerate(zip(answers, golds)):
            fast = plain_integer_verdict(answer, gold) if self.fast_path else None
            if fast is None:
                pending.append(i)
            else:
                verdicts[i] = Verdict(fast)
        slow = self._map(lambda i: self._verify(answers[i], golds[i], timeout_s), pending)
        for i, verdict in zip(pending, slow):
            verdicts[i] = verdict
        return verdicts  # type: ignore[return-value]

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

    def _map(self, fn, items: Sequence) -> Iterator:
        if len(items) <= 1:
            return map(fn, items)
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.num_workers, "retool-grader")
        return self._executor.map(fn, items)

    def _verify(self, answer: str, gold: str, timeout_s: float) -> Verdict:
        try:
            reply = self._with_worker(lambda worker: worker.run(answer, gold, timeout_s))
        except _WorkerLost as lost:
            return Verdict(False, grader_error=str(lost))
        if reply[0] == "gold_error":
            return Verdict(False, gold_error=reply[1])
        return Verdict(reply[1], grader_error=reply[2])

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


def _default_num_workers() -> int:
    configured = os.environ.get("RETOOL_GRADER_WORKERS")
    if configured:
        return int(configured)
    return min(8, os.cpu_count() or 1)


# ---------------------------------------------------------------- the process-wide pool

_default_pool: GraderPool | None = None
_default_pool_lock = threading.Lock()


def default_pool() -> GraderPool:
    """The pool behind :func:`retool.reward.grade` and friends (created on first use)."""
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
