"""Adversarial tests of the local sandbox: one hostile property per test.

The test process plays the trainer: it must survive every test, and no test may leave
processes or temporary directories behind. Isolation is asserted to be on before the
hostile tests rely on it; with ``CI=true`` a missing mechanism fails instead of skipping.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dis
import glob
import hashlib
import os
import signal
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from retool.sandbox import Sandbox, SandboxConfig
from retool.sandbox._zygote import SCRIPT_NAME, WORK_DIR, compile_script
from retool.sandbox.executor import CLEAN_ENV, MAX_TIMEOUT_S, build_result, check_relative_path
from retool.types import ExecStatus
from tests.snippets import FAST_IO_TEMPLATE

REPO = Path(__file__).resolve().parents[1]
SECRET = "retool-test-secret-" + uuid.uuid4().hex
TIMEOUT = 1.5
CI = os.environ.get("CI", "").lower() == "true"
ROOT_ISOLATION = ("netns", "pidns", "mountns", "minimal_root", "readonly_fs", "private_proc",
                  "uid_drop", "no_new_privs", "rlimits", "clean_template", "scratch_quota", "session_netns", "prefork")


@pytest.fixture(scope="module")
def sb():
    os.environ["RETOOL_TEST_SECRET"] = SECRET  # planted in the trainer before the sandbox starts
    sandbox = Sandbox(SandboxConfig(timeout_s=TIMEOUT, workers=8))
    sandbox.start()
    host_dir = sandbox._zygote.ready["host_dir"]
    yield sandbox
    sandbox.close()
    os.environ.pop("RETOOL_TEST_SECRET", None)
    assert not os.path.exists(host_dir), "the sandbox left its directory behind"


@pytest.fixture(autouse=True)
def no_strays(request):
    """After every test: no process of a sandbox uid survives."""
    yield
    if "sb" in request.fixturenames:
        assert _sandbox_uid_processes() == []


def _sandbox_uid_processes(base: int = SandboxConfig().uid_base) -> list[int]:
    """Processes running as a sandbox uid that descend from this test process (other
    test runs on the same machine use the same uids)."""
    uids, parents = {}, {}
    for status in glob.glob("/proc/[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in open(status) if ":" in line)
        except OSError:
            continue
        if "Uid" not in fields or "PPid" not in fields:  # it exited while read
            continue
        pid = int(status.split("/")[2])
        uids[pid], parents[pid] = int(fields["Uid"].split()[1]), int(fields["PPid"])

    def ours(pid: int) -> bool:
        while pid > 1:
            if pid == os.getpid():
                return True
            pid = parents.get(pid, 0)
        return False

    return [pid for pid, uid in uids.items() if base <= uid < base + 1000 and ours(pid)]


def _processes_with(marker: str) -> list[int]:
    found = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            if marker.encode() in open(path, "rb").read():
                found.append(int(path.split("/")[2]))
        except OSError:
            pass
    return found


def require(sb: Sandbox, *mechanisms: str) -> None:
    """Skip (fail under CI=true) unless the named isolation mechanisms are in force."""
    missing = [m for m in mechanisms if m not in sb.isolation]
    if missing:
        message = f"isolation not in force here: {missing} (warnings: {sb._zygote.ready['warnings']})"
        if CI:
            pytest.fail(message)
        pytest.skip(message)


def run(sb: Sandbox, code: str, **kwargs):
    return sb.run_sync(code, **kwargs)


# ---------------------------------------------------------------- isolation is on


def test_isolation_is_actually_on(sb):
    if os.geteuid() != 0 and not CI:
        pytest.skip("full isolation is asserted when running as root (CI)")
    require(sb, *ROOT_ISOLATION)
    res = run(sb, "import os; print(os.getuid(), os.getpid(), os.getcwd())")
    uid, pid, cwd = res.stdout.split()
    assert res.ok and int(uid) >= SandboxConfig().uid_base and int(pid) == 2
    assert set(ROOT_ISOLATION) <= set(res.isolation)


# ---------------------------------------------------------------- semantics


def test_autoprint_last_expression_like_a_notebook(sb):
    assert run(sb, "x = 6\nx * 7").stdout == "42\n"
    assert run(sb, "'text'").stdout == "'text'\n"
    assert run(sb, "print('once')").stdout == "once\n"  # print returns None: not shown again
    assert run(sb, "x = 1").stdout == ""
    assert run(sb, "if True:\n    5").stdout == ""  # inside a block: not the last top-level stmt
    assert run(sb, "import sympy\nsympy.factorint(360)").stdout == "{2: 3, 3: 2, 5: 1}\n"


def test_autoprint_uses_ast_not_text():
    blocks = compile_script("a = 1  # 2\n'''doc'''  ;  a + 1", "main.py")
    assert len(blocks) == 2
    assert len(compile_script("for i in range(3):\n    i", "main.py")) == 1
    assert len(compile_script("a = 1\na + 1", "main.py", auto_print=False)) == 1
    alone = compile_script("6 * 7", "main.py")  # one expression: one block, shown as a notebook shows it
    shown = {i.opname for i in dis.get_instructions(alone[0])} | {i.argrepr for i in dis.get_instructions(alone[0])}
    assert len(alone) == 1 and shown & {"PRINT_EXPR", "INTRINSIC_PRINT"}  # 3.11 / 3.12+
    with pytest.raises(SyntaxError):
        compile_script("def f(:\n", "main.py")


def test_without_auto_print_nothing_is_displayed(sb):
    assert run(sb, "import sys\nsys.stdout.write('5\\n')", auto_print=False).stdout == "5\n"
    assert run(sb, "6 * 7", auto_print=False).stdout == ""


def test_error_shows_traceback_last_frames(sb):
    res = run(sb, "def f(n):\n    return 1 / n\n\nf(0)")
    assert res.status is ExecStatus.ERROR and res.exit_code == 1
    assert "ZeroDivisionError: division by zero" in res.observation
    assert f'{SCRIPT_NAME}", line 2, in f' in res.observation and "_zygote" not in res.stderr
    syntax = run(sb, "def f(:")
    assert syntax.status is ExecStatus.ERROR and "SyntaxError" in syntax.observation


def test_timeout_observation(sb):
    res = run(sb, "print('started', flush=True)\nwhile True: pass", timeout_s=0.5)
    assert res.status is ExecStatus.TIMEOUT
    assert res.observation == "started\nExecution timed out after 0.5 s"
    assert 0.5 <= res.wall_s < 3


def test_stdin_closed_by_default_and_fed_when_given(sb):
    assert "EOFError" in run(sb, "input()").observation
    assert run(sb, "print(int(input()) * 2)", stdin="21\n").stdout == "42\n"


def test_files_written_and_fetched(sb):
    code = "print(open('data/in.txt').read())\nn = open('out.bin', 'wb').write(bytes(range(256)))"
    res = run(sb, code, files={"data/in.txt": b"hello"}, fetch_files=["out.bin", "missing.txt"])
    assert res.stdout == "hello\n" and res.files == {"out.bin": bytes(range(256))}
    for bad in ("../x", "/etc/passwd", "a/../../b", ""):
        with pytest.raises(ValueError):
            check_relative_path(bad)


def test_fetch_refuses_symlinks_out_of_the_call_directory(sb):
    res = run(sb, "import os; os.symlink('/etc/hostname', 'leak')", fetch_files=["leak"])
    assert res.ok and res.files == {}


def test_unicode_and_binary_output(sb):
    res = run(sb, "import sys\nprint('héllo ✓ 😀')\nsys.stdout.flush()\n"
                  "sys.stdout.buffer.write(b'\\xff\\xfe\\n')")
    assert res.ok and res.stdout.startswith("héllo ✓ 😀\n") and "\ufffd" in res.stdout


def test_exit_paths(sb):
    assert run(sb, "import sys; sys.exit(0)").status is ExecStatus.OK
    exited = run(sb, "import sys; sys.exit(3)")
    assert exited.status is ExecStatus.ERROR and exited.exit_code == 3
    assert run(sb, "import os; os._exit(5)").exit_code == 5
    message = run(sb, "import sys; sys.exit('bad input')")
    assert message.exit_code == 1 and "bad input" in message.observation


def test_segfault_is_an_error_not_a_crash(sb):
    res = run(sb, "import ctypes; ctypes.string_at(0)")
    assert res.status is ExecStatus.ERROR and res.signal == signal.SIGSEGV
    assert "SIGSEGV" in res.observation
    assert run(sb, "1").ok


def test_recursion_overflow(sb):
    res = run(sb, "def f(n): return f(n + 1)\nf(0)")
    assert res.status is ExecStatus.ERROR and "RecursionError" in res.observation
    deep = run(sb, "import sys\nsys.setrecursionlimit(10**8)\ndef f(n): return f(n + 1)\nf(0)",
               memory_mb=96, timeout_s=10)
    assert deep.status in (ExecStatus.ERROR, ExecStatus.MEMORY), deep
    assert run(sb, "1").ok


def test_no_state_leaks_between_calls(sb):
    first = ("import math, builtins, sys, os\nleak = 1\nmath.pi = 3\nbuiltins.leaked = True\n"
             "sys.modules['planted'] = math\nopen('left.txt', 'w').write('x')\nos.environ['X'] = '1'")
    assert run(sb, first).ok
    second = ("import math, builtins, sys, os\nprint('leak' in globals(), math.pi, hasattr(builtins, 'leaked'),"
              " 'planted' in sys.modules, os.listdir('.'), 'X' in os.environ)")
    assert run(sb, second).stdout == f"False 3.141592653589793 False False {[SCRIPT_NAME]} False\n"


# ---------------------------------------------------------------- hostile


def test_secret_not_in_environment(sb):
    res = run(sb, "import os; print(dict(os.environ))")
    assert res.ok and SECRET not in res.stdout and "RETOOL_TEST_SECRET" not in res.stdout


def test_secret_not_readable_through_proc(sb):
    require(sb, "private_proc")
    code = f"""
