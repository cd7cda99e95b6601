"""Handing freed memory back to the system: glibc's malloc arenas and ``malloc_trim``.

A CPU sampler allocates and frees large tensors (KV caches of a batch, logits of a
prefill) from several threads (the asyncio worker thread, torch's intra-op threads).
glibc gives each thread its own malloc arena and keeps freed memory inside it, so the
process's resident memory grows towards the sum of every arena's high-water mark and
stays there, long after the tensors are gone. :func:`limit_arenas` caps the number of
arenas (``mallopt(M_ARENA_MAX)``, what ``MALLOC_ARENA_MAX`` does at start-up) and
:func:`release_free_memory` returns the free pages of every arena to the system
(``malloc_trim(0)``); the sampler calls both (the second after every batch), and the
trainer trims after every layer of a training forward (:func:`trim_after_each`).

Not covered: other C libraries (musl, macOS): both functions then do nothing and
return ``False``; memory that is still referenced (the KV store, the model).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
from collections.abc import Iterable, Iterator
from typing import Any

M_ARENA_MAX = -8
"""glibc's ``mallopt`` parameter for the most arenas (``malloc.h``)."""


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def limit_arenas(arenas: int = 2) -> bool:
    """Let glibc create at most ``arenas`` malloc arenas from now on; ``False`` when the
    C library is not glibc."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(M_ARENA_MAX, arenas))


def release_free_memory() -> bool:
    """Return the free memory of every malloc arena to the system; ``False`` when the C
    library is not glibc or nothing could be returned."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


@contextlib.contextmanager
def trim_after_each(modules: Iterable[Any]) -> Iterator[None]:
    """Within the block, :func:`release_free_memory` after every forward of each of
    ``modules`` (torch modules). glibc places a freed block's successor anywhere in its
    arenas' free space, so over a training forward the short-lived tensors of successive
    layers touch most of that space (a gigabyte after the sampler's turn) though few are
    alive at once; trimming after each layer hands those pages back before the next layer
    touches others. (An activation-checkpointed layer's recomputation in the backward stops
    once it has what the backward needs, before the hook.) Nothing is registered, and
    nothing happens, when the C library is not glibc."""
    if _glibc() is None:
        yield
        return

    def trim(*_: Any) -> None:  # a hook that returns something replaces the module's output
        release_free_memory()

    handles = [m.register_forward_hook(trim) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
