"""The local sandbox: run model-written Python snippets in fresh, isolated, limited processes.

:class:`Sandbox` talks to one warm parent process (the *zygote*, :mod:`._zygote`), which
is started through a clean ``exec`` with a scrubbed environment, imports numpy, sympy and
friends once, and forks a fresh process tree per call; see :mod:`retool.sandbox` for the
threat model. This module is the trainer's side: configuration, a bounded pool that is
safe from asyncio and threads, result classification, metrics, and replacing a zygote
that died (its in-flight calls then report ``sandbox_error`` instead of hanging).

Stateless by default: every call is a fresh process. :meth:`Sandbox.session` opens a
:class:`Session` instead — one interpreter, isolated and limited exactly like a call,
that keeps its globals across the session's calls (as a notebook does) until it is
closed. Limits stay per call (time, memory growth, output); a call that breaks one ends
the interpreter, and the session's next call runs in a fresh one whose result says the
state was lost (``ExecutionResult.state_lost``).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import itertools
import json
import logging
import os
import posixpath
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retool.sandbox._cgroups import remove_leftovers as remove_leftover_cgroups
from retool.sandbox._zygote import SCRIPT_NAME
from retool.sandbox.metrics import SandboxMetrics
from retool.types import ExecStatus, ExecutionResult

log = logging.getLogger("retool.sandbox")

ZYGOTE_SCRIPT = Path(__file__).with_name("_zygote.py")

MAX_TIMEOUT_S = 3600.0
"""Largest wall-clock limit of one call (and of ``SandboxConfig.timeout_s``), in seconds:
a finite bound, so that no call can hold a worker for ever."""

DEFAULT_PRELOAD = (
    "math", "cmath", "itertools", "functools", "fractions", "decimal", "collections",
    "statistics", "random", "re", "string", "heapq", "bisect", "operator", "numbers",
    "json", "datetime", "numpy", "numpy.random", "numpy.linalg", "sympy", "mpmath", "scipy",
    "networkx",
)
"""Modules the warm parent imports once; missing optional ones are skipped and reported."""

CLEAN_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONHASHSEED": "0",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONIOENCODING": "utf-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
    "VECLIB_MAXIMUM_THREADS": "1",
    "MPLBACKEND": "Agg",
    "HOME": "/nonexistent",
}
"""The whole environment of the warm parent and its calls: nothing is inherited."""

NAMESPACE_ISOLATION = ("mountns", "readonly_fs", "pidns", "private_proc", "no_new_privs", "rlimits", "seccomp",
                       "clean_template")
"""Mechanisms full isolation has (``strict=True`` requires them): these, plus ``netns``
unless ``network=True``, plus ``uid_drop`` (as root) or ``caps_drop`` (otherwise), plus
control groups (``cgroup_v2`` or ``cgroup_v1``; they need root)."""

SKIPPABLE = ("pidns", "private_mounts", "privilege_drop", "rlimits", "seccomp", "template", "scratch_quota",
             "session_netns", "cgroups", "prefork")

WATCHDOG_GRACE_S = 10.0
"""How long past its timeout a started call may stay unanswered before the zygote is
declared hung, killed and replaced."""


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and pool settings of the local sandbox (per-call overrides in ``Sandbox.run``)."""

    timeout_s: float = 30.0
    """Wall-clock limit of one call, at most :data:`MAX_TIMEOUT_S`; the whole process tree
    is killed when it passes."""
    memory_mb: int = 2048
    """Memory each process of a call may allocate, in MiB, on top of the address space it
    inherits from the warm parent (RLIMIT_AS = that baseline + this; the baseline is in
    ``ExecutionResult.memory_baseline_bytes``)."""
    max_file_mb: int = 16
    """Largest file a call may write (RLIMIT_FSIZE), in MiB; also caps fetched files."""
    max_processes: int = 64
    """Processes one call may have at once (RLIMIT_NPROC under its own uid)."""
    max_output_bytes: int = 1 << 20
    """Cap on stdout and on stderr, each; a call that exceeds it is killed (``output_limit``)."""
    workers: int = 8
    """Calls running at once (stateless and session calls together); further calls wait in the queue."""
    demote_after_s: float | None = None
    """A stateless call still running after this many seconds runs its remaining time at
    the lowest CPU priority (nice 19 and its session's autogroup at 19, every process of
    it, those it starts later too), so a snippet that spins to its timeout takes only the
    CPU the short calls beside it leave; it cannot raise its priority again (RLIMIT_NICE
    0, no capabilities). Its wall timeout and CPU-time bound are unchanged. ``None`` (the
    default): never. For a sandbox that has the machine's CPU to itself (the sampler and
    trainer on a service or a GPU): beside a sampler that keeps every core busy (the local
    engine on a CPU) a demoted call gets almost no CPU and may run into its timeout."""
    session_memory_mb: int | None = None
    """Memory a session's interpreter may hold in all, in MiB on top of the baseline (a
    hard limit; each call may still grow it by only ``memory_mb``). ``None``: 4 x ``memory_mb``."""
    max_sessions: int = 256
    """Stateful interpreters (:meth:`Sandbox.session`) alive at once; the first call of
    one more session waits until another is closed. Session ``i`` runs as uid
    ``uid_base + workers + i`` (as root)."""
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    """Modules imported once in the warm parent, so calls get them for free."""
    network: bool = False
    """Allow network access (no network namespace). Off by default."""
    cpu_time_s: float | None = None
    """CPU-time limit (RLIMIT_CPU) per process and, with control groups, of all the call's
    processes and threads together (the warm parent kills the call past it: status
    ``timeout``); ``None`` = the call's timeout + 1 s."""
    scratch_mb: int = 1024
    """Size of the tmpfs that holds all calls' working directories together, in MiB."""
    call_scratch_mb: int = 256
    """Size of each call's and each session's own tmpfs (its working directory), in MiB:
    one call or session that fills its directory cannot fill anyone else's."""
    prefork: int = 8
    """Call runners, and session interpreters, each kept forked ahead of their work (at
    most one per call slot and per free session slot): already in their namespaces,
    control group and directory, waiting for a request, so that a call only hands its
    work to a ready child. 0: fork each child when its request comes."""
    uid_base: int = 1_950_000_000
    """When running as root, call slot ``i`` runs as uid/gid ``uid_base + i`` (no real user)."""
    traceback_frames: int = 3
    """Frames of the traceback kept in the observation the model sees."""
    strict: bool = False
    """Refuse to start unless namespace isolation (:data:`NAMESPACE_ISOLATION`) is in force."""
    start_timeout_s: float = 120.0
    """How long the warm parent may take to start and import ``preload``."""
    python: str = field(default_factory=lambda: sys.executable)
    """Interpreter of the warm parent (must be able to import ``preload``)."""
    benchmark_skip: tuple[str, ...] = ()
    """For ``bench/sandbox.py`` only, never in training: per-call mechanisms to leave out
    to measure their cost (``pidns``, ``private_mounts``, ``privilege_drop``, ``rlimits``,
    ``seccomp``, ``template``: fork each call from the warm parent itself, ``scratch_quota``,
    ``session_netns``, ``cgroups``, ``prefork``: fork each child when its request comes)."""

    def __post_init__(self) -> None:
        if self.demote_after_s is not None and not self.demote_after_s > 0:
            raise ValueError(f"SandboxConfig.demote_after_s must be > 0 or None, got {self.demote_after_s!r}")
        positive = ("timeout_s", "memory_mb", "max_file_mb", "max_processes", "max_output_bytes",
                    "workers", "max_sessions", "scratch_mb", "call_scratch_mb", "start_timeout_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.prefork < 0:
            raise ValueError(f"SandboxConfig.prefork must be >= 0, got {self.prefork!r}")
        check_timeout(self.timeout_s, "SandboxConfig.timeout_s")
        unknown = set(self.benchmark_skip) - set(SKIPPABLE)
        if unknown or (self.strict and self.benchmark_skip):
            raise ValueError(f"benchmark_skip: unknown {sorted(unknown)} or combined with strict=True")


def check_timeout(timeout_s: float, name: str = "timeout_s") -> float:
    """``timeout_s`` if it is a number of seconds in (0, :data:`MAX_TIMEOUT_S`], else ValueError."""
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s <= MAX_TIMEOUT_S):
        raise ValueError(f"{name} must be a number of seconds > 0 and <= {MAX_TIMEOUT_S:g}, got {timeout_s!r}")
    return float(timeout_s)