import glob
seen = []
for path in [f"/proc/{os.getpid()}/environ", f"/proc/{os.getpid()}/cmdline", *glob.glob("/proc/*/environ")]:
    try:
        seen.append(open(path, "rb").read().decode("latin-1"))
    except OSError as exc:
        seen.append(type(exc).__name__)
print(seen)
"""
    res = run(sb, "import os\n" + code)
    assert res.ok and SECRET not in res.stdout


@pytest.mark.parametrize("target", [str(REPO / "sandbox_wrote_here.txt"), os.path.expanduser("~/sandbox_wrote_here.txt"),
                                    os.path.join(tempfile.gettempdir(), "sandbox_wrote_here.txt")])
def test_cannot_write_outside_its_directory(sb, target):
    res = run(sb, f"open({target!r}, 'w').write('pwned')")
    assert res.status is ExecStatus.ERROR and ("Errno 30" in res.stderr or "Errno 13" in res.stderr
                                               or "Errno 2" in res.stderr)
    assert not os.path.exists(target)


def test_no_network(sb):
    require(sb, "netns")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        res = run(sb, f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)")
        with pytest.raises(socket.timeout):
            listener.accept()
    assert res.status is ExecStatus.ERROR and "OSError" in res.observation


def test_fork_bomb(sb):
    require(sb, "pidns", "uid_drop")
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    res = run(sb, code, timeout_s=1.0)
    assert res.status is ExecStatus.TIMEOUT
    assert run(sb, "print('alive')").stdout == "alive\n"


def test_process_count_is_capped(sb):
    require(sb, "uid_drop")
    code = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(30)\n"
            "        n += 1\nexcept OSError as exc:\n    print(n, type(exc).__name__)")
    res = run(sb, code, timeout_s=5)
    count, error = res.stdout.split()
    assert res.ok and int(count) < SandboxConfig().max_processes and error == "BlockingIOError"


def test_memory_bomb(sb):
    res = run(sb, "x = bytearray(1 << 33)", memory_mb=256)
    assert res.status is ExecStatus.MEMORY and "MemoryError" in res.observation
    grow = run(sb, "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 24))", memory_mb=256)
    assert grow.status is ExecStatus.MEMORY
    assert grow.peak_rss_bytes is not None and grow.peak_rss_bytes < grow.memory_baseline_bytes + (300 << 20)


def test_huge_file(sb):
    res = run(sb, "with open('big', 'wb') as f:\n    for _ in range(64):\n        f.write(bytes(1 << 20))")
    assert res.status is ExecStatus.ERROR and "File too large" in res.observation


def test_print_forever(sb):
    res = run(sb, "while True:\n    print('x' * 1000)", timeout_s=10)
    assert res.status is ExecStatus.OUTPUT_LIMIT and res.truncated
    assert len(res.stdout.encode()) <= SandboxConfig().max_output_bytes and res.wall_s < 5


@pytest.mark.parametrize("main_ends", ["timeout", "exit"])
def test_setsid_and_double_fork_children_die(sb, main_ends):
    require(sb, "pidns")
    marker = f"{int(time.time() * 1000) % 10**6 + 1000}.{os.getpid() % 997}"
    code = f"""
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sleep", ["sleep", "{marker}"])
    os._exit(0)
