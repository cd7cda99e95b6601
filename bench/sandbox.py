"""Benchmark: the warm-fork sandbox against one ``python -B -c`` subprocess per call.

Measured in the same run, for three snippets ((a) ``print(1+1)``, (b) sympy factoring,
(c) a numpy snippet) at concurrency 1 and 8: p50/p95 latency and calls/s of the
sandbox with all isolation on, of the baseline (a fresh interpreter per call with the
same rlimits, a scrubbed environment, closed stdin and its own temporary directory, but
no namespaces), and the ratio baseline/sandbox. Then what each per-call isolation
mechanism costs: p50 of (a) with everything on minus p50 with that one left out
(``SandboxConfig.benchmark_skip``). Shared mechanisms (network namespace, minimal root
filesystem) are entered once at start-up and cost nothing per call.

Then the hardening mechanisms (clean template, control groups, per-call and per-session
tmpfs, per-session network namespace, syscall filter and fresh keyring) and the children
forked ahead of their work that
pay for them (prefork): before (none of them) and after (all of them) in one run, and
what each costs, for stateless calls and for sessions (first and later calls).

Last, the stateful interpreter against the stateless one (the baseline of that table),
in the same sandbox, rounds interleaved so machine load hits both alike: per-call
latency of trajectories of ``--session-calls`` calls (each a session opened at its first
call and closed after its last), at 1 and 8 trajectories at once; p50/p95 of all calls,
p50 of first calls (they fork the session's interpreter) and of later calls, the ratio
stateless/stateful, and the load average before and after.

Then why a child is born in its control group rather than moved there (``--only
cgroup-join``, as root): what joining a group costs, back to back and 100 ms apart.

And why the sandbox keeps an empty v1 group frozen (``--only freezer``, as root, v1): what
freezing and thawing a group with one sleeping process costs with no other group frozen
(each freeze and thaw flips the kernel's freezer static key) vs with one kept frozen.

Or, with ``--against REV``, only this: this checkout's sandbox against git revision REV's (e.g.
``3b5ca40``, the code before the hardening), both with their defaults, each in its own process,
rounds interleaved: the same calls per round as the hardening table.

Usage: ``python bench/sandbox.py [--calls 40] [--baseline-calls 12] [--rounds 30] [--only hardening]``
or ``python bench/sandbox.py --against 3b5ca40 --rounds 60``.
Needs Linux; the isolation columns need root or unprivileged user namespaces.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from retool.sandbox import Sandbox, SandboxConfig
from retool.sandbox.executor import CLEAN_ENV, SKIPPABLE
from retool.sandbox.metrics import percentile

SNIPPETS = {
    "a_print": "print(1+1)",
    "b_sympy": "import sympy; print(sympy.factorint(2**64-1))",
    "c_numpy": "import numpy as np\na = np.arange(1, 10001, dtype=np.float64)\nprint(float(np.sum(1 / a**2)))",
}
CFG = SandboxConfig(timeout_s=30)


def baseline_call(code: str) -> float:
    """One fresh interpreter per call, under the same limits as the sandbox."""
    workdir = tempfile.mkdtemp(prefix="bench-baseline-")

    def limits():
        mib = 1 << 20
        resource.setrlimit(resource.RLIMIT_AS, (CFG.memory_mb * mib,) * 2)
        resource.setrlimit(resource.RLIMIT_CPU, (int(CFG.timeout_s) + 1,) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (CFG.max_file_mb * mib,) * 2)
        resource.setrlimit(resource.RLIMIT_NPROC, (CFG.max_processes,) * 2)

    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-B", "-c", code], stdin=subprocess.DEVNULL,
                              capture_output=True, env={**CLEAN_ENV, "HOME": workdir, "TMPDIR": workdir},
                              cwd=workdir, timeout=CFG.timeout_s, preexec_fn=limits)
        assert proc.returncode == 0, proc.stderr
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return time.perf_counter() - start


def measure_baseline(code: str, calls: int, concurrency: int) -> tuple[list[float], float]:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        latencies = list(pool.map(baseline_call, [code] * calls))
    return latencies, time.perf_counter() - start


def measure_sandbox(sb: Sandbox, code: str, calls: int, concurrency: int) -> tuple[list[float], float]:
    async def one(gate: asyncio.Semaphore) -> float:
        async with gate:
            t = time.perf_counter()
            res = await sb.run(code)
            assert res.ok, res
            return time.perf_counter() - t

    async def main() -> list[float]:
        gate = asyncio.Semaphore(concurrency)
        return list(await asyncio.gather(*(one(gate) for _ in range(calls))))

    start = time.perf_counter()
    latencies = asyncio.run(main())
    return latencies, time.perf_counter() - start


def summary(latencies: list[float], wall: float) -> tuple[float, float, float]:
    ordered = sorted(latencies)
    return percentile(ordered, 50) * 1e3, percentile(ordered, 95) * 1e3, len(latencies) / wall


def compare(calls: int, baseline_calls: int) -> None:
    with Sandbox(CFG) as sb:
        t = time.perf_counter()
        isolation = sb.start()
        print(f"sandbox start-up (imports included): {time.perf_counter() - t:.2f} s")
        print(f"isolation: {', '.join(isolation)}\n")
        measure_sandbox(sb, "1", 8, 8)  # warm-up
        header = (f"{'snippet':9} {'conc':>4} | {'sandbox p50':>11} {'p95':>7} {'calls/s':>8} | "
                  f"{'baseline p50':>12} {'p95':>7} {'calls/s':>8} | {'p50 ratio':>9} {'calls/s ratio':>13}")
        print(header + "\n" + "-" * len(header))
        for name, code in SNIPPETS.items():
            for conc in (1, 8):
                s50, s95, srate = summary(*measure_sandbox(sb, code, calls, conc))
                b50, b95, brate = summary(*measure_baseline(code, baseline_calls, conc))
                print(f"{name:9} {conc:>4} | {s50:>8.1f} ms {s95:>7.1f} {srate:>8.1f} | "
                      f"{b50:>9.1f} ms {b95:>7.1f} {brate:>8.1f} | {b50 / s50:>8.1f}x {srate / brate:>12.1f}x")


def mechanism_costs(calls: int) -> None:
    """Interleave calls round-robin over one sandbox per variant, so that load from other
    processes hits every variant alike (this matters on a shared machine)."""
    print(f"\nper-call cost of each isolation mechanism (p50 of {SNIPPETS['a_print']!r}, "
          "concurrency 1, variants interleaved)")
    variants = {"all on": (), **{f"without {m}": (m,) for m in SKIPPABLE}, "none of them": SKIPPABLE}
    logging.getLogger("retool.sandbox").setLevel(logging.ERROR)  # the variants are degraded on purpose
    boxes = {label: Sandbox(SandboxConfig(timeout_s=30, benchmark_skip=skip)) for label, skip in variants.items()}
    latencies: dict[str, list[float]] = {label: [] for label in variants}
    try:
        for sb in boxes.values():
            sb.start()
            sb.run_sync("1")
        for _ in range(calls):
            for label, sb in boxes.items():
                t = time.perf_counter()
                assert sb.run_sync(SNIPPETS["a_print"]).ok
                latencies[label].append(time.perf_counter() - t)
    finally:
        for sb in boxes.values():
            sb.close()
    p50s = {label: percentile(sorted(ts), 50) * 1e3 for label, ts in latencies.items()}
    for label, p50 in p50s.items():
        cost = "" if label == "all on" else f"  (all on costs {p50s['all on'] - p50:+.1f} ms more)"
        print(f"  {label:28} p50 {p50:6.1f} ms{cost}")


HARDENING = ("template", "cgroups", "scratch_quota", "session_netns", "seccomp", "prefork")
"""The mechanisms that close the structural attack classes: a clean template to fork
children from, a control group per call and session, a tmpfs per call and session, a
network namespace per session, the syscall filter with a fresh session keyring
(``seccomp``); and what pays for them: children forked ahead of their work (``prefork``;
"without prefork" shows what it saves)."""


SESSION_CALLS = 6
"""Calls per session in the hardening table: its first forks the interpreter, the five
later ones (back to back) give enough samples for a stable p50 of a ~1 ms call on a
loaded machine. A second session per round makes 3 calls ``GAP_S`` apart."""
GAP_S = 0.02
"""Time between a session's calls in the "later, apart" column: in training a model
writes its next call in between (far longer than this)."""


LATER_PER_ROUND = {"later": SESSION_CALLS - 1, "apart": 2}
"""Later calls per round and variant: back to back, and ``GAP_S`` apart."""


def hardening_costs(rounds: int) -> None:
    """Before/after the hardening mechanisms, in one run: one sandbox with none of them
    ("before"), one with all ("after") and one without each, rounds interleaved so that
    machine load hits every variant alike (every other round in reverse order, so that no
    variant always follows the same one). Per round and variant: one stateless call, one
    session of ``SESSION_CALLS`` calls back to back (its first call forks the interpreter)
    and one of 3 calls ``GAP_S`` apart. Besides the ratio of the p50s, the later calls'
    paired ratio: the median over rounds of after/before within a round (before and after
    run next to each other, so load that drifts between rounds cancels out)."""
    print(f"\nhardening mechanisms: before/after and the cost of each ({rounds} rounds, variants interleaved); "
          "load average before: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    variants = {"before (none of them)": HARDENING, "after (all of them)": (),
                **{f"after, without {m}": (m,) for m in HARDENING}}
    logging.getLogger("retool.sandbox").setLevel(logging.ERROR)  # the variants are degraded on purpose
    boxes = {label: Sandbox(SandboxConfig(timeout_s=30, workers=8, max_sessions=8, benchmark_skip=skip))
             for label, skip in variants.items()}
    samples = {label: {"stateless": [], "first": [], "later": [], "apart": []} for label in variants}
    paired = {"later": [], "apart": []}  # per round: after's p50 / before's p50 in that round
    try:
        for sb in boxes.values():
            sb.start()
            sb.run_sync("1")
        for r in range(rounds):
            for label, sb in list(boxes.items())[::-1 if r % 2 else 1]:
                t = time.perf_counter()
                assert sb.run_sync(SNIPPETS["a_print"]).ok
                samples[label]["stateless"].append(time.perf_counter() - t)
                session = trajectory_latencies(sb, SNIPPETS["a_print"], SESSION_CALLS, stateful=True)
                samples[label]["first"].append(session[0])
                samples[label]["later"] += session[1:]
                session = trajectory_latencies(sb, SNIPPETS["a_print"], 3, stateful=True, gap_s=GAP_S)
                samples[label]["first"].append(session[0])
                samples[label]["apart"] += session[1:]
            for kind, per_round in paired.items():
                after, before = (percentile(sorted(samples[label][kind][-LATER_PER_ROUND[kind]:]), 50)
                                 for label in ("after (all of them)", "before (none of them)"))
                per_round.append(after / before)
        rates = {label: summary(*measure_sandbox(boxes[label], SNIPPETS["a_print"], 4 * rounds, 8))[2]
                 for label in ("before (none of them)", "after (all of them)")}
    finally:
        for sb in boxes.values():
            sb.close()
    p50 = {label: {k: percentile(sorted(v), 50) * 1e3 for k, v in kinds.items()} for label, kinds in samples.items()}
    after = p50["after (all of them)"]
    header = (f"  {'variant':28} {'stateless p50':>13} {'session 1st p50':>15} {'later p50':>9} "
              f"{'later, ' + str(int(GAP_S * 1e3)) + ' ms apart':>19}")
    print(header + "\n  " + "-" * (len(header) - 2))
    for label, row in p50.items():
        print(f"  {label:28} {row['stateless']:10.1f} ms {row['first']:12.1f} ms {row['later']:6.2f} ms "
              f"{row['apart']:16.2f} ms")
    print("  cost of each mechanism (all on minus all on but that one), stateless / session 1st / later / apart:")
    for m in HARDENING:
        row = p50[f"after, without {m}"]
        print(f"    {m:16} {after['stateless'] - row['stateless']:+6.1f} ms {after['first'] - row['first']:+6.1f} ms "
              f"{after['later'] - row['later']:+6.2f} ms {after['apart'] - row['apart']:+6.2f} ms")
    before = p50["before (none of them)"]
    print(f"  after/before p50 ratio: stateless {after['stateless'] / before['stateless']:.2f}x, "
          f"session 1st {after['first'] / before['first']:.2f}x, later {after['later'] / before['later']:.2f}x, "
          f"apart {after['apart'] / before['apart']:.2f}x (paired, median over rounds: later "
          f"{percentile(sorted(paired['later']), 50):.2f}x, apart {percentile(sorted(paired['apart']), 50):.2f}x); "
          f"calls/s at concurrency 8: before {rates['before (none of them)']:.1f}, "
          f"after {rates['after (all of them)']:.1f}")
    print("  load average after: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


def cgroup_join_cost(joins: int = 15) -> None:
    """Why a child born in its control group matters: a process that joins a group by
    writing ``cgroup.procs`` waits for an RCU grace period (the kernel's
    ``cgroup_threadgroup_rwsem`` write side) unless another join happened just before.
    Joins back to back vs 100 ms apart, in a v1 pids group and a v2 group (as root)."""
    print("\njoining a control group (a fresh child writes cgroup.procs): load average "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    own = next((line.split(":", 2)[2].strip() for line in open("/proc/self/cgroup") if ":pids:" in line), None)
    trees = {"v1 pids": f"/sys/fs/cgroup/pids{(own or '').rstrip('/')}" if own is not None else None,
             "v2": next((t for t in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup")
                         if os.path.exists(f"{t}/cgroup.procs") and os.path.exists(f"{t}/cgroup.controllers")), None)}
    for label, tree in trees.items():
        if tree is None or os.geteuid() != 0:
            print(f"  {label}: not measured (no such tree, or not root)")
            continue
        group = tempfile.mkdtemp(prefix="retool-bench-", dir=tree)
        try:
            row = {gap: percentile(sorted(_join_once(group, gap) for _ in range(joins)), 50) * 1e3 for gap in (0.0, 0.1)}
        finally:
            os.rmdir(group)
        print(f"  {label:8} p50 back to back {row[0.0]:6.2f} ms, 100 ms apart {row[0.1]:6.2f} ms")


def freezer_pin_cost(cycles: int = 60) -> None:
    """What a v1 freeze and a thaw of one session's group cost (the writes alone, in the
    warm parent) with no other group frozen vs with an empty group kept frozen, as the
    sandbox keeps one (``_cgroups.FREEZER_PIN``); cycles alternate between the two. Any
    other frozen v1 group on the machine (a running sandbox's, say) makes both rows alike."""
    print("\nfreezing a v1 group with one sleeping process: load average "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    own = next((line.split(":", 2)[2].strip() for line in open("/proc/self/cgroup") if ":freezer:" in line), None)
    if own is None or os.geteuid() != 0:
        print("  not measured (no v1 freezer hierarchy, or not root)")
        return
    tree = f"/sys/fs/cgroup/freezer{own.rstrip('/')}"
    group, pin = (tempfile.mkdtemp(prefix=f"retool-bench-{kind}-", dir=tree) for kind in ("group", "pin"))
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        with open(f"{group}/cgroup.procs", "w") as f:
            f.write(str(sleeper.pid))
        state = os.open(f"{group}/freezer.state", os.O_RDWR)
        times = {False: [], True: []}  # pinned -> [(freeze, thaw) seconds]
        for i in range(2 * cycles):
            pinned = bool(i % 2)
            with open(f"{pin}/freezer.state", "w") as f:
                f.write("FROZEN" if pinned else "THAWED")
            times[pinned].append(_freeze_thaw(state))
        os.close(state)
    finally:
        sleeper.kill()
        sleeper.wait()
        with open(f"{pin}/freezer.state", "w") as f:
            f.write("THAWED")
        for path in (group, pin):
            _rmdir_when_empty(path)
    for pinned, label in ((False, "no other group frozen"), (True, "an empty group kept frozen")):
        freeze, thaw = (percentile(sorted(t[k] for t in times[pinned]), 50) * 1e6 for k in (0, 1))
        print(f"  {label:27} p50 freeze {freeze:6.1f} us, thaw {thaw:6.1f} us")


def _freeze_thaw(state: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    os.pwrite(state, b"FROZEN", 0)
    t1 = time.perf_counter()
    while os.pread(state, 64, 0).strip() != b"FROZEN":
        time.sleep(0.0005)
    time.sleep(0.002)  # a session stays frozen a while
    t2 = time.perf_counter()
    os.pwrite(state, b"THAWED", 0)
    return t1 - t0, time.perf_counter() - t2


def _rmdir_when_empty(path: str) -> None:
    deadline = time.monotonic() + 5
    while os.path.isdir(path):
        try:
            os.rmdir(path)
        except OSError:  # EBUSY: the killed sleeper has not left the group yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _join_once(group: str, gap: float) -> float:
    time.sleep(gap)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        t = time.perf_counter()
        with open(f"{group}/cgroup.procs", "w") as f:
            f.write("0")
        os.write(write, str(time.perf_counter() - t).encode())
        os._exit(0)
    os.close(write)
    seconds = float(os.read(read, 64))
    os.close(read)
    os.waitpid(pid, 0)
    return seconds


def trajectory_latencies(sb: Sandbox, code: str, calls: int, stateful: bool, gap_s: float = 0.0) -> list[float]:
    """Per-call latencies of one trajectory of ``calls`` calls (one session when ``stateful``;
    its opening is in the first call, its closing in no call), ``gap_s`` apart (the time
    a model would take to write the next call; not counted)."""
    async def main() -> list[float]:
        latencies = []
        session = sb.session() if stateful else None
        try:
            for i in range(calls):
                if i and gap_s:
                    await asyncio.sleep(gap_s)
                t = time.perf_counter()
                res = await (session.run(code) if stateful else sb.run(code))
                assert res.ok, res
                latencies.append(time.perf_counter() - t)
        finally:
            if session is not None:
                await session.aclose()
        return latencies

    return asyncio.run(main())


def measure_trajectories(sb: Sandbox, code: str, trajectories: int, calls: int, concurrency: int,
                         stateful: bool) -> list[list[float]]:
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda _: trajectory_latencies(sb, code, calls, stateful), range(trajectories)))


def stateful_vs_stateless(trajectories: int, calls: int) -> None:
    """Per-call latency of the two interpreter modes, rounds interleaved."""
    print(f"\nstateful vs stateless interpreter: per-call latency, trajectories of {calls} calls "
          f"({trajectories} per cell, modes interleaved); load average before: "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    header = (f"{'snippet':9} {'conc':>4} | {'stateless p50':>13} {'p95':>7} | {'stateful p50':>12} {'p95':>7} "
              f"{'first p50':>9} {'later p50':>9} | {'p50 ratio':>9}")
    print(header + "\n" + "-" * len(header))
    with Sandbox(SandboxConfig(timeout_s=30, workers=8)) as sb:
        sb.start()
        measure_sandbox(sb, "1", 8, 8)  # warm-up
        for name, code in SNIPPETS.items():
            for conc in (1, 8):
                runs: dict[bool, list[list[float]]] = {False: [], True: []}
                for _ in range(max(1, trajectories // conc)):  # rounds of `conc` trajectories per mode
                    for stateful in (False, True):
                        runs[stateful] += measure_trajectories(sb, code, conc, calls, conc, stateful)
                stateless = sorted(x for run in runs[False] for x in run)
                stateful_all = sorted(x for run in runs[True] for x in run)
                first = sorted(run[0] for run in runs[True])
                later = sorted(x for run in runs[True] for x in run[1:])
                p = lambda xs, q: percentile(xs, q) * 1e3  # noqa: E731
                print(f"{name:9} {conc:>4} | {p(stateless, 50):>10.1f} ms {p(stateless, 95):>7.1f} | "
                      f"{p(stateful_all, 50):>9.1f} ms {p(stateful_all, 95):>7.1f} {p(first, 50):>9.1f} "
                      f"{p(later, 50):>9.1f} | {p(stateless, 50) / p(stateful_all, 50):>8.1f}x")
    print("load average after: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


AGAINST_WORKER = """
import asyncio, json, logging, sys, time
from retool.sandbox import Sandbox, SandboxConfig
logging.getLogger("retool.sandbox").setLevel(logging.ERROR)
sb = Sandbox(SandboxConfig(timeout_s=30))
sb.start()
sb.run_sync("1")

def trajectory(calls, gap_s):
    async def main():
        session, latencies = sb.session(), []
        try:
            for i in range(calls):
                if i and gap_s:
                    await asyncio.sleep(gap_s)
                t = time.perf_counter()
                assert (await session.run("print(1+1)")).ok
                latencies.append(time.perf_counter() - t)
        finally:
            await session.aclose()
        return latencies
    return asyncio.run(main())

print("ready", flush=True)
for line in sys.stdin:
    t = time.perf_counter()
    assert sb.run_sync("print(1+1)").ok
    stateless = time.perf_counter() - t
    later, apart = trajectory(6, 0.0), trajectory(3, 0.02)
    print(json.dumps({"stateless": [stateless], "first": [later[0], apart[0]], "later": later[1:],
                      "apart": apart[1:]}), flush=True)
sb.close()
"""
"""Runs in a subprocess with one revision's ``retool`` first on its path: one sandbox with
the defaults; per line on stdin, one round of the hardening table's calls, as JSON."""
AGAINST_SETTLE_S = 0.2
"""Pause before each round: the other sandbox's children forked ahead (50 ms after its
last call) are ready by then, so neither revision's calls share the CPU with them."""


def against_revision(rev: str, rounds: int) -> None:
    """This checkout's sandbox against revision ``rev``'s (``git archive`` of it, e.g. the
    code before the hardening), both with their defaults, each in a process of its own,
    rounds interleaved (every other round in reverse order) and ``AGAINST_SETTLE_S`` apart;
    per round one stateless call, a session of 6 calls back to back and one of 3 calls
    20 ms apart. Prints p50s, the ratio and the paired ratio of later calls (median over
    rounds of this/that within a round)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory(prefix="retool-rev-") as old:
        archive = subprocess.run(["git", "-C", repo, "archive", rev, "retool"], capture_output=True)
        if archive.returncode:
            raise SystemExit(f"--against {rev}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", old], input=archive.stdout, check=True)
        print(f"\nthis checkout against {rev} (its sandbox, the defaults), {rounds} rounds, interleaved; "
              "load average before: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
        workers = {}
        for label, root in ((rev, old), ("this checkout", repo)):
            env = {**os.environ, "PYTHONPATH": root}
            proc = subprocess.Popen([sys.executable, "-c", AGAINST_WORKER], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, env=env, cwd=tempfile.gettempdir())
            if proc.stdout.readline().strip() != "ready":
                raise SystemExit(f"the sandbox of {label} did not start")
            workers[label] = proc
        samples = {label: {"stateless": [], "first": [], "later": [], "apart": []} for label in workers}
        paired = {"later": [], "apart": []}
        try:
            for r in range(rounds):
                for label, proc in list(workers.items())[::-1 if r % 2 else 1]:
                    time.sleep(AGAINST_SETTLE_S)
                    proc.stdin.write("round\n")
                    proc.stdin.flush()
                    for kind, values in json.loads(proc.stdout.readline()).items():
                        samples[label][kind] += values
                for kind, per_round in paired.items():
                    new, base = (percentile(sorted(samples[label][kind][-LATER_PER_ROUND[kind]:]), 50)
                                 for label in ("this checkout", rev))
                    per_round.append(new / base)
        finally:
            for proc in workers.values():
                proc.stdin.close()
                proc.wait()
    p50 = {label: {k: percentile(sorted(v), 50) * 1e3 for k, v in kinds.items()} for label, kinds in samples.items()}
    print(f"  {'p50':24} {rev[:12]:>12} {'this checkout':>14} {'ratio':>6}")
    for kind, name in (("stateless", "stateless call"), ("first", "session, first call"),
                       ("later", "later calls, back to back"), ("apart", "later calls, 20 ms apart")):
        base, new = p50[rev][kind], p50["this checkout"][kind]
        print(f"  {name:24} {base:9.3f} ms {new:11.3f} ms {new / base:5.2f}x")
    print(f"  paired (median over rounds): later {percentile(sorted(paired['later']), 50):.2f}x, "
          f"apart {percentile(sorted(paired['apart']), 50):.2f}x")
    print("  load average after: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40, help="sandbox calls per measurement")
    parser.add_argument("--baseline-calls", type=int, default=12, help="baseline calls per measurement")
    parser.add_argument("--trajectories", type=int, default=16,
                        help="trajectories per mode and cell in the stateful comparison")
    parser.add_argument("--session-calls", type=int, default=4,
                        help="calls per trajectory in the stateful comparison (the rollout's default budget)")
    parser.add_argument("--rounds", type=int, default=30,
                        help="interleaved rounds in the before/after table of the hardening mechanisms")
    parser.add_argument("--only", choices=("baseline", "mechanisms", "hardening", "cgroup-join", "freezer", "stateful"),
                        help="run one part only (default: all six)")
    parser.add_argument("--against", metavar="REV",
                        help="instead: this checkout's sandbox against git revision REV's, both with their "
                             "defaults (e.g. 3b5ca40, the code before the hardening)")
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, uid {os.geteuid()}\n")
    if args.against:
        against_revision(args.against, args.rounds)
        return 0
    if args.only in (None, "baseline"):
        compare(args.calls, args.baseline_calls)
    if args.only in (None, "mechanisms"):
        mechanism_costs(args.calls)
    if args.only in (None, "hardening"):
        hardening_costs(args.rounds)
    if args.only in (None, "cgroup-join"):
        cgroup_join_cost()
    if args.only in (None, "freezer"):
        freezer_pin_cost()
    if args.only in (None, "stateful"):
        stateful_vs_stateless(args.trajectories, args.session_calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
