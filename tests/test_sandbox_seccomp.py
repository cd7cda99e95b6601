"""Attacks on the sandbox's syscall filter and keyrings, written as a snippet would try them.

Every probe runs twice: inside the sandbox, where it must be refused, and in a *control*
without the mechanism (a sandbox with ``benchmark_skip=("seccomp",)``, or a plain
``python``), where it must get through — so a probe that cannot tell the difference fails
instead of passing blind. With ``CI=true`` a missing filter fails instead of skipping.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import subprocess
import sys
import uuid

import pytest

from retool.sandbox import Sandbox, SandboxConfig, SandboxUnavailableError, seccomp
from retool.sandbox.executor import missing_isolation

CI = os.environ.get("CI", "").lower() == "true"
try:
    import pyseccomp  # a dependency on Linux; RuntimeError: libseccomp2 is missing
except (ImportError, RuntimeError) as exc:
    if CI:
        raise
    pytest.skip(f"no syscall filter can be built here ({exc})", allow_module_level=True)
X86_64 = platform.machine() == "x86_64"
ARCH = pyseccomp.system_arch()
X32_BIT = 0x40000000
SIGCHLD = 17


def nr(name: str) -> int:
    return pyseccomp.resolve_syscall(ARCH, name)


@pytest.fixture(scope="module")
def sb():
    with Sandbox(SandboxConfig(timeout_s=20, workers=1, preload=("numpy", "sympy"))) as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def control():
    """The same sandbox without the filter and the keyring switch: where every probe must work."""
    with Sandbox(SandboxConfig(timeout_s=20, workers=1, preload=(), benchmark_skip=("seccomp",))) as sandbox:
        yield sandbox


def require_filter(sb: Sandbox) -> None:
    """Skip (fail under CI=true) unless the filter and the fresh keyring are in force."""
    missing = [m for m in ("seccomp", "fresh_keyring", "uid_drop", "pidns") if m not in sb.isolation]
    if missing:
        message = f"not in force here: {missing} (warnings: {sb._zygote.ready['warnings']})"
        if CI:
            pytest.fail(message)
        pytest.skip(message)


def probe(box: Sandbox, code: str) -> dict:
    """Run ``code`` (which prints one JSON object last) in ``box``; its parsed output."""
    res = box.run_sync(code, auto_print=False)
    assert res.ok, (res.status, res.stderr)
    return json.loads(res.stdout.strip().splitlines()[-1])


SYSCALL_PROBE = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
def call(number, *args):
    ctypes.set_errno(0)
    ret = libc.syscall(ctypes.c_long(number), *(ctypes.c_long(os.getpid() if a == "self" else a) for a in args))
    return os.strerror(ctypes.get_errno()) if ret == -1 else "ok"
print(json.dumps({name: call(number, *args) for name, (number, args) in json.loads(%r).items()}))
"""

# Arguments chosen so that, without the filter, each call fails with something else than
# EPERM where the kernel allows it (a bad fd, a bad address, no such process) or succeeds
# harmlessly: only the filter answers EPERM to all of them.
HARMLESS_ARGS = {
    "keyctl": (0, -3, 0),                      # KEYCTL_GET_KEYRING_ID of @s
    "ptrace": (3, 2 ** 30),                    # PTRACE_PEEKUSER of no such process
    "process_vm_readv": ("self", 0, 0, 0, 0, 0),  # no iovecs of its own memory: succeeds
    "process_vm_writev": ("self", 0, 0, 0, 0, 0),
    "pidfd_getfd": (-1, 0, 0),
    "unshare": (0,),                           # no flags: succeeds without the filter
    "setns": (-1, 0),
    "io_uring_setup": (1, 0),                  # NULL params: EFAULT
    "io_uring_enter": (-1, 0, 0, 0, 0, 0),
    "io_uring_register": (-1, 0, 0, 0),
    "perf_event_open": (0, 0, -1, -1, 0),
    "name_to_handle_at": (-1, 0, 0, 0, 0),
    "mount_setattr": (-1, 0, 0, 0, 0),
    "chroot": (0,),
    "clock_settime": (0, 0),
    "bpf": (-1, 0, 0),
}
DISTINGUISHING = ("keyctl", "ptrace", "process_vm_readv", "unshare", "setns", "io_uring_setup", "chroot")
"""Calls whose answer without the filter is certainly not EPERM (the control checks it)."""


def denied_calls(x32: bool = False) -> dict[str, tuple[int, tuple[int, ...]]]:
    calls = {}
    for name in seccomp.DENIED_SYSCALLS:
        if nr(name) >= 0:
            calls[name] = (nr(name) | (X32_BIT if x32 else 0), HARMLESS_ARGS.get(name, (0,) * 6))
    return calls