time.sleep(0.3)
{"while True: pass" if main_ends == "timeout" else "print('done')"}
"""
    res = run(sb, code, timeout_s=1.0)
    assert res.status is (ExecStatus.TIMEOUT if main_ends == "timeout" else ExecStatus.OK)
    assert _processes_with(marker) == []


def test_cannot_signal_the_trainer_or_the_warm_parent(sb):
    """The snippet really runs and really tries: SIGTERM, SIGKILL and SIGSTOP to the trainer's
    and the warm parent's PIDs, to every process it can see in its own /proc, and to -1; it
    reports each outcome. None may reach the trainer (which would notice a SIGTERM) or the
    warm parent. (Process group 0 is left out: that is the snippet itself.)"""
    zygote_pid = sb._zygote.proc.pid
    code = f"""
import os, signal
me = os.getpid()
visible = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me]
print("visible", *visible)
for target in ({os.getpid()}, {zygote_pid}, *visible, -1):
    outcomes = []
    for sig in (signal.SIGTERM, signal.SIGSTOP, signal.SIGKILL):
        try:
            os.kill(target, sig)
            outcomes.append("sent")
        except OSError as err:
            outcomes.append(type(err).__name__)
    print(target, *outcomes)
print("survived")
"""
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        res = run(sb, code)
    finally:
        signal.signal(signal.SIGTERM, previous)
    lines = {line.split()[0]: line.split()[1:] for line in res.stdout.splitlines()}
    assert res.ok and "survived" in lines, res.observation  # the snippet ran to its end
    for pid in (os.getpid(), zygote_pid):
        assert len(lines[str(pid)]) == 3 and "sent" not in lines[str(pid)], res.stdout
    assert received == [], "a signal from the sandbox reached the trainer"
    assert sb._zygote.proc.poll() is None and sb.metrics(reset=False)["sandbox/worker_restarts"] == 0
    assert run(sb, "print('still serving')").stdout == "still serving\n"


def test_64_concurrent_calls_with_timeouts(sb):
    async def main():
        slow = {5, 20, 41, 63}
        codes = ["while True: pass" if i in slow else f"import sympy\nprint({i}, sympy.isprime({i}))"
                 for i in range(64)]
        results = await asyncio.gather(*(sb.run(c, timeout_s=1.0) for c in codes))
        return slow, results

    slow, results = asyncio.run(main())
    for i, res in enumerate(results):
        if i in slow:
            assert res.status is ExecStatus.TIMEOUT
        else:
            assert res.ok and res.stdout.split()[0] == str(i), res
    assert run(sb, "print('healthy')").stdout == "healthy\n"


def test_threads_can_share_the_pool(sb):
    outputs = [None] * 16

    def worker(i):
        outputs[i] = sb.run_sync(f"{i} * 2").stdout

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outputs == [f"{i * 2}\n" for i in range(16)]


def test_cancelled_call_is_killed(sb):
    marker = f"{int(time.time()) % 10**5 + 2000}.{os.getpid() % 991}"

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(sb.run(f"import os; os.execv('/bin/sleep', ['sleep', '{marker}'])",
                                          timeout_s=30), 0.5)

    asyncio.run(main())
    deadline = time.monotonic() + 3
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_with(marker) == []


# ---------------------------------------------------------------- pool health and metrics


def test_dead_worker_is_replaced_and_its_call_reports_sandbox_error():
    with Sandbox(SandboxConfig(timeout_s=5, preload=("math",))) as sandbox:
        sandbox.start()
        victim = sandbox._zygote.proc.pid

        async def main():
            call = asyncio.ensure_future(sandbox.run("import time; time.sleep(3)"))
            await asyncio.sleep(0.3)
            os.killpg(victim, signal.SIGKILL)
            return await call

        res = asyncio.run(main())
        assert res.status is ExecStatus.SANDBOX_ERROR and "died" in res.observation
        assert sandbox.run_sync("print('back')").stdout == "back\n"
        assert sandbox._zygote.proc.pid != victim
        assert sandbox.metrics()["sandbox/worker_restarts"] == 1


def test_a_warm_parent_that_hangs_before_answering_is_killed_and_replaced(monkeypatch):
    """A call the warm parent never acknowledges is timed from its submission: a stopped
    (hung) warm parent is killed by the client's watchdog and the call answered."""
    monkeypatch.setattr("retool.sandbox.executor.WATCHDOG_GRACE_S", 0.3)
    with Sandbox(SandboxConfig(timeout_s=0.5, preload=())) as sandbox:
        sandbox.start()
        victim = sandbox._zygote.proc.pid
        os.killpg(victim, signal.SIGSTOP)
        started = time.monotonic()
        res = sandbox.run_sync("print('never')")
        assert res.status is ExecStatus.SANDBOX_ERROR and "died" in res.observation
        assert time.monotonic() - started < 5
        assert sandbox.run_sync("print('back')").stdout == "back\n"
        assert sandbox._zygote.proc.pid != victim


