"""SFT dialogues: reading and validating OpenAI-format dialogues, and their rollout-shaped tokens.

**Token layout = the RL rollout's.** A dialogue becomes exactly the tokens a rollout
would have produced had the policy written its assistant turns: the prompt (mask 0),
then per assistant turn its text and end-of-turn token (mask 1) followed by what
:class:`retool.render.Renderer` appends — the template's closing, the sanitised and
truncated tool message, the next generation prompt (mask 0). The text of a tool-call
turn is the chat template's own render of the OpenAI ``tool_calls`` message, and it
must parse back to the same code with the protocol's parser, or the dialogue is
rejected. So the loss covers assistant tokens only; tool output is never trained on.
An assistant message with ``"weight": 0`` (OpenAI's fine-tuning format has the same key,
0 or 1) stays in the context but is not trained on either: a mistaken call that the
dialogue goes on to correct, for instance, so that the model learns the correction and
not the mistake.

**Input** (JSONL, one dialogue per line): ``{"messages": [...]}`` with an optional
system message, one user message (the question), then assistant turns; an assistant
turn that calls ``code_interpreter`` (one call, ``arguments`` a JSON string or an
object with one ``code`` string) is followed by one ``tool`` message; the last message
is the final assistant answer. Other top-level keys (``id``, ``answer``) are kept for
error messages and otherwise ignored. Anything else is a :class:`ConversationError`
naming the file, line, message and what is wrong — raised before any model loads.
Dialogues longer than ``max_seq_tokens`` are dropped and counted (never silently).

Not covered: multi-turn user dialogues, parallel tool calls, tools other than
``code_interpreter``; the SFT loop itself (:mod:`retool.sft`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retool.jsonl import JsonlError, iter_jsonl
from retool.protocol import TOOL_NAME, TemplateError, parse_assistant, truncate_tool_output
from retool.types import ToolCall

ROLES = ("system", "user", "assistant", "tool")


class ConversationError(ValueError):
    """A dialogue of an SFT file is malformed; the message names file, line and message."""


@dataclass(frozen=True)
class AssistantTurn:
    """One assistant message: its text, and the call it made with the tool's answer."""

    content: str
    code: str | None = None
    """The ``code_interpreter`` call's code; ``None`` for the final answer."""
    tool_output: str | None = None
    """The content of the tool message that answered the call."""
    weight: int = 1
    """1: trained on; 0: context only (the message's ``"weight"`` key)."""


@dataclass(frozen=True)
class Dialogue:
    """One validated SFT dialogue: the opening messages and the assistant turns."""

    where: str
    """``FILE:LINE`` of the source row, for error messages."""
    system: str | None
    question: str
    turns: tuple[AssistantTurn, ...]

    def prompt_messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return [*system, {"role": "user", "content": self.question}]


