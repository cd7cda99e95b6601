"""``retool view``: one self-contained HTML page of trajectories, for humans.

Reads a run's trajectory logs (:mod:`retool.trajectory_log`) or eval results files (docs/formats.md), plain or gzipped, and writes a
single HTML file that opens offline: inline CSS and JavaScript, a Content-Security-Policy
that forbids every network request, and the data embedded once as gzip + base64 JSON
that the page decodes and renders (each trajectory's body only when it is opened, so
hundreds of long trajectories stay quick).

Each trajectory shows the problem, every turn's reasoning, each code call with its
interpreter output and status, the final answer and reward, and a token view: policy
tokens (mask 1) coloured by the sign of the trajectory's advantage, masked tokens grey,
a tooltip with token id, logprob and advantage. Filters: correct / incorrect, tool used
or not, trajectories with mask warnings. Mask warnings are computed here
(:func:`mask_warnings`) — the view exists to catch masking bugs.

Model and interpreter text is treated as hostile: the page only ever sets it with
``textContent``. Token texts come from ``--tokenizer`` (a Hugging Face tokenizer name or
folder, or ``bundled:smollm2``); without one the token view shows ids.

Re-graded files (``retool regrade``) show both verdicts: an eval file's header names the
original (``regraded_from``), which is read for each sample's earlier grade (a note on
stderr when it is gone); a run's regraded rows carry their ``original_grade``. The page
marks each trajectory whose verdict changed and counts them.

Not covered: editing or re-grading trajectories (``retool regrade`` does that), diffs
between runs, a server.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import html
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from retool.atomic import atomic_write_text
from retool.bundled import resolve_model_name
from retool.flag_checks import output_file, refuse_renamed
from retool.report import ReportInputError, read_eval_results
from retool.results import EvalResults, is_results_file
from retool.stats import trajectory_stats
from retool.trajectory_log import NotATrajectoryLog, TrajectoryLogError, TrajectoryLogRow, read_trajectory_log
from retool.types import Grade, ToolCall, Trajectory, Turn

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "view"


@dataclass(frozen=True)
class ViewItem:
    """One trajectory to show, with what its source file knows about it."""

    source: str
    """Where it came from, e.g. ``step 3 · group 1 · #2`` or ``base · retool · sample 4``."""
    trajectory: Trajectory
    advantage: float | None = None
    """The training advantage (``None`` for eval samples)."""
    question: str | None = None
    gold: str | None = None
    original: Grade | None = None
    """The grade before ``retool regrade`` (``None``: not a regraded file, or the original is gone)."""


# ---------------------------------------------------------------- loading


def load_items(paths: list[Path]) -> tuple[list[ViewItem], list[str]]:
    """Trajectories from files or folders, and the list of files they came from.

    A folder contributes its ``*.jsonl``/``*.jsonl.gz`` files and those of its
    ``trajectories/`` sub-folder, skipping files that are neither format (a run's
    ``metrics.jsonl``). A file named explicitly must be one of the two formats.
    """
    items, sources = [], []
    for path in paths:
        if path.is_dir():
            for file in _folder_files(path):
                found = _load_file(file, strict=False)
                if found is not None:
                    items += found
                    sources.append(str(file))
        elif path.is_file():
            items += _load_file(path, strict=True)
            sources.append(str(path))
        else:
            raise ReportInputError(f"{path}: no such file or folder")
    return items, sources


def _folder_files(folder: Path) -> list[Path]:
    files = []
    for sub in (folder, folder / "trajectories"):
        files += sorted([*sub.glob("*.jsonl"), *sub.glob("*.jsonl.gz")])
    return files


def _load_file(path: Path, strict: bool) -> list[ViewItem] | None:
    if is_results_file(path):
        return _eval_items(read_eval_results(path))
    try:
        return [_training_item(row) for row in read_trajectory_log(path)]
    except NotATrajectoryLog:
        if strict:
            raise ReportInputError(f"{path}: neither a trajectory log nor an eval results file") from None
    except TrajectoryLogError as err:
        raise ReportInputError(str(err)) from None
    print(f"skipped {path}: neither a trajectory log nor an eval results file", file=sys.stderr)
    return None


def _eval_items(results: EvalResults) -> list[ViewItem]:
    label = " · ".join(str(part) for part in (results.label, results.header.mode) if part)
    originals = _original_grades(results)
    return [ViewItem(source=f"{label} · sample {n}", trajectory=trajectory, question=problem.question,
                     gold=_str_or_none(problem.answer), original=originals.get((problem.problem_id, n)))
            for problem in results.problems for n, trajectory in enumerate(problem.samples, start=1)]