def test_a_call_queued_behind_busy_workers_is_not_taken_for_a_hung_warm_parent(monkeypatch):
    """A call that waits for a worker far longer than its timeout plus the watchdog's grace
    is answered "queued" by the warm parent and only timed once it starts."""
    monkeypatch.setattr("retool.sandbox.executor.WATCHDOG_GRACE_S", 0.3)
    with Sandbox(SandboxConfig(timeout_s=3, workers=1, preload=())) as sandbox:
        sandbox.start()

        async def main():
            busy = asyncio.ensure_future(sandbox.run("import time; time.sleep(1.5); print('busy')"))
            await asyncio.sleep(0.1)
            waiting = asyncio.ensure_future(sandbox.run("print('waited')", timeout_s=0.2))
            return await busy, await waiting

        busy, waiting = asyncio.run(main())
        assert busy.stdout == "busy\n" and waiting.stdout == "waited\n", (busy, waiting)
        assert sandbox.metrics()["sandbox/worker_restarts"] == 0


def test_requests_larger_than_the_pipe_arrive_whole_and_in_order(sb):
    """Requests are written by the caller's thread when the pipe takes them at once, else by
    the writer thread (in order): from 8 threads at once, requests of a few bytes and of
    ~1.4 MB (a file, base64-encoded), each answered with its own data."""
    def one(i: int) -> tuple[str, str]:
        data = os.urandom(1 << 20) if i % 3 == 0 else str(i).encode()
        expect = f"{len(data)} {hashlib.sha256(data).hexdigest()}"
        res = sb.run_sync("import hashlib\nd = open('d.bin', 'rb').read()\nprint(len(d), hashlib.sha256(d).hexdigest())",
                          files={"d.bin": data}, timeout_s=20)
        return res.stdout.strip(), expect

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        pairs = list(pool.map(one, range(24)))
    assert all(got == expect for got, expect in pairs), [p for p in pairs if p[0] != p[1]][:2]


