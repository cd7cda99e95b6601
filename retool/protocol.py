"""The tool protocol: the ``code_interpreter`` tool, the system prompt, parsing of the
model's tool calls, and the hygiene of tool output before it enters the context.

The one tool is declared natively through the model's chat template (``tools=``), so
the model sees it in the form it was trained on. Two call formats exist in real
templates and are parsed here:

* ``hermes`` — Qwen2.5 / Qwen3 / QwQ (and the bundled Hermes override)::

      <tool_call>
      {"name": "code_interpreter", "arguments": {"code": "print(1 + 1)"}}
      </tool_call>

* ``xml`` — Qwen3.5 / Qwen3-Coder::

      <tool_call>
      <function=code_interpreter>
      <parameter=code>
      print(1 + 1)
      </parameter>
      </function>
      </tool_call>

Two interpreter modes (:data:`INTERPRETERS`) differ only in what the model is told:
``stateless`` (the default: every execution starts afresh) and ``stateful`` (executions
share one Python session, as notebook cells do). :func:`system_prompt` and
:func:`tool_schema` give each mode's text; the sandbox gives each mode's behaviour.

The format is chosen once from the chat template (:func:`detect_format`), never guessed
per message. A malformed attempt becomes an :class:`~retool.types.InvalidToolCall`
whose ``message`` is a short text for the model; nothing here raises on model output.

Tool output is *sanitised* (every added/special token of the tokenizer and every
structural tag of the template is broken with a zero-width space, so printed text can
never forge ``<|im_end|>`` or ``</tool_response>``) and *truncated* by tokens, keeping
head and tail.

Non-goals: rendering and tokenising conversations (:mod:`retool.render`), running code
(:mod:`retool.sandbox`), call budgets (the rollout counts calls; this module only words
the message).
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterable
from typing import Any

from retool.types import ExecutionResult, ExecStatus, InvalidToolCall, ParsedTurn, ToolCall

TOOL_NAME = "code_interpreter"

INTERPRETERS = ("stateless", "stateful")
"""Interpreter modes: a fresh process per execution (the default), or one Python session
per trajectory whose variables carry over between executions."""


def _schema(description: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {
                    "code": {"type": "string", "description": "The Python code to be executed."},
                },
                "required": ["code"],
            },
        },
    }


TOOL_SCHEMA: dict[str, Any] = _schema(
    "Run a Python snippet in a fresh, stateless sandbox and return what it printed (stdout), or the error it raised."
)
"""The OpenAI-style function schema passed to the chat template as ``tools=[TOOL_SCHEMA]``."""

STATEFUL_TOOL_SCHEMA: dict[str, Any] = _schema(
    "Run a Python snippet in a sandboxed Python session that keeps its variables, functions and imports "
    "between calls, and return what it printed (stdout), or the error it raised."
)
"""The schema of the stateful mode: the same tool, described as a persistent session."""

SYSTEM_PROMPT = """\
You are an expert mathematician. Solve the user's problem by reasoning step by step.

You can run Python with the code_interpreter tool, to compute, to check cases or to verify a result. Rules for the code:
- It must finish within a few seconds and use little memory: keep enumerations and searches small.
- No file, network or other I/O. You only see what the code prints, so print() every result you need.
- Every execution is independent and stateless: import and define everything you use in each call.
- Make at most one tool call per turn, then stop and wait for its result.

Never call the tool and give the final answer in the same turn. When you are done, end your reply with one line of the form \\boxed{<answer>}."""
"""System prompt of tool mode (stateless interpreter): the task, the tool, the resource rules."""

STATELESS_RULE = "- Every execution is independent and stateless: import and define everything you use in each call.\n"
STATEFUL_RULE = (
    "- Executions share one Python session, like notebook cells: variables, functions and imports from "
    "earlier calls stay available. A call that times out or runs out of memory restarts the session "
    "(the tool's reply then says the state was lost).\n"
)
STATEFUL_SYSTEM_PROMPT = SYSTEM_PROMPT.replace(STATELESS_RULE, STATEFUL_RULE)
"""System prompt of tool mode with the stateful interpreter: the same, but the state rule."""

TEXT_SYSTEM_PROMPT = """\
You are an expert mathematician. Solve the user's problem by reasoning step by step.

