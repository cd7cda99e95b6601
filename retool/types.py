"""The typed records every layer of retool shares.

Small, frozen dataclasses passed between stages: a problem, a parsed tool call,
the result of executing one snippet, the grade of one answer, one assistant turn,
one trajectory, one group of trajectories, token usage. Nothing here does work; behaviour lives in
the modules that make and consume these records.

Shape suffixes follow the STYLE guide: ``tokens_T`` is one entry per token of a
trajectory, ``rewards_G`` one entry per member of a group.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Problem:
    """One math problem with its reference answer."""

    id: str
    question: str
    answer: str
    data_source: str = ""


# ---------------------------------------------------------------- tool calls


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call of the ``code_interpreter`` tool."""

    code: str
    raw: str = ""
    """The exact text of the call as the model wrote it (for viewers and debugging)."""


@dataclass(frozen=True)
class InvalidToolCall:
    """A call attempt that could not be executed.

    ``reason`` is a short machine-readable tag (``bad_json``, ``unknown_tool``,
    ``multiple_calls``, ``text_after_call``, ``empty_code``, ``missing_code``,
    ``unclosed_call``, ``bad_xml`` — the XML form's structure is broken,
    ``bad_arguments`` — arguments other than one string ``code``, ``forged_response`` —
    the turn wrote a tool response itself instead of calling the tool); ``message`` is the
    short text sent back to the model as the tool response, so it can correct itself.
    """

    reason: str
    message: str
    raw: str = ""


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant message split into its text and its tool call, if any.

    ``call`` is ``None`` when the model made no call attempt (a final answer).
    """

    content: str
    call: ToolCall | InvalidToolCall | None = None

    @property
    def attempted_call(self) -> bool:
        return self.call is not None

    @property
    def valid_call(self) -> bool:
        return isinstance(self.call, ToolCall)


# ---------------------------------------------------------------- execution


class ExecStatus(str, enum.Enum):
    """How one sandboxed execution ended."""

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    MEMORY = "memory"
    OUTPUT_LIMIT = "output_limit"
    SANDBOX_ERROR = "sandbox_error"


@dataclass(frozen=True)
class ExecutionResult:
    """The outcome of running one snippet in the sandbox.

    ``observation`` is the text the model sees (stdout; on error the last frames of
    the traceback; on timeout "Execution timed out after N s"). ``files`` holds the
    contents of files the caller asked to fetch back (server mode).
    """

    status: ExecStatus
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    signal: int | None = None
    wall_s: float = 0.0
    cpu_s: float = 0.0
    peak_rss_bytes: int | None = None
    truncated: bool = False
    observation: str = ""
    isolation: tuple[str, ...] = ()
    """Isolation mechanisms that were actually in force for this call."""
    files: dict[str, bytes] = field(default_factory=dict)
    memory_baseline_bytes: int | None = field(default=None, metadata={"omit_if_none": True})
    """Address space the call inherited from the sandbox's warm parent (preloaded
    modules); the memory limit counts only what the snippet adds on top of it."""
    state_lost: str | None = field(default=None, metadata={"omit_if_none": True})
    """Stateful interpreter only: why the interpreter of the earlier calls ended
    (``timeout``, ``memory``, ...) when this call had to run in a fresh one."""

    @property
    def ok(self) -> bool:
        return self.status is ExecStatus.OK


# ---------------------------------------------------------------- grading


@dataclass(frozen=True)
class Grade:
    """The outcome reward of one final answer.

    ``formatted`` is False when no closed ``\\boxed{}`` was found in the answer
    window; ``grader_error`` is set when the grader raised or timed out on the
    prediction (then the answer counts as incorrect but formatted).
    """

    reward: float
    correct: bool
    formatted: bool
    answer: str | None = None
    grader_error: str | None = None


# ---------------------------------------------------------------- rollouts


class StopReason(str, enum.Enum):
    """Why one assistant turn, or a whole trajectory, ended."""

    STOP = "stop"
    """The policy emitted an end-of-turn token (or a stop string)."""
    LENGTH = "length"
    """The per-turn token budget ran out."""
    BUDGET = "budget"
    """The trajectory token, turn or code-call budget ran out."""
    PROMPT = "prompt"
    """The prompt alone filled the trajectory budget: nothing was sampled (a recorded,
    counted outcome — graded like an empty answer — not an error that stops the run)."""


@dataclass(frozen=True)
class ToolExchange:
    """One tool call made during a rollout and what came back."""

    call: ToolCall | InvalidToolCall
    result: ExecutionResult | None
    """``None`` for invalid or over-budget calls, which are answered without running."""
    response: str
    """The tool message text that entered the context (after sanitising and truncation)."""
    latency_s: float = 0.0


@dataclass(frozen=True)
class Turn:
    """One assistant turn: the sampled text and what the rollout did with it."""

    text: str
    num_tokens: int
    stop_reason: StopReason
    exchange: ToolExchange | None = None


NOT_SAMPLED = -1
"""The weight version of a token no policy sampled (prompt, template, interpreter)."""


@dataclass(frozen=True)
class Trajectory:
    """One complete multi-turn rollout for one problem.

    ``tokens_T`` is the whole context (prompt included); ``mask_T`` is 1 on tokens
    sampled by the policy and 0 on prompt, template and interpreter tokens;
    ``logprobs_T`` holds the sampler's logprob for policy tokens and 0.0 elsewhere;
    ``versions_T`` the weight version that sampled each policy token (the trainer's step
    whose sampler drew it: the weights after every earlier step's update) and
    :data:`NOT_SAMPLED` elsewhere; ``None`` when not recorded (files written before it
    was).
    """

    problem_id: str
    prompt_len: int
    tokens_T: tuple[int, ...]
    mask_T: tuple[int, ...]
    logprobs_T: tuple[float, ...]
    turns: tuple[Turn, ...]
    grade: Grade
    stop_reason: StopReason = StopReason.STOP
    versions_T: tuple[int, ...] | None = field(default=None, metadata={"omit_if_none": True})

    def __post_init__(self) -> None:
        if self.versions_T is not None and len(self.versions_T) != len(self.tokens_T):
            raise ValueError(f"trajectory {self.problem_id!r}: versions_T has {len(self.versions_T)} entries, "
                             f"tokens_T {len(self.tokens_T)}")

    @property
    def num_code_calls(self) -> int:
        """Calls that actually ran in the sandbox (not invalid or over-budget attempts)."""
        return sum(1 for t in self.turns if t.exchange is not None and t.exchange.result is not None)

    @property
    def num_invalid_calls(self) -> int:
        """Call attempts that could not run (malformed JSON, an unknown tool, a call cut off by
        the turn budget...: :class:`InvalidToolCall`), answered with an error message."""
        return sum(1 for t in self.turns if t.exchange is not None and isinstance(t.exchange.call, InvalidToolCall))


@dataclass(frozen=True)
class TrajectoryGroup:
    """The trajectories of one problem sampled together: a GRPO group.

    Advantages are computed within a group (each reward against its group's mean), so
    the group, not the single trajectory, is what the rollout hands to the reward and
    advantage stages.
    """

    problem: Problem
    trajectories_G: tuple[Trajectory, ...]

    def __post_init__(self) -> None:
        if not self.trajectories_G:
            raise ValueError(f"a group needs at least one trajectory (problem {self.problem.id})")

    @property
    def rewards_G(self) -> tuple[float, ...]:
        """Each trajectory's outcome reward, in order."""
        return tuple(t.grade.reward for t in self.trajectories_G)


@dataclass(frozen=True)
class TokenUsage:
    """Tokens a run asked of its engines — the one vocabulary of training and eval alike.

    ``prefill``: context tokens sent to the sampler (once per request, however many
    samples it asks for); ``sampled``: tokens the sampler returned; ``trained``: policy
    tokens in the update (0 where nothing is trained, as in eval). Logged as
    ``tokens/prefill``, ``tokens/sampled`` and ``tokens/trained``.
    """

    prefill: int = 0
    sampled: int = 0
    trained: int = 0

    def __add__(self, other: TokenUsage) -> TokenUsage:
        return TokenUsage(self.prefill + other.prefill, self.sampled + other.sampled, self.trained + other.trained)

    def to_json(self) -> dict[str, int]:
        return {"prefill": self.prefill, "sampled": self.sampled, "trained": self.trained}

    def metrics(self) -> dict[str, float]:
        """``tokens/prefill``, ``tokens/sampled`` and ``tokens/trained``, as a step logs them."""
        return {f"tokens/{name}": float(count) for name, count in self.to_json().items()}

    @classmethod
    def from_json(cls, row: dict) -> TokenUsage:
        """Keys a row leaves out read as 0 (files written before ``trained`` was recorded)."""
        return cls(int(row.get("prefill", 0)), int(row.get("sampled", 0)), int(row.get("trained", 0)))


# ---------------------------------------------------------------- training


@dataclass(frozen=True)
class Datum:
    """One training sequence in next-token form (Tinker's ``Datum``, flattened).

    Position ``i`` of ``input_tokens_N`` predicts ``target_tokens_N[i]``: build one from
    a token sequence ``s`` as ``inputs = s[:-1]``, ``targets = s[1:]`` (see
    ``retool.algo.make_datum``). Every ``_N`` field has one entry per target.

    ``weights_N`` is 1.0 where the target is trained (policy-sampled tokens in RL,
    supervised tokens in SFT) and 0.0 on prompt, template and interpreter tokens;
    token-mean losses divide by its sum. ``sampler_logprobs_N`` and ``advantages_N``
    are needed by the RL losses and left empty for ``cross_entropy``; both are 0.0
    wherever the weight is 0.
    """

    input_tokens_N: tuple[int, ...]
    target_tokens_N: tuple[int, ...]
    weights_N: tuple[float, ...]
    sampler_logprobs_N: tuple[float, ...] = ()
    advantages_N: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.input_tokens_N)
        if n == 0:
            raise ValueError("a Datum needs at least one input token")
        lengths = {
            "target_tokens_N": len(self.target_tokens_N),
            "weights_N": len(self.weights_N),
            "sampler_logprobs_N": len(self.sampler_logprobs_N) or n,
            "advantages_N": len(self.advantages_N) or n,
        }
        wrong = {k: v for k, v in lengths.items() if v != n}
        if wrong:
            raise ValueError(f"Datum fields must have {n} entries like input_tokens_N; got {wrong}")

    @property
    def num_tokens(self) -> int:
        return len(self.input_tokens_N)

    @property
    def num_trained(self) -> int:
        """Targets with a non-zero loss weight."""
        return sum(1 for w in self.weights_N if w != 0.0)
