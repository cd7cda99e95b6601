"""Multi-turn, code-interleaved rollouts: the per-trajectory async state machine.

One group = one problem × ``group_size`` trajectories. The first turn samples all of
them in one request (group fork); afterwards every trajectory advances on its own
asyncio task, so a slow sandbox call or a long generation in one trajectory never holds
back the others (no per-round barrier).

A trajectory alternates assistant turns and tool messages:

1. sample an assistant turn (≤ ``max_turn_tokens``, and never past the trajectory
   budget);
2. parse it in the template's tool-call format (:mod:`retool.protocol`):
   - no call attempt → the final turn: close it, grade it, done;
   - a well-formed call within the code-call budget → run it in the sandbox; the tool
     message is its sanitised, token-truncated observation;
   - a malformed call → the tool message is the short error for the model (it uses
     an assistant turn, not a code call);
   - a call after ``max_code_calls`` → the tool message says the budget is spent;
3. append the sampled tokens (mask 1) and the template/tool tokens (mask 0) exactly as
   :class:`retool.render.Renderer` builds them — tokens in, tokens out;
4. stop when the turn was cut by its token budget (``length``), when the assistant
   turn budget or the trajectory token budget is spent (``budget``), else continue.
   A prompt that alone fills the trajectory budget is sampled not at all (``prompt``).

Grading uses only the text of the final assistant turn (:mod:`retool.reward`). Every
trajectory keeps its tokens, mask, sampler logprobs, turns, tool exchanges (code,
result, status, latency) and grade. Failures of the sampler or the template propagate
with the problem id attached (:class:`RolloutError`); failures of model code are
execution results, never exceptions.

Interpreter: with the renderer's ``interpreter="stateful"``, each trajectory gets one
sandbox session (opened at its first code call, closed when the trajectory ends —
normally, by an error or by cancellation), so its calls share variables; otherwise
every call runs in a fresh process.

Not covered: parallel tool calls within one turn (the protocol allows one per turn),
tools other than ``code_interpreter``, reward shaping.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from retool.config import ConfigError, option, require
from retool.engines.base import SampledSequence, SamplingClient, SamplingParams, TransientEngineError
from retool.protocol import (
    INTERPRETERS,
    budget_exhausted_message,
    check_interpreter,
    tool_message_text,
    truncate_tool_output,
)
from retool.render import Renderer, Segment
from retool.sandbox import Sandbox, SandboxConfig
from retool.sandbox.executor import MAX_TIMEOUT_S
from retool.seeding import derive_seed
from retool.stats import trajectory_stats
from retool.types import (
    NOT_SAMPLED,
    ExecutionResult,
    Grade,
    InvalidToolCall,
    Problem,
    StopReason,
    ToolCall,
    TokenUsage,
    ToolExchange,
    Trajectory,
    Turn,
)

Grader = Callable[[str, str], Awaitable[Grade]]
"""``await grader(final_turn_text, gold_answer) -> Grade``."""


class RolloutError(RuntimeError):
    """A rollout failed for a reason that is not the model's (sampler, template, sandbox).

    ``transient`` is true when the cause may pass on a retry (a
    :class:`~retool.engines.base.TransientEngineError`, a connection error or a
    timeout): only such rollouts are retried; anything else is a real error.
    """

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


TRANSIENT_ERRORS = (TransientEngineError, ConnectionError, TimeoutError)
"""Sampler failures a rollout may retry: everything else stops it for good."""


@dataclass(frozen=True)
class RolloutConfig:
    """Budgets and sampling of rollouts (defaults: the seed's budgets — 4 code calls,
    6 assistant turns, 8,192 tokens a trajectory, 1,024 a turn, 512 a tool response)."""

    max_code_calls: int = 4
    max_assistant_turns: int = 6
    max_trajectory_tokens: int = 8192
    max_turn_tokens: int = 1024
    max_tool_response_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    sandbox_timeout_s: float | None = None
    """Per-call wall timeout; ``None`` uses the sandbox's own default (30 s)."""
    seed: int | None = None
    """Seed of the first (group-fork) request; later turns draw from the engine's stream."""

    def __post_init__(self) -> None:
        problems = budget_problems(self)
        if problems:
            raise ValueError(problems[0])


BUDGET_FIELDS = ("max_code_calls", "max_assistant_turns", "max_trajectory_tokens", "max_turn_tokens",
                 "max_tool_response_tokens")
