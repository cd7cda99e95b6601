"""Tests of the outcome reward (retool/reward.py), its grader pool (retool/grader_pool.py)
and ``retool grade`` (retool/grade_command.py).

The table's verdicts were written by hand from mathematical truth and the reward's rules
(last 300 characters, last ``\\boxed{``, no box → unformatted), not produced by the code
under test. Where ``math_verify`` 0.9.0 disagrees with mathematical truth the row says
so (``DIVERGES``) and expects ``math_verify``'s verdict: the reward is defined as
``math_verify``'s verdict, and a reward that silently patched it would no longer be the
reward the seed's numbers were measured with.
"""

from __future__ import annotations

import asyncio
import functools
import io
import json
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from retool import grader_pool, reward
from retool.grader_pool import GraderPool
from retool.reward import GoldAnswerError, extract_boxed

B = reward.boxed
FILLER = "x" * 300  # pushes anything before it out of the 300-character window

# (category, response, gold, expected_correct, expected_formatted)
TABLE: list[tuple[str, str, str, bool, bool]] = [
    # fractions
    ("fractions", B(r"\frac{1}{2}"), r"\frac{1}{2}", True, True),
    ("fractions", B(r"\frac{2}{4}"), r"\frac12", True, True),
    ("fractions", B("0.5"), r"\frac{1}{2}", True, True),
    ("fractions", B("1/3"), r"\frac{1}{3}", True, True),
    ("fractions", B(r"\frac{1}{3}"), r"\frac{1}{2}", False, True),
    ("fractions", B(r"\frac{14}{3}"), r"\frac{14}{3}", True, True),
    ("fractions", B("0.33"), r"\frac{1}{3}", False, True),
    # \dfrac and \tfrac
    ("dfrac", B(r"\dfrac{1}{2}"), r"\frac{1}{2}", True, True),
    ("dfrac", B(r"\frac{3}{4}"), r"\dfrac{3}{4}", True, True),
    ("dfrac", B(r"\dfrac{7}{2}"), "3.5", True, True),
    ("dfrac", B(r"\tfrac{5}{6}"), r"\frac{5}{6}", True, True),
    ("dfrac", B(r"\dfrac{2}{3}"), r"\frac{3}{2}", False, True),
    # radicals
    ("radicals", B(r"2\sqrt{2}"), r"\sqrt{8}", True, True),
    ("radicals", B(r"\frac{\sqrt{2}}{2}"), r"\frac{1}{\sqrt{2}}", True, True),
    ("radicals", B(r"\sqrt{3}"), r"\sqrt{2}", False, True),
    ("radicals", B(r"3\sqrt[3]{2}"), r"\sqrt[3]{54}", True, True),
    ("radicals", B("1.414"), r"\sqrt{2}", False, True),  # a rounding is not the number
    ("radicals", B(r"\sqrt{12}"), r"2\sqrt3", True, True),
    # pi
    ("pi", B(r"2\pi"), r"2\pi", True, True),
    ("pi", B(r"\frac{\pi}{2}"), r"\pi/2", True, True),
    ("pi", B("3.14"), r"\pi", False, True),
    ("pi", B(r"\pi"), r"2\pi", False, True),
    ("pi", B(r"\frac{3\pi}{4}"), r"\frac34\pi", True, True),
    ("pi", B(r"6\pi"), r"6 \pi", True, True),
    # intervals
    ("intervals", B("[1,2)"), "[1,2)", True, True),
    ("intervals", B("(1,2)"), "[1,2)", False, True),
    ("intervals", B(r"(-\infty, 3]"), r"(-\infty,3]", True, True),
    ("intervals", B("[2,5]"), "[2, 5]", True, True),
    ("intervals", B(r"(-\infty,0)\cup(1,\infty)"), r"(-\infty, 0) \cup (1, \infty)", True, True),
    ("intervals", B("[0,1]"), "[0,2]", False, True),
    # tuples
    ("tuples", B(r"(3, \frac{\pi}{2})"), r"\left( 3, \frac{\pi}{2} \right)", True, True),
    ("tuples", B("(2,1)"), "(1,2)", False, True),
    ("tuples", B("(1,2,3)"), "(1, 2, 3)", True, True),
    ("tuples", B("(1,3,2)"), "(1,2,3)", False, True),
    ("tuples", B(r"(\frac12, -1)"), "(0.5,-1)", True, True),
    # percent: math_verify is lenient, "10\%" and 10 are one answer (the
    # question asks "what percent"); 0.1 = 10% is also plain truth.
    ("percent", B(r"10\%"), "10", True, True),
    ("percent", B("10"), r"10\%", True, True),
    ("percent", B(r"25\%"), r"25\%", True, True),
    ("percent", B("0.1"), r"10\%", True, True),
    ("percent", B(r"20\%"), r"10\%", False, True),
    # degrees
    ("degrees", B(r"336^\circ"), "336", True, True),
    ("degrees", B("45"), r"45^\circ", True, True),
    ("degrees", B(r"45^{\circ}"), r"45^\circ", True, True),
    ("degrees", B(r"30^\circ"), "60", False, True),
    # DIVERGES: 90° is π/2 radians, but math_verify reads degrees as plain numbers
    # (convert_degrees=False), so 90 ≠ π/2 here. Kept: answers are given in the unit
    # the question asks for, and patching this would change every degree answer.
    ("degrees", B(r"90^\circ"), r"\frac{\pi}{2}", False, True),
    # units
    ("units", B(r"5\text{ cm}"), "5", True, True),
    ("units", B(r"\$5"), "5", True, True),
    ("units", B(r"18\text{ m}^2"), "18", True, True),
    ("units", B(r"12 \text{ inches}"), "12", True, True),
    ("units", B(r"7\text{ cm}"), "5", False, True),
    ("units", B(r"5 \mbox{ dollars}"), "5", True, True),
    # x= (math_verify is lenient: "x=4" equals 4)
    ("x=", B("x=4"), "4", True, True),
    ("x=", B("x = 4"), "4", True, True),
    ("x=", B("4"), "x=4", True, True),
    ("x=", B("x=5"), "4", False, True),
    ("x=", B("y=4"), "x=4", False, True),
    ("x=", B(r"k=\frac{1}{2}"), r"\frac{1}{2}", True, True),
    # leading zeros (AIME answers are sometimes written 007)
    ("leading zeros", B("007"), "7", True, True),
    ("leading zeros", B("7"), "007", True, True),
    ("leading zeros", B("0.50"), r"\frac{1}{2}", True, True),
    ("leading zeros", B("070"), "7", False, True),
    ("leading zeros", B("00"), "0", True, True),
    # spaces
    ("spaces", B(" 42 "), "42", True, True),
    ("spaces", B("1 + 1"), "2", True, True),
    ("spaces", B(r"\frac {1} {2}"), r"\frac{1}{2}", True, True),
    ("spaces", "The answer is " + B(" 3 ") + ".\n\n", "3", True, True),
    ("spaces", B("1,000"), "1000", True, True),
    # DIVERGES (two rows): a thin space or a space as thousands separator means 1000,
    # but math_verify reads "1\,000" and "1 000" as the product 1·000 = 0.
    ("spaces", B(r"1\,000"), "1000", False, True),
    ("spaces", B("1 000"), "1000", False, True),
    # nested braces
    ("nested braces", B(r"\frac{1}{\sqrt{2}}"), r"\frac{\sqrt2}{2}", True, True),
    ("nested braces", B("{5}"), "5", True, True),
    ("nested braces", B(r"\{1,2\}"), r"\{1, 2\}", True, True),
    ("nested braces", B("2^{10}"), "1024", True, True),
    ("nested braces", B(r"\frac{\frac{1}{2}}{2}"), r"\frac14", True, True),
    ("nested braces", B(B("6")), "6", True, True),  # the inner box is the last one
    # multiple boxes: only the last counts
    ("multiple boxes", B("3") + " ... so " + B("5"), "5", True, True),
    ("multiple boxes", B("5") + " ... wait, " + B("3"), "5", False, True),
    ("multiple boxes", f"First {B('1')}, then {B('2')}, finally {B('3')}", "3", True, True),
    ("multiple boxes", f"{B('2')} and {B('3')}", "2, 3", False, True),
    ("multiple boxes", f"{B('3')}\n{B('3')}", "3", True, True),
    # box outside the 300-character window
    ("outside window", B("5") + FILLER, "5", False, False),
    ("outside window", B("5") + "x" * 291, "5", True, True),  # exactly 300 characters
    ("outside window", B("5") + "x" * 292, "5", False, False),  # the backslash is out
    ("outside window", B("5") + FILLER + " The answer is 5.", "5", False, False),
    ("outside window", B("123") + "x" * 296, "123", False, False),  # "\boxed{" cut off
    ("outside window", B("7") + FILLER + B("5"), "5", True, True),
    # unclosed box: the last \boxed{ must close, else there is no answer
    ("unclosed box", r"\boxed{5", "5", False, False),
    ("unclosed box", r"\boxed{\frac{1}{2}", r"\frac12", False, False),
    ("unclosed box", B("3") + r" then \boxed{5", "3", False, False),
    ("unclosed box", r"\boxed{5\}", "5", False, False),  # \} is an escaped brace
    ("unclosed box", r"\boxed{}", "0", False, False),  # empty: no answer either
    # no box at all (math_verify's last-number fallback must not be used)
    ("no box", "The answer is 5.", "5", False, False),
    ("no box", "$5$", "5", False, False),
    ("no box", r"\boxed 5", "5", False, False),
    ("no box", r"\fbox{5}", "5", False, False),
    ("no box", "", "5", False, False),
    ("no box", "Answer: 42", "42", False, False),
    # plain integers (the fast path's territory)
    ("integers", B("42"), "42", True, True),
    ("integers", B("-3"), "-3", True, True),
    ("integers", B("+5"), "5", True, True),
    ("integers", B("-0"), "0", True, True),
    ("integers", B("43"), "42", False, True),
    ("integers", B("-5"), "5", False, True),
    ("integers", B("12345678901234567890123"), "12345678901234567890123", True, True),
    ("integers", B("12345678901234567890123"), "12345678901234567890124", False, True),
]

