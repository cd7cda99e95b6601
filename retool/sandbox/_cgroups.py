"""Control groups for the sandbox: limits enforced from outside the snippet's processes.

Loaded by the warm parent (``_zygote.py``, standard library only). Each call slot and
each session slot has a group of its own, created on first use and reused; a child joins
its group itself, before it runs any code, through ``cgroup.procs`` fds the zygote
opened (so the snippet never sees the cgroup file system: it is not mounted in the
sandbox). What a group gives, for every process of the call or session together:

- a memory limit (page cache and tmpfs files included) and no swap;
- a pids limit;
- CPU accounting, from which the zygote enforces the call's CPU-time bound (the snippet
  cannot ignore it, unlike SIGXCPU, which never reaches a PID namespace's init);
- freezing (a session is frozen between its calls: nothing of it runs, forks or spins
  there) and a kill of every process in it (``cgroup.kill`` on v2, freeze-and-kill on v1).

Version 2 is used where its memory and pids controllers can be enabled below this
process's group; else version 1 with the memory, pids, cpuacct and freezer controllers,
each under this process's group in that hierarchy. Everything is opened before the
sandbox's root filesystem is built, and every later access is relative to those
directory fds.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import sys
import time

ROOT = "/sys/fs/cgroup"
V1_CONTROLLERS = ("memory", "pids", "cpuacct", "freezer")
MEMORY_SLACK_BYTES = 128 << 20
"""Added to a group's memory limit: the pages of the preloaded interpreter that the
child's own writes copy (copy-on-write) are charged to the child's group."""
SETTLE_ROUNDS = 20
FREEZER_PIN = "frozen-pin"
"""v1: an empty group kept frozen for the sandbox's lifetime. The v1 freezer turns a
kernel-wide static key on when the first group starts freezing and off when the last one
thaws, and each switch patches kernel code on every CPU: ~80 µs per freeze and per thaw of
a session with no other group frozen, ~3 µs with this one frozen (``python bench/sandbox.py
--only freezer``). While it is, the kernel's freezing checks take their slow path, as they
do whenever any session is frozen. Version 2 has no such key."""


def _delegate_controllers(own: int) -> None:
    """v2: enable memory, pids and (where available) cpu in the slots' groups below ``own``."""
    available = _read(own, "cgroup.controllers").split()
    _write(own, "cgroup.subtree_control", " ".join(f"+{c}" for c in ("memory", "pids", "cpu") if c in available))


def _write(dir_fd: int, name: str, text: str) -> None:
    fd = os.open(name, os.O_WRONLY, dir_fd=dir_fd)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _pread(fd: int) -> str:
    """The whole content of a control file kept open: each read at offset 0 is fresh."""
    return os.pread(fd, 1 << 16, 0).decode()


def _read(dir_fd: int, name: str) -> str:
    fd = os.open(name, os.O_RDONLY, dir_fd=dir_fd)
    try:
        return os.read(fd, 1 << 20).decode()
    finally:
        os.close(fd)


