"""The control-group code of the sandbox (``retool/sandbox/_cgroups.py``), version 2 path.

The sandbox picks version 2 where its memory and pids controllers can be enabled, else
version 1. Machines with a hybrid layout (v1 controllers, plus a v2 tree at
``/sys/fs/cgroup/unified`` with no controllers) run the sandbox on v1; but their v2 tree
still has ``cgroup.procs``, ``cgroup.freeze``, ``cgroup.events``, ``cgroup.kill`` and
``cpu.stat``, so the v2 code for joining, freezing, thawing, killing, CPU accounting and
clean-up runs here against the real kernel interface. What it cannot exercise without
controllers: ``memory.max``/``memory.swap.max``/``pids.max`` (``set_limits``),
``memory.peak``, and enabling controllers in ``cgroup.subtree_control``.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

from retool.sandbox import _cgroups

UNIFIED = "/sys/fs/cgroup/unified"
"""Where a hybrid layout mounts the v2 tree (a pure v2 system mounts it at /sys/fs/cgroup)."""


def _v2_tree() -> str:
    for path in (_cgroups.ROOT, UNIFIED):
        if os.path.exists(os.path.join(path, "cgroup.controllers")):
            return path
    pytest.skip("no cgroup v2 tree mounted")


@pytest.fixture
def hierarchy():
    """A v2 parent group made by hand under the v2 tree (as ``Hierarchy.open`` makes one,
    minus the controllers), removed at the end whatever happened."""
    tree = _v2_tree()
    if os.geteuid() != 0:
        pytest.skip("making v2 groups needs root")
    name = f"retool-test-{uuid.uuid4().hex[:8]}"
    parent = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.mkdir(name, 0o755, dir_fd=parent)
    except OSError as exc:
        os.close(parent)
        pytest.skip(f"cannot make a v2 group under {tree}: {exc}")
    own = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=parent)
    if not os.path.exists(f"{tree}/{name}/cgroup.kill"):
        os.close(own)
        os.rmdir(f"{tree}/{name}")
        os.close(parent)
        pytest.skip("this kernel's v2 groups have no cgroup.kill (Linux < 5.14)")
    h = _cgroups.Hierarchy("v2", name, {"": parent}, {"": own}, [f"{tree}/{name}"])
    yield h
    if os.path.isdir(h.paths[0]):
        assert _cgroups.remove_leftovers(h.paths) == []


def _sleeper(group: _cgroups.Group) -> int:
    """A ``sleep`` that joins ``group`` itself before it execs, as the sandbox's children do."""
    fds = group.join_fds()
    pid = os.fork()
    if pid == 0:
        try:
            _cgroups.join(fds)
            os.execv("/bin/sleep", ["sleep", "60"])
        finally:
            os._exit(1)
    for fd in fds:
        os.close(fd)
    _wait_for(lambda: pid in group.pids())
    return pid


def _wait_for(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _killed(pid: int) -> bool:
    return os.WIFSIGNALED(status := os.waitpid(pid, 0)[1]) and os.WTERMSIG(status) == signal.SIGKILL


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_v2_join_freeze_thaw_and_cpu_accounting(hierarchy):
    group = hierarchy.group("call-0")
    pid = _sleeper(group)
    try:
        assert group.pids() == [pid]
        assert group.cpu_seconds() >= 0.0  # cpu.stat's usage_usec exists without the cpu controller
        assert not group.frozen()
        group.freeze()
        assert group.frozen()
        group.thaw()
        _wait_for(lambda: not group.frozen())
        group.freeze(wait=False)  # as the zygote freezes a session after its call
        _wait_for(group.frozen)
        group.thaw()
    finally:
        group.kill_all()
    assert _killed(pid)


def test_v2_kill_all_kills_a_frozen_group_through_cgroup_kill(hierarchy):
    group = hierarchy.group("session-0")
    pids = [_sleeper(group), _sleeper(group)]
    group.freeze()
    group.kill_all()  # cgroup.kill: frozen or not, they die
    assert all(_killed(pid) for pid in pids)
    _wait_for(lambda: group.pids() == [])


def test_v2_leave_only_keeps_the_interpreter_alone_and_frozen(hierarchy):
    group = hierarchy.group("session-1")
    keep, stray = _sleeper(group), _sleeper(group)
    try:
        assert group.leave_only(keep) == 1
        assert _killed(stray)
        assert group.pids() == [keep] and group.frozen()
        group.thaw()
        assert _state(keep) in "SR"
    finally:
        group.kill_all()
    assert _killed(keep)


def test_v2_close_and_remove_leftovers_clean_up(hierarchy):
    first = hierarchy.group("call-1")
    pid = _sleeper(first)
    first.freeze()  # a warm parent killed while a session was frozen leaves this behind
    assert sorted(hierarchy._group_names()) == ["call-1"]
    assert _cgroups.remove_leftovers(hierarchy.paths) == []  # kills, thaws (cgroup.freeze 0), removes
    assert _killed(pid)
    assert not os.path.exists(hierarchy.paths[0])


def test_v2_hierarchy_close_kills_and_removes_every_group(hierarchy):
    pids = [_sleeper(hierarchy.group("call-0")), _sleeper(hierarchy.group("session-0"))]
    hierarchy.group("session-0").freeze()
    hierarchy.close()
    assert all(_killed(pid) for pid in pids)
    assert not os.path.exists(hierarchy.paths[0])


def test_hierarchy_open_says_why_v2_was_not_used():
    """On a hybrid layout v2 is refused with a reason (no v2 mount at the root, or its
    controllers cannot be enabled); the sandbox then reports ``cgroup_v1``."""
    if os.path.exists(os.path.join(_cgroups.ROOT, "cgroup.controllers")):
        pytest.skip("a pure v2 system: the sandbox uses v2 here")
    with pytest.raises(OSError, match="not a cgroup v2 mount"):
        _cgroups.Hierarchy._open_v2(f"retool-test-{uuid.uuid4().hex[:8]}")
