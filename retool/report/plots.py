"""``retool plot``: the checkpoint comparison figure and a run's training curves.

Two figures, each written as PNG and SVG:

- **checkpoints** — from a folder of eval results files (docs/formats.md): Average@k and
  Pass@k bars and a Format line per checkpoint, base first, then by training step (the
  seed's figure). Files are grouped by (dataset, mode); each group gets its own figure.
  An eval that was interrupted (no summary line) is summarised from the problems it
  finished, and its label says so. Other ``*.jsonl`` files in the folder are skipped
  and listed.
- **behaviour** — beside each checkpoint figure, the ReTool paper's behaviour figures
  per checkpoint (:data:`retool.stats.BEHAVIOUR_FIGURES`: response tokens, call rate,
  code lines per call, share of calls that ran without error, first-call position,
  self-corrections), one small bar panel each; recomputed from the problems for files
  written before summaries recorded them.
- **training** — from a run's ``metrics.jsonl``: a grid of small panels (reward,
  tool-call validity, code calls and turns, trajectory tokens, sandbox outcomes and
  latency, training and token counters). Panels whose metrics are absent are left out;
  when a resumed run logged a step twice, the last row for that step wins.

Not covered: interactive plots, comparing several runs in one figure, smoothing.
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import sys
from dataclasses import dataclass, field
from collections.abc import Sequence
from pathlib import Path

from retool.atomic import atomic_open
from retool.flag_checks import output_folder, refuse_renamed
from retool.jsonl import JsonlError
from retool.log import read_metrics
from retool.report import ReportInputError, read_eval_results
from retool.results import EvalResults, is_results_file, summarize
from retool.stats import BEHAVIOUR_FIGURES, COUNT_FIGURES

FORMATS = ("png", "svg")

TRAINING_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward/mean", "reward/correct", "reward/format")),
    ("valid tool-call rate", ("rollout/valid_tool_call_rate",)),
    ("code calls and turns", ("rollout/code_calls", "rollout/turns")),
    ("trajectory tokens", ("rollout/trajectory_tokens",)),
    ("degenerate groups", ("rollout/degenerate_group_rate",)),
    ("tool-use behaviour (shares)", ("behaviour/call_rate", "behaviour/call_success_rate",
                                     "behaviour/first_call_position")),
    ("tool-use behaviour (counts)", ("behaviour/code_lines_per_call", "behaviour/self_corrections")),
    ("sandbox outcomes", ("sandbox/*rate",)),
    ("sandbox latency (s)", ("sandbox/latency*",)),
    ("loss", ("train/loss",)),
    ("policy drift", ("train/*kl*", "train/clip*", "train/*logprob_diff*")),
    ("behaviour IS (--behaviour-is)", ("train/behaviour_*",)),
    ("staleness (versions, --max-staleness)", ("staleness/mean", "staleness/max")),
    ("tokens by lag (share)", ("staleness/share_lag_*",)),
    ("entropy", ("train/entropy", "train/sampler_nll")),
    ("grad norm", ("train/grad_norm",)),
    ("tokens per step", ("tokens/prefill", "tokens/sampled", "tokens/trained")),
    ("step time (s)", ("time/step", "time/total_step", "time/rollout_ahead", "time/rollout_wait")),
)
"""Panel title → metric name patterns (``fnmatch`` globs), in display order."""


# ---------------------------------------------------------------- checkpoints


@dataclass(frozen=True)
class CheckpointPoint:
    """One bar group of the checkpoint figure."""

    label: str
    step: int | None
    average: float
    pass_at_k: float
    format: float
    k: int
    complete: bool
    behaviour: dict[str, float] = field(default_factory=dict)
    """:func:`retool.stats.behaviour_figures` of the checkpoint's samples."""


