"""The syscall filter and the fresh keyring every sandboxed call and session starts with.

Two things, applied in the child after its privilege drop, just before the snippet runs:

1. :func:`join_fresh_session_keyring` — the process leaves the session keyring the server
   was started in (inherited through ``exec`` and the uid drop alike) for a new, empty,
   anonymous one, so the host's keys are not reachable through ``@s``.
2. :func:`install` — a seccomp-BPF filter (:func:`compile_filter`) that makes the system
   calls in :data:`DENIED_SYSCALLS` fail with ``EPERM`` (Python raises ``PermissionError``),
   as do ``clone`` with a namespace-creating flag (:data:`NAMESPACE_CLONE_FLAGS`) and every
   call from another architecture's ABI (i386 through the ``AUDIT_ARCH`` check, x32 through
   the ``0x40000000`` bit of the syscall number); ``clone3`` fails with ``ENOSYS`` so that
   glibc falls back to ``clone``, whose flags the filter can inspect (as Docker's default
   profile does: clone3's flags sit in memory a filter cannot read). Denying ``keyctl``,
   ``add_key`` and ``request_key`` also keeps the snippet's uid's user keyring (``@u``,
   which outlives the call, and sandbox uids are reused) unwritable.

The filter cannot be lifted from inside: the kernel gives seccomp filters to every child
and offers no call to remove one; ``no_new_privs`` (set before it) cannot be unset; a
filter the snippet adds itself is stacked, and the strictest answer of all filters wins.
Everything else is allowed: numpy, sympy, threads, ``multiprocessing`` and ``subprocess``
keep working. The list is what Docker's default profile denies that a math snippet never
needs; it is a deny list, not an allow list, so a new kernel's new system calls are
allowed until named here.

Built with **pyseccomp** (pure-Python ctypes binding of libseccomp2, the library Docker,
systemd and podman compile their filters with): libseccomp knows every architecture's
syscall numbers and writes the architecture and x32 checks itself, which a hand-written BPF
builder would have to get right per architecture. The program is compiled once in the warm
parent (:func:`compile_filter`); a child only hands the finished bytes to the kernel
(:func:`install`, one ``prctl``), which costs microseconds. Where pyseccomp or libseccomp2 is
missing, :func:`compile_filter` raises :class:`FilterUnavailable` and the sandbox runs
without the filter, saying so in ``isolation`` (``strict`` then refuses).

This module imports only the standard library at top level, so the warm parent can load it
as a plain file.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from dataclasses import dataclass

DENIED_SYSCALLS = (
    # kernel keyrings: shared with the host and outliving the call
    "keyctl", "add_key", "request_key",
    # reading or writing other processes' memory
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # namespaces and mounts (the sandbox sets them up before the filter goes on)
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot",
    "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "name_to_handle_at", "open_by_handle_at",
    # large kernel attack surface a snippet never needs
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    # the machine itself: kernel code, clocks, swap, accounting
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "reboot", "swapon", "swapoff", "acct", "settimeofday", "clock_settime", "clock_adjtime",
    "syslog", "quotactl", "lookup_dcookie", "vhangup", "iopl", "ioperm", "uselib",
)
"""System calls that fail with ``EPERM`` inside the sandbox (those this architecture has)."""

NAMESPACE_CLONE_FLAGS = {
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
"""``clone`` flags that create a namespace: ``clone`` with any of them fails with ``EPERM``
(``CLONE_NEWTIME`` exists only for ``unshare`` and ``clone3``, which are denied outright)."""

KEYCTL_JOIN_SESSION_KEYRING = 1
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2


_libc = None


def _libc_handle() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


class FilterUnavailable(RuntimeError):
    """The filter cannot be built here (no pyseccomp, no libseccomp2, not Linux)."""


@dataclass(frozen=True)
class Filter:
    """A compiled filter for this machine's architecture, ready for :func:`install`."""

    program: bytes
    """The BPF program: ``struct sock_filter`` entries of 8 bytes each."""
    keyctl_nr: int
    """This architecture's number of ``keyctl`` (glibc has no wrapper for it)."""


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def compile_filter() -> Filter:
    """Compile the filter for this machine's architecture with libseccomp (see the module
    docstring for what it denies). Raises :class:`FilterUnavailable` where it cannot."""
    if not sys.platform.startswith("linux"):
        raise FilterUnavailable("seccomp exists only on Linux")
    try:
        import pyseccomp as sc  # optional: the sandbox runs (degraded) without it
    except (ImportError, RuntimeError, OSError) as exc:  # RuntimeError: libseccomp2 not found
        raise FilterUnavailable(f"pyseccomp/libseccomp2 unavailable ({exc})") from exc
    arch = sc.system_arch()
    rules = sc.SyscallFilter(sc.ALLOW)
    rules.set_attr(sc.Attr.ACT_BADARCH, sc.ERRNO(errno.EPERM))  # i386 and x32 calls
    for name in DENIED_SYSCALLS:
        if sc.resolve_syscall(arch, name) >= 0:  # skip what this architecture lacks
            rules.add_rule(sc.ERRNO(errno.EPERM), name)
    for flag in NAMESPACE_CLONE_FLAGS.values():
        rules.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    rules.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    compiled = Filter(program=_export(rules), keyctl_nr=sc.resolve_syscall(arch, "keyctl"))
    _libc_handle(), _prepared(compiled.program)  # made once here, inherited by every forked child
    return compiled


def _export(rules) -> bytes:
    read_end, write_end = os.pipe()  # a program is a few hundred bytes: fits the pipe buffer
    try:
        with os.fdopen(write_end, "wb") as sink:
            rules.export_bpf(sink)
        return _read_all(read_end)
    finally:
        os.close(read_end)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


_PREPARED: dict[bytes, tuple[_SockFprog, ctypes.Array]] = {}


def _prepared(program: bytes) -> _SockFprog:
    """The ``struct sock_fprog`` for ``program`` (kept with the instructions it points to)."""
    if program not in _PREPARED:
        count = len(program) // ctypes.sizeof(_SockFilter)
        instructions = (_SockFilter * count).from_buffer_copy(program)
        _PREPARED[program] = (_SockFprog(count, instructions), instructions)
    return _PREPARED[program][0]


def install(compiled: Filter) -> None:
    """Put ``compiled`` on the calling thread for good (the sandbox's child is single-threaded
    here: its threads and children created later inherit it). Sets ``no_new_privs`` first,
    as the kernel requires of an unprivileged caller. Raises ``OSError`` on failure."""
    libc, prog = _libc_handle(), _prepared(compiled.program)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    _check(libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(prog), 0, 0),
           "prctl(PR_SET_SECCOMP)")


def join_fresh_session_keyring(compiled: Filter) -> bool:
    """Replace the inherited session keyring with a new anonymous one (owned by the caller's
    uid, empty, gone with the call's last process). False where the kernel or a container's
    own filter refuses ``keyctl`` (then the host's keyrings are out of reach anyway)."""
    libc = _libc_handle()
    if libc.syscall(ctypes.c_long(compiled.keyctl_nr), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING),
                    ctypes.c_void_p(None)) >= 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM, errno.EACCES):
        return False
    raise OSError(err, f"keyctl(KEYCTL_JOIN_SESSION_KEYRING): {os.strerror(err)}")


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
