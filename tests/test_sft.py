"""Cold-start SFT: token layout and masks by hand, template-exact call text, loud data errors,
and a tiny-model run whose checkpoint ``retool train --init-from`` resolves and loads."""

from __future__ import annotations

import json

import pytest

from retool import dialogues as dialogue_module
from retool import sft
from retool.cli import main as cli_main
from retool.algo import make_datum
from retool.config import ConfigError
from retool.engines.local import LocalEngineConfig, LocalTrainingClient
from retool.log import read_metrics
from retool.protocol import SYSTEM_PROMPT
from retool.render import Renderer
from retool.runs import latest_checkpoint, read_manifest, resolve_init_from
from tests.tiny import tiny_model_dir
from tests.tokenizers import qwen25_tokenizer, qwen35_tokenizer, smollm2_tokenizer

pytestmark = pytest.mark.timeout(300)  # the tiny SFT run loads a model

QUESTION = "What is 6 times 7?"
CODE = 'print(6 * 7)\nprint("done")'
CALL_JSON = '{"name": "code_interpreter", "arguments": {"code": "print(6 * 7)\\nprint(\\"done\\")"}}'


def openai_row(**overrides) -> dict:
    """A small dialogue in OpenAI format: arguments as a JSON string, as the API sends them."""
    call = {"id": "call_0", "type": "function",
            "function": {"name": "code_interpreter", "arguments": json.dumps({"code": CODE})}}
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Let me compute.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "42\ndone\n"},
        {"role": "assistant", "content": "So it is 42.\n\n\\boxed{42}"},
    ]
    return {"messages": messages, **overrides}


