"""``retool replay``: run recorded code calls again in the current sandbox; do they reproduce?

Every trajectory records each executed code call with its result. Replaying re-runs the
calls in a fresh :class:`~retool.sandbox.Sandbox` exactly as the rollout ran them
(``Sandbox.run(code, timeout_s=...)``, the tool's ``auto_print`` of a final bare
expression included) and compares, call by call, the status and the output (``stdout``
and the ``observation`` the model saw). A call *reproduces* when both are identical.

Uses: find snippets whose output depends on time, randomness or the machine, and check
that a sandbox change (isolation, preloaded modules, limits) leaves recorded behaviour
alone. Limits are those recorded where the source says — an eval header's ``sandbox``
(``timeout_s``, ``memory_mb``), a run's ``config.json`` (``sandbox_timeout_s``,
``sandbox_memory_mb``) — else :class:`~retool.sandbox.SandboxConfig`'s defaults.

Sources: an eval results file, a run's trajectory file (``step_NNNNNN.jsonl.gz``, or a
regraded copy), a ``trajectories/`` folder or a run folder. ``--problem ID`` picks that
problem's trajectory number ``--index K`` (0-based, in file order: for an eval file, the
sample) and shows every call; without it every call of every trajectory is replayed and
summarised (how many reproduce; which do not, by recorded → replayed status).

Sources recorded with the stateful interpreter (an eval header's ``sandbox.interpreter``, a
run's ``interpreter``) replay each trajectory's calls in order in one interpreter session,
as the rollout ran them; otherwise each call runs fresh.

Not covered: invalid or over-budget call attempts (never run, nothing to compare), the
tool message's sanitising and token truncation (the comparison is on the raw result),
wall time and memory use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from retool.report import ReportInputError, read_eval_results
from retool.results import is_results_file
from retool.sandbox import Sandbox, SandboxConfig
from retool.trajectory_log import NotATrajectoryLog, TrajectoryLogError, read_trajectory_log
from retool.types import ExecutionResult, ToolCall, Trajectory

SHOWN_FAILURES = 20
"""Calls that do not reproduce listed one by one in a file summary; the rest are counted."""


class ReplayError(ValueError):
    """A source replay cannot use; the message is the one line the user sees."""


@dataclass(frozen=True)
class Recorded:
    """One recorded trajectory and where it came from."""

    where: str
    trajectory: Trajectory


@dataclass(frozen=True)
class Limits:
    """The limits recorded with a source (``None``: not recorded, the sandbox's default)."""

    timeout_s: float | None = None
    memory_mb: int | None = None
    interpreter: str = "stateless"
    """``stateful``: the trajectory's calls shared one interpreter session."""


@dataclass(frozen=True)
class CallReplay:
    """One code call: what was recorded and what running it again gave."""

    where: str
    number: int
    """1-based among the trajectory's executed calls."""
    code: str
    recorded: ExecutionResult
    replayed: ExecutionResult

    @property
    def same_status(self) -> bool:
        return self.recorded.status == self.replayed.status

    @property
    def same_output(self) -> bool:
        return (self.recorded.stdout == self.replayed.stdout
                and self.recorded.observation == self.replayed.observation)

    @property
    def reproduces(self) -> bool:
        return self.same_status and self.same_output

    @property
    def status_change(self) -> str:
        return f"{self.recorded.status.value} → {self.replayed.status.value}"


# ---------------------------------------------------------------- reading sources


def load_source(source: Path) -> tuple[list[Recorded], Limits]:
    """The recorded trajectories of ``source`` (file order) and its recorded limits."""
    if source.is_dir():
        folder = source / "trajectories" if (source / "trajectories").is_dir() else source
        files = sorted(folder.glob("step_*.jsonl.gz"))
        if not files:
            raise ReplayError(f"{source}: no step_*.jsonl.gz trajectory files in it")
        found = [r for path in files for r in _run_file(path)]
        return found, _run_limits(folder.parent)
    if not source.is_file():
        raise ReplayError(f"{source}: no such file or folder")
    if is_results_file(source):
        try:
            results = read_eval_results(source)
        except ReportInputError as err:
            raise ReplayError(str(err)) from None
        sandbox = results.header.sandbox
        limits = Limits(sandbox.timeout_s, sandbox.memory_mb, sandbox.interpreter or "stateless") if sandbox \
            else Limits()
        found = [Recorded(f"problem {p.problem_id} #{n}", t) for p in results.problems
                 for n, t in enumerate(p.samples)]
        return found, limits
    return _run_file(source), _run_limits(source.parent.parent)


def _run_file(path: Path) -> list[Recorded]:
    try:
        return [Recorded(row.where, row.trajectory) for row in read_trajectory_log(path)]
    except NotATrajectoryLog:
        raise ReplayError(f"{path}: neither an eval results file nor a trajectory log") from None
    except TrajectoryLogError as err:
        raise ReplayError(str(err)) from None


def _run_limits(run_dir: Path) -> Limits:
    try:
        config = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return Limits()
    if not isinstance(config, dict):
        return Limits()
    return Limits(config.get("sandbox_timeout_s"), config.get("sandbox_memory_mb"),
                  config.get("interpreter") or "stateless")


def pick(recorded: list[Recorded], problem: str, index: int) -> Recorded:
    """Trajectory ``index`` (0-based, file order) of ``problem``; :class:`ReplayError` if none."""
    matching = [r for r in recorded if r.trajectory.problem_id == problem]
    if not matching:
        raise ReplayError(f"problem {problem!r} is not in the source")
    if not 0 <= index < len(matching):
        raise ReplayError(f"problem {problem!r} has {len(matching)} recorded trajectories: --index 0..{len(matching) - 1}")
    return matching[index]


# ---------------------------------------------------------------- replaying


def recorded_calls(item: Recorded) -> list[tuple[int, str, ExecutionResult]]:
    """``(number, code, recorded result)`` of each executed call of one trajectory."""
    calls = [(t.exchange.call.code, t.exchange.result) for t in item.trajectory.turns
             if t.exchange is not None and isinstance(t.exchange.call, ToolCall) and t.exchange.result is not None]
    return [(n, code, result) for n, (code, result) in enumerate(calls, start=1)]


async def replay(items: list[Recorded], sandbox, limits: Limits) -> list[CallReplay]:
    """Run every recorded call of ``items`` again (trajectories concurrently, the sandbox
    queues them; a trajectory's calls in order, in one session when it was stateful)."""

    async def trajectory(item: Recorded) -> list[CallReplay]:
        runner = sandbox.session() if limits.interpreter == "stateful" else sandbox
        try:
            return [CallReplay(item.where, n, code, result, await runner.run(code, timeout_s=limits.timeout_s))
                    for n, code, result in recorded_calls(item)]
        finally:
            if runner is not sandbox:
                await runner.aclose()

    return [call for calls in await asyncio.gather(*(trajectory(item) for item in items)) for call in calls]


def sandbox_config(limits: Limits, **overrides):
    """The sandbox of a replay: the recorded limits, defaults for the rest."""
    recorded = {k: v for k, v in (("timeout_s", limits.timeout_s), ("memory_mb", limits.memory_mb)) if v is not None}
    return SandboxConfig(**{**recorded, **overrides})


def run_replay(items: list[Recorded], limits: Limits, **config_overrides) -> list[CallReplay]:
    """Start a sandbox with the recorded limits, replay ``items``' calls, stop it."""
    async def main() -> list[CallReplay]:
        async with Sandbox(sandbox_config(limits, **config_overrides)) as sandbox:
            return await replay(items, sandbox, limits)

    return asyncio.run(main())


# ---------------------------------------------------------------- printing


def print_calls(item: Recorded, calls: list[CallReplay], out=None) -> None:
    """Call by call: status recorded → replayed, and whether the output is identical."""
    out = out or sys.stdout
    print(f"{item.where} (problem {item.trajectory.problem_id}): {len(calls)} code call(s)", file=out)
    for call in calls:
        verdict = "reproduces" if call.reproduces else "DIFFERS"
        print(f"  call {call.number}: {call.status_change}, output "
              f"{'identical' if call.same_output else 'differs'} — {verdict}", file=out)
        if not call.same_output:
            recorded, replayed = _first_difference(call.recorded.observation, call.replayed.observation)
            print(f"    recorded: {recorded!r}\n    replayed: {replayed!r}", file=out)


def _first_difference(a: str, b: str) -> tuple[str, str]:
    """The first line where ``a`` and ``b`` differ (shortened)."""
    lines_a, lines_b = a.splitlines() or [""], b.splitlines() or [""]
    for i in range(max(len(lines_a), len(lines_b))):
        x = lines_a[i] if i < len(lines_a) else "(no line)"
        y = lines_b[i] if i < len(lines_b) else "(no line)"
        if x != y:
            return x[:200], y[:200]
    return a[:200], b[:200]


def print_summary(source: Path, calls: list[CallReplay], trajectories: int, out=None) -> None:
    """How many calls reproduce; the others by status change, the first few by place."""
    out = out or sys.stdout
    failing = [c for c in calls if not c.reproduces]
    print(f"{source}: {len(calls)} code calls in {trajectories} trajectories; "
          f"{len(calls) - len(failing)} reproduce, {len(failing)} do not", file=out)
    by_status = Counter((c.status_change, "output differs" if not c.same_output else "output identical")
                        for c in failing)
    for (change, output), count in sorted(by_status.items()):
        print(f"  {change}, {output}: {count}", file=out)
    for call in failing[:SHOWN_FAILURES]:
        print(f"  {call.where} call {call.number}: {call.status_change}", file=out)
    if len(failing) > SHOWN_FAILURES:
        print(f"  … and {len(failing) - SHOWN_FAILURES} more", file=out)


# ---------------------------------------------------------------- CLI


def register(subparsers) -> None:
    """Add ``retool replay``."""
    parser = subparsers.add_parser(
        "replay",
        description="Re-execute the code calls recorded in an eval results file or a run's trajectory "
                    "file/folder in the current sandbox (the recorded timeout and memory limit where the "
                    "source has them) and compare status and output call by call. Exit code 0 when every "
                    "replayed call reproduces, 1 when some do not, 2 for a bad input.")
    parser.add_argument("source", type=Path, metavar="SOURCE",
                        help="an eval results file, a trajectory file (step_N.jsonl.gz), or a run / trajectories folder")
    parser.add_argument("--problem", metavar="ID", help="replay one trajectory of this problem, call by call")
    parser.add_argument("--index", type=int, default=0, metavar="K",
                        help="which of the problem's recorded trajectories (0-based, file order; default 0)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        if args.problem is None and args.index != 0:
            raise ReplayError("--index picks one trajectory of --problem ID: give --problem too")
        items, limits = load_source(args.source)
        if args.problem is not None:
            items = [pick(items, args.problem, args.index)]
    except ReplayError as err:
        print(f"retool replay: error: {err}", file=sys.stderr)
        return 2
    calls = run_replay(items, limits)
    if args.problem is not None:
        print_calls(items[0], calls)
    else:
        print_summary(args.source, calls, len(items))
    return 0 if all(c.reproduces for c in calls) else 1