def test_metrics_per_window():
    with Sandbox(SandboxConfig(timeout_s=0.5, preload=())) as sandbox:
        for code in ("1", "2", "1/0", "while True: pass"):
            sandbox.run_sync(code)
        m = sandbox.metrics(reset=True)
        assert m["sandbox/calls"] == 4 and m["sandbox/count_ok"] == 2
        assert m["sandbox/success_rate"] == 0.5 and m["sandbox/error_rate"] == 0.25
        assert m["sandbox/timeout_rate"] == 0.25 and m["sandbox/count_timeout"] == 1
        assert 0 < m["sandbox/latency_p50"] <= m["sandbox/latency_p95"]
        assert sandbox.metrics()["sandbox/calls"] == 0


def test_classification_of_replies():
    cfg = SandboxConfig()
    base = {"stdout": "", "stderr": "", "wall_s": 0.1, "cpu_s": 0.1, "exit_code": None, "signal": None}
    cases = [
        ({"signal": signal.SIGXCPU}, ExecStatus.TIMEOUT),
        ({"exit_code": 1, "exc_type": "MemoryError"}, ExecStatus.MEMORY),
        ({"signal": signal.SIGKILL}, ExecStatus.MEMORY),  # not ours: the OOM killer
        ({"exit_code": 0}, ExecStatus.OK),
        ({"exit_code": 2}, ExecStatus.ERROR),
        ({"exit_code": 70, "setup_failed": "no uid"}, ExecStatus.SANDBOX_ERROR),
    ]
    for extra, status in cases:
        assert build_result({**base, **extra}, 1.0, 64, cfg).status is status, extra


