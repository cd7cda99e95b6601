"""``retool eval``: a dataset × a model (base or checkpoint) × a mode × ``val_n`` samples.

One eval, top to bottom (:func:`evaluate`):

    problems (bundled AIME 2025 by default) → open the results file (resume: keep the
    problems already done) → load the model → per problem: rollout.group(problem,
    val_n) with the same rollout, grader and answer window as training → append the
    problem's line → summary line (Average@k, Pass@k, unbiased pass@k', Format, …)

Modes: ``retool`` declares the ``code_interpreter`` tool and runs calls in the sandbox;
``text`` uses the text-only prompt and never runs code. Both grade with
:func:`retool.reward.agrade` (last ``\\boxed{}`` in the last 300 characters).

The results file (``docs/formats.md``) is a header line, one line per finished problem
(every sample's full trajectory: text, code calls, tool outputs, statuses, grade) and a
summary line. Lines are appended, flushed and fsynced as each problem finishes.

Resume: re-running the same command reads the file back, refuses it if its header was
written with other settings (model, checkpoint, dataset contents, mode, ``val_n``,
sampling, budgets, seed, …; ``--overwrite`` starts afresh), drops a torn last line and
the old summary, and samples only the problems that are missing — a finished problem
is never sampled twice.

Reproducibility: with ``seeded`` (the default) every sampler request gets a seed
derived from (seed, problem id, the request's context tokens, how often that context
was asked before), so a problem's samples depend on nothing else — not on
concurrency, timing, order or an interruption — and a killed-and-resumed eval ends
with the summary an uninterrupted one writes. The local engine draws every row with
its own seeded generator, so seeded requests of different problems still share one
batched ``generate`` call. ``--no-seeded`` leaves seeding to the engine's stream; the
samples then depend on how requests happened to meet.

Not covered: engines other than the local one (``retool.engines.local``), sharding one
eval over several machines, comparing checkpoints (``retool plot checkpoints``), and
re-grading a finished file with another grader.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retool.config import ConfigError, add_config_args, config_from_args, option, require
from retool.runs import resolve_checkpoint

DEFAULT_MODEL = "Qwen/Qwen3.5-4B"
MODES = ("retool", "text")
MATCHED_HEADER_KEYS = ("model", "checkpoint", "step", "dataset_fingerprint", "mode", "val_n", "seed", "seeded",
                       "chat_template", "dtype", "sampling", "sandbox")
"""Header fields that must be equal for a run to resume (append to) an existing file."""


@dataclass
class EvalConfig:
    """Every knob of ``retool eval``; defaults are the seed's evaluation (SPEC §3)."""

    # ---- what to evaluate
    dataset: str = option("aime25", "aime25, aime24, math500, or a question/answer JSONL (or parquet) file")
    question_field: str | None = option(None, "question field of a dataset file (default: the set's own)")
    answer_field: str | None = option(None, "answer field of a dataset file (default: the set's own)")
    id_field: str | None = option(None, "problem id field of a dataset file (default: 'id' if present)")
    limit: int | None = option(None, "evaluate only the first N problems")
    mode: str = option("retool", "retool = tool on, text = tool off (same grader and answer window)",
                       choices=MODES)

    # ---- which weights
    model: str | None = option(None, f"HF model id, local folder or bundled:smollm2 "
                                     f"(default: the checkpoint's model, else {DEFAULT_MODEL})")
    checkpoint: str | None = option(None, "a training run folder (its newest checkpoint) or one "
                                          "checkpoints/step_N folder; none = the base model")
    chat_template: str | None = option(None, "chat-template override: 'hermes', a .jinja file or Jinja source "
                                             "(default: the checkpoint's run setting, else the tokenizer's)")
    label: str | None = option(None, "name of this model in reports (default: 'base' or 'step N')")
    device: str = option("auto", "auto, cpu, cuda or cuda:N")
    dtype: str = option("auto", "auto (fp32 on CPU, bf16 on GPU), float32 or bfloat16")

    # ---- sampling and budgets
    val_n: int = option(12, "samples per problem (the k of Average@k and Pass@k)")
    temperature: float = option(1.0, "sampling temperature (0 = greedy)")
    top_p: float = option(0.7, "nucleus sampling")
    top_k: int = option(0, "top-k sampling; 0 = off")
    max_code_calls: int = option(4, "code executions per trajectory")
    max_assistant_turns: int = option(6, "assistant turns per trajectory")
    max_trajectory_tokens: int = option(8192, "tokens per trajectory, prompt included")
    max_turn_tokens: int = option(1024, "tokens per assistant turn")
    max_tool_response_tokens: int = option(512, "tokens per tool response (head+tail kept)")
    seed: int = option(42, "seed of every problem's sampling")
    seeded: bool = option(True, "seed every request from (seed, problem, context): results independent of "
                                "batching and resume; --no-seeded uses the engine's stream (not reproducible)")

    # ---- sandbox (retool mode)
    sandbox_workers: int = option(8, "concurrent sandbox executions")
    sandbox_timeout_s: float = option(30.0, "wall-clock limit of one code execution")
    sandbox_memory_mb: int = option(2048, "address-space limit of one code execution")

    # ---- running and output
    concurrency: int = option(4, "problems rolled out at the same time")
    output: str | None = option(None, "results file (.jsonl); default: OUTPUT_DIR/<dataset>-<mode>-<model>.jsonl")
    output_dir: str = option("results", "folder of the default results file")
    overwrite: bool = option(False, "discard an existing results file instead of resuming it")

    def validate(self) -> None:
        for name in ("val_n", "max_assistant_turns", "max_trajectory_tokens", "max_turn_tokens",
                     "max_tool_response_tokens", "sandbox_workers", "sandbox_memory_mb", "concurrency"):
            require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        require(self.max_code_calls >= 0, f"max_code_calls must be >= 0, got {self.max_code_calls}")
        require(self.limit is None or self.limit >= 1, f"limit must be >= 1, got {self.limit}")
        require(self.temperature >= 0 and 0 < self.top_p <= 1 and self.top_k >= 0,
                "need temperature >= 0, top_p in (0, 1] and top_k >= 0")
        require(self.sandbox_timeout_s > 0, "sandbox_timeout_s must be > 0")
        require(self.output is None or self.output.endswith(".jsonl"),
                f"output must be a .jsonl file (appended line by line), got {self.output}")


