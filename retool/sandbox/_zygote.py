"""The warm parent of the sandbox: one long-lived process that forks a fresh child per call.

This file runs as its own script (``python -s -B -P _zygote.py CONFIG_JSON``), started by
:mod:`retool.sandbox.executor` through a clean ``exec`` with a scrubbed environment, so
nothing of the trainer's memory or environment is ever in it. It imports only the
standard library itself (and its sibling file ``seccomp.py``, whose compiler uses pyseccomp
when installed); the modules named in ``preload`` (numpy, sympy, ...) are
imported once and every call's child inherits them already loaded.

Process tree (Linux, with namespaces available)::

    launcher    enters new user(*)/mount/net/ipc/pid namespaces once, builds the calls'
     |          root filesystem (read-only binds of the system and Python directories plus
     |          a size-capped tmpfs for call directories) and pivot_roots into it
     zygote     pid 1 of that shared namespace; imports ``preload``, then gc.freeze()s so
     |          children do not copy its heap; serves requests, enforces timeouts and
     |          output caps, reaps                 (*) user namespace only when not root
     +- init    per call: ``sleep infinity`` spawned (vfork+exec, cheap) as pid 1 of a
     |          fresh PID namespace. Killing it makes the kernel kill every process in
     |          that namespace: how a call's tree dies, setsid/double-fork included.
     +- runner  per call: forked into that namespace as pid 2 (by the slot's template, in
                the slot's control group, usually ahead of its call: ``prefork``);
                takes a private /proc, /dev/shm and IPC namespace, waits for its
                request on a socket of its own, applies rlimits, drops to the call slot's
                unprivileged uid (or all capabilities), resets interpreter state, joins
                a fresh session keyring, installs the syscall filter (``seccomp.py``)
                and runs the snippet as ``python main.py`` would (written to its
                working directory, seen at WORK_DIR), plus ast-based auto-print when asked

Control protocol: JSON lines on stdin (requests) and stdout (replies); bytes travel as
base64. Children never hold the control pipes. The zygote is single-threaded, so
forking it is safe.
"""

from __future__ import annotations

import ast
import atexit
import base64
import builtins
import collections
import contextlib
import ctypes
import errno
import fcntl
import gc
import importlib
import importlib.util
import io
import json
import linecache
import math
import os
import resource
import select
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import types

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MS_REC, MS_PRIVATE = 1 << 14, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_MOUNT_SETATTR = 442  # same number on every architecture (added in Linux 5.12)
SYS_CAPSET = {"x86_64": 126, "aarch64": 91}
SYS_CLONE = {"x86_64": 56, "aarch64": 220}.get(os.uname().machine, -1)
CLONE_PARENT = 0x00008000
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine, -1)
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, AT_RECURSIVE, AT_FDCWD = 0x1, 0x2, 0x8000, -100
MS_BIND, MNT_DETACH = 4096, 2

MAX_FD = 1 << 16
MAX_TRACEBACK_FRAMES = 200
EXIT_SETUP_FAILED = 70
"""Exit code of a call's init or runner when isolation could not be applied."""
SCRIPT_NAME = "main.py"
"""The file the snippet is written to in its working directory and run as (``python main.py``)."""
WORK_DIR = "/sandbox/work"
"""Where every call's working directory appears inside the sandbox (a bind mount in the
call's private mount namespace): the same neutral path for every call, never a host path.
Without a private mount namespace the call runs in its real directory."""


def _load_sibling(name: str) -> types.ModuleType:
    """Import ``retool/sandbox/<name>.py`` as a plain file: this script runs with ``-P`` and
    without the ``retool`` package (nor its imports) in the warm parent."""
    spec = importlib.util.spec_from_file_location(f"_retool_sandbox_{name}", os.path.join(
        os.path.dirname(os.path.abspath(__file__)), f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_cgroups = _load_sibling("_cgroups")
CPU_POLL_S = 0.05
"""How often the zygote reads the CPU time of running calls' groups to enforce their bound."""
SETTLE_POLL_S = 0.001
"""How often the zygote looks whether a session's group, frozen after its call, is frozen yet."""
FREEZE_IDLE_S = 0.01
"""How long a session's group stays unfrozen after its call: a next call that comes
sooner (back to back) finds it unfrozen and needs neither freeze nor thaw, only a look at
who is in the group; one that comes later (in training: the seconds a model takes to
write it) finds it frozen. What the session's threads use of the CPU meanwhile is
charged to its next call."""
PREFORK_IDLE_S = 0.05
"""How long the zygote must have had nothing to do before it forks a child ahead: longer
than a session's calls are apart when they come back to back, far shorter than the time
a model takes to write its next call."""
DEMOTED_NICE = 19
"""The nice value of a stateless call past ``demote_after_s`` (the lowest priority)."""
PREFORK_NICE = 10
"""How much lower the templates run (as root): children forked ahead take spare CPU only."""
seccomp = _load_sibling("seccomp")
SYSCALL_FILTER: seccomp.Filter | None = None
"""The calls' syscall filter, compiled by the launcher before it leaves the host's
filesystem (libseccomp is found there); None where it could not be (``FILTER_PROBLEM``)."""
FILTER_PROBLEM = "not compiled"

_libc = None


def libc():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    _check(libc().unshare(flags), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(libc().setns(fd, nstype), "setns")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(libc().mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                        ctypes.c_ulong(flags), data.encode() if data else None), f"mount {target}")


def prctl(option: int, arg: int) -> None:
    _check(libc().prctl(option, ctypes.c_ulong(arg), 0, 0, 0), "prctl")


def set_mount_attr(path: str, attrs: int) -> None:
    """Set mount attributes (e.g. read-only) on ``path`` and every mount below it (Linux >= 5.12)."""
    attr = ctypes.create_string_buffer(attrs.to_bytes(8, "little") + bytes(24))
    _check(libc().syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), AT_RECURSIVE, attr, 32), "mount_setattr")


def drop_all_capabilities() -> None:
    """Clear the effective, permitted and inheritable capability sets (capset v3)."""
    number = SYS_CAPSET.get(os.uname().machine)
    if number is None:
        raise OSError(errno.ENOSYS, "capset: unknown architecture")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(libc().syscall(number, header, data), "capset")


# ---------------------------------------------------------------- launcher


def setup_namespaces(cfg: dict, base: str) -> tuple[list[str], list[str], str]:
    """Enter the namespaces shared by every call and build the calls' root filesystem.

    Returns (mechanisms in force, warnings, directory that holds the call directories).
    """
    if not sys.platform.startswith("linux"):
        return [], [f"no namespaces on {sys.platform}: only rlimits apply"], base
    isolation: list[str] = []
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | (0 if cfg["network"] else CLONE_NEWNET)
    try:
        if os.geteuid() != 0:
            _enter_user_namespace(flags)
            isolation.append("userns")
        else:
            unshare(flags)
        mount("none", "/", None, MS_REC | MS_PRIVATE)
    except OSError as exc:
        return isolation, [f"namespaces unavailable ({exc}); calls run without them"], base
    isolation += ["mountns", "ipcns"] + ([] if cfg["network"] else ["netns"])
    try:
        pivot_to_minimal_root(base, cfg["scratch_mb"], python_paths(), "userns" in isolation)
        return isolation + ["minimal_root", "readonly_fs", "scratch_tmpfs"], [], CALLS_DIR
    except OSError as exc:
        return isolation, [f"could not build the calls' root filesystem ({exc}); "
                           "the whole host filesystem is visible to them with their uid's rights"], base


CALLS_DIR = "/sandbox"
"""Inside the calls' root filesystem: the tmpfs that holds every call's working directory."""
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/dev", "/sys")
"""Host paths every call sees (read-only), besides the Python installation."""
SHALLOW_PATHS = ("/dev", "/sys")


def python_paths() -> list[str]:
    """Directories this interpreter needs: its prefixes and every directory on sys.path."""
    candidates = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                  os.path.dirname(os.path.realpath(sys.executable))}
    candidates.update(p for p in sys.path if p and os.path.isdir(p))
    candidates.update({os.path.realpath(p) for p in candidates})
    return sorted(p for p in candidates if os.path.isdir(p))


def pivot_to_minimal_root(new_root: str, scratch_mb: int, extra: list[str], user_namespace: bool) -> None:
    """Make a tmpfs at ``new_root`` holding read-only binds of the system and Python
    directories, a size-capped writable tmpfs at :data:`CALLS_DIR` for the call
    directories, an empty read-only ``/tmp`` and a ``/proc`` mount point; then ``pivot_root`` into it. Everything else of the host (the
    repository, /root, /home) does not exist for the sandbox."""
    mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=0755")
    bound: list[str] = []
    for path in [*SYSTEM_PATHS, *extra]:
        if not os.path.lexists(path) or any(path == b or path.startswith(b + "/") for b in bound):
            continue
        target = new_root + path
        if os.path.islink(path) and path in SYSTEM_PATHS:
            os.symlink(os.readlink(path), target)
            continue
        os.makedirs(target, mode=0o755, exist_ok=True)
        # /dev and /sys without their submounts (pts, shm, cgroups): fewer mounts make
        # each call's private mount namespace cheaper to create and to tear down
        try:
            mount(path, target, None, MS_BIND if path in SHALLOW_PATHS else MS_BIND | MS_REC)
        except OSError as exc:  # in a user namespace, submounts are locked to their parent
            if exc.errno != errno.EINVAL:
                raise
            mount(path, target, None, MS_BIND | MS_REC)
        bound.append(path)
    for name in ("proc", "tmp", CALLS_DIR):
        os.makedirs(new_root + "/" + name.lstrip("/"), mode=0o755, exist_ok=True)
    if os.geteuid() != 0 or user_namespace:
        # a user namespace may mount a new proc only where a full one is visible: keep
        # the host's underneath (covered by the zygote's and each call's own /proc)
        mount("/proc", new_root + "/proc", None, MS_BIND | MS_REC)
    set_mount_attr(new_root, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID)
    mount("tmpfs", new_root + CALLS_DIR, "tmpfs", MS_NOSUID | MS_NODEV, f"size={scratch_mb}m,mode=0755")
    os.chdir(new_root)
    _check(libc().syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    _check(libc().umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")


def _enter_user_namespace(flags: int) -> None:
    uid, gid = os.geteuid(), os.getegid()
    unshare(CLONE_NEWUSER | flags)
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def launcher_main() -> None:
    """Entry point: set up shared namespaces, fork the zygote (pid 1 inside), wait for it."""
    cfg = json.loads(sys.argv[1])
    base = tempfile.mkdtemp(prefix="retool-sandbox-", dir=cfg.get("base_dir"))
    os.chmod(base, 0o755)
    parent_fd = os.open(os.path.dirname(base), os.O_RDONLY | os.O_DIRECTORY)  # the host's view
    cgroups, cgroup_warning = _open_cgroups(cfg)  # before the root is pivoted: cgroupfs is not in it
    _compile_syscall_filter(cfg)
    isolation, warnings, calls_dir = setup_namespaces(cfg, base)
    if cgroups is not None:
        isolation.append(f"cgroup_{cgroups.version}")
    else:
        warnings.append(cgroup_warning)
    pid = os.fork()
    if pid == 0:
        try:
            if "mountns" in isolation:
                prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            Zygote(cfg, calls_dir, base, isolation, warnings, cgroups).serve()
        except BaseException:
            traceback.print_exc()  # to the trainer's stderr: the zygote is broken
            os._exit(1)
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)  # the trainer must see EOF as soon as the zygote dies
    os.dup2(devnull, 1)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: os.kill(pid, signal.SIGKILL))
    _, status = os.waitpid(pid, 0)
    if "minimal_root" in isolation:
        _remove_mount_point(os.path.basename(base), parent_fd)
    else:
        shutil.rmtree(base, ignore_errors=True)
    if cgroups is not None:
        try:
            cgroups.close()
        except OSError as exc:
            sys.stderr.write(f"retool sandbox: could not remove its control groups: {exc}\n")
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _open_cgroups(cfg: dict) -> tuple[object | None, str]:
    """The sandbox's control groups (see :mod:`_cgroups`), or None and why not."""
    if "cgroups" in cfg.get("benchmark_skip", ()):
        return None, "no control groups (left out)"
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return None, "no control groups (they need root on Linux): memory, processes and CPU are bounded per process only"
    try:
        return _cgroups.Hierarchy.open(f"retool-sandbox-{os.getpid()}"), ""
    except OSError as exc:
        return None, f"no control groups ({exc}): memory, processes and CPU are bounded per process only"