def load_dialogues(path: str | Path) -> list[Dialogue]:
    """Read and validate every dialogue of a JSONL file (see the module docstring).

    Raises :class:`ConversationError` at the first bad row, ``FileNotFoundError`` for a
    missing file and ``ConversationError`` for a file without dialogues.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"SFT data {path}: no such file (write one with `retool task-data`)")
    try:
        lines = list(iter_jsonl(path))
    except JsonlError as err:
        raise ConversationError(str(err)) from None
    dialogues = [parse_dialogue(line.row, f"{path}:{line.lineno}") for line in lines]
    if not dialogues:
        raise ConversationError(f"{path}: holds no dialogues")
    return dialogues


def parse_dialogue(row: Any, where: str = "<dialogue>") -> Dialogue:
    """Validate one OpenAI-format row ``{"messages": [...]}`` into a :class:`Dialogue`."""
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
        raise ConversationError(f"{where}: expected an object with a 'messages' list")
    messages = row["messages"]
    for i, message in enumerate(messages):
        _check_message(message, f"{where}: message {i}")
    roles = [m["role"] for m in messages]
    start = 1 if roles[:1] == ["system"] else 0
    if roles[start:start + 1] != ["user"]:
        raise ConversationError(f"{where}: a dialogue starts with an optional system message and then one "
                                f"user message (the question); got roles {roles[:2]}")
    turns, i = [], start + 1
    while i < len(messages):
        turn, i = _assistant_turn(messages, i, where)
        turns.append(turn)
    if not turns or turns[-1].code is not None:
        raise ConversationError(f"{where}: the last message must be the final assistant answer "
                                "(an assistant message without tool_calls)")
    if not any(turn.weight for turn in turns):
        raise ConversationError(f"{where}: every assistant message has weight 0: the dialogue would train nothing")
    if not messages[start]["content"].strip():
        raise ConversationError(f"{where}: message {start}: the question (user message) is empty")
    system = messages[0]["content"] if start else None
    return Dialogue(where, system, messages[start]["content"], tuple(turns))


def _check_message(message: Any, where: str) -> None:
    if not isinstance(message, dict) or "role" not in message:
        raise ConversationError(f"{where}: a message must be an object with a 'role'")
    if message["role"] not in ROLES:
        raise ConversationError(f"{where}: unknown role {message['role']!r} (expected one of {', '.join(ROLES)})")
    content = message.get("content")
    if not (isinstance(content, str) or (content is None and message.get("tool_calls"))):
        raise ConversationError(f"{where}: {message['role']} content must be a string")


def _assistant_turn(messages: list[dict[str, Any]], i: int, where: str) -> tuple[AssistantTurn, int]:
    """Parse the assistant message at ``i`` (and its tool message); return the next index."""
    message, here = messages[i], f"{where}: message {i}"
    if message["role"] != "assistant":
        what = "a tool message without a preceding tool call" if message["role"] == "tool" else \
            f"a {message['role']} message after the question"
        raise ConversationError(f"{here}: {what}; only assistant turns (each call followed by its tool "
                                "message) may follow the question")
    content = message.get("content") or ""
    calls = message.get("tool_calls") or []
    weight = message.get("weight", 1)
    if type(weight) is not int or weight not in (0, 1):  # noqa: E721 -- True/1.0 are not weights
        raise ConversationError(f"{here}: weight must be 0 or 1, got {weight!r}")
    if not calls:
        if not content.strip():
            raise ConversationError(f"{here}: empty assistant turn (no content and no tool call)")
        return AssistantTurn(content, weight=weight), i + 1
    code = _call_code(calls, here)
    if i + 1 >= len(messages) or messages[i + 1]["role"] != "tool":
        raise ConversationError(f"{here}: the tool call is not followed by a tool message with its output")
    tool = messages[i + 1]
    call_id = calls[0].get("id") if isinstance(calls[0], dict) else None
    if call_id and tool.get("tool_call_id") and tool["tool_call_id"] != call_id:
        raise ConversationError(f"{where}: message {i + 1}: tool_call_id {tool['tool_call_id']!r} does not "
                                f"answer the call {call_id!r} before it")
    return AssistantTurn(content, code, tool["content"], weight), i + 2


def _call_code(calls: Any, where: str) -> str:
    """The code of the single ``code_interpreter`` call in ``tool_calls``."""
    if not isinstance(calls, list) or len(calls) != 1:
        raise ConversationError(f"{where}: exactly one tool call per assistant turn is supported "
                                f"(the protocol runs one call per turn)")
    call = calls[0]
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise ConversationError(f"{where}: a tool call must be an object with a 'function'")
    if function.get("name") != TOOL_NAME:
        raise ConversationError(f"{where}: tool call names {function.get('name')!r}; the only tool is {TOOL_NAME}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            raise ConversationError(f"{where}: tool call arguments are not valid JSON ({err.msg})") from None
    if not isinstance(arguments, dict) or set(arguments) != {"code"} or not isinstance(arguments["code"], str):
        raise ConversationError(f"{where}: {TOOL_NAME} takes exactly one argument, code (a string)")
    if not arguments["code"].strip():
        raise ConversationError(f"{where}: the tool call's code is empty")
    return arguments["code"]


# ---------------------------------------------------------------- tokens and datums


class AssistantFormatter:
    """The text a policy writes for an assistant message, taken from the chat template.

    A message's text is the template's render of the conversation ending in that
    message, minus the render of the prompt (with its generation prompt) and minus the
    template's closing of a final turn — so a tool call reads exactly as the template
    would show an OpenAI ``tool_calls`` message (Hermes JSON, Qwen3.5 XML …).
    """

    _PLACEHOLDER = "RETOOLSFTCONTENT"

    def __init__(self, renderer: Any) -> None:
        self.renderer = renderer
        self._base = renderer.messages("RETOOLSFTQUESTION")
        self._prefix = renderer.render(self._base, add_generation_prompt=True)
        probe = self._cut({"role": "assistant", "content": self._PLACEHOLDER}, closing="")
        if probe.count(self._PLACEHOLDER) != 1:
            raise _template_error(renderer, "it does not keep assistant content intact")
        self._closing = probe.split(self._PLACEHOLDER)[1]

    def text(self, turn: AssistantTurn) -> str:
        message: dict[str, Any] = {"role": "assistant", "content": turn.content}
        if turn.code is not None:
            message["tool_calls"] = [{"type": "function",
                                      "function": {"name": TOOL_NAME, "arguments": {"code": turn.code}}}]
        return self._cut(message, self._closing)

    def _cut(self, message: dict[str, Any], closing: str) -> str:
        rendered = self.renderer.render([*self._base, message], add_generation_prompt=False)
        if not rendered.startswith(self._prefix) or not rendered.endswith(closing):
            raise _template_error(self.renderer, "an assistant message does not render as the generation "
                                                 "prompt followed by its text and the turn's closing")
        return rendered[len(self._prefix):len(rendered) - len(closing)]


def _template_error(renderer: Any, why: str) -> Exception:
    return TemplateError(f"the chat template of {renderer.model_name} cannot be used for SFT: {why}")


@dataclass(frozen=True)
class DialogueTokens:
    """A dialogue in the rollout's token layout (``mask_T`` 1 = trained)."""

    tokens_T: tuple[int, ...]
    mask_T: tuple[int, ...]
    truncated_tool_outputs: int = 0


