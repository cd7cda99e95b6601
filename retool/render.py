"""Token-exact rendering of tool conversations from a model's own chat template.

Tokens are the source of truth: a trajectory is the prompt tokens, then for
every assistant turn the *sampled* tokens followed by tokens this module appends — the
template's assistant-closing text, the rendered tool message and the next generation
prompt. History is never decoded and re-encoded.

The appended text is learnt from the template itself, by rendering conversations whose
assistant and tool contents are placeholders and cutting the render around them
("placeholder method"). This handles templates that rewrite history (Qwen3.5 trims
assistant content and splits ``</think>``; Qwen3 drops the empty think block of earlier
turns) because only the text *between* contents is used. It needs the template to
render that text the same way at every depth of the conversation and to keep the
placeholders intact; otherwise :class:`TemplateError` names the model and the check
that failed.

Where a template is append-only (Qwen2.5, Qwen3.5, Qwen3-Coder) the incremental tokens
equal the template's render of the whole conversation; where it is not (Qwen3, QwQ)
they are what the model actually saw while sampling, which is what training needs.
``Renderer.append_only`` says which case applies.

Mask and logprobs: sampled tokens carry mask 1 and their sampler logprob; appended
tokens carry mask 0 and 0.0. The end-of-turn token is part of the sampled tokens when
the sampler returned it (mask 1) and appended otherwise (mask 0); the token sequence
is the same either way.

Non-goals: chat templates that interleave tool calls with template-generated text
inside an assistant turn, multimodal content, more than one tool message per turn.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

import jinja2

from retool.protocol import (
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_NAME,
    TemplateError,
    ToolCallFormat,
    ToolOutputSanitizer,
    build_messages,
    check_interpreter,
    detect_format,
    parse_assistant,
    tool_schema,
)
from retool.types import ParsedTurn

__all__ = ["BUNDLED_TEMPLATES", "Renderer", "Segment", "TemplateError", "build_prompt", "load_chat_template"]

BUNDLED_TEMPLATES = {"hermes": "hermes.jinja"}
"""Chat-template overrides shipped in ``retool/assets/chat_templates`` (name → file)."""

_ASSISTANT = ("RETOOLASSISTANTZERO", "RETOOLASSISTANTONE")
_TOOL = ("RETOOLTOOLZERO", "RETOOLTOOLONE")
_QUESTION = "RETOOLQUESTION"
_END_OF_TEXT = "<|endoftext|>"
_PADDING = "\n \n"
"""Placeholders are letters only, so trimming and ``</think>`` splitting leave them intact."""


@dataclass(frozen=True)
class Segment:
    """Tokens appended to a trajectory, with their loss mask and sampler logprobs."""

    tokens: tuple[int, ...]
    mask: tuple[int, ...]
    """1 = sampled by the policy, 0 = template or tool text."""
    logprobs: tuple[float, ...]
    """The sampler's logprob for policy tokens, 0.0 elsewhere."""

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class _Deltas:
    """The template text around contents, learnt from placeholder renders."""

    generation_prompt: str
    """Opens an assistant turn (``<|im_start|>assistant\\n`` …)."""
    final_closing: str
    """Follows the content of the last assistant turn (``<|im_end|>\\n``)."""
    tool_opening: str = ""
    """Follows an assistant turn that called the tool, up to the tool content."""
    tool_closing: str = ""
    """Follows the tool content, through the next generation prompt."""
    trims_tool_content: bool = False
    append_only: bool = True
    opens_thinking: bool = False
    """The generation prompt leaves a ``<think>`` open: a sampled turn starts in reasoning."""


def load_chat_template(spec: str | Path | None, tokenizer: Any = None) -> str:
    """Resolve a chat-template override to template source.

    ``spec`` may be ``None`` (the tokenizer's own template), the name of a bundled
    template (``"hermes"``), a path to a ``.jinja`` file, or the template source itself.
    """
    if spec is None:
        template = getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str) or not template:
            raise TemplateError(f"{_model_name(tokenizer)} has no chat template; pass a chat-template override")
        return template
    if isinstance(spec, str) and spec in BUNDLED_TEMPLATES:
        files = importlib.resources.files("retool") / "assets" / "chat_templates"
        return (files / BUNDLED_TEMPLATES[spec]).read_text(encoding="utf-8")
    if isinstance(spec, Path) or ("{{" not in spec and "{%" not in spec):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise TemplateError(
                f"chat template {str(spec)!r} is neither a bundled template "
                f"({', '.join(BUNDLED_TEMPLATES)}), an existing file, nor Jinja source")
        return path.read_text(encoding="utf-8")
    return spec


