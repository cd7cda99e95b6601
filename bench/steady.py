"""Which steps of a timed run stand for a long run's (``bench/scale.py``, ``bench/async_demo.py``)."""

from __future__ import annotations


def steady_rows(rows: list[dict], max_staleness: int) -> list[dict]:
    """The steps of a run that stand for a long run's: steps ``2 .. N - K`` (``N`` the
    run's last step, ``K`` the larger lag compared), the same range for every mode. With
    ``--max-staleness K`` step 1 waits for its own rollout and also starts step 2's, and
    the last ``K`` steps have no later rollout to overlap, so they only train: counting
    them (as ``step >= 2`` did) made sampling ahead look faster than it is."""
    last = max((int(r["step"]) for r in rows), default=0)
    return [r for r in rows if 2 <= int(r["step"]) <= last - max_staleness]
