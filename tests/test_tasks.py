"""The synthetic arithmetic task: disjoint splits, correct answers, real-sandbox dialogues, CLI."""

from __future__ import annotations

import json
import os

import pytest

from retool import tasks
from retool.data import load_problems
from retool.protocol import STATEFUL_SYSTEM_PROMPT, SYSTEM_PROMPT, TOOL_NAME
from retool.reward import boxed, grade
from retool.sandbox import Sandbox, SandboxConfig
from retool.dialogues import parse_dialogue


@pytest.fixture(scope="module")
def sandbox():
    sb = Sandbox(SandboxConfig(timeout_s=10.0, workers=2))
    yield sb
    sb.close()


def test_draws_are_deterministic_distinct_and_in_their_split():
    first = tasks.make_problems(60, seed=3, split="rl")
    assert first == tasks.make_problems(60, seed=3, split="rl")
    assert first != tasks.make_problems(60, seed=4, split="rl")
    assert len({p.id for p in first}) == 60
    for split in tasks.SPLITS:
        assert all(tasks.split_of(d) == split for d in tasks.draw_problems(40, 0, split))


def test_splits_never_share_a_problem_whatever_the_seeds():
    keys = {split: {(d.kind, d.key) for seed in range(2) for d in tasks.draw_problems(120, seed, split)}
            for split in tasks.SPLITS}
    assert not keys["test"] & keys["sft"]
    assert not keys["test"] & keys["rl"]
    assert not keys["sft"] & keys["rl"]


def test_every_kind_appears_in_every_split():
    for split in tasks.SPLITS:
        for kind in tasks.KINDS:
            draws = tasks.draw_problems(5, 0, split, kinds=[kind])
            assert {d.kind for d in draws} == {kind}


def test_answers_are_what_the_snippets_print_in_the_sandbox(sandbox):
    draws = [d for kind in tasks.KINDS for d in tasks.draw_problems(2, 1, "test", kinds=[kind])]
    for d in draws:
        result = sandbox.run_sync(d.code)
        assert result.ok, (d.code, result.observation)
        assert result.observation.strip() == str(d.answer), d


def test_gold_answers_grade_against_themselves():
    for p in tasks.make_problems(8, seed=0, split="test"):
        assert p.answer.lstrip("-").isdigit()
        assert grade(boxed(p.answer), p.answer).correct


def test_answers_are_beyond_mental_arithmetic():
    """At least a clear majority of answers have many digits or come from big operands."""
    problems = tasks.make_problems(200, seed=0, split="test")
    assert sum(len(p.answer) >= 4 for p in problems) / len(problems) > 0.6


def test_plans_state_the_operands_before_the_call():
    # the copy path question -> plan -> code that a small model can follow (docs/sft.md)
    import re

    for draw in tasks.draw_problems(120, seed=5, split="sft"):
        numbers = re.findall(r"\d+", draw.question)
        operands = [n for n in numbers if n in draw.code]
        assert operands, draw
        assert all(n in draw.plan for n in operands), (draw.plan, draw.code)
        if draw.kind in ("product", "word_problem"):  # the plan holds the code's very expression
            assert draw.code.removeprefix(tasks.PRELUDE).removeprefix("print(").removesuffix(")") in draw.plan


def test_every_snippet_has_the_same_first_line_and_one_print_line():
    # no kind has a setup line of its own: RL taught the demo's model to drop such lines (NameError)
    import contextlib
    import io

    for draw in tasks.draw_problems(200, seed=3, split="sft"):
        first, *rest = draw.code.split("\n")
        assert first + "\n" == tasks.PRELUDE and len(rest) == 1 and rest[0].startswith("print("), draw.code
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(draw.code, {})  # the project's own snippets, not model code
        assert out.getvalue().strip() == str(draw.answer), draw


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="unknown split"):
        tasks.make_problems(3, split="dev")
    with pytest.raises(ValueError, match="unknown problem kind"):
        tasks.make_problems(3, kinds=["factorial"])
    with pytest.raises(ValueError, match="n must be >= 1"):
        tasks.make_problems(0)


