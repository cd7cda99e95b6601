"""The stateful interpreter (``Sandbox.session``): state kept, isolation and limits as a
stateless call, per-call limits, strays killed after each call, nothing outliving a session.

Process counts are taken over every process of a sandbox uid that descends from this
test process (sessions run as ``uid_base + workers + i``)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from retool.sandbox import Sandbox, SandboxConfig
from retool.types import ExecStatus
from tests.test_sandbox import _processes_with, _sandbox_uid_processes, require

pytestmark = pytest.mark.timeout(180)

TIMEOUT = 2.0


@pytest.fixture(scope="module")
def sb():
    sandbox = Sandbox(SandboxConfig(timeout_s=TIMEOUT, workers=8, max_sessions=40))
    sandbox.start()
    yield sandbox
    sandbox.close()


@pytest.fixture(autouse=True)
def no_strays():
    yield
    assert _wait_for_no_strays() == []


def _wait_for_no_strays(seconds: float = 3.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := _sandbox_uid_processes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _marker() -> str:
    return f"{int(time.time() * 1000) % 10**6 + 3000}.{os.getpid() % 983}"


# ---------------------------------------------------------------- state


def test_state_is_kept_across_calls(sb):
    with sb.session() as s:
        assert s.run_sync("import sympy\nx = sympy.factorint(360)\ndef f(n):\n    return n * 2").stdout == ""
        assert s.run_sync("print(x)\nf(21)").stdout == "{2: 3, 3: 2, 5: 1}\n42\n"
        first = s.run_sync("import os\nos.getpid(), os.getuid()")
    assert first.ok and first.state_lost is None


def test_auto_print_is_the_same_in_both_modes(sb):
    snippets = ["x = 6\nx * 7", "'text'", "print('once')", "x = 1", "if True:\n    5"]
    with sb.session() as s:
        for code in snippets:
            assert s.run_sync(code).stdout == sb.run_sync(code).stdout


def test_a_session_is_isolated_like_a_call(sb):
    require(sb, "pidns", "uid_drop")
    with sb.session() as s:
        res = s.run_sync("import os\nprint(os.getuid(), os.getpid(), os.getcwd(), sorted(os.listdir('/proc'))[0])")
    uid, pid, cwd, first_proc = res.stdout.split()
    assert res.ok and int(uid) >= sb.config.uid_base + sb.config.workers and pid == "1" and cwd == "/sandbox/work"
    assert first_proc == "1"  # its /proc shows its own namespace only


def test_32_concurrent_sessions_with_the_same_names_never_leak(sb):
    require(sb, "pidns", "uid_drop")

    async def trajectory(i: int) -> list[str]:
        async with sb.session() as s:
            seen = [(await s.run(f"secret = {i}\nimport os\nfiles = os.listdir('.')\n_ = open('mine', 'w').write('{i}')")).observation]
            for _ in range(2):
                await asyncio.sleep(0.01 * (i % 5))
                seen.append((await s.run("secret, open('mine').read(), sorted(os.listdir('.'))")).stdout)
            seen.append((await s.run("import glob\nsorted({open(p).read() for p in glob.glob('/sandbox/*/mine')})")).stdout)
            return seen

    async def main():
        return await asyncio.gather(*(trajectory(i) for i in range(32)))

    for i, seen in enumerate(asyncio.run(main())):
        assert seen[0] == "" and seen[1] == seen[2] == f"({i}, '{i}', ['mine'])\n", (i, seen)
        assert seen[3] == f"['{i}']\n", seen[3]  # its own file (two paths to it), no other session's


# ---------------------------------------------------------------- limits and lost state


def test_timeout_ends_the_interpreter_and_the_next_call_says_so(sb):
    with sb.session() as s:
        s.run_sync("x = 1")
        res = s.run_sync("while True: pass", timeout_s=1.0)
        assert res.status is ExecStatus.TIMEOUT and "interpreter was stopped" in res.observation
        after = s.run_sync("x")
        assert after.state_lost == "timeout" and "NameError" in after.observation
        assert after.observation.startswith("[Note: an earlier call ended the interpreter (it timed out)")
        assert s.run_sync("x = 2\nx").stdout == "2\n" and s.run_sync("x").state_lost is None


def test_memory_error_ends_the_interpreter(sb):
    with sb.session() as s:
        s.run_sync("x = 1")
        res = s.run_sync("y = bytearray(1 << 33)", memory_mb=256)
        assert res.status is ExecStatus.MEMORY
        assert s.run_sync("x").state_lost == "memory"


def test_output_flood_ends_the_interpreter(sb):
    with sb.session() as s:
        s.run_sync("x = 1")
        res = s.run_sync("while True:\n    print('x' * 1000)", timeout_s=10)
        assert res.status is ExecStatus.OUTPUT_LIMIT and res.truncated
        assert s.run_sync("x").state_lost == "output_limit"


def test_exiting_the_process_ends_the_interpreter_but_sys_exit_ends_only_the_call(sb):
    with sb.session() as s:
        s.run_sync("x = 1")
        res = s.run_sync("import sys\nsys.exit(3)")
        assert res.exit_code == 3 and s.run_sync("x").stdout == "1\n"
        assert s.run_sync("import os\nos._exit(0)").status is ExecStatus.OK
        assert s.run_sync("x").state_lost == "exited"


def test_limits_are_per_call_not_summed(sb):
    """Three calls that each use ~60 % of the CPU allowance (timeout + 1 s) and keep ~60 %
    of the memory allowance alive all succeed; one call over the memory allowance fails."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6 * {cpu}: pass"
    cpu = TIMEOUT + 1.0
    with sb.session() as s:
        for i in range(3):
            res = s.run_sync(burn.format(cpu=cpu) + f"\nkeep{i} = bytearray(150 << 20)", memory_mb=256, timeout_s=TIMEOUT + 5)
            assert res.ok, res.observation
        assert s.run_sync("len(keep0) + len(keep1) + len(keep2)").stdout == f"{3 * (150 << 20)}\n"
        assert s.run_sync("z = bytearray(300 << 20)", memory_mb=256).status is ExecStatus.MEMORY