def test_bad_arguments_raise(sb):
    with pytest.raises(TypeError):
        run(sb, b"print(1)")
    for timeout in (0, -1, float("inf"), float("nan"), MAX_TIMEOUT_S + 1):
        with pytest.raises(ValueError, match="seconds > 0 and <= 3600"):
            run(sb, "1", timeout_s=timeout)
    with pytest.raises(ValueError, match="timeout_s must be"):
        SandboxConfig(timeout_s=float("inf"))
    with pytest.raises(ValueError, match="may not contain 'main.py'"):
        run(sb, "1", files={"main.py": b"print(2)"})
    with pytest.raises(TypeError):
        run(sb, "1", files={"a.txt": "not bytes"})
    with pytest.raises(ValueError, match="prefork must be >= 0"):
        SandboxConfig(prefork=-1)


@pytest.mark.parametrize("prefork", [0, 1])
def test_children_forked_ahead_or_on_demand_give_the_same_results(prefork):
    """With one child forked ahead per kind (two slots: the second call in a row and the
    second session fork on demand) and with none, every call gets its own stdin, files and
    directory, and sessions their own state; nothing of one call is in the next."""
    with Sandbox(SandboxConfig(timeout_s=10, workers=2, max_sessions=2, prefork=prefork)) as box:
        box.start()
        assert ("prefork" in box.isolation) == (prefork > 0 and "clean_template" in box.isolation)
        for i in range(4):
            res = run(box, "import os; print(input(), open('in.txt').read(), sorted(os.listdir('.')))",
                      stdin=f"call{i}\n", files={"in.txt": f"file{i}".encode()})
            assert res.stdout == f"call{i} file{i} ['in.txt', 'main.py']\n", res

        async def two_sessions():
            async with box.session() as a, box.session() as b:
                await a.run("x = 'a'")
                await b.run("x = 'b'")
                return (await a.run("print(x)")).stdout, (await b.run("print(x)")).stdout

        assert asyncio.run(two_sessions()) == ("a\n", "b\n")