"""The rollout budgets. Their defaults and rules are :class:`RolloutConfig`'s; the command
line's :class:`RolloutBudgets` takes both from it and hands them on by these names."""


def budget_problems(budgets: Any) -> list[str]:
    """What is wrong with the budgets of ``budgets`` (anything with :data:`BUDGET_FIELDS`)."""
    problems = [f"{name} must be >= 1, got {getattr(budgets, name)}" for name in BUDGET_FIELDS[1:]
                if getattr(budgets, name) < 1]
    if budgets.max_code_calls < 0:
        problems.append(f"max_code_calls must be >= 0, got {budgets.max_code_calls}")
    return problems


@dataclass
class RolloutBudgets:
    """The rollout and sandbox budgets, declared once for every command that rolls out
    (``retool train`` and ``retool eval`` configs subclass it)."""

    max_code_calls: int = option(RolloutConfig.max_code_calls, "code executions per trajectory")
    max_assistant_turns: int = option(RolloutConfig.max_assistant_turns, "assistant turns per trajectory")
    max_trajectory_tokens: int = option(RolloutConfig.max_trajectory_tokens, "tokens per trajectory, prompt included")
    max_turn_tokens: int = option(RolloutConfig.max_turn_tokens, "tokens per assistant turn")
    max_tool_response_tokens: int = option(RolloutConfig.max_tool_response_tokens,
                                           "tokens per tool response (head+tail kept)")
    sandbox_workers: int = option(8, "concurrent sandbox executions")
    sandbox_timeout_s: float = option(30.0, f"wall-clock limit of one code execution (at most {MAX_TIMEOUT_S:g} s)")
    sandbox_memory_mb: int = option(2048, "memory one code execution may allocate (MiB, on top of the preloaded modules)")
    sandbox_demote_after_s: float = option(0.0, "seconds after which a running code execution drops to the "
                                           "lowest CPU priority, so calls that spin to their timeout leave the "
                                           "cores to short ones (0: never; only where the sampler and trainer "
                                           "are not on this machine's CPU)")
    sandbox_strict: bool = option(False, "refuse to start unless the sandbox has full isolation")
    interpreter: str = option("stateless", "stateless: every code call starts a fresh Python; stateful: "
                              "one Python session per trajectory keeps variables between its calls "
                              "(the system prompt says which)", choices=INTERPRETERS)

    def validate_budgets(self) -> None:
        for problem in budget_problems(self)[:1]:
            raise ConfigError(problem)
        for name in ("sandbox_workers", "sandbox_memory_mb"):
            require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        require(self.sandbox_demote_after_s >= 0,  # false for nan
                f"sandbox_demote_after_s must be >= 0 seconds (0: never), got {self.sandbox_demote_after_s!r}")
        require(self.interpreter in INTERPRETERS,
                f"interpreter must be one of {', '.join(INTERPRETERS)}, got {self.interpreter!r}")
        require(0 < self.sandbox_timeout_s <= MAX_TIMEOUT_S,  # false for nan
                f"sandbox_timeout_s must be a number of seconds > 0 and <= {MAX_TIMEOUT_S:g} "
                f"(the sandbox's maximum), got {self.sandbox_timeout_s!r}")

    def rollout_config(self, *, temperature: float, top_p: float, top_k: int = 0) -> RolloutConfig:
        """The rollout's budgets and sampling settings."""
        return RolloutConfig(**self.budgets(), temperature=temperature, top_p=top_p, top_k=top_k,
                             sandbox_timeout_s=self.sandbox_timeout_s)

    def budgets(self) -> dict[str, int]:
        """The :data:`BUDGET_FIELDS` of this config, by name."""
        return {name: getattr(self, name) for name in BUDGET_FIELDS}

    def start_sandbox(self) -> Sandbox:
        """The sandbox, started now: its isolation line goes to stderr, and with
        ``sandbox_strict`` an incomplete isolation raises ``SandboxUnavailableError``."""
        sandbox = Sandbox(self.sandbox_config())
        try:
            print(sandbox.isolation_report(), file=sys.stderr)
        except BaseException:
            sandbox.close()
            raise
        return sandbox

    def sandbox_config(self) -> SandboxConfig:
        """The sandbox's limits and pool size."""
        return SandboxConfig(timeout_s=self.sandbox_timeout_s, memory_mb=self.sandbox_memory_mb,
                             workers=self.sandbox_workers, strict=self.sandbox_strict,
                             demote_after_s=self.sandbox_demote_after_s or None)