IDS = [f"{i:03d}-{row[0]}" for i, row in enumerate(TABLE)]


@pytest.fixture(scope="module")
def pool():
    with GraderPool(2) as grader:
        grader.start()
        yield grader


@pytest.fixture(scope="module")
def slow_pool():
    with GraderPool(2, fast_path=False) as grader:
        yield grader


def test_correct_table_rows_are_wrong_against_another_gold(pool):
    """The table's "correct" verdicts are not a grader that says yes to anything: each
    response it grades correct is wrong (and still formatted) against a different gold."""
    rows = [row for row in TABLE if row[3]]
    grades = reward.grade_many([r[1] for r in rows], ["987654321"] * len(rows), pool=pool)
    wrong = [f"{row[0]}: {row[1][-60:]!r}" for row, g in zip(rows, grades)
             if g.correct or not g.formatted or g.reward != -1.0]
    assert not wrong, "\n".join(wrong)


def test_table_verdicts(pool):
    grades = reward.grade_many([r[1] for r in TABLE], [r[2] for r in TABLE], pool=pool)
    wrong = [
        f"{case_id}: {row[1][-60:]!r} vs {row[2]!r}: got {g}"
        for case_id, row, g in zip(IDS, TABLE, grades)
        if (g.correct, g.formatted) != (row[3], row[4]) or g.reward != (1.0 if row[3] else -1.0)
    ]
    assert not wrong, "\n".join(wrong)
    assert all(g.grader_error is None for g in grades)