class EvalError(RuntimeError):
    """An eval could not go on (sampler failure, unusable results file); finished problems are kept."""


# ---------------------------------------------------------------- model choice


@dataclass(frozen=True)
class ModelChoice:
    """Which weights an eval samples with, resolved from ``--model``/``--checkpoint``."""

    model: str
    checkpoint: str | None = None
    """The checkpoint folder (absolute), or ``None`` for the base model."""
    engine_dir: str | None = None
    """The folder ``save_state`` wrote (``engine.json`` + adapter or weights)."""
    step: int | None = None
    label: str = "base"
    chat_template: str | None = None
    run_name: str | None = None
    engine_settings: dict = dataclasses.field(default_factory=dict)
    """The checkpoint engine's saved settings (adapter shape) from its ``engine.json``."""


def choose_model(cfg: EvalConfig) -> ModelChoice:
    """Resolve the model, checkpoint, step, label and chat template of an eval.

    A checkpoint brings its model and its run's chat template unless ``--model`` or
    ``--chat-template`` say otherwise.
    """
    if cfg.checkpoint is None:
        return ModelChoice(model=cfg.model or DEFAULT_MODEL, label=cfg.label or "base",
                           chat_template=cfg.chat_template)
    found = resolve_checkpoint(cfg.checkpoint).resolved()
    checkpoint, engine_dir, step, run = found.folder, found.engine_dir, found.step, found.run_dir
    meta = json.loads((engine_dir / "engine.json").read_text())
    settings = meta.get("config") or {}
    run_config = json.loads((run / "config.json").read_text()) if run and (run / "config.json").is_file() else {}
    saved_model = settings.get("model") or meta.get("model") or run_config.get("model")
    if cfg.model and saved_model and cfg.model != saved_model:
        print(f"warning: checkpoint {checkpoint} was trained from {saved_model!r}; loading it onto "
              f"{cfg.model!r} as asked", file=sys.stderr)
    model = cfg.model or saved_model
    if not model:
        raise ConfigError(f"checkpoint {checkpoint}: its engine.json names no model; pass --model")
    label = cfg.label or (f"step {step}" if step is not None else checkpoint.name)
    return ModelChoice(model=model, checkpoint=str(checkpoint), engine_dir=str(engine_dir), step=step, label=label,
                       chat_template=cfg.chat_template or run_config.get("chat_template"),
                       run_name=run.name if run else None, engine_settings=settings)