class CodeRunner:
    """What a rollout needs from a sandbox: ``await run(code, timeout_s=...)``, and for the
    stateful interpreter ``session()``, an object with that ``run`` and ``await aclose()``.

    :class:`retool.sandbox.Sandbox` satisfies it; so does anything with those methods.
    """

    async def run(self, code: str, *, timeout_s: float | None = None) -> ExecutionResult:  # pragma: no cover
        raise NotImplementedError

    def session(self) -> Any:  # pragma: no cover
        raise NotImplementedError


@dataclass(frozen=True)
class _Group:
    """What every request of one group shares: its problem, sampler (and the weight version
    it samples with), seed and usage meter."""

    problem: Problem
    sampler: SamplingClient
    seed: int | None
    usage: UsageMeter | None
    version: int = 0


@dataclass
class UsageMeter:
    """A running :class:`~retool.types.TokenUsage` (a rollout's, or one group's)."""

    total: TokenUsage = TokenUsage()

    def add(self, usage: TokenUsage) -> None:
        self.total = self.total + usage

    def take(self) -> TokenUsage:
        """Return the usage so far and start again from zero."""
        total, self.total = self.total, TokenUsage()
        return total


@dataclass
class _State:
    """The mutable state of one trajectory while it is being rolled out."""

    tokens: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]
    version: int
    """The weight version sampling this trajectory's turns."""
    turns: list[Turn] = field(default_factory=list)
    code_calls: int = 0
    final_text: str = ""
    stop_reason: StopReason = StopReason.STOP
    session: Any = None
    """The trajectory's interpreter session (stateful mode), from its first code call on."""

    def extend(self, segment: Segment) -> None:
        """Append ``segment``; its policy tokens were sampled by weight version ``version``."""
        self.tokens.extend(segment.tokens)
        self.mask.extend(segment.mask)
        self.logprobs.extend(segment.logprobs)
        self.versions.extend(self.version if m else NOT_SAMPLED for m in segment.mask)


