"""Seeds derived from other values, the same in every process and on every machine.

Python's ``hash`` is salted per process, so a seed that must survive a resume (a
training step's group seeds, the vLLM client's per-request seeds, eval's per-problem
seeds) is a digest of its parts instead. One function, so the rollout, the evaluator
and the engines can never disagree on how parts become a seed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` (bytes as they are, anything else as its ``str``),
    stable across processes and machines. Each part is length-prefixed, so
    ``(1, 23)`` and ``(12, 3)`` give different seeds."""
    h = hashlib.sha256()
    for part in parts:
        raw = part if isinstance(part, bytes) else str(part).encode()
        h.update(len(raw).to_bytes(8, "little") + raw)
    return int.from_bytes(h.digest()[:8], "little") >> 1


def context_digest(tokens: Sequence[int]) -> bytes:
    """A token sequence as 32 bytes, a part of :func:`derive_seed` for seeds that depend
    on a request's context (the prompt and everything sampled so far)."""
    return hashlib.sha256(",".join(map(str, tokens)).encode()).digest()