@dataclass
class EvalModel:
    """What an eval samples with: a tokenizer and a sampling client (any engine)."""

    tokenizer: Any
    sampler: Any
    choice: ModelChoice


_ADAPTER_KEYS = ("full_finetune", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "trust_remote_code")


def load_eval_model(cfg: EvalConfig, choice: ModelChoice) -> EvalModel:
    """Load the chosen weights into the local engine and return its sampler.

    The base model is loaded without an adapter (``full_finetune=True`` only means "no
    LoRA wrapper" here: nothing is trained); a checkpoint is loaded with the adapter
    shape it was saved with.
    """
    from retool.engines.local import LocalEngineConfig, LocalTrainingClient

    if choice.engine_dir is None:
        adapter: dict[str, Any] = {"full_finetune": True}
    else:
        adapter = {k: choice.engine_settings[k] for k in _ADAPTER_KEYS if k in choice.engine_settings}
        if isinstance(adapter.get("lora_targets"), list):
            adapter["lora_targets"] = tuple(adapter["lora_targets"])
    engine = LocalTrainingClient(LocalEngineConfig(model=choice.model, device=cfg.device, dtype=cfg.dtype,
                                                   seed=cfg.seed, init_from=choice.engine_dir, **adapter))
    return EvalModel(engine.get_tokenizer(), engine.save_weights_for_sampler(), choice)


# ---------------------------------------------------------------- seeding


def _digest(*parts: bytes) -> int:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little") + part)
    return int.from_bytes(h.digest()[:8], "little") >> 1


def problem_seed(seed: int, problem_id: str) -> int:
    """A 63-bit seed for one problem, stable across processes and machines."""
    return _digest(str(seed).encode(), problem_id.encode())


class ProblemSampler:
    """Wraps a sampling client for one problem: seeds its requests and counts them.

    With ``seed`` set, a request gets ``hash(seed, context tokens, occurrence)`` as its
    ``SamplingParams.seed``, where occurrence counts earlier requests with the same
    context (two trajectories that reached the same state still draw independently).
    With ``seed=None`` requests pass through unchanged. ``requests``, ``sequences`` and
    ``tokens`` count what was asked and returned.
    """

    def __init__(self, inner: Any, seed: int | None) -> None:
        self.inner, self.seed = inner, seed
        self.requests = self.sequences = self.tokens = 0
        self._seen: Counter = Counter()

    async def sample(self, prompt_tokens: Sequence[int], num_samples: int, sampling_params: Any) -> Any:
        params = sampling_params
        if self.seed is not None:
            context = hashlib.sha256(",".join(map(str, prompt_tokens)).encode()).digest()
            occurrence = self._seen[context]
            self._seen[context] += 1
            request_seed = _digest(str(self.seed).encode(), context, str(occurrence).encode())
            params = dataclasses.replace(sampling_params, seed=request_seed)
        self.requests += 1
        result = await self.inner.sample(prompt_tokens, num_samples, params)
        self.sequences += len(result.sequences)
        self.tokens += sum(len(s.tokens) for s in result.sequences)
        return result


# ---------------------------------------------------------------- dataset and header


@dataclass(frozen=True)
class Dataset:
    """The problems of an eval and how to recognise the same set again."""

    name: str
    path: str
    fingerprint: str
    """sha256 of every problem's id, question and answer, in file order."""
    problems: tuple
    """The problems evaluated (after ``limit``)."""
    total: int
    """Problems in the whole set."""


def load_dataset(cfg: EvalConfig) -> Dataset:
    """Read the eval's problems; a bad row or a duplicate id raises ``DataError``."""
    from retool.data import BUNDLED, read_problems

    result = read_problems(cfg.dataset, question_field=cfg.question_field, answer_field=cfg.answer_field,
                           id_field=cfg.id_field)
    h = hashlib.sha256()
    for p in result.problems:
        h.update(json.dumps([p.id, p.question, p.answer]).encode() + b"\n")
    name = cfg.dataset if cfg.dataset in BUNDLED else Path(cfg.dataset).stem
    problems = result.problems[: cfg.limit] if cfg.limit else result.problems
    return Dataset(name, str(result.path), h.hexdigest(), tuple(problems), len(result.problems))


