"""``RetoolAgentLoop``: one ReTool trajectory inside verl, run by retool's own rollout.

verl builds one agent-loop object per trajectory (``hydra.utils.instantiate`` of the
entry named by the row's ``agent_name``) and awaits ``run(sampling_params, **row)``.
This loop does not re-implement the conversation: it builds a
:class:`retool.rollout.Rollout` whose sampler is verl's server manager
(:class:`~retool.integrations.verl.sampler.ServerManagerSampler`) and rolls out a
group of one. So the chat-template rendering (append-only, tokens in and out), the
tool-call parser and its malformed-call messages, the sandbox, the budgets, the stop
reasons and the grader are exactly those of ``retool train`` — one state machine.

What verl receives (``AgentLoopOutput``):

- ``prompt_ids`` / ``response_ids``: the rollout's tokens split at the prompt;
  ``response_mask`` 1 on sampled tokens, 0 on template and interpreter tokens;
  ``response_logprobs`` the sampler's logprobs on sampled tokens, 0.0 elsewhere.
- ``reward_score``: retool's grade (math-verify on the final turn's boxed answer), so
  verl's reward hook is not called for these rows.
- ``num_turns``: messages after the system prompt (user + assistant + tool), as verl's
  own tool agent counts them.
- ``metrics``: verl's timing record (generation, tool calls, grading seconds).
- ``extra_fields["reward_extra_info"]``: per-trajectory figures under retool's metric
  names (``reward/correct``, ``rollout/code_calls``, ``rollout/stop/length``,
  ``sandbox/latency_mean`` …) with the same keys on every row, as verl requires; and
  ``extra_fields["tool_call_counts"]`` (code calls run), which verl's own training
  metrics aggregate (``tool_call_counts/{min,max,mean}``).

Per process (one verl agent-loop worker), the renderer and the sandbox are built once
and shared by every trajectory: an in-process warm sandbox (``sandbox_workers``
concurrent calls), or a ``retool sandbox serve`` URL (``sandbox_url``).

The trajectory budget is retool's ``max_trajectory_tokens`` (prompt included), never
more than the prompt plus verl's ``rollout.response_length``.

Not covered: multimodal prompts, verl's own tool registry (``tools``) and its
``multi_turn`` settings (this loop has its own budgets), partial rollouts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

from retool.config import option
from retool.integrations.verl.sampler import ServerManagerSampler
from retool.protocol import build_messages
from retool.render import Renderer
from retool.reward import agrade
from retool.rollout import Rollout, RolloutBudgets, RolloutConfig, rollout_metrics
from retool.sandbox import Sandbox
from retool.types import ExecStatus, Grade, Problem, Trajectory

AGENT_NAME = "retool"


@dataclass
class LoopSettings(RolloutBudgets):
    """What the agent-loop YAML entry sets (``retool verl-config`` writes every field):
    retool's rollout and sandbox budgets — :class:`retool.rollout.RolloutBudgets`, the
    fields and defaults ``retool train`` has — plus where the sandbox runs and the template."""

    sandbox_url: str | None = option(None, "a `retool sandbox serve` URL; none = a warm sandbox in this process")
    chat_template: str | None = option(None, "chat-template override: 'hermes', a .jinja file, or Jinja source")
    enable_thinking: bool = option(False, "render prompts with the template's thinking mode on")

    def __post_init__(self) -> None:
        self.validate_budgets()


_RENDERERS: dict[tuple, Renderer] = {}
_SANDBOXES: dict[tuple, Any] = {}


def shared_renderer(tokenizer: Any, settings: LoopSettings) -> Renderer:
    """One renderer per tokenizer and template in this process (it probes the template once)."""
    key = (id(tokenizer), settings.chat_template, settings.enable_thinking)
    if key not in _RENDERERS:
        _RENDERERS[key] = Renderer(tokenizer, chat_template=settings.chat_template, tools=True,
                                   enable_thinking=settings.enable_thinking)
    return _RENDERERS[key]


def shared_sandbox(settings: LoopSettings) -> Any:
    """One sandbox (or client of a sandbox server) per process and settings."""
    key = (settings.sandbox_url, settings.sandbox_config())
    if key not in _SANDBOXES:
        if settings.sandbox_url:
            from retool.sandbox.client import SandboxClient  # aiohttp: only a sandbox server needs it

            _SANDBOXES[key] = SandboxClient(settings.sandbox_url)
        else:
            _SANDBOXES[key] = Sandbox(settings.sandbox_config())
    return _SANDBOXES[key]


@register(AGENT_NAME)
class RetoolAgentLoop(AgentLoopBase):
    """A verl agent loop that runs one ReTool trajectory with retool's rollout."""

    def __init__(self, *args: Any, name: str = AGENT_NAME, **kwargs: Any) -> None:
        # ``name`` is the YAML entry's own key, handed over by hydra.instantiate; the
        # entry's other keys are LoopSettings fields; the rest is AgentLoopBase's.
        fields = set(LoopSettings.__dataclass_fields__)
        settings = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
        super().__init__(*args, **kwargs)
        self.settings = LoopSettings(**settings)
        self.response_length = int(self.rollout_config.response_length)

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        problem = problem_from_row(row)
        renderer = shared_renderer(self.tokenizer, self.settings)
        # The prompt's length sets the budget (rendered again inside the rollout: same tokens).
        prompt_len = len(renderer.prompt_tokens(build_messages(problem.question, tools=True)))
        grading = _TimedGrader()
        rollout = Rollout(renderer, ServerManagerSampler(self.server_manager), shared_sandbox(self.settings),
                          grading, self._rollout_config(sampling_params, prompt_len))
        start = time.monotonic()
        (trajectory,) = await rollout.group(problem, 1)
        return to_output(trajectory, time.monotonic() - start, grading.seconds)

    def _rollout_config(self, sampling_params: dict[str, Any], prompt_len: int) -> RolloutConfig:
        config = self.settings.rollout_config(temperature=float(sampling_params.get("temperature", 1.0)),
                                              top_p=float(sampling_params.get("top_p", 1.0)),
                                              top_k=max(int(sampling_params.get("top_k", -1)), 0))
        budget = min(config.max_trajectory_tokens, prompt_len + self.response_length)
        return replace(config, max_trajectory_tokens=budget)


