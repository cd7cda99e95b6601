"""The reference run's load, rehearsed: ``retool train`` at full size against a
latency-model Tinker service, with a soak, a SIGKILL and a resume.

``retool train --config configs/qwen35-4b-tinker.toml --save-every 50`` (Qwen3.5-4B,
8 problems x 8 trajectories of up to 8,192 tokens, at most 4 code calls) runs in a
subprocess against :class:`bench.tinker_latency.LatencyTinkerServer` on 127.0.0.1: the
unmodified ``tinker`` SDK, the real Qwen3.5 tokenizer and template (built offline and
passed with ``--tinker-tokenizer``), the real sandbox and grader; only the GPU work is
time (:class:`bench.tinker_latency.LatencyModel`, each rate a flag below).

Printed per step and in total: wall time; the time the service was serving at least one
request (the client waits on it) against the client's own time (nothing in flight: rollout
bookkeeping, sandbox, grading, datums, metrics, checkpoints), their ratio; sandbox calls/s,
p50/p95 latency, the p95 wait for a worker beside the p95 run time; grading time
(``time/grade``: every trajectory's grading, summed, and the longest one); the client's RSS,
open fds and process count at every step, and their slopes over the run.

With ``--kill`` (the default when the run has more than 100 steps) the client is
SIGKILLed at a random point after step 100 and ``retool train --resume`` finishes the run;
``--compare`` also runs it uninterrupted against a fresh service and checks that both
asked the service for the same things, step by step (samples by prompt and seed,
forward_backward by datums, optim_step by parameters): the same data order. A run that
samples ahead (``--train-arg=--max-staleness=K``) is checked the same way, but its
samples as a set (:func:`same_calls`): a resumed run reuses the stored groups sampled
with weights older than its checkpoint instead of asking for them again.

With ``--stream-groups`` the same steps run a second time, uninterrupted, with
``retool train --stream-groups`` against a fresh service: both runs' totals, their
steps per hour and ratio, the training time left after each step's rollout, and the
ratio the latency model would allow if every forward_backward but the last group's hid
behind the rollout. With ``--max-staleness K [K ...]`` likewise with ``retool train
--max-staleness K`` for each K (step t+K sampled while step t trains): steps per hour and
ratio, the client's share of each, the trainer's wait for the sampler, and the ratios a
perfect overlap of rollout and training would give (with and without every sandbox
timeout hidden).

With ``--engine vllm`` (needs ``.venv-vllm``) the latency model is left out: the same
``--max-staleness K`` comparison runs on the vLLM engine itself — the local trainer and a
vLLM-CPU server in its own process on this machine (started once, ``--max-loras K + 1``),
the CPU preset (``configs/cpu-smollm2.toml``, from the base model) at a tiny shape
(``--batch-size``/``--group-size``, 24-token turns), synchronous and sampling-ahead runs
alternating ``--repeats`` times; steps per hour over steps ``2 .. N - K`` (step 1 cannot
overlap, the last ``K`` have nothing left to overlap: ``--steps`` at least ``K + 2``),
their ratio, the rollout/training split and the load.

With ``--service tinker`` (or ``pytrio``) the same run goes to the real service instead:
the SDK reads your key from ``TINKER_API_KEY`` (``PYTRIO_API_KEY``), never from a flag or
a file; ``--max-cost USD`` and ``--price-table FILE`` are required (``retool train`` ends
the run cleanly, after a checkpoint, before another step would pass the budget; the
bench says where it stopped); ``--base-url`` picks the service's address. One run only
(no comparisons: each would be another bill). With no service log to read, the split of
each step is measured by the client itself: ``time/service_busy``, the time at least one
SDK request was in flight (the SDK's own work counts as in flight, so the client's share
comes out a little lower than the service would see it), over ``time/service_window``,
the wall time from one step's ``optim_step`` answer to the next; the latency-model runs
print this measure beside the service's. A kill and resume is checked on the client's
side too: the redone steps rolled out the same problems in the same groups (the
trajectories files); the latency-model runs check that as well.

Usage::

    python bench/scale.py --steps 20                   # the unscaled overhead figure
    nice -n 10 python bench/scale.py --engine vllm --steps 4 --batch-size 1 --group-size 4 --max-staleness 1
    python bench/scale.py --steps 4 --stream-groups    # synchronous vs streamed steps, in one run
    python bench/scale.py --steps 5 --max-staleness 1 --no-kill   # synchronous vs sampling one step ahead
    python bench/scale.py --steps 20 --max-staleness 1 2 --no-kill   # ... and two steps ahead, in one run
    nice -n 10 python bench/scale.py --time-scale 10   # the 200-step soak, with kill + resume
    python bench/scale.py --time-scale 10 --train-arg=--max-staleness=6   # ... sampling 6 steps ahead
    python bench/scale.py --steps 3 --batch-size 2 --group-size 4   # a quick check
    TINKER_API_KEY=... python bench/scale.py --service tinker --steps 20 --no-kill --max-cost 30 --price-table my.toml

Goals printed: client overhead <= 5 % of a step; sandbox worker wait p95 <= run time p95;
RSS / fds / process slopes ~ 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scale_policy import TIMEOUT_RATE, make_problems  # noqa: E402
from bench.steady import steady_rows  # noqa: E402
from bench.tinker_latency import LatencyModel, LatencyTinkerServer, ServiceCall, replace_model  # noqa: E402
from retool.runs import latest_checkpoint  # noqa: E402
from retool.trajectory_log import TrajectoryLogError, read_trajectory_log  # noqa: E402

CONFIG = ROOT / "configs" / "qwen35-4b-tinker.toml"
PRESETS = {"tinker": CONFIG, "pytrio": ROOT / "configs" / "qwen35-4b-pytrio.toml"}
"""The reference run's preset per service (``--service``)."""
KEY_ENV = {"tinker": "TINKER_API_KEY", "pytrio": "PYTRIO_API_KEY"}
"""Where ``--service tinker``/``pytrio`` finds the user's key (read by the SDK; never a flag)."""
KILL_AFTER_STEP = 100
API_KEY = "tml-latency-model-rehearsal-0000000000"
"""The SDK wants a key of Tinker's shape; the latency-model service accepts any."""