def build_header(cfg: EvalConfig, choice: ModelChoice, dataset: Dataset) -> dict:
    """The first line of a results file (docs/formats.md): what was evaluated, and how."""
    from retool import __version__

    tools = cfg.mode == "retool"
    return {
        "type": "header", "model": choice.model, "checkpoint": choice.checkpoint, "step": choice.step,
        "label": choice.label, "dataset": dataset.name, "dataset_path": dataset.path,
        "dataset_fingerprint": dataset.fingerprint, "dataset_problems": dataset.total,
        "mode": cfg.mode, "val_n": cfg.val_n, "seed": cfg.seed, "seeded": cfg.seeded,
        "chat_template": choice.chat_template, "dtype": cfg.dtype,
        "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
                     "max_trajectory_tokens": cfg.max_trajectory_tokens, "max_turn_tokens": cfg.max_turn_tokens,
                     "max_assistant_turns": cfg.max_assistant_turns,
                     "max_code_calls": cfg.max_code_calls if tools else 0,
                     "max_tool_response_tokens": cfg.max_tool_response_tokens},
        "sandbox": {"timeout_s": cfg.sandbox_timeout_s, "memory_mb": cfg.sandbox_memory_mb} if tools else None,
        "retool_version": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def default_output(cfg: EvalConfig, choice: ModelChoice, dataset: Dataset) -> Path:
    """``OUTPUT_DIR/<dataset>-<mode>-<model or run>-<base|stepN>.jsonl``."""
    if cfg.output:
        return Path(cfg.output)
    if choice.checkpoint is None:
        who = f"{_slug(choice.model.removeprefix('bundled:').rstrip('/').split('/')[-1])}-base"
    else:
        step = f"step{choice.step}" if choice.step is not None else Path(choice.checkpoint).name
        who = f"{_slug(choice.run_name or Path(choice.checkpoint).parent.name)}-{_slug(step)}"
    return Path(cfg.output_dir) / f"{_slug(dataset.name)}-{cfg.mode}-{who}.jsonl"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "model"


# ---------------------------------------------------------------- the results file


@dataclass
class _Done:
    """What the summary and the progress bar need from one finished problem."""

    index: int
    problem_id: str
    samples: list
    """Trajectories with their per-token arrays reduced to their lengths (see :func:`_summary_view`)."""
    num_correct: int


def _summary_view(sample: dict) -> Any:
    """A trajectory as :func:`retool.stats.summarize` reads it, without the big arrays.

    Summaries read only the lengths of ``tokens_T`` and the sum of ``mask_T``; holding
    every token of a large eval in memory would take gigabytes, so the view keeps
    constant tuples of the same length and sum, and no logprobs.
    """
    from retool.serialize import trajectory_from_jsonable

    n, sampled = len(sample["tokens_T"]), sum(sample["mask_T"])
    bare = trajectory_from_jsonable({**sample, "tokens_T": [], "mask_T": [], "logprobs_T": []})
    return dataclasses.replace(bare, tokens_T=(0,) * n, mask_T=(1,) * sampled + (0,) * (n - sampled))


class ResultsFile:
    """An eval results file opened for appending, with the problems it already holds.

    :meth:`open` checks an existing file's header against this run's, drops a torn last
    line (a writer killed mid-line) and an old summary line, and remembers the finished
    problems; :meth:`append` adds one problem line durably; :meth:`finish` appends the
    summary of every problem in the file.
    """

    def __init__(self, path: Path, header: dict, done: dict[str, _Done], *, fresh: bool, keep: int) -> None:
        self.path, self.header, self.done = path, header, done
        self._fresh, self._keep = fresh, keep
        self._prepared = False

    @classmethod
    def open(cls, path: Path, header: dict, dataset: Dataset, *, overwrite: bool) -> "ResultsFile":
        """Read and check an existing file (nothing is written until :meth:`prepare`)."""
        path = Path(path)
        existing = path.read_bytes() if path.exists() and not overwrite else b""
        old_header, rows, keep = _parse_results(path, existing)
        if old_header is None:
            return cls(path, header, {}, fresh=True, keep=0)
        _check_header(path, old_header, header)
        return cls(path, old_header, _done_problems(path, rows, dataset, header["val_n"]), fresh=False, keep=keep)

    def prepare(self) -> None:
        """Start a new file with its header, or cut an old one after its last problem line."""
        if self._prepared:
            return
        if self._fresh:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _write_line(self.path, self.header, mode="wb")
        elif self.path.stat().st_size != self._keep:
            os.truncate(self.path, self._keep)
        self._prepared = True

    def append(self, index: int, row: dict) -> None:
        """Write one problem line (flushed and fsynced) and remember the problem."""
        _write_line(self.path, row)
        self.done[row["problem_id"]] = _Done(index, row["problem_id"], [_summary_view(s) for s in row["samples"]],
                                             row["num_correct"])

    def summary(self) -> dict:
        """The summary of every problem in the file, in dataset order."""
        from retool.stats import summarize

        done = sorted(self.done.values(), key=lambda d: d.index)
        return {"type": "summary", **summarize({"samples": d.samples} for d in done)}

    def finish(self) -> dict:
        """Append the summary line and return it."""
        self.prepare()
        summary = self.summary()
        _write_line(self.path, summary)
        return summary

    def running_average(self) -> float:
        done = list(self.done.values())
        return sum(d.num_correct / len(d.samples) for d in done) / len(done) if done else 0.0