def dialogue_tokens(dialogue: Dialogue, renderer: Any, formatter: AssistantFormatter,
                    max_tool_response_tokens: int = 512) -> DialogueTokens:
    """The tokens and loss mask a rollout would have produced for ``dialogue``.

    Raises :class:`ConversationError` when an assistant text does not parse back, with
    the protocol's parser, to the same call (or to no call, for the final answer).
    """
    tokens = renderer.prompt_tokens(dialogue.prompt_messages())
    mask, truncated = [0] * len(tokens), 0
    for k, turn in enumerate(dialogue.turns):
        text = formatter.text(turn)
        _check_round_trip(renderer, text, turn, f"{dialogue.where}: assistant turn {k}")
        sampled = [*renderer.encode(text), renderer.end_of_turn_id]
        zeros = [0.0] * len(sampled)
        if turn.code is None:
            segment = renderer.final_turn(sampled, zeros)
        else:
            clean = renderer.sanitizer(turn.tool_output)
            tool_text = truncate_tool_output(clean, renderer.tokenizer, max_tool_response_tokens)
            truncated += tool_text != clean
            segment = renderer.tool_turn(sampled, zeros, tool_text)
        tokens.extend(segment.tokens)
        mask.extend(segment.mask if turn.weight else [0] * len(segment.mask))
    return DialogueTokens(tuple(tokens), tuple(mask), truncated)


def _check_round_trip(renderer: Any, text: str, turn: AssistantTurn, where: str) -> None:
    parsed = parse_assistant(text, renderer.tool_format, in_thinking=renderer.opens_thinking)
    code = parsed.call.code if isinstance(parsed.call, ToolCall) else None
    if parsed.call is not None and code is None:
        raise ConversationError(f"{where}: the rendered turn holds a malformed tool call "
                                f"({parsed.call.reason}); the policy would be taught a broken call")
    if code != turn.code:
        expected = "no tool call" if turn.code is None else f"a call with code {turn.code!r}"
        raise ConversationError(f"{where}: the rendered turn parses back to "
                                f"{'no tool call' if code is None else repr(code)}, not {expected}")