def _compile_syscall_filter(cfg: dict) -> None:
    global SYSCALL_FILTER, FILTER_PROBLEM
    if "seccomp" in cfg.get("benchmark_skip", ()):
        FILTER_PROBLEM = "left out (benchmark_skip)"
        return
    try:
        SYSCALL_FILTER = seccomp.compile_filter()
    except (seccomp.FilterUnavailable, OSError) as exc:
        FILTER_PROBLEM = str(exc)


def _remove_mount_point(name: str, parent_fd: int) -> None:
    """Remove the (empty, host-side) directory the calls' root was mounted on; the mount
    lives only in our namespace, which is gone by now, so the host sees a plain empty dir."""
    try:
        os.rmdir(name, dir_fd=parent_fd)
    except OSError:
        pass  # the trainer tries again when it closes the sandbox


# ---------------------------------------------------------------- zygote


class Call:
    """The zygote's bookkeeping for one running call."""

    def __init__(self, req: dict, slot: int, directory: str):
        self.req = req
        self.id = req["id"]
        self.slot = slot
        self.dir = directory
        self.pid = 0  # the runner
        self.init_pid = 0  # pid 1 of its PID namespace, when there is one
        self.pidfd: int | None = None
        self.fds: dict[str, int] = {}
        self.bufs = {"stdout": bytearray(), "stderr": bytearray(), "info": bytearray()}
        self.started = time.monotonic()
        self.deadline = self.started + req["timeout_s"]
        self.killed: str | None = None  # "timeout" / "output_limit" / "cancelled"
        self.demote_at = math.inf  # when it goes to DEMOTED_NICE (stateless calls only)
        self.demoted = False
        self.demoted_pids: dict[int, int] = {}  # pid -> the session it was demoted in
        self.done = False  # answered and cleaned up
        self.session: Session | None = None  # the stateful interpreter it runs in, if any
        self.fresh = True  # runs in an interpreter started for it (always, without a session)
        self.state_lost: str | None = None  # why the session's previous interpreter ended
        self.baseline: int | None = None  # address space the call started from (sessions)
        self.cpu_before = 0.0  # interpreter CPU seconds before the call (sessions)
        self.group = None  # its control group (the slot's or the session's), if any
        self.group_cpu_base = 0.0  # the group's CPU seconds when the call started (sessions: when the last ended)


class Session:
    """The zygote's bookkeeping for one stateful interpreter: a long-lived process, forked
    like a call's runner (same namespaces, uid, limits), that keeps its globals across the
    calls sent to it. Its uid is its own (``uid_base + workers + slot``)."""

    def __init__(self, sid: str, slot: int, uid: int):
        self.id = sid
        self.slot = slot
        self.uid = uid
        self.pid = 0  # the interpreter (pid 1 of its own PID namespace); 0 while there is none
        self.pidfd: int | None = None
        self.dir = ""
        self.fds: dict[str, int] = {}  # stdout, stderr, info (read ends) and control (write end)
        self.info = bytearray()  # an info line not yet complete
        self.outbuf = bytearray()  # request bytes not yet written to control
        self.call: Call | None = None
        self.calls = 0  # calls sent to the current interpreter
        self.lost: str | None = None  # why the previous interpreter ended, until a call reports it
        self.generation = 0  # which interpreter of the session an event belongs to
        self.reported: dict = {}  # the interpreter's last "done" report (its CPU time so far)
        self.group = None  # its control group, if any (frozen between calls)
        self.settled = False  # frozen since its last call with the interpreter alone in it
        self.frozen = False  # its group is frozen (or freezing): nothing of the session runs
        self.idle_since = 0.0  # when its last call ended (it is frozen FREEZE_IDLE_S later)
        self.cpu_mark: float | None = None  # its group's CPU seconds when its last call ended


class Child:
    """A call's runner or a session's interpreter, forked (usually ahead of its work) and
    waiting on its ``go`` socket for the request (:meth:`Zygote._hand_over`)."""

    def __init__(self, kind: str, slot: int, uid: int, directory: str):
        self.kind = kind  # "call" or "session"
        self.slot = slot
        self.uid = uid
        self.dir = directory  # its own tmpfs (with scratch_quota)
        self.pid = 0  # 0 until the template answers its fork
        self.init_pid = 0  # a call's pid 1 of its PID namespace, when there is one
        self.fds: dict[str, int] = {}  # the zygote's ends: stdout, stderr, info (+ a session's control)
        self.go: socket.socket | None = None
        self.group = None  # its control group, if any
        self.born_inside = False  # forked by a template living in that group
        self.template: Template | None = None  # the template asked to fork it
        self.error: str | None = None  # why the template could not fork it