# ---------------------------------------------------------------- like `python main.py`

FAST_IO = FAST_IO_TEMPLATE + '''input = lambda: sys.stdin.readline().rstrip("\\r\\n")
n = int(input())
print(sum(map(int, input().split())) * n)
'''

LIKE_PYTHON = {
    "fast_io_template": (FAST_IO, "2\n1 2 3\n"),
    "atexit_output": ("import atexit\natexit.register(print, 'from atexit')\nprint('main')", None),
    "atexit_after_error": ("import atexit\natexit.register(print, 'still runs')\n1 / 0", None),
    "file_and_argv": ("import os, sys\nprint(__file__, sys.argv, sys.path[0] == os.getcwd(), __name__)\n"
                      "print(open(__file__).read().count('argv'))", None),
    "std_streams": ("import sys\nfor s in (sys.stdin, sys.stdout, sys.stderr):\n"
                    "    print(s.name, s.mode, s.encoding, s.errors, s.line_buffering, type(s.buffer).__name__)", ""),
    "syntax_error": ("x = 1\ndef f(:\n    pass\n", None),
    "indentation_error": ("if True:\nprint(1)\n", None),
    "keyboard_interrupt": ("import atexit\natexit.register(print, 'bye')\nprint('before')\nraise KeyboardInterrupt", None),
    "runtime_error_chain": ("def f():\n    try:\n        {}['k']\n    except KeyError as e:\n"
                            "        raise ValueError('bad') from e\nf()", None),
    "lone_surrogate": ("print('ok')\nprint('\\ud800')", None),
    "thread_pool_not_shut_down": ("from concurrent.futures import ThreadPoolExecutor\n"
                                  "ex = ThreadPoolExecutor(2)\nprint(ex.submit(pow, 2, 10).result())", None),
    "exit_in_atexit_is_ignored": ("import atexit, sys\natexit.register(sys.exit, 4)\nprint(1)", None),
}


def _python_file(code: str, stdin: str | None, tmp_path: Path) -> tuple[int, str, str]:
    """What ``python main.py`` does with ``code`` in a folder of its own (paths shown as
    the sandbox's working directory)."""
    (tmp_path / SCRIPT_NAME).write_text(code)
    proc = subprocess.run([sys.executable, SCRIPT_NAME], cwd=tmp_path, env={**CLEAN_ENV, "HOME": str(tmp_path)},
                          input=(stdin or "").encode(), capture_output=True, timeout=60)
    out, err = (s.decode("utf-8", "replace").replace(str(tmp_path), WORK_DIR) for s in (proc.stdout, proc.stderr))
    return proc.returncode, out, err


@pytest.mark.parametrize("name", sorted(LIKE_PYTHON))
def test_runs_like_python_file(sb, name, tmp_path):
    require(sb, "minimal_root", "private_proc")
    code, stdin = LIKE_PYTHON[name]
    res = run(sb, code, stdin=stdin, auto_print=False)
    returncode = res.exit_code if res.exit_code is not None else -res.signal
    assert (returncode, res.stdout, res.stderr) == _python_file(code, stdin, tmp_path)
    assert "retool-sandbox" not in res.stdout + res.stderr and "_zygote" not in res.stderr


def test_keyboard_interrupt_is_return_code_minus_2(sb):
    res = run(sb, "raise KeyboardInterrupt")
    assert res.signal == signal.SIGINT and res.exit_code is None and "KeyboardInterrupt" in res.observation


def test_syntax_error_has_no_sandbox_frames_and_no_host_path(sb):
    res = run(sb, "print(1)\nprint(2 +)\n")
    assert res.stderr.startswith('  File "') and "Traceback" not in res.stderr
    assert "ast.py" not in res.stderr and "_zygote" not in res.stderr
    assert f'{SCRIPT_NAME}", line 2' in res.observation and tempfile.gettempdir() + "/" not in res.stderr


