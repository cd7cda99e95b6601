"""The control-group code of the sandbox (``retool/sandbox/_cgroups.py``), version 1 path,
against the kernel's v1 hierarchies (memory, pids, cpuacct, freezer), as root.

What a session's later call relies on: the frozen pin group that keeps each freeze and
thaw cheap exists while the sandbox's groups do and goes with them, and ``alone`` answers
from ``pids.current`` exactly what the process list would (threads of the one process
included, other processes never missed).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import pytest

from retool.sandbox import _cgroups


@pytest.fixture
def hierarchy():
    if os.geteuid() != 0:
        pytest.skip("making groups needs root")
    if not all(os.path.isdir(f"{_cgroups.ROOT}/{c}") for c in _cgroups.V1_CONTROLLERS):
        pytest.skip("no v1 memory, pids, cpuacct and freezer hierarchies")
    h = _cgroups.Hierarchy._open_v1(f"retool-test-{uuid.uuid4().hex[:8]}")
    yield h
    if any(os.path.isdir(p) for p in h.paths):
        assert _cgroups.remove_leftovers(h.paths) == []


def _freezer_dir(hierarchy) -> str:
    return next(p for p in hierarchy.paths if p.startswith(f"{_cgroups.ROOT}/freezer/"))


def _child_in(group: _cgroups.Group, threads: int = 0) -> int:
    """A child that joins ``group``, starts ``threads`` extra threads and sleeps; returns
    once it is in the group with all its threads."""
    fds = group.join_fds()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _cgroups.join(fds)
            for _ in range(threads):
                threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
            os.write(ready_w, b"x")
            time.sleep(60)
        finally:
            os._exit(0)
    for fd in (*fds, ready_w):
        os.close(fd)
    assert os.read(ready_r, 1) == b"x"
    os.close(ready_r)
    return pid


def _end(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def test_the_pin_group_is_frozen_while_the_hierarchy_lives_and_removed_with_it(hierarchy):
    pin = f"{_freezer_dir(hierarchy)}/{_cgroups.FREEZER_PIN}"
    with open(f"{pin}/freezer.state") as f:
        assert f.read().strip() == "FROZEN"
    hierarchy.group("session-0")
    hierarchy.close()
    assert not os.path.exists(pin) and not any(os.path.exists(p) for p in hierarchy.paths)


def test_remove_leftovers_removes_the_pin_of_a_killed_warm_parent(hierarchy):
    pin = f"{_freezer_dir(hierarchy)}/{_cgroups.FREEZER_PIN}"
    group = hierarchy.group("session-0")
    pid = _child_in(group)
    group.freeze()  # as a warm parent SIGKILLed between a session's calls leaves it
    assert _cgroups.remove_leftovers(hierarchy.paths) == []
    assert os.waitpid(pid, 0)[1] == signal.SIGKILL
    assert not os.path.exists(pin)


def test_alone_agrees_with_the_process_list(hierarchy):
    group = hierarchy.group("session-0")
    one = _child_in(group)
    try:
        assert group.alone(one)  # one task: pids.current says so
        threaded = _child_in(hierarchy.group("session-1"), threads=2)
        try:
            assert hierarchy.group("session-1").alone(threaded)  # three tasks, one process
        finally:
            _end(threaded)
        other = _child_in(group)
        try:
            assert not group.alone(one)
        finally:
            _end(other)
        deadline = time.monotonic() + 5
        while not group.alone(one):  # the reaped one leaves the group
            assert time.monotonic() < deadline
            time.sleep(0.005)
    finally:
        _end(one)


def test_freeze_and_thaw_through_kept_files_see_the_kernel_state(hierarchy):
    group = hierarchy.group("session-0")
    pid = _child_in(group)
    try:
        group.freeze()
        assert group.frozen()
        with open(f"{_freezer_dir(hierarchy)}/session-0/freezer.state") as f:
            assert f.read().strip() == "FROZEN"
        group.thaw()
        assert not group.frozen()
        usage = group.cpu_seconds()
        assert usage >= 0.0 and group.cpu_seconds() >= usage
    finally:
        group.kill_all()
    assert os.waitpid(pid, 0)[1] == signal.SIGKILL