def test_verdicts_identical_to_plain_math_verify(pool, slow_pool):
    """Fast path on, fast path off and math_verify itself agree on every boxed row."""
    from math_verify import parse, verify

    rows = [(r[1], r[2]) for r in TABLE if extract_boxed(r[1]) is not None]
    fast = reward.grade_many([r[0] for r in rows], [r[1] for r in rows], pool=pool)
    slow = reward.grade_many([r[0] for r in rows], [r[1] for r in rows], pool=slow_pool)
    for (response, gold), f, s in zip(rows, fast, slow):
        answer = extract_boxed(response)
        plain = verify(parse(f"${gold}$"), parse(f"${answer}$"))
        assert f.correct == s.correct == plain, (answer, gold)
        shortcut = grader_pool.plain_integer_verdict(answer, gold)
        assert shortcut is None or shortcut == plain, (answer, gold)
    assert sum(grader_pool.plain_integer_verdict(extract_boxed(r), g) is not None for r, g in rows) >= 10


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"\boxed{a}\boxed{b}", "b"),
        (r"\boxed{\\}", "\\\\"),  # "\\" is an escaped backslash; the brace closes
        (r"\boxed{\\{x\}}", None),
        (r"x \boxed{ \left\{ 1 \right\} }", r"\left\{ 1 \right\}"),
        (r"\boxed{   }", None),
        ("no box here", None),
    ],
)
def test_extract_boxed_edges(text, expected):
    assert extract_boxed(text) == expected


def test_extract_boxed_window_is_configurable():
    text = B("5") + "x" * 400
    assert extract_boxed(text) is None
    assert extract_boxed(text, window=500) == "5"
    assert extract_boxed(text, window=0) == "5"  # 0 = the whole text