@dataclass(frozen=True)
class Sample:
    """The client process tree at one step: RSS of the retool process (MiB), its open fds,
    the processes in its tree (sandbox workers included)."""

    step: int
    rss_mib: float
    fds: int
    procs: int


def qwen35_tokenizer_folder(target: Path) -> Path:
    """The Qwen3.5 tokenizer with its official template, saved as a local folder."""
    from tests.tokenizers import qwen35_tokenizer

    if not (target / "tokenizer.json").is_file():
        qwen35_tokenizer().save_pretrained(str(target))
    return target


def write_problems(path: Path, count: int) -> Path:
    with path.open("w") as f:
        for p in make_problems(count):
            f.write(json.dumps({"id": p.id, "question": p.question, "answer": str(p.answer)}) + "\n")
    return path


def process_sample(pid: int, step: int) -> Sample | None:
    """RSS, fds and tree size of ``pid`` now (``None`` once it is gone)."""
    try:
        rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return None
    return Sample(step, rss, fds, len(_descendants(pid)) + 1)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (x, y) points (0.0 for fewer than two)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0


class ClientRun:
    """One ``retool train`` subprocess, its process samples taken as each step's metrics
    row appears, optionally SIGKILLed once ``kill_step`` has been logged."""

    def __init__(self, argv: list[str], run_dir: Path, env: dict[str, str]) -> None:
        self.argv, self.run_dir, self.env = argv, run_dir, env
        self.samples: list[Sample] = []

    def run(self, kill_step: int | None = None, kill_delay_s: float = 0.0) -> int:
        self.run_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir.parent / "client.err", "ab") as err:
            proc = subprocess.Popen(self.argv, env=self.env, cwd=ROOT, start_new_session=True,
                                    stdout=subprocess.DEVNULL, stderr=err)
        try:
            return self._watch(proc, kill_step, kill_delay_s)
        finally:  # the bench stopped (Ctrl-C, an error): take the client's process group with it
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def _watch(self, proc: subprocess.Popen, kill_step: int | None, kill_delay_s: float) -> int:
        metrics = self.run_dir / "metrics.jsonl"
        seen = len(_read_rows(metrics))  # a resumed run's earlier rows are not this process's
        while proc.poll() is None:
            rows = _read_rows(metrics)
            for row in rows[seen:]:
                sample = process_sample(proc.pid, int(row["step"]))
                if sample is not None:
                    self.samples.append(sample)
            seen = max(seen, len(rows))
            if kill_step is not None and rows and rows[-1]["step"] >= kill_step:
                time.sleep(kill_delay_s)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return -signal.SIGKILL
            time.sleep(0.2)
        return proc.returncode


def _read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written
            break
    return [r for r in rows if "step" in r and "time/step" in r]


def train_argv(args: argparse.Namespace, work: Path, url: str | None, tokenizer: Path, data: Path, run: Path,
               stream: bool = False, max_staleness: int = 0) -> list[str]:
    """``retool train`` with the reference run's preset at the bench's shape: against the
    latency model at ``url``, or (``--service tinker``/``pytrio``) the real service, with
    its price table and ``--max-cost``."""
    engine = "tinker" if args.service == "latency" else args.service
    argv = [sys.executable, "-m", "retool", "train", "--config", str(PRESETS[engine]),
            "--save-every", str(args.save_every), "--max-steps", str(args.steps), "--train-data", str(data),
            "--run-dir", str(run), f"--{engine}-tokenizer", str(tokenizer), "--sinks", "jsonl",
            "--batch-size", str(args.batch_size), "--group-size", str(args.group_size), "--seed", str(args.seed)]
    if url:
        argv += [f"--{engine}-base-url", url]
    if args.service == "latency":
        argv += ["--weight-sync-check-every", "0"]  # the latency model has no weights, so no logprobs to check
    else:
        argv += ["--price-table", str(args.price_table), "--max-cost", str(args.max_cost)]
    if args.sandbox_timeout_s is not None:
        argv += ["--sandbox-timeout-s", str(args.sandbox_timeout_s)]
    if args.sandbox_workers is not None:
        argv += ["--sandbox-workers", str(args.sandbox_workers)]
    if stream:
        argv.append("--stream-groups")
    if max_staleness:
        argv += ["--max-staleness", str(max_staleness)]
    return argv + list(args.train_arg)


@dataclass
class Outcome:
    """What one rehearsal (a run, or a killed run and its resume) left."""

    rows: list[dict]
    samples: list[Sample]
    calls: list[ServiceCall]
    marks: list[tuple[float, float, int | None]]
    tokens: dict[str, int]
    gaps: dict[tuple[str, str], float]
    returncodes: list[int]
    resumed_from: int | None = None
    resumed_samples: list[Sample] = field(default_factory=list)
    """The resumed client's samples (``samples``: the first client's, the soak's)."""
    redone: tuple[bool, str] | None = None
    """Whether the steps done before the kill and done again after the resume asked the
    service the same things (the steps from the checkpoint to the last one the killed
    client finished); ``None`` with ``--service`` (no service log: :attr:`order` only)."""
    killed_after: int | None = None
    """The step after whose metrics row the first client was SIGKILLed (at a random delay)."""
    order: tuple[bool, str] | None = None
    """Whether those steps rolled out the same problems in the same groups (the trajectories files)."""


def rehearse(args: argparse.Namespace, model: LatencyModel, work: Path, tokenizer_dir: Path, data: Path,
             kill: bool, stream: bool = False, max_staleness: int = 0) -> Outcome:
    """One run against a fresh latency-model service, or (``--service tinker``/``pytrio``)
    the real one (``stream``: with ``--stream-groups``; ``max_staleness``: with
    ``--max-staleness``); with ``kill``, SIGKILLed after step ``--kill-after`` at a random
    point and resumed."""
    from tests.tokenizers import qwen35_tokenizer

    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    if args.service != "latency":  # the user's own key stays in the environment, as the SDK reads it
        return _rehearse(args, None, args.base_url, env, work, tokenizer_dir, data, kill, stream, max_staleness)
    env = {k: v for k, v in env.items() if k not in KEY_ENV.values()}  # a real key never goes near the latency model
    with LatencyTinkerServer(work / "service", qwen35_tokenizer(), model, args.timeout_rate) as server:
        return _rehearse(args, server, server.url, {**env, "TINKER_API_KEY": API_KEY}, work, tokenizer_dir, data,
                         kill, stream, max_staleness)


