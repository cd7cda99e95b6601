"""Attacks on the sandbox's structure, written as an attacker would write them: hostile
code inside a call or session goes after other work running at the same time, or after
the mechanism that contains it. Each probe also looks for a control marker in its *own*
data, so that a probe that finds nothing is known not to be blind.

Mechanisms are asserted to be in force first; with ``CI=true`` a missing one fails.
"""

from __future__ import annotations

import ast
import asyncio
import glob
import json
import os
import time
import uuid

import pytest

from retool.sandbox import Sandbox, SandboxConfig
from tests.test_sandbox import require

pytestmark = pytest.mark.timeout(240)

VICTIM_SECONDS = 6.0
"""How long a victim call stays in flight (holding its code and its output so far in
the warm parent) while the attacker runs."""


@pytest.fixture(scope="module")
def sb():
    sandbox = Sandbox(SandboxConfig(timeout_s=30, workers=6, max_sessions=4))
    sandbox.start()
    yield sandbox
    sandbox.close()


# ---------------------------------------------------------------- other work is not reachable

MEMORY_PROBE = '''
import ctypes, gc, re
ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: our own /proc/self/mem becomes readable to us
PREFIX = "zz" + "MARK" + "zz"  # built at run time: the source never holds a full marker
pattern = re.compile((PREFIX + "-(victim|own)-[0-9a-f]{32}").encode())
own = "{own}"  # this call's own control marker (in its own code, so in its own memory)
found = set()
for obj in gc.get_objects():  # live objects first: the attack the review found
    for value in (list(obj.values()) if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else [obj]):
        if isinstance(value, (str, bytes, bytearray)) and PREFIX in (value if isinstance(value, str) else value.decode("latin-1")):
            data = value.encode("latin-1", "replace") if isinstance(value, str) else bytes(value)
            found.update(m.group(0).decode() for m in pattern.finditer(data))
with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", buffering=0) as mem:
    for line in maps:  # then every readable byte of this process, freed memory included
        span, perms = line.split()[:2]
        if not perms.startswith("r"):
            continue
        start, end = (int(x, 16) for x in span.split("-"))
        for at in range(start, end, 1 << 22):
            try:
                mem.seek(at)
                chunk = mem.read(min(end - at, (1 << 22) + 64))
            except OSError:
                break
            found.update(m.group(0).decode() for m in pattern.finditer(chunk))
print(sorted(found))
'''


def _marker(kind: str) -> str:
    return f"zzMARKzz-{kind}-{uuid.uuid4().hex}"


def _victim_code(marker: str) -> str:
    return f"import sys, time\nsecret = {marker!r}\nprint(secret, flush=True)\ntime.sleep({VICTIM_SECONDS})\n"


async def _attack_while_victims_run(sb: Sandbox, attacker_in_session: bool) -> tuple[set[str], set[str], str]:
    """Start two stateless victims and one session victim (each prints its marker and
    sleeps), then run the memory probe; returns (markers found, victim markers, own marker)."""
    victims = [_marker("victim") for _ in range(3)]
    own = _marker("own")
    async with sb.session() as victim_session, sb.session() as attacker_session:
        await attacker_session.run("warm = 1")  # the attacker's interpreter exists before the victims
        running = [asyncio.ensure_future(sb.run(_victim_code(victims[0]))),
                   asyncio.ensure_future(sb.run(_victim_code(victims[1]))),
                   asyncio.ensure_future(victim_session.run(_victim_code(victims[2])))]
        await asyncio.sleep(1.5)  # the victims are started and their output is read
        probe = MEMORY_PROBE.replace("{own}", own)
        attacker = await (attacker_session.run(probe) if attacker_in_session else sb.run(probe))
        results = await asyncio.gather(*running)
    assert attacker.ok, attacker
    assert all(r.ok and r.stdout.startswith(m) for r, m in zip(results, victims)), results
    return set(eval(attacker.stdout)), set(victims), own


@pytest.mark.parametrize("attacker_in_session", [False, True], ids=["stateless", "session"])
def test_no_other_calls_code_or_output_in_a_child_s_memory(sb, attacker_in_session):
    require(sb, "clean_template", "pidns")
    found, victims, own = asyncio.run(_attack_while_victims_run(sb, attacker_in_session))
    assert own in found, "the probe is blind: it did not find its own marker in its own memory"
    assert not found & victims, f"other work reachable from a child: {found & victims}"