def test_pathological_answer_is_bounded_and_does_not_lose_other_tasks(pool):
    before = {w.proc.pid for w in pool._workers}
    responses = [B("9^{9^{9^{9}}}")] + [B(f"\\frac{{{n}}}{{1}}") for n in range(10)]
    golds = ["1"] + [str(n) for n in range(10)]
    started = time.monotonic()
    grades = reward.grade_many(responses, golds, timeout_s=1.5, pool=pool)
    elapsed = time.monotonic() - started
    assert grades[0].reward == -1.0 and grades[0].formatted and not grades[0].correct
    assert grades[0].grader_error == "timeout after 1.5 s"
    assert all(g.correct for g in grades[1:])
    assert elapsed < 1.5 + 6.0  # the bound plus a replacement worker's start-up
    killed = before - {w.proc.pid for w in pool._workers}
    assert len(killed) == 1
    assert not any(os.path.exists(f"/proc/{pid}") for pid in killed)  # reaped: no zombie
    assert reward.grade(B("2"), "2", pool=pool).correct  # the pool recovered


def test_worker_killed_from_outside_is_a_grader_error(pool):
    pool.start()
    victims = list(pool._workers)

    def kill_soon():
        time.sleep(0.5)
        for worker in victims:
            if worker.proc.poll() is None:
                os.kill(worker.proc.pid, signal.SIGKILL)

    threading.Thread(target=kill_soon).start()
    grade = reward.grade(B("9^{9^{9^{9}}}"), "1", timeout_s=30, pool=pool)
    assert not grade.correct and grade.formatted
    assert grade.grader_error == "grader process died (exit code -9)"
    assert reward.grade(B(r"\frac{6}{2}"), "3", pool=pool).correct


def test_1000_integer_answers_from_threads(pool, slow_pool):
    golds = [str(n) for n in range(1000)]
    responses = [f"Thinking... {B(str(n if n % 3 else n + 1))}" for n in range(1000)]
    expected = [n % 3 != 0 for n in range(1000)]
    for grader in (pool, slow_pool):
        with ThreadPoolExecutor(8) as threads:
            grades = list(threads.map(functools.partial(reward.grade, pool=grader), responses, golds))
        assert [g.correct for g in grades] == expected
        assert all(g.grader_error is None for g in grades)


def test_module_api_from_asyncio():
    async def main():
        single = await reward.agrade(B(r"\dfrac{1}{2}"), "0.5")
        many = await reward.agrade_many([B("1"), B("x=2"), "none"], ["1", "2", "3"])
        gathered = await asyncio.gather(*(reward.agrade(B(str(n)), str(n)) for n in range(8)))
        return single, many, gathered

    single, many, gathered = asyncio.run(main())
    assert single.correct
    assert [(g.correct, g.formatted) for g in many] == [(True, True), (True, True), (False, False)]
    assert all(g.correct for g in gathered)


def _grade_in_child(args):
    response, gold = args
    return reward.grade(response, gold)


def test_grading_inside_daemonic_and_forked_processes():
    reward.grade(B("1"), "1")  # the parent's default pool is warm before forking
    parent_workers = {w.proc.pid for w in grader_pool.default_pool()._workers}
    tasks = [(B(r"\sqrt{4}"), "2"), (B("3"), "4")]
    for method in ("spawn", "fork"):
        with multiprocessing.get_context(method).Pool(1) as children:  # daemonic workers
            grades = children.map(_grade_in_child, tasks)
        assert [g.correct for g in grades] == [True, False], method
    assert {w.proc.pid for w in grader_pool.default_pool()._workers} == parent_workers
    assert reward.grade(B(r"\sqrt{9}"), "3").correct


def test_gold_errors():
    with pytest.raises(GoldAnswerError, match="extracts nothing"):
        reward.grade(B("1"), "$")
    with pytest.raises(GoldAnswerError, match=r"golds\[1\]"):
        reward.grade_many([B("1"), B("1")], ["1", "$"])
    assert reward.grade("no box", "$").formatted is False  # no answer: gold not consulted
    problems = reward.check_golds([r"\frac{14}{3}", "", r"\frac{1", "$", "x" * 300, "(3, \\frac{\\pi}{2})"])
    assert problems[0] is None and problems[5] is None
    assert "empty" in problems[1].reason
    assert "braces" in problems[2].reason
    assert "extracts nothing" in problems[3].reason
    assert "window" in problems[4].reason
    reward.check_gold(r"\text{Evelyn}")
    with pytest.raises(GoldAnswerError):
        reward.check_gold("")


