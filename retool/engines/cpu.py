"""What this machine's CPU can do, as Linux reports it (``/proc/cpuinfo``), without torch.

Read by the local engine's precision choice (``lean_decode.native_bf16``: ``avx512_bf16``
or AMX) and by the vLLM server's machine rule (``vllm.server.machine_problem``: the CPU
build needs ``avx512f``), so both read the flags the same way.
"""

from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first CPU's feature flags (``avx2``, ``avx512f``, ...); empty where
    ``/proc/cpuinfo`` cannot be read (not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass  # not Linux: no flags to read
    return frozenset()