def _own_path(controller: str | None) -> str:
    """This process's group in the hierarchy of ``controller`` (``None``: version 2)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            if (controller is None and names == "") or controller in names.split(","):
                return path
    raise OSError(errno.ENOENT, f"no {controller or 'v2'} hierarchy in /proc/self/cgroup")


class Hierarchy:
    """The sandbox's parent group (one per controller on v1), holding every slot's group."""

    def __init__(self, version: str, name: str, parents: dict[str, int], own: dict[str, int],
                 paths: list[str]):
        self.version = version  # "v1" or "v2"
        self.name = name
        self.paths = paths  # the parent group's directory in each hierarchy (host paths)
        self.parents = parents  # controller ("" on v2) -> fd of the group we made our group in
        self.own = own  # controller -> fd of our group (the sandbox's parent group)
        self.groups: dict[str, Group] = {}

    @classmethod
    def open(cls, name: str) -> Hierarchy:
        """Create the parent group ``name``; raises OSError when neither version works."""
        try:
            return cls._open_v2(name)
        except OSError as v2_error:
            try:
                return cls._open_v1(name)
            except OSError as v1_error:
                raise OSError(v1_error.errno, f"v2: {v2_error}; v1: {v1_error}") from None

    @classmethod
    def _open_v2(cls, name: str) -> Hierarchy:
        """Make the parent group under this process's own group (where memory and pids are
        delegated to its children), else under the hierarchy's root (as root)."""
        if not os.path.exists(f"{ROOT}/cgroup.controllers"):
            raise OSError(errno.ENOENT, f"{ROOT} is not a cgroup v2 mount")
        errors = []
        for path in dict.fromkeys([ROOT + _own_path(None).rstrip("/"), ROOT]):
            try:
                return cls._open_v2_under(path, name)
            except OSError as exc:
                errors.append(f"{path}: {exc.strerror or exc}")
        raise OSError(errno.ENOTSUP, "; ".join(errors))

    @classmethod
    def _open_v2_under(cls, path: str, name: str) -> Hierarchy:
        parent = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        made, own = False, None
        try:
            if not {"memory", "pids"} <= set(_read(parent, "cgroup.subtree_control").split()):
                _write(parent, "cgroup.subtree_control", "+memory +pids")  # EBUSY if it holds processes
            os.mkdir(name, 0o755, dir_fd=parent)
            made = True
            own = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=parent)
            _delegate_controllers(own)
        except OSError:
            if own is not None:
                os.close(own)
            if made:
                _rmdir(parent, name)
            os.close(parent)
            raise
        return cls("v2", name, {"": parent}, {"": own}, [f"{path}/{name}"])

    @classmethod
    def _open_v1(cls, name: str) -> Hierarchy:
        parents, own, paths = {}, {}, []
        try:
            for controller in V1_CONTROLLERS:
                path = f"{ROOT}/{controller}{_own_path(controller).rstrip('/')}"
                parents[controller] = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
                paths.append(f"{path}/{name}")
                os.mkdir(name, 0o755, dir_fd=parents[controller])
                own[controller] = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=parents[controller])
        except OSError:
            for controller, fd in parents.items():
                if controller in own:
                    os.close(own[controller])
                    _rmdir(fd, name)
                os.close(fd)
            raise
        hierarchy = cls("v1", name, parents, own, paths)
        hierarchy._pin_freezer()
        return hierarchy

    def _pin_freezer(self) -> None:
        """Make and freeze the empty :data:`FREEZER_PIN` group (v1); without it, the
        sandbox works as well, its freezes and thaws cost more."""
        freezer = self.own["freezer"]
        try:
            os.mkdir(FREEZER_PIN, 0o755, dir_fd=freezer)
            _write(freezer, f"{FREEZER_PIN}/freezer.state", "FROZEN")
        except OSError as exc:
            sys.stderr.write(f"retool sandbox: no frozen pin group ({exc}): each freeze and thaw takes ~0.1 ms\n")

    def _unpin_freezer(self) -> None:
        freezer = self.own.get("freezer")
        if freezer is not None and _is_dir(freezer, FREEZER_PIN, missing_ok=True):
            _write(freezer, f"{FREEZER_PIN}/freezer.state", "THAWED")
            _rmdir(freezer, FREEZER_PIN)

    def group(self, name: str) -> Group:
        """The group ``name`` (created on first use)."""
        if name not in self.groups:
            fds = {}
            for controller, parent in self.own.items():
                try:
                    os.mkdir(name, 0o755, dir_fd=parent)
                except FileExistsError:
                    pass
                fds[controller] = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=parent)
            self.groups[name] = Group(self.version, fds)
        return self.groups[name]

    def close(self) -> None:
        """Kill what is left in every slot's group (made by this process or a fork of it),
        remove those groups and the parent group."""
        for name in self._group_names():
            group = self.groups.get(name) or self.group(name)
            group.kill_all()
            group.close()
            for parent in self.own.values():
                _rmdir(parent, name)
        self._unpin_freezer()
        for controller, fd in self.own.items():
            os.close(fd)
            _rmdir(self.parents[controller], self.name)
            os.close(self.parents[controller])

    def _group_names(self) -> list[str]:
        fd = next(iter(self.own.values()))
        return sorted(name for name in os.listdir(fd) if _is_dir(fd, name))


