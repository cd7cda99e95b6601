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

A session is one interpreter forked exactly as a call's runner is (same namespaces, its
own unprivileged uid, rlimits, scrubbed environment, output caps, fresh session keyring
and syscall filter, plus a network namespace of its own), given to it at its first call; its
calls run one after the other in the same globals, each as the file ``call<n>.py``.
Limits are per call, never summed: before each call the interpreter's soft address-space
limit is its size now + ``memory_mb`` (under a hard cap for the whole session,
``session_memory_mb``); the wall-clock timeout, the CPU-time bound and the output caps
are the warm parent's, per call. The interpreter is pid 1 of its own PID namespace, so
when it dies the kernel kills every process of the session. After each call the
interpreter kills every other process there (whatever the call started and left running,
setsid and double forks included); with control groups, the session's group is then
frozen once the session has been idle for 10 ms — nothing of it runs between calls,
daemon threads included, beyond those 10 ms, and what its threads use of the CPU before
the freeze is charged to the next call's CPU-time bound — and, once it is frozen, the
warm parent, which the snippet cannot reach, checks that the interpreter is alone in it;
the next call thaws it. Before every next call the warm parent kills every other process
in the group, frozen (a call that comes back to back, before the freeze, finds the group
unfrozen: with the interpreter alone in it, it needs neither freeze nor thaw). A call that times out,
exceeds memory (``MemoryError``), floods output or ends the process ends the interpreter;
the session's next call gets a fresh one and its observation begins with a note that the
state was lost (``ExecutionResult.state_lost``). Closing the session (also on errors and
cancellation: ``async with``/``aclose``) kills the interpreter and waits until its
processes are gone. ``SandboxConfig.max_sessions`` bounds the interpreters alive at once.

Threat model (Linux; what ``ExecutionResult.isolation`` lists is what was in force):

