"""One thread's OpenMP team at a time: torch's products on a worker thread at full speed.

torch on Linux runs its parallel CPU work (oneDNN products, attention, large element-wise
ops) in OpenMP regions of GNU libgomp. libgomp keeps a team of worker threads for every
thread that has started a region, and while the threads of all teams together outnumber
the CPUs, every team's workers stop spinning between regions almost at once (libgomp's
"throttled" spin of 100 iterations) and each region wakes them through the kernel. On a
2-core machine the sampler decodes on a worker thread (``asyncio.to_thread``) after the
main thread has loaded the model and trained, so two teams exist and each of a decode
step's ~180 regions cost ~60 µs more: a 200k-element add took 75 µs on the worker thread
against 11 µs on the main thread, the lean step's products 1.8x their time
(``bench/openmp_teams.py``; measured in ``docs/benchmarks.md``).

:func:`release_team` hands the calling thread's team back (OpenMP 5's
``omp_pause_resource_all(omp_pause_hard)``, which libgomp implements per thread: it frees
the caller's own team and nothing else; the next region builds a new one, a few thread
starts). :func:`on_worker_thread` runs a function on a worker thread the way the sampler
needs it: the calling thread's team released first, the worker's own released after, so
only the thread doing the work holds a team.

Only libgomp is touched (found among the process's mapped libraries); with another OpenMP
runtime (LLVM's libomp, Intel's) or none, both do nothing: their pause routines act on the
whole runtime, not on one thread.
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

OMP_PAUSE_HARD = 2
"""``omp_pause_hard`` of OpenMP 5's ``omp_pause_resource_t``."""

T = TypeVar("T")


_FOUND: list[Any] = []
"""The libgomp handle (or ``None`` when one is mapped but has no pause routine), once found."""


def _libgomp() -> Any:
    """The libgomp this process has loaded (torch's own copy, usually), or ``None``. Looked
    up again on every call until a libgomp is mapped (torch may be imported later)."""
    if not _FOUND:
        path = _mapped_libgomp()
        if path is None:
            return None
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            lib = None
        _FOUND.append(lib if lib is not None and hasattr(lib, "omp_pause_resource_all") else None)
    return _FOUND[0]


def _mapped_libgomp() -> str | None:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and Path(fields[5]).name.startswith("libgomp"):
            return fields[5]
    return None


def release_team() -> bool:
    """Free the calling thread's OpenMP team (libgomp only); ``True`` when it was released
    or there was none, ``False`` when this process has no libgomp to ask. Call it outside
    any parallel region (from Python code it always is)."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_HARD) == 0


def _then_release(fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    finally:
        release_team()


async def on_worker_thread(fn: Callable[..., T], *args: Any) -> T:
    """``await asyncio.to_thread(fn, *args)`` with one OpenMP team at a time: the calling
    thread's team released before, the worker thread's own after ``fn`` returns or raises."""
    release_team()
    return await asyncio.to_thread(_then_release, fn, *args)