class Renderer:
    """Renders prompts and continuations for one tokenizer + chat template.

    Build once per run: the constructor renders a handful of placeholder
    conversations and raises :class:`TemplateError` if the template cannot be used.

    Args:
        tokenizer: a Hugging Face (fast) tokenizer.
        chat_template: override — bundled name, file path or Jinja source (see
            :func:`load_chat_template`); ``None`` uses the tokenizer's template.
        tools: declare ``code_interpreter`` (tool mode) or not (text-only mode).
        interpreter: ``stateless`` or ``stateful`` — which system prompt and tool
            description the conversation carries (:mod:`retool.protocol`); a rollout
            gives each trajectory one interpreter session when it is ``stateful``.
        enable_thinking: passed to templates that have that switch (Qwen3, Qwen3.5).
        model_name: used in error messages; defaults to the tokenizer's name.
    """

    def __init__(self, tokenizer: Any, *, chat_template: str | Path | None = None, tools: bool = True,
                 enable_thinking: bool = False, model_name: str | None = None,
                 interpreter: str = "stateless") -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name or _model_name(tokenizer)
        self.chat_template = load_chat_template(chat_template, tokenizer)
        self.tools = tools
        self.interpreter = check_interpreter(interpreter)
        self.enable_thinking = enable_thinking
        self.tool_format: ToolCallFormat | None = self._tool_format() if tools else None
        self.sanitizer = ToolOutputSanitizer(tokenizer, self.chat_template)
        self._deltas = self._probe()
        self.end_of_turn_id = self._end_of_turn_id()
        self.stop_token_ids = self._stop_token_ids()

    # ------------------------------------------------------------ public API

    @property
    def append_only(self) -> bool:
        """True when incremental tokens equal the template's render of the whole conversation."""
        return self._deltas.append_only

    @property
    def opens_thinking(self) -> bool:
        """True when the template's generation prompt opens a thinking block (QwQ; Qwen3.5
        with thinking on), so every sampled turn starts inside the model's reasoning."""
        return self._deltas.opens_thinking

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        """The template's text for ``messages`` (with the tool declared in tool mode)."""
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tools=[tool_schema(self.interpreter)] if self.tools else None,
                chat_template=self.chat_template,
                tokenize=False, add_generation_prompt=add_generation_prompt, enable_thinking=self.enable_thinking)
        except (jinja2.TemplateError, TypeError, ValueError) as err:  # raise_exception(), bad content …
            raise TemplateError(f"the chat template of {self.model_name} failed to render: {err}") from err

    def messages(self, question: str) -> list[dict[str, str]]:
        """The opening conversation for ``question`` in this renderer's mode (tools, interpreter)."""
        return build_messages(question, tools=self.tools, interpreter=self.interpreter)

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text (template text already holds any BOS it wants)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_tokens(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The tokens of the opening conversation, ending with the generation prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def decode_turn(self, sampled_tokens: Sequence[int]) -> str:
        """The text of a sampled assistant turn, without a trailing stop token."""
        tokens = list(sampled_tokens)
        if tokens and tokens[-1] in self.stop_token_ids:
            tokens.pop()
        # No clean-up: it would rewrite " ," and " 's" inside the model's code.
        return self.tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def parse_turn(self, sampled_tokens: Sequence[int]) -> ParsedTurn:
        """Decode a sampled turn and parse its tool call in this template's format."""
        if self.tool_format is None:
            return ParsedTurn(content=self.decode_turn(sampled_tokens))
        return parse_assistant(self.decode_turn(sampled_tokens), self.tool_format, in_thinking=self.opens_thinking)

    def tool_turn(self, sampled_tokens: Sequence[int], sampled_logprobs: Sequence[float],
                  tool_text: str) -> Segment:
        """An assistant turn that called the tool, plus the tool message and the next
        generation prompt.

        ``tool_text`` is the tool message content, already sanitised and truncated
        (:func:`retool.protocol.tool_message_text`, or an invalid-call message).
        """
        if not self.tools:
            raise ValueError("tool_turn() needs a Renderer built with tools=True")
        if self._deltas.trims_tool_content:
            tool_text = tool_text.strip()
        appended = self._deltas.tool_opening + tool_text + self._deltas.tool_closing
        return self._segment(sampled_tokens, sampled_logprobs, appended)

    def final_turn(self, sampled_tokens: Sequence[int], sampled_logprobs: Sequence[float]) -> Segment:
        """The last assistant turn of a trajectory, closed the way the template closes it."""
        return self._segment(sampled_tokens, sampled_logprobs, self._deltas.final_closing)

    # ------------------------------------------------------------ internals

    def _segment(self, sampled: Sequence[int], logprobs: Sequence[float], appended_text: str) -> Segment:
        if len(sampled) != len(logprobs):
            raise ValueError(f"{len(sampled)} sampled tokens but {len(logprobs)} logprobs")
        appended = self.encode(appended_text)
        if sampled and sampled[-1] == self.end_of_turn_id:
            appended = appended[1:]  # the policy sampled the end-of-turn token itself
        return Segment(
            tokens=(*sampled, *appended),
            mask=(1,) * len(sampled) + (0,) * len(appended),
            logprobs=(*map(float, logprobs), *(0.0,) * len(appended)),
        )

    def _tool_format(self) -> ToolCallFormat:
        try:
            fmt = detect_format(self.chat_template)
        except TemplateError as err:
            raise TemplateError(f"{self.model_name}: {err}") from None
        probe = self.render(self.messages(_QUESTION), add_generation_prompt=True)
        if TOOL_NAME not in probe:
            raise TemplateError(f"the chat template of {self.model_name} ignores tools=: the rendered prompt "
                                "never declares code_interpreter; use a chat-template override such as 'hermes'")
        return fmt

    def _probe(self) -> _Deltas:
        """Learn the template text around contents from placeholder conversations."""
        base = self.messages(_QUESTION)
        prompt = self.render(base, add_generation_prompt=True)
        without = self.render(base, add_generation_prompt=False)
        if not prompt.startswith(without):
            self._fail("the generation prompt is not appended to the conversation")
        generation_prompt = prompt[len(without):]
        one = self._cut(self.render([*base, _assistant(1)], add_generation_prompt=False), _ASSISTANT[1:])
        two = self._cut(self.render([*base, _assistant(0), _tool(0), _assistant(1)], add_generation_prompt=False),
                        (_ASSISTANT[0], _TOOL[0], _ASSISTANT[1]))
        if one[-1] != two[-1]:
            self._fail("the closing of the final assistant turn depends on the turns before it")
        deltas = _Deltas(generation_prompt, final_closing=one[-1], append_only=one[0] == prompt,
                         opens_thinking=generation_prompt.rfind(THINK_OPEN) > generation_prompt.rfind(THINK_CLOSE))
        return self._probe_tool_turns(base, prompt, deltas) if self.tools else deltas

    def _probe_tool_turns(self, base: list[dict[str, Any]], prompt: str, deltas: _Deltas) -> _Deltas:
        """Cut ``base + A1 T1`` and ``base + A0 T0 A1 T1`` (each + generation prompt).

        The text after an assistant content up to the tool content (``tool_opening``)
        and after the tool content to the end (``tool_closing``) must not depend on the
        depth. The template is append-only when its render of the history (before A0,
        between T0 and A1) is exactly what was appended while sampling.
        """
        one_text = self.render([*base, _assistant(1), _tool(1)], add_generation_prompt=True)
        one = self._cut(one_text, (_ASSISTANT[1], _TOOL[1]))
        two = self._cut(self.render([*base, _assistant(0), _tool(0), _assistant(1), _tool(1)],
                                    add_generation_prompt=True), (_ASSISTANT[0], _TOOL[0], _ASSISTANT[1], _TOOL[1]))
        tool_opening, tool_closing = one[1], one[2]
        if not (two[1] == two[3] == tool_opening and two[4] == tool_closing):
            self._fail("the text around an assistant turn or a tool message depends on the turns before it")
        if not tool_closing.endswith(deltas.generation_prompt):
            self._fail("the tool message is not followed by the generation prompt")
        return replace(
            deltas, tool_opening=tool_opening, tool_closing=tool_closing,
            trims_tool_content=self._trims_tool_content(base, one_text),
            append_only=deltas.append_only and two[0] == prompt and two[2] == tool_closing,
        )

    def _trims_tool_content(self, base: list[dict[str, Any]], plain: str) -> bool:
        """Whether the template strips whitespace around tool content (Qwen3.5 does)."""
        padded_content = _PADDING + _TOOL[1] + _PADDING
        padded_tool = {"role": "tool", "content": padded_content, "name": TOOL_NAME}
        padded = self.render([*base, _assistant(1), padded_tool], add_generation_prompt=True)
        if padded == plain.replace(_TOOL[1], padded_content):
            return False
        if padded == plain:
            return True
        self._fail("it rewrites tool message content beyond trimming whitespace")

    def _cut(self, text: str, placeholders: Sequence[str]) -> list[str]:
        """Split ``text`` at each placeholder, which must occur exactly once, in order."""
        pieces = []
        for placeholder in placeholders:
            if text.count(placeholder) != 1:
                self._fail(f"it drops, repeats or rewrites message content (placeholder {placeholder} "
                           f"appears {text.count(placeholder)} times)")
            before, text = text.split(placeholder)
            pieces.append(before)
        return [*pieces, text]

    def _end_of_turn_id(self) -> int:
        closing = self._deltas.final_closing
        tokens = self.encode(closing)
        first = tokens[0] if tokens else None
        added = getattr(self.tokenizer, "added_tokens_decoder", {})
        if first is None or (first not in added and first not in self.tokenizer.all_special_ids):
            self._fail(f"its assistant closing {closing!r} does not start with a special end-of-turn token")
        if self.tools and self.encode(self._deltas.tool_opening)[:1] != [first]:
            self._fail("an assistant turn that calls the tool is closed differently from a final one")
        return first

    def _stop_token_ids(self) -> tuple[int, ...]:
        """End of turn first, then the tokenizer's EOS and ``<|endoftext|>`` when they differ.

        A turn the sampler ended with one of the latter keeps that token (mask 1) and
        still gets the template's full closing appended.
        """
        end_of_text = self.tokenizer.convert_tokens_to_ids(_END_OF_TEXT)
        if self.tokenizer.convert_ids_to_tokens(end_of_text) != _END_OF_TEXT:
            end_of_text = None  # the tokenizer has no such token (the id is its unknown token)
        candidates = (self.end_of_turn_id, getattr(self.tokenizer, "eos_token_id", None), end_of_text)
        return tuple(dict.fromkeys(t for t in candidates if t is not None))

    def _fail(self, why: str) -> NoReturn:
        raise TemplateError(
            f"the chat template of {self.model_name} is not prefix-stable in the way token-exact rendering "
            f"needs: {why}. Use a chat-template override (e.g. the bundled 'hermes' template).")


def build_prompt(tokenizer: Any, messages: Sequence[dict[str, Any]], **renderer_options: Any) -> list[int]:
    """One-off prompt tokens for ``messages`` (build a :class:`Renderer` once in loops)."""
    return Renderer(tokenizer, **renderer_options).prompt_tokens(messages)


def _assistant(i: int) -> dict[str, str]:
    return {"role": "assistant", "content": _ASSISTANT[i]}


def _tool(i: int) -> dict[str, str]:
    return {"role": "tool", "content": _TOOL[i], "name": TOOL_NAME}


def _model_name(tokenizer: Any) -> str:
    name = getattr(tokenizer, "name_or_path", "") if tokenizer is not None else ""
    return f"model {name!r}" if name else "this model"