class Zygote:
    """Serves run requests: at most ``workers`` calls at once, one fresh process tree each."""

    def __init__(self, cfg: dict, base: str, host_dir: str, isolation: list[str], warnings: list[str],
                 cgroups=None):
        self.cfg = cfg
        self.cgroups = cgroups  # a _cgroups.Hierarchy, or None
        self.next_cpu_check = 0.0
        self.base = base
        self.host_dir = host_dir
        self.isolation = isolation
        self.warnings = warnings
        self.sel = selectors.DefaultSelector()
        self.queue: collections.deque[dict] = collections.deque()
        self.calls: dict[str, Call] = {}
        self.free_slots = list(range(cfg["workers"]))
        self.sessions: dict[str, Session] = {}
        self.free_session_slots = list(range(cfg.get("max_sessions", 0)))
        self.inbuf = bytearray()
        self.pidns_fd: int | None = None
        self.root = os.geteuid() == 0 and "userns" not in isolation
        self.env = dict(os.environ)
        self.skip = set(cfg.get("benchmark_skip", ()))
        self.private_mounts = False
        self.work_dir: str | None = None  # the fixed path calls run at, when they can
        self.sleep_binary = shutil.which("sleep", path="/usr/bin:/bin")
        self.scratch_quota = False  # each call and session directory is a tmpfs of its own
        self.session_netns = False  # each session's interpreter gets a network namespace of its own
        self.template: Template | None = None  # forks every call's and session's process
        self.slot_templates: dict[int, Template] = {}  # one per call slot, inside the slot's group
        self.confine = False  # a fresh session keyring and the syscall filter, once probed
        self.prefork = False  # children are forked ahead of their work (by a template only)
        self.prefork_paused_until = 0.0
        self.last_busy = 0.0  # when the serve loop last handled an event
        self.priority = os.getpriority(os.PRIO_PROCESS, 0)  # the zygote's nice value
        self.ready_calls: dict[int, Child] = {}  # call slot -> its runner, forked ahead
        self.ready_sessions: dict[int, Child] = {}  # session slot -> its interpreter, forked ahead
        self.idle: list[Session] = []  # sessions between calls, not frozen yet (see FREEZE_IDLE_S)
        self.settling: list[Session] = []  # sessions between calls, freezing, not yet checked

    # ---- start-up

    def serve(self) -> None:
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        loaded, failed = self._preload()
        gc.collect()
        gc.freeze()  # children never scan (and so never copy) the parent's objects
        self._probe_call_isolation()
        self._start_template()
        self._reply({"op": "ready", "isolation": self.isolation, "warnings": self.warnings,
                     "preloaded": loaded, "preload_failed": failed, "calls_dir": self.base,
                     "host_dir": self.host_dir,
                     "cgroup_dirs": self.cgroups.paths if self.cgroups is not None else [],
                     "root": self.root, "pid": os.getpid()})
        os.set_blocking(0, False)
        self.sel.register(0, selectors.EVENT_READ, ("control", None))
        while True:
            events = self.sel.select(self._next_timeout())
            if events:
                self.last_busy = time.monotonic()
            for key, _ in events:
                kind, call = key.data
                if kind == "control":
                    if not self._read_control():
                        return self._shutdown()
                elif kind == "session":
                    self._on_session_event(*call)
                elif kind == "template":
                    call.receive(wait=False)
                elif call.done:
                    continue  # stale: the call finished earlier in this batch (its fds may be reused)
                elif kind == "exit":
                    self._guarded(call, lambda c=call: self._on_exit(c))
                else:
                    self._guarded(call, lambda c=call, k=kind: self._on_output(c, k))
            self._poll_without_pidfd()
            self._enforce_deadlines()
            self._settle_sessions()
            self._replenish()

    def _guarded(self, call: Call, handle) -> None:
        """Run one event handler; a bug in it fails that call (sandbox_error), not the zygote."""
        try:
            handle()
        except Exception:
            self._kill(call, "cancelled")
            _reap(call.pid)
            _reap(call.init_pid)
            if not call.done:
                self._cleanup(call)
                self._reply({"op": "result", "id": call.id, "sandbox_error": traceback.format_exc()[-2000:]})
                self._start_queued()

    def _preload(self) -> tuple[list[str], dict[str, str]]:
        loaded, failed = [], {}
        for name in self.cfg["preload"]:
            try:
                importlib.import_module(name)
                loaded.append(name)
            except Exception as exc:  # a missing optional module is recorded, not fatal
                failed[name] = f"{type(exc).__name__}: {exc}"
        return loaded, failed

    def _probe_call_isolation(self) -> None:
        """Decide what each call gets; a per-call PID namespace is unshare(CLONE_NEWPID)
        before the call's first fork and setns back to ours after it."""
        linux = sys.platform.startswith("linux")
        if "minimal_root" in self.isolation:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # our own pid namespace's
        if linux and "mountns" in self.isolation and "pidns" not in self.skip:
            try:
                self.pidns_fd = os.open("/proc/self/ns/pid", os.O_RDONLY)
                unshare(CLONE_NEWPID)
                setns(self.pidns_fd, CLONE_NEWPID)
                self.isolation.append("pidns")
            except OSError as exc:
                self.pidns_fd = None
                self.warnings.append(f"no per-call PID namespace ({exc})")
        if self.pidns_fd is None:
            self.warnings.append("no per-call PID namespace: a call's setsid() children may outlive it")
        self.private_mounts = "mountns" in self.isolation and "private_mounts" not in self.skip
        if self.private_mounts and "minimal_root" in self.isolation:
            os.makedirs(WORK_DIR, mode=0o755, exist_ok=True)
            self.work_dir = WORK_DIR
        if self.private_mounts:
            self.isolation += ["private_proc", "private_shm"] if self.pidns_fd is not None else ["private_shm"]
        self.scratch_quota = "minimal_root" in self.isolation and "scratch_quota" not in self.skip
        if self.scratch_quota:
            self.isolation.append("scratch_quota")
        self.session_netns = "netns" in self.isolation and "session_netns" not in self.skip
        if self.session_netns:
            self.isolation.append("session_netns")
        if "privilege_drop" not in self.skip:
            self.isolation += ["uid_drop" if self.root else "caps_drop", "no_new_privs"]
        if "rlimits" not in self.skip:
            self.isolation.append("rlimits")
        self._probe_syscall_filter()

    def _probe_syscall_filter(self) -> None:
        """Try the keyring switch and the filter once in a throw-away child: the calls
        get them only if they work on this kernel (a call must not fail for want of them)."""
        if SYSCALL_FILTER is None:
            self.warnings.append(f"no syscall filter ({FILTER_PROBLEM})")
            return
        pid = _fork_running(_probe_confinement)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code in (0, PROBE_NO_KEYCTL):
            self.isolation += ["seccomp"] + (["fresh_keyring"] if code == 0 else [])
            self.confine = True
        else:
            self.warnings.append(f"no syscall filter (installing it failed in a test child, exit code {code})")
        if code == PROBE_NO_KEYCTL:
            self.warnings.append("keyctl is refused here already: no fresh session keyring needed")

    # ---- control channel

    def _reply(self, msg: dict) -> None:
        data = (json.dumps(msg) + "\n").encode()
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(1, view):]
            except BlockingIOError:
                selectors.DefaultSelector().select(0.01)

    def _read_control(self) -> bool:
        try:
            chunk = os.read(0, 1 << 20)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        self.inbuf += chunk
        while (end := self.inbuf.find(b"\n")) >= 0:
            line, self.inbuf = bytes(self.inbuf[:end]), self.inbuf[end + 1:]
            self._on_request(json.loads(line))
        return True

    def _on_request(self, req: dict) -> None:
        if req.get("op") == "cancel":
            return self._cancel(req["id"])
        if req.get("op") == "close_session":
            return self._close_session(req)
        self.queue.append(req)
        self._start_queued()
        if any(r is req for r in self.queue):  # it waits (for a worker, or for its session)
            req["queued"] = True  # the client's watchdog waits for "started" (sent then)
            self._reply({"op": "queued", "id": req["id"]})

    def _cancel(self, call_id: str) -> None:
        for req in list(self.queue):
            if req["id"] == call_id:
                self.queue.remove(req)
                self._reply({"op": "result", "id": call_id, "cancelled": True})
        if call_id in self.calls:
            self._kill(self.calls[call_id], "cancelled")

    def _start_queued(self) -> None:
        """Start queued calls, in order, while fewer than ``workers`` run. A session's call
        waits while that session runs another one, or while no session slot is free."""
        waiting: collections.deque[dict] = collections.deque()
        while self.queue:
            req = self.queue.popleft()
            if len(self.calls) >= self.cfg["workers"] or not self._can_start(req):
                waiting.append(req)
                continue
            try:
                if req.get("session") is None:
                    slot = self.free_slots.pop(0)
                    try:
                        self._spawn(req, slot)
                    except BaseException:
                        self.free_slots.append(slot)
                        raise
                else:
                    self._start_session_call(req)
            except Exception as exc:  # the call is answered as sandbox_error, the zygote lives on
                self._reply({"op": "result", "id": req["id"], "sandbox_error": f"{type(exc).__name__}: {exc}"})
        self.queue = waiting

    def _can_start(self, req: dict) -> bool:
        sid = req.get("session")
        if sid is None:
            return True
        session = self.sessions.get(sid)
        return session.call is None if session is not None else bool(self.free_session_slots)

    def _shutdown(self) -> None:
        for call in list(self.calls.values()):
            self._kill(call, "cancelled")
        for session in list(self.sessions.values()):
            self._end_interpreter(session, "closed")
        for child in [*self.ready_calls.values(), *self.ready_sessions.values()]:
            self._discard(child)

    # ---- starting a call

    def _spawn(self, req: dict, slot: int) -> None:
        """Start a stateless call in ``slot``: its runner (forked ahead, or now) gets the
        call's files in its directory, its limits and then its request."""
        child = self._take("call", slot)
        call = Call(req, slot, child.dir)
        call.pid, call.init_pid, call.fds, call.group = child.pid, child.init_pid, child.fds, child.group
        stdin = None
        try:
            _prepare_directory(child.dir, {**(req.get("files") or {}), SCRIPT_NAME: None}, child.uid, req["code"])
            if call.group is not None:
                call.group.set_limits(req["memory_mb"] << 20, self.cfg["max_processes"] + child.born_inside)
                call.group_cpu_base = call.group.cpu_seconds()
            stdin = (os.open(os.devnull, os.O_RDONLY) if req.get("stdin") is None
                     else _memory_file("stdin", req["stdin"].encode()))
            call.started = time.monotonic()
            call.deadline = call.started + req["timeout_s"]
            if self.cfg.get("demote_after_s"):
                call.demote_at = call.started + self.cfg["demote_after_s"]
            self._hand_over(child, {"code": req["code"], "cpu_s": req["cpu_s"], "memory_mb": req["memory_mb"],
                                    "auto_print": req.get("auto_print", True)}, stdin)
        except BaseException:
            self._discard(child)
            raise
        finally:
            if stdin is not None:
                os.close(stdin)
        self.calls[call.id] = call
        for name, fd in call.fds.items():
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ, (name, call))
        if hasattr(os, "pidfd_open"):
            call.pidfd = os.pidfd_open(call.pid)
            self.sel.register(call.pidfd, selectors.EVENT_READ, ("exit", call))
        if req.get("queued"):  # a call that started at once is timed from its request
            self._reply({"op": "started", "id": call.id})

    # ---- children forked ahead of their work

    def _uid(self, kind: str, slot: int) -> int:
        """The unprivileged uid of a call slot or a session slot (as root; else our own)."""
        if not self.root:
            return os.geteuid()
        return self.cfg["uid_base"] + slot + (self.cfg["workers"] if kind == "session" else 0)

    def _take(self, kind: str, slot: int) -> Child:
        """The child of ``kind`` for ``slot``: the one forked ahead, else one forked now."""
        pool = self.ready_calls if kind == "call" else self.ready_sessions
        child = pool.pop(slot, None) or self._prepare(kind, slot)
        if child.template is not None and not child.pid and child.error is None:
            self._hurry(child.template.pid)  # its fork was asked for and is not answered yet
            while not child.pid and child.error is None:
                child.template.receive()
            if self.prefork and self.root:
                os.setpriority(os.PRIO_PROCESS, child.template.pid, self.priority + PREFORK_NICE)
        if child.error is not None:
            self._discard(child)
            raise OSError(errno.EAGAIN, child.error)
        self._hurry(child.pid)
        return child

    def _prepare(self, kind: str, slot: int) -> Child:
        """Fork a call's runner or a session's interpreter that isolates itself as far as it
        can without its request (see :func:`_enter_sandbox`) and then waits for it: its
        directory (own tmpfs), pipes, PID namespace, control group and, for a session, its
        network namespace. With a template the fork is asked for and answered later
        (:meth:`Template.receive`): the zygote does not wait for it."""
        child = Child(kind, slot, self._uid(kind, slot), tempfile.mkdtemp(prefix=f"{kind}-{slot}-", dir=self.base))
        child_fds: dict[str, int] = {}
        try:
            self._mount_scratch(child.dir)
            _prepare_directory(child.dir, {}, child.uid, "")
            child_fds, child.fds = _make_pipes(session=kind == "session")
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            child.go, child_fds["go"] = mine, theirs.detach()
            child_fds["request"] = _memory_file("request", json.dumps({"dir": child.dir, "uid": child.uid}).encode())
            if kind == "call":
                self._fork_runner(child, child_fds)
            else:
                self._fork_interpreter(child, child_fds)
        except BaseException:
            self._discard(child)
            raise
        finally:
            for fd in child_fds.values():
                os.close(fd)
        return child

    def _fork_runner(self, child: Child, child_fds: dict[str, int]) -> None:
        """With PID namespaces, a tiny init as pid 1 of a fresh namespace (killing it makes
        the kernel kill everything in it), then the runner as pid 2, forked by the slot's
        template (or, without one, by the zygote itself)."""
        template = self._template_for("call", child.slot)
        child.born_inside = template is not self.template
        child.group = self._group(f"call-{child.slot}", child_fds, child.born_inside)
        with self._children_in_new_pid_namespace():
            if self.pidns_fd is not None:
                child.init_pid = self._spawn_init()
            if template is None:
                child.pid = _fork_running(run_snippet, self, child_fds)
        if template is not None:
            template.send(child, "call", child_fds, child.init_pid or None)

    def _fork_interpreter(self, child: Child, child_fds: dict[str, int]) -> None:
        """A session's interpreter: pid 1 of a fresh PID namespace (so that it can kill
        every other process of its session, and its death kills them all)."""
        child.group = self._group(f"session-{child.slot}", child_fds, born_inside=False)
        if child.group is not None:
            child.group.set_limits(self.cfg["session_memory_mb"] << 20, self.cfg["max_processes"])
        if self.template is not None:
            self.template.send(child, "session", child_fds, None)
        else:
            with self._children_in_new_pid_namespace():
                child.pid = _fork_running(run_session, self, child_fds)

    def _hand_over(self, child: Child, work: dict, stdin: int | None) -> None:
        """Send the child its work: a memory file with ``work`` (read only by the child),
        and a call's stdin. A child that died meanwhile cannot take it: its exit (and the
        setup error it reported) then answers the call."""
        fds = {"request": _memory_file("request", json.dumps(work).encode())}
        if stdin is not None:
            fds["stdin"] = stdin
        try:
            socket.send_fds(child.go, [" ".join(fds).encode()], list(fds.values()))
        except OSError as exc:
            if exc.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ECONNREFUSED):
                raise
        finally:
            os.close(fds["request"])
            child.go.close()

    def _discard(self, child: Child) -> None:
        """Kill a child that will not get (or could not take) its work and free what it held."""
        while child.template is not None and not child.pid and child.error is None:
            child.template.receive()
        _end_runner(child.pid, child.init_pid)
        child.pid = child.init_pid = 0
        for fd in child.fds.values():
            os.close(fd)
        child.fds = {}
        if child.go is not None:  # None when preparing it failed before its socket was made
            child.go.close()
        self._remove_directory(child.dir)

    def _wanted(self) -> list[tuple[str, int]]:
        """The children to fork ahead: one for each of the first free call slots and free
        session slots (``prefork`` of each at most) that has none, whose template is not
        forking another one already."""
        if not self.prefork or time.monotonic() < self.prefork_paused_until:
            return []
        wanted = [("call", s) for s in self.free_slots[:self.cfg["prefork"]] if s not in self.ready_calls]
        wanted += [("session", s) for s in self.free_session_slots[:self.cfg["prefork"]]
                   if s not in self.ready_sessions]
        # one at a time per template: a request's own fork never queues behind many
        return [(kind, slot) for kind, slot in wanted if not self._template_for(kind, slot).pending]

    def _template_for(self, kind: str, slot: int) -> Template | None:
        return self.slot_templates.get(slot, self.template) if kind == "call" else self.template

    def _replenish(self) -> None:
        """Fork one child ahead (see :meth:`_wanted`), once nothing has happened for
        :data:`PREFORK_IDLE_S`: the request path never waits for this. The template forks
        it at a lower priority (as root), so that running calls keep the CPU. A failure is
        said once and pauses this for a second."""
        wanted = self._wanted()
        if not wanted or time.monotonic() - self.last_busy < PREFORK_IDLE_S:
            return
        kind, slot = wanted[0]
        try:
            child = self._prepare(kind, slot)
        except Exception as exc:  # e.g. no memory or fds left: calls fork on demand meanwhile
            sys.stderr.write(f"retool sandbox: could not fork a {kind} ahead ({exc}); retrying in 1 s\n")
            self.prefork_paused_until = time.monotonic() + 1.0
            return
        (self.ready_calls if kind == "call" else self.ready_sessions)[slot] = child

    def _hurry(self, pid: int) -> None:
        """Give a forked-ahead child, or the template forking one that a request waits for,
        the warm parent's own priority back."""
        if self.prefork and self.root:
            with contextlib.suppress(ProcessLookupError):  # it died: its exit answers the call
                os.setpriority(os.PRIO_PROCESS, pid, self.priority)

    @contextlib.contextmanager
    def _children_in_new_pid_namespace(self):
        """With PID namespaces, the children forked inside the block start a fresh one
        (``unshare`` affects only our next children; ``setns`` undoes it on the way out)."""
        if self.pidns_fd is not None:
            unshare(CLONE_NEWPID)
        try:
            yield
        finally:
            if self.pidns_fd is not None:
                setns(self.pidns_fd, CLONE_NEWPID)

    def _group(self, name: str, child_fds: dict[str, int], born_inside: bool):
        """The control group ``name``, and fds for the child to join it (added to
        ``child_fds``) unless it is ``born_inside`` it (forked by the slot's template,
        which lives there); None without control groups."""
        if self.cgroups is None:
            return None
        group = self.cgroups.group(name)
        if not born_inside:
            for i, fd in enumerate(group.join_fds()):
                child_fds[f"cgroup{i}"] = fd
        return group

    def _mount_scratch(self, directory: str) -> None:
        """Give a call or session directory its own size-capped tmpfs, so that filling it
        (ENOSPC) cannot take space from any other call or session."""
        if self.scratch_quota:
            mount("tmpfs", directory, "tmpfs", MS_NOSUID | MS_NODEV,
                  f"size={self.cfg['call_scratch_mb']}m,mode=0700")

    def _remove_directory(self, directory: str) -> None:
        """Remove a call or session directory (and detach its tmpfs: every file goes with it)."""
        if self.scratch_quota:  # fails (EINVAL) only where the tmpfs was never mounted
            libc().umount2(directory.encode(), MNT_DETACH)
        shutil.rmtree(directory, ignore_errors=True)

    def _start_template(self) -> None:
        """Fork the template that forks every call's and session's process (see
        :class:`Template`), now, before this process has held any request."""
        if "template" in self.skip:
            return
        if SYS_CLONE < 0 or not sys.platform.startswith("linux"):
            self.warnings.append("no clean template: calls are forked from the warm parent itself")
            return
        self.template = Template.start(self)
        self.isolation.append("clean_template")
        self.prefork = "prefork" not in self.skip and self.cfg.get("prefork", 0) > 0
        if self.cgroups is not None:  # a child born in its group needs no migration (that waits
            for slot in range(self.cfg["workers"]):  # for an RCU grace period, ~10 ms here)
                group = self.cgroups.group(f"call-{slot}")
                group.set_limits(self.cfg["session_memory_mb"] << 20, self.cfg["max_processes"] + 1)
                self.slot_templates[slot] = Template.start(self, group.join_fds())
        for template in [self.template, *self.slot_templates.values()]:
            self.sel.register(template.sock, selectors.EVENT_READ, ("template", template))
            if self.prefork and self.root:
                os.setpriority(os.PRIO_PROCESS, template.pid, self.priority + PREFORK_NICE)
        if self.prefork:
            self.isolation.append("prefork")

    def _spawn_init(self) -> int:
        """Pid 1 of the call's namespace: ``sleep`` via vfork+exec (cheap at any parent
        size), or a forked copy of this process that just waits."""
        if self.sleep_binary:
            return os.posix_spawn(self.sleep_binary, [self.sleep_binary, "infinity"], {},
                                  file_actions=[(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0)
                                                for fd in (0, 1, 2)], setsid=True)
        pid = os.fork()
        if pid == 0:
            while True:
                signal.pause()
        return pid

    # ---- running calls

    def _on_output(self, call: Call, name: str) -> None:
        try:
            chunk = os.read(call.fds[name], 1 << 16)
        except BlockingIOError:
            return
        if not chunk:
            self.sel.unregister(call.fds[name])
            return
        buf = call.bufs[name]
        cap = self._cap(name)
        buf += chunk[:max(cap - len(buf), 0)]
        if len(buf) >= cap and name in ("stdout", "stderr"):
            self._kill(call, "output_limit")

    def _cap(self, name: str) -> int:
        return self.cfg["max_output_bytes"] if name in ("stdout", "stderr") else 1 << 16

    def _next_timeout(self) -> float | None:
        deadlines = [min(c.deadline, c.demote_at) for c in self.calls.values() if not c.killed]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        if (self.calls or self.sessions) and not hasattr(os, "pidfd_open"):
            timeout = 0.005 if timeout is None else min(timeout, 0.005)  # poll for exits
        if any(c.group is not None and not c.killed for c in self.calls.values()):
            wait = max(0.0, self.next_cpu_check - time.monotonic())
            timeout = wait if timeout is None else min(timeout, wait)
        if self.settling:
            timeout = SETTLE_POLL_S if timeout is None else min(timeout, SETTLE_POLL_S)
        if self.idle:
            wait = max(0.0, min(s.idle_since for s in self.idle) + FREEZE_IDLE_S - time.monotonic())
            timeout = wait if timeout is None else min(timeout, wait)
        if self._wanted():
            wait = max(0.0, self.last_busy + PREFORK_IDLE_S - time.monotonic())
            timeout = wait if timeout is None else min(timeout, wait)
        return timeout

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        for call in list(self.calls.values()):
            if not call.killed and now >= call.deadline:
                self._kill(call, "timeout")
            elif not call.killed and now >= call.demote_at:
                call.demote_at = math.inf
                self._demote(call)
        if now >= self.next_cpu_check:
            self.next_cpu_check = now + CPU_POLL_S
            self._enforce_cpu_time()

    def _demote(self, call: Call) -> None:
        """Every process of a long-running stateless call to :data:`DEMOTED_NICE`, and the
        autogroup of its session with it (where the kernel groups sessions, it weighs them
        against each other first, so a process's own nice value only counts within its
        session): those in its control group (the slot's template, which forks the slot's
        next runner, left out), else its process group; children inherit both. With a
        control group this repeats every :data:`CPU_POLL_S` for processes not seen yet and
        for those in another session since (``setsid`` starts a new autogroup at nice 0)."""
        call.demoted = True
        template = self.slot_templates.get(call.slot)
        if call.group is not None:
            targets = []
            for pid in call.group.pids():
                try:
                    session = os.getsid(pid)
                except OSError:  # gone
                    continue
                if call.demoted_pids.get(pid) != session and (template is None or pid != template.pid):
                    call.demoted_pids[pid] = session  # again if it starts a session of its own later
                    targets.append((os.PRIO_PROCESS, pid))
        else:
            targets = [(os.PRIO_PGRP, call.pid)]
        for which, who in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # gone, or not ours to lower
                os.setpriority(which, who, DEMOTED_NICE)
            with contextlib.suppress(OSError):  # no autogroups here, or gone (a group: its leader's session)
                with open(f"/proc/{who}/autogroup", "w") as f:
                    f.write(str(DEMOTED_NICE))

    def _enforce_cpu_time(self) -> None:
        """Kill each call whose processes together (its control group: every thread, every
        child, the session interpreter's daemon threads) used more than its CPU time; demote
        the processes a demoted call started since the last look."""
        for call in list(self.calls.values()):
            if call.demoted and call.group is not None and not call.killed:
                self._demote(call)
            if call.group is not None and not call.killed:
                if call.group.cpu_seconds() - call.group_cpu_base > call.req["cpu_s"]:
                    self._kill(call, "cpu_time")

    def _kill(self, call: Call, reason: str) -> None:
        """Kill the call's whole process tree: its namespace's init, else its process group."""
        if call.killed:
            return
        call.killed = reason
        call.deadline = math.inf
        _kill_tree(call)

    def _poll_without_pidfd(self) -> None:
        if hasattr(os, "pidfd_open"):
            return
        for call in [c for c in self.calls.values() if c.session is None]:
            pid, status, usage = os.wait4(call.pid, os.WNOHANG)
            if pid:
                self._on_exit(call, (status, usage))
        for session in [s for s in self.sessions.values() if s.pid]:
            pid, status, usage = os.wait4(session.pid, os.WNOHANG)
            if pid:
                self._on_session_exit(session, (status, usage))

    def _on_exit(self, call: Call, waited: tuple | None = None) -> None:
        status, usage = waited or os.wait4(call.pid, 0)[1:]
        wall = time.monotonic() - call.started
        _kill_tree(call)  # whatever the snippet left behind dies with it
        _reap(call.init_pid)  # returns once every process of the namespace is gone
        if call.group is not None and not call.init_pid:  # no namespace died with it
            template = self.slot_templates.get(call.slot)
            call.group.kill_all(keep=template.pid if template is not None else None)
        self._drain(call)
        reply = self._result(call, status, usage, wall)
        self._cleanup(call)
        self._reply(reply)
        self._start_queued()

    def _drain(self, call: Call) -> None:
        """Read what is left in the pipes (every writer is dead, so this ends)."""
        for name, fd in call.fds.items():
            os.set_blocking(fd, True)
            cap = self._cap(name)
            while len(call.bufs[name]) < cap and (chunk := _read(fd)):
                call.bufs[name] += chunk[:cap - len(call.bufs[name])]
            if len(call.bufs[name]) >= cap and _read(fd) and name in ("stdout", "stderr"):
                call.killed = call.killed or "output_limit"

    def _result(self, call: Call, status: int, usage, wall: float) -> dict:
        info = _parse_json_lines(call.bufs["info"])
        code, sig = _split_status(status)
        if call.killed and sig == signal.SIGKILL:
            sig = None  # our own kill, reported as the reason instead
        return {
            "op": "result", "id": call.id,
            "stdout": _b64(call.bufs["stdout"]), "stderr": _b64(call.bufs["stderr"]),
            "exit_code": code, "signal": sig, "killed": call.killed,
            "setup_failed": info.get("setup_error") or (not call.killed and not info.get("ready")),
            "exc_type": info.get("exc_type"), "short_tb": info.get("short_tb"),
            "memory_baseline_bytes": info.get("memory_baseline_bytes"),
            "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_rss_bytes": usage.ru_maxrss * 1024 if sys.platform.startswith("linux") else usage.ru_maxrss,
            "isolation": self.isolation,
            "files": _fetch_files(call.dir, call.req.get("fetch_files") or [], self.cfg["max_file_bytes"]),
        }

    def _close_fds(self, pipes: dict, pidfd: int | None) -> None:
        """Stop watching and close a child's output pipes and pidfd."""
        for fd in [*pipes.values(), *([pidfd] if pidfd is not None else [])]:
            try:
                self.sel.unregister(fd)
            except (KeyError, ValueError):
                pass
            os.close(fd)

    def _cleanup(self, call: Call) -> None:
        self._close_fds(call.fds, call.pidfd)
        self._remove_directory(call.dir)
        call.done = True
        self.calls.pop(call.id, None)
        self.free_slots.append(call.slot)

    # ---- sessions: one stateful interpreter per session id

    def _start_session_call(self, req: dict) -> None:
        """Send a call to its session's interpreter, starting one (and the session) if needed."""
        session = self.sessions.get(req["session"])
        if session is None:
            slot = next((s for s in self.free_session_slots if s in self.ready_sessions), self.free_session_slots[0])
            self.free_session_slots.remove(slot)
            session = self.sessions[req["session"]] = Session(req["session"], slot, self._uid("session", slot))
        if session.pid and session.group is not None and not self._clear(session):
            self._end_interpreter(session, "processes")
        fresh = not session.pid
        if fresh:
            self._start_interpreter(session, req)
        call = Call(req, session.slot, session.dir)
        call.session, call.pid, call.fresh = session, session.pid, fresh
        call.init_pid = session.pid if self.pidns_fd is not None else 0  # killing it kills its namespace
        call.state_lost, session.lost = session.lost or req.get("state_lost"), None
        call.cpu_before = float(session.reported.get("cpu_total", 0.0))
        call.group = session.group
        if session.group is not None:
            call.group_cpu_base = session.cpu_mark if session.cpu_mark is not None else session.group.cpu_seconds()
        session.calls += 1
        session.call = self.calls[call.id] = call
        request = {"id": call.id, "code": req["code"], "auto_print": req.get("auto_print", True),
                   "n": session.calls, "cpu_s": req["cpu_s"], "memory_mb": req["memory_mb"]}
        session.outbuf += (json.dumps(request) + "\n").encode()
        self._flush_control(session)
        if session.frozen:  # the request is in its pipe already: the interpreter wakes once
            session.group.thaw()
            session.frozen = False
        if req.get("queued"):  # a call that started at once is timed from its request
            self._reply({"op": "started", "id": call.id})

    def _start_interpreter(self, session: Session, req: dict) -> None:
        """Give the session an interpreter (forked ahead, or now) and its first limits."""
        child = self._take("session", session.slot)
        session.dir, session.fds, session.pid, session.group = child.dir, child.fds, child.pid, child.group
        try:
            self._hand_over(child, {"cpu_s": req["cpu_s"], "memory_mb": req["memory_mb"]}, None)
        except BaseException:
            self._end_interpreter(session, "sandbox_error")
            raise
        session.calls, session.reported, session.info = 0, {}, bytearray()
        session.generation += 1
        for name in ("stdout", "stderr", "info"):
            os.set_blocking(session.fds[name], False)
            self.sel.register(session.fds[name], selectors.EVENT_READ, self._event(session, name))
        os.set_blocking(session.fds["control"], False)
        if hasattr(os, "pidfd_open"):
            session.pidfd = os.pidfd_open(session.pid)
            self.sel.register(session.pidfd, selectors.EVENT_READ, self._event(session, "exit"))

    @staticmethod
    def _event(session: Session, name: str) -> tuple:
        return "session", (name, session, session.generation)

    def _flush_control(self, session: Session) -> None:
        """Write what is pending to the interpreter's control pipe without blocking; the
        rest waits for the pipe to drain (a busy interpreter cannot stall the zygote)."""
        fd = session.fds.get("control")
        while session.outbuf and fd is not None:
            try:
                written = os.write(fd, session.outbuf)
            except BlockingIOError:
                break
            except OSError:  # the interpreter is gone: its exit event ends the call
                session.outbuf.clear()
                break
            del session.outbuf[:written]
        key = self.sel.get_map().get(fd) if fd is not None else None
        if session.outbuf and key is None:
            self.sel.register(fd, selectors.EVENT_WRITE, self._event(session, "control"))
        elif not session.outbuf and key is not None:
            self.sel.unregister(fd)

    def _on_session_event(self, name: str, session: Session, generation: int) -> None:
        """One event of a session's interpreter; a bug here ends that interpreter, not the zygote.
        Events of an interpreter that has ended (earlier in the same batch) are stale: dropped."""
        if generation != session.generation or not session.pid:
            return
        try:
            if name == "exit":
                self._on_session_exit(session)
            elif name == "control":
                self._flush_control(session)
            elif name == "info":
                self._on_session_info(session)
            else:
                self._on_session_output(session, name)
        except Exception:
            call = session.call
            self._end_interpreter(session, "sandbox_error")
            if call is not None:
                self._reply({"op": "result", "id": call.id, "sandbox_error": traceback.format_exc()[-2000:]})
            self._start_queued()

    def _on_session_output(self, session: Session, name: str) -> None:
        chunk = _read(session.fds[name])
        call = session.call
        if not chunk:  # closed (by the code, or at exit): stop watching it
            self.sel.unregister(session.fds[name])
            return
        if call is None:  # output between calls (a daemon thread) is dropped
            return
        buf = call.bufs[name]
        buf += chunk[:max(self._cap(name) - len(buf), 0)]
        if len(buf) >= self._cap(name):
            self._kill(call, "output_limit")

    def _on_session_info(self, session: Session) -> None:
        chunk = _read(session.fds["info"])
        if not chunk:
            self.sel.unregister(session.fds["info"])
            return
        session.info += chunk
        while (end := session.info.find(b"\n")) >= 0:
            line, session.info = bytes(session.info[:end + 1]), session.info[end + 1:]
            call = session.call
            msg = _parse_json_lines(bytearray(line))
            if call is not None and msg.get("done") == call.id:
                session.reported = msg
                self._finish_session_call(session, call, msg)
            elif call is not None and len(call.bufs["info"]) < self._cap("info"):
                call.bufs["info"] += line
        if len(session.info) > self._cap("info"):  # no end of line in sight: not our loop talking
            if session.call is not None:
                self._kill(session.call, "output_limit")
            else:
                self._end_interpreter(session, "exited")

    def _finish_session_call(self, session: Session, call: Call, done: dict) -> None:
        """The interpreter says the call ended (and has killed what the call left running)."""
        for name in ("stdout", "stderr"):
            cap = self._cap(name)
            while len(call.bufs[name]) < cap and (chunk := _read(session.fds[name])):
                call.bufs[name] += chunk[:cap - len(call.bufs[name])]
        info = _parse_json_lines(call.bufs["info"])
        call.baseline = done.get("baseline")
        reply = self._session_result(call, {
            "exit_code": done.get("exit_code"), "signal": None,
            "setup_failed": call.fresh and not info.get("ready"),
            "cpu_s": done.get("cpu", 0.0), "peak_rss_bytes": done.get("peak_rss"),
        }, info)
        session.call = None
        self.calls.pop(call.id, None)
        call.done = True
        ended = call.killed or ("memory" if info.get("exc_type") == "MemoryError" else None)
        if ended:  # killed as it ended, or out of memory (its state may be half-built): start afresh
            self._end_interpreter(session, ended)
            reply["ended_interpreter"] = ended
        if not ended and session.group is not None:  # frozen once idle (see FREEZE_IDLE_S)
            session.idle_since = time.monotonic()
            self.idle.append(session)
        self._reply(reply)
        if not ended and session.group is not None:  # off the reply's path
            session.cpu_mark = session.group.cpu_seconds()
        self._start_queued()

    def _session_result(self, call: Call, fields: dict, info: dict | None = None) -> dict:
        info = _parse_json_lines(call.bufs["info"]) if info is None else info
        baseline = call.baseline or info.get("memory_baseline_bytes")
        return {
            "op": "result", "id": call.id, "session": call.session.id,
            "stdout": _b64(call.bufs["stdout"]), "stderr": _b64(call.bufs["stderr"]),
            "killed": call.killed, "exc_type": info.get("exc_type"), "short_tb": info.get("short_tb"),
            "memory_baseline_bytes": baseline, "wall_s": time.monotonic() - call.started,
            "isolation": self.isolation, "files": {}, "state_lost": call.state_lost,
            **fields,
        }

    def _on_session_exit(self, session: Session, waited: tuple | None = None) -> None:
        """The interpreter died (killed for a limit, crashed, or the code ended it)."""
        status, usage = waited or os.wait4(session.pid, 0)[1:]
        if self.pidns_fd is None:  # no namespace died with it: its process group may live on
            _kill_tree_of(session.pid, namespace=False)
        session.pid = 0  # reaped: never signal that pid again
        call = session.call
        if call is None:
            return self._end_interpreter(session, "exited")
        for name, fd in session.fds.items():  # every writer is dead: read to the end
            if name in ("stdout", "stderr", "info"):
                os.set_blocking(fd, True)
                while len(call.bufs[name]) < self._cap(name) and (chunk := _read(fd)):
                    call.bufs[name] += chunk[:self._cap(name) - len(call.bufs[name])]
        call.bufs["info"] += session.info
        info = _parse_json_lines(call.bufs["info"])
        code, sig = _split_status(status)
        if call.killed and sig == signal.SIGKILL:
            sig = None  # our own kill, reported as the reason instead
        reply = self._session_result(call, {
            "exit_code": code, "signal": sig,
            "setup_failed": info.get("setup_error") or (call.fresh and not call.killed and not info.get("ready")),
            "cpu_s": max(usage.ru_utime + usage.ru_stime - call.cpu_before, 0.0),
            "peak_rss_bytes": usage.ru_maxrss * 1024,
        })
        reason = call.killed or ("cpu_time" if sig == signal.SIGXCPU else "exited")
        reply["ended_interpreter"] = reason
        session.call = None
        self.calls.pop(call.id, None)
        call.done = True
        self._end_interpreter(session, reason)
        self._reply(reply)
        self._start_queued()

    def _settle_sessions(self) -> None:
        """Between a session's calls, off the request's path: freeze its group once it has
        been idle for :data:`FREEZE_IDLE_S`; once frozen, check that the interpreter is
        alone in it. Then nothing can start there until it is thawed, so its next call only
        thaws it (:meth:`_clear`). A group that holds other processes is left to that next
        call, which kills them."""
        now = time.monotonic()
        for session in list(self.idle):
            if session.call is not None or not session.pid or session.group is None:
                self.idle.remove(session)
            elif now - session.idle_since >= FREEZE_IDLE_S:
                self.idle.remove(session)
                session.group.freeze(wait=False)  # nothing of the session runs until its next call
                session.frozen = True
                self.settling.append(session)
        for session in list(self.settling):
            if session.call is not None or not session.pid or session.group is None:
                self.settling.remove(session)
            elif session.group.frozen():
                self.settling.remove(session)
                session.settled = session.group.alone(session.pid)

    def _clear(self, session: Session) -> bool:
        """Before a session's next call: kill every process in its group but the
        interpreter (from here, where the snippet cannot reach: whatever a call left,
        whatever its threads started after it), frozen, and leave it frozen: the call
        thaws it once its request is in the interpreter's pipe. A group not frozen yet
        (the call came back to back) with the interpreter alone in it needs neither
        freeze nor thaw. False when processes keep appearing: the interpreter must end."""
        if session in self.idle:
            self.idle.remove(session)
            if session.group.alone(session.pid):
                return True
        if session in self.settling:
            self.settling.remove(session)
        if not session.settled:
            try:
                session.group.leave_only(session.pid)
                session.frozen = True
            except OSError:  # processes keep appearing as fast as they are killed, or it would not freeze
                return False
        session.settled = False
        return True

    def _end_interpreter(self, session: Session, reason: str) -> None:
        """Kill the session's interpreter and everything it started, wait until they are
        gone, remove its directory; the session's next call starts a fresh one."""
        session.settled, session.frozen, session.cpu_mark = False, False, None  # kill_all thaws
        if session in self.settling:
            self.settling.remove(session)
        if session in self.idle:
            self.idle.remove(session)
        if session.group is not None:
            session.group.kill_all()  # frozen or not, every process of the session dies
        if session.pid:
            _kill_tree_of(session.pid, namespace=self.pidns_fd is not None)
            _reap(session.pid)
            session.pid = 0
        self._close_fds(session.fds, session.pidfd)
        session.fds, session.pidfd = {}, None
        session.outbuf.clear()
        if session.dir:
            self._remove_directory(session.dir)
            session.dir = ""
        session.lost = reason

    def _close_session(self, req: dict) -> None:
        """End a session for good: its interpreter, its queued and running calls, its slot."""
        session = self.sessions.pop(req["session"], None)
        for queued in [r for r in self.queue if r.get("session") == req["session"]]:
            self.queue.remove(queued)
            self._reply({"op": "result", "id": queued["id"], "sandbox_error": "the session was closed"})
        if session is not None:
            call = session.call
            if call is not None:
                session.call = None
                self.calls.pop(call.id, None)
                call.done = True
                self._reply({"op": "result", "id": call.id, "sandbox_error": "the session was closed"})
            self._end_interpreter(session, "closed")
            self.free_session_slots.append(session.slot)
        self._reply({"op": "result", "id": req["id"], "closed": True})
        self._start_queued()