def test_only_the_snippets_own_atexit_hooks_run(sb):
    res = run(sb, "import atexit\nprint(atexit._ncallbacks())\natexit.register(print, 'mine')", auto_print=False)
    assert res.stdout in ("0\nmine\n", "1\nmine\n")  # at most logging.shutdown, as after `import logging`


def test_fast_io_reads_200k_lines_fast(sb):
    code = "import sys\nn = 0\nfor line in iter(sys.stdin.buffer.readline, b''):\n    n += 1\nprint(n)"
    res = run(sb, code, stdin="1 2 3\n" * 200_000, timeout_s=10)
    assert res.stdout == "200000\n" and res.wall_s < 1.0, res  # unbuffered: 1.5 s


def test_memory_limit_counts_the_snippets_own_allocations(sb, tmp_path):
    require(sb, "rlimits")
    fits = run(sb, "x = bytearray(400 << 20)\nprint(len(x) >> 20)", memory_mb=512, timeout_s=20)
    assert fits.ok and fits.stdout == "400\n", fits
    assert fits.memory_baseline_bytes > 50 << 20  # numpy, sympy, ... preloaded
    assert run(sb, "x = bytearray(600 << 20)", memory_mb=512, timeout_s=20).status is ExecStatus.MEMORY
    (tmp_path / "m.py").write_text("x = bytearray(400 << 20)\nprint(len(x) >> 20)")
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (512 << 20,) * 2)  # noqa: E731 - `ulimit -v`
    plain = subprocess.run([sys.executable, "m.py"], cwd=tmp_path, env=CLEAN_ENV, preexec_fn=limit,
                           capture_output=True, text=True, timeout=60)
    assert plain.stdout == fits.stdout  # what `python file.py` under the same limit can do


def test_code_file_lives_at_a_neutral_path(sb):
    require(sb, "minimal_root", "private_proc")
    res = run(sb, "import os, sys\nprint(os.getcwd(), __file__, os.environ['HOME'], sys.path[0])")
    assert res.stdout.split() == [WORK_DIR, f"{WORK_DIR}/{SCRIPT_NAME}", WORK_DIR, WORK_DIR]


# ---------------------------------------------------------------- isolation: logged, measured, strict


def test_degraded_isolation_is_logged_and_measured(sb, caplog):
    require(sb, *ROOT_ISOLATION)
    assert sb.metrics(reset=False)["sandbox/isolation_degraded"] == 0.0
    assert sb.isolation_report().startswith("sandbox isolation: full (")
    with caplog.at_level("INFO", logger="retool.sandbox"):
        with Sandbox(SandboxConfig(preload=(), benchmark_skip=("pidns",))) as degraded:
            degraded.start()
            assert degraded.metrics()["sandbox/isolation_degraded"] == 1.0
            assert "REDUCED, missing pidns, private_proc" in degraded.isolation_report()
    (record,) = [r for r in caplog.records if r.name == "retool.sandbox"]
    assert record.levelname == "WARNING" and "missing pidns" in record.getMessage()


def test_strict_refuses_to_start_without_full_isolation(monkeypatch):
    import retool.sandbox.executor as executor

    monkeypatch.setattr(executor, "NAMESPACE_ISOLATION", executor.NAMESPACE_ISOLATION + ("imaginary_ns",))
    sandbox = Sandbox(SandboxConfig(strict=True, preload=()))
    with pytest.raises(executor.SandboxUnavailableError, match="strict sandbox: .*missing imaginary_ns"):
        sandbox.start()
    sandbox.close()


def test_a_broken_stdout_is_reported_not_a_sandbox_error(sb):
    code = ("import sys\nclass Broken:\n    def write(self, s): pass\n"
            "    def flush(self): raise AttributeError('no flush')\nsys.stdout = Broken()")
    res = run(sb, code, auto_print=False)
    assert (res.status, res.exit_code) == (ExecStatus.ERROR, 120)  # as `python main.py` exits
    assert "AttributeError: no flush" in res.stderr
    assert run(sb, "import sys\nsys.stdout = None", auto_print=False).ok