def test_a_process_left_running_is_killed_when_the_call_ends(sb):
    require(sb, "pidns")
    marker = _marker()
    with sb.session() as s:
        code = f"""
import os, subprocess
subprocess.Popen(["/bin/sleep", "{marker}"])
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sleep", ["sleep", "{marker}"])
    os._exit(0)
x = 5
"""
        assert s.run_sync(code).ok
        assert _processes_with(marker) == []  # gone already, while the session lives on
        assert s.run_sync("x").stdout == "5\n"


# ---------------------------------------------------------------- nothing outlives a session


def _busy_session_code(marker: str) -> str:
    return f"import subprocess, time\nsubprocess.Popen(['/bin/sleep', '{marker}'])\ntime.sleep(30)"


def test_no_process_remains_after_close_exception_or_cancellation(sb):
    marker = _marker()

    async def closed_normally():
        async with sb.session() as s:
            await s.run("x = 1")

    async def raised():
        with pytest.raises(ZeroDivisionError):
            async with sb.session() as s:
                await s.run("x = 1")
                1 / 0

    async def cancelled():
        async def trajectory():
            async with sb.session() as s:
                await s.run("x = 1")
                await s.run(_busy_session_code(marker), timeout_s=60)

        task = asyncio.create_task(trajectory())
        while not _processes_with(marker):
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def main():
        await asyncio.gather(closed_normally(), raised(), cancelled())

    asyncio.run(main())
    assert _processes_with(marker) == [] and _sandbox_uid_processes() == []


def test_closing_the_sandbox_ends_every_session():
    sandbox = Sandbox(SandboxConfig(timeout_s=TIMEOUT, workers=2, preload=("math",)))
    sessions = [sandbox.session() for _ in range(5)]
    for s in sessions:
        assert s.run_sync("x = 1\nx").stdout == "1\n"
    assert len(_sandbox_uid_processes()) == 5
    sandbox.close()
    assert _wait_for_no_strays() == []


def test_sessions_beyond_the_bound_wait_for_a_free_one():
    with Sandbox(SandboxConfig(timeout_s=TIMEOUT, workers=4, max_sessions=2, preload=("math",))) as sandbox:
        async def main():
            first, second, third = sandbox.session(), sandbox.session(), sandbox.session()
            await first.run("x = 1")
            await second.run("x = 2")
            waiting = asyncio.create_task(third.run("x = 3\nx"))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            await first.aclose()
            assert (await waiting).stdout == "3\n"
            await asyncio.gather(second.aclose(), third.aclose())

        asyncio.run(main())


def test_a_closed_session_refuses_calls(sb):
    s = sb.session()
    s.close()
    s.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        s.run_sync("1")


# ---------------------------------------------------------------- hostile sessions


def test_a_session_that_subverts_its_loop_only_spoils_itself(sb):
    """Closing its own streams, then forging the end of its call and spinning: the warm
    parent stays responsive, other sessions are untouched, and the CPU limit (set per
    call) still ends the runaway interpreter."""
    with sb.session() as other, sb.session() as hostile:
        other.run_sync("x = 'mine'")
        closed = hostile.run_sync("import os\nos.close(1)\nos.close(2)")
        assert closed.stdout == "" and sb.run_sync("print('parent fine')").stdout == "parent fine\n"
        forged = ("import os, sys, time\nreq = sys._getframe(2).f_locals['req']\n"
                  "os.write(3, ('{\"done\": \"%s\", \"exit_code\": 0}\\n' % req['id']).encode())\n"
                  "while True: pass")
        started = time.monotonic()
        assert hostile.run_sync(forged).status is ExecStatus.OK  # the parent believed the forgery...
        assert time.monotonic() - started < 1
        assert other.run_sync("x").stdout == "'mine'\n"  # ...which changed nothing for anyone else
        deadline = time.monotonic() + 2 * (TIMEOUT + 2)
        while (res := hostile.run_sync("1", timeout_s=0.5)).state_lost is None and time.monotonic() < deadline:
            pass
        assert res.state_lost is not None  # its interpreter was ended (CPU limit or the timeout)
        assert hostile.run_sync("2").stdout == "2\n"


SPY = """
import sys
f = sys._getframe()
while f is not None and 'zygote' not in f.f_locals:
    f = f.f_back
z = f.f_locals['zygote']
print(len(z.calls), len(z.sessions), len(z.queue))
"""


def test_the_warm_parents_other_work_is_not_reachable_from_a_call_or_session(sb):
    async def main():
        async with sb.session() as victim, sb.session() as spy:
            busy = asyncio.create_task(victim.run("import time\nprint('SECRET', flush=True)\ntime.sleep(1)"))
            stateless = asyncio.create_task(sb.run("import time\ntime.sleep(1)"))
            await asyncio.sleep(0.3)
            seen = [(await spy.run(SPY)).stdout, (await sb.run(SPY)).stdout]
            await asyncio.gather(busy, stateless)
            return seen

    assert asyncio.run(main()) == ["0 0 0\n", "0 0 0\n"]