def discover_eval_results(folder: str | Path) -> tuple[list[EvalResults], list[Path]]:
    """Eval results files in ``folder`` (``*.jsonl``, ``*.jsonl.gz``) and the files skipped.

    A file is skipped when it is not an eval results file (no header first) or holds no
    finished problem yet.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ReportInputError(f"{folder}: not a folder of eval results")
    found, skipped = [], []
    for path in sorted([*folder.glob("*.jsonl"), *folder.glob("*.jsonl.gz")]):
        if not is_results_file(path):
            skipped.append(path)
            continue
        results = read_eval_results(path)
        if results.problems:
            found.append(results)
        else:
            skipped.append(path)
    return found, skipped


def checkpoint_point(results: EvalResults) -> CheckpointPoint:
    """The numbers one checkpoint contributes, from its summary or its problems."""
    try:
        summary = results.summary or summarize(p.samples for p in results.problems)
        behaviour = summary.behaviour
        if behaviour is None:  # a file from before summaries recorded the behaviour figures
            behaviour = summarize(p.samples for p in results.problems).behaviour
    except ValueError as err:
        raise ReportInputError(f"{results.path}: cannot summarise its problem rows: {err!r}") from err
    label = results.label
    if results.summary is None:
        label += f" (partial: {len(results.problems)} problems)"
    return CheckpointPoint(label=label, step=results.header.step, average=summary.average_at_k,
                           pass_at_k=summary.pass_at_k, format=summary.format, k=summary.k,
                           complete=results.summary is not None, behaviour=dict(behaviour or {}))


def order_checkpoints(points: list[CheckpointPoint], order: Sequence[str] | None = None) -> list[CheckpointPoint]:
    """Base (no step) first, then by step; ties keep label order.

    ``order`` (labels) overrides that for the labels it names — e.g. the demo's
    "before SFT", "after SFT", "after RL", whose steps count different runs; points
    it does not name follow in the default order.
    """
    ranked = sorted(points, key=lambda p: (p.step is not None, p.step or 0, p.label))
    if not order:
        return ranked
    rank = {label: i for i, label in enumerate(order)}
    return sorted(ranked, key=lambda p: rank.get(p.label, len(rank)))


def plot_checkpoints(results_dir: str | Path, out_dir: str | Path, *, dataset: str | None = None,
                     mode: str | None = None, order: Sequence[str] | None = None) -> list[Path]:
    """Draw one checkpoint figure per (dataset, mode) found in ``results_dir``.

    Returns the written paths (PNG and SVG per figure). Raises :class:`ReportInputError`
    when no eval results match. ``order`` lists labels to place first, in that order.
    """
    found, skipped = discover_eval_results(results_dir)
    for path in skipped:
        print(f"skipped {path}: not an eval results file, or no finished problem", file=sys.stderr)
    groups: dict[tuple[str, str], list[EvalResults]] = {}
    for results in found:
        key = (results.header.dataset or "unknown", results.header.mode or "unknown")
        if (dataset is None or key[0] == dataset) and (mode is None or key[1] == mode):
            groups.setdefault(key, []).append(results)
    if not groups:
        raise ReportInputError(f"{results_dir}: no eval results found (dataset={dataset}, mode={mode})")
    written = []
    for (ds, md), members in sorted(groups.items()):
        points = order_checkpoints([checkpoint_point(r) for r in members], order)
        fig = _checkpoint_figure(points, title=f"{ds} · {md} mode")
        written += _save(fig, Path(out_dir) / f"checkpoints_{_slug(ds)}_{_slug(md)}")
        fig = _behaviour_figure(points, title=f"tool-use behaviour · {ds} · {md} mode")
        written += _save(fig, Path(out_dir) / f"behaviour_{_slug(ds)}_{_slug(md)}")
    return written


def _checkpoint_figure(points: list[CheckpointPoint], title: str):
    # numpy and matplotlib: heavy, only drawing needs them
    import numpy as np
    from matplotlib.figure import Figure

    ks = sorted({p.k for p in points})
    k_text = str(ks[0]) if len(ks) == 1 else "k"
    x = np.arange(len(points))
    width = 0.38
    fig = Figure(figsize=(max(6.0, 1.5 * len(points) + 2), 4.5))
    ax = fig.subplots()
    for offset, attr, name, color in ((-width / 2, "average", f"Average@{k_text}", "#4C72B0"),
                                      (width / 2, "pass_at_k", f"Pass@{k_text}", "#DD8452")):
        values = [100 * getattr(p, attr) for p in points]
        bars = ax.bar(x + offset, values, width, label=name, color=color)
        ax.bar_label(bars, fmt="%.1f", fontsize=8, padding=2)
    formats = [100 * p.format for p in points]
    ax.plot(x, formats, "o-", color="#2CA02C", label="Format", linewidth=2)
    for xi, value in zip(x, formats):
        ax.annotate(f"{value:.1f}", (xi, value), textcoords="offset points", xytext=(0, 7),
                    ha="center", fontsize=8, color="#2CA02C",
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85})
    ax.set_xticks(x, [p.label for p in points], rotation=15 if len(points) > 6 else 0)
    ax.set_ylim(0, 110)
    ax.set_ylabel("%")
    ax.set_title(title)
    ax.legend(loc="upper left", ncols=3, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


BEHAVIOUR_TITLES = {"response_tokens": "response tokens", "call_rate": "samples with a call (%)",
                    "code_lines_per_call": "code lines per call", "call_success_rate": "calls without error (%)",
                    "first_call_position": "first call (% of response)", "self_corrections": "self-corrections"}


def _behaviour_figure(points: list[CheckpointPoint], title: str):
    """One bar panel per behaviour figure, a bar per checkpoint (missing: no calls there)."""
    from matplotlib.figure import Figure  # heavy: only drawing needs it

    fig = Figure(figsize=(max(9.0, 0.9 * len(points) * 3 + 1), 5.2))
    axes = fig.subplots(2, 3, squeeze=False)
    for ax, name in zip(axes.flat, BEHAVIOUR_FIGURES):
        scale = 1.0 if name in COUNT_FIGURES else 100.0
        values = [scale * p.behaviour[name] if name in p.behaviour else 0.0 for p in points]
        bars = ax.bar(range(len(points)), values, color="#4C72B0")
        ax.bar_label(bars, labels=[f"{v:.2f}" if name in p.behaviour else "—" for v, p in zip(values, points)],
                     fontsize=7, padding=2)
        ax.set_xticks(range(len(points)), [p.label for p in points], rotation=20, fontsize=7)
        ax.set_title(BEHAVIOUR_TITLES[name], fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- training curves


def metrics_by_step(path: str | Path) -> dict[int, dict]:
    """Rows of ``metrics.jsonl`` (read by :func:`retool.log.read_metrics`) by step; a later
    row for the same step replaces an earlier one (a resumed run rewrites its last steps).

    Raises :class:`ReportInputError` for a missing or damaged file and a row without an
    integer ``step``.
    """
    path = Path(path)
    if not path.is_file():
        raise ReportInputError(f"{path}: cannot read: no such file")
    try:
        rows = read_metrics(path)
    except JsonlError as err:
        raise ReportInputError(str(err)) from None
    by_step = {}
    for lineno, row in enumerate(rows, start=1):
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise ReportInputError(f"{path}: row {lineno} has no integer 'step' (got {step!r})")
        by_step[step] = row
    return dict(sorted(by_step.items()))


def panel_series(rows: dict[int, dict], patterns: tuple[str, ...]) -> dict[str, tuple[list[int], list[float]]]:
    """Metric name → (steps, values) for every metric matching ``patterns``.

    Missing, non-numeric and non-finite values are left out of a series; metrics with no
    value at all are left out entirely.
    """
    names = sorted({name for row in rows.values() for name in row
                    if any(fnmatch.fnmatchcase(name, p) for p in patterns)})
    series = {}
    for name in names:
        points = [(step, float(row[name])) for step, row in rows.items() if _is_number(row.get(name))]
        if points:
            series[name] = ([s for s, _ in points], [v for _, v in points])
    return series


def plot_training(metrics_path: str | Path, out_dir: str | Path) -> list[Path]:
    """Draw the training-curve grid from a run's ``metrics.jsonl`` (or its run folder)."""
    metrics_path = Path(metrics_path)
    if metrics_path.is_dir():
        metrics_path = metrics_path / "metrics.jsonl"
    rows = metrics_by_step(metrics_path)
    panels = [(title, panel_series(rows, patterns)) for title, patterns in TRAINING_PANELS]
    panels = [(title, series) for title, series in panels if series]
    if not panels:
        raise ReportInputError(f"{metrics_path}: none of the known metrics are present")
    return _save(_training_figure(panels, title=f"training: {metrics_path.parent.name}"),
                 Path(out_dir) / "training")


