"""The sandbox that runs the model's Python snippets: local warm-fork executor (+ HTTP server/client).

Use::

    from retool.sandbox import Sandbox, SandboxConfig
    async with Sandbox(SandboxConfig(timeout_s=10)) as sb:
        res = await sb.run("import sympy\\nsympy.factorint(2**64 - 1)")
        res.status, res.observation     # ExecStatus.OK, '{3: 1, 5: 1, 17: 1, ...}'

What a call is: ``python main.py`` for the snippet written to ``main.py`` in a fresh,
empty working directory, with the given stdin — same ``__file__`` (``/sandbox/work/main.py``,
a neutral path inside the sandbox: no host path appears in any output), ``sys.argv``
(``['main.py']``), standard streams (made as the interpreter makes them: ``.mode``,
buffered ``.buffer``), tracebacks and ``SyntaxError`` reports (printed by
``sys.excepthook``), end of run (non-daemon threads joined, the snippet's own ``atexit``
hooks run, streams flushed) and return code (``-2`` after an uncaught
``KeyboardInterrupt``). The model's tool adds one thing: ``auto_print=True`` (the
default of ``Sandbox.run``) shows the value of a final bare expression, as a REPL does.
The modules in ``preload`` are already imported (faster; ``sys.modules`` shows them).
``memory_mb`` limits what the snippet allocates *on top of* that preloaded baseline
(``ExecutionResult.memory_baseline_bytes``, ~160 MB of address space with numpy and
sympy), so 512 MB lets a snippet allocate ~510 MB, as ``python main.py`` under
``ulimit -v 512M`` can allocate ~490 MB. Timeouts are bounded (``MAX_TIMEOUT_S``, 3600 s).

Stateful interpreter (opt-in; ``--interpreter stateful``)::

    async with sb.session() as s:             # one per trajectory
        await s.run("x = sympy.factorint(360)")
        (await s.run("len(x)")).stdout          # '3\n': the globals carry over

A session is one interpreter forked from the warm parent exactly as a call's runner is
(same namespaces, its own unprivileged uid, rlimits, scrubbed environment, output caps,
fresh session keyring and syscall filter),
started at its first call; its calls run one after the other in the same globals, each
as the file ``call<n>.py``. Limits are per call, never summed: before each call the
interpreter's soft CPU limit is its CPU time so far + the call's allowance and its
address-space limit its size now + ``memory_mb`` (under a hard cap for the whole
session, ``session_memory_mb``); the wall-clock timeout and output caps are the warm
parent's, per call. The interpreter is pid 1 of its own PID namespace: after each call it
kills every other process there (whatever the call started and left running, setsid and
double forks included), and when it dies the kernel kills them all. A call that times out,
exceeds memory (``MemoryError``), floods output or ends the process ends the interpreter;
the session's next call gets a fresh one and its observation begins with a note that the
state was lost (``ExecutionResult.state_lost``). Closing the session (also on errors and
cancellation: ``async with``/``aclose``) kills the interpreter and waits until its
processes are gone. ``SandboxConfig.max_sessions`` bounds the interpreters alive at once.

Threat model (Linux; what ``ExecutionResult.isolation`` lists is what was in force):

The snippet is untrusted code written by a model being trained: it may be buggy or
hostile (fork bombs, memory bombs, endless output, ``setsid``/double-fork escapes,
reading secrets, writing into the repository, signalling the trainer). Isolated:

- *Secrets.* The warm parent is started by ``exec`` with a fixed, minimal environment
  (``CLEAN_ENV``), never forked from the trainer, so neither the trainer's environment
  nor its memory is in any call. Each call has a private ``/proc`` showing only its own
  processes, so ``/proc/<trainer>/environ`` and ``cmdline`` do not exist for it.
- *Filesystem.* Every mount is read-only in the sandbox's mount namespace; the only
  writable places are the call's own empty directory (cwd, ``HOME`` and ``TMPDIR``; on
  a size-capped tmpfs, removed after the call) and a private ``/dev/shm``.
- *Privilege.* As root, each call slot runs as its own unused uid/gid (``uid_base + i``,
  no supplementary groups); otherwise the process runs in a user namespace with all
  capabilities dropped. ``no_new_privs`` stops setuid binaries from regaining root.
- *Processes.* Each call is a fresh PID namespace whose init is the sandbox's: when the
  snippet's main process ends or times out, every process left (``setsid``, double
  fork) is killed by the kernel. The snippet cannot see or signal the trainer, the warm
  parent or other calls. RLIMIT_NPROC (binding because of the private uid) caps
  processes; RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE bound memory, CPU and file size;
  output is read with a cap while the process runs; a wall-clock timeout kills the tree.
  The OOM killer prefers snippets (``oom_score_adj`` 1000) over the trainer.
- *Network.* A network namespace with no interfaces up (unless ``network=True``).
- *System calls* (``seccomp``). Just before the snippet runs, after the privilege drop, a
  seccomp-BPF filter goes on every call's and session's process, for good (its children
  inherit it; it cannot be removed, ``no_new_privs`` cannot be unset, a filter the snippet
  adds only narrows it): ``keyctl``/``add_key``/``request_key``, ``ptrace``,
  ``process_vm_readv/writev``, ``unshare``/``setns``, mounting and ``chroot``, ``bpf``,
  ``perf_event_open``, ``userfaultfd``, ``io_uring_*``, module and ``kexec`` loading, ``clone``
  with a namespace flag and every i386/x32 call fail with ``EPERM`` (a ``PermissionError``);
  ``clone3`` fails with ``ENOSYS`` (glibc falls back to ``clone``). The full list is
  ``retool.sandbox.seccomp.DENIED_SYSCALLS``; numpy, sympy, threads, ``multiprocessing`` and
  ``subprocess`` are unaffected.
- *Keyrings* (``fresh_keyring``). Each call and session leaves the session keyring the
  server was started in for a new, empty one before the filter goes on, and cannot use
  ``keyctl`` after it: the host's keys and its uid's user keyring (``@u``, which outlives a
  call, and uids are reused) are out of reach.

Not isolated / known limits:

- Concurrent calls share the network namespace (abstract Unix sockets could pass data
  between two calls running at the same time) and the scratch tmpfs's capacity.
- Each call's process (and each session's interpreter) is a fork of the warm parent, so the
  parent's memory at that moment is in it: references to other calls' and sessions' code,
  requests and output read so far are dropped in the child, but their bytes may remain in
  freed memory, readable by code that scans its own memory (ctypes).
- CPU time and disk bandwidth are not shared fairly; a call can slow its neighbours.
- The kernel is shared: a kernel exploit through a system call the filter allows escapes
  everything here (the filter is a deny list, not an allow list; there is no VM).
- Without root or unprivileged user namespaces (some containers), and on non-Linux
  systems, only rlimits, the scrubbed environment and the process-group kill apply:
  children that ``setsid()`` can outlive a call, the network and the filesystem are
  reachable with the trainer's rights. ``isolation`` then says so, the start-up log
  line says what is missing, the metric ``sandbox/isolation_degraded`` is 1, and
  ``strict=True`` (``--sandbox-strict``) refuses to start instead. Without a private
  mount namespace the call also runs at its real (host) directory, not at the neutral
  path. Non-Linux systems are not supported beyond that.
- The process ends with ``os._exit`` after the interpreter-like shutdown above: objects'
  finalizers (``__del__``) that only module teardown would call do not run.
- Sessions: the snippet shares its process with the session's call loop, so hostile code
  can subvert that loop — raise its own soft limits up to the hard ones (the wall-clock
  timeout and output caps, enforced by the warm parent, still hold), keep a daemon thread
  running between calls, or make the parent think a call ended early. It can only spoil
  its own session: another session or call, the trainer and the warm parent stay out of
  reach, and everything of the session dies when it is closed. Files a session's calls
  write stay in its directory until the session ends. Session calls take no ``stdin``,
  ``files`` or ``fetch_files``. Without a PID namespace (degraded isolation) processes a
  call leaves running live until the session ends, not the call.
"""

from retool.sandbox.executor import (
    DEFAULT_PRELOAD,
    Sandbox,
    SandboxConfig,
    SandboxUnavailableError,
)
from retool.sandbox.metrics import SandboxMetrics

__all__ = ["DEFAULT_PRELOAD", "Sandbox", "SandboxConfig", "SandboxMetrics", "SandboxUnavailableError"]
