"""Per-window sandbox metrics: outcome rates, latency percentiles, counts by status, CPU time.

The trainer reads and resets them once per step (``snapshot(reset=True)``), so every
number describes one collection window, never the whole run.
"""

from __future__ import annotations

import threading

from retool.types import ExecStatus, ExecutionResult


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in [0, 100]) of an ascending list; 0.0 if empty."""
    if not sorted_values:
        return 0.0
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class SandboxMetrics:
    """Thread-safe accumulator of call outcomes for one collection window."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latencies: list[float] = []
        self._runs: list[float] = []
        self._waits: list[float] = []
        self._counts = {status: 0 for status in ExecStatus}
        self._restarts = 0
        self._cpu_s = 0.0

    def record(self, result: ExecutionResult, latency_s: float) -> None:
        with self._lock:
            self._latencies.append(latency_s)
            self._runs.append(result.wall_s)
            self._waits.append(max(0.0, latency_s - result.wall_s))
            self._counts[result.status] += 1
            self._cpu_s += result.cpu_s

    def record_restart(self) -> None:
        with self._lock:
            self._restarts += 1

    def snapshot(self, reset: bool = True) -> dict[str, float]:
        """``sandbox/*`` metrics of the window; rates are 0.0 when there were no calls.

        ``latency`` is the caller's end-to-end time (queueing included), in seconds;
        ``run`` a call's own wall time in the sandbox, ``queue_wait`` the rest (waiting
        for a worker, and the hand-over);
        ``cpu_s`` the user + system CPU seconds the calls' processes used (what a priced
        sandbox bills, :mod:`retool.cost`).
        """
        with self._lock:
            latencies = sorted(self._latencies)
            runs, waits = sorted(self._runs), sorted(self._waits)
            counts = dict(self._counts)
            restarts = self._restarts
            cpu_s = self._cpu_s
            if reset:
                self.__init__()
        n = len(latencies)
        rate = (lambda status: counts[status] / n) if n else (lambda status: 0.0)
        out = {
            "sandbox/calls": float(n),
            "sandbox/success_rate": rate(ExecStatus.OK),
            "sandbox/error_rate": rate(ExecStatus.ERROR),
            "sandbox/timeout_rate": rate(ExecStatus.TIMEOUT),
            "sandbox/latency_mean": sum(latencies) / n if n else 0.0,
            "sandbox/latency_p50": percentile(latencies, 50),
            "sandbox/latency_p95": percentile(latencies, 95),
            "sandbox/run_p95": percentile(runs, 95),
            "sandbox/queue_wait_p50": percentile(waits, 50),
            "sandbox/queue_wait_p95": percentile(waits, 95),
            "sandbox/worker_restarts": float(restarts),
            "sandbox/cpu_s": cpu_s,
        }
        out.update({f"sandbox/count_{status.value}": float(c) for status, c in counts.items()})
        return out