def _rehearse(args: argparse.Namespace, server: LatencyTinkerServer | None, url: str | None, env: dict[str, str],
              work: Path, tokenizer_dir: Path, data: Path, kill: bool, stream: bool, max_staleness: int) -> Outcome:
    run = work / "run"
    client = ClientRun(train_argv(args, work, url, tokenizer_dir, data, run, stream, max_staleness), run, env)
    codes, resumed_from, resumed_samples, redone, killed_after, order = [], None, [], None, None, None
    if kill:
        rng = random.Random(args.seed)
        killed_after = rng.randint(args.kill_after + 1, args.steps - 1)
        codes.append(client.run(killed_after, rng.uniform(0.0, 1.0) * _mean_step_s(run)))
        latest = latest_checkpoint(run)
        before, checkpoint = trajectory_order(run), latest.step if latest else None
        first_calls = list(server.calls) if server else []
        if server:
            server.new_client()
        resumed_client = ClientRun([sys.executable, "-m", "retool", "train", "--resume", str(run)], run, env)
        codes.append(resumed_client.run())
        resumed_samples = resumed_client.samples
        order = same_order(before, trajectory_order(run), checkpoint)
        if server:
            resumed = server.calls[len(first_calls):]
            resumed_from = min((c.step for c in resumed), default=None)
            finished = {c.step for c in first_calls if c.endpoint == "optim_step"}
            overlap = {step for step in finished if step >= (resumed_from or 0)}
            ahead = samples_ahead(run)  # then the redone steps' samples are not asked again: their training is compared

            def redone_call(c: ServiceCall) -> bool:
                return c.step in overlap and (c.endpoint in TRAINING or not ahead)

            redone = same_calls(list(filter(redone_call, first_calls)), list(filter(redone_call, resumed)))
            calls = [c for c in first_calls
                     if resumed_from is None or c.step < resumed_from or (ahead and c.endpoint not in TRAINING)] + resumed
        else:
            resumed_from, calls = checkpoint, []
    else:
        codes.append(client.run())
        calls = list(server.calls) if server else []
    rows = _read_rows(run / "metrics.jsonl")
    if server:
        marks, tokens, gaps = list(server.step_marks), dict(server.tokens), dict(server.gaps)
    else:
        marks, tokens, gaps = [], client_tokens(rows), {}
    return Outcome(rows, client.samples, calls, marks, tokens, gaps, codes, resumed_from, resumed_samples, redone,
                   killed_after, order)


def trajectory_order(run: Path) -> dict[int, list[tuple[int, int, str]]]:
    """Step -> (group, index, problem id) of every trajectory in the run's trajectories
    files: its data order, read on the client's side (an unreadable file is left out)."""
    order: dict[int, list[tuple[int, int, str]]] = {}
    for path in sorted((run / "trajectories").glob("*.jsonl.gz")):
        try:
            rows = read_trajectory_log(path)
        except TrajectoryLogError:
            continue
        for r in rows:
            order.setdefault(r.step, []).append((r.group, r.index, r.trajectory.problem_id))
    return {step: sorted(keys) for step, keys in order.items()}


def same_order(before: dict[int, list], after: dict[int, list], checkpoint: int | None) -> tuple[bool, str]:
    """Whether the steps done before the kill and again after the resume (those after the
    checkpoint it resumed from) rolled out the same problems in the same groups."""
    redone = sorted(s for s in before if checkpoint is None or s > checkpoint)
    differ = [s for s in redone if after.get(s) != before[s]]
    detail = f"steps {redone[0]}-{redone[-1]} redone" if redone else "no step redone: the kill came after a checkpoint"
    return not differ, detail + (f"; steps that differ: {differ[:10]}" if differ else "")


def client_tokens(rows: list[dict]) -> dict[str, int]:
    """What the run asked the service for, from its own metrics (``--service``: no service log)."""
    def total(key: str) -> int:
        return int(sum(r.get(key, 0) for r in rows))

    return {"prefill": total("tokens/prefill_service"),
            "prefill_new": total("tokens/prefill_service") - total("tokens/prefill_cached"),
            "sampled": total("tokens/sampled"), "trained": total("tokens/forward_backward")}


def _mean_step_s(run: Path) -> float:
    rows = _read_rows(run / "metrics.jsonl")
    return sum(r["time/step"] for r in rows) / len(rows) if rows else 1.0


TRAINING = ("forward_backward", "optim_step")
"""The training calls; the other calls the bench records are samples."""


def samples_ahead(run: Path) -> bool:
    """Whether the run samples ahead of training (its ``--max-staleness``, however it was given)."""
    try:
        return bool(json.loads((run / "config.json").read_text()).get("max_staleness", 0))
    except (OSError, json.JSONDecodeError):
        return False


def same_calls(a: list[ServiceCall], b: list[ServiceCall], *, ahead: bool = False) -> tuple[bool, str]:
    """Whether two runs asked the same things, step by step (order inside a step free).

    With ``ahead`` (runs that sample ahead of training, ``--max-staleness``): the training
    calls step by step, and the samples as a set. A resumed run does not ask again for the
    groups it finds stored (those of the steps sampled with weights older than its
    checkpoint), and a sample carries the step the trainer was at when it was asked, which
    depends on timing when rollouts run ahead; so every sample either run asked, the other
    asked too, and every step trained the same datums."""
    if ahead:
        same, detail = same_calls([c for c in a if c.endpoint in TRAINING], [c for c in b if c.endpoint in TRAINING])
        sa, sb = ({c.digest for c in calls if c.endpoint not in TRAINING} for calls in (a, b))
        return same and sa == sb, f"training: {detail}; distinct samples {len(sa)} vs {len(sb)}, {len(sa ^ sb)} in one only"

    def by_step(calls: list[ServiceCall]) -> dict[int, list[tuple[str, str]]]:
        out: dict[int, list[tuple[str, str]]] = {}
        for c in calls:
            out.setdefault(c.step, []).append((c.endpoint, c.digest))
        return {k: sorted(v) for k, v in out.items()}

    sa, sb = by_step(a), by_step(b)
    differ = [s for s in sorted(set(sa) | set(sb)) if sa.get(s) != sb.get(s)]
    return not differ, f"{len(a)} vs {len(b)} calls; steps that differ: {differ[:10]}"


