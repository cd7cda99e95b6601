"""The peak memory of this process and every process it started (``PeakRSS``).

``retool demo`` reports it at the end: the sandbox's worker processes and the grader
pool run beside the model, so the process's own peak (``resource.getrusage``) would
miss them. A daemon thread reads the process tree every ``interval_s`` seconds (psutil)
and keeps two peaks:

- the summed **PSS** (proportional set size: a page shared by n processes counts 1/n in
  each), the tree's real footprint: forked sandbox children share the copy-on-write
  pages of their warm parent (interpreter, numpy, sympy), which a sum of RSS counts once
  per child. A process whose PSS cannot be read (another user's, e.g. a sandbox child
  that dropped its uid) counts with its RSS, and ``unreadable`` says how many did;
- the summed **RSS**, the upper bound the first version of this module reported.

The exact peak of the largest single process (``ru_maxrss`` of this process and of the
children it has waited for, such as the demo's finished stage processes) is reported too,
and ``peak_bytes`` (what the demo prints first and records as ``peak_pss_mb``) is the
larger of the PSS peak and that floor, which the sampling cannot miss. Inside ``with
peak.stage(name)`` a reading also counts towards that stage's own PSS peak
(``stage_pss_bytes``: which stage of the demo sets the peak).

Not covered: spikes shorter than the interval between samples are seen only in the
process's own peak; memory the kernel holds for the processes (page tables, tmpfs
files of the sandbox's scratch folders) is not in either sum.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class TreeMemory:
    """One reading of a process tree: summed RSS, summed PSS (RSS where unreadable)."""

    rss_bytes: int
    pss_bytes: int
    unreadable: int
    """Processes whose PSS could not be read (counted with their RSS)."""


def tree_memory(process: psutil.Process) -> TreeMemory:
    """RSS and PSS summed over ``process`` and all its descendants (processes that exit
    while being read count as 0)."""
    rss = pss = unreadable = 0
    try:
        members = [process, *process.children(recursive=True)]
    except psutil.Error:
        return TreeMemory(0, 0, 0)
    for member in members:
        try:
            own_rss = member.memory_info().rss
        except psutil.Error:
            continue  # it exited between the listing and the read
        rss += own_rss
        try:
            pss += member.memory_full_info().pss
        except psutil.AccessDenied:
            pss += own_rss
            unreadable += 1
        except psutil.Error:
            continue
    return TreeMemory(rss, pss, unreadable)


def tree_rss_bytes(process: psutil.Process) -> int:
    """The summed RSS of ``process`` and all its descendants."""
    return tree_memory(process).rss_bytes


def own_peak_bytes() -> int:
    """This process's own peak RSS so far (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    return _bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def single_process_peak_bytes() -> int:
    """The largest peak RSS of one process: this one, or any child it has waited for (a
    finished stage process of the demo, a sandbox worker)."""
    return max(own_peak_bytes(), _bytes(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))


def _bytes(maxrss: int) -> int:
    return maxrss if sys.platform == "darwin" else maxrss * 1024


class PeakRSS:
    """Samples the process tree's memory while in a ``with`` block: ``sampled_bytes`` is
    the largest summed RSS seen, ``sampled_pss_bytes`` the largest summed PSS, and
    ``peak_bytes`` the PSS peak (at least this process's own peak); ``stage_pss_bytes``
    the PSS peak of each ``stage`` block by name."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.sampled_bytes = 0
        self.sampled_pss_bytes = 0
        self.unreadable = 0
        self.stage_pss_bytes: dict[str, int] = {}
        self._stage: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Readings taken inside this block count towards ``stage_pss_bytes[name]`` too (one
        reading is taken on entry and one on exit, so a stage shorter than the interval
        still has one)."""
        self._stage = name
        self.stage_pss_bytes.setdefault(name, 0)
        self._read()
        try:
            yield
        finally:
            self._read()
            self._stage = None

    @property
    def peak_bytes(self) -> int:
        return max(self.sampled_pss_bytes, single_process_peak_bytes())

    @property
    def rss_peak_bytes(self) -> int:
        """The largest summed RSS seen (at least one process's own peak, as ``peak_bytes``)."""
        return max(self.sampled_bytes, single_process_peak_bytes())

    def _read(self) -> None:
        stage = self._stage
        reading = tree_memory(psutil.Process())
        self.sampled_bytes = max(self.sampled_bytes, reading.rss_bytes)
        if reading.pss_bytes > self.sampled_pss_bytes:
            self.sampled_pss_bytes, self.unreadable = reading.pss_bytes, reading.unreadable
        if stage is not None:
            self.stage_pss_bytes[stage] = max(self.stage_pss_bytes.get(stage, 0), reading.pss_bytes)

    def _sample(self) -> None:
        while True:
            self._read()
            if self._stop.wait(self.interval_s):
                return

    def sentence(self) -> str:
        """One line for the demo's output."""
        unreadable = f"; {self.unreadable} processes' PSS unreadable, counted at their RSS" if self.unreadable else ""
        return (f"peak memory: {self.peak_bytes / 2**30:.2f} GiB (PSS, shared pages split between processes), "
                f"this process and every process under it (stage, sandbox, grader) together; their RSS summed peaked at "
                f"{self.rss_peak_bytes / 2**30:.2f} GiB (counts shared pages once per process), the largest "
                f"single process at {single_process_peak_bytes() / 2**30:.2f} GiB "
                f"(sampled every {self.interval_s:g} s{unreadable})"
                + self.stage_sentence())

    def stage_sentence(self) -> str:
        """``; PSS peak by stage: SFT 2.10 GiB, …`` (empty without stages)."""
        if not self.stage_pss_bytes:
            return ""
        return "; PSS peak by stage: " + ", ".join(f"{name} {peak / 2**30:.2f} GiB"
                                                   for name, peak in self.stage_pss_bytes.items())
