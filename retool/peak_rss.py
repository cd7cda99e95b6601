"""The peak resident memory of this process and every process it started (``PeakRSS``).

``retool demo`` reports it at the end: the sandbox's worker processes and the grader
pool run beside the model, so the process's own peak (``resource.getrusage``) would
miss them. A daemon thread sums the resident set size (RSS) of the process tree every
``interval_s`` seconds (psutil) and keeps the largest sum; the process's own exact peak
(``ru_maxrss``) is reported too, as a floor the sampling cannot miss.

Not covered: memory shared between processes is counted once per process (RSS), so the
sum can overstate a forked tree's use; spikes shorter than the interval between samples
are seen only in the process's own peak.
"""

from __future__ import annotations

import resource
import sys
import threading

import psutil


def tree_rss_bytes(process: psutil.Process) -> int:
    """The summed RSS of ``process`` and all its descendants (processes that exit while
    being read count as 0)."""
    total = 0
    try:
        members = [process, *process.children(recursive=True)]
    except psutil.Error:
        return 0
    for member in members:
        try:
            total += member.memory_info().rss
        except psutil.Error:
            continue  # it exited between the listing and the read
    return total


def own_peak_bytes() -> int:
    """This process's own peak RSS so far (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class PeakRSS:
    """Samples the process tree's RSS while in a ``with`` block; ``peak_bytes`` is the
    largest sum seen (at least this process's own peak)."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.sampled_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_bytes(self) -> int:
        return max(self.sampled_bytes, own_peak_bytes())

    def _sample(self) -> None:
        process = psutil.Process()
        while True:
            self.sampled_bytes = max(self.sampled_bytes, tree_rss_bytes(process))
            if self._stop.wait(self.interval_s):
                return

    def sentence(self) -> str:
        """One line for the demo's output."""
        return (f"peak memory: {self.peak_bytes / 2**30:.2f} GiB resident, this process and its sandbox and "
                f"grader processes together (sampled every {self.interval_s:g} s; this process alone "
                f"peaked at {own_peak_bytes() / 2**30:.2f} GiB)")