When you are done, end your reply with one line of the form \\boxed{<answer>}."""
"""System prompt of text-only mode (no tool declared)."""


class TemplateError(ValueError):
    """A chat template cannot be used for the tool protocol or for token-exact rendering."""


def check_interpreter(interpreter: str) -> str:
    """``interpreter`` if it is one of :data:`INTERPRETERS`, else ValueError."""
    if interpreter not in INTERPRETERS:
        raise ValueError(f"interpreter must be one of {', '.join(INTERPRETERS)}, got {interpreter!r}")
    return interpreter


def system_prompt(interpreter: str = "stateless") -> str:
    """The tool-mode system prompt for an interpreter mode."""
    return STATEFUL_SYSTEM_PROMPT if check_interpreter(interpreter) == "stateful" else SYSTEM_PROMPT


def tool_schema(interpreter: str = "stateless") -> dict[str, Any]:
    """The tool's schema for an interpreter mode."""
    return STATEFUL_TOOL_SCHEMA if check_interpreter(interpreter) == "stateful" else TOOL_SCHEMA


def build_messages(question: str, *, tools: bool = True, interpreter: str = "stateless") -> list[dict[str, str]]:
    """The opening conversation for one problem: system prompt + the question.

    ``tools=False`` gives the text-only prompt (the tool is neither declared nor
    mentioned). ``interpreter`` picks the tool-mode prompt (:func:`system_prompt`). The
    tool schema itself is passed to the chat template separately (:func:`tool_schema`).
    """
    system = system_prompt(interpreter) if tools else TEXT_SYSTEM_PROMPT
    return [{"role": "system", "content": system}, {"role": "user", "content": question.strip()}]


# ---------------------------------------------------------------- call formats