def missing_isolation(isolation: tuple[str, ...], network: bool = False) -> list[str]:
    """The mechanisms of full isolation (:data:`NAMESPACE_ISOLATION`) not in ``isolation``."""
    required = NAMESPACE_ISOLATION + (() if network else ("netns",))
    missing = [m for m in required if m not in isolation]
    if "uid_drop" not in isolation and "caps_drop" not in isolation:
        missing.append("uid_drop")
    if "cgroup_v1" not in isolation and "cgroup_v2" not in isolation:
        missing.append("cgroups")
    return missing


class SandboxUnavailableError(RuntimeError):
    """The warm parent could not be started (or lacks the isolation ``strict`` demands)."""


@dataclass
class _Pending:
    future: concurrent.futures.Future
    timeout_s: float
    memory_mb: int
    submitted: float
    started: float | None = None
    """Since when the watchdog times it: its submission for a call the warm parent starts
    at once, the "started" message for one it answered "queued" (None while it waits)."""


class _Zygote:
    """One warm-parent process and the threads that talk to it."""

    def __init__(self, cfg: SandboxConfig):
        self.cfg = cfg
        self.pending: dict[str, _Pending] = {}
        self.lock = threading.Lock()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # what the writer thread must write
        self.write_lock = threading.Lock()  # orders direct writes against the writer thread's
        self.queued = 0  # messages in the outbox or being written by the writer thread
        self.stdin_closed = False
        self.dead = False
        self.proc = subprocess.Popen(
            [cfg.python, "-s", "-B", *(["-P"] if sys.version_info >= (3, 11) else []),  # -P: no script dir
             str(ZYGOTE_SCRIPT), json.dumps(self._wire_config())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=CLEAN_ENV, cwd="/",
            start_new_session=True, close_fds=True)
        self.ready = self._await_ready()
        self.isolation = tuple(self.ready["isolation"])
        self.stdin_fd = self.proc.stdin.fileno()
        os.set_blocking(self.stdin_fd, False)  # a direct write never blocks its caller (see _send)
        threading.Thread(target=self._read_loop, name="sandbox-reader", daemon=True).start()
        threading.Thread(target=self._write_loop, name="sandbox-writer", daemon=True).start()

    def _wire_config(self) -> dict:
        c = self.cfg
        return {"workers": c.workers, "max_sessions": c.max_sessions, "demote_after_s": c.demote_after_s,
                "session_memory_mb": c.session_memory_mb or 4 * c.memory_mb, "preload": list(c.preload),
                "network": c.network,
                "scratch_mb": c.scratch_mb, "call_scratch_mb": c.call_scratch_mb, "uid_base": c.uid_base, "prefork": c.prefork, "max_processes": c.max_processes,
                "max_output_bytes": c.max_output_bytes, "max_file_bytes": c.max_file_mb << 20,
                "traceback_frames": c.traceback_frames, "base_dir": tempfile.gettempdir(),
                "benchmark_skip": list(c.benchmark_skip)}

    def _await_ready(self) -> dict:
        result: list = []
        reader = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(self.cfg.start_timeout_s)
        line = result[0] if result else b""
        if not line:  # the zygote died (the launcher then cleans up and exits) or hangs
            code = self.proc.poll() if reader.is_alive() else self.proc.wait()
            if code is None:
                self.terminate()
            why = f"exited with status {code}" if code is not None else "timed out"
            raise SandboxUnavailableError(f"sandbox warm parent {why} before it was ready")
        return json.loads(line)

    def submit(self, call_id: str, request: dict, pending: _Pending) -> None:
        with self.lock:
            if self.dead:
                raise BrokenPipeError("sandbox warm parent is gone")
            self.pending[call_id] = pending
        self._send(request)

    def cancel(self, call_id: str) -> None:
        if not self.dead:
            self._send({"op": "cancel", "id": call_id})

    def _send(self, msg: dict) -> None:
        """Write ``msg`` to the warm parent from the calling thread when nothing is waiting
        for the writer thread and the pipe takes it all at once (the common case: one hop
        less per call); otherwise, or for what the pipe did not take, the writer thread
        writes it, in order. Never blocks on a full pipe. A closed or broken pipe drops it:
        the reader then finds the warm parent gone and answers every pending call."""
        data = (json.dumps(msg) + "\n").encode()
        with self.write_lock:
            if self.stdin_closed:
                return
            if not self.queued:
                try:
                    data = data[os.write(self.stdin_fd, data):]
                except BlockingIOError:
                    pass
                except OSError:
                    return
                if not data:
                    return
            self.queued += 1
            self.outbox.put(data)

    def _write_loop(self) -> None:
        while not self.dead:
            try:
                data = self.outbox.get(timeout=0.5)
            except queue.Empty:
                self._watchdog()
                continue
            if data is None:
                break
            try:
                _write_all(self.stdin_fd, data)
            except OSError:
                break
            finally:
                with self.write_lock:
                    self.queued -= 1
            self._watchdog()
        self._close_stdin()

    def _watchdog(self) -> None:
        now = time.monotonic()
        with self.lock:
            hung = [p for p in self.pending.values()
                    if p.started is not None and now - p.started > p.timeout_s + WATCHDOG_GRACE_S]
        if hung:
            self.kill()

    def _read_loop(self) -> None:
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:  # cannot happen unless the warm parent is broken: replace it
                self.kill()
                break
            with self.lock:
                pending = self.pending.get(msg["id"])
                if pending is not None and msg["op"] == "queued":  # not running: not timed yet
                    pending.started = None
                elif pending is not None and msg["op"] == "started":  # it ran after waiting
                    pending.started = time.monotonic()
                elif msg["op"] == "result":
                    self.pending.pop(msg["id"], None)
            if pending is not None and msg.get("closed"):
                _resolve(pending, lambda: None)
            elif pending is not None and msg["op"] == "result" and not msg.get("cancelled"):
                _resolve(pending, lambda: build_result(msg, pending.timeout_s, pending.memory_mb, self.cfg))
        self._die()

    def _die(self) -> None:
        with self.lock:
            self.dead = True
            orphans, self.pending = list(self.pending.values()), {}
        self.outbox.put(None)
        code = self.proc.wait()
        left = remove_leftover_cgroups(self.ready.get("cgroup_dirs") or [])
        if left:
            log.warning("sandbox: could not remove its control groups %s", left)
        for pending in orphans:
            _resolve(pending, lambda: sandbox_error(f"the sandbox worker died (exit status {code}); "
                                                   "it is replaced for the next call", self.isolation))
        _remove_empty_dir(self.ready.get("host_dir"))

    def _close_stdin(self) -> None:
        with self.write_lock:  # no direct write can reach a closed (and reused) fd number
            self.stdin_closed = True
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def kill(self) -> None:
        """Kill the warm parent; the kernel then kills every call it was running."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def terminate(self, timeout_s: float = 5.0) -> None:
        """SIGTERM the launcher (it kills the zygote and removes its mount point), else SIGKILL."""
        try:
            self.proc.terminate()
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()

    def close(self, timeout_s: float = 5.0) -> None:
        self.outbox.put(None)  # EOF on its stdin: the zygote kills running calls and exits
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.terminate()


def _describe(zygote: _Zygote, missing: list[str]) -> str:
    """The isolation line logged at start (and refused with under ``strict``)."""
    in_force = ", ".join(zygote.isolation) or "nothing"
    if not missing:
        return f"sandbox isolation: full ({in_force})"
    warnings = "; ".join(zygote.ready.get("warnings") or ()) or "none"
    return (f"sandbox isolation: REDUCED, missing {', '.join(missing)} (in force: {in_force}; warnings: "
            f"{warnings}); --sandbox-strict refuses to run like this")


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to the non-blocking ``fd``, waiting while the pipe is full."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            select.select([], [fd], [], 0.5)


def _resolve(pending: _Pending, make_result) -> None:
    if not pending.future.done():
        try:
            pending.future.set_result(make_result())
        except concurrent.futures.InvalidStateError:  # cancelled meanwhile
            pass


class Sandbox:
    """A pool of warm, isolated Python executors (see :mod:`retool.sandbox`).

    Starts lazily on the first call (or ``start()``); use as a context manager, sync or
    async, or call ``close()``/``aclose()``. ``run`` (asyncio) and ``run_sync`` (threads)
    may be mixed freely; at most ``config.workers`` calls run at once, the rest queue.
    """

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        self._zygote: _Zygote | None = None
        self._start_lock = threading.Lock()
        self._ids = itertools.count()
        self._metrics = SandboxMetrics()
        self._closed = False
        self._finalizer = weakref.finalize(self, _kill_quietly, [None])

    # ---- lifecycle

    def start(self) -> tuple[str, ...]:
        """Start the warm parent now (idempotent); return the isolation mechanisms in force."""
        return self._ensure_zygote().isolation

    @property
    def isolation(self) -> tuple[str, ...]:
        """Mechanisms in force in the current warm parent (starts it if needed)."""
        return self.start()

    def _ensure_zygote(self) -> _Zygote:
        zygote = self._zygote
        if zygote is not None and not zygote.dead:
            return zygote
        with self._start_lock:
            if self._closed:
                raise RuntimeError("Sandbox is closed")
            if self._zygote is None or self._zygote.dead:
                if self._zygote is not None:
                    self._metrics.record_restart()
                self._zygote = _Zygote(self.config)
                self._finalizer.detach()
                self._finalizer = weakref.finalize(self, _kill_quietly, [self._zygote])
                self._check_strict(self._zygote)
            return self._zygote

    def _check_strict(self, zygote: _Zygote) -> None:
        missing = missing_isolation(zygote.isolation, self.config.network)
        if self.config.strict and missing:
            zygote.close()
            self._zygote = None
            raise SandboxUnavailableError(f"strict sandbox: {_describe(zygote, missing)}; run as root or "
                                          "where user namespaces are allowed, or drop the strict setting")
        log.log(logging.WARNING if missing else logging.INFO, "%s", _describe(zygote, missing))

    def isolation_report(self) -> str:
        """One line: the isolation mechanisms in force, and what is missing (starts the sandbox)."""
        zygote = self._ensure_zygote()
        return _describe(zygote, missing_isolation(zygote.isolation, self.config.network))

    @property
    def isolation_degraded(self) -> bool:
        """True when the running warm parent lacks part of full isolation (see
        :func:`missing_isolation`); False before it has started."""
        zygote = self._zygote
        return zygote is not None and bool(missing_isolation(zygote.isolation, self.config.network))

    def close(self) -> None:
        """Stop the warm parent; running calls are killed and answered ``sandbox_error``."""
        with self._start_lock:
            self._closed = True
            zygote, self._zygote = self._zygote, None
        if zygote is not None:
            zygote.close()
        self._finalizer.detach()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # ---- calls

    async def run(self, code: str, *, timeout_s: float | None = None, memory_mb: int | None = None,
                  stdin: str | None = None, files: dict[str, bytes] | None = None,
                  fetch_files=(), auto_print: bool = True) -> ExecutionResult:
        """Run ``code`` in a fresh isolated process; never raises for anything the code does.

        The code runs as ``python main.py`` runs that file in the call's working
        directory; ``auto_print`` (the model's tool) also shows the value of a final bare
        expression, as an interactive session would. ``memory_mb`` limits what the
        snippet allocates on top of what the warm parent preloaded
        (``result.memory_baseline_bytes``).

        ``stdin``: ``None`` gives the process an empty stdin; a string is fed to it.
        ``files``: relative path -> bytes written into the call's empty working directory
        first; ``fetch_files``: relative paths read back afterwards into ``result.files``
        (missing ones are left out). Bad arguments raise ``ValueError``/``TypeError``.
        """
        zygote = self._zygote
        if zygote is None or zygote.dead:
            await asyncio.to_thread(self._ensure_zygote)
        future = self._submit(code, timeout_s, memory_mb, stdin, files, fetch_files, auto_print)
        return await asyncio.wrap_future(future)

    def run_sync(self, code: str, *, timeout_s: float | None = None, memory_mb: int | None = None,
                 stdin: str | None = None, files: dict[str, bytes] | None = None,
                 fetch_files=(), auto_print: bool = True) -> ExecutionResult:
        """Blocking form of :meth:`run` for plain threads (not from inside an event loop)."""
        return self._submit(code, timeout_s, memory_mb, stdin, files, fetch_files, auto_print).result()

    def session(self) -> Session:
        """A new stateful interpreter (see :class:`Session`); it starts at its first call."""
        return Session(self, f"s{next(self._ids)}")

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """``sandbox/*`` metrics since the last reset (see :class:`SandboxMetrics`), plus
        ``sandbox/isolation_degraded``: 1.0 while the sandbox runs without full isolation."""
        return {**self._metrics.snapshot(reset), "sandbox/isolation_degraded": float(self.isolation_degraded)}

    def record_outcomes(self, outcomes: Sequence[tuple[ExecutionResult, float]]) -> None:
        """Count calls that ran elsewhere — e.g. in the finished groups an interrupted run
        of this step left — in the current window, as ``(result, latency_s)`` pairs."""
        for result, latency_s in outcomes:
            self._metrics.record(result, latency_s)

    def _submit(self, code, timeout_s, memory_mb, stdin, files, fetch_files,
                auto_print=True, session: Session | None = None) -> concurrent.futures.Future:
        timeout_s = self.config.timeout_s if timeout_s is None else float(timeout_s)
        memory_mb = self.config.memory_mb if memory_mb is None else int(memory_mb)
        call_id = str(next(self._ids))
        request = self._request(call_id, code, timeout_s, memory_mb, stdin, files, fetch_files)
        request["auto_print"] = bool(auto_print)
        pending = _Pending(concurrent.futures.Future(), timeout_s, memory_mb, time.monotonic())
        pending.started = pending.submitted  # the warm parent says "queued" if it cannot start it at once
        pending.future.add_done_callback(lambda f: self._on_done(f, pending, call_id))
        zygote = self._ensure_zygote()
        if session is not None:
            request.update(session._request_fields(zygote))
        try:
            zygote.submit(call_id, request, pending)
        except BrokenPipeError as exc:
            message = str(exc)
            _resolve(pending, lambda: sandbox_error(message, zygote.isolation))
        return pending.future

    def _on_done(self, future: concurrent.futures.Future, pending: _Pending, call_id: str) -> None:
        if future.cancelled():
            zygote = self._zygote
            if zygote is not None:
                zygote.cancel(call_id)
            return
        self._metrics.record(future.result(), time.monotonic() - pending.submitted)

    def _request(self, call_id, code, timeout_s, memory_mb, stdin, files, fetch_files) -> dict:
        if not isinstance(code, str):
            raise TypeError(f"code must be str, got {type(code).__name__}")
        check_timeout(timeout_s)
        if not memory_mb > 0:
            raise ValueError(f"memory_mb must be > 0, got {memory_mb!r}")
        if stdin is not None and not isinstance(stdin, str):
            raise TypeError(f"stdin must be str or None, got {type(stdin).__name__}")
        files = files or {}
        for path, data in files.items():
            check_relative_path(path)
            if posixpath.normpath(path) == SCRIPT_NAME:
                raise ValueError(f"files may not contain {SCRIPT_NAME!r}: the snippet itself runs as that file")
            if not isinstance(data, (bytes, bytearray)):
                raise TypeError(f"files[{path!r}] must be bytes, got {type(data).__name__}")
        fetch = [check_relative_path(p) for p in fetch_files]
        cpu_s = self.config.cpu_time_s or timeout_s + 1.0
        return {"op": "run", "id": call_id, "code": code, "timeout_s": timeout_s, "memory_mb": memory_mb,
                "cpu_s": cpu_s, "stdin": stdin, "fetch_files": fetch,
                "files": {p: base64.b64encode(bytes(d)).decode() for p, d in files.items()}}


class Session:
    """One stateful interpreter of a :class:`Sandbox`, for one trajectory (or one client).

    Its calls run one after the other in the same globals, so ``x = solve()`` in one call
    and ``print(x)`` in the next works, as in a notebook. The interpreter is forked from
    the warm parent at the first call, with exactly the isolation and limits of a
    stateless call (namespaces, its own uid, rlimits, output caps); limits apply per
    call. After each call, every process the call started and left running is killed.
    A call that times out, runs out of memory or output, or ends the process (``os._exit``)
    ends the interpreter: the next call runs in a fresh one, and its result's
    ``state_lost`` and observation say so. ``close()``/``aclose()`` (or ``async with``)
    kill the interpreter and everything it started, and return once they are gone.

    Not the same as a stateless call: no ``stdin``, ``files`` or ``fetch_files``; files
    the calls write stay in the session's directory until it ends; daemon threads a
    call leaves keep running (in the interpreter, under its CPU limit) until the session ends.
    """

    def __init__(self, sandbox: Sandbox, session_id: str):
        self.sandbox = sandbox
        self.id = session_id
        self._zygote: _Zygote | None = None  # the warm parent its interpreter lives in
        self._closed = False

    def _request_fields(self, zygote: _Zygote) -> dict:
        """What a call request of this session carries (``state_lost`` when the warm parent
        that held its interpreter has been replaced since the last call)."""
        if self._closed:
            raise RuntimeError(f"session {self.id} is closed")
        fields = {"session": self.id}
        if self._zygote is not None and self._zygote is not zygote:
            fields["state_lost"] = "sandbox_restarted"
        self._zygote = zygote
        return fields

    async def run(self, code: str, *, timeout_s: float | None = None, memory_mb: int | None = None,
                  auto_print: bool = True) -> ExecutionResult:
        """Run ``code`` in this session's interpreter (see :meth:`Sandbox.run` for the limits)."""
        zygote = self.sandbox._zygote
        if zygote is None or zygote.dead:
            await asyncio.to_thread(self.sandbox._ensure_zygote)
        future = self.sandbox._submit(code, timeout_s, memory_mb, None, None, (), auto_print, session=self)
        return await asyncio.wrap_future(future)

    def run_sync(self, code: str, *, timeout_s: float | None = None, memory_mb: int | None = None,
                 auto_print: bool = True) -> ExecutionResult:
        """Blocking form of :meth:`run` for plain threads."""
        return self.sandbox._submit(code, timeout_s, memory_mb, None, None, (), auto_print, session=self).result()

    def _send_close(self) -> concurrent.futures.Future | None:
        """Ask the warm parent to end the interpreter (sent at once, even from a cancelled task)."""
        zygote, self._zygote = self._zygote, None
        self._closed = True
        if zygote is None or zygote.dead:
            return None
        pending = _Pending(concurrent.futures.Future(), 0.0, 0, time.monotonic())
        call_id = str(next(self.sandbox._ids))
        try:
            zygote.submit(call_id, {"op": "close_session", "id": call_id, "session": self.id}, pending)
        except BrokenPipeError:
            return None
        return pending.future

    def close(self) -> None:
        """End the interpreter and every process it started; idempotent."""
        future = self._send_close()
        if future is not None:
            future.result()

    async def aclose(self) -> None:
        future = self._send_close()
        if future is not None:
            await asyncio.shield(asyncio.wrap_future(future))

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_relative_path(path: str) -> str:
    """Return ``path`` if it is a plain relative path inside the call directory, else raise."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ValueError(f"file path must be a non-empty string, got {path!r}")
    norm = posixpath.normpath(path)
    if posixpath.isabs(path) or norm == "." or norm.split("/")[0] == ".." or ".." in path.split("/"):
        raise ValueError(f"file path must be relative and stay inside the working directory: {path!r}")
    return path


def _remove_empty_dir(path: str | None) -> None:
    """Remove the warm parent's (by now empty) mount point; never anything with content."""
    if path:
        try:
            os.rmdir(path)
        except OSError:
            pass


def _kill_quietly(holder) -> None:
    """Finalizer of an unclosed Sandbox: SIGTERM the launcher, which kills the zygote
    (and with it every call) and removes its mount point; does not wait."""
    zygote = holder[0] if isinstance(holder, list) else holder
    if zygote is not None and zygote.proc.poll() is None:
        zygote.proc.terminate()


# ---------------------------------------------------------------- results


def sandbox_error(message: str, isolation: tuple[str, ...] = ()) -> ExecutionResult:
    """The result of a call the sandbox itself failed to run."""
    return ExecutionResult(status=ExecStatus.SANDBOX_ERROR, stderr=message,
                           observation=f"Sandbox error: {message}", isolation=isolation)


@dataclass(frozen=True)
class CallReply:
    """The warm parent's ``result`` message for one call, read once at the edge
    (:meth:`from_message`); every other function here reads its fields, not the dict."""

    isolation: tuple[str, ...] = ()
    sandbox_error: str | None = None
    """The sandbox itself failed to run the call (its message)."""
    setup_failed: str | None = None
    """The call's isolation could not be set up (what failed)."""
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    signal: int | None = None
    killed: str | None = None
    """Why the warm parent killed the call: ``timeout``, ``cpu_time`` or ``output_limit``."""
    exc_type: str | None = None
    short_tb: str | None = None
    """The last lines of the code's own traceback, as the model should see them."""
    wall_s: float = 0.0
    cpu_s: float = 0.0
    peak_rss_bytes: int | None = None
    memory_baseline_bytes: int | None = None
    state_lost: str | None = None
    ended_interpreter: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)

    @classmethod
    def from_message(cls, msg: dict[str, Any]) -> CallReply:
        """The record of a ``result`` message (stdout, stderr and files arrive base64-encoded)."""
        setup_failed = msg.get("setup_failed")
        if setup_failed and not isinstance(setup_failed, str):
            setup_failed = "call set-up failed"
        return cls(
            isolation=tuple(msg.get("isolation", ())), sandbox_error=msg.get("sandbox_error"),
            setup_failed=setup_failed or None, stdout=_decoded(msg.get("stdout", "")),
            stderr=_decoded(msg.get("stderr", "")), exit_code=msg.get("exit_code"), signal=msg.get("signal"),
            killed=msg.get("killed"), exc_type=msg.get("exc_type"), short_tb=msg.get("short_tb") or None,
            wall_s=msg.get("wall_s", 0.0), cpu_s=msg.get("cpu_s", 0.0), peak_rss_bytes=msg.get("peak_rss_bytes"),
            memory_baseline_bytes=msg.get("memory_baseline_bytes"), state_lost=msg.get("state_lost") or None,
            ended_interpreter=msg.get("ended_interpreter") or None,
            files={name: base64.b64decode(data) for name, data in msg.get("files", {}).items()})


def _decoded(data: str) -> str:
    return base64.b64decode(data).decode("utf-8", "replace")


def classify(reply: CallReply) -> ExecStatus:
    """The status of a finished call from the warm parent's reply (see ``ExecStatus``)."""
    if reply.setup_failed:
        return ExecStatus.SANDBOX_ERROR
    if reply.killed in ("timeout", "cpu_time") or reply.signal == signal.SIGXCPU:
        return ExecStatus.TIMEOUT
    if reply.killed == "output_limit":
        return ExecStatus.OUTPUT_LIMIT
    if reply.exc_type == "MemoryError" or _looks_out_of_memory(reply.signal, reply.stderr):
        return ExecStatus.MEMORY
    if reply.exit_code == 0 and reply.signal is None:
        return ExecStatus.OK
    return ExecStatus.ERROR


def _looks_out_of_memory(sig: int | None, stderr: str) -> bool:
    if sig is None:
        return False
    if sig == signal.SIGKILL:  # not killed by us: the kernel's OOM killer
        return True
    tail = stderr[-2000:]
    return any(s in tail for s in ("MemoryError", "Cannot allocate memory", "bad_alloc", "out of memory"))


def build_result(msg: dict[str, Any], timeout_s: float, memory_mb: int, cfg: SandboxConfig) -> ExecutionResult:
    """Turn the warm parent's ``result`` message into an :class:`ExecutionResult` with its observation."""
    reply = CallReply.from_message(msg)
    if reply.sandbox_error is not None:
        return sandbox_error(reply.sandbox_error, reply.isolation)
    if reply.setup_failed:
        return sandbox_error(f"could not isolate the call: {reply.setup_failed.strip()}", reply.isolation)
    status = classify(reply)
    shown = observation(status, reply, timeout_s, memory_mb, cfg)
    if reply.state_lost:
        shown = state_lost_note(reply.state_lost) + shown
    if reply.ended_interpreter:
        shown = _join(shown, INTERPRETER_ENDED)
    return ExecutionResult(
        status=status, stdout=reply.stdout, stderr=reply.stderr, exit_code=reply.exit_code, signal=reply.signal,
        wall_s=reply.wall_s, cpu_s=reply.cpu_s, peak_rss_bytes=reply.peak_rss_bytes,
        truncated=status is ExecStatus.OUTPUT_LIMIT, memory_baseline_bytes=reply.memory_baseline_bytes,
        observation=shown, isolation=reply.isolation, state_lost=reply.state_lost, files=reply.files)


INTERPRETER_ENDED = "The interpreter was stopped: variables and functions from earlier calls are lost."
"""Appended to the observation of a session call that ended its interpreter."""

_LOST_BECAUSE = {
    "timeout": "it timed out", "memory": "it ran out of memory", "output_limit": "it printed too much",
    "cpu_time": "it used too much CPU time", "exited": "the code ended the process",
    "cancelled": "it was cancelled", "sandbox_restarted": "the sandbox restarted",
    "processes": "it kept starting processes after the call ended",
}


def state_lost_note(reason: str) -> str:
    """The first line of a session call that ran in a fresh interpreter (the old one ended)."""
    why = _LOST_BECAUSE.get(reason, "the sandbox restarted it")
    return (f"[Note: an earlier call ended the interpreter ({why}); this call ran in a fresh one: "
            "variables, functions and imports from earlier calls are gone.]\n")


def observation(status: ExecStatus, reply: CallReply, timeout_s: float, memory_mb: int, cfg: SandboxConfig) -> str:
    """What the model sees: stdout, then what went wrong (if anything), in a few lines."""
    if status is ExecStatus.OK:
        tail = reply.stderr
    elif status is ExecStatus.TIMEOUT:
        tail = f"Execution timed out after {timeout_s:g} s"
    elif status is ExecStatus.OUTPUT_LIMIT:
        tail = f"[output truncated: more than {cfg.max_output_bytes} bytes; the process was stopped]"
    elif status is ExecStatus.SANDBOX_ERROR:
        tail = f"Sandbox error: {reply.stderr.strip() or 'the sandbox could not run this call'}"
    elif reply.short_tb:
        tail = reply.short_tb
    elif status is ExecStatus.MEMORY:
        tail = f"MemoryError: the program exceeded the memory limit of {memory_mb} MB"
    else:
        tail = _describe_failure(reply)
    return _join(reply.stdout, tail)


def _describe_failure(reply: CallReply) -> str:
    sig = reply.signal
    if sig is not None:
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        return _join(reply.stderr[-2000:], f"Process killed by signal {name}")
    return reply.stderr[-2000:] or f"Process exited with code {reply.exit_code}"


def _join(head: str, tail: str) -> str:
    if not tail:
        return head
    if head and not head.endswith("\n"):
        head += "\n"
    return head + tail