def syscall_probe(calls: dict) -> str:
    return SYSCALL_PROBE % json.dumps(calls)


# ---------------------------------------------------------------- the filter is on and stays on


def test_filter_is_in_force_in_calls_and_sessions(sb):
    require_filter(sb)
    status = "print(open('/proc/self/status').read().split('Seccomp:')[1].split()[0])"
    assert sb.run_sync(status).stdout == "2\n"  # SECCOMP_MODE_FILTER
    with sb.session() as s:
        assert s.run_sync("x = 1").ok and s.run_sync(status).stdout == "2\n"
    assert "seccomp" not in missing_isolation(tuple(sb.isolation))


def test_every_denied_syscall_is_eperm_and_the_probe_is_not_blind(sb, control):
    require_filter(sb)
    calls = denied_calls()
    inside = probe(sb, syscall_probe(calls))
    assert inside == {name: os.strerror(errno.EPERM) for name in calls}
    without = probe(control, syscall_probe({n: calls[n] for n in DISTINGUISHING}))
    assert all(answer != os.strerror(errno.EPERM) for answer in without.values()), without


def test_a_denied_syscall_is_a_clear_permission_error(sb):
    require_filter(sb)
    code = ("import os\ntry:\n    os.unshare(os.CLONE_NEWUSER) if hasattr(os, 'unshare') else os.chroot('/')\n"
            "except PermissionError as exc:\n    print(type(exc).__name__, exc.errno)")
    assert sb.run_sync(code).stdout == f"PermissionError {errno.EPERM}\n"


@pytest.mark.skipif(not X86_64, reason="the x32 ABI exists only on x86_64")
def test_x32_numbers_of_every_call_are_denied(sb, control):
    require_filter(sb)
    calls = {**denied_calls(x32=True), "getpid": (39 | X32_BIT, ())}
    inside = probe(sb, syscall_probe(calls))
    assert inside == {name: os.strerror(errno.EPERM) for name in calls}
    # without the filter an x32 call is answered by the kernel (ENOSYS where x32 is off)
    assert probe(control, syscall_probe({"getpid": calls["getpid"]}))["getpid"] != os.strerror(errno.EPERM)


I386_GETPID = """
import ctypes, json, mmap
page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))  # mov eax, 20 (i386 getpid); int 0x80; ret
address = ctypes.addressof(ctypes.c_char.from_buffer(page))
print(json.dumps({"eax": ctypes.CFUNCTYPE(ctypes.c_int)(address)()}))
"""


@pytest.mark.skipif(not X86_64, reason="the i386 ABI (int 0x80) exists only on x86")
def test_i386_calls_through_int_0x80_are_denied(sb, control):
    require_filter(sb)
    res = control.run_sync(I386_GETPID, auto_print=False)
    if not res.ok:
        pytest.skip(f"this kernel has no i386 emulation (int 0x80 ends the process: {res.status})")
    assert json.loads(res.stdout)["eax"] > 0  # the control reaches the i386 getpid
    assert probe(sb, I386_GETPID)["eax"] == -errno.EPERM


CLONE_PROBE = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
answers = {}
for name, flag in json.loads(%r).items():
    ctypes.set_errno(0)
    pid = libc.syscall(ctypes.c_long(%d), ctypes.c_long(flag | 17), 0, 0, 0, 0)  # | SIGCHLD
    if pid == 0:
        os._exit(0)  # the child, in its new namespace
    if pid > 0:
        os.waitpid(pid, 0)
    answers[name] = "ok" if pid > 0 else os.strerror(ctypes.get_errno())
print(json.dumps(answers))
"""


def test_clone_with_a_namespace_flag_is_denied_and_plain_clone3_falls_back(sb, control):
    require_filter(sb)
    flags = seccomp.NAMESPACE_CLONE_FLAGS
    inside = probe(sb, CLONE_PROBE % (json.dumps(flags), nr("clone")))
    assert inside == {name: os.strerror(errno.EPERM) for name in flags}
    assert probe(sb, CLONE_PROBE % (json.dumps({"no namespace": 0}), nr("clone"))) == {"no namespace": "ok"}
    clone3 = probe(sb, syscall_probe({"clone3": (nr("clone3"), (0, 0))}))
    assert clone3 == {"clone3": os.strerror(errno.ENOSYS)}  # glibc then uses clone


def test_the_snippet_cannot_lift_or_loosen_the_filter(sb):
    require_filter(sb)
    code = f"""