def test_an_exhausted_problem_space_is_an_error(monkeypatch):
    def make(x):
        return tasks.Draw("tiny", (x,), f"What is {x} + 1?", f"print({x} + 1)", x + 1, "Plan.", "Done.")

    monkeypatch.setitem(tasks.KINDS, "tiny", lambda rng, level: make(rng.randint(1, 20)))  # 20 problems in all
    available = sum(tasks.split_of(make(x)) == "test" for x in range(1, 21))
    assert 0 < available < 20
    assert len(tasks.make_problems(available, kinds=["tiny"])) == available
    with pytest.raises(ValueError, match=f"could only draw {available} distinct test problems"):
        tasks.make_problems(available + 1, kinds=["tiny"])


def test_sft_conversations_are_valid_tool_dialogues(sandbox):
    rows = tasks.make_sft_conversations(12, seed=5, sandbox=sandbox)
    assert len({r["id"] for r in rows}) == 12
    for row in rows:
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["system", "user", "assistant", "tool", "assistant"]
        assert row["messages"][0]["content"] == SYSTEM_PROMPT
        call = row["messages"][2]["tool_calls"][0]
        assert call["function"]["name"] == TOOL_NAME
        code = json.loads(call["function"]["arguments"])["code"]
        assert row["messages"][3]["content"] == sandbox.run_sync(code).observation
        assert row["messages"][4]["content"].endswith(f"\\boxed{{{row['answer']}}}")
        dialogue = parse_dialogue(row)
        assert dialogue.turns[0].code == code


def test_recovery_dialogues_correct_a_real_error_and_train_only_the_correction(sandbox):
    rows = tasks.make_sft_conversations(60, seed=4, sandbox=sandbox, recovery_share=0.3)
    plain = tasks.make_sft_conversations(60, seed=4, sandbox=sandbox)
    assert [r["id"] for r in rows] == [r["id"] for r in plain]  # the same problems, whatever the share
    recovered = [(r, p) for r, p in zip(rows, plain) if r != p]
    assert 8 <= len(recovered) <= 30
    assert tasks.make_sft_conversations(60, seed=4, sandbox=sandbox, recovery_share=0.3) == rows  # seeded
    errors = set()
    for row, before in recovered:
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
        first, traceback, retry, output, answer = row["messages"][2:]
        mistake, right = (json.loads(m["tool_calls"][0]["function"]["arguments"])["code"] for m in (first, retry))
        assert first["weight"] == 0 and "weight" not in retry and "weight" not in answer
        assert first["content"] == before["messages"][2]["content"]  # the plan, then the mistaken call
        assert right == json.loads(before["messages"][2]["tool_calls"][0]["function"]["arguments"])["code"]
        assert mistake != right and mistake in tasks.mistakes(right)
        result = sandbox.run_sync(mistake)  # the recorded traceback is the sandbox's own
        assert result.status.value == "error" and traceback["content"] == result.observation
        error = traceback["content"].strip().splitlines()[-1].split(":")[0]
        errors.add(error)
        assert retry["content"].startswith(f"The code raised {error}. I fix it: I need ")
        assert output["content"] == before["messages"][3]["content"] and answer == before["messages"][4]
        turns = parse_dialogue(row).turns
        assert [t.weight for t in turns] == [0, 1, 1] and [t.code for t in turns] == [mistake, right, None]
    assert "SyntaxError" in errors


def test_every_mistake_of_every_kind_raises_in_the_sandbox(sandbox):
    for kind in tasks.KINDS:
        draw = tasks.draw_problems(1, 2, "sft", kinds=[kind])[0]
        found = tasks.mistakes(draw.code)
        assert len(found) >= 2 and all(m.startswith(tasks.PRELUDE) for m in found)
        for code in found:
            assert sandbox.run_sync(code).status.value == "error", (kind, code)