def _original_grades(results: EvalResults) -> dict[tuple[str, int], Grade]:
    """``(problem id, sample number) → grade`` of the file a regraded file was made from."""
    original = results.header.regraded_from
    if not original:
        return {}
    try:
        before = read_eval_results(original)
    except ReportInputError as err:
        print(f"note: {results.path} was regraded from {original}, which cannot be read ({err}); "
              "showing only the new verdicts", file=sys.stderr)
        return {}
    return {(p.problem_id, n): t.grade for p in before.problems for n, t in enumerate(p.samples, start=1)}


def _training_item(row: TrajectoryLogRow) -> ViewItem:
    return ViewItem(source=row.where, trajectory=row.trajectory, advantage=_finite(row.advantage),
                    original=row.original_grade)


# ---------------------------------------------------------------- checks


def mask_warnings(trajectory: Trajectory) -> list[str]:
    """Signs of a broken loss mask in one trajectory (an empty list when it looks right).

    Checks: mask values other than 0/1; policy tokens inside the prompt; masked tokens
    that carry a logprob; a mask sum that differs from the turns' sampled-token counts.
    """
    t = trajectory
    warnings = []
    odd = sorted({m for m in t.mask_T if m not in (0, 1)})
    if odd:
        warnings.append(f"mask values other than 0/1: {odd}")
    in_prompt = sum(1 for m in t.mask_T[: t.prompt_len] if m == 1)
    if in_prompt:
        warnings.append(f"{in_prompt} policy token(s) inside the prompt (first {t.prompt_len} tokens)")
    with_logprob = sum(1 for m, lp in zip(t.mask_T, t.logprobs_T) if m == 0 and lp != 0.0)
    if with_logprob:
        warnings.append(f"{with_logprob} masked token(s) carry a non-zero logprob")
    policy, sampled = sum(1 for m in t.mask_T if m == 1), sum(turn.num_tokens for turn in t.turns)
    if policy != sampled:
        warnings.append(f"mask marks {policy} policy tokens but the turns sampled {sampled}")
    return warnings


# ---------------------------------------------------------------- tokens


def load_tokenizer(name: str):
    """A Hugging Face tokenizer from a name, a folder, or ``bundled:smollm2``."""
    from transformers import AutoTokenizer  # heavy: only --tokenizer needs it


    try:
        return AutoTokenizer.from_pretrained(resolve_model_name(name))
    except (OSError, ValueError) as err:
        raise ReportInputError(f"cannot load tokenizer {name!r}: {err}") from err


def token_texts(tokenizer, ids: set[int]) -> dict[str, str | None]:
    """Each id's decoded text (special tokens kept); ``None`` for ids outside the vocabulary."""
    size = len(tokenizer)
    return {str(i): tokenizer.decode([i], skip_special_tokens=False) if 0 <= i < size else None
            for i in sorted(ids)}


# ---------------------------------------------------------------- page


def page_data(items: list[ViewItem], sources: list[str], tokenizer=None, note: str = "") -> dict:
    """The JSON the page renders: items, optional vocabulary, sources and a note."""
    vocab = None
    if tokenizer is not None:
        vocab = token_texts(tokenizer, {i for item in items for i in item.trajectory.tokens_T})
    rows = []
    for item in items:
        prompt = None
        if tokenizer is not None and item.question is None:
            prompt = tokenizer.decode(list(item.trajectory.tokens_T[: item.trajectory.prompt_len]),
                                      skip_special_tokens=False)
        rows.append(_item_json(item, prompt))
    return {"items": rows, "vocab": vocab, "sources": sources, "note": note}


def _item_json(item: ViewItem, prompt: str | None) -> dict:
    t = item.trajectory
    return {
        "src": item.source, "pid": t.problem_id, "q": item.question, "gold": item.gold, "prompt": prompt,
        "adv": item.advantage, "reward": _finite(t.grade.reward), "correct": t.grade.correct,
        "formatted": t.grade.formatted, "pred": t.grade.answer, "grader_error": t.grade.grader_error,
        "stop": t.stop_reason.value, "calls": t.num_code_calls, "prompt_len": t.prompt_len,
        "attempts": trajectory_stats([t]).tool_call_attempts,
        "turns": [_turn_json(turn) for turn in t.turns], "ids": list(t.tokens_T), "mask": list(t.mask_T),
        "lp": _rounded(t.logprobs_T),
        "warn": mask_warnings(t),
        "orig": None if item.original is None else {
            "correct": item.original.correct, "formatted": item.original.formatted, "pred": item.original.answer,
            "reward": _finite(item.original.reward)},
    }