CHILD_FD_NAMES = ("stdin", "stdout", "stderr", "info", "control", "request", "go", "pidns",
                  *(f"cgroup{i}" for i in range(len(_cgroups.V1_CONTROLLERS))))
"""The names the fds a child gets from the template may have (``control``: a session's
requests; ``pidns``: the PID namespace a call's runner is forked into; ``cgroup<i>``: its
control group's ``cgroup.procs``, one per hierarchy; ``go``: the socket its work
arrives on)."""
TEMPLATE_REPLY_TIMEOUT_S = 30.0


class Template:
    """The zygote's handle on its template: a copy of the warm parent forked right after
    ``preload``, before the zygote has read any request, that forks every call's runner
    and every session's interpreter.

    Why: a child forked from the zygote itself would inherit the zygote's memory at that
    moment — other calls' code, queued requests and output read so far, as live objects
    (``gc.get_objects()``) and as freed bytes. The template never holds any of that. Each
    command it gets is one word (``call``/``session``) and the names of the fds sent with
    it (``SCM_RIGHTS`` on a socket pair): the child's pipes, a memory file with its own
    request (read only by the child), for a call its PID namespace, the socket its work
    arrives on, and the ``cgroup.procs`` of the control group the child joins. There is one template for
    sessions and, with control groups, one per call slot living in that slot's group (a
    child born there needs no migration: joining a group waits for an RCU grace period,
    ~10 ms, unless another join happened just before). With ``prefork`` it runs at a
    lower priority. It forks with ``CLONE_PARENT``, so the
    child is the zygote's child (the zygote waits for it, reads its resource usage and
    gets its pidfd as before) and the template has no children at all. It is
    single-threaded, so the raw ``clone`` (without glibc's fork handlers; CPython's own
    before/after-fork hooks do run) leaves no lock held in the child.
    """

    def __init__(self, pid: int, sock: socket.socket):
        self.pid = pid
        self.sock = sock
        self.pending: collections.deque[Child] = collections.deque()  # forks asked for, not answered

    @classmethod
    def start(cls, zygote: Zygote, group_fds: list[int] = ()) -> Template:
        """Fork a template; with ``group_fds``, it lives in that control group (as does
        every child it forks). The OOM killer there picks the snippet's processes first
        (their ``oom_score_adj`` is 1000, the template's 0)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            try:
                mine.close()
                _cgroups.join(list(group_fds))
                serve_template(zygote, theirs)
            except BaseException:
                traceback.print_exc()  # to the trainer's stderr: the template is broken
            finally:
                os._exit(EXIT_SETUP_FAILED)
        for fd in group_fds:
            os.close(fd)
        theirs.close()
        mine.settimeout(TEMPLATE_REPLY_TIMEOUT_S)
        return cls(pid, mine)

    def send(self, child: Child, kind: str, child_fds: dict[str, int], pid_namespace_of: int | None) -> None:
        """Ask the template to fork ``child`` (a ``kind`` child with ``child_fds``; the
        zygote keeps and closes its copies); for a call, in the PID namespace of the process
        ``pid_namespace_of``. The pid comes later (:meth:`receive`). Ends the zygote if the
        template is gone."""
        fds = dict(child_fds)
        namespace_fd = os.pidfd_open(pid_namespace_of) if pid_namespace_of else None
        if namespace_fd is not None:
            fds["pidns"] = namespace_fd
        try:
            socket.send_fds(self.sock, [" ".join([kind, *fds]).encode()], list(fds.values()))
        except OSError as exc:
            self._gone(str(exc))
        finally:
            if namespace_fd is not None:
                os.close(namespace_fd)
        child.template = self
        self.pending.append(child)

    def receive(self, wait: bool = True) -> None:
        """Read the template's next answer: the pid of its oldest pending child (the
        zygote's child), or why it could not fork it. Without ``wait``, only an answer that
        is there already (a readiness event may be stale: the answer was read meanwhile)."""
        if not self.pending or not (wait or select.select([self.sock], [], [], 0)[0]):
            return
        try:
            reply = self.sock.recv(512).decode()
        except OSError as exc:
            reply = f"gone ({exc})"
        if not reply or reply.startswith("gone"):
            self._gone(reply)
        child = self.pending.popleft()
        if reply.isdigit():
            child.pid = int(reply)
        else:
            child.error = f"the template could not fork: {reply}"

    @staticmethod
    def _gone(why: str) -> None:
        sys.stderr.write(f"retool sandbox: the template process is gone {why}; the warm parent exits\n")
        os._exit(1)  # the trainer's side replaces the whole warm parent


def serve_template(zygote: Zygote, sock: socket.socket) -> None:
    """The template's loop: fork the child each command asks for, answer its pid."""
    if sys.platform.startswith("linux"):
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):  # never hold the zygote's control pipes
        os.dup2(devnull, fd)
    os.close(devnull)
    sock.setblocking(True)
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, 512, len(CHILD_FD_NAMES))
        except ConnectionResetError:  # the zygote ended with an answer of ours unread
            message, fds = b"", []
        if not message:
            os._exit(0)
        try:
            kind, *names = message.decode().split()
            reply = str(_fork_child(zygote, kind, dict(zip(names, fds, strict=True))))
        except Exception as exc:  # answered to the zygote, which fails that call
            reply = f"{type(exc).__name__}: {exc}"
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(reply.encode())


