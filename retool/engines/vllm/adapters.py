"""Which LoRA adapters a vLLM server has loaded, and who still needs each of them.

With ``retool train --max-staleness K`` the rollout of step ``t + K`` samples with the
adapter of version ``t`` while the trainer makes ``t + 1 .. t + K``: an adapter must stay
on the server until nothing can use it any more. :class:`AdapterLeases` counts, per
adapter name, the holders that may still send a request naming it:

- the training client, for its newest adapter (it may still hand out samplers of it),
  until a newer one is loaded;
- every :class:`~retool.engines.vllm.client.VLLMSamplingClient` handed out for it, until
  that client is closed or garbage-collected;
- every request in flight that names it, until it has answered or failed.

When the count reaches 0 the adapter is unloaded (``POST /v1/unload_lora_adapter``) and
its folder removed. Every method is thread-safe (rollouts run in threads); the HTTP call
happens outside the lock.

What the pinned vLLM (0.32 CPU) does otherwise, found against the real server
(``tests/test_vllm_staleness.py``): a request naming an adapter that was unloaded is
refused with 404 (the model does not exist), so unloading early breaks a sampler; more
adapters loaded than ``--max-loras`` is accepted (the server keeps them registered and
schedules at most ``--max-loras`` distinct ones per batch), so ``--max-loras K + 1`` is
what lets every version in use share a batch rather than a limit that would refuse one.
"""

from __future__ import annotations

import shutil
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class AdapterGoneError(RuntimeError):
    """A request named an adapter after its last holder had released it (a bug in the caller)."""


@dataclass
class _Entry:
    folder: Path | None
    holders: int


class AdapterLeases:
    """Reference counts of the adapters loaded on one server (see the module docstring)."""

    def __init__(self, unload: Callable[[str], None]) -> None:
        """``unload(name)`` removes an adapter from the server (it may raise ``RuntimeError``/``OSError``)."""
        self._unload = unload
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.RLock()  # a finalizer may release while this thread holds it
        self.unloaded: list[str] = []
        """Names unloaded so far, in order."""
        self.unload_failures = 0

    def add(self, name: str, folder: Path | None) -> None:
        """Record an adapter the server has just loaded, with one holder (its loader)."""
        with self._lock:
            if name in self._entries:
                raise ValueError(f"adapter {name} is already loaded")
            self._entries[name] = _Entry(folder, 1)

    def acquire(self, name: str) -> None:
        """One more holder of ``name``; :class:`AdapterGoneError` once it has been unloaded."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                raise AdapterGoneError(f"engine vllm: adapter {name} was already unloaded (every sampler of it "
                                       "had been closed)")
            entry.holders += 1

    def release(self, name: str) -> None:
        """One holder fewer; the last one unloads the adapter and removes its folder. A
        name :meth:`close` already unloaded is ignored (a client dropped after the run)."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return
            entry.holders -= 1
            if entry.holders > 0:
                return
            del self._entries[name]
        self._drop(name, entry.folder)

    def loaded(self) -> tuple[str, ...]:
        """The names still loaded (held by someone), oldest first."""
        with self._lock:
            return tuple(self._entries)

    def holders(self, name: str) -> int:
        with self._lock:
            entry = self._entries.get(name)
            return entry.holders if entry is not None else 0

    def close(self) -> None:
        """Unload every adapter still loaded, whoever holds it (the run is over)."""
        with self._lock:
            entries, self._entries = self._entries, {}
        for name, entry in entries.items():
            self._drop(name, entry.folder)

    def _drop(self, name: str, folder: Path | None) -> None:
        try:
            self._unload(name)
        except (RuntimeError, OSError) as err:  # a server that died or was stopped first: nothing to free
            self.unload_failures += 1
            print(f"vllm: could not unload adapter {name}: {err}", file=sys.stderr)
        else:
            self.unloaded.append(name)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
