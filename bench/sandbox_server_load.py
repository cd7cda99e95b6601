"""Benchmark: ``retool sandbox serve`` under cluster concurrency on loopback.

For each concurrency level (default 256 and 1,024) the server is started fresh as its own
process (``python -m retool sandbox serve --port P``) and that many clients each send
``--requests`` ``POST /run_code`` requests one after another, in verl's default shape:
``compile_timeout`` 10 s, ``run_timeout`` 10 s, ``memory_limit_MB`` 1024, a client
deadline of ``compile_timeout + run_timeout + 10`` s, a 504 retried twice (after 1 s and
2 s) and nothing else retried, as verl's ``call_sandbox_api`` does. Snippets are plain
arithmetic, sympy and numpy (the scripted policy's, ``bench/scale_policy.py``), each
answer checked.

Printed per level: requests/s, p50/p95/p99 latency, answers by HTTP status and by run
status, client-side failures (deadline passed, connection refused or reset: a request
dropped or hung), the server's memory (PSS of its whole process tree) before, at peak and
after, and the load average. The whole run is bounded by ``--max-s`` per level.

Usage: ``python bench/sandbox_server_load.py [--clients 256 1024] [--requests 2] [--workers 64]``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scale import _descendants  # noqa: E402
from retool.sandbox.metrics import percentile  # noqa: E402

COMPILE_TIMEOUT_S, RUN_TIMEOUT_S, API_TIMEOUT_S = 10, 10, 10
"""verl's defaults: its client waits compile + run + 10 s for an answer."""
RETRY_504_DELAYS_S = (1.0, 2.0)
SNIPPETS = (
    ("print(sum(k * k for k in range(1, 201)))", "2686700"),
    ("import sympy\nprint(sympy.divisor_count(720720))", "240"),
    ("import numpy as np\na = np.arange(1, 101, dtype=np.int64)\nprint(int((a * a).sum()))", "338350"),
    ("print(pow(7, 1234, 997))", str(pow(7, 1234, 997))),
)


def tree_rss_mib(pid: int) -> float:
    """Memory of ``pid`` and its descendants in MiB: the sum of their PSS (a page shared by
    the zygote's forks counted once in all), from ``/proc/PID/smaps_rollup``."""
    total_kib = 0
    for p in [pid, *_descendants(pid)]:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total_kib += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total_kib / 1024


class MemoryWatch:
    """Peak tree RSS of a process, sampled every 0.25 s in a thread."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.25):
            self.peak = max(self.peak, tree_rss_mib(self.pid))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, workers: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "retool", "sandbox", "serve", "--port", str(port),
                             "--workers", str(workers), "--log-level", "WARNING"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited at start: {proc.stderr.read().decode()[-500:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start listening within 120 s")


async def one_request(session, url: str, code: str, expect: str, out: dict) -> None:
    """One verl-shaped request, its 504 retries, its outcome counted in ``out``."""
    import aiohttp

    body = {"code": code, "language": "python", "compile_timeout": COMPILE_TIMEOUT_S,
            "run_timeout": RUN_TIMEOUT_S, "memory_limit_MB": 1024}
    deadline = aiohttp.ClientTimeout(total=COMPILE_TIMEOUT_S + RUN_TIMEOUT_S + API_TIMEOUT_S)
    start = time.monotonic()
    for delay in (*RETRY_504_DELAYS_S, None):
        try:
            async with session.post(url, json=body, timeout=deadline) as response:
                payload = await response.json(content_type=None)
                status = response.status
        except asyncio.TimeoutError:
            out["client: deadline passed"] += 1
            return
        except aiohttp.ClientError as err:
            out[f"client: {type(err).__name__}"] += 1
            return
        if status != 504 or delay is None:
            break
        await asyncio.sleep(delay)
    out["latencies"].append(time.monotonic() - start)
    out[f"http {status}"] += 1
    if status == 200:
        stdout = ((payload.get("run_result") or {}).get("stdout") or "").strip()
        out[f"run: {payload.get('status')}{'' if stdout == expect else ' (wrong output)'}"] += 1


async def load(url: str, clients: int, requests: int, max_s: float) -> tuple[dict, float]:
    import aiohttp

    out: dict = collections.defaultdict(int)
    out["latencies"] = []
    connector = aiohttp.TCPConnector(limit=clients, force_close=False)

    async def client(i: int) -> None:
        for r in range(requests):
            code, expect = SNIPPETS[(i + r) % len(SNIPPETS)]
            await one_request(session, url, code, expect, out)

    start = time.monotonic()
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [asyncio.create_task(client(i)) for i in range(clients)]
        done, pending = await asyncio.wait(tasks, timeout=max_s)
        for task in pending:
            task.cancel()
        out["client: unfinished at --max-s"] += sum(1 for _ in pending)
    return out, time.monotonic() - start


def run_level(clients: int, args: argparse.Namespace) -> dict:
    port = free_port()
    server = start_server(port, args.workers)
    try:
        time.sleep(1.0)
        before = tree_rss_mib(server.pid)
        watch = MemoryWatch(server.pid)
        afters = []
        for _ in range(args.rounds):  # the same server again: memory that keeps growing is a leak
            out, wall = asyncio.run(load(f"http://127.0.0.1:{port}/run_code", clients, args.requests, args.max_s))
            afters.append(tree_rss_mib(server.pid))
        peak = watch.stop()
        after = afters[-1]
        alive = server.poll() is None
    finally:
        server.terminate()
        try:
            server.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait()
    latencies = sorted(out.pop("latencies"))
    answered = len(latencies)
    print(f"\n== {clients} concurrent clients x {args.requests} requests, {args.workers} workers, "
          f"{args.rounds} round(s); "
          f"load {os.getloadavg()}")
    print(f"answered {answered} of {clients * args.requests} in {wall:.1f} s: {answered / wall:.1f} requests/s; "
          f"latency p50 {percentile(latencies, 50):.2f} s, p95 {percentile(latencies, 95):.2f} s, "
          f"p99 {percentile(latencies, 99):.2f} s")
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(out.items()) if v))
    print(f"server memory (process tree PSS): before {before:.0f} MiB, peak {max(peak, after):.0f} MiB, "
          f"after each round {', '.join(f'{a:.0f}' for a in afters)} MiB; still serving after the load: {alive}")
    return {"answered": answered, "sent": clients * args.requests, "rate": answered / wall, **out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[256, 1024], help="concurrency levels")
    parser.add_argument("--requests", type=int, default=2, help="requests each client sends, one after another")
    parser.add_argument("--workers", type=int, default=64, help="the server's --workers (its default: 64)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="load the same server this many times (reported: the last round; memory after each)")
    parser.add_argument("--max-s", type=float, default=300.0, help="bound on each level's time")
    args = parser.parse_args(argv)
    ok, rates = True, []
    for clients in args.clients:
        result = run_level(clients, args)
        ok = ok and result["answered"] == result["sent"]
        rates.append((clients, result["rate"]))
    base_clients, base_rate = rates[0]
    for clients, rate in rates[1:]:  # the baseline: the first level, measured in this run
        print(f"requests/s at {clients} clients / at {base_clients}: {rate / base_rate if base_rate else 0:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