def _fork_child(zygote: Zygote, kind: str, child_fds: dict[str, int]) -> int:
    """Fork a ``kind`` child as the zygote's child: a call's runner into the PID namespace
    ``pidns``, a session's interpreter as pid 1 of a fresh one."""
    if kind not in ("call", "session") or not set(child_fds) <= set(CHILD_FD_NAMES):
        raise ValueError(f"not a template command: {kind} {sorted(child_fds)}")
    namespace_fd = child_fds.pop("pidns", None)
    runner = run_snippet if kind == "call" else run_session
    new_namespace = kind == "session" and zygote.pidns_fd is not None
    if namespace_fd is not None:
        setns(namespace_fd, CLONE_NEWPID)
    elif new_namespace:
        unshare(CLONE_NEWPID)
    try:
        return _fork_sibling(runner, zygote, child_fds)
    finally:
        if namespace_fd is not None or new_namespace:
            setns(zygote.pidns_fd, CLONE_NEWPID)


_pylibc = None


def _fork_sibling(runner, *args) -> int:
    """Like :func:`_fork_running`, but the child's parent is our parent (``CLONE_PARENT``).
    CPython's fork hooks run as ``os.fork`` runs them (the GIL stays held: ``PyDLL``)."""
    global _pylibc
    if _pylibc is None:
        _pylibc = ctypes.PyDLL(None, use_errno=True)
    zero = ctypes.c_long(0)
    ctypes.pythonapi.PyOS_BeforeFork()
    pid = _pylibc.syscall(ctypes.c_long(SYS_CLONE), ctypes.c_long(CLONE_PARENT | signal.SIGCHLD),
                          zero, zero, zero, zero)
    if pid == 0:
        ctypes.pythonapi.PyOS_AfterFork_Child()
        try:
            runner(*args)
        finally:
            os._exit(EXIT_SETUP_FAILED)
    err = ctypes.get_errno()
    ctypes.pythonapi.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(err, f"clone: {os.strerror(err)}")
    return pid


