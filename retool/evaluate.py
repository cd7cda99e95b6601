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
summary line. Lines are appended, flushed and fsynced as each problem finishes
(records, reader and appender: :mod:`retool.results`).

Resume: re-running the same command reads the file back, refuses it if its header was
written with other settings (model, checkpoint, dataset contents, mode, ``val_n``,
sampling, budgets, seed, …; ``--overwrite`` starts afresh), drops a torn last line and
the old summary, and samples only the problems that are missing — a finished problem
is never sampled twice.

Reproducibility: with ``seeded`` (the default) every sampler request gets a seed
derived from (seed, problem id, the request's place: the group fork, or trajectory *i*'s
turn *t*) — :meth:`retool.rollout.Rollout.group`'s scheme, the one ``retool train``
uses, recorded in the header as ``seeding: position`` — so a problem's samples depend
on nothing else — not on concurrency, timing, order or an interruption — and a
killed-and-resumed eval ends with the summary an uninterrupted one writes. A file
written before (no ``seeding`` in its header) was seeded from each request's context
tokens and how often that context was asked (:class:`ProblemSampler`); it resumes
under that scheme, so its resume stays exact too. The local engine draws every row with
its own seeded generator, so seeded requests of different problems still share one
batched ``generate`` call. ``--no-seeded`` leaves seeding to the engine's stream; the
samples then depend on how requests happened to meet.

The sampler comes from ``--engine`` (``retool.engines``), built as a sampler only.

Not covered: sharding one eval over several machines, comparing checkpoints (``retool plot checkpoints``), and
re-grading a finished file with another grader.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retool import __version__
from retool.config import ConfigError, add_config_args, config_from_args, option, require
from retool.cost import PriceTableOption, cost_meter
from retool.data import BUNDLED, DataError, problems_fingerprint, read_problems, require_usable_golds
from retool.engines import (
    DEFAULT_MODEL,
    EngineCheckpoint,
    EngineChoice,
    EngineSampler,
    Requirements,
    SamplerRequest,
    check_supported,
    load_sampler,
    reads_checkpoint,
)
from retool.flag_checks import output_file, output_folder
from retool.log import StepProgress
from retool.protocol import TemplateError
from retool.render import Renderer
from retool.results import (
    EvalSummary,
    ProblemResult,
    ResultsFile,
    ResultsFileError,
    ResultsHeader,
    SamplingSettings,
    SandboxSettings,
)
from retool.reward import agrade
from retool.rollout import Rollout, RolloutBudgets, RolloutError
from retool.runs import resolve_checkpoint
from retool.sandbox import SandboxUnavailableError
from retool.seeding import context_digest, derive_seed
from retool.types import TokenUsage

MODES = ("retool", "text")
SEEDING = "position"
"""How a new seeded eval seeds its requests: :meth:`retool.rollout.Rollout.group`'s scheme,
the one ``retool train`` uses (the header records it; older files resume under theirs)."""


@dataclass
class EvalConfig(PriceTableOption, RolloutBudgets, EngineChoice):
    """Every knob of ``retool eval``; defaults are the seed's evaluation (AIME 2025, 12
    samples a problem, temperature 1.0, top_p 0.7, 8,192-token trajectories, tool on).

    The engine fields come from :class:`retool.engines.EngineChoice` (an eval builds a
    sampler only), the rollout and sandbox budgets from
    :class:`retool.rollout.RolloutBudgets` (shared with ``retool train``); ``--price-table``
    prices this call's tokens and sandbox CPU (:mod:`retool.cost`).
    """

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
    seed: int = option(42, "seed of every problem's sampling")
    seeded: bool = option(True, "seed every request from (seed, problem, its place in the group): results "
                                "independent of batching and resume; --no-seeded uses the engine's stream "
                                "(not reproducible)")

    # ---- running and output
    concurrency: int = option(4, "problems rolled out at the same time")
    output: str | None = option(None, "results file (.jsonl); default: OUTPUT_DIR/<dataset>-<mode>-<model>.jsonl")
    output_dir: str = option("results", "folder of the default results file")
    overwrite: bool = option(False, "discard an existing results file instead of resuming it")

    def validate(self) -> None:
        for name in ("val_n", "concurrency"):
            require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        self.validate_engine()
        self.validate_budgets()
        require(self.limit is None or self.limit >= 1, f"limit must be >= 1, got {self.limit}")
        require(self.temperature >= 0 and 0 < self.top_p <= 1 and self.top_k >= 0,
                "need temperature >= 0, top_p in (0, 1] and top_k >= 0")
        check_supported(self.engine, Requirements(training=False))
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
    engine_checkpoint: EngineCheckpoint | None = None
    """What the checkpoint's ``engine.json`` records (engine, model, adapter shape)."""


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
    record = EngineCheckpoint.read(engine_dir)
    run_config = json.loads((run / "config.json").read_text()) if run and (run / "config.json").is_file() else {}
    saved_model = record.model or run_config.get("model")
    if cfg.model and saved_model and cfg.model != saved_model:
        print(f"warning: checkpoint {checkpoint} was trained from {saved_model!r}; loading it onto "
              f"{cfg.model!r} as asked", file=sys.stderr)
    model = cfg.model or saved_model
    if not model:
        raise ConfigError(f"checkpoint {checkpoint}: its engine.json names no model; pass --model")
    label = cfg.label or (f"step {step}" if step is not None else checkpoint.name)
    return ModelChoice(model=model, checkpoint=str(checkpoint), engine_dir=str(engine_dir), step=step, label=label,
                       chat_template=cfg.chat_template or run_config.get("chat_template"),
                       run_name=run.name if run else None, engine_checkpoint=record)