def report(outcome: Outcome, model: LatencyModel, per_step: bool) -> dict[str, float]:
    """Print the per-step table and the totals; return the totals."""
    from retool.sandbox.metrics import percentile

    rows_by_step = {int(r["step"]): r for r in outcome.rows}  # a step redone after a resume: its last row
    client_side = client_spans(outcome.rows)
    spans = step_spans(outcome.marks) if outcome.marks else client_side
    steps = [s for s in sorted(spans) if s in rows_by_step]
    rows = [rows_by_step[s] for s in steps]
    walls = [spans[s][0] for s in steps]
    busys = [spans[s][1] for s in steps]
    if per_step:
        print(f"{'step':>4} {'wall_s':>7} {'service_s':>9} {'client_s':>8} {'client%':>7} {'sbx_calls':>9} "
              f"{'sbx_p50':>7} {'sbx_p95':>7} {'wait_p95':>8} {'run_p95':>7} {'grade_s':>7} {'grd_max':>7} {'rss_MiB':>7} "
              f"{'fds':>4} {'procs':>5}")
        by_step = {s.step: s for s in outcome.samples + outcome.resumed_samples}
        for i, row in enumerate(rows):
            s = by_step.get(int(row["step"]))
            wall, busy = walls[i], busys[i]
            print(f"{int(row['step']):>4} {wall:7.2f} {busy:9.2f} {wall - busy:8.2f} {100 * (wall - busy) / wall:6.1f}% "
                  f"{row.get('sandbox/calls', 0):9.0f} {row.get('sandbox/latency_p50', 0):7.3f} "
                  f"{row.get('sandbox/latency_p95', 0):7.3f} {row.get('sandbox/queue_wait_p95', 0):8.3f} "
                  f"{row.get('sandbox/run_p95', 0):7.3f} {row.get('time/grade', 0):7.3f} "
                  f"{row.get('time/grade_max', 0):7.3f} "
                  + (f"{s.rss_mib:7.0f} {s.fds:4d} {s.procs:5d}" if s else ""))
    wall, busy = sum(walls), sum(busys)
    calm = [(w, b) for w, b, r in zip(walls, busys, rows) if not r.get("sandbox/count_timeout", 0)]
    shares = sorted((w - b) / w for w, b in zip(walls, busys) if w > 0)
    calls = sum(r.get("sandbox/calls", 0) for r in rows)
    rollout = sum(r.get("time/rollout", 0) for r in rows)
    totals = {"steps": len(walls), "wall_s": wall, "service_s": busy, "client_s": wall - busy,
              "client_share": (wall - busy) / wall if wall else 0.0,
              "client_s_per_step": (wall - busy) / max(len(walls), 1), "step_s": wall / max(len(walls), 1),
              "client_share_median": percentile(shares, 50), "steps_without_timeout": len(calm),
              "client_share_without_timeout": (sum(w - b for w, b in calm) / sum(w for w, _ in calm)) if calm else 0.0,
              "client_s_per_step_without_timeout": sum(w - b for w, b in calm) / max(len(calm), 1),
              "sandbox_calls": calls, "sandbox_calls_per_s": calls / rollout if rollout else 0.0,
              "sandbox_p50_s": percentile(sorted(r.get("sandbox/latency_p50", 0) for r in rows), 50),
              "sandbox_p95_s": percentile(sorted(r.get("sandbox/latency_p95", 0) for r in rows), 50),
              "sandbox_wait_p95_s": max((r.get("sandbox/queue_wait_p95", 0) for r in rows), default=0.0),
              "sandbox_wait_p95_median_s": percentile(sorted(r.get("sandbox/queue_wait_p95", 0) for r in rows), 50),
              "sandbox_run_p95_s": percentile(sorted(r.get("sandbox/run_p95", 0) for r in rows), 50),
              "grade_s_per_step": _mean(rows, "time/grade"), "grade_max_s": _mean(rows, "time/grade_max"),
              "grade_s": sum(r.get("time/grade", 0) for r in rows),
              "reward_correct": _mean(rows, "reward/correct"), "trajectory_tokens": _mean(rows, "rollout/trajectory_tokens"),
              "code_calls": _mean(rows, "rollout/code_calls"), "turns": _mean(rows, "rollout/turns")}
    for name in ("rss_mib", "fds", "procs"):
        points = [(s.step, getattr(s, name)) for s in outcome.samples]
        half = points[len(points) // 2:]  # after warm-up
        totals[f"{name}_first"] = points[0][1] if points else 0
        totals[f"{name}_last"] = points[-1][1] if points else 0
        totals[f"{name}_slope_per_step"] = slope(half)
    # Idle from one sample's end to the next one's start: every live trajectory is at its
    # code call (the sandbox running the snippet, the client parsing and rendering around it).
    between = outcome.gaps.get(("asample", "asample"), 0.0)
    totals["between_samples_s_per_step"] = between / max(len(walls), 1)
    totals["client_share_apart_from_code_calls"] = (wall - busy - between) / wall if wall else 0.0
    for (before, after), seconds in sorted(outcome.gaps.items(), key=lambda kv: -kv[1])[:6]:
        totals[f"gap_s_per_step/{before}->{after}"] = seconds / max(len(walls), 1)
    tok = outcome.tokens
    totals.update({f"tokens_{k}": float(v) for k, v in tok.items()})
    totals["measured_on"] = "service" if outcome.marks else "client"
    # the same split from the client's side (time/service_busy: an SDK request in flight), on the same steps
    mine = [client_side[s] for s in steps if s in client_side]
    if mine:
        own_wall = sum(w for w, _ in mine)
        totals["client_side_steps"] = len(mine)
        totals["client_side_share"] = (own_wall - sum(b for _, b in mine)) / own_wall if own_wall else 0.0
        totals["client_side_s_per_step"] = (own_wall - sum(b for _, b in mine)) / len(mine)
    costs = [r["cost/total"] for r in outcome.rows if "cost/total" in r]
    if costs:
        totals["cost_total"] = costs[-1]
    return totals


def client_spans(rows: list[dict]) -> dict[int, tuple[float, float]]:
    """Step -> (wall seconds, seconds with a service request in flight), measured by the
    client itself (``time/service_window`` and ``time/service_busy``, Tinker/PyTRIO
    engines: from one step's optim_step answer to the next, the latency service's span)."""
    return {int(r["step"]): (r["time/service_window"], r["time/service_busy"]) for r in rows
            if "time/service_window" in r and "time/service_busy" in r}


def step_spans(marks: list[tuple[float, float, int | None]]) -> dict[int, tuple[float, float]]:
    """Step -> (wall seconds, service-busy seconds), from the service's step marks; a step
    is measured from the mark before it in the same client process (a redone step: the
    last time)."""
    spans = {}
    for (t0, b0, _), (t1, b1, step) in zip(marks, marks[1:]):
        if step is not None:
            spans[step] = (t1 - t0, b1 - b0)
    return spans


def _mean(rows: list[dict], key: str) -> float:
    return sum(r.get(key, 0.0) for r in rows) / max(len(rows), 1)


def print_totals(label: str, totals: dict[str, float], model: LatencyModel | None) -> None:
    """Print a rehearsal's totals; ``model`` None: the real service (``--service``)."""
    t = totals
    scale_note = "the real service" if model is None else f"time scale {model.time_scale:g}"
    print(f"\n== {label}: {int(t['steps'])} steps, {scale_note}, load {os.getloadavg()}")
    side = "as the service saw it" if t.get("measured_on") == "service" else "measured by the client"
    unscaled = model is None or model.time_scale == 1
    print(f"step wall {t['step_s']:.2f} s; service busy {t['service_s'] / max(t['steps'], 1):.2f} s/step ({side}); "
          f"client's own work {t['client_s_per_step']:.2f} s/step = {100 * t['client_share']:.1f} % of a step "
          f"(goal <= 5 %{'' if unscaled else '; the goal applies to unscaled runs'})")
    if t.get("measured_on") == "service" and "client_side_share" in t:
        print(f"the same from the client's side (an SDK request in flight, time/service_busy; the SDK's own "
              f"work counts as in flight): client's own work {t['client_side_s_per_step']:.2f} s/step = "
              f"{100 * t['client_side_share']:.1f} %")
    if "cost_total" in t:
        print(f"cost: {t['cost_total']:.4g} USD (cost/total, priced by --price-table)")
    print(f"steps with no sandbox timeout ({int(t['steps_without_timeout'])}): client's own work "
          f"{t['client_s_per_step_without_timeout']:.2f} s/step = {100 * t['client_share_without_timeout']:.1f} %; "
          f"median step {100 * t['client_share_median']:.1f} %")
    if t.get("measured_on") == "service":  # where the idle time sits needs the service's log of its calls
        print(f"of which between two samples (every live trajectory at its code call: the sandbox running it, "
              f"the client parsing and rendering around it) {t['between_samples_s_per_step']:.2f} s/step; the rest "
              f"of the client's own work {t['client_s_per_step'] - t['between_samples_s_per_step']:.2f} s/step = "
              f"{100 * t['client_share_apart_from_code_calls']:.1f} %")
        gaps = [(k.split("/", 1)[1], v) for k, v in t.items() if k.startswith("gap_s_per_step/")]
        print("client's own work, by where it sits (s/step; idle between the service calls named): "
              + ", ".join(f"{k} {v:.2f}" for k, v in gaps))
    met = t["sandbox_wait_p95_median_s"] <= t["sandbox_run_p95_s"]
    print(f"sandbox: {t['sandbox_calls']:.0f} calls, {t['sandbox_calls_per_s']:.1f} calls/s of rollout time, "
          f"median-step p50 {t['sandbox_p50_s']:.3f} s / p95 {t['sandbox_p95_s']:.3f} s; wait for a worker p95 "
          f"{t['sandbox_wait_p95_median_s']:.3f} s (median step; worst {t['sandbox_wait_p95_s']:.3f} s) vs run p95 "
          f"{t['sandbox_run_p95_s']:.3f} s (goal: wait <= run: {'met' if met else 'NOT met'}; the wait includes "
          f"the hand-over)")
    print(f"grading: {t['grade_s']:.2f} s in all, {t['grade_s_per_step']:.3f} s/step summed over the step's "
          f"trajectories (each graded in a thread as it ends, beside the others' sampling); the longest one "
          f"{t['grade_max_s']:.3f} s per step on average")
    print(f"client RSS {t['rss_mib_first']:.0f} -> {t['rss_mib_last']:.0f} MiB (slope {t['rss_mib_slope_per_step']:+.3f}"
          f" MiB/step), fds {t['fds_first']} -> {t['fds_last']} ({t['fds_slope_per_step']:+.3f}/step), processes "
          f"{t['procs_first']} -> {t['procs_last']} ({t['procs_slope_per_step']:+.3f}/step); slopes over the 2nd half")
    print(f"tokens: prefill {t.get('tokens_prefill', 0):.0f} (after the prefix cache {t.get('tokens_prefill_new', 0):.0f}), "
          f"sampled {t.get('tokens_sampled', 0):.0f}, trained {t.get('tokens_trained', 0):.0f}; "
          f"correct {100 * t['reward_correct']:.0f} %")
    print(f"trajectories: {t['trajectory_tokens']:.0f} tokens, {t['code_calls']:.2f} code calls, "
          f"{t['turns']:.2f} turns on average")


def print_stream_comparison(sync: dict[str, float], streamed: dict[str, float], sync_rows: list[dict],
                            streamed_rows: list[dict], model: LatencyModel, batch_size: int) -> float:
    """Print streamed against synchronous steps; return the measured steps-per-hour ratio.

    The ideal: the synchronous step with its training time (``time/train``) hidden behind
    the rollout except the last group's forward_backward (1 / batch_size of it) and the
    optim_step, which streaming cannot hide."""
    train_s, tail_s = _mean(sync_rows, "time/train"), _mean(streamed_rows, "time/train")
    optim_s = model.scaled(model.optim_step_s)
    ideal_step_s = sync["step_s"] - train_s + max(train_s - optim_s, 0.0) / batch_size + optim_s
    ratio = sync["step_s"] / streamed["step_s"]
    print(f"\n== --stream-groups vs synchronous ({int(sync['steps'])} steps each, same seed; load {os.getloadavg()})")
    print(f"steps/hour: synchronous {3600 / sync['step_s']:.0f} ({sync['step_s']:.2f} s/step), streamed "
          f"{3600 / streamed['step_s']:.0f} ({streamed['step_s']:.2f} s/step): {ratio:.3f}x")
    print(f"training after the rollout: synchronous {train_s:.2f} s/step, streamed {tail_s:.2f} s/step; rollout "
          f"{_mean(sync_rows, 'time/rollout'):.2f} vs {_mean(streamed_rows, 'time/rollout'):.2f} s/step; service busy "
          f"{sync['service_s'] / max(sync['steps'], 1):.2f} vs {streamed['service_s'] / max(streamed['steps'], 1):.2f}"
          f" s/step")
    print(f"ideal under this latency model (all training but the last group's share and the optim_step hidden): "
          f"{ideal_step_s:.2f} s/step = {sync['step_s'] / ideal_step_s:.3f}x")
    return ratio


def print_staleness_comparison(sync: dict[str, float], lagged: dict[str, float], sync_rows: list[dict],
                               lagged_rows: list[dict], max_staleness: int, model: LatencyModel | None = None) -> float:
    """Print sampling ahead against synchronous steps; return the measured steps-per-hour ratio.

    Two ideals: the synchronous step with its rollout and its training fully overlapped
    (the longer of the two: what overlap alone gives while every step still waits for
    its own slowest trajectory); and, under a latency ``model``, the service at capacity —
    every sampled token at the batched decode rate, every new prompt token at the prefill
    rate, training at its rate, the sampler kept busy meanwhile by the later steps'
    rollouts (the longer of sampling and training, per step), which no lag can beat."""
    rollout_s = _mean(sync_rows, "time/rollout")
    ideal_step_s = max(rollout_s, sync["step_s"] - rollout_s)
    ratio = sync["step_s"] / lagged["step_s"]
    print(f"\n== --max-staleness {max_staleness} vs synchronous ({int(sync['steps'])} steps each, same seed; "
          f"load {os.getloadavg()})")
    print(f"steps/hour: synchronous {3600 / sync['step_s']:.0f} ({sync['step_s']:.2f} s/step), sampling ahead "
          f"{3600 / lagged['step_s']:.0f} ({lagged['step_s']:.2f} s/step): {ratio:.3f}x")
    print(f"synchronous: rollout {rollout_s:.2f} s/step, training {_mean(sync_rows, 'time/train'):.2f} s/step; "
          f"sampling ahead: rollout {_mean(lagged_rows, 'time/rollout_ahead'):.2f} s/step (beside training and the "
          f"other steps' rollouts), the trainer waited for it {_mean(lagged_rows, 'time/rollout_wait'):.2f} s/step, "
          f"training {_mean(lagged_rows, 'time/train'):.2f} s/step; mean lag {_mean(lagged_rows, 'staleness/mean'):.2f}")
    line = (f"ideal (rollout and training fully overlapped): {ideal_step_s:.2f} s/step = "
            f"{sync['step_s'] / ideal_step_s:.3f}x")
    if model is not None and sync["steps"]:
        steps = sync["steps"]
        sampling_s = (sync.get("tokens_prefill_new", 0) / model.prefill_rate
                      + sync.get("tokens_sampled", 0) / model.decode_rate) / steps
        training_s = sync.get("tokens_trained", 0) / model.train_rate / steps + model.optim_step_s + model.sampler_swap_s
        capacity_s = model.scaled(max(sampling_s, training_s))
        line += (f"; the service at capacity (sampling {model.scaled(sampling_s):.2f}, training "
                 f"{model.scaled(training_s):.2f} s/step): {capacity_s:.2f} s/step = {sync['step_s'] / capacity_s:.3f}x")
    print(line)
    return ratio


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, LatencyModel]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="training steps (default 200, the reference run's)")
    parser.add_argument("--batch-size", type=int, default=8, help="problems per step (the reference run's 8)")
    parser.add_argument("--group-size", type=int, default=8, help="trajectories per problem (the reference run's 8)")
    parser.add_argument("--problems", type=int, default=512, help="problems in the generated training set")
    parser.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (default 50)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--sandbox-timeout-s", type=float, default=None,
                        help="override the preset's 30 s sandbox timeout (a soak: fewer long stalls)")
    parser.add_argument("--sandbox-workers", type=int, default=None, help="override the preset's 8 workers")
    parser.add_argument("--timeout-rate", type=float, default=None,
                        help=f"the scripted policy's share of snippets that loop to the sandbox timeout (default "
                             f"{TIMEOUT_RATE:g}; the reference run reported 0.02-0.03)")
    parser.add_argument("--kill", action=argparse.BooleanOptionalAction, default=None,
                        help="SIGKILL after step --kill-after and resume (default: on when --steps > 101)")
    parser.add_argument("--kill-after", type=int, default=KILL_AFTER_STEP,
                        help="the kill comes at a random point after this step (default 100)")
    parser.add_argument("--compare", action=argparse.BooleanOptionalAction, default=False,
                        help="also run uninterrupted and check both asked the service the same things")
    parser.add_argument("--stream-groups", action=argparse.BooleanOptionalAction, default=False,
                        help="also run the steps with retool train --stream-groups (uninterrupted, fresh service) "
                             "and print both, their steps/hour and ratio")
    parser.add_argument("--max-staleness", type=int, nargs="+", default=[0], metavar="K",
                        help="also run the steps with retool train --max-staleness K, for each K given (uninterrupted, "
                             "fresh service each), and print each against the synchronous run: steps/hour and ratio")
    parser.add_argument("--engine", choices=("tinker", "vllm"), default="tinker",
                        help="tinker: the latency-model service (default); vllm: the vLLM engine on this machine "
                             "(--max-staleness comparison only)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="--engine vllm: synchronous / sampling-ahead pairs, alternating (default 2)")
    parser.add_argument("--service", choices=("latency", "tinker", "pytrio"), default="latency",
                        help="latency: the latency-model service on 127.0.0.1 (default); tinker / pytrio: the real "
                             "service, one run, its API key read from TINKER_API_KEY / PYTRIO_API_KEY (never a flag), "
                             "capped by --max-cost")
    parser.add_argument("--max-cost", type=float, default=None,
                        help="--service tinker/pytrio (required): USD the run may spend; retool train ends it cleanly, "
                             "after a checkpoint, before another step would pass it")
    parser.add_argument("--price-table", type=Path, default=None,
                        help="--service tinker/pytrio (required): your prices, TOML (configs/prices/example.toml)")
    parser.add_argument("--base-url", default=None,
                        help="--service tinker/pytrio: the service's URL (default: the SDK's)")
    parser.add_argument("--train-arg", action="append", default=[], metavar="ARG",
                        help="one more flag for retool train, after the bench's own (repeat it; e.g. "
                             "--train-arg=--lora-rank=16)")
    parser.add_argument("--per-step", action=argparse.BooleanOptionalAction, default=True, help="print every step")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep runs here (default: a temporary folder)")
    parser.add_argument("--json", type=Path, default=None, help="also write the totals here")
    defaults = LatencyModel()
    for f in fields(LatencyModel):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(defaults, f.name)), default=None,
                            help=f"latency model: {f.name} (default {getattr(defaults, f.name):g})")
    args = parser.parse_args(argv)
    try:
        model = replace_model(defaults, **{f.name: getattr(args, f.name) for f in fields(LatencyModel)})
    except ValueError as err:
        parser.error(str(err))
    if args.timeout_rate is not None and not 0.0 <= args.timeout_rate <= 0.5:
        parser.error(f"--timeout-rate must be in [0, 0.5], got {args.timeout_rate:g}")
    if args.service != "latency":
        _check_real_service(parser, args)
    elif args.max_cost is not None or args.price_table is not None or args.base_url is not None:
        parser.error("--max-cost, --price-table and --base-url are for --service tinker/pytrio (the latency model "
                     "costs nothing)")
    if min(args.steps, args.batch_size, args.group_size, args.problems, args.save_every) < 1:
        parser.error("--steps, --batch-size, --group-size, --problems and --save-every must be >= 1")
    if args.kill is None:
        args.kill = args.steps > args.kill_after + 1
    if min(args.max_staleness) < 0:
        parser.error("--max-staleness must be >= 0")
    args.lags = sorted({k for k in args.max_staleness if k})  # the sampling-ahead runs to compare
    if args.engine == "vllm":
        if len(args.lags) != 1 or args.stream_groups or args.compare or args.repeats < 1 \
                or args.timeout_rate is not None \
                or args.steps < max(args.lags, default=0) + 2:
            parser.error("--engine vllm compares one --max-staleness K >= 1 with synchronous steps: give "
                         "--max-staleness K, --steps >= K + 2 and --repeats >= 1 (no --stream-groups / --compare / "
                         "--timeout-rate)")
        args.kill = False
    args.max_staleness = args.lags[0] if args.lags else 0  # the first (--engine vllm: the only) K
    if args.kill and args.lags:
        parser.error("--max-staleness compares uninterrupted runs: add --no-kill (or run fewer steps)")
    if args.kill and args.stream_groups:
        parser.error("--stream-groups compares uninterrupted runs: add --no-kill (or run fewer steps)")
    if args.kill and args.steps <= args.kill_after + 1:
        parser.error(f"--kill needs --steps > {args.kill_after + 1} (the kill comes after step {args.kill_after})")
    if args.timeout_rate is None:  # None until here: the checks above refuse it where it does not apply
        args.timeout_rate = TIMEOUT_RATE
    return args, model