def _kill_tree(call: Call) -> None:
    """SIGKILL the call's namespace init (the kernel then kills all in it), else its group."""
    targets = [call.init_pid, call.pid] if call.init_pid else [-call.pid, call.pid]
    for target in targets:
        if target:
            try:
                os.kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _kill_tree_of(pid: int, namespace: bool) -> None:
    """SIGKILL a session's interpreter: pid 1 of its namespace (the kernel kills the rest),
    else the leader of its process group (the group too)."""
    for target in ([pid] if namespace else [-pid, pid]):
        try:
            os.kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    except OSError:
        return b""


def _reap(pid: int) -> None:
    if pid:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def _end_runner(runner: int, init: int) -> None:
    """SIGKILL a call's runner and the init of its PID namespace, and reap them: the runner
    first. The init (pid 1 there) cannot finish exiting before every process of its
    namespace has been reaped (the kernel's ``zap_pid_ns_processes`` waits for that), and
    the runner is the zygote's own child (``CLONE_PARENT``): a zygote that waits for the
    init first waits for itself. (It did: discarding the children forked ahead hung every
    shutdown, until the trainer's side gave up after 5 s and killed the sandbox.)"""
    for pid in (runner, init):
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for pid in (runner, init):
        _reap_within(pid, REAP_WAIT_S)


REAP_WAIT_S = 2.0
"""How long :func:`_end_runner` waits for a killed process (it is dead within
milliseconds; a wait this long means the process is stuck in the kernel, whose state
the warning names)."""