@dataclass
class EvalModel:
    """What an eval samples with: a tokenizer and a sampling client (any engine)."""

    tokenizer: Any
    sampler: Any
    choice: ModelChoice
    close: Callable[[], None] = lambda: None
    """Releases what the engine holds (e.g. a sampling server it started)."""


def load_eval_model(cfg: EvalConfig, choice: ModelChoice) -> EvalModel:
    """Load a sampler (no training state) for the chosen weights on ``cfg``'s engine.

    The base model is loaded as it is; a checkpoint in the adapter shape it was saved with.
    """
    if choice.engine_checkpoint is not None and not reads_checkpoint(cfg.engine, choice.engine_checkpoint.engine):
        raise ConfigError(f"checkpoint {choice.checkpoint} was written by the {choice.engine_checkpoint.engine} "
                          f"engine; evaluate it with --engine {choice.engine_checkpoint.engine}")
    loaded: EngineSampler = load_sampler(cfg.engine, SamplerRequest(
        model=choice.model, checkpoint=choice.engine_checkpoint, checkpoint_dir=choice.engine_dir,
        device=cfg.device, dtype=cfg.dtype, seed=cfg.seed, settings=cfg.engine_settings()))
    return EvalModel(loaded.tokenizer, loaded.sampler, choice, loaded.close)


# ---------------------------------------------------------------- seeding


def problem_seed(seed: int, problem_id: str) -> int:
    """A 63-bit seed for one problem, stable across processes and machines."""
    return derive_seed(str(seed).encode(), problem_id.encode())


class ProblemSampler:
    """Wraps a sampling client for one problem: seeds its requests and counts them.

    With ``seed`` set, a request gets ``hash(seed, context tokens, occurrence)`` as its
    ``SamplingParams.seed``, where occurrence counts earlier requests with the same
    context (two trajectories that reached the same state still draw independently).
    With ``seed=None`` requests pass through unchanged. ``requests``, ``sequences`` and
    ``usage`` (a :class:`~retool.types.TokenUsage`: prompt tokens sent, tokens sampled)
    count what was asked and returned.
    """

    def __init__(self, inner: Any, seed: int | None) -> None:
        self.inner, self.seed = inner, seed
        self.requests = self.sequences = 0
        self.usage = TokenUsage()
        self._seen: Counter = Counter()

    async def sample(self, prompt_tokens: Sequence[int], num_samples: int, sampling_params: Any) -> Any:
        params = sampling_params
        if self.seed is not None:
            context = context_digest(prompt_tokens)
            occurrence = self._seen[context]
            self._seen[context] += 1
            request_seed = derive_seed(str(self.seed).encode(), context, str(occurrence).encode())
            params = dataclasses.replace(sampling_params, seed=request_seed)
        self.requests += 1
        result = await self.inner.sample(prompt_tokens, num_samples, params)
        self.sequences += len(result.sequences)
        self.usage += TokenUsage(prefill=len(prompt_tokens), sampled=sum(len(s.tokens) for s in result.sequences))
        return result


@dataclass
class EvalCounts:
    """What the problems sampled by one call asked of the sampler, added up."""

    requests: int = 0
    sequences: int = 0
    usage: TokenUsage = TokenUsage()

    def add(self, sampler: ProblemSampler) -> None:
        self.requests += sampler.requests
        self.sequences += sampler.sequences
        self.usage += sampler.usage


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
    result = read_problems(cfg.dataset, question_field=cfg.question_field, answer_field=cfg.answer_field,
                           id_field=cfg.id_field)
    name = cfg.dataset if cfg.dataset in BUNDLED else Path(cfg.dataset).stem
    problems = result.problems[: cfg.limit] if cfg.limit else result.problems
    return Dataset(name, str(result.path), problems_fingerprint(result.problems), tuple(problems),
                   len(result.problems))