def test_the_probe_finds_other_work_where_children_are_forked_from_the_warm_parent():
    """The same attack against children forked from the zygote itself (the mechanism left
    out): the victims' code is found, so the probe above can see a leak where there is one."""
    with Sandbox(SandboxConfig(timeout_s=30, workers=6, max_sessions=4, benchmark_skip=("template",))) as leaky:
        leaky.start()
        found, victims, own = asyncio.run(_attack_while_victims_run(leaky, attacker_in_session=False))
    assert own in found
    assert found & victims, "a child forked from the warm parent should hold the victims' code"


# ---------------------------------------------------------------- scratch space is per call and per session

FILL = '''
import os
written, error = 0, None
block = b"x" * (1 << 20)
with open("fill.bin", "wb", buffering=0) as f:
    while written < (1 << 31):
        try:
            written += f.write(block)
        except OSError as exc:
            error = exc.errno
            break
elsewhere = []
for path in ("/sandbox/x", "../x", "/tmp/x", "/sandbox/work/../x"):
    try:
        open(path, "wb").write(b"x")
        elsewhere.append(path)
    except OSError:
        pass
print(written >> 20, error == 28, elsewhere)
'''


def _scratch_victim(marker: str) -> str:
    return (f"data = {marker!r}.encode() * 20000\nopen('v.bin', 'wb').write(data)\n"
            "print(open('v.bin', 'rb').read() == data)\n")


def test_a_session_that_fills_its_scratch_space_does_not_fill_anyone_else_s():
    async def attack(sb: Sandbox):
        async with sb.session() as hostile, sb.session() as neighbour:
            filled = await hostile.run(FILL)  # ENOSPC in its own directory, and it stays full
            victims = await asyncio.gather(*[sb.run(_scratch_victim(_marker("victim"))) for _ in range(3)],
                                           neighbour.run(_scratch_victim(_marker("victim"))))
            again = await hostile.run("import os\nos.path.getsize('fill.bin') >> 20")
        return filled, victims, again

    with Sandbox(SandboxConfig(timeout_s=30, workers=6, max_sessions=4, call_scratch_mb=32,
                               max_file_mb=64, max_output_bytes=1 << 16)) as sb:
        sb.start()
        require(sb, "scratch_quota")
        filled, victims, again = asyncio.run(attack(sb))
    mib, enospc, elsewhere = filled.stdout.split(maxsplit=2)
    assert filled.ok and enospc == "True", f"the probe is blind: it never filled its own space ({filled})"
    assert 24 <= int(mib) <= 32 and elsewhere.strip() == "[]", filled.stdout
    assert again.stdout.strip() == mib  # the hostile session's directory is still full...
    assert all(v.ok and v.stdout == "True\n" for v in victims), victims  # ...and nobody else noticed


# ---------------------------------------------------------------- a network namespace per session

LISTEN = '''
import socket, threading
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind("\\x00{name}")
server.listen(8)
def serve():
    while True:
        conn, _ = server.accept()
        conn.sendall(b"{marker}")
        conn.close()
threading.Thread(target=serve, daemon=True).start()
'''

CONNECT = '''
import socket
def fetch(name):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect("\\x00" + name)
        return s.recv(100).decode()
    except OSError as exc:
        return type(exc).__name__
    finally:
        s.close()
print(fetch("{name}"))
'''


def _socket_attack(sb: Sandbox):
    """A victim session listens on an abstract socket; it connects to itself (the control),
    then another session and a stateless call try to connect. Returns the four results."""
    name, marker = uuid.uuid4().hex, _marker("victim")

    async def attack():
        async with sb.session() as victim, sb.session() as attacker:
            listening = await victim.run(LISTEN.replace("{name}", name).replace("{marker}", marker))
            own = await victim.run(CONNECT.replace("{name}", name))
            stolen = await attacker.run(CONNECT.replace("{name}", name))
            stateless = await sb.run(CONNECT.replace("{name}", name))
        return listening, own, stolen, stateless

    listening, own, stolen, stateless = asyncio.run(attack())
    assert listening.ok and own.stdout.strip() == marker, (listening, own)
    return marker, stolen, stateless


