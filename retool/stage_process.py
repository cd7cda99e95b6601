"""Run one pipeline stage in a fresh process and get its result back (``in_own_process``).

``retool demo`` runs each stage this way. Every stage loads its own model and engine; run
one after another in one process, what a finished stage leaves resident — heap pages the
allocator keeps rather than returning, oneDNN's packed weights and primitive caches,
Python objects of the stage's engine — stays under the next stage: on the 2-core
reference machine the demo's evals peaked 0.4–0.5 GiB above the same eval run alone. A
process per stage hands all of it back to the system when the stage ends.

The process is *spawned* (a new interpreter), not forked: the caller has threads (the
memory sampler), and a fork copies none of them but every lock they might hold. The
function and its arguments are pickled, so the function must be importable by name (a
module-level function). What it raises comes back as itself — a ``ConfigError`` stays one
error line — with the stage's traceback attached as its ``__cause__``; a stage process
that dies without an answer (killed, out of memory) raises ``StageDied``, one line naming
the stage and how its process ended. A stage process ends when the command does, however
the command ends (``kill``, a crash; not only Ctrl-C, which reaches the whole group): it
asks the kernel for SIGTERM when its parent goes (``PR_SET_PDEATHSIG``; elsewhere a thread
watches the parent's pid), so that no orphaned stage keeps training with nobody to answer.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class StageDied(RuntimeError):
    """A stage's process ended without a result (killed by a signal, or exited early)."""


class StageTraceback(Exception):
    """The traceback of an exception raised in a stage's process (attached as ``__cause__``)."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


PR_SET_PDEATHSIG = 1
"""``prctl`` option: the signal this process gets when its parent ends (``linux/prctl.h``)."""


def die_with_parent(parent: int) -> None:
    """Make this process get SIGTERM when its parent (pid ``parent``) ends: the kernel's
    ``PR_SET_PDEATHSIG`` on Linux, else a daemon thread that checks the parent's pid every
    second. A parent that is gone already ends this process now."""
    armed = False
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        armed = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
    if not armed:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    if os.getppid() != parent:  # it ended before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def _stage_main(connection: Any, function: Callable[..., Any], args: tuple[Any, ...], parent: int) -> None:
    die_with_parent(parent)
    try:
        answer: tuple[str, Any, str] = ("result", function(*args), "")
    except BaseException as err:  # noqa: BLE001 -- every failure goes back to the caller
        answer = ("error", err, traceback.format_exc())
    try:
        connection.send(answer)
    except Exception as err:  # the result or the exception does not pickle
        what = "its result" if answer[0] == "result" else f"{type(answer[1]).__name__}: {answer[1]}"
        connection.send(("error", RuntimeError(f"{what} (and it could not be sent back: {err})"), answer[2]))
    finally:
        connection.close()


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is None:
        return "did not end"
    if exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else str(-exitcode)
        hint = " (the kernel's out-of-memory killer sends it)" if -exitcode == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {exitcode}"


def in_own_process(name: str, function: Callable[..., T], *args: Any) -> T:
    """``function(*args)``, run in a new spawned process; ``name`` names the stage in errors.

    Returns what it returns; raises what it raises (traceback of the stage's process as the
    ``__cause__``); raises ``StageDied`` if the process ends without answering. An interrupt
    (Ctrl-C) reaches the stage's process too, and it is waited for before the interrupt goes
    on, so no stage outlives the command.
    """
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_stage_main, args=(send, function, args, os.getpid()), name=f"retool {name}")
    process.start()
    send.close()  # the parent's copy: recv() sees EOF once the child's is gone
    try:
        try:
            kind, value, remote_traceback = receive.recv()
        except (EOFError, OSError, pickle.UnpicklingError):
            process.join()
            raise StageDied(f"the {name} stage's process {_how_it_ended(process.exitcode)} before it "
                            "finished") from None
    finally:
        receive.close()
        process.join(timeout=30)
        if process.is_alive():
            process.terminate()
            process.join()
    if kind == "result":
        return value
    raise value from StageTraceback(remote_traceback)