import ctypes, json, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
class Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Insn))]
allow_all = (Insn * 1)(Insn(0x06, 0, 0, 0x7FFF0000))  # BPF_RET SECCOMP_RET_ALLOW
added = libc.prctl(22, ctypes.c_ulong(2), ctypes.byref(Prog(1, allow_all)), 0, 0)  # PR_SET_SECCOMP
unset_nnp = libc.prctl(38, ctypes.c_ulong(0), 0, 0, 0), ctypes.get_errno()  # PR_SET_NO_NEW_PRIVS 0
ctypes.set_errno(0)
keyctl = libc.syscall(ctypes.c_long({nr("keyctl")}), ctypes.c_long(0), ctypes.c_long(-3), 0), ctypes.get_errno()
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
seccomp_mode = "print(open('/proc/self/status').read().split('Seccomp:')[1].split()[0])"
child = subprocess.run([sys.executable, "-c", seccomp_mode], capture_output=True, text=True).stdout.strip()
print(json.dumps({{"added": added, "unset_nnp": unset_nnp, "keyctl": keyctl, "nnp": libc.prctl(39, 0, 0, 0, 0),
                   "filters": int(status["Seccomp_filters"]), "child": child}}))
"""
    got = probe(sb, code)
    assert got["added"] == 0 and got["filters"] == 2  # stacked on ours, not replacing it
    assert got["keyctl"] == [-1, errno.EPERM]  # the strictest answer wins
    assert got["unset_nnp"] == [-1, errno.EINVAL] and got["nnp"] == 1
    assert got["child"] == "2"  # an exec'd child is filtered too


# ---------------------------------------------------------------- keyrings


KEY_PROBE = """
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
def keyctl(*args):
    ctypes.set_errno(0)
    return libc.syscall(ctypes.c_long({keyctl}), *args), ctypes.get_errno()
# KEYCTL_SEARCH, linking what it finds into the thread keyring (-1): then this thread
# possesses the key, which lets it read the key even from a session keyring it cannot search
serial, err = keyctl(ctypes.c_long(10), ctypes.c_long({keyring}), b"user", {description!r}, ctypes.c_long(-1))
listed = {description!r}.decode() in open("/proc/keys").read()  # what it may view, before invalidating
payload = ""
if serial > 0:  # found it: KEYCTL_READ it
    buf = ctypes.create_string_buffer(256)
    size, err = keyctl(ctypes.c_long(11), ctypes.c_long(serial), buf, ctypes.c_long(256))
    payload = buf.raw[:max(size, 0)].decode(){then}
print(json.dumps({{"payload": payload, "errno": err, "listed": listed}}))
"""
INVALIDATE = "\n    keyctl(ctypes.c_long(21), ctypes.c_long(serial))  # KEYCTL_INVALIDATE: leave nothing behind"


def key_probe(description: str, keyring: int, invalidate: bool = False) -> str:
    return KEY_PROBE.format(keyctl=nr("keyctl"), keyring=keyring, description=description.encode(),
                            then=INVALIDATE if invalidate else "")


def add_key(description: str, payload: str, keyring: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(ctypes.c_long(nr("add_key")), b"user", description.encode(), payload.encode(),
                        ctypes.c_size_t(len(payload)), ctypes.c_long(keyring))


def test_the_servers_session_keyring_is_out_of_reach(sb):
    require_filter(sb)
    description, payload = f"retool-control-{uuid.uuid4().hex}", f"secret-{uuid.uuid4().hex}"
    serial = add_key(description, payload, -3)  # @s of this test process: the sandbox's too
    if serial < 0:
        pytest.skip(f"keyctl is refused to this test process ({os.strerror(ctypes.get_errno())})")
    try:
        code = key_probe(description, -3)
        outside = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert json.loads(outside.stdout) == {"payload": payload, "errno": 0, "listed": True}  # not blind
        with Sandbox(SandboxConfig(timeout_s=20, workers=1, preload=())) as started_here:  # in this keyring
            inside = probe(started_here, code)
            by_serial = probe(started_here, code.replace("serial, err = keyctl(", f"serial = {serial}\n_ = keyctl(", 1))
        # the filter refuses keyctl; the fresh keyring keeps even the key's description out of /proc/keys
        assert inside == {"payload": "", "errno": errno.EPERM, "listed": False}
        assert by_serial["payload"] == ""
    finally:
        ctypes.CDLL(None).syscall(ctypes.c_long(nr("keyctl")), ctypes.c_long(21), ctypes.c_long(serial))


USER_KEYRING = -4
WRITE_USER_KEY = """
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
ctypes.set_errno(0)
serial = libc.syscall(ctypes.c_long({add_key}), b"user", {description!r}, b"left-behind", ctypes.c_size_t(11),
                      ctypes.c_long(-4))
