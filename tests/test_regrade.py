"""``retool regrade``: recorded answers graded again into a new file; the original untouched.

A grader change is simulated by a changed gold (``--data``/``--train-data``) and by a
recorded grade that disagrees with what the current grader says.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from retool.cli import main
from retool.data import problems_fingerprint, read_problems
from retool.regrade import final_text
from retool.results import ProblemResult, ResultsHeader, SandboxSettings, read_results, summarize
from retool.runs import save_trajectories
from retool.serialize import to_jsonable
from retool.types import ExecStatus, ExecutionResult, Grade, StopReason, ToolCall, ToolExchange, Trajectory, Turn


def traj(pid: str, boxed: str | None, grade: Grade, call_last: bool = False) -> Trajectory:
    answer = f"so the answer is \\boxed{{{boxed}}}" if boxed is not None else "I give up"
    call = ToolExchange(ToolCall("print(1)"), ExecutionResult(ExecStatus.OK, "1\n", observation="1\n"), "1\n")
    turns = [Turn("let me compute", 3, StopReason.STOP, call), Turn(answer, 5, StopReason.STOP)]
    if call_last:
        turns = [Turn(answer, 5, StopReason.STOP, call)]
    n = sum(t.num_tokens for t in turns)
    return Trajectory(problem_id=pid, prompt_len=2, tokens_T=tuple(range(n + 2)), mask_T=(0, 0) + (1,) * n,
                      logprobs_T=(0.0, 0.0) + (-0.1,) * n, turns=tuple(turns), grade=grade)


RIGHT = Grade(1.0, True, True, "4")
WRONG5 = Grade(-1.0, False, True, "5")


def results_file(path: Path, *, summary: bool = True) -> Path:
    """Two problems, gold 4: p1 answered 4 and 5 (graded right), p2 answered 4 twice, but
    the recorded grade of p2's second sample says incorrect (an old grader's mistake)."""
    problems = [
        ProblemResult("p1", "q1", "4", (traj("p1", "4", RIGHT), traj("p1", "5", WRONG5)), index=0),
        ProblemResult("p2", "q2", "4", (traj("p2", "4", RIGHT), traj("p2", "4", Grade(-1.0, False, True, "4"))),
                      index=1),
    ]
    rows = [ResultsHeader(model="m", mode="retool", val_n=2, sandbox=SandboxSettings(5.0, 512)).to_json(),
            *(p.to_json() for p in problems)]
    if summary:
        rows.append(summarize([p.samples for p in problems]).to_json())
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def data_file(path: Path, golds: dict[str, str]) -> Path:
    path.write_text("".join(json.dumps({"id": k, "question": f"q {k}", "answer": v}) + "\n" for k, v in golds.items()))
    return path


def test_eval_file_regraded_into_a_new_file_and_the_changes_printed(tmp_path, capsys):
    source = results_file(tmp_path / "eval.jsonl")
    before = source.read_bytes()
    golds = data_file(tmp_path / "fixed.jsonl", {"p1": "5", "p2": "4"})  # p1's gold was wrong
    assert main(["regrade", str(source), "--data", str(golds)]) == 0
    out = capsys.readouterr().out
    assert source.read_bytes() == before
    new = read_results(tmp_path / "eval.regraded.jsonl")
    assert new.header.regraded_from == str(source.resolve()) and new.header.model == "m"
    verdicts = {p.problem_id: [t.grade.correct for t in p.samples] for p in new.problems}
    assert verdicts == {"p1": [False, True], "p2": [True, True]}
    assert [p.answer for p in new.problems] == ["5", "4"]
    assert new.header.dataset_path == str(golds) and new.header.dataset_problems == 2
    assert new.header.dataset_fingerprint == problems_fingerprint(read_problems(golds).problems)
    assert new.summary.num_correct == 3 and new.summary.average_at_k == pytest.approx(0.75)
    assert "verdict flips: 3" in out
    assert "problem p1 #0: correct → incorrect" in out and "problem p1 #1: incorrect → correct" in out
    assert "problem p2 #1: incorrect → correct" in out
    assert "correct: 2 → 3" in out and "Average@k: 0.5000 → 0.7500" in out


def test_without_data_the_recorded_golds_are_used_and_an_unfinished_eval_gets_no_summary(tmp_path, capsys):
    source = results_file(tmp_path / "eval.jsonl", summary=False)
    out_path = tmp_path / "sub" / "new.jsonl"
    assert main(["regrade", str(source), "--output", str(out_path)]) == 0
    assert "verdict flips: 1" in capsys.readouterr().out
    new = read_results(out_path)
    assert new.summary is None and sum(p.num_correct for p in new.problems) == 3


def test_header_without_regraded_from_keeps_its_old_bytes():
    assert "regraded_from" not in ResultsHeader(model="m").to_json()
    assert ResultsHeader(model="m", regraded_from="/x").to_json()["regraded_from"] == "/x"


@pytest.mark.parametrize("case", ["missing", "not_results", "damaged", "unwritable", "same_file", "missing_id"])
def test_bad_inputs_give_one_line_and_leave_an_existing_output_alone(tmp_path, capsys, case):
    source = results_file(tmp_path / "eval.jsonl")
    output = tmp_path / "out.jsonl"
    output.write_text("old\n")
    args = [str(source), "--output", str(output)]
    if case == "missing":
        args[0] = str(tmp_path / "nope.jsonl")
    elif case == "not_results":
        (tmp_path / "x.jsonl").write_text('{"response": "a", "gold": "b"}\n')
        args[0] = str(tmp_path / "x.jsonl")
    elif case == "damaged":
        lines = source.read_text().splitlines(keepends=True)
        source.write_text(lines[0] + lines[1][:40] + "\n" + "".join(lines[2:]))
    elif case == "unwritable":
        args[2] = str(output / "inside-a-file.jsonl")
    elif case == "same_file":
        args[2] = str(source)
    else:
        args += ["--data", str(data_file(tmp_path / "d.jsonl", {"p1": "4"}))]
    before = source.read_bytes() if source.exists() else None
    assert main(["regrade", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("retool regrade: error:") and "\n" not in err
    assert output.read_text() == "old\n"
    if before is not None:
        assert source.read_bytes() == before


def make_run(tmp_path: Path, golds: dict[str, str]) -> Path:
    run = tmp_path / "run"
    data = data_file(tmp_path / "train.jsonl", golds)
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"train_data": str(data), "sandbox_timeout_s": 5.0}))
    group = [traj("p1", "4", RIGHT), traj("p1", "5", WRONG5)]
    save_trajectories(run, 1, [(group, [1.0, -1.0])])
    save_trajectories(run, 2, [([traj("p2", None, Grade(-1.0, False, False))], [0.0])])
    return run


def test_run_folder_regraded_against_its_data_file_into_regraded(tmp_path, capsys):
    run = make_run(tmp_path, {"p1": "4", "p2": "7"})
    originals = {p: p.read_bytes() for p in (run / "trajectories").iterdir()}
    data_file(tmp_path / "train.jsonl", {"p1": "5", "p2": "7"})  # the gold fixed after the run
    assert main(["regrade", str(run)]) == 0
    out = capsys.readouterr().out
    assert {p: p.read_bytes() for p in (run / "trajectories").iterdir()} == originals
    with gzip.open(run / "regraded" / "step_000001.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    assert [r["trajectory"]["grade"]["correct"] for r in rows] == [False, True]
    assert [r["original_grade"]["correct"] for r in rows] == [True, False]
    assert rows[0]["advantage"] == 1.0 and rows[0]["regraded_from"].endswith("step_000001.jsonl.gz")
    assert (run / "regraded" / "step_000002.jsonl.gz").is_file()
    assert "verdict flips: 2" in out and "step 1 · group 0 · #0 (problem p1): correct → incorrect" in out


def test_run_folder_fixed_data_flag_and_a_missing_problem(tmp_path, capsys):
    run = make_run(tmp_path, {"p1": "4", "p2": "7"})
    fixed = data_file(tmp_path / "other.jsonl", {"p1": "4"})
    assert main(["regrade", str(run), "--train-data", str(fixed), "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "'p2' is not in" in err and not (tmp_path / "o").exists()
    assert main(["regrade", str(tmp_path)]) == 2  # a folder with no trajectories
    assert "no trajectories/step_" in capsys.readouterr().err


def test_final_text_is_what_the_rollout_graded():
    assert final_text(traj("p", "4", RIGHT)) == "so the answer is \\boxed{4}"
    # A trajectory that ended on its budget after a tool call: graded empty when no answer was found.
    assert final_text(traj("p", "4", Grade(-1.0, False, False), call_last=True)) == ""
    assert final_text(traj("p", "4", RIGHT, call_last=True)).endswith("\\boxed{4}")
    assert to_jsonable(RIGHT)["answer"] == "4"


def test_view_shows_both_verdicts_of_a_regraded_file(tmp_path, capsys):
    from retool.report import view

    source = results_file(tmp_path / "eval.jsonl")
    assert main(["regrade", str(source), "--data", str(data_file(tmp_path / "d.jsonl", {"p1": "5", "p2": "4"}))]) == 0
    items, _ = view.load_items([tmp_path / "eval.regraded.jsonl"])
    rows = view.page_data(items, [])["items"]
    assert [(r["orig"]["correct"], r["correct"]) for r in rows] == [(True, False), (False, True), (True, True),
                                                                    (False, True)]
    run = make_run(tmp_path, {"p1": "5", "p2": "7"})
    assert main(["regrade", str(run)]) == 0
    rows = view.page_data(view.load_items([run / "regraded"])[0], [])["items"]
    assert [(r["orig"]["correct"], r["correct"]) for r in rows] == [(True, False), (False, True), (False, False)]
    source.unlink()  # the original is gone: the regraded file still shows, with a note
    items, _ = view.load_items([tmp_path / "eval.regraded.jsonl"])
    assert all(i.original is None for i in items) and "cannot be read" in capsys.readouterr().err