class ToolCallFormat(str, enum.Enum):
    """How a chat template writes a tool call."""

    HERMES = "hermes"
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5, Qwen3, QwQ)."""
    XML = "xml"
    """``<tool_call><function=NAME><parameter=ARG>value</parameter>...`` (Qwen3.5, Qwen3-Coder)."""


CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"


def detect_format(chat_template: str) -> ToolCallFormat:
    """The tool-call format a chat template teaches, read from the template source.

    Raises :class:`TemplateError` when the template has no tool-call syntax at all
    (e.g. SmolLM2's, which ignores ``tools=``): such a model needs a chat-template
    override such as the bundled ``hermes`` template.
    """
    if "<function=" in chat_template and CALL_OPEN in chat_template:
        return ToolCallFormat.XML
    if CALL_OPEN in chat_template:
        return ToolCallFormat.HERMES
    raise TemplateError(
        "this chat template declares no tool-call format (no <tool_call> in it); "
        "use a chat-template override such as the bundled 'hermes' template"
    )


# ---------------------------------------------------------------- parsing

_HINTS = {
    ToolCallFormat.HERMES: (
        'Inside the tool-call tags write one JSON object: '
        '{"name": "code_interpreter", "arguments": {"code": "..."}}.'
    ),
    ToolCallFormat.XML: (
        "Inside the tool-call tags write one function block named code_interpreter "
        "with one parameter named code holding the Python code."
    ),
}

_FUNCTION_RE = re.compile(r"\s*<function=([^>\n]*)>(.*)</function>\s*", re.DOTALL)
_PARAMETER_RE = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)


def parse_assistant(text: str, fmt: ToolCallFormat, *, in_thinking: bool = False) -> ParsedTurn:
    """Split one assistant turn into its text and its tool call, if it attempted one.

    A call attempt is any ``<tool_call>`` outside the turn's reasoning, which is not
    searched. The turn has reasoning only when it starts inside a thinking block:
    ``in_thinking`` (the generation prompt left a ``<think>`` open, which
    :attr:`retool.render.Renderer.opens_thinking` knows from the template), or the turn
    itself opens with ``<think>``. That block ends at the first ``</think>``; in a turn
    without one, ``</think>`` is plain text (inside a call's code, say) and never hides
    the call. Exactly one closed call with nothing but whitespace after it, naming
    ``code_interpreter`` with a single non-empty ``code`` argument, is a
    :class:`~retool.types.ToolCall`; anything else that attempted a call is an
    :class:`~retool.types.InvalidToolCall` with a reason tag and a message for the
    model. So is a turn that writes the interpreter's reply itself (a
    ``<tool_response>`` or ``</tool_response>`` tag outside its reasoning, before any
    call: ``forged_response``) — a model that, after a failed call, invents the
    traceback or output it expected instead of calling again or answering. ``text`` is
    the decoded turn without its end-of-turn token.
    """
    reasoning_end = _reasoning_end(text, in_thinking)
    start = text.find(CALL_OPEN, reasoning_end)
    forged = _forged_response_start(text, reasoning_end, len(text) if start < 0 else start)
    if forged >= 0:
        return ParsedTurn(content=text[:forged].rstrip(), call=_invalid(
            "forged_response", "only the interpreter writes tool responses, in reply to a tool call, so "
            "nothing was run. Make a tool call to run code, or end with one line \\boxed{<answer>}.",
            text[forged:]))
    if start < 0:
        return ParsedTurn(content=text)
    return ParsedTurn(content=text[:start].rstrip(), call=_parse_call(text[start:], fmt))


def _forged_response_start(text: str, begin: int, end: int) -> int:
    """Where ``text[begin:end]`` first writes a tool-response tag, or -1."""
    found = [i for i in (text.find(RESPONSE_OPEN, begin, end), text.find(RESPONSE_CLOSE, begin, end)) if i >= 0]
    return min(found, default=-1)


def _reasoning_end(text: str, in_thinking: bool) -> int:
    """Where the reasoning of a turn ends: after its first ``</think>`` when the turn starts
    inside a thinking block, else 0; also 0 when the block never closes (the whole turn is
    then searched, as a turn without reasoning is)."""
    if not (in_thinking or text.lstrip().startswith(THINK_OPEN)):
        return 0
    end = text.find(THINK_CLOSE)
    return 0 if end < 0 else end + len(THINK_CLOSE)


def _parse_call(raw: str, fmt: ToolCallFormat) -> ToolCall | InvalidToolCall:
    """Check the shape around one call (count, closing, trailing text), then its body."""
    if raw.count(CALL_OPEN) > 1:
        return _invalid("multiple_calls", "only one tool call per turn is allowed, so none was "
                        "run. Make a single call and wait for its result.", raw)
    end = raw.find(CALL_CLOSE)
    if end < 0:
        return _invalid("unclosed_call", f"the tool call was never closed with {CALL_CLOSE[1:-1]}"
                        f", so it was not run. {_HINTS[fmt]}", raw)
    call_text = raw[: end + len(CALL_CLOSE)]
    if raw[len(call_text):].strip():
        return _invalid("text_after_call", "nothing may follow the tool call in the same turn, "
                        "so it was not run. End your turn right after the call.", raw)
    body = raw[len(CALL_OPEN):end]
    parse_body = _parse_hermes if fmt is ToolCallFormat.HERMES else _parse_xml
    return parse_body(body, call_text, fmt)


def _parse_hermes(body: str, raw: str, fmt: ToolCallFormat) -> ToolCall | InvalidToolCall:
    try:
        # strict=False accepts raw newlines/tabs inside strings: unambiguous, and the
        # most common slip when a model writes multi-line code into JSON.
        obj = json.loads(body, strict=False)
    except json.JSONDecodeError as err:
        return _invalid("bad_json", f"the JSON could not be parsed ({err.msg} at line "
                        f"{err.lineno} column {err.colno}). {_HINTS[fmt]}", raw)
    if not isinstance(obj, dict) or "name" not in obj or not isinstance(obj.get("arguments"), dict):
        return _invalid("bad_json", "the JSON must be an object with a name and an arguments "
                        f"object. {_HINTS[fmt]}", raw)
    if obj["name"] != TOOL_NAME:
        return _unknown_tool(obj["name"], raw)
    return _check_arguments(obj["arguments"], raw, fmt)


def _parse_xml(body: str, raw: str, fmt: ToolCallFormat) -> ToolCall | InvalidToolCall:
    function = _FUNCTION_RE.fullmatch(body)
    if function is None:
        return _invalid("bad_xml", f"expected one function block inside the tool call. {_HINTS[fmt]}", raw)
    if function[1].strip() != TOOL_NAME:
        return _unknown_tool(function[1].strip(), raw)
    arguments: dict[str, str] = {}
    position = 0
    inner = function[2]
    for parameter in _PARAMETER_RE.finditer(inner):
        name = parameter[1].strip()
        if inner[position:parameter.start()].strip() or name in arguments:
            return _invalid("bad_xml", f"the parameters are malformed. {_HINTS[fmt]}", raw)
        arguments[name] = _strip_one_newline(parameter[2])
        position = parameter.end()
    if inner[position:].strip():
        return _invalid("bad_xml", f"the parameters are malformed. {_HINTS[fmt]}", raw)
    return _check_arguments(arguments, raw, fmt)


def _strip_one_newline(value: str) -> str:
    """Undo the template's ``<parameter=x>\\n`` + value + ``\\n</parameter>`` framing."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _check_arguments(arguments: dict[str, Any], raw: str, fmt: ToolCallFormat) -> ToolCall | InvalidToolCall:
    if "code" not in arguments:
        return _invalid("missing_code", f"the code argument is missing. {_HINTS[fmt]}", raw)
    if set(arguments) != {"code"} or not isinstance(arguments["code"], str):
        return _invalid("bad_arguments", "code_interpreter takes exactly one argument, code, "
                        "a string of Python.", raw)
    if not arguments["code"].strip():
        return _invalid("empty_code", "the code is empty; nothing was run.", raw)
    return ToolCall(code=arguments["code"], raw=raw)


def _unknown_tool(name: Any, raw: str) -> InvalidToolCall:
    shown = str(name)[:40]
    return _invalid("unknown_tool", f"there is no tool named {shown!r}; the only tool is "
                    f"{TOOL_NAME}.", raw)


def _invalid(reason: str, detail: str, raw: str) -> InvalidToolCall:
    return InvalidToolCall(reason=reason, message=f"Invalid tool call: {detail}", raw=raw)


def budget_exhausted_message(max_code_calls: int) -> str:
    """The tool response for a call made after the code-call budget is spent."""
    return (
        f"Tool call not run: the limit of {max_code_calls} code executions for this "
        "problem is reached. Continue without the tool and end with one line "
        "\\boxed{<answer>}."
    )


# ---------------------------------------------------------------- tool output

ZERO_WIDTH_SPACE = "\u200b"

ALWAYS_PROTECTED = (THINK_OPEN, THINK_CLOSE, CALL_OPEN, CALL_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE)
"""Tags neutralised even where neither tokenizer nor template knows them: models meet
them in pretraining data and may read them as structure."""

_TEMPLATE_TAG_RE = re.compile(r"<\|[^|<>\s]{1,64}\|>|</?[A-Za-z_][\w.\-]{0,63}(?:>|=)")
"""Structural tags in a template's source: ``<|im_end|>``, ``</tool_response>``, ``<function=``."""


class ToolOutputSanitizer:
    """Neutralises every string that could forge structure in tool output.

    Protected strings: the content of every added token of the tokenizer (special or
    not: ``<|im_end|>``, ``<tool_call>``, ``<think>`` …), every special token, every
    structural tag found in the chat template's source (with a Hermes override on
    SmolLM2, ``<tool_response>`` is plain text yet still structure) and
    :data:`ALWAYS_PROTECTED`. Each occurrence is broken by a zero-width space after its
    first character, repeatedly until none is left, so the result can never tokenise to
    one of those tokens; removing the zero-width spaces gives back the original text.
    Build it once per tokenizer/template; calling it is cheap.

    Not covered: single-character added tokens (cannot be split) and added tokens
    matched after normalisation in a different surface form.
    """

    def __init__(self, tokenizer: Any, chat_template: str) -> None:
        self.tokenizer = tokenizer
        self.protected = tuple(sorted(_protected_strings(tokenizer, chat_template), key=lambda s: (-len(s), s)))
        self._pattern = re.compile("|".join(map(re.escape, self.protected))) if self.protected else None

    def __call__(self, text: str) -> str:
        # Terminates: each pass breaks at least one occurrence, and inserting a
        # zero-width space cannot create an occurrence of a string that has none.
        while self._pattern is not None and self._pattern.search(text):
            text = self._pattern.sub(lambda m: m[0][0] + ZERO_WIDTH_SPACE + m[0][1:], text)
        return text


def _protected_strings(tokenizer: Any, chat_template: str) -> set[str]:
    added = [token.content for token in getattr(tokenizer, "added_tokens_decoder", {}).values()]
    candidates: Iterable[str] = [*added, *tokenizer.all_special_tokens, *ALWAYS_PROTECTED,
                                 *_TEMPLATE_TAG_RE.findall(chat_template)]
    return {s for s in candidates if len(s) >= 2 and s.strip() == s and ZERO_WIDTH_SPACE not in s}


def sanitize_tool_output(text: str, tokenizer: Any, chat_template: str) -> str:
    """One-off form of :class:`ToolOutputSanitizer` (build the class once in loops)."""
    return ToolOutputSanitizer(tokenizer, chat_template)(text)


def truncation_marker(omitted_tokens: int) -> str:
    """The line that replaces the middle of an over-long tool output."""
    return f"\n[... {omitted_tokens} tokens of output omitted ...]\n"


def truncate_tool_output(text: str, tokenizer: Any, max_tokens: int) -> str:
    """Cut ``text`` to at most ``max_tokens`` tokens, keeping its head and tail.

    Text within budget is returned unchanged. Otherwise the middle is replaced by
    :func:`truncation_marker`; the cut follows token boundaries (through the fast
    tokenizer's offsets, so no character is split) and the result, marker included,
    re-encodes to at most ``max_tokens`` tokens.
    """
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoding["offset_mapping"]
    if len(offsets) <= max_tokens:
        return text
    marker_tokens = _count_tokens(tokenizer, truncation_marker(len(offsets)))
    keep = max_tokens - marker_tokens
    if keep < 2:
        raise ValueError(f"max_tokens={max_tokens} leaves no room next to the truncation marker")
    head, tail = keep // 2, keep - keep // 2
    while True:
        head_end, tail_start = _snap_to_lines(text, offsets[head][0], offsets[len(offsets) - tail][0])
        kept = _count_tokens(tokenizer, text[:head_end]) + _count_tokens(tokenizer, text[tail_start:])
        result = text[:head_end] + truncation_marker(len(offsets) - kept) + text[tail_start:]
        excess = _count_tokens(tokenizer, result) - max_tokens
        if excess <= 0:
            return result
        if head + tail <= 2:
            raise ValueError(f"cannot fit the output into max_tokens={max_tokens}")
        # Re-tokenisation at the seams came out longer: give back the excess.
        tail_cut = min(tail - 1, (excess + 1) // 2)
        head_cut = min(head - 1, excess - tail_cut)
        head, tail = head - head_cut, tail - tail_cut


def _snap_to_lines(text: str, head_end: int, tail_start: int) -> tuple[int, int]:
    """Move the cuts to line boundaries when that drops at most a quarter of each side."""
    newline = text.rfind("\n", 0, head_end)
    if newline >= 0 and head_end - (newline + 1) <= head_end // 4:
        head_end = newline + 1
    newline = text.find("\n", tail_start)
    if newline >= 0 and newline + 1 - tail_start <= (len(text) - tail_start) // 4:
        tail_start = newline + 1
    return head_end, tail_start


def _count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def observation_text(result: ExecutionResult) -> str:
    """What the model should read for one execution, before sanitising and truncation."""
    if result.observation.strip():
        return result.observation
    if result.status is ExecStatus.OK:
        return "(no output: print() the values you want to see)"
    return f"(execution ended with status {result.status.value} and no output)"


def tool_message_text(result: ExecutionResult, sanitizer: ToolOutputSanitizer, *, max_tokens: int = 512) -> str:
    """The tool message content for one execution: observation → sanitised → truncated."""
    return truncate_tool_output(sanitizer(observation_text(result)), sanitizer.tokenizer, max_tokens)