def test_abstract_unix_sockets_do_not_connect_sessions(sb):
    require(sb, "session_netns")
    _, stolen, stateless = _socket_attack(sb)
    assert stolen.ok and stolen.stdout.strip() == "ConnectionRefusedError", stolen
    assert stateless.ok and stateless.stdout.strip() == "ConnectionRefusedError", stateless


def test_the_socket_probe_connects_where_sessions_share_a_network_namespace():
    # without control groups too: a frozen session (between its calls) would not answer
    with Sandbox(SandboxConfig(timeout_s=30, workers=6, max_sessions=4,
                               benchmark_skip=("session_netns", "cgroups"))) as shared:
        shared.start()
        marker, stolen, _ = _socket_attack(shared)
    assert stolen.stdout.strip() == marker


# ---------------------------------------------------------------- limits enforced from outside the snippet

DISABLE_STRAY_KILLER = '''
import gc
for obj in gc.get_objects():  # the session loop's module: switch its stray killer off
    if isinstance(obj, dict) and "_kill_strays" in obj and "serve_session" in obj:
        obj["_kill_strays"] = lambda: None
'''

FORK_STRAYS = DISABLE_STRAY_KILLER + '''
import os, resource, select, time
held_pipe, held_signal = os.pipe()
for _ in range({n}):
    if os.fork() == 0:
        try:
            os.setsid()
            hard = resource.getrlimit(resource.RLIMIT_AS)[1]
            resource.setrlimit(resource.RLIMIT_AS, (hard, hard))  # soft up to the hard limit
            block = bytearray({mib} << 20)
            block[::4096] = b"x" * len(block[::4096])  # touch every page
            os.write(1, b"held\\n")
            os.write(held_signal, b"h")
            time.sleep(60)
        finally:
            os._exit(0)
os.close(held_signal)
# wait until a child holds its memory (on a loaded machine that can take seconds), or all died
select.select([held_pipe], [], [], 15.0)
print("processes now:", len([p for p in os.listdir("/proc") if p.isdigit()]))
'''

COUNT_PROCESSES = 'import os\nprint("processes now:", len([p for p in os.listdir("/proc") if p.isdigit()]))'


def _session_groups(sb: Sandbox) -> list[str]:
    """Host paths of the sandbox's session groups in the v1 memory hierarchy (where this machine has it)."""
    own = next(line.split(":", 2)[2].strip() for line in open("/proc/self/cgroup") if ":memory:" in line)
    return glob.glob(f"/sys/fs/cgroup/memory{own.rstrip('/')}/retool-sandbox-{sb._zygote.proc.pid}/session-*")


def test_a_session_cannot_keep_processes_or_memory_between_calls():
    """The snippet switches off the interpreter's own stray killer, forks children that
    raise their soft limits to the hard ones and each hold 100 MiB: between calls they are
    killed from outside, and the session's memory never exceeds its cap."""
    with Sandbox(SandboxConfig(timeout_s=20, memory_mb=96, session_memory_mb=160, workers=4, max_sessions=2)) as sb:
        sb.start()
        require(sb, "pidns")
        _require_cgroups(sb)
        with sb.session() as s:
            during = s.run_sync(FORK_STRAYS.replace("{n}", "4").replace("{mib}", "100"))
            after = s.run_sync(COUNT_PROCESSES)
        peaks = [int(open(f"{g}/memory.max_usage_in_bytes").read()) for g in _session_groups(sb)] \
            if "cgroup_v1" in sb.isolation else []
    held = during.stdout.count("held")
    assert held >= 1, f"the probe is blind: no child ever held its memory ({during})"
    assert during.stdout.strip().endswith(("processes now: 5", "processes now: 4", "processes now: 3",
                                           "processes now: 2")), during.stdout  # its children ran
    assert after.ok and after.stdout == "processes now: 1\n", after  # only the interpreter is left
    cap = (160 << 20) + (128 << 20)  # session_memory_mb + the group's copy-on-write slack
    assert all(peak <= cap for peak in peaks), (peaks, held)  # children that held memory were OOM-killed in turn