def test_recovery_share_is_checked():
    with pytest.raises(ValueError, match="recovery_share must be in"):
        tasks.make_sft_conversations(2, recovery_share=1.5)
    with pytest.raises(ValueError, match="recovery dialogues are stateless"):
        tasks.make_sft_conversations(2, recovery_share=0.5, interpreter="stateful")


def test_a_mistake_that_runs_is_a_generator_bug(sandbox, monkeypatch):
    monkeypatch.setattr(tasks, "mistakes", lambda code: [code])
    with pytest.raises(RuntimeError, match="generator bug: the mistaken snippet"):
        tasks.make_sft_conversations(3, seed=1, sandbox=sandbox, recovery_share=1.0)


def test_a_generator_bug_is_caught_by_the_sandbox_check():
    draw = tasks.draw_problems(1, 0, "sft", kinds=["product"])[0]
    wrong = tasks.Draw(**{**draw.__dict__, "answer": draw.answer + 1})
    with pytest.raises(RuntimeError, match="generator bug"):
        tasks._conversation(wrong, [(draw.plan, draw.code)], [f"{draw.answer}\n"], "stateless")


def test_stateful_dialogues_reuse_variables_and_record_real_outputs(sandbox):
    rows = tasks.make_sft_conversations(len(tasks.KINDS) * 3, seed=7, sandbox=sandbox, interpreter="stateful")
    kinds = set()
    for row in rows:
        kinds.add(row["id"].split("-")[1])
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
        assert row["messages"][0]["content"] == STATEFUL_SYSTEM_PROMPT
        setup, compute = (json.loads(row["messages"][i]["tool_calls"][0]["function"]["arguments"])["code"]
                          for i in (2, 4))
        assert setup.startswith(tasks.PRELUDE) and not compute.startswith(tasks.PRELUDE)
        with sandbox.session() as session:  # the recorded outputs are what a session prints
            assert [session.run_sync(setup).observation, session.run_sync(compute).observation] == \
                [row["messages"][3]["content"], row["messages"][5]["content"]]
        assert row["messages"][5]["content"].strip() == row["answer"]
        alone = sandbox.run_sync(compute)  # the second call relies on the first's variables
        assert alone.status.value == "error" and "NameError" in alone.observation
        assert [t.code for t in parse_dialogue(row).turns if t.code] == [setup, compute]
    assert len(kinds) >= 6
    # each plan states what its call computes: the first the stateless plan (the expression with
    # the question's numbers), the second the expression over the variables
    for row, draw in zip(rows, tasks.draw_problems(len(rows), 7, "sft")):
        assert row["id"] == tasks._problem(draw).id
        assert row["messages"][2]["content"].startswith(draw.plan + " ")
        compute = json.loads(row["messages"][4]["tool_calls"][0]["function"]["arguments"])["code"]
        if row["id"].split("-")[1] == "word_problem":
            assert compute.removeprefix("print(").removesuffix(")") in row["messages"][4]["content"]


