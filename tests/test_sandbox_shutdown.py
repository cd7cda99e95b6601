"""Shutting the sandbox down: quick, and nothing of it is left.

The sandbox at its busiest idle moment: children forked ahead of their work (a call
runner waiting in each call slot, with the ``sleep`` init of its PID namespace; session
interpreters waiting in free session slots) and open sessions whose interpreters are
frozen in their control groups between calls. Closing it must take well under a second
and leave no process and no control group behind, whether the trainer closes it or is
SIGKILLed (the warm parent then sees EOF on its control pipe and shuts down alone).

The hang these tests guard against: the warm parent discarded a ready call child by
killing the init of its PID namespace and then waiting for that init; the init cannot
finish exiting until every process of its namespace is reaped, and the runner there is
the warm parent's own child, so the warm parent waited for itself (every shutdown took
the trainer's 5 s close timeout, and ended in a kill).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from retool.sandbox import Sandbox, SandboxConfig
from tests.test_sandbox import require

pytestmark = pytest.mark.timeout(180)

SHUTDOWN_LIMIT_S = 0.5
"""The longest a shutdown may take (about 0.1 s here at load 3; it was 5 s)."""
PREFORK_WAIT_S = 20.0
"""How long to wait for the warm parent to fork every child ahead (it does so only while idle)."""


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every process visible here but zombies (they
    hold nothing; one whose parent died waits for the machine's init to reap it)."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # it ended while we looked
                continue
            if fields[0] != "Z":
                table[int(name)] = (int(fields[1]), fields[19])
    return table


def _tree(root: int) -> dict[int, str]:
    """pid -> start time of ``root`` and all its descendants (the start time tells a
    process from a later one that reuses its pid)."""
    table = _process_table()
    found = {root} if root in table else set()
    while grown := {pid for pid, (ppid, _) in table.items() if ppid in found} - found:
        found |= grown
    return {pid: table[pid][1] for pid in found}


def _alive(processes: dict[int, str]) -> dict[int, str]:
    table = _process_table()
    return {pid: start for pid, start in processes.items() if table.get(pid, (0, None))[1] == start}


def _wait_for_ready_children(sb: Sandbox, inits: int, interpreters: int) -> dict[int, str]:
    """Wait until the warm parent holds ``inits`` call inits (each beside its waiting
    runner) and ``interpreters`` session interpreters beyond the templates; returns the tree."""
    launcher = sb._zygote.proc.pid
    deadline = time.monotonic() + PREFORK_WAIT_S
    while True:
        tree = _tree(launcher)
        commands = [_command(pid) for pid in tree]
        sleeps = sum(c.endswith("sleep infinity ") for c in commands)
        pythons = sum("_zygote.py" in c for c in commands)
        grouped = {"cgroup_v1", "cgroup_v2"} & set(sb.isolation)
        templates = 1 + (sb.config.workers if grouped else 0)  # + one per call slot, living in its group
        if sleeps >= inits and pythons >= 2 + templates + inits + interpreters:  # + launcher, zygote
            return tree
        assert time.monotonic() < deadline, f"children were not forked ahead: {sorted(commands)}"
        time.sleep(0.05)


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _frozen(group_dirs: list[str], name: str) -> bool:
    """Whether the group ``name`` (e.g. ``session-0``) is frozen, on v1 or v2."""
    for parent in group_dirs:
        v1 = os.path.join(parent, name, "freezer.state")
        v2 = os.path.join(parent, name, "cgroup.events")
        if os.path.exists(v1):
            return open(v1).read().strip() == "FROZEN"
        if os.path.exists(v2):
            return "frozen 1" in open(v2).read().splitlines()
    return False


def _busy_sandbox(skip: tuple[str, ...]) -> tuple[Sandbox, list]:
    """A sandbox with calls done, two sessions open (frozen between calls where control
    groups are) and every child forked ahead."""
    sb = Sandbox(SandboxConfig(timeout_s=30, workers=3, max_sessions=4, prefork=4, preload=("math",),
                               benchmark_skip=skip))
    sb.start()
    require(sb, "pidns", "clean_template", "prefork")
    if not skip and "cgroup_v2" not in sb.isolation:
        require(sb, "cgroup_v1")
    for i in range(6):
        assert sb.run_sync(f"print({i})").stdout == f"{i}\n"
    sessions = [sb.session() for _ in range(2)]
    for n, session in enumerate(sessions):
        assert session.run_sync(f"x = {n}").ok
        assert session.run_sync("print(x)").stdout == f"{n}\n"
    return sb, sessions


@pytest.mark.parametrize("skip", [(), ("cgroups",)], ids=["with_cgroups", "without_cgroups"])
def test_close_with_ready_children_and_frozen_sessions_is_quick_and_leaves_nothing(skip, capfd):
    sb, _ = _busy_sandbox(skip)
    group_dirs = sb._zygote.ready.get("cgroup_dirs") or []
    tree = _wait_for_ready_children(sb, inits=sb.config.workers, interpreters=2 + 2)
    if not skip:  # the open sessions' groups are frozen between their calls
        deadline = time.monotonic() + 5
        while not all(_frozen(group_dirs, f"session-{i}") for i in range(2)):
            assert time.monotonic() < deadline, "the sessions' groups did not freeze between calls"
            time.sleep(0.01)
    start = time.monotonic()
    sb.close()
    took = time.monotonic() - start
    left = _alive(tree)
    stderr = capfd.readouterr().err
    assert "did not exit" not in stderr, stderr
    assert left == {}, {pid: _command(pid) for pid in left}
    assert [d for d in group_dirs if os.path.exists(d)] == []
    assert took < SHUTDOWN_LIMIT_S, f"closing took {took:.2f} s"


TRAINER = textwrap.dedent("""
    import json, os, signal, sys, time
    from retool.sandbox import Sandbox, SandboxConfig
    sb = Sandbox(SandboxConfig(timeout_s=30, workers=3, max_sessions=4, prefork=4, preload=("math",)))
    sb.start()
    for i in range(4):
        sb.run_sync("print(1)")
    session = sb.session()
    session.run_sync("x = 1")
    session.run_sync("x += 1")
    print(json.dumps({"launcher": sb._zygote.proc.pid, "isolation": list(sb.isolation),
                      "cgroup_dirs": sb._zygote.ready.get("cgroup_dirs") or []}), flush=True)
    time.sleep(60)  # SIGKILLed here, the sandbox left to shut itself down
""")


def test_sigkilled_trainer_leaves_no_sandbox_process_behind():
    """The warm parent of a SIGKILLed trainer shuts down alone (EOF on its control pipe),
    ready children and a frozen session included, within the same bound."""
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        info = json.loads(trainer.stdout.readline() or "{}")
        assert info, trainer.stderr.read()
        if not {"pidns", "prefork"} <= set(info["isolation"]):
            pytest.skip(f"no per-call PID namespace or prefork here: {info['isolation']}")
        time.sleep(1.0)  # the warm parent forks its children ahead while idle
        tree = _tree(info["launcher"])
        assert len(tree) > 8, {pid: _command(pid) for pid in tree}
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        deadline = time.monotonic() + SHUTDOWN_LIMIT_S
        while _alive(tree) and time.monotonic() < deadline:
            time.sleep(0.01)
        left = _alive(tree)
        assert left == {}, {pid: _command(pid) for pid in left}
        assert [d for d in info["cgroup_dirs"] if os.path.exists(d)] == []
        assert "did not exit" not in trainer.stderr.read()
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