SPIN_BETWEEN_CALLS = '''
import threading, time
def spin():
    while True:
        pass
threading.Thread(target=spin, daemon=True).start()
start = time.process_time()
'''


def test_a_session_s_daemon_thread_does_not_run_between_calls(sb):
    require(sb, "pidns")
    _require_cgroups(sb)
    with sb.session() as s:
        assert s.run_sync(SPIN_BETWEEN_CALLS).ok
        gap = s.run_sync("between = time.process_time() - start\nprint(round(between, 2))")
        time.sleep(2.0)  # idle: a spinning thread would burn up to 2 CPU seconds here
        later = s.run_sync("import time\nt = time.process_time(); time.sleep(1.0)\n"
                           "print(round(time.process_time() - t, 3), round(t - start - between, 3))")
    during_call, idle = (float(x) for x in later.stdout.split())  # CPU s in 1 s of a call / in the 2 s gap
    assert during_call > 0.01, f"the probe is blind: the spinner never ran ({later.stdout})"
    assert idle < max(0.1, 0.5 * during_call), f"the session ran for {idle} CPU s while idle ({later.stdout})"
    assert gap.ok


OWN_GROUP = 'print([line.strip().split(":", 2) for line in open("/proc/self/cgroup")])'


def _host_group(sb: Sandbox, lines: list[list[str]]) -> tuple[str, str]:
    """(freezer directory, CPU directory) on the host of the group a call reported
    (``/proc/self/cgroup`` inside the sandbox names it relative to each hierarchy's root)."""
    if "cgroup_v1" in sb.isolation:
        path = {names: path for _, names, path in lines}
        return f"/sys/fs/cgroup/freezer{path['freezer']}", f"/sys/fs/cgroup/cpuacct{path['cpuacct']}"
    root = next(t for t in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified") if os.path.exists(f"{t}/cgroup.controllers"))
    path = f"{root}{next(p for _, names, p in lines if names == '')}"
    return path, path


def _group_state(freezer_dir: str, cpu_dir: str) -> tuple[bool, float]:
    """(frozen, CPU seconds used so far) of a group, read from the host."""
    if os.path.exists(f"{freezer_dir}/freezer.state"):
        frozen = open(f"{freezer_dir}/freezer.state").read().strip() == "FROZEN"
        return frozen, int(open(f"{cpu_dir}/cpuacct.usage").read()) / 1e9
    stat = dict(line.split() for line in open(f"{cpu_dir}/cpu.stat"))
    return "frozen 1" in open(f"{freezer_dir}/cgroup.events").read().splitlines(), int(stat["usage_usec"]) / 1e6


def test_a_session_called_back_to_back_is_still_frozen_as_soon_as_it_is_idle(sb):
    """Calls that come back to back find the session unfrozen (freezing is left to idle
    time): with a daemon thread spinning all along, the group is frozen within a moment
    of the last call, and stays at rest while idle."""
    require(sb, "pidns")
    _require_cgroups(sb)
    with sb.session() as s:
        assert s.run_sync(SPIN_BETWEEN_CALLS).ok
        group = _host_group(sb, ast.literal_eval(s.run_sync(OWN_GROUP).stdout))
        for _ in range(20):
            assert s.run_sync("pass").ok
        time.sleep(0.2)  # far longer than the idle time after which a session is frozen
        frozen, cpu_before = _group_state(*group)
        time.sleep(0.5)
        _, cpu_after = _group_state(*group)
        spun = s.run_sync("print(time.process_time() - start)")
    assert float(spun.stdout) > 0.005, f"the probe is blind: the spinner never ran ({spun})"
    assert frozen, f"the session's group {group[0]} was not frozen 0.2 s after its last call"
    assert cpu_after - cpu_before < 0.02, f"the idle session used {cpu_after - cpu_before:.3f} CPU s in 0.5 s"


def _require_cgroups(sb: Sandbox) -> None:
    if "cgroup_v1" not in sb.isolation and "cgroup_v2" not in sb.isolation:
        require(sb, "cgroup_v2")  # fails under CI=true, skips elsewhere


CPU_HOG = """
import resource, signal, threading, time
signal.signal(signal.SIGXCPU, signal.SIG_IGN)
hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))  # soft up to the hard limit
def spin():
    while True:
        pass
for _ in range(2):
    threading.Thread(target=spin, daemon=True).start()
time.sleep(20)
"""


@pytest.mark.parametrize("in_session", [False, True], ids=["stateless", "session"])
def test_cpu_time_is_bounded_over_all_threads_even_as_pid_1(in_session):
    """The snippet ignores SIGXCPU, raises its soft CPU limit and spins in two threads while
    its main thread sleeps (a session interpreter is pid 1: SIGXCPU would never reach it)."""
    with Sandbox(SandboxConfig(timeout_s=25, cpu_time_s=1.5, workers=2, max_sessions=1)) as sb:
        sb.start()
        require(sb, "pidns")
        _require_cgroups(sb)
        if in_session:
            with sb.session() as s:
                res = s.run_sync(CPU_HOG)
        else:
            res = sb.run_sync(CPU_HOG)
    assert res.status.value == "timeout" and res.wall_s < 15, res


ESCAPE_CGROUP = '''
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
mine = open("/proc/self/cgroup").read()
attempts = []
for path in ("/sys/fs/cgroup/memory/cgroup.procs", "/sys/fs/cgroup/pids/cgroup.procs",
             "/sys/fs/cgroup/cgroup.procs", "/sys/fs/cgroup/unified/cgroup.procs"):
    try:
        with open(path, "w") as f:
            f.write(str(os.getpid()))
        attempts.append("wrote " + path)
    except OSError as exc:
        attempts.append(type(exc).__name__)
os.makedirs("mnt", exist_ok=True)
for fstype, data in (("cgroup", b"memory"), ("cgroup2", None)):
    rc = libc.mount(b"none", b"mnt", fstype.encode(), 0, data)
    attempts.append("mounted " + fstype if rc == 0 else os.strerror(ctypes.get_errno()))
print(json.dumps({"mine": mine, "attempts": attempts, "unchanged": open("/proc/self/cgroup").read() == mine}))
'''


def test_a_call_cannot_move_itself_out_of_its_group(sb):
    _require_cgroups(sb)
    res = sb.run_sync(ESCAPE_CGROUP)
    assert res.ok, res
    report = json.loads(res.stdout)
    assert "/call-" in report["mine"], f"the probe is blind: it does not see its own group ({report})"
    assert not any(a.startswith(("wrote", "mounted")) for a in report["attempts"]), report
    assert report["unchanged"], report


def test_a_killed_warm_parent_leaves_no_group_and_no_frozen_process():
    """The warm parent is SIGKILLed while a session (with a spinning daemon thread) is
    frozen between calls: the trainer's side kills, thaws and removes what is left."""
    uid_base = 1_960_000_000 + (os.getpid() % 10_000) * 8  # uids no other test run uses
    sb = Sandbox(SandboxConfig(timeout_s=20, workers=2, max_sessions=1, uid_base=uid_base))
    sb.start()
    try:
        _require_cgroups(sb)
        dirs = sb._zygote.ready["cgroup_dirs"]
        assert dirs and all(os.path.isdir(d) for d in dirs), "the probe is blind: no group to look for"
        with sb.session() as s:
            assert s.run_sync(SPIN_BETWEEN_CALLS).ok
            sb._zygote.kill()
            deadline = time.monotonic() + 10
            while any(os.path.exists(d) for d in dirs) and time.monotonic() < deadline:
                time.sleep(0.1)
    finally:
        sb.close()
    assert not [d for d in dirs if os.path.exists(d)]
    deadline = time.monotonic() + 10
    while _processes_of_uid(uid_base + 2) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_of_uid(uid_base + 2) == []  # the frozen interpreter was thawed and died


def _processes_of_uid(uid: int) -> list[int]:
    """Every process on the machine running as ``uid`` (reparented ones included)."""
    found = []
    for status in glob.glob("/proc/[0-9]*/status"):
        try:
            lines = dict(line.split(":", 1) for line in open(status) if ":" in line)
        except OSError:  # it ended while we looked
            continue
        if int(lines["Uid"].split()[1]) == uid:
            found.append(int(status.split("/")[2]))
    return found