def _check_real_service(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--service tinker``/``pytrio``: one run of the reference run's preset, paid, so
    capped; every problem a one-line error before anything is sent."""
    if not os.environ.get(KEY_ENV[args.service]):
        parser.error(f"--service {args.service} needs your API key in {KEY_ENV[args.service]} (the SDK reads it "
                     f"there; it is never a flag)")
    if args.max_cost is None or args.price_table is None:
        parser.error(f"--service {args.service} needs --max-cost USD and --price-table FILE: the run is billed, "
                     f"and retool train stops it before another step would pass the budget")
    if not args.max_cost > 0:
        parser.error(f"--max-cost must be > 0, got {args.max_cost:g}")
    if not args.price_table.is_file():
        parser.error(f"--price-table {args.price_table}: no such file")
    if args.engine != "tinker" or args.compare or args.stream_groups or any(args.max_staleness):
        parser.error(f"--service {args.service} runs one run (each comparison is another full bill): no --engine vllm, "
                     f"--compare, --stream-groups or --max-staleness")
    given = [f.name for f in fields(LatencyModel) if getattr(args, f.name) is not None]
    given += ["timeout_rate"] if args.timeout_rate is not None else []
    if given:
        parser.error(f"--service {args.service}: the latency-model flags do not apply ({', '.join(given)})")


def vllm_argv(args: argparse.Namespace, url: str, adapters: Path, data: Path, run: Path, max_staleness: int
              ) -> list[str]:
    """``retool train --engine vllm`` with the CPU preset at the bench's tiny shape, on the server at ``url``."""
    argv = [sys.executable, "-m", "retool", "train", "--config", str(ROOT / "configs" / "cpu-smollm2.toml"),
            "--init-from", "none", "--train-data", str(data), "--max-steps", str(args.steps),
            "--batch-size", str(args.batch_size), "--group-size", str(args.group_size), "--refill-rounds", "0",
            "--max-turn-tokens", "24", "--max-assistant-turns", "2", "--max-code-calls", "1", "--seed", str(args.seed),
            "--save-every", str(args.save_every), "--sinks", "jsonl", "--run-dir", str(run),
            "--engine", "vllm", "--vllm-url", url, "--vllm-adapter-dir", str(adapters)]
    return argv + (["--max-staleness", str(max_staleness)] if max_staleness else [])


def vllm_staleness(args: argparse.Namespace, work: Path) -> int:
    """``--engine vllm``: synchronous and ``--max-staleness K`` runs alternating on one
    vLLM-CPU server; print each run, then the comparison over steps ``2 .. N - K``
    (:func:`steady_rows`); 0 when all ran."""
    from retool.bundled import smollm2_path
    from retool.engines.vllm import max_loras_for
    from retool.engines.vllm import server as vserver

    data = work / "rl.jsonl"
    subprocess.run([sys.executable, "-m", "retool", "task-data", "--split", "rl", "--n", str(args.problems),
                    "--output", str(data)], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    server = vserver.ManagedServer(vserver.ServerOptions(
        model_dir=str(smollm2_path()), max_lora_rank=32, max_loras=max_loras_for(args.max_staleness),
        dtype="float32", seed=args.seed))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    runs: dict[int, list[list[dict]]] = {0: [], args.max_staleness: []}
    codes = []
    try:
        server.wait_ready()
        for repeat in range(args.repeats):
            for k in (0, args.max_staleness) if repeat % 2 == 0 else (args.max_staleness, 0):
                run, adapters = work / f"k{k}-{repeat}", work / f"adapters-k{k}-{repeat}"
                adapters.mkdir(parents=True)
                t0 = time.monotonic()
                codes.append(ClientRun(vllm_argv(args, server.url, adapters, data, run, k), run, env).run())
                rows = _read_rows(run / "metrics.jsonl")
                runs[k].append(rows)
                print(f"K={k} repeat {repeat}: exit {codes[-1]}, {len(rows)} steps in {time.monotonic() - t0:.0f} s "
                      f"(s/step {[round(r['time/step'], 1) for r in rows]}); load {os.getloadavg()}")
    finally:
        server.stop()
    later = {k: [r for rows in all_rows for r in steady_rows(rows, args.max_staleness)] for k, all_rows in runs.items()}
    totals = {k: {"steps": float(len(rows)), "step_s": _mean(rows, "time/step")} for k, rows in later.items()}
    for k, all_rows in runs.items():
        walls = [sum(r["time/step"] for r in rows) for rows in all_rows]
        print(f"K={k}: whole runs (every step, the first and last included) {[round(w, 1) for w in walls]} s")
    print_staleness_comparison(totals[0], totals[args.max_staleness], later[0], later[args.max_staleness],
                               args.max_staleness)
    return 0 if all(code == 0 for code in codes) else 1


def main(argv: list[str] | None = None) -> int:
    sys.stdout.reconfigure(line_buffering=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated bench takes its client with it
    args, model = parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="retool-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.engine == "vllm":
        print(f"vLLM engine on this machine: {os.cpu_count()} cores; work dir {work}; load {os.getloadavg()}")
        return vllm_staleness(args, work)
    tokenizer_dir = qwen35_tokenizer_folder(work / "qwen3.5-tokenizer")
    data = write_problems(work / "train.jsonl", args.problems)
    if args.service == "latency":
        print(f"latency model: {model}\nscripted policy: {100 * args.timeout_rate:g} % of snippets loop to the "
              f"sandbox timeout"
              f"\nwork dir {work}; load {os.getloadavg()}", flush=True)
        for service, env in KEY_ENV.items():
            if os.environ.get(env):
                print(f"{env} is set: --service {service} --max-cost USD --price-table FILE runs this against the "
                      f"real service (this run uses the latency model and never sends the key)")
    else:
        print(f"the real {args.service} service ({args.base_url or 'the SDK default URL'}), {KEY_ENV[args.service]} "
              f"from the environment; --max-cost {args.max_cost:g} USD priced by {args.price_table}\nwork dir {work}; "
              f"load {os.getloadavg()}", flush=True)
    shown_model = model if args.service == "latency" else None
    outcome = rehearse(args, model, work / ("killed" if args.kill else "run"), tokenizer_dir, data, args.kill)
    totals = report(outcome, model, args.per_step)
    print_totals("killed + resumed" if args.kill else "run", totals, shown_model)
    ok = all(code == 0 for code in outcome.returncodes[-1:])
    if args.service != "latency" and len(outcome.rows) < args.steps:
        print(f"the run stopped after {len(outcome.rows)} of {args.steps} steps: see {work}/*/client.err "
              f"(--max-cost ends a run cleanly once another step would pass it)")
    if args.kill:
        print(f"SIGKILL at a random point after step {outcome.killed_after} (> {args.kill_after}): exit codes {outcome.returncodes}; resumed from step "
              f"{outcome.resumed_from}; finished with {len(outcome.rows)} metric rows")
        if outcome.redone is not None:
            print(f"steps redone after the resume asked the service what they asked before the kill: "
                  f"{outcome.redone[0]} ({outcome.redone[1]})")
        print(f"steps redone after the resume rolled out the problems they rolled out before the kill, group by "
              f"group: {outcome.order[0]} ({outcome.order[1]})")
        ok = ok and (outcome.redone is None or outcome.redone[0]) and outcome.order[0]
    if args.compare:
        reference = rehearse(args, model, work / "uninterrupted", tokenizer_dir, data, kill=False)
        same, detail = same_calls(reference.calls, outcome.calls, ahead=samples_ahead(work / "uninterrupted" / "run"))
        print(f"service calls and data order equal to an uninterrupted run's: {same} ({detail})")
        ok = ok and same
        totals["same_calls"] = float(same)
    if args.stream_groups:
        streamed = rehearse(args, model, work / "streamed", tokenizer_dir, data, kill=False, stream=True)
        streamed_totals = report(streamed, model, args.per_step)
        print_totals("streamed (--stream-groups)", streamed_totals, model)
        totals["streamed_step_s"] = streamed_totals["step_s"]
        totals["streamed_ratio"] = print_stream_comparison(totals, streamed_totals, outcome.rows, streamed.rows,
                                                           model, args.batch_size)
        ok = ok and all(code == 0 for code in streamed.returncodes)
    for k in args.lags:
        lagged = rehearse(args, model, work / f"lagged-k{k}", tokenizer_dir, data, kill=False, max_staleness=k)
        lagged_totals = report(lagged, model, args.per_step)
        print_totals(f"sampling ahead (--max-staleness {k})", lagged_totals, model)
        suffix = "" if k == args.lags[0] else f"_k{k}"
        totals[f"lagged_step_s{suffix}"] = lagged_totals["step_s"]
        totals[f"lagged_client_share{suffix}"] = lagged_totals["client_share"]
        totals[f"lagged_ratio{suffix}"] = print_staleness_comparison(totals, lagged_totals, outcome.rows,
                                                                     lagged.rows, k, model)
        ok = ok and all(code == 0 for code in lagged.returncodes)
    if args.json:
        args.json.write_text(json.dumps(totals, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
