"""What the syscall filter and the fresh session keyring cost: the same calls with and
without them (``SandboxConfig.benchmark_skip=("seccomp",)``), in one run.

    .venv/bin/python bench/seccomp.py                # 200 calls per variant
    .venv/bin/python bench/seccomp.py --calls 50     # quicker

Two numbers per variant, measured in alternating blocks so that load drifts hit both alike:

- *per call*: p50/p90 latency of a trivial stateless call (``x = 1``) and of a trivial
  session call — the filter goes on once per call (one ``prctl``) or once per session;
- *per system call*: ns per ``os.getppid()`` inside a call (a system call that glibc never
  caches), where the filter's BPF program runs on every call into the kernel;
- *in the child*: µs that the keyring switch and the filter's installation take in a
  freshly forked process (measured directly, without a sandbox around it).

Timings on a shared machine are noisy: read the ratios, printed beside the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from retool.sandbox import Sandbox, SandboxConfig, seccomp

SYSCALLS = 200_000
SYSCALL_LOOP = (f"import os, time\nt = time.perf_counter()\nfor _ in range({SYSCALLS}): os.getppid()\n"
                f"print((time.perf_counter() - t) / {SYSCALLS} * 1e9)")
VARIANTS = {"with filter": (), "without": ("seccomp",)}
BLOCK = 5


def call_latency(sb: Sandbox, calls: int) -> list[float]:
    latencies = []
    for _ in range(calls):
        start = time.perf_counter()
        assert sb.run_sync("x = 1").ok
        latencies.append(time.perf_counter() - start)
    return latencies


def session_latency(sb: Sandbox, calls: int) -> list[float]:
    latencies = []
    with sb.session() as s:
        for _ in range(calls):
            start = time.perf_counter()
            assert s.run_sync("x = 1").ok
            latencies.append(time.perf_counter() - start)
    return latencies


def ns_per_syscall(sb: Sandbox) -> float:
    res = sb.run_sync(SYSCALL_LOOP)
    assert res.ok, res.stderr
    return float(res.stdout)


def confine_cost_us(children: int = 50) -> tuple[float, float]:
    """Median µs of the keyring switch and of installing the filter, in forked children."""
    compiled = seccomp.compile_filter()
    samples = []
    for _ in range(children):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            start = time.perf_counter()
            seccomp.join_fresh_session_keyring(compiled)
            joined = time.perf_counter()
            seccomp.install(compiled)
            os.write(write_end, json.dumps([joined - start, time.perf_counter() - joined]).encode())
            os._exit(0)
        os.close(write_end)
        samples.append(json.loads(os.read(read_end, 100)))
        os.close(read_end)
        os.waitpid(pid, 0)
    return tuple(statistics.median(s[i] for s in samples) * 1e6 for i in (0, 1))


def quantiles_ms(latencies: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(latencies, n=10)
    return statistics.median(latencies) * 1e3, cuts[8] * 1e3


def measure(calls: int) -> dict[str, dict[str, list[float]]]:
    boxes = {name: Sandbox(SandboxConfig(timeout_s=30, workers=1, preload=("numpy", "sympy"),
                                         benchmark_skip=skip)) for name, skip in VARIANTS.items()}
    found = {name: {"call": [], "session": [], "syscall": []} for name in boxes}
    try:
        for name, sb in boxes.items():
            sb.start()
            print(f"{name}: isolation {', '.join(sb.isolation)}")
            call_latency(sb, 3)  # warm up
        for round_ in range(max(1, calls // BLOCK)):
            order = list(boxes.items())
            for name, sb in order if round_ % 2 else reversed(order):  # ABBA: drifts hit both alike
                found[name]["call"] += call_latency(sb, BLOCK)
                found[name]["session"] += session_latency(sb, BLOCK)
                found[name]["syscall"].append(ns_per_syscall(sb))
    finally:
        for sb in boxes.values():
            sb.close()
    return found


def report(found: dict[str, dict[str, list[float]]]) -> None:
    base = found["without"]
    print(f"load average {os.getloadavg()}")
    print(f"{'variant':<12} {'call p50 ms':>11} {'p90':>7} {'session call p50 ms':>19} {'p90':>7} {'ns/syscall':>10}")
    for name, rows in found.items():
        c50, c90 = quantiles_ms(rows["call"])
        s50, s90 = quantiles_ms(rows["session"])
        syscall_ns = statistics.median(rows["syscall"])
        print(f"{name:<12} {c50:>11.2f} {c90:>7.2f} {s50:>19.2f} {s90:>7.2f} {syscall_ns:>10.0f}")
    mine = found["with filter"]
    keyring_us, install_us = confine_cost_us()
    print(f"in a forked child: fresh keyring {keyring_us:.0f} us, filter install {install_us:.0f} us")
    print("ratio with/without: call p50 {:.3f}, session call p50 {:.3f}, per syscall {:.3f}".format(
        statistics.median(mine["call"]) / statistics.median(base["call"]),
        statistics.median(mine["session"]) / statistics.median(base["session"]),
        statistics.median(mine["syscall"]) / statistics.median(base["syscall"])))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per variant and kind (default 200)")
    args = parser.parse_args()
    if args.calls < BLOCK:
        parser.error(f"--calls must be at least {BLOCK}")
    try:
        seccomp.compile_filter()
    except seccomp.FilterUnavailable as exc:
        parser.error(f"nothing to measure: {exc}")
    report(measure(args.calls))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