The snippet is untrusted code written by a model being trained: it may be buggy or
hostile (fork bombs, memory bombs, endless output, ``setsid``/double-fork escapes,
reading secrets, writing into the repository, signalling the trainer, reading other
calls' work, switching off the mechanisms that contain it). Isolated:

- *Other work* (``clean_template``). No call or session process is a fork of the warm
  parent that holds requests: the warm parent forks a template right after importing
  ``preload``, before it has read any request, and the template (one per call slot, and
  one for sessions) forks every runner and interpreter. Each child then reads its own
  request from a memory file of its own. So no other call's or session's code, input or
  output is in a child's memory at all — not as objects, not as freed bytes.
  Children are forked ahead of their work (``prefork``; ``SandboxConfig.prefork`` of each
  kind): a ready child has its control group, PID namespace, private mounts, directory
  and (a session's) network namespace, but no request and nothing of any call; it runs
  only the sandbox's code (still with the warm parent's uid, at a lower priority), waiting
  on a socket of its own for the memory file with its request (and a call's stdin). Rlimits, the privilege drop, the fresh interpreter
  state, keyring and filter come after the request, as before, always before the snippet.
- *Secrets.* The warm parent is started by ``exec`` with a fixed, minimal environment
  (``CLEAN_ENV``), never forked from the trainer, so neither the trainer's environment
  nor its memory is in any call. Each call has a private ``/proc`` showing only its own
  processes, so ``/proc/<trainer>/environ`` and ``cmdline`` do not exist for it.
- *Filesystem.* Every mount is read-only in the sandbox's mount namespace; the only
  writable places are the call's own empty directory (cwd, ``HOME`` and ``TMPDIR``) and a
  private ``/dev/shm``. Each call's and each session's directory is a tmpfs of its own,
  ``call_scratch_mb`` in size (``scratch_quota``), detached when the call or session
  ends: one that fills its space (ENOSPC) takes none from the others.
- *Privilege.* As root, each call slot runs as its own unused uid/gid (``uid_base + i``,
  no supplementary groups); otherwise the process runs in a user namespace with all
  capabilities dropped. ``no_new_privs`` stops setuid binaries from regaining root.
- *Processes.* Each call is a fresh PID namespace whose init is the sandbox's: when the
  snippet's main process ends or times out, every process left (``setsid``, double
  fork) is killed by the kernel. The snippet cannot see or signal the trainer, the warm
  parent or other calls. RLIMIT_NPROC (binding because of the private uid) caps
  processes; RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE bound each process's memory, CPU and
  file size; output is read with a cap while the process runs; a wall-clock timeout
  kills the tree. The OOM killer prefers snippets (``oom_score_adj`` 1000) over the trainer.
- *Limits from outside* (``cgroup_v2`` or ``cgroup_v1``; as root). Each call slot and each
  session has a control group (v2 where its memory and pids controllers can be enabled,
  else v1's memory, pids, cpuacct and freezer), which every process of the call or
  session is in from its first instruction (the cgroup file system is not mounted in the
  sandbox, so none can move itself out). The kernel bounds their memory together
  (``memory_mb``, for a session ``session_memory_mb``, + 128 MiB for copied pages of the
  interpreter; no swap) and their number (``max_processes``); the warm parent reads
  their CPU time together every 50 ms and kills the call past its allowance (``cpu_s``:
  a session's interpreter is pid 1 of its namespace, which SIGXCPU never reaches, and
  raising the soft rlimits up to the hard ones gains nothing). Ending them all is
  ``cgroup.kill`` (v2) or freeze-and-kill (v1).
- *Network.* A network namespace with no interfaces up (unless ``network=True``), and
  one more per session (``session_netns``): abstract Unix sockets and loopback do not
  connect a session to any other session or call.
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

- Concurrent stateless calls share one network namespace (abstract Unix sockets could
  pass data between two calls running at the same time; a namespace per call would cost
  several ms per call). The tmpfs directories are capped each, not together: many full
  ones at once use that much memory (charged to each call's memory limit where control
  groups are in force).
- A child is a fork of the template, so it holds what the warm parent held before its
  first request: the preloaded modules and the configuration, nothing of any call.
- CPU time and disk bandwidth are not shared fairly; a call can slow its neighbours
  (control groups bound each call's CPU time, not its share of the machine). One
  mitigation, off by default: a stateless call still running after ``demote_after_s``
  (the service presets: 1 s) runs the rest of its time at nice 19, and so does its
  session's autogroup (the kernel weighs sessions against each other first), every
  process of it (those in its control group, else its process group; children inherit
  it); RLIMIT_NICE 0 without capabilities keeps it there, so a snippet that spins to
  its timeout takes only the CPU the short calls leave (beside a sampler that keeps
  every core busy it gets almost none: hence off by default). Before that second, and
  in sessions, calls share the CPU as ordinary processes; with control groups a process
  the call starts later, in a session of its own too, is demoted within 50 ms; without
  them a snippet that leaves its process group before the second keeps its priority.
- The kernel is shared: a kernel exploit through a system call the filter allows escapes
  everything here (the filter is a deny list, not an allow list; there is no VM).
- Control groups need root (as another user, or where the cgroup file system cannot be
  written): then memory, processes and CPU are bounded per process only (rlimits), a
  session's CPU time only by its calls' wall-clock timeouts, and a session's interpreter
  kills its own strays after each call (its code can switch that off); ``isolation``
  lacks ``cgroup_*``, and ``strict=True`` refuses to start.
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
  can subvert that loop — raise its own soft limits up to the hard ones (the control
  group's memory, pids and CPU bounds, the wall-clock timeout and output caps, all
  enforced from outside, still hold), or make the parent think a call ended early (the
  session is then frozen and cleared of strays early). It can only spoil its own
  session: another session or call, the trainer and the warm parent stay out of reach,
  and everything of the session dies when it is closed. With control groups, daemon
  threads do not run between calls once the session has been idle for 10 ms (it is
  frozen); in those 10 ms they run, charged to the next call's CPU time, and a process
  they fork there, after the warm parent's look before a back-to-back call, lives into
  that call (as one forked during it would) and is killed after it. Files a session's calls write stay in its
  directory until the session ends. Session calls take no ``stdin``, ``files`` or
  ``fetch_files``. Without a PID namespace (degraded isolation) processes a call leaves
  running live until the session ends, not the call.
"""

from retool.sandbox.executor import (
    DEFAULT_PRELOAD,
    Sandbox,
    SandboxConfig,
    SandboxUnavailableError,
)
from retool.sandbox.metrics import SandboxMetrics

__all__ = ["DEFAULT_PRELOAD", "Sandbox", "SandboxConfig", "SandboxMetrics", "SandboxUnavailableError"]
