"""The files the cgroup v2 code writes and reads, against a fake v2 tree in a tmp dir.

What this checks: which control file each step of ``retool/sandbox/_cgroups.py``'s v2 path
writes, with what text, and in which order — ``cgroup.subtree_control`` (the parent's and
the sandbox group's), ``memory.max``, ``memory.swap.max``, ``pids.max``, ``cgroup.freeze``,
``cgroup.kill`` — and what it makes of ``cgroup.events``, ``pids.current``,
``cgroup.procs`` and ``cpu.stat``.

What it cannot check: the kernel's v2 behaviour. The fake files are plain files, so
nothing here enforces a limit, freezes or kills a process through the kernel, or refuses
a write (e.g. ``EBUSY`` from ``cgroup.subtree_control`` of a group that holds
processes). This machine's v2 tree has no controllers, so ``memory.max``, ``pids.max``
and ``subtree_control`` cannot run against the kernel here at all; freezing, killing, CPU
accounting and clean-up run against the real v2 tree in ``test_sandbox_cgroups.py``.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from retool.sandbox import _cgroups

GROUP_FILES = {
    "cgroup.procs": "", "cgroup.freeze": "0", "cgroup.kill": "", "cgroup.events": "populated 0\nfrozen 0\n",
    "cpu.stat": "usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n", "pids.current": "1\n",
    "memory.max": "", "memory.swap.max": "", "pids.max": "",
}
"""A slot group's control files as the fake tree starts them (the kernel makes these on mkdir)."""


def _fill(path: str, files: dict[str, str]) -> None:
    os.makedirs(path, exist_ok=True)
    for name, text in files.items():
        with open(os.path.join(path, name), "w") as f:
            f.write(text)


def _text(path: str) -> str:
    with open(path) as f:
        return f.read()


@pytest.fixture
def fake_tree(tmp_path):
    """A fake v2 sandbox group with two slot groups made ahead (the kernel would make their
    files as the sandbox mkdirs them; here ``Hierarchy.group`` finds the directories there)."""
    own_dir = tmp_path / "retool-sandbox-1"
    for slot in ("call-0", "session-0"):
        _fill(str(own_dir / slot), GROUP_FILES)
    parent = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    own = os.open(own_dir, os.O_RDONLY | os.O_DIRECTORY)
    hierarchy = _cgroups.Hierarchy("v2", own_dir.name, {"": parent}, {"": own}, [str(own_dir)])
    yield hierarchy, own_dir
    for group in hierarchy.groups.values():
        group.close()
    os.close(own)
    os.close(parent)


def test_set_limits_writes_memory_max_with_slack_no_swap_and_pids_max(fake_tree):
    hierarchy, own_dir = fake_tree
    group = hierarchy.group("call-0")
    group.set_limits(256 << 20, 64)
    assert _text(own_dir / "call-0" / "memory.max") == str((256 << 20) + _cgroups.MEMORY_SLACK_BYTES)
    assert _text(own_dir / "call-0" / "memory.swap.max") == "0"
    assert _text(own_dir / "call-0" / "pids.max") == "64"
    os.remove(own_dir / "call-0" / "pids.max")
    group.set_limits(256 << 20, 64)  # unchanged: nothing is written again
    assert not os.path.exists(own_dir / "call-0" / "pids.max")


def test_freeze_thaw_and_frozen_go_through_cgroup_freeze_and_events(fake_tree):
    hierarchy, own_dir = fake_tree
    group, files = hierarchy.group("session-0"), own_dir / "session-0"
    assert not group.frozen()
    group.freeze(wait=False)
    assert _text(files / "cgroup.freeze") == "1"
    _fill(str(files), {"cgroup.events": "populated 1\nfrozen 1\n"})  # what the kernel says once all stopped
    assert group.frozen()
    group.freeze()  # with wait: returns as cgroup.events says frozen
    group.thaw()
    assert _text(files / "cgroup.freeze") == "0"


def test_kill_all_writes_cgroup_kill_and_leaves_the_group_thawed(fake_tree):
    """A process that joins a frozen group is frozen at once: after the kill the group
    must be thawed, or the slot's next interpreter would never run."""
    hierarchy, own_dir = fake_tree
    group, files = hierarchy.group("session-0"), own_dir / "session-0"
    group.freeze(wait=False)
    group.kill_all()
    assert _text(files / "cgroup.kill") == "1"
    assert _text(files / "cgroup.freeze") == "0"


def test_kill_all_but_one_kills_the_listed_others_frozen_then_thaws(fake_tree):
    hierarchy, own_dir = fake_tree
    group, files = hierarchy.group("session-0"), own_dir / "session-0"
    keep, victim = (_sleeper() for _ in range(2))
    try:
        _fill(str(files), {"cgroup.procs": f"{keep}\n{victim}\n", "cgroup.events": "populated 1\nfrozen 1\n"})
        group.kill_all(keep=keep)
        assert os.waitpid(victim, 0)[1] == signal.SIGKILL
        assert os.waitpid(keep, os.WNOHANG) == (0, 0)  # left alive
        assert _text(files / "cgroup.freeze") == "0"  # frozen for the kill, thawed after it
    finally:
        os.kill(keep, signal.SIGKILL)
        os.waitpid(keep, 0)


def test_alone_reads_pids_current_and_falls_back_to_the_process_list(fake_tree):
    hierarchy, own_dir = fake_tree
    group, files = hierarchy.group("session-0"), own_dir / "session-0"
    _fill(str(files), {"cgroup.procs": "41\n42\n"})  # ignored while pids.current says one task
    assert group.alone(41)
    _fill(str(files), {"pids.current": "3\n"})  # three tasks: threads of 41, or other processes
    assert not group.alone(41)
    _fill(str(files), {"cgroup.procs": "41\n"})  # 41's own threads
    assert group.alone(41)


def test_cpu_seconds_reads_usage_usec_of_cpu_stat(fake_tree):
    hierarchy, own_dir = fake_tree
    group = hierarchy.group("call-0")
    assert group.cpu_seconds() == 1.5
    _fill(str(own_dir / "call-0"), {"cpu.stat": "usage_usec 2250000\nuser_usec 2000000\nsystem_usec 250000\n"})
    assert group.cpu_seconds() == 2.25  # the kept fd reads it afresh


def test_open_v2_enables_memory_and_pids_in_the_parent_and_cleans_up_on_failure(tmp_path):
    """The parent lacks memory and pids in its ``subtree_control``: they are enabled there;
    the new group gets no ``cgroup.controllers`` here (a plain mkdir), so opening fails and
    the group directory it made is removed again."""
    _fill(str(tmp_path), {"cgroup.subtree_control": "cpu\n"})
    with pytest.raises(FileNotFoundError):
        _cgroups.Hierarchy._open_v2_under(str(tmp_path), "retool-sandbox-1")
    assert _text(tmp_path / "cgroup.subtree_control") == "+memory +pids"
    assert not os.path.exists(tmp_path / "retool-sandbox-1")


def test_delegate_controllers_enables_what_the_group_has(tmp_path):
    _fill(str(tmp_path), {"cgroup.controllers": "cpuset memory pids\n", "cgroup.subtree_control": ""})
    own = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _cgroups._delegate_controllers(own)
    finally:
        os.close(own)
    assert _text(tmp_path / "cgroup.subtree_control") == "+memory +pids"  # no cpu controller there


def _sleeper() -> int:
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    return pid