def _write_line(path: Path, row: dict, mode: str = "ab") -> None:
    """Append (or, with ``mode="wb"``, start the file with) one line, flushed and fsynced."""
    with open(path, mode) as f:
        f.write((json.dumps(row) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def _parse_results(path: Path, data: bytes) -> tuple[dict | None, list[tuple[int, dict]], int]:
    """``(header, [(line number, problem row)], bytes to keep)`` of an existing file.

    A last line without its newline is torn and not kept; nor is a trailing summary.
    Anything else that is not a header, problem or summary line raises :class:`EvalError`.
    """
    lines = data.split(b"\n")
    complete = lines[:-1]  # the last piece is b"" when the file ends with a newline
    if lines[-1]:
        print(f"note: {path}: dropped a torn last line (a run killed mid-write); that problem is re-done",
              file=sys.stderr)
    header, rows, keep, offset = None, [], 0, 0
    for lineno, raw in enumerate(complete, start=1):
        offset += len(raw) + 1
        row = _json_line(path, lineno, raw)
        kind = row.get("type")
        if lineno == 1 and kind != "header":
            raise EvalError(f"{path} is not an eval results file (its first line is not a header); "
                            "choose another --output")
        if kind == "summary":
            if lineno != len(complete):
                raise EvalError(f"{path}:{lineno}: a summary line before the end of the file")
            continue
        if lineno > 1 and kind != "problem":
            raise EvalError(f"{path}:{lineno}: unexpected line type {kind!r}")
        if kind == "header":
            header = row
        else:
            rows.append((lineno, row))
        keep = offset
    return header, rows, keep


def _json_line(path: Path, lineno: int, raw: bytes) -> dict:
    try:
        row = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise EvalError(f"{path}:{lineno}: not valid JSON ({err}); the file is damaged — "
                        "fix or remove that line, or pass --overwrite") from None
    if not isinstance(row, dict):
        raise EvalError(f"{path}:{lineno}: expected a JSON object")
    return row


def _check_header(path: Path, old: dict, new: dict) -> None:
    old_flat, new_flat = _flatten({k: old.get(k) for k in MATCHED_HEADER_KEYS}), _flatten(
        {k: new[k] for k in MATCHED_HEADER_KEYS})
    missing = "(not set)"
    diffs = [f"{k}: file has {old_flat.get(k, missing)!r}, this run has {new_flat.get(k, missing)!r}"
             for k in sorted(old_flat.keys() | new_flat.keys()) if old_flat.get(k, missing) != new_flat.get(k, missing)]
    if diffs:
        raise ConfigError(f"{path} holds an eval with other settings, so it cannot be resumed:\n  "
                          + "\n  ".join(diffs) + "\nPass --output NEW.jsonl for a separate file, "
                          "or --overwrite to discard this one.")


def _flatten(d: dict, prefix: str = "") -> dict:
    """``{"sampling": {"top_p": 0.7}}`` → ``{"sampling.top_p": 0.7}`` (for readable differences)."""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _done_problems(path: Path, rows: list[tuple[int, dict]], dataset: Dataset, val_n: int) -> dict[str, _Done]:
    index_of = {p.id: i for i, p in enumerate(dataset.problems)}
    done: dict[str, _Done] = {}
    for lineno, row in rows:
        pid = row.get("problem_id")
        samples = row.get("samples")
        if pid in done:
            raise EvalError(f"{path}:{lineno}: problem {pid!r} appears twice")
        if not isinstance(samples, list) or len(samples) != val_n:
            raise EvalError(f"{path}:{lineno}: problem {pid!r} has "
                            f"{len(samples) if isinstance(samples, list) else 'no'} samples, expected {val_n}")
        index = index_of.get(pid, row.get("index", len(index_of)))  # beyond --limit: keep the file's order
        done[pid] = _Done(index, pid, [_summary_view(s) for s in samples], int(row["num_correct"]))
    return done


# ---------------------------------------------------------------- running


@dataclass(frozen=True)
class EvalReport:
    """What one ``evaluate`` call did."""

    path: Path
    header: dict
    summary: dict
    sampled_problems: int
    """Problems sampled by this call (0 when the file was already complete)."""
    resumed_problems: int
    """Problems found finished in the file and not sampled again."""
    sampler_requests: int
    sampled_sequences: int
    sampled_tokens: int
    seconds: float


def evaluate(cfg: EvalConfig, model: EvalModel | None = None) -> EvalReport:
    """Run (or resume) one eval as configured; return where it wrote and its summary.

    ``model`` supplies the tokenizer and sampler (any engine, or a scripted sampler in
    tests); by default the local engine loads the weights ``cfg`` chooses — only when
    some problem still needs sampling.
    """
    t0 = time.monotonic()
    dataset = load_dataset(cfg)
    choice = model.choice if model is not None else choose_model(cfg)
    header = build_header(cfg, choice, dataset)
    results = ResultsFile.open(default_output(cfg, choice, dataset), header, dataset, overwrite=cfg.overwrite)
    pending = [(i, p) for i, p in enumerate(dataset.problems) if p.id not in results.done]
    resumed = len(dataset.problems) - len(pending)
    if resumed:
        print(f"resuming {results.path}: {resumed} of {len(dataset.problems)} problems already done",
              file=sys.stderr)
    counts = Counter()
    if pending:
        _check_gold_answers(dataset.path, [p for _, p in pending])
        model = model or load_eval_model(cfg, choice)
        counts = asyncio.run(_sample_pending(cfg, model, pending, results))
    summary = results.finish()
    return EvalReport(results.path, results.header, summary, len(pending), resumed, counts["requests"],
                      counts["sequences"], counts["tokens"], time.monotonic() - t0)


def _check_gold_answers(dataset_path: str, problems: list) -> None:
    """Refuse, before any sampling, gold answers the grader cannot parse (a data bug)."""
    from retool.data import DataError
    from retool.reward import check_golds

    bad = [(p, err) for p, err in zip(problems, check_golds([p.answer for p in problems])) if err is not None]
    if bad:
        listed = "; ".join(f"{p.id}: {err}" for p, err in bad[:5])
        raise DataError(dataset_path, f"{len(bad)} gold answer(s) the grader cannot use ({listed})")


async def _sample_pending(cfg: EvalConfig, model: EvalModel, pending: list, results: ResultsFile) -> Counter:
    """Roll out every pending problem, ``concurrency`` at a time; append each as it finishes."""
    from retool.log import StepProgress

    renderer, rollout_config, sandbox = _rollout_parts(cfg, model)
    semaphore, counts = asyncio.Semaphore(cfg.concurrency), Counter()

    async def one(index: int, problem: Any) -> None:
        async with semaphore:
            row, sampler = await _sample_problem(cfg, model, renderer, rollout_config, sandbox, index, problem)
        results.append(index, row)
        counts.update(requests=sampler.requests, sequences=sampler.sequences, tokens=sampler.tokens)
        progress.update(len(results.done), average=results.running_average(),
                        tok_s=counts["tokens"] / max(time.monotonic() - t0, 1e-9))

    t0 = time.monotonic()
    try:
        results.prepare()  # only now that the model, the template and the sandbox work
        total = len(results.done) + len(pending)
        with StepProgress(total, start=len(results.done), description="eval") as progress:
            tasks = [asyncio.create_task(one(i, p)) for i, p in pending]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
    finally:
        if sandbox is not None:
            sandbox.close()
    return counts


def _rollout_parts(cfg: EvalConfig, model: EvalModel) -> tuple[Any, Any, Any]:
    """The renderer, rollout budgets and (retool mode) sandbox every problem shares."""
    from retool.render import Renderer
    from retool.rollout import RolloutConfig

    tools = cfg.mode == "retool"
    renderer = Renderer(model.tokenizer, chat_template=model.choice.chat_template, tools=tools,
                        model_name=model.choice.model)
    rollout_config = RolloutConfig(
        max_code_calls=cfg.max_code_calls, max_assistant_turns=cfg.max_assistant_turns,
        max_trajectory_tokens=cfg.max_trajectory_tokens, max_turn_tokens=cfg.max_turn_tokens,
        max_tool_response_tokens=cfg.max_tool_response_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
        top_k=cfg.top_k, sandbox_timeout_s=cfg.sandbox_timeout_s)
    sandbox = None
    if tools:
        from retool.sandbox import Sandbox, SandboxConfig

        sandbox = Sandbox(SandboxConfig(timeout_s=cfg.sandbox_timeout_s, memory_mb=cfg.sandbox_memory_mb,
                                        workers=cfg.sandbox_workers))
    return renderer, rollout_config, sandbox


async def _sample_problem(cfg: EvalConfig, model: EvalModel, renderer: Any, rollout_config: Any, sandbox: Any,
                          index: int, problem: Any) -> tuple[dict, ProblemSampler]:
    """``val_n`` trajectories of one problem and its results line."""
    from retool.reward import agrade
    from retool.rollout import Rollout, RolloutError
    from retool.serialize import to_jsonable

    seed = problem_seed(cfg.seed, problem.id)
    sampler = ProblemSampler(model.sampler, seed if cfg.seeded else None)
    rollout = Rollout(renderer, sampler, sandbox, agrade, rollout_config)
    start = time.monotonic()
    try:
        trajectories = await rollout.group(problem, cfg.val_n)
    except RolloutError as err:
        raise EvalError(str(err)) from err
    row = {"type": "problem", "index": index, "problem_id": problem.id, "question": problem.question,
           "answer": problem.answer, "seed": seed, "samples": to_jsonable(trajectories),
           "num_correct": sum(t.grade.correct for t in trajectories),
           "num_formatted": sum(t.grade.formatted for t in trajectories),
           "sampler_requests": sampler.requests, "time_s": round(time.monotonic() - start, 3)}
    return row, sampler


# ---------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval", help="evaluate a base model or checkpoint: Average@k, Pass@k, Format (resumable)",
        description="Evaluate a dataset x a model (base or checkpoint) x a mode (retool = tool on, text = "
        "tool off) x val_n samples: Average@k, Pass@k, unbiased pass@k, Format, code calls, turns. Writes one "
        "JSONL results file (docs/formats.md) and resumes it when re-run with the same settings. Every "
        "default is the seed's evaluation setting (AIME 2025, 12 samples, temperature 1.0, top_p 0.7, "
        "8,192-token budget, tool mode).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_args(p, EvalConfig)
    p.set_defaults(func=_run_eval_command)


def _run_eval_command(args: argparse.Namespace) -> int:
    from retool.data import DataError
    from retool.protocol import TemplateError
    from retool.sandbox import SandboxUnavailableError

    try:
        report = evaluate(config_from_args(EvalConfig, args))
    except (ConfigError, DataError, TemplateError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (EvalError, SandboxUnavailableError) as err:
        print(f"error: {err}\nFinished problems are kept; re-run the same command to resume.", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: finished problems are kept; re-run the same command to resume.", file=sys.stderr)
        return 130
    print(format_summary(report))
    return 0


def format_summary(report: EvalReport) -> str:
    """A short human-readable account of an eval's summary and of this call's work."""
    s, h = report.summary, report.header
    k = s["k"]
    unbiased = "  ".join(f"pass@{j} {100 * v:.2f}%" for j, v in s["pass@k_unbiased"].items())
    return "\n".join([
        f"{h['label']} on {h['dataset']} ({h['mode']} mode), {s['num_problems']} problems × {k} samples",
        f"  Average@{k} {100 * s['average@k']:.2f}% ± {100 * s['average@k_stderr']:.2f}  "
        f"Pass@{k} {100 * s['pass@k']:.2f}%  Format {100 * s['format']:.2f}%",
        f"  unbiased  {unbiased}",
        f"  code calls {s['code_calls']:.2f}  turns {s['turns']:.2f}  tokens {s['tokens']:.0f}  "
        f"correct {s['num_correct']}/{s['num_samples']}  solved {s['num_solved']}/{s['num_problems']}",
        f"  this run: sampled {report.sampled_problems} problems ({report.sampler_requests} sampler requests, "
        f"{report.sampled_tokens} tokens), {report.resumed_problems} already done, {report.seconds:.1f} s",
        f"  results: {report.path}",
    ])