def build_header(cfg: EvalConfig, choice: ModelChoice, dataset: Dataset) -> ResultsHeader:
    """The first line of a results file (docs/formats.md): what was evaluated, and how."""
    tools = cfg.mode == "retool"
    sampling = SamplingSettings(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                **{**cfg.budgets(), "max_code_calls": cfg.max_code_calls if tools else 0})
    return ResultsHeader(
        model=choice.model, checkpoint=choice.checkpoint, step=choice.step, label=choice.label,
        dataset=dataset.name, dataset_path=dataset.path, dataset_fingerprint=dataset.fingerprint,
        dataset_problems=dataset.total, mode=cfg.mode, val_n=cfg.val_n, seed=cfg.seed, seeded=cfg.seeded,
        seeding=SEEDING if cfg.seeded else None,
        chat_template=choice.chat_template, dtype=cfg.dtype, sampling=sampling,
        sandbox=SandboxSettings(timeout_s=cfg.sandbox_timeout_s, memory_mb=cfg.sandbox_memory_mb,
                                interpreter=None if cfg.interpreter == "stateless" else cfg.interpreter)
        if tools else None,
        retool_version=__version__, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), engine=cfg.engine)


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


# ---------------------------------------------------------------- running


@dataclass(frozen=True)
class EvalReport:
    """What one ``evaluate`` call did."""

    path: Path
    header: ResultsHeader
    summary: EvalSummary
    sampled_problems: int
    """Problems sampled by this call (0 when the file was already complete)."""
    resumed_problems: int
    """Problems found finished in the file and not sampled again."""
    sampler_requests: int
    sampled_sequences: int
    usage: TokenUsage
    """Tokens this call sent to the sampler (one prompt per request) and got back."""
    seconds: float
    sandbox_cpu_s: float = 0.0
    """CPU seconds this call's code calls used in the sandbox."""
    cost: float | None = None
    """USD for this call's tokens and sandbox CPU, with ``--price-table``; else ``None``."""


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
    meter = cost_meter(cfg, cfg.engine, choice.model)  # a bad price table fails before the model loads
    results = _open_results(cfg, default_output(cfg, choice, dataset), header, dataset)
    pending = [(i, p) for i, p in enumerate(dataset.problems) if p.id not in results.done]
    resumed = len(dataset.problems) - len(pending)
    if resumed:
        print(f"resuming {results.path}: {resumed} of {len(dataset.problems)} problems already done",
              file=sys.stderr)
    counts, cpu_s = EvalCounts(), 0.0
    if pending:
        require_usable_golds(dataset.path, [p for _, p in pending])
        sandbox = cfg.start_sandbox() if cfg.mode == "retool" else None  # before the model: strict refuses early
        try:
            model = model or load_eval_model(cfg, choice)
            try:
                counts = asyncio.run(_sample_pending(cfg, model, sandbox, pending, results))
            finally:
                model.close()
        finally:
            if sandbox is not None:
                cpu_s = sandbox.metrics(reset=False)["sandbox/cpu_s"]
                sandbox.close()
    summary = results.finish()
    cost = None if meter is None else meter.prices.step_cost({**counts.usage.metrics(), "sandbox/cpu_s": cpu_s})
    return EvalReport(results.path, results.header, summary, len(pending), resumed, counts.requests,
                      counts.sequences, counts.usage, time.monotonic() - t0, cpu_s, cost)


def _open_results(cfg: EvalConfig, path: Path, header: ResultsHeader, dataset: Dataset) -> ResultsFile:
    """The results file to append to; a damaged one is an :class:`EvalError`."""
    try:
        return ResultsFile.open(path, header, {p.id: i for i, p in enumerate(dataset.problems)},
                                overwrite=cfg.overwrite)
    except ResultsFileError as err:
        raise EvalError(f"{err} — fix or remove that line, choose another --output, "
                        "or pass --overwrite to discard the file") from None


async def _sample_pending(cfg: EvalConfig, model: EvalModel, sandbox: Any, pending: list,
                          results: ResultsFile) -> EvalCounts:
    """Roll out every pending problem, ``concurrency`` at a time; append each as it finishes."""
    renderer, rollout_config = _rollout_parts(cfg, model)
    semaphore, counts = asyncio.Semaphore(cfg.concurrency), EvalCounts()

    async def one(index: int, problem: Any) -> None:
        async with semaphore:
            result, sampler = await _sample_problem(cfg, model, renderer, rollout_config, sandbox, index, problem,
                                                    seeding=results.header.seeding)
        results.append(result)
        counts.add(sampler)
        progress.update(len(results.done), average=results.running_average(),
                        tok_s=counts.usage.sampled / max(time.monotonic() - t0, 1e-9))

    t0 = time.monotonic()
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
    return counts