@dataclass
class Rollout:
    """Everything one rollout needs; build once per run and call :meth:`group`.

    ``sampler`` is the policy a group samples from when :meth:`group` is not handed one:
    eval and the verl agent loop sample one model throughout and build the rollout with
    it; the trainer builds it with ``None`` and hands every step's sampler (the current
    weights) to :meth:`group`.
    """

    renderer: Renderer
    sampler: SamplingClient | None
    sandbox: CodeRunner | None
    grader: Grader
    config: RolloutConfig = field(default_factory=RolloutConfig)
    usage: UsageMeter = field(default_factory=UsageMeter, init=False)
    """Token usage (``prefill``, ``sampled``) since the last :meth:`take_usage`."""

    @property
    def tools(self) -> bool:
        return self.renderer.tools

    def __post_init__(self) -> None:
        if self.tools and self.sandbox is None:
            raise ValueError("tool mode needs a sandbox; build the Renderer with tools=False for text mode")
        check_interpreter(self.renderer.interpreter)

    @property
    def stateful(self) -> bool:
        return self.tools and self.renderer.interpreter == "stateful"

    def take_usage(self) -> TokenUsage:
        """Return the token usage since the last call and reset it."""
        return self.usage.take()

    # ------------------------------------------------------------ groups

    async def group(self, problem: Problem, group_size: int, *, sampler: SamplingClient | None = None,
                    seed: int | None = None, usage: UsageMeter | None = None,
                    weight_version: int = 0) -> list[Trajectory]:
        """Roll out ``group_size`` trajectories for ``problem`` (first turn forked) with
        ``sampler`` (default: the rollout's own).

        With ``seed``, every request of the group carries a seed derived from it and the
        request's place (the fork, or trajectory ``i``'s turn ``t``), so the group's
        samples depend on nothing else — not on timing, batching or which other groups
        are rolled out with it (a resumed step re-rolls only its unfinished groups and
        gets what the uninterrupted step got). Without it, the fork uses
        ``config.seed`` and later turns draw from the engine's stream. ``usage``, when
        given, also receives this group's token usage (as :attr:`usage` does).
        ``weight_version`` is recorded on every policy token (``Trajectory.versions_T``):
        the trainer passes the step whose weights ``sampler`` holds.
        """
        sampler = sampler if sampler is not None else self.sampler
        if sampler is None:
            raise ValueError("no sampler: build the Rollout with one or pass sampler= to group()")
        ctx = _Group(problem, sampler, seed, usage, weight_version)
        prompt = self.renderer.prompt_tokens(self.renderer.messages(problem.question))
        budget = self._turn_budget(len(prompt))
        if budget < 1:  # e.g. a long problem under a short --max-trajectory-tokens
            return [await self._unsampled(problem, prompt) for _ in range(group_size)]
        fork_seed = self.config.seed if seed is None else derive_seed(seed, "fork")
        first = await self._sample(ctx, prompt, group_size, budget, seed=fork_seed)
        tasks = [asyncio.create_task(self._trajectory(ctx, i, prompt, seq)) for i, seq in enumerate(first)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # their sessions are closed
            raise

    async def groups(self, problems: Sequence[Problem], group_size: int, *,
                     sampler: SamplingClient | None = None) -> list[list[Trajectory]]:
        """All groups of a batch concurrently, in the order of ``problems``."""
        return list(await asyncio.gather(*(self.group(p, group_size, sampler=sampler) for p in problems)))

    # ------------------------------------------------------------ one trajectory

    async def _unsampled(self, problem: Problem, prompt: list[int]) -> Trajectory:
        """The trajectory of a prompt that leaves no room to sample: no turns, graded as
        an empty answer, stop reason ``prompt``."""
        return Trajectory(
            problem_id=problem.id, prompt_len=len(prompt), tokens_T=tuple(prompt), mask_T=(0,) * len(prompt),
            logprobs_T=(0.0,) * len(prompt), turns=(), grade=await self.grader("", problem.answer),
            stop_reason=StopReason.PROMPT, versions_T=(NOT_SAMPLED,) * len(prompt),
        )

    async def _trajectory(self, ctx: _Group, index: int, prompt: list[int], first: SampledSequence) -> Trajectory:
        state = _State(tokens=list(prompt), mask=[0] * len(prompt), logprobs=[0.0] * len(prompt),
                       versions=[NOT_SAMPLED] * len(prompt), version=ctx.version)
        try:
            await self._turns(ctx, index, state, first)
        finally:  # also on errors and cancellation: no interpreter outlives its trajectory
            if state.session is not None:
                await state.session.aclose()
        problem = ctx.problem
        grade = await self.grader(state.final_text, problem.answer)
        return Trajectory(
            problem_id=problem.id, prompt_len=len(prompt), tokens_T=tuple(state.tokens),
            mask_T=tuple(state.mask), logprobs_T=tuple(state.logprobs), turns=tuple(state.turns),
            grade=grade, stop_reason=state.stop_reason, versions_T=tuple(state.versions),
        )

    async def _turns(self, ctx: _Group, index: int, state: _State, first: SampledSequence) -> None:
        """Sample and answer turns until the trajectory ends."""
        sequence: SampledSequence | None = first
        for turn_index in range(self.config.max_assistant_turns):
            if sequence is None:
                budget = self._turn_budget(len(state.tokens))
                if budget < 1:
                    state.stop_reason = StopReason.BUDGET
                    break
                seed = None if ctx.seed is None else derive_seed(ctx.seed, index, turn_index)
                sequence = (await self._sample(ctx, state.tokens, 1, budget, seed=seed))[0]
            last_turn = turn_index == self.config.max_assistant_turns - 1
            if not await self._advance(state, sequence, last_turn):
                break
            sequence = None

    async def _advance(self, state: _State, sequence: SampledSequence, last_turn: bool) -> bool:
        """Append one sampled turn (and its tool message); return whether to go on."""
        parsed = self.renderer.parse_turn(sequence.tokens)
        text = self.renderer.decode_turn(sequence.tokens)
        turn_stop = sequence.stop_reason
        if turn_stop is StopReason.LENGTH or parsed.call is None or last_turn:
            state.extend(self.renderer.final_turn(sequence.tokens, sequence.logprobs))
            state.turns.append(Turn(text=text, num_tokens=len(sequence.tokens), stop_reason=turn_stop))
            state.final_text = text
            if turn_stop is StopReason.LENGTH:
                state.stop_reason = StopReason.LENGTH
            elif parsed.call is not None:
                state.stop_reason = StopReason.BUDGET  # wanted the tool, but no turn is left
            return False
        exchange = await self._exchange(state, parsed.call)
        segment = self.renderer.tool_turn(sequence.tokens, sequence.logprobs, exchange.response)
        state.turns.append(Turn(text=text, num_tokens=len(sequence.tokens), stop_reason=turn_stop,
                                exchange=exchange))
        if len(state.tokens) + len(segment) >= self.config.max_trajectory_tokens:
            # The tool message would not leave room for another turn: end here.
            state.extend(self.renderer.final_turn(sequence.tokens, sequence.logprobs))
            state.final_text = text
            state.stop_reason = StopReason.BUDGET
            return False
        state.extend(segment)
        return True

    async def _exchange(self, state: _State, call: ToolCall | InvalidToolCall) -> ToolExchange:
        """Answer one call attempt: run it, or explain why it was not run."""
        if isinstance(call, InvalidToolCall):
            return ToolExchange(call=call, result=None, response=self._plain_response(call.message))
        if state.code_calls >= self.config.max_code_calls:
            message = budget_exhausted_message(self.config.max_code_calls)
            return ToolExchange(call=call, result=None, response=self._plain_response(message))
        state.code_calls += 1
        start = time.monotonic()
        runner = self.sandbox
        if self.stateful:
            if state.session is None:
                state.session = self.sandbox.session()
            runner = state.session
        result = await runner.run(call.code, timeout_s=self.config.sandbox_timeout_s)
        latency = time.monotonic() - start
        response = tool_message_text(result, self.renderer.sanitizer,
                                     max_tokens=self.config.max_tool_response_tokens)
        return ToolExchange(call=call, result=result, response=response, latency_s=latency)

    def _plain_response(self, message: str) -> str:
        clean = self.renderer.sanitizer(message)
        return truncate_tool_output(clean, self.renderer.tokenizer, self.config.max_tool_response_tokens)

    # ------------------------------------------------------------ sampling

    def _turn_budget(self, context_len: int) -> int:
        return min(self.config.max_turn_tokens, self.config.max_trajectory_tokens - context_len)

    async def _sample(self, ctx: _Group, tokens: list[int], n: int, max_tokens: int,
                      seed: int | None = None) -> tuple[SampledSequence, ...]:
        problem = ctx.problem
        params = SamplingParams(
            max_tokens=max_tokens, temperature=self.config.temperature, top_p=self.config.top_p,
            top_k=self.config.top_k, stop_token_ids=self.renderer.stop_token_ids, seed=seed,
        )
        try:
            result = await ctx.sampler.sample(tokens, n, params)
        except Exception as err:
            raise RolloutError(f"problem {problem.id}: sampling failed at context length "
                               f"{len(tokens)}: {type(err).__name__}: {err}",
                               transient=isinstance(err, TRANSIENT_ERRORS)) from err
        if len(result.sequences) != n:
            raise RolloutError(f"problem {problem.id}: asked the sampler for {n} sequences, "
                               f"got {len(result.sequences)}")
        counts = TokenUsage(prefill=len(tokens), sampled=sum(len(s.tokens) for s in result.sequences))
        self.usage.add(counts)
        if ctx.usage is not None:
            ctx.usage.add(counts)
        return result.sequences


# ---------------------------------------------------------------- metrics


def rollout_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Per-step rollout and reward metrics over a batch of trajectories.

    The figures are :func:`retool.stats.trajectory_stats` (shared with the eval summary)
    under the training names: ``reward/*``, ``rollout/*``, ``rollout/invalid_calls/<reason>``
    (counts) and ``rollout/stop/<reason>`` (shares).
    """
    if not trajectories:
        return {}
    s = trajectory_stats(trajectories)
    metrics = {
        "reward/mean": s.reward_mean,
        "reward/correct": s.correct_rate,
        "reward/format": s.format_rate,
        "reward/grader_errors": float(s.grader_errors),
        "rollout/turns": s.turns_mean,
        "rollout/code_calls": s.code_calls_mean,
        "rollout/tool_call_attempts": s.tool_call_attempts_mean,
        "rollout/valid_tool_call_rate": s.valid_tool_call_rate,
        "rollout/budget_exhausted_calls": float(s.budget_exhausted_calls),
        "rollout/name_error_rate": s.name_error_rate,
        "rollout/state_lost_calls": float(s.state_lost_calls),
        "rollout/trajectory_tokens": s.tokens_mean,
        "rollout/sampled_tokens": s.sampled_tokens_mean,
        "rollout/used_tool_rate": s.used_tool_rate,
    }
    for reason, count in s.invalid_calls.items():
        metrics[f"rollout/invalid_calls/{reason}"] = float(count)
    for reason in StopReason:
        metrics[f"rollout/stop/{reason.value}"] = s.stop_reasons.get(reason.value, 0) / s.trajectories
    return metrics