def test_bad_arguments():
    with pytest.raises(ValueError, match="2 responses but 1 golds"):
        reward.grade_many([B("1"), B("2")], ["1"])
    with pytest.raises(TypeError):
        reward.grade(B("1"), 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s"):
        reward.grade(B("1"), "1", timeout_s=0)


def test_closed_pool_refuses_work_and_reaps_workers():
    grader = GraderPool(1, fast_path=False)
    assert reward.grade(B("2"), "2", pool=grader).correct
    pids = [w.proc.pid for w in grader._workers]
    grader.close()
    assert pids and not any(os.path.exists(f"/proc/{pid}") for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        reward.grade(B("2"), "2", pool=grader)


# ---------------------------------------------------------------- retool grade


def _run_cli(argv, stdin_text=None, monkeypatch=None):
    """``retool grade …`` through retool's real command line."""
    from retool.cli import main

    if stdin_text is not None:
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin_text.encode())))
    return main(["grade", *argv])


def test_cli_grades_file_in_order_and_reports_bad_lines(tmp_path, capsys):
    lines = [
        json.dumps({"response": "so " + B(r"\frac{1}{2}"), "gold": "0.5"}),
        "{not json",
        json.dumps({"response": B("7")}),
        "",
        json.dumps({"response": B("7"), "gold": 7}),
        json.dumps({"response": "no box", "gold": "7"}),
        json.dumps({"response": B("1"), "gold": "$"}),
        json.dumps({"response": B("9^{9^{9^{9}}}"), "gold": "1"}),
        json.dumps({"response": B("x"), "gold": ["x"]}),
    ]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(("\n".join(lines) + "\n").encode() + b'{"response": "\xff"}\n')
    code = _run_cli(["--input", str(source), "--output", str(target), "--timeout-s", "1.5",
                     "--workers", "2"])
    records = [json.loads(line) for line in target.read_text().splitlines()]
    assert code == 1
    assert [r["line"] for r in records] == [1, 2, 3, 5, 6, 7, 8, 9, 10]
    assert records[0] == {"line": 1, "reward": 1.0, "correct": True, "formatted": True,
                          "answer": r"\frac{1}{2}", "grader_error": None}
    assert "invalid JSON" in records[1]["error"]
    assert "missing field(s) gold" in records[2]["error"]
    assert records[3]["correct"] is True
    assert records[4]["formatted"] is False and records[4]["reward"] == -1.0
    assert "extracts nothing" in records[5]["error"]
    assert records[6]["grader_error"] == "timeout after 1.5 s"
    assert "must be a string or number" in records[7]["error"]
    assert "not valid UTF-8" in records[8]["error"]
    err = capsys.readouterr().err
    assert "line 2:" in err and "9 lines, 2 correct" in err and "5 bad lines" in err


def test_cli_reads_stdin_writes_stdout(monkeypatch, capsys):
    text = "".join(json.dumps({"response": B(str(n)), "gold": "3"}) + "\n" for n in range(5))
    assert _run_cli(["--batch-size", "2"], stdin_text=text, monkeypatch=monkeypatch) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["correct"] for r in out] == [False, False, False, True, False]


@pytest.mark.parametrize("flags, message", [
    (["--timeout-s", "0"], "--timeout-s must be a number of seconds in (0, 3600], got 0"),
    (["--timeout-s", "-1"], "--timeout-s must be a number of seconds in (0, 3600], got -1"),
    (["--timeout-s", "nan"], "--timeout-s must be a number of seconds in (0, 3600], got nan"),
    (["--timeout-s", "inf"], "--timeout-s must be a number of seconds in (0, 3600], got inf"),
    (["--workers", "0"], "--workers must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
])
def test_cli_bad_options_leave_the_output_untouched(flags, message, tmp_path, capsys):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps({"response": B("1"), "gold": "1"}) + "\n")
    target.write_text("earlier results\n")
    assert _run_cli(["--input", str(source), "--output", str(target), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"retool grade: error: {message}") and len(err.strip().splitlines()) == 1
    assert target.read_text() == "earlier results\n"


def test_cli_missing_input_leaves_the_output_untouched(tmp_path, capsys):
    target = tmp_path / "out.jsonl"
    target.write_text("earlier results\n")
    assert _run_cli(["--input", str(tmp_path / "nope.jsonl"), "--output", str(target)]) == 2
    assert "no such file" in capsys.readouterr().err and target.read_text() == "earlier results\n"


def test_cli_empty_input_says_nothing_was_graded(tmp_path, monkeypatch, capsys):
    source = tmp_path / "empty.jsonl"
    source.write_text("\n\n")
    assert _run_cli(["--input", str(source)]) == 1
    assert "nothing was graded" in capsys.readouterr().err
    assert _run_cli([], stdin_text="", monkeypatch=monkeypatch) == 1
    err = capsys.readouterr().err
    assert "nothing was graded: stdin holds no JSONL lines" in err and len(err.strip().splitlines()) == 1