def _rollout_parts(cfg: EvalConfig, model: EvalModel) -> tuple[Any, Any]:
    """The renderer and rollout budgets every problem shares."""
    renderer = Renderer(model.tokenizer, chat_template=model.choice.chat_template, tools=cfg.mode == "retool",
                        model_name=model.choice.model, interpreter=cfg.interpreter)
    return renderer, cfg.rollout_config(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)


async def _sample_problem(cfg: EvalConfig, model: EvalModel, renderer: Any, rollout_config: Any, sandbox: Any,
                          index: int, problem: Any, *, seeding: str | None) -> tuple[ProblemResult, ProblemSampler]:
    """``val_n`` trajectories of one problem and its results line, seeded by the file's
    ``seeding`` (``position``; ``None`` with ``seeded``: the context scheme of older files)."""
    seed = problem_seed(cfg.seed, problem.id)
    by_context = cfg.seeded and seeding is None
    sampler = ProblemSampler(model.sampler, seed if by_context else None)
    rollout = Rollout(renderer, sampler, sandbox, agrade, rollout_config)
    start = time.monotonic()
    try:
        trajectories = await rollout.group(problem, cfg.val_n, seed=seed if seeding == SEEDING else None)
    except RolloutError as err:
        raise EvalError(str(err)) from err
    result = ProblemResult(problem_id=problem.id, question=problem.question, answer=problem.answer,
                           samples=tuple(trajectories), index=index, seed=seed, sampler_requests=sampler.requests,
                           time_s=round(time.monotonic() - start, 3))
    return result, sampler


# ---------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval",
        description="Evaluate a dataset x a model (base or checkpoint) x a mode (retool = tool on, text = "
        "tool off) x val_n samples: Average@k, Pass@k, unbiased pass@k, Format, code calls, turns. Writes one "
        "JSONL results file (docs/formats.md) and resumes it when re-run with the same settings. Every "
        "default is the seed's evaluation setting (AIME 2025, 12 samples, temperature 1.0, top_p 0.7, "
        "8,192-token budget, tool mode).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_args(p, EvalConfig)
    p.set_defaults(func=_run_eval_command)


def _run_eval_command(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(EvalConfig, args)
        check_outputs(cfg)
        report = evaluate(cfg)
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


def format_behaviour(figures: Mapping[str, float]) -> str:
    """The behaviour figures (:func:`retool.stats.behaviour_figures`) as one line."""
    parts = [f"response {figures['response_tokens']:.0f} tokens", f"calls in {100 * figures['call_rate']:.0f}%"]
    if "code_lines_per_call" in figures:
        parts.append(f"{figures['code_lines_per_call']:.1f} lines per call")
    if "call_success_rate" in figures:
        parts.append(f"{100 * figures['call_success_rate']:.0f}% of calls ran without error")
    if "first_call_position" in figures:
        parts.append(f"first call at {100 * figures['first_call_position']:.0f}% of the response")
    parts.append(f"{figures['self_corrections']:.2f} self-corrections per sample")
    return ", ".join(parts)


def check_outputs(cfg: EvalConfig) -> None:
    """Refuse, before any work, a results file (``--output``) or folder (``--output-dir``)
    that cannot be written (:mod:`retool.flag_checks`)."""
    if cfg.output:
        output_file(cfg.output, "--output")
    else:
        output_folder(cfg.output_dir, "--output-dir")


def format_summary(report: EvalReport) -> str:
    """A short human-readable account of an eval's summary and of this call's work."""
    s, h = report.summary, report.header
    k = s.k
    unbiased = "  ".join(f"pass@{j} {100 * v:.2f}%" for j, v in s.pass_at_k_unbiased.items())
    cost = [] if report.cost is None else [
        f"  cost of this run: {report.cost:.4g} USD ({report.usage.prefill} prompt tokens, "
        f"{report.usage.sampled} sampled tokens, {report.sandbox_cpu_s:.1f} sandbox CPU-s)"]
    return "\n".join([
        f"{h.label} on {h.dataset} ({h.mode} mode), {s.num_problems} problems × {k} samples",
        f"  Average@{k} {100 * s.average_at_k:.2f}% ± {100 * s.average_at_k_stderr:.2f}  "
        f"Pass@{k} {100 * s.pass_at_k:.2f}%  Format {100 * s.format:.2f}%",
        f"  unbiased  {unbiased}",
        f"  code calls {s.code_calls:.2f}  turns {s.turns:.2f}  tokens {s.tokens:.0f}  "
        f"correct {s.num_correct}/{s.num_samples}  solved {s.num_solved}/{s.num_problems}",
        *([f"  behaviour: {format_behaviour(s.behaviour)}"] if s.behaviour else []),
        f"  this run: sampled {report.sampled_problems} problems ({report.sampler_requests} sampler requests, "
        f"{report.usage.sampled} tokens), {report.resumed_problems} already done, {report.seconds:.1f} s",
        *cost,
        f"  results: {report.path}",
    ])