class _TimedGrader:
    """retool's grader, timing itself (verl's ``compute_score`` seconds)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    async def __call__(self, response: str, gold: str) -> Grade:
        start = time.monotonic()
        try:
            return await agrade(response, gold)
        finally:
            self.seconds += time.monotonic() - start


def problem_from_row(row: dict[str, Any]) -> Problem:
    """The problem of one verl dataset row (the layout ``retool verl-config`` writes).

    The question is ``extra_info.question`` (else the last user message of
    ``raw_prompt``); the gold answer is ``reward_model.ground_truth`` — a row without one
    is a data bug and raises.
    """
    extra = dict(row.get("extra_info") or {})
    reward_model = dict(row.get("reward_model") or {})
    if reward_model.get("ground_truth") in (None, ""):
        raise ValueError(f"verl row {extra.get('id', '?')} has no reward_model.ground_truth")
    question = extra.get("question")
    if not question:
        users = [m for m in list(row.get("raw_prompt") or []) if m.get("role") == "user"]
        if not users:
            raise ValueError(f"verl row {extra.get('id', '?')} has neither extra_info.question nor a user message")
        question = users[-1]["content"]
    return Problem(id=str(extra.get("id", extra.get("index", ""))), question=str(question),
                   answer=str(reward_model["ground_truth"]), data_source=str(row.get("data_source", "")))


def to_output(trajectory: Trajectory, rollout_s: float, grading_s: float) -> AgentLoopOutput:
    """verl's record of one finished trajectory (see the module docstring)."""
    p = trajectory.prompt_len
    tool_s = sum(t.exchange.latency_s for t in trajectory.turns if t.exchange is not None)
    metrics = AgentLoopMetrics(generate_sequences=max(rollout_s - tool_s - grading_s, 0.0),
                               tool_calls=tool_s, compute_score=grading_s)
    return AgentLoopOutput(
        prompt_ids=list(trajectory.tokens_T[:p]), response_ids=list(trajectory.tokens_T[p:]),
        response_mask=list(trajectory.mask_T[p:]), response_logprobs=list(trajectory.logprobs_T[p:]),
        reward_score=trajectory.grade.reward, num_turns=num_turns(trajectory), metrics=metrics,
        extra_fields={"reward_extra_info": trajectory_metrics(trajectory), "turn_scores": [], "tool_rewards": [],
                      "tool_call_counts": trajectory.num_code_calls})


def num_turns(trajectory: Trajectory) -> int:
    """User message + assistant turns + tool messages that entered the context."""
    tool_messages = sum(1 for t in trajectory.turns[:-1] if t.exchange is not None)
    return 1 + len(trajectory.turns) + tool_messages


def trajectory_metrics(trajectory: Trajectory) -> dict[str, float]:
    """retool's rollout, reward and sandbox figures for one trajectory, with fixed keys.

    :func:`retool.rollout.rollout_metrics` over a batch of one (its per-reason invalid
    call counts are summed into ``rollout/invalid_calls``, so every row has the same
    keys), plus the sandbox figures of this trajectory's executed calls.
    """
    metrics = {k: v for k, v in rollout_metrics([trajectory]).items() if not k.startswith("rollout/invalid_calls/")}
    exchanges = [t.exchange for t in trajectory.turns if t.exchange is not None]
    metrics["rollout/invalid_calls"] = float(trajectory.num_invalid_calls)
    ran = [e for e in exchanges if e.result is not None]
    metrics["sandbox/calls"] = float(len(ran))
    metrics["sandbox/latency_mean"] = sum(e.latency_s for e in ran) / len(ran) if ran else 0.0
    metrics["sandbox/latency_max"] = max((e.latency_s for e in ran), default=0.0)
    for status in ExecStatus:
        metrics[f"sandbox/count_{status.value}"] = float(sum(1 for e in ran if e.result.status is status))
    return metrics