def test_cli_writes_stateful_dialogues(tmp_path):
    from retool.cli import main

    out = tmp_path / "sft.jsonl"
    assert main(["task-data", "--n", "2", "--interpreter", "stateful", "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(len(r["messages"]) == 7 for r in rows)


def test_cli_writes_dialogues_and_loadable_problems(tmp_path, capsys):
    from retool.cli import main

    for split, n in (("sft", 3), ("test", 5)):
        out = tmp_path / f"{split}.jsonl"
        assert main(["task-data", "--split", split, "--n", str(n), "--output", str(out)]) == 0
        assert len(out.read_text().splitlines()) == n
        assert out.stat().st_mode & 0o777 == 0o666 & ~_umask()  # the normal umask, not 0600
    problems = load_problems(tmp_path / "test.jsonl")
    assert [p.id for p in problems] == [p.id for p in tasks.make_problems(5, 0, "test")]
    assert main(["task-data", "--kinds", "nope", "--output", str(tmp_path / "x.jsonl")]) == 2
    assert "unknown problem kind" in capsys.readouterr().err
    assert main(["task-data", "--split", "test", "--recovery-share", "0.2", "--output", str(tmp_path / "y.jsonl")]) == 2
    assert capsys.readouterr().err == "error: --recovery-share applies to the 'sft' split (dialogues)\n"
    out = tmp_path / "rec.jsonl"
    assert main(["task-data", "--n", "8", "--recovery-share", "1", "--output", str(out)]) == 0
    assert all(len(json.loads(line)["messages"]) == 7 for line in out.read_text().splitlines())


def test_cli_unwritable_output_is_one_line(tmp_path, capsys):
    from retool.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("keep me")
    assert main(["task-data", "--split", "test", "--n", "2", "--output", str(blocker / "x.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write") and len(err.strip().splitlines()) == 1
    assert blocker.read_text() == "keep me"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------- difficulty levels


def test_level_zero_is_the_default_task_and_higher_levels_copy_more_digits():
    import re

    assert tasks.make_problems(40, 2, "rl", difficulty={k: 0 for k in tasks.KINDS}) == tasks.make_problems(40, 2, "rl")
    for kind in tasks.KINDS:
        easy = tasks.draw_problems(30, 4, "rl", kinds=[kind])
        hard = tasks.draw_problems(30, 4, "rl", kinds=[kind], difficulty={kind: 2})
        digits = [sum(len(n) for d in draws for n in re.findall(r"\d+", d.code.removeprefix(tasks.PRELUDE)))
                  / len(draws) for draws in (easy, hard)]
        assert digits[1] > digits[0] + 0.5, (kind, digits)  # more digits to copy


def test_hard_snippets_print_their_answers_in_the_sandbox(sandbox):
    draws = [d for kind in tasks.KINDS for d in tasks.draw_problems(2, 1, "test", kinds=[kind],
                                                                    difficulty={kind: tasks.MAX_LEVEL})]
    for d in draws:
        result = sandbox.run_sync(d.code)
        assert result.ok, (d.code, result.observation)
        assert result.observation.strip() == str(d.answer), d


def test_problems_name_their_kind_and_a_word_problem_its_story_as_data_source():
    problems = tasks.make_problems(120, 0, "rl")
    stories = {"warehouse": "crates", "printer": "printer", "cartons": "eggs", "pencils": "pencils", "route": "cyclist"}
    assert {p.data_source for p in problems} == {
        f"{tasks.DATA_SOURCE}/{kind}" for kind in tasks.KINDS if kind != "word_problem"} | {
        f"{tasks.DATA_SOURCE}/word_problem/{story}" for story in stories}
    for p in problems:
        kind = p.id.split("-")[1]
        if kind == "word_problem":
            assert stories[p.data_source.rsplit("/", 1)[1]] in p.question, (p.data_source, p.question)
        else:
            assert p.data_source == f"{tasks.DATA_SOURCE}/{kind}"


@pytest.mark.parametrize("text, message", [
    ("product=9", "levels must be 0..2"), ("factorial=1", "unknown problem kind"),
    ("product", "the level must be an integer"), ("product=x", "the level must be an integer"),
    ("product=1,gcd", "write kind=level"),
])
def test_bad_difficulty_is_one_line(text, message, tmp_path, capsys):
    from retool.cli import main

    with pytest.raises(ValueError, match=message):
        tasks.parse_difficulty(text)
    assert main(["task-data", "--split", "rl", "--difficulty", text, "--output", str(tmp_path / "x.jsonl")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_difficulty_parses_per_kind_or_for_all():
    assert tasks.parse_difficulty("") == {}
    assert tasks.parse_difficulty("product=1, word_problem=2") == {"product": 1, "word_problem": 2}
    assert tasks.parse_difficulty("1") == dict.fromkeys(tasks.KINDS, 1)