print(json.dumps({{"serial": serial, "errno": ctypes.get_errno()}}))
"""


def test_a_key_written_to_the_uids_user_keyring_does_not_reach_a_later_call(sb, control):
    require_filter(sb)
    for box, blocked in ((control, False), (sb, True)):  # the control shows the probe pair works
        description = f"retool-user-key-{uuid.uuid4().hex}"
        write = WRITE_USER_KEY.format(add_key=nr("add_key"), description=description.encode())
        written = probe(box, write)
        later = probe(box, key_probe(description, USER_KEYRING, invalidate=True))  # same slot: same uid
        if blocked:
            assert written == {"serial": -1, "errno": errno.EPERM}
            assert later == {"payload": "", "errno": errno.EPERM, "listed": False}
        else:
            assert written["serial"] > 0 and later["payload"] == "left-behind" and later["listed"], (written, later)


# ---------------------------------------------------------------- what snippets need still works


WORKLOAD = """
import concurrent.futures, multiprocessing, subprocess, sys, threading
import numpy as np, sympy
def square(x):
    return x * x
with multiprocessing.Pool(2) as pool:
    squares = pool.map(square, range(5))
with concurrent.futures.ThreadPoolExecutor(4) as ex:
    doubled = list(ex.map(lambda x: 2 * x, range(5)))
child = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True).stdout.strip()
shell = subprocess.run("echo hi | tr a-z A-Z", shell=True, capture_output=True, text=True).stdout.strip()
eig = sorted(np.linalg.eigvalsh(np.array([[2.0, 1.0], [1.0, 2.0]])).round(6).tolist())
print(squares, doubled, child, shell, eig, sympy.factorint(360), sympy.solve(sympy.Symbol("x") ** 2 - 4))
"""
EXPECTED = "[0, 1, 4, 9, 16] [0, 2, 4, 6, 8] 42 HI [1.0, 3.0] {2: 3, 3: 2, 5: 1} [-2, 2]\n"


def test_numpy_sympy_multiprocessing_threads_and_subprocess_work_in_a_call(sb):
    require_filter(sb)
    res = sb.run_sync(WORKLOAD)
    assert (res.stdout, res.stderr) == (EXPECTED, "")


def test_the_same_work_runs_in_a_session(sb):
    require_filter(sb)
    with sb.session() as s:
        first = s.run_sync(WORKLOAD)
        again = s.run_sync("print(squares, child)")
    assert first.stdout == EXPECTED and again.stdout == "[0, 1, 4, 9, 16] 42\n"


# ---------------------------------------------------------------- the filter itself; strict


def test_the_compiled_filter_works_in_a_plain_child():
    """Without the sandbox around it: a forked child with the filter gets EPERM from keyctl
    and ENOSYS from clone3, while an ordinary call (getpid) still answers."""
    compiled = seccomp.compile_filter()
    assert len(compiled.program) % 8 == 0 and compiled.keyctl_nr == nr("keyctl")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            seccomp.install(compiled)
            libc = ctypes.CDLL(None, use_errno=True)
            answers = [libc.syscall(ctypes.c_long(nr("keyctl")), 0, -3, 0), ctypes.get_errno(),
                       libc.syscall(ctypes.c_long(nr("clone3")), 0, 0), ctypes.get_errno(),
                       libc.syscall(ctypes.c_long(nr("getpid"))) == os.getpid()]
            os.write(write_end, json.dumps(answers).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    answers = json.loads(os.read(read_end, 1000))
    os.waitpid(pid, 0)
    os.close(read_end)
    assert answers == [-1, errno.EPERM, -1, errno.ENOSYS, True]


def test_strict_refuses_a_warm_parent_without_the_filter(tmp_path):
    """An interpreter without pyseccomp cannot build the filter: strict refuses it."""
    system_python = "/usr/bin/python3"
    check = subprocess.run([system_python, "-c", "import pyseccomp"], capture_output=True) if os.path.exists(
        system_python) else None
    if check is None or check.returncode == 0:
        pytest.skip("no interpreter without pyseccomp here to start the warm parent with")
    assert "seccomp" in missing_isolation(("mountns",))
    with pytest.raises(SandboxUnavailableError, match="missing.*seccomp"):
        Sandbox(SandboxConfig(strict=True, preload=(), python=system_python)).start()
    with Sandbox(SandboxConfig(preload=(), python=system_python)) as degraded:
        assert degraded.run_sync("1 + 1").stdout == "2\n" and "seccomp" not in degraded.isolation
        assert any("no syscall filter" in w for w in degraded._zygote.ready["warnings"])