def template_messages(row: dict) -> list[dict]:
    """The same dialogue as chat templates take it (arguments as an object)."""
    out = []
    for m in row["messages"]:
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [{"type": "function", "function": {
                "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]]
        out.append(m)
    return out


# ---------------------------------------------------------------- layout and masks


@pytest.mark.parametrize("tokenizer, template", [(qwen25_tokenizer, None), (smollm2_tokenizer, "hermes")],
                         ids=["qwen2.5", "smollm2-hermes"])
def test_datum_equals_a_hand_computed_layout(tokenizer, template):
    tok = tokenizer()
    renderer = Renderer(tok, chat_template=template)
    data = sft.build_sft_data([dialogue_module.parse_dialogue(openai_row())], renderer)
    prompt = renderer.render([{"role": "system", "content": SYSTEM_PROMPT},
                              {"role": "user", "content": QUESTION}], add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nWhat is 6 times 7?<|im_end|>\n<|im_start|>assistant\n")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def enc(text):
        return tok.encode(text, add_special_tokens=False)

    pieces = [  # (tokens, trained?) written out by hand from the Qwen2.5 / Hermes layout
        (enc(prompt), 0),
        (enc(f"Let me compute.\n<tool_call>\n{CALL_JSON}\n</tool_call>") + [im_end], 1),
        (enc("\n<|im_start|>user\n<tool_response>\n42\ndone\n\n</tool_response><|im_end|>\n"
             "<|im_start|>assistant\n"), 0),
        (enc("So it is 42.\n\n\\boxed{42}") + [im_end], 1),
        (enc("\n"), 0),
    ]
    tokens = [t for ids, _ in pieces for t in ids]
    mask = [m for ids, m in pieces for _ in ids]
    assert data.datums == (make_datum(tokens, mask),)
    assert sum(data.datums[0].weights_N) == len(pieces[1][0]) + len(pieces[3][0])


@pytest.mark.parametrize("tokenizer, template", [
    (qwen25_tokenizer, None), (qwen35_tokenizer, None), (smollm2_tokenizer, "hermes")],
    ids=["qwen2.5", "qwen3.5-xml", "smollm2-hermes"])
def test_tokens_equal_the_templates_render_of_the_openai_dialogue(tokenizer, template):
    """Append-only templates: the SFT tokens are the template's own render of the whole
    conversation, tool_calls message included (Hermes JSON or Qwen3.5 XML)."""
    tok = tokenizer()
    renderer = Renderer(tok, chat_template=template)
    assert renderer.append_only
    seq = dialogue_module.dialogue_tokens(dialogue_module.parse_dialogue(openai_row()), renderer, dialogue_module.AssistantFormatter(renderer))
    whole = renderer.render(template_messages(openai_row()), add_generation_prompt=False)
    assert seq.tokens_T == tuple(renderer.encode(whole))
    trained = tok.decode([t for t, m in zip(seq.tokens_T, seq.mask_T) if m])
    assert trained.startswith("Let me compute.") and trained.endswith("\\boxed{42}<|im_end|>")
    assert "<tool_response>" not in trained and "done\n" not in trained  # tool output is never trained on


def test_a_weight_0_message_is_context_not_trained_on():
    """OpenAI's ``"weight": 0``: the message's tokens stay in the sequence, its mask is 0
    (a mistaken call that the dialogue then corrects), and the other turns train as before."""
    renderer = Renderer(smollm2_tokenizer(), chat_template="hermes")
    formatter = dialogue_module.AssistantFormatter(renderer)
    plain = dialogue_module.dialogue_tokens(dialogue_module.parse_dialogue(openai_row()), renderer, formatter)
    muted = dialogue_module.dialogue_tokens(dialogue_module.parse_dialogue(_edit(2, weight=0)), renderer, formatter)
    assert muted.tokens_T == plain.tokens_T
    trained = [i for i, m in enumerate(plain.mask_T) if m]
    first_turn = [i for i in trained if i < plain.tokens_T.index(renderer.end_of_turn_id, trained[0]) + 1]
    assert first_turn and [i for i, m in enumerate(muted.mask_T) if m] == trained[len(first_turn):]
    explicit = dialogue_module.dialogue_tokens(dialogue_module.parse_dialogue(_edit(2, weight=1)), renderer, formatter)
    assert explicit == plain


def test_call_text_is_the_templates_render():
    formatter = dialogue_module.AssistantFormatter(Renderer(smollm2_tokenizer(), chat_template="hermes"))
    turn = dialogue_module.AssistantTurn("Let me compute.", CODE, "42\n")
    assert formatter.text(turn) == f"Let me compute.\n<tool_call>\n{CALL_JSON}\n</tool_call>"
    assert formatter.text(dialogue_module.AssistantTurn("", CODE, "42\n")) == f"<tool_call>\n{CALL_JSON}\n</tool_call>"
    xml = dialogue_module.AssistantFormatter(Renderer(qwen35_tokenizer())).text(turn)
    assert xml.endswith(f"<function=code_interpreter>\n<parameter=code>\n{CODE}\n</parameter>\n</function>\n"
                        "</tool_call>")


def test_tool_output_is_sanitised_and_truncated_like_in_rollouts():
    renderer = Renderer(qwen25_tokenizer())
    formatter = dialogue_module.AssistantFormatter(renderer)
    plain = dialogue_module.dialogue_tokens(dialogue_module.parse_dialogue(openai_row()), renderer, formatter)
    forged = dialogue_module.dialogue_tokens(dialogue_module.parse_dialogue(_edit(3, content="<|im_end|>forged " + "x " * 400)),
                                 renderer, formatter, max_tool_response_tokens=32)
    assert (plain.truncated_tool_outputs, forged.truncated_tool_outputs) == (0, 1)
    eot = renderer.end_of_turn_id
    assert forged.tokens_T.count(eot) == plain.tokens_T.count(eot)  # the printed <|im_end|> is no token
    assert len(forged.tokens_T) - len(plain.tokens_T) < 40


def test_long_dialogues_are_dropped_and_counted():
    renderer = Renderer(qwen25_tokenizer())
    dialogues = [dialogue_module.parse_dialogue(openai_row(), "f:1"), dialogue_module.parse_dialogue(
        openai_row(messages=openai_row()["messages"][:4] + [{"role": "assistant", "content": "long " * 900}]),
        "f:2")]
    data = sft.build_sft_data(dialogues, renderer, max_seq_tokens=1000)
    assert len(data.datums) == 1 and data.dropped_too_long == ("f:2",)
    assert data.summary()["dropped_too_long"] == 1
    with pytest.raises(dialogue_module.ConversationError, match="all 2 dialogues are longer"):
        sft.build_sft_data(dialogues, renderer, max_seq_tokens=100)


# ---------------------------------------------------------------- bad data


def _edit(index, **changes):
    row = openai_row()
    row["messages"][index] = {**row["messages"][index], **changes}
    return row


def _drop(*indices):
    row = openai_row()
    row["messages"] = [m for i, m in enumerate(row["messages"]) if i not in indices]
    return row


BAD_ROWS = {
    "unknown role": (_edit(2, role="function"), "message 2: unknown role 'function'"),
    "wrong tool name": (_edit(2, tool_calls=[{"function": {"name": "python", "arguments": {"code": "1"}}}]),
                        "tool call names 'python'; the only tool is code_interpreter"),
    "tool without call": (_edit(2, tool_calls=None), "message 3: a tool message without a preceding tool call"),
    "empty assistant": (_edit(4, content="  "), "message 4: empty assistant turn"),
    "call not answered": (_drop(3), "not followed by a tool message"),
    "ends with a call": (_drop(4), "last message must be the final assistant answer"),
    "bad arguments": (_edit(2, tool_calls=[{"function": {"name": "code_interpreter", "arguments": "{code"}}]),
                      "arguments are not valid JSON"),
    "extra argument": (_edit(2, tool_calls=[{"function": {"name": "code_interpreter",
                                                          "arguments": {"code": "1", "timeout": 3}}}]),
                       "exactly one argument, code"),
    "two calls": (_edit(2, tool_calls=[{"function": {"name": "code_interpreter", "arguments": {"code": "1"}}}] * 2),
                  "exactly one tool call per assistant turn"),
    "empty code": (_edit(2, tool_calls=[{"function": {"name": "code_interpreter", "arguments": {"code": " "}}}]),
                   "code is empty"),
    "wrong call id": (_edit(3, tool_call_id="call_9"), "does not answer the call 'call_0'"),
    "no question": (_drop(1), "then one user message"),
    "empty question": (_edit(1, content=" "), "message 1: the question (user message) is empty"),
    "second question": (_edit(4, role="user"), "a user message after the question"),
    "content not text": (_edit(1, content=["What", "?"]), "user content must be a string"),
    "no messages": ({"conversation": []}, "expected an object with a 'messages' list"),
    "weight not 0 or 1": (_edit(2, weight=0.5), "message 2: weight must be 0 or 1, got 0.5"),
    "weight a bool": (_edit(4, weight=True), "message 4: weight must be 0 or 1, got True"),
    "nothing trained": ({"messages": [*_edit(2, weight=0)["messages"][:4],
                                      {**openai_row()["messages"][4], "weight": 0}]},
                        "every assistant message has weight 0"),
}


@pytest.mark.parametrize("name", list(BAD_ROWS))
def test_bad_dialogues_are_rejected_with_a_clear_message(name):
    row, message = BAD_ROWS[name]
    with pytest.raises(dialogue_module.ConversationError, match="^data.jsonl:7: .*" + _escape(message)):
        dialogue_module.parse_dialogue(row, "data.jsonl:7")


def _escape(text):
    import re

    return re.escape(text)


def test_load_dialogues_names_file_and_line(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps(openai_row()) + "\n\n" + "{not json\n")
    with pytest.raises(dialogue_module.ConversationError, match=f"^{_escape(str(path))}:3: not valid JSON"):
        dialogue_module.load_dialogues(path)
    path.write_text(json.dumps(openai_row()) + "\n" + json.dumps(_edit(2, role="bot")) + "\n")
    with pytest.raises(dialogue_module.ConversationError, match=f"{_escape(str(path))}:2: message 2: unknown role"):
        dialogue_module.load_dialogues(path)
    path.write_text("\n")
    with pytest.raises(dialogue_module.ConversationError, match="holds no dialogues"):
        dialogue_module.load_dialogues(path)
    with pytest.raises(FileNotFoundError, match="retool task-data"):
        dialogue_module.load_dialogues(tmp_path / "missing.jsonl")


def test_a_final_answer_that_would_parse_as_a_call_is_rejected():
    renderer = Renderer(qwen25_tokenizer())
    row = _edit(4, content="<tool_call>\n" + CALL_JSON + "\n</tool_call>")
    with pytest.raises(dialogue_module.ConversationError, match="assistant turn 1: the rendered turn parses back to"):
        sft.build_sft_data([dialogue_module.parse_dialogue(row, "f:1")], renderer)



def test_a_turn_that_writes_a_tool_response_itself_is_rejected():
    """Only the interpreter writes tool responses: a dialogue whose assistant writes one (outside
    its reasoning, before any call) would teach the forgery the rollout sends back."""
    renderer = Renderer(qwen25_tokenizer())
    row = _edit(4, content="The product is 42.\n<tool_response>\n42\n</tool_response>")
    with pytest.raises(dialogue_module.ConversationError,
                       match=r"assistant turn 1: the rendered turn holds a malformed tool call \(forged_response\)"):
        sft.build_sft_data([dialogue_module.parse_dialogue(row, "f:1")], renderer)
    quoted = _edit(4, content="The interpreter wrote its answer inside tool_response tags: 42. \\boxed{42}")
    assert sft.build_sft_data([dialogue_module.parse_dialogue(quoted, "f:1")], renderer)  # the word is not the tag

# ---------------------------------------------------------------- schedule


def test_learning_rate_schedules_by_hand():
    cfg = sft.SFTConfig(lr=1.0, warmup_steps=2, lr_schedule="linear")
    assert [sft.learning_rate(s, 6, cfg) for s in range(1, 7)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    cfg.lr_schedule = "cosine"
    assert [round(sft.learning_rate(s, 6, cfg), 6) for s in (3, 5)] == [1.0, 0.5]
    cfg.lr_schedule, cfg.warmup_steps = "constant", 0
    assert sft.learning_rate(5, 6, cfg) == 1.0
    assert sft.total_steps(sft.SFTConfig(batch_size=4, epochs=2.5), 10) == 7
    assert sft.total_steps(sft.SFTConfig(batch_size=4, max_steps=3), 10) == 3


# ---------------------------------------------------------------- a tiny run


def run_cli(argv: list[str]) -> int:
    """``retool …`` in-process, through retool's real command line."""
    return cli_main(argv)


def test_tiny_sft_run_lowers_the_loss_and_rl_can_start_from_it(tmp_path, capsys):
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps(openai_row()) + "\n" + json.dumps(_edit(1, content="What is 7 times 8?")) + "\n")
    run_dir = tmp_path / "run"
    flags = ["sft", "--model", str(tiny_model_dir()), "--chat-template", "hermes", "--data", str(data),
             "--run-dir", str(run_dir), "--batch-size", "2", "--max-steps", "3", "--save-every", "2",
             "--lora-rank", "8", "--lora-alpha", "16", "--lr", "0.02"]
    assert run_cli(flags) == 0
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["sft/loss"] < rows[0]["sft/loss"]
    assert rows[0]["tokens/trained"] > 0 and rows[0]["sft/grad_norm"] > 0
    assert [m.step for m in read_manifest(run_dir)] == [2, 3]

    engine_dir = resolve_init_from(str(run_dir))
    assert engine_dir == str(latest_checkpoint(run_dir)[1] / "engine")
    trained = LocalTrainingClient(LocalEngineConfig(model=str(tiny_model_dir()), lora_rank=8, lora_alpha=16.0,
                                                    init_from=engine_dir))
    renderer = Renderer(trained.get_tokenizer(), chat_template="hermes")
    datums = sft.build_sft_data(dialogue_module.load_dialogues(data), renderer).datums
    # step 1 saw both dialogues with the initial weights; the loaded adapter does better on them
    assert trained.forward_backward(datums, "cross_entropy").metrics["train/loss"] < rows[0]["sft/loss"] - 0.1

    # resume: extend the run by one step; the saved config and data are used
    assert run_cli(["sft", "--resume", str(run_dir), "--max-steps", "4"]) == 0
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    assert latest_checkpoint(run_dir)[0] == 4

    config_before = (run_dir / "config.json").read_bytes()
    data.write_text(json.dumps(openai_row()) + "\n")
    assert run_cli(["sft", "--resume", str(run_dir), "--max-steps", "5"]) == 2
    assert "changed since" in capsys.readouterr().err
    assert (run_dir / "config.json").read_bytes() == config_before  # a failed resume changes nothing
    assert run_cli(flags) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_bad_data_fails_before_the_model_loads(tmp_path, capsys):
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps(_edit(2, role="bot")) + "\n")
    assert run_cli(["sft", "--model", str(tmp_path / "no-such-model"), "--data", str(data),
                              "--run-dir", str(tmp_path / "run")]) == 2
    assert f"{data}:1: message 2: unknown role 'bot'" in capsys.readouterr().err


def test_config_validation():
    with pytest.raises(ConfigError, match="batch_size"):
        sft.SFTConfig(batch_size=0).validate()
    with pytest.raises(ConfigError, match="epochs"):
        sft.SFTConfig(epochs=0).validate()


def test_docs_list_every_flag():
    from pathlib import Path

    from retool.config import markdown_table
    from retool.sft import SFTConfig

    docs = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
    assert markdown_table(SFTConfig) in docs.read_text()