def _reap_within(pid: int, timeout_s: float) -> bool:
    """Reap ``pid`` (if non-zero) if it exits within ``timeout_s``; False if it did not
    (said once, with the state the kernel reports for it: the process ends with the
    sandbox's namespace)."""
    deadline = time.monotonic() + timeout_s
    while pid:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True
        if done:
            return True
        if time.monotonic() >= deadline:
            sys.stderr.write(f"retool sandbox: process {pid} did not exit within {timeout_s:.0f} s of SIGKILL "
                             f"({_process_state(pid)}); it ends with the sandbox\n")
            return False
        time.sleep(0.001)
    return True


def _process_state(pid: int) -> str:
    """The kernel's state of ``pid`` and where it waits, e.g. ``S in zap_pid_ns_processes``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/wchan") as f:
            return f"state {state} in {f.read().strip() or '?'}"
    except OSError as exc:
        return f"state unknown: {exc.strerror}"


def _b64(data: bytes | bytearray) -> str:
    return base64.b64encode(bytes(data)).decode()


def _parse_json_lines(buf: bytearray) -> dict:
    """Merge the JSON objects found on the lines of ``buf``, ignoring anything malformed."""
    merged: dict = {}
    for line in bytes(buf).splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            merged.update(obj)
    return merged


def _split_status(status: int) -> tuple[int | None, int | None]:
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    return os.WEXITSTATUS(status), None


def _make_pipes(session: bool) -> tuple[dict[str, int], dict[str, int]]:
    """Return (the child's ends, the zygote's ends) of its output pipes; a session's
    interpreter also gets its control pipe and an empty stdin (a call's comes with its work)."""
    child, mine = {}, {}
    for name in ("stdout", "stderr", "info"):
        mine[name], child[name] = os.pipe()
    if session:
        child["control"], mine["control"] = os.pipe()
        child["stdin"] = os.open(os.devnull, os.O_RDONLY)
    return child, mine


def _memory_file(name: str, data: bytes) -> int:
    """An fd of an anonymous file holding ``data``, positioned at its start."""
    fd = os.memfd_create(name) if hasattr(os, "memfd_create") else tempfile.TemporaryFile().detach()
    _write_all(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read_request(fd: int) -> dict:
    """The request the zygote wrote for this child (read once, then closed)."""
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    os.close(fd)
    return json.loads(b"".join(chunks))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _prepare_directory(directory: str, files: dict[str, str | None], uid: int, code: str) -> None:
    """Write the request's files (paths already checked: relative, no ``..``) and the
    snippet as :data:`SCRIPT_NAME` (``None`` content), and give the directory and
    everything in it to the call's uid."""
    for rel, b64 in files.items():
        path = os.path.join(directory, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(code.encode("utf-8", "surrogatepass") if b64 is None else base64.b64decode(b64))
    if os.geteuid() == 0 and uid != 0:
        for parent, dirs, names in os.walk(directory):
            for name in [*dirs, *names]:
                os.chown(os.path.join(parent, name), uid, uid, follow_symlinks=False)
        os.chown(directory, uid, uid)


def _fetch_files(directory: str, names: list[str], max_bytes: int) -> dict[str, str]:
    """Read back requested regular files that resolve inside the call's directory.

    Runs after every process of the call is dead, so the snippet cannot race the checks;
    symlinks pointing outside the directory are refused (never read as the zygote).
    """
    found = {}
    root = os.path.realpath(directory)
    for rel in names:
        path = os.path.realpath(os.path.join(directory, rel))
        if os.path.commonpath([root, path]) != root or not os.path.isfile(path):
            continue
        if os.path.getsize(path) <= max_bytes:
            with open(path, "rb") as f:
                found[rel] = _b64(f.read())
    return found


# ---------------------------------------------------------------- one call


def _fork_running(runner, *args) -> int:
    """Fork a child that runs ``runner(*args)`` and never returns into the zygote's code
    (it exits with :data:`EXIT_SETUP_FAILED` if the runner returns or raises); the
    child's pid to the parent."""
    pid = os.fork()
    if pid == 0:
        try:
            runner(*args)
        finally:
            os._exit(EXIT_SETUP_FAILED)
    return pid


def run_snippet(zygote: Zygote, child_fds: dict[str, int]) -> None:
    """The runner: private mounts (forked ahead of its work), then, once its request has
    come, limits, privilege drop, fresh state and the code."""
    info = child_fds["info"]  # fd 3 once the fds are laid out
    try:
        req, workdir = _enter_sandbox(zygote, child_fds, session=False)
        _layout_fds(child_fds)
        info = 3
        baseline = _address_space_bytes()
        if "rlimits" not in zygote.skip:
            _apply_limits(req, zygote.cfg, baseline)
        if "privilege_drop" not in zygote.skip:
            _drop_privileges(req["uid"], zygote.root)
        namespace = _fresh_interpreter_state(workdir, zygote.env)
        if zygote.confine:
            _confine()
    except BaseException:  # never run the snippet half-isolated
        _report(info, {"setup_error": traceback.format_exc()[-3000:]})
        os._exit(EXIT_SETUP_FAILED)
    _report(3, {"ready": True, "memory_baseline_bytes": baseline})
    script = os.path.join(workdir, SCRIPT_NAME)
    code = execute(req["code"], namespace, zygote.cfg["traceback_frames"], script, req["auto_print"])
    os._exit(code)


def run_session(zygote: Zygote, child_fds: dict[str, int]) -> None:
    """A session's interpreter: isolated and limited exactly as a call's runner (the
    first call's limits; the zygote re-sets them before every later call), then a loop
    that runs each call sent on fd 4 in the same globals."""
    info = child_fds["info"]
    try:
        req, workdir = _enter_sandbox(zygote, child_fds, session=True)
        _layout_fds(child_fds, SESSION_FDS)
        info = 3
        baseline = _address_space_bytes()
        limited = "rlimits" not in zygote.skip
        if limited:
            _apply_limits(req, zygote.cfg, baseline, session_cap=baseline + zygote.cfg["session_memory_mb"] * (1 << 20))
        if "privilege_drop" not in zygote.skip:
            _drop_privileges(req["uid"], zygote.root)
        namespace = _fresh_interpreter_state(workdir, zygote.env)
        if zygote.confine:
            _confine()
    except BaseException:  # never run code half-isolated
        _report(info, {"setup_error": traceback.format_exc()[-3000:]})
        os._exit(EXIT_SETUP_FAILED)
    _report(3, {"ready": True, "memory_baseline_bytes": baseline})
    serve_session(namespace, zygote.cfg["traceback_frames"], workdir, limited)


def _enter_sandbox(zygote: Zygote, child_fds: dict[str, int], session: bool) -> tuple[dict, str]:
    """What a child does before it has work (so, forked ahead, off the request's path):
    join its control group, leave the zygote's session, take private mounts (and, for a
    session, a network namespace of its own) and enter its directory. Then wait for the
    work on the ``go`` socket. Returns the request (directory and uid, plus the work) and
    the working directory; the work's fds (a call's stdin) are added to ``child_fds``."""
    req = _read_request(child_fds.pop("request"))
    _cgroups.join([child_fds.pop(name) for name in sorted(child_fds) if name.startswith("cgroup")])
    os.setsid()
    if sys.platform.startswith("linux"):
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the zygote dies: so does the child
    workdir = req["dir"]
    if zygote.private_mounts:
        _private_mounts(req["dir"], zygote.work_dir)
        workdir = zygote.work_dir or req["dir"]
    if session and zygote.session_netns:  # abstract Unix sockets and loopback stay inside the session
        unshare(CLONE_NEWNET)
    os.chdir(workdir)
    work, fds = _await_work(child_fds.pop("go"))
    child_fds.update(fds)
    return {**req, **work}, workdir


def _await_work(fd: int) -> tuple[dict, dict[str, int]]:
    """Block until the zygote hands over the work on the socket ``fd``: a memory file with
    the request and, for a call, its stdin. Exits at once when the zygote closes the
    socket instead (it discards a child it no longer needs, or it has ended)."""
    with socket.socket(fileno=fd) as sock:
        message, fds, _, _ = socket.recv_fds(sock, 512, 2)
    if not message:
        os._exit(0)
    received = dict(zip(message.decode().split(), fds, strict=True))
    return _read_request(received.pop("request")), received


def serve_session(namespace: dict, frames: int, workdir: str, limited: bool = True) -> None:
    """Run the calls that arrive on fd 4 (one JSON line each) in ``namespace``, one after
    the other; after each, kill what it left running and say so on fd 3. Ends at EOF.

    Before each call the soft limits are set from where the interpreter stands, so they
    are per call: CPU time used so far + the call's allowance, address space now + the
    call's ``memory_mb`` (never above the session's hard cap). Call ``n`` runs as the file
    ``call<n>.py``, so a traceback through a function of an earlier call shows its lines."""
    pending = bytearray()
    while True:
        while (end := pending.find(b"\n")) < 0:
            chunk = _read(4)
            if not chunk:
                os._exit(0)
            pending += chunk
        line, pending = bytes(pending[:end]), pending[end + 1:]
        req = json.loads(line)
        cpu_before, baseline = _cpu_seconds(), _address_space_bytes()
        if limited:
            _set_call_limits(req, cpu_before, baseline)
        filename = os.path.join(workdir, f"call{req['n']}.py")
        code = execute(req["code"], namespace, frames, filename, req.get("auto_print", True), session=True)
        _kill_strays()
        cpu_total = _cpu_seconds()
        _report(3, {"done": req["id"], "exit_code": code, "baseline": baseline, "cpu": cpu_total - cpu_before,
                    "cpu_total": cpu_total, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _set_call_limits(req: dict, cpu_used: float, address_space: int) -> None:
    """Soft limits of one session call, below the hard limits fixed at the interpreter's start."""
    cpu = int(math.ceil(cpu_used + req["cpu_s"]))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, resource.getrlimit(resource.RLIMIT_CPU)[1]))
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    soft = address_space + req["memory_mb"] * (1 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _kill_strays() -> None:
    """SIGKILL every other process of this session and reap it — only as pid 1 of the
    session's own PID namespace, where ``kill(-1)`` reaches exactly those processes."""
    if os.getpid() != 1:
        return
    while True:
        _reap_finished()
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:  # ESRCH: none left
            return
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:  # what is dying is not (yet) our child
            time.sleep(0.001)


def _reap_finished() -> None:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def _private_mounts(call_dir: str, work_dir: str | None) -> None:
    """A /proc that shows only this call's processes, a private /dev/shm and SysV IPC,
    and the call's directory at the fixed path ``work_dir`` (when given)."""
    unshare(CLONE_NEWNS | CLONE_NEWIPC)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if os.path.isdir("/dev/shm"):
        mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=1777")
    if work_dir is not None:
        mount(call_dir, work_dir, None, MS_BIND)


def _address_space_bytes() -> int:
    """This process's address space (VmSize) now: what the warm parent preloaded, which
    the snippet's memory limit does not count. 0 where /proc cannot tell. Read from
    ``statm`` (its first field, in pages), which the kernel writes several times faster
    than ``status``: this is on every session call's path. Opened afresh each time, never
    kept: a kept fd is one the snippet could replace."""
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
        try:
            return int(os.read(fd, 64).split()[0]) * PAGE_BYTES
        finally:
            os.close(fd)
    except (OSError, ValueError, IndexError):
        return 0


PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


CALL_FDS = ("stdin", "stdout", "stderr", "info")
SESSION_FDS = (*CALL_FDS, "control")
"""A call's fds 0-3, and a session interpreter's 0-4 (fd 4: its requests)."""


def _layout_fds(child_fds: dict[str, int], order: tuple[str, ...] = CALL_FDS) -> None:
    """Put the fds named in ``order`` on 0, 1, 2, ... and close everything else."""
    high = [fcntl.fcntl(child_fds[name], fcntl.F_DUPFD, 10) for name in order]  # above every target
    for target, fd in enumerate(high):
        os.dup2(fd, target)
    os.closerange(len(order), MAX_FD)


def _report(fd: int, msg: dict) -> None:
    try:
        os.write(fd, (json.dumps(msg) + "\n").encode())
    except OSError:
        pass


def _apply_limits(req: dict, cfg: dict, baseline_bytes: int, session_cap: int | None = None) -> None:
    """rlimits of the call; the address-space limit is the snippet's ``memory_mb`` on top
    of the preloaded ``baseline_bytes`` it inherited.

    A session's interpreter (``session_cap``) gets the same soft limits, but hard limits
    that leave room for later calls: CPU time unlimited (each call's soft limit and wall
    timeout bound it), address space ``session_cap`` bytes in all."""
    mib = 1 << 20
    cpu = int(math.ceil(req["cpu_s"]))
    memory = baseline_bytes + req["memory_mb"] * mib
    if session_cap is None:
        cpu_limit, memory_limit = (cpu, cpu + 1), (memory, memory)
    else:
        cpu_limit = (cpu, resource.getrlimit(resource.RLIMIT_CPU)[1])
        memory_limit = (min(memory, session_cap), session_cap)
    limits = [
        (resource.RLIMIT_CPU, cpu_limit),
        (resource.RLIMIT_AS, memory_limit),
        (resource.RLIMIT_FSIZE, (cfg["max_file_bytes"],) * 2),
        (resource.RLIMIT_NPROC, (cfg["max_processes"],) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ]
    if hasattr(resource, "RLIMIT_NICE"):  # Linux: a demoted call cannot raise its priority again
        limits.append((resource.RLIMIT_NICE, (0, 0)))
    for which, value in limits:
        resource.setrlimit(which, value)
    if sys.platform.startswith("linux"):
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # under memory pressure the kernel kills a snippet, not the trainer


def _drop_privileges(uid: int, root: bool) -> None:
    if root:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        if os.geteuid() != uid or os.getuid() == 0:
            raise OSError(errno.EPERM, "still root after setresuid")
    elif sys.platform.startswith("linux"):
        drop_all_capabilities()
    if sys.platform.startswith("linux"):
        prctl(PR_SET_NO_NEW_PRIVS, 1)


PROBE_NO_KEYCTL = 3
"""Exit code of the start-up probe child when the filter went on but keyctl was refused."""


def _confine() -> bool:
    """The last step before a snippet runs: a fresh anonymous session keyring, then the
    syscall filter (for good: this process and all it starts). False if keyctl is refused."""
    joined = seccomp.join_fresh_session_keyring(SYSCALL_FILTER)
    seccomp.install(SYSCALL_FILTER)
    return joined


def _probe_confinement() -> None:
    os._exit(0 if _confine() else PROBE_NO_KEYCTL)


_ORIGINAL_STREAMS: list[io.TextIOWrapper] = []
"""The call's own stdout and stderr, flushed at its end even if the snippet rebinds
``sys.stdout`` and ``sys.__stdout__`` (as the interpreter's teardown flushes them)."""


def _fresh_interpreter_state(directory: str, env: dict) -> dict:
    """Make the forked interpreter look like ``python main.py`` started in ``directory``:
    environment, ``sys.argv``/``sys.path``, standard streams, ``__main__``, atexit."""
    os.environ.clear()
    os.environ.update(env, HOME=directory, TMPDIR=directory, PWD=directory)
    tempfile.tempdir = None
    sys.argv = [SCRIPT_NAME]
    sys.path.insert(0, directory)
    sys.stdin = sys.__stdin__ = _std_stream(0, sys.__stdin__, "r", "<stdin>")
    sys.stdout = sys.__stdout__ = _std_stream(1, sys.__stdout__, "w", "<stdout>")
    sys.stderr = sys.__stderr__ = _std_stream(2, sys.__stderr__, "w", "<stderr>")
    _ORIGINAL_STREAMS[:] = [sys.stdout, sys.stderr]
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    _fresh_atexit()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()  # a fresh interpreter would not share the parent's seed
    return main.__dict__


def _std_stream(fd: int, like: io.TextIOWrapper, mode: str, name: str) -> io.TextIOWrapper:
    """A standard stream made as the interpreter makes it (``create_stdio``): a buffered
    binary stream under a text wrapper with ``.mode`` and ``.name``, and the encoding,
    error handler and line buffering this interpreter chose for its own stream (the
    warm parent's stdin and stdout are pipes, as a call's are)."""
    buffered = io.open(fd, mode + "b", buffering=-1, closefd=False)
    buffered.raw.name = name
    stream = io.TextIOWrapper(buffered, encoding=like.encoding, errors=like.errors, newline="\n",
                              line_buffering=like.line_buffering, write_through=False)
    stream.mode = mode
    return stream


def _fresh_atexit() -> None:
    """Drop the warm parent's atexit hooks: the snippet's own hooks run at its end, as
    ``python main.py`` runs them. ``logging.shutdown`` stays, as importing logging
    registers it in any interpreter (the warm parent imported it already)."""
    atexit._clear()
    if "logging" in sys.modules:
        atexit.register(sys.modules["logging"].shutdown)


def compile_script(source: str, filename: str, auto_print: bool = True) -> list[types.CodeType]:
    """Compile ``source`` as the file ``filename``. With ``auto_print``, when its last
    top-level statement is a bare expression, that statement is compiled in ``single``
    mode, so its value is shown through ``sys.displayhook`` exactly as an interactive
    session shows it (``repr``, nothing for ``None``). Raises ``SyntaxError`` like ``compile``.
    """
    if not auto_print:
        return [compile(source, filename, "exec", dont_inherit=True)]
    tree = ast.parse(source, filename, "exec")
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = compile(ast.Interactive(body=[tree.body.pop()]), filename, "single", dont_inherit=True)
        if not tree.body and not tree.type_ignores:  # the expression alone: nothing before it to run
            return [last]
        return [compile(tree, filename, "exec", dont_inherit=True), last]
    return [compile(tree, filename, "exec", dont_inherit=True)]


def execute(source: str, namespace: dict, frames: int, filename: str, auto_print: bool = True,
            session: bool = False) -> int:
    """Run ``source`` in ``namespace`` as ``python filename`` would (plus ``auto_print``);
    return the exit code. Like the interpreter: an uncaught exception is printed, then
    non-daemon threads are joined and atexit hooks run, then the streams are flushed;
    an uncaught ``KeyboardInterrupt`` ends the process by SIGINT (return code -2).

    ``session``: one call of a stateful interpreter, which goes on afterwards — threads
    are joined and streams flushed, but no atexit hook runs and nothing ends the process
    (``SystemExit`` and ``KeyboardInterrupt`` end only the call)."""
    namespace.update(__file__=filename, __cached__=None)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    code, interrupted = 0, False
    try:
        blocks = compile_script(source, filename, auto_print)
    except (SyntaxError, ValueError) as exc:  # ValueError: NUL bytes in the source
        _report_exception(exc, frames, show_frames=False, session=session)
        blocks, code = [], 1
    try:
        for block in blocks:
            exec(block, namespace)
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:  # user code: report like the interpreter, never propagate
        code, interrupted = 1, isinstance(exc, KeyboardInterrupt)
        _report_exception(exc, frames, session=session)
    if session:
        _join_threads()
        flushed = _flush_std_streams()
        return 120 if not flushed and code == 0 else code
    if not _finalize() and code == 0:
        code = 120  # as Python exits when flushing stdout fails
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _finalize() -> bool:
    """What ``Py_FinalizeEx`` does for a script: join threads, run atexit hooks, flush the
    standard streams. False when flushing stdout failed (reported as Python reports it)."""
    try:
        threading._shutdown()  # non-daemon threads; concurrent.futures' exit hooks
    except BaseException:  # pragma: no cover - interpreters without it: join by hand
        _join_threads()
    hook = sys.unraisablehook  # the snippet's, if it set one
    sys.unraisablehook = lambda args: hook(type(args)((args.exc_type, args.exc_value, _user_frames(
        args.exc_traceback), args.err_msg, args.object)))
    atexit._run_exitfuncs()  # reports "Exception ignored in atexit callback" through that hook
    return _flush_std_streams()


def _flush_std_streams() -> bool:
    """Flush stdout and stderr, then the original streams if the snippet replaced them (text
    written to ``sys.__stdout__`` is not lost: the interpreter's teardown flushes them too);
    False when flushing ``sys.stdout`` failed (reported as Python reports it)."""
    flushed, seen = True, []
    streams = [("stdout", getattr(sys, "stdout", None)), ("stderr", getattr(sys, "stderr", None)),
               *zip(("__stdout__", "__stderr__"), _ORIGINAL_STREAMS)]
    for name, stream in streams:
        if stream is None or any(stream is other for other in seen):
            continue
        seen.append(stream)
        try:
            stream.flush()
        except BaseException as exc:  # the snippet replaced or broke the stream
            flushed = flushed and name != "stdout"
            _write_fd(2, f"Exception ignored on flushing sys.{name}:\n{type(exc).__name__}: {exc}\n")
    return flushed


def _write_fd(fd: int, text: str) -> None:
    try:
        os.write(fd, text.encode("utf-8", "backslashreplace"))
    except OSError:
        pass


def _user_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` without its leading frames of this file (the sandbox's, never the snippet's)."""
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def _join_threads() -> None:
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _report_exception(exc: BaseException, frames: int, show_frames: bool = True, session: bool = False) -> None:
    """Print ``exc`` through ``sys.excepthook`` as the interpreter does (minus the
    sandbox's own frames) and report a short traceback, for the model, on fd 3.
    ``show_frames=False`` (a SyntaxError of the file): no traceback, as Python prints it.
    ``session``: the call's file exists only in :mod:`linecache`, which the built-in hook
    does not read (it opens the file), so the same report is printed by :mod:`traceback`."""
    tb = _user_frames(exc.__traceback__) if show_frames else None
    exc.__traceback__ = tb
    try:
        if session and sys.excepthook is sys.__excepthook__:
            traceback.print_exception(type(exc), exc, tb, file=sys.stderr)
        else:
            sys.excepthook(type(exc), exc, tb)
    except BaseException:  # a broken hook, or no memory left: what the interpreter falls back to
        try:
            sys.__excepthook__(type(exc), exc, tb)
        except BaseException:
            pass
    try:
        short = "".join(traceback.format_exception(type(exc), exc, tb, limit=-frames if frames else None,
                                                   chain=False))
    except BaseException:  # e.g. MemoryError while formatting a huge traceback
        short = f"{type(exc).__name__}: (traceback unavailable)\n"
    _report(3, {"exc_type": type(exc).__name__, "short_tb": short[-8000:]})


if __name__ == "__main__":
    launcher_main()