class Group:
    """One slot's group: limits, accounting, freezing and killing of all its processes."""

    def __init__(self, version: str, fds: dict[str, int]):
        self.version = version
        self.fds = fds
        self.limits: tuple[int, int] | None = None
        self.kept: dict[str, int] = {}  # control files read or written on every call, kept open

    def _fd(self, controller: str) -> int:
        return self.fds["" if self.version == "v2" else controller]

    def _kept(self, controller: str, name: str) -> int:
        """An fd of the control file ``name``, opened once (a session's calls read and
        write the same few files: one syscall each instead of three)."""
        if name not in self.kept:
            self.kept[name] = os.open(name, os.O_RDWR if name in WRITTEN else os.O_RDONLY, dir_fd=self._fd(controller))
        return self.kept[name]

    def set_limits(self, memory_bytes: int, pids: int) -> None:
        """Memory (no swap) and process-count limits (written only when they change)."""
        if self.limits == (memory_bytes, pids):
            return
        memory, text = self._fd("memory"), str(memory_bytes + MEMORY_SLACK_BYTES)
        if self.version == "v2":
            _write(memory, "memory.max", text)
            _write_if_present(memory, "memory.swap.max", "0")
        else:  # memsw (memory + swap) may not be below the memory limit: order matters
            current = int(_read(memory, "memory.limit_in_bytes"))
            names = ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
            for name in (names if int(text) <= current else names[::-1]):
                _write_if_present(memory, name, text)
        _write(self._fd("pids"), "pids.max", str(pids))
        self.limits = (memory_bytes, pids)

    def join_fds(self) -> list[int]:
        """Fresh fds of this group's ``cgroup.procs`` (one per hierarchy): a child that
        writes ``0`` to each joins the group. The caller closes them."""
        return [os.open("cgroup.procs", os.O_WRONLY, dir_fd=fd) for fd in self.fds.values()]

    def cpu_seconds(self) -> float:
        """CPU time used by every process that was ever in the group."""
        if self.version == "v2":
            stat = dict(line.split() for line in _pread(self._kept("", "cpu.stat")).splitlines())
            return int(stat["usage_usec"]) / 1e6
        return int(_pread(self._kept("cpuacct", "cpuacct.usage"))) / 1e9

    def pids(self) -> list[int]:
        """The processes in the group (``cgroup.procs`` is opened afresh each time: a kept
        fd of it does not see processes that joined later)."""
        return [int(p) for p in _read(self._fd("pids"), "cgroup.procs").split()]

    def alone(self, pid: int) -> bool:
        """Whether ``pid`` (a member) is the group's only process. ``pids.current`` counts
        every task (threads, and forks still in progress, too): when it says 1, that is
        ``pid``'s one thread, read in ~1 µs; otherwise the process list decides (~20 µs)."""
        try:
            if int(_pread(self._kept("pids", "pids.current"))) == 1:
                return True
        except FileNotFoundError:  # v2 without the pids controller (only in tests)
            pass
        return self.pids() == [pid]

    def peak_memory_bytes(self) -> int | None:
        """The group's peak memory use (v1: since it was created or last reset)."""
        name = "memory.peak" if self.version == "v2" else "memory.max_usage_in_bytes"
        try:
            return int(_read(self._fd("memory"), name))
        except OSError:
            return None

    def freeze(self, wait: bool = True) -> None:
        """Stop every process of the group; with ``wait``, return once they are all stopped."""
        if self.version == "v2":
            os.pwrite(self._kept("", "cgroup.freeze"), b"1", 0)
        else:
            os.pwrite(self._kept("freezer", "freezer.state"), b"FROZEN", 0)
        if not wait:
            return
        deadline = time.monotonic() + 5.0
        while not self.frozen():
            if time.monotonic() > deadline:
                raise TimeoutError(errno.ETIMEDOUT, "the group did not freeze")
            time.sleep(0.0005)

    def frozen(self) -> bool:
        """Whether every process of the group is stopped (a freeze asked for has completed)."""
        if self.version == "v2":
            return "frozen 1" in _pread(self._kept("", "cgroup.events")).splitlines()
        return _pread(self._kept("freezer", "freezer.state")).strip() == "FROZEN"

    def thaw(self) -> None:
        if self.version == "v2":
            os.pwrite(self._kept("", "cgroup.freeze"), b"0", 0)
        else:
            os.pwrite(self._kept("freezer", "freezer.state"), b"THAWED", 0)

    def kill_all(self, keep: int | None = None) -> None:
        """SIGKILL every process of the group but ``keep`` (they die at once, frozen or
        not) and leave it thawed (a process that joins a frozen group is frozen at once)."""
        if keep is None and self.version == "v2" and _write_if_present(self.fds[""], "cgroup.kill", "1"):
            self.thaw()
            return
        try:
            self.freeze()
        except TimeoutError as exc:  # a process stuck in the kernel (D state): kill what can be killed
            sys.stderr.write(f"retool sandbox: {exc.strerror}; killing its processes unfrozen\n")
        for pid in self.pids():
            if pid != keep:
                _kill(pid)
        self.thaw()

    def leave_only(self, keep: int) -> int:
        """Kill every process of the group but ``keep`` and leave the group frozen, with
        ``keep`` alone in it. Returns how many processes were killed; raises OSError when
        new ones keep appearing (``keep`` forks as fast as they die)."""
        killed = 0
        for _ in range(SETTLE_ROUNDS):
            self.freeze()
            others = [pid for pid in self.pids() if pid != keep]
            if not others:
                return killed
            for pid in others:
                _kill(pid)
            killed += len(others)
            self.thaw()  # the killed ones die as they thaw
            _wait_until_gone(self, others)
        raise OSError(errno.EAGAIN, "processes keep appearing in the session's group")

    def close(self) -> None:
        for fd in [*self.kept.values(), *self.fds.values()]:
            os.close(fd)
        self.fds, self.kept = {}, {}