def _training_figure(panels, title: str):
    from matplotlib.figure import Figure  # heavy: only drawing needs it

    cols = 3
    nrows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(4.2 * cols, 2.9 * nrows))
    axes = fig.subplots(nrows, cols, squeeze=False)
    for ax, (panel_title, series) in zip(axes.flat, panels):
        for name, (steps, values) in series.items():
            ax.plot(steps, values, label=name, linewidth=1.5, marker="." if len(steps) < 40 else None)
        ax.set_title(panel_title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- shared


def _save(fig, stem: Path) -> list[Path]:
    """Write ``stem.png`` and ``stem.svg`` (SVG text stays text: searchable, smaller)."""
    import matplotlib  # heavy: only saving a figure needs it

    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "retool"}):
        for ext in FORMATS:
            path = stem.with_suffix(f".{ext}")
            with atomic_open(path, "wb") as f:
                fig.savefig(f, format=ext, dpi=130, metadata=_METADATA[ext])
            paths.append(path)
    return paths


_METADATA = {"png": {"Software": None}, "svg": {"Date": None, "Creator": None}}
"""No dates or versions in the files, so the same input gives the same bytes."""


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "-" for c in text) or "unknown"


# ---------------------------------------------------------------- CLI


def register(subparsers) -> None:
    """Add ``retool plot`` with its ``checkpoints`` and ``training`` subcommands."""
    parser = subparsers.add_parser(
        "plot",
        description="Draw figures from what retool wrote. `retool plot checkpoints DIR`: "
                    "Average@k / Pass@k bars and a Format line per checkpoint from a folder of "
                    "eval results. `retool plot training RUN_DIR`: training curves from metrics.jsonl.")
    kinds = parser.add_subparsers(dest="plot_kind", metavar="KIND", required=True)
    ckpt = kinds.add_parser("checkpoints", help="compare checkpoints from a folder of eval results",
                            description="One figure per (dataset, mode) in RESULTS_DIR: base first, "
                                        "then checkpoints by step.")
    ckpt.add_argument("results_dir", type=Path, metavar="RESULTS_DIR",
                      help="folder holding eval results files (*.jsonl or *.jsonl.gz)")
    ckpt.add_argument("--output-dir", type=Path, help="output folder (default: RESULTS_DIR/plots)")
    refuse_renamed(ckpt, "--out", "--output-dir")
    ckpt.add_argument("--dataset", help="only eval results of this dataset (e.g. aime25)")
    ckpt.add_argument("--mode", choices=("retool", "text"), help="only eval results of this mode")
    ckpt.set_defaults(func=_run_checkpoints)
    train = kinds.add_parser("training", help="training curves from a run's metrics.jsonl",
                             description="A grid of panels from RUN_DIR/metrics.jsonl; absent metrics "
                                         "are skipped.")
    train.add_argument("run", type=Path, metavar="RUN_DIR", help="run folder, or its metrics.jsonl")
    train.add_argument("--output-dir", type=Path, help="output folder (default: RUN_DIR/plots)")
    refuse_renamed(train, "--out", "--output-dir")
    train.set_defaults(func=_run_training)


def _run_checkpoints(args: argparse.Namespace) -> int:
    out = args.output_dir or args.results_dir / "plots"
    return _report(out, lambda: plot_checkpoints(args.results_dir, out, dataset=args.dataset, mode=args.mode))


def _run_training(args: argparse.Namespace) -> int:
    run_dir = args.run if args.run.is_dir() else args.run.parent
    out = args.output_dir or run_dir / "plots"
    return _report(out, lambda: plot_training(args.run, out))


def _report(out: Path, draw) -> int:
    output_folder(out, "--output-dir")
    try:
        paths = draw()
    except ReportInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0