def _turn_json(turn: Turn) -> dict:
    out = {"text": turn.text, "n": turn.num_tokens, "stop": turn.stop_reason.value, "call": None}
    exchange = turn.exchange
    if exchange is None:
        return out
    call = exchange.call
    if isinstance(call, ToolCall):
        out["call"] = {"kind": "valid", "code": call.code}
    else:
        out["call"] = {"kind": "invalid", "reason": call.reason, "raw": call.raw or call.message}
    out.update(response=exchange.response, latency=_finite(exchange.latency_s))
    if exchange.result is not None:
        out.update(status=exchange.result.status.value, exit_code=exchange.result.exit_code,
                   truncated=exchange.result.truncated)
    return out


def render_html(data: dict, title: str) -> str:
    """The complete HTML page for ``data`` (from :func:`page_data`)."""
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
    encoded = base64.b64encode(gzip.compress(payload, compresslevel=6, mtime=0)).decode("ascii")
    parts = {
        "__TITLE__": html.escape(title),
        "__CSS__": (ASSETS / "view.css").read_text(encoding="utf-8"),
        "__JS__": (ASSETS / "view.js").read_text(encoding="utf-8"),
        "__PAYLOAD__": encoded,
    }
    template = (ASSETS / "view.html").read_text(encoding="utf-8")
    return re.sub("|".join(parts), lambda m: parts[m.group(0)], template)


def write_view(paths: list[Path], out: Path, *, tokenizer_name: str | None = None,
               limit: int | None = None, title: str | None = None) -> Path:
    """Load trajectories from ``paths`` and write the HTML page to ``out``; returns ``out``."""
    items, sources = load_items(paths)
    if not items:
        raise ReportInputError(f"no trajectories found in {', '.join(map(str, paths))}")
    note = "token texts decoded with " + tokenizer_name if tokenizer_name else \
        "no --tokenizer given: the token view shows token ids"
    if limit is not None and len(items) > limit:
        note += f" · showing the first {limit} of {len(items)} trajectories (--limit)"
        items = items[:limit]
    tokenizer = load_tokenizer(tokenizer_name) if tokenizer_name else None
    data = page_data(items, sources, tokenizer, note)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, render_html(data, title or f"retool trajectories: {paths[0].name}"))
    return out


def _finite(value) -> float | None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _rounded(values: tuple[float, ...]) -> list[float | None]:
    """Values to 3 decimals (they only feed tooltips), non-finite ones as ``None``."""
    import numpy as np  # numpy: only writing a page needs it

    array = np.round(np.asarray(values, dtype=np.float64), 3)
    finite = np.isfinite(array)
    if finite.all():
        return array.tolist()
    return [v if ok else None for v, ok in zip(array.tolist(), finite.tolist())]


def _str_or_none(value) -> str | None:
    return None if value is None else str(value)


# ---------------------------------------------------------------- CLI


def register(subparsers) -> None:
    """Add ``retool view``."""
    parser = subparsers.add_parser(
        "view",
        description="Write one HTML file (opens offline) showing each trajectory's problem, reasoning, "
                    "code calls with interpreter output, final answer, reward, and a token view that "
                    "colours policy tokens by advantage and masked tokens grey.")
    parser.add_argument("inputs", nargs="+", type=Path, metavar="INPUT",
                        help="trajectory logs (RUN_DIR/trajectories/step_*.jsonl.gz), eval results "
                             "files, or folders holding them (a run folder works)")
    parser.add_argument("--output", "-o", type=Path,
                        help="HTML file to write (default: next to the first input, ending .html)")
    refuse_renamed(parser, "--out", "--output")
    parser.add_argument("--tokenizer", metavar="NAME_OR_PATH",
                        help="decode token ids with this Hugging Face tokenizer (or bundled:smollm2); "
                             "without it the token view shows ids")
    parser.add_argument("--limit", type=int, help="show at most this many trajectories (first ones)")
    parser.add_argument("--title", help="page title")
    parser.set_defaults(func=_run)


def default_out(first_input: Path) -> Path:
    """``X.jsonl[.gz]`` → ``X.html`` beside it; a folder → ``FOLDER/view.html``."""
    if first_input.is_dir():
        return first_input / "view.html"
    name = re.sub(r"(\.jsonl)?(\.gz)?$", "", first_input.name)
    return first_input.with_name(name + ".html")


def _run(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        print("error: --limit must be at least 1", file=sys.stderr)
        return 2
    out = output_file(args.output or default_out(args.inputs[0]), "--output")
    try:
        out = write_view(args.inputs, out, tokenizer_name=args.tokenizer, limit=args.limit, title=args.title)
    except ReportInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(out)
    return 0