WRITTEN = ("cgroup.freeze", "freezer.state")
"""The kept-open control files that are written (the others are only read)."""


def _wait_until_gone(group: Group, pids: list[int], seconds: float = 1.0) -> None:
    deadline = time.monotonic() + seconds
    while set(pids) & set(group.pids()) and time.monotonic() < deadline:
        time.sleep(0.0005)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass


def _is_dir(dir_fd: int, name: str, missing_ok: bool = False) -> bool:
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        if missing_ok:
            return False
        raise


def _write_if_present(dir_fd: int, name: str, text: str) -> bool:
    try:
        _write(dir_fd, name, text)
        return True
    except FileNotFoundError:  # not in this kernel or configuration (e.g. no swap accounting)
        return False


def _rmdir(dir_fd: int, name: str, seconds: float = 1.0) -> None:
    """Remove an empty group; its last processes may take a moment to leave (EBUSY)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            os.rmdir(name, dir_fd=dir_fd)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.001)


def join(fds: list[int]) -> None:
    """In a new child, before it runs any code: join the group those fds belong to."""
    for fd in fds:
        os.write(fd, b"0")
        os.close(fd)


def remove_leftovers(paths: list[str], seconds: float = 5.0) -> list[str]:
    """On the trainer's side, once the warm parent is gone (killed, so it could not clean
    up): kill whatever is left in the sandbox's groups, thaw them (a frozen process dies
    only when thawed), and remove them. Returns the paths that could not be removed."""
    paths = [p for p in paths if os.path.isdir(p)]  # the others were removed as it ended
    groups = [os.path.join(p, n) for p in paths for n in os.listdir(p) if os.path.isdir(os.path.join(p, n))]
    for group in groups:
        try:
            with open(os.path.join(group, "cgroup.procs")) as f:
                for pid in f.read().split():
                    _kill(int(pid))
            for name, text in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
                if os.path.exists(os.path.join(group, name)):
                    with open(os.path.join(group, name), "w") as f:
                        f.write(text)
        except OSError:  # removed meanwhile, or not ours to write: the rmdir below says
            continue
    deadline = time.monotonic() + seconds
    left = []
    for path in [*groups, *paths]:
        while True:
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    left.append(path)
                    break
                time.sleep(0.01)
    return left
