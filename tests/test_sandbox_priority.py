"""A stateless call that runs long drops to the lowest CPU priority (``demote_after_s``).

The property: at the reference run's load, snippets that spin to the 30 s timeout (2-3 %
of calls) would otherwise take the cores from the short calls beside them and from the
sampler and trainer. Each test reads the priority from inside the call, where the
snippet itself would see it, and the control (``demote_after_s=None``, or a short call)
shows the same probe reading the ordinary value, so it would see a demotion if there
were one and none where there is none.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from retool.sandbox import Sandbox, SandboxConfig
from retool.types import ExecStatus

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="POSIX priorities")

DEMOTE_S = 0.4
SPIN = "import os, time\n_t = time.time()\nwhile time.time() - _t < {s}:\n    pass\n"
NICE = "print(os.getpriority(os.PRIO_PROCESS, 0))"
AUTOGROUPS = os.path.exists("/proc/self/autogroup")


@pytest.fixture(scope="module")
def sb():
    with Sandbox(SandboxConfig(timeout_s=10, workers=2, demote_after_s=DEMOTE_S)) as sandbox:
        yield sandbox


def run(sandbox: Sandbox, code: str, **kw):
    result = asyncio.run(sandbox.run(code, **kw))
    assert result.status is ExecStatus.OK, (result.status, result.stderr[-500:])
    return result.stdout.split()


def test_a_call_past_the_threshold_runs_at_the_lowest_priority_and_a_short_one_does_not(sb):
    own = os.getpriority(os.PRIO_PROCESS, 0)  # the sandbox's parent inherits the test's nice value
    assert run(sb, "import os\n" + NICE) == [str(own)]
    assert run(sb, SPIN.format(s=DEMOTE_S + 0.6) + NICE) == ["19"]


def test_without_the_setting_the_same_probe_reads_the_ordinary_priority():
    own = os.getpriority(os.PRIO_PROCESS, 0)
    with Sandbox(SandboxConfig(timeout_s=10, workers=1, demote_after_s=None)) as plain:
        assert run(plain, SPIN.format(s=1.0) + NICE) == [str(own)]


def test_a_demoted_call_cannot_raise_its_priority_again(sb):
    attack = SPIN.format(s=DEMOTE_S + 0.6) + """
import resource
tries = {
    "setpriority": lambda: os.setpriority(os.PRIO_PROCESS, 0, 0),
    "nice": lambda: os.nice(-5),
    "pgrp": lambda: os.setpriority(os.PRIO_PGRP, 0, 0),
    "rlimit": lambda: resource.setrlimit(resource.RLIMIT_NICE, (40, 40)),
}
for name, attempt in tries.items():
    try:
        attempt()
        print(name + ":done")
    except (OSError, ValueError):  # EPERM / EACCES; raising a hard limit: ValueError
        print(name + ":refused")
print(resource.getrlimit(resource.RLIMIT_NICE)[1])
""" + NICE
    out = run(sb, attack)
    assert out[:4] == ["setpriority:refused", "nice:refused", "pgrp:refused", "rlimit:refused"], out
    assert out[4:] == ["0", "19"]


def test_every_process_of_the_call_is_demoted_those_started_before_and_after(sb):
    code = """import os, subprocess, sys, time
child = "import time\\nt = time.time()\\nwhile time.time() - t < 4:\\n    pass"
before = subprocess.Popen([sys.executable, "-c", child])
""" + SPIN.format(s=DEMOTE_S + 0.6).split("\n", 1)[1] + """after = subprocess.Popen([sys.executable, "-c", child])
time.sleep(0.1)
print(os.getpriority(os.PRIO_PROCESS, before.pid), os.getpriority(os.PRIO_PROCESS, after.pid))
before.kill()
after.kill()
"""
    assert run(sb, code) == ["19", "19"]


@pytest.mark.skipif(not AUTOGROUPS, reason="the kernel does not group sessions (no CONFIG_SCHED_AUTOGROUP)")
def test_the_call_s_session_is_demoted_and_a_new_session_started_after_it_is_demoted_again(sb):
    """Each call is a session of its own, and the scheduler weighs sessions (autogroups)
    against each other before nice values count: the session's weight must drop too, and a
    snippet that leaves it with ``setsid`` after the demotion must not regain its share."""
    code = SPIN.format(s=DEMOTE_S + 0.6) + """import subprocess, sys, time
print(open("/proc/self/autogroup").read().split()[-1])
leave = "import os, sys, time\\ntime.sleep(float(sys.argv[1]))\\nos.setsid()\\ntime.sleep(3)"
at_once = subprocess.Popen([sys.executable, "-c", leave, "0"])
later = subprocess.Popen([sys.executable, "-c", leave, "0.5"])  # after it was demoted in the call's session
deadline = time.time() + 6
while time.time() < deadline and not all(os.getsid(c.pid) == c.pid for c in (at_once, later)):
    time.sleep(0.05)
time.sleep(0.3)  # the warm parent looks every 50 ms
for child in (at_once, later):
    print(os.getsid(child.pid) == child.pid, open(f"/proc/{child.pid}/autogroup").read().split()[-1],
          os.getpriority(os.PRIO_PROCESS, child.pid))
    child.kill()
"""
    assert run(sb, code) == ["19"] + ["True", "19", "19"] * 2


def test_the_timeout_and_the_result_are_unchanged(sb):
    result = asyncio.run(sb.run(SPIN.format(s=60), timeout_s=1.5))
    assert result.status is ExecStatus.TIMEOUT and 1.4 < result.wall_s < 4.0
    assert run(sb, SPIN.format(s=DEMOTE_S + 0.3) + "print(sum(range(10)))") == ["45"]


def test_a_session_s_calls_keep_their_priority(sb):
    own = os.getpriority(os.PRIO_PROCESS, 0)

    async def go():
        async with sb.session() as session:
            return await session.run(SPIN.format(s=DEMOTE_S + 0.6) + NICE)

    result = asyncio.run(go())
    assert result.status is ExecStatus.OK and result.stdout.split() == [str(own)]


def test_without_control_groups_the_call_s_process_group_is_demoted():
    with Sandbox(SandboxConfig(timeout_s=10, workers=1, demote_after_s=DEMOTE_S,
                               benchmark_skip=("cgroups",))) as plain:
        code = SPIN.format(s=DEMOTE_S + 0.6) + NICE
        if AUTOGROUPS:
            code += '\nprint(open("/proc/self/autogroup").read().split()[-1])'
        assert run(plain, code) == ["19", "19"][:1 + AUTOGROUPS]


@pytest.mark.parametrize("value", [0, -1.0])
def test_a_bad_threshold_is_a_clear_error(value):
    with pytest.raises(ValueError, match="demote_after_s must be > 0 or None"):
        SandboxConfig(demote_after_s=value)
