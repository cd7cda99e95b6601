"""``retool.engines.openmp``: a thread hands its OpenMP team back, and the sampler's worker
threads hold a team only while they work (torch's libgomp: one team per thread that ran a
parallel region; more team threads than CPUs make every region wake its workers through the
kernel, ``bench/openmp_teams.py``). Threads are counted in ``/proc/self/task``."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
import torch

from retool.engines import openmp

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp and /proc are Linux's"),
              pytest.mark.timeout(120)]

BIG = torch.randn(4_000_000)


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def parallel_region() -> None:
    """An add large enough for torch to split it over its threads (one OpenMP region)."""
    torch.add(BIG, BIG)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


def test_torch_here_runs_on_libgomp():
    """The pinned CPU wheel of torch on Linux carries its own libgomp: the release has
    something to act on (else every check below would pass by doing nothing)."""
    assert openmp._libgomp() is not None
    assert openmp.release_team()


def test_a_thread_hands_its_team_back_and_the_next_region_builds_one(two_threads):
    parallel_region()
    held = os_threads()
    assert openmp.release_team()
    assert os_threads() == held - (two_threads - 1)  # the team's worker thread has ended
    parallel_region()
    assert os_threads() == held
    assert torch.equal(BIG + BIG, BIG * 2)  # and it computes as before


def test_on_worker_thread_leaves_neither_thread_a_team(two_threads):
    async def counted(call) -> tuple[int, int]:
        inside = await call(lambda: (parallel_region(), os_threads())[1])
        return inside, os_threads()  # the executor's thread is still alive here

    parallel_region()
    plain_inside, plain_after = asyncio.run(counted(asyncio.to_thread))
    parallel_region()
    inside, after = asyncio.run(counted(openmp.on_worker_thread))
    # plain: the caller's team and the worker's both held while it works, and after
    # released: the caller's handed back first, the worker's after its work
    assert inside == plain_inside - (two_threads - 1)
    assert after == plain_after - 2 * (two_threads - 1)


def test_on_worker_thread_returns_and_raises_what_the_function_does():
    assert asyncio.run(openmp.on_worker_thread(lambda a, b: a + b, 2, 3)) == 5

    def boom():
        raise ValueError("from the worker")

    with pytest.raises(ValueError, match="from the worker"):
        asyncio.run(openmp.on_worker_thread(boom))


def test_a_process_without_libgomp_yet_looks_again_later(monkeypatch):
    """Asked before torch has mapped libgomp, the lookup answers None and does not keep that
    answer: once the library is there, it is found."""
    monkeypatch.setattr(openmp, "_FOUND", [])
    monkeypatch.setattr(openmp, "_mapped_libgomp", lambda: None)
    assert openmp._libgomp() is None and not openmp.release_team()
    monkeypatch.undo()
    monkeypatch.setattr(openmp, "_FOUND", [])
    assert openmp._libgomp() is not None and openmp.release_team()
