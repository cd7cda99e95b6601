"""``retool compare``: paired difference of two evals, checked against hand computation."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from retool.cli import main
from retool.report import read_eval_results
from retool.report.compare import compare, format_table
from retool.stats import paired_difference, paired_ratio_difference, trajectory_stats

EVAL = Path(__file__).parent / "fixtures" / "report" / "eval"


def test_paired_difference_by_hand():
    diff, se = paired_difference([0.0, 0.5, 1.0, 0.25], [0.5, 0.5, 1.0, 1.0])
    # differences 0.5, 0, 0, 0.75: mean 0.3125, sample std 0.375
    assert diff == pytest.approx(0.3125)
    d = [0.5, 0.0, 0.0, 0.75]
    sd = math.sqrt(sum((x - 0.3125) ** 2 for x in d) / 3)
    assert se == pytest.approx(sd / 2)
    assert paired_difference([0.2], [0.7]) == (pytest.approx(0.5), 0.0)
    with pytest.raises(ValueError, match="1 values before, 2 after"):
        paired_difference([0.1], [0.1, 0.2])
    with pytest.raises(ValueError, match="no problems"):
        paired_difference([], [])


def test_paired_ratio_difference_by_hand():
    # before: 2 valid of 4 attempts (ratio 0.5); after: 4 of 4 (ratio 1.0); 3 problems
    diff, se = paired_ratio_difference([(1, 1), (1, 2), (0, 1)], [(2, 2), (1, 1), (1, 1)])
    assert diff == pytest.approx(0.5)
    # u before = (n - 0.5 d) / (4/3) = 0.375, 0, -0.375; u after = 0, 0, 0
    d = [-0.375, 0.0, 0.375]
    assert se == pytest.approx(math.sqrt(sum(x * x for x in d) / 2) / math.sqrt(3))
    # the same ratio on both sides with the same per-problem pattern: no difference, no noise
    assert paired_ratio_difference([(1, 2), (3, 4)], [(1, 2), (3, 4)]) == (0.0, 0.0)
    with pytest.raises(ValueError, match="denominators before sum to 0"):
        paired_ratio_difference([(0, 0)], [(1, 1)])
    with pytest.raises(ValueError, match="1 problems before, 2 after"):
        paired_ratio_difference([(1, 1)], [(1, 1), (1, 1)])


def test_compare_matches_the_per_problem_counts():
    result = compare(EVAL / "base.jsonl", EVAL / "step-100.jsonl")
    before, after = read_eval_results(EVAL / "base.jsonl"), read_eval_results(EVAL / "step-100.jsonl")
    acc_b = {r.problem_id: r.num_correct / len(r.samples) for r in before.problems}
    acc_a = {r.problem_id: r.num_correct / len(r.samples) for r in after.problems}
    ids = list(acc_b)
    accuracy = result.metric("accuracy")
    assert result.problems == len(ids) and result.only_before == result.only_after == 0
    assert accuracy.before == pytest.approx(before.summary.average_at_k)
    assert accuracy.after == pytest.approx(after.summary.average_at_k)
    diff, se = paired_difference([acc_b[i] for i in ids], [acc_a[i] for i in ids])
    assert accuracy.difference == pytest.approx(diff) and accuracy.stderr == pytest.approx(se)
    assert accuracy.significant == (abs(diff) > 2 * se > 0)
    assert result.metric("format").before == pytest.approx(before.summary.format)
    assert result.metric("used_tool").after == pytest.approx(after.summary.used_tool_rate)
    valid = result.metric("valid_tool_call_rate")
    assert 0 <= valid.before <= 1 and valid.stderr is not None and valid.stderr >= 0
    assert result.metric("tokens").before == pytest.approx(before.summary.tokens)
    names = result.metric("name_error_rate")
    assert 0 <= names.before <= 1 and 0 <= names.after <= 1


def test_name_errors_are_counted_from_the_traceback():
    from retool.stats import is_name_error
    from retool.types import ExecStatus, ExecutionResult

    failed = ExecutionResult(ExecStatus.ERROR, stderr='Traceback (most recent call last):\n  File "call2.py", '
                             "line 1, in <module>\nNameError: name 'x' is not defined\n")
    assert is_name_error(failed)
    assert not is_name_error(ExecutionResult(ExecStatus.ERROR, stderr="ZeroDivisionError: division by zero\n"))
    assert not is_name_error(ExecutionResult(ExecStatus.OK, stderr="NameError: printed, not raised\n"))


def test_cli_table_json_and_errors(tmp_path, capsys):
    assert main(["compare", str(EVAL / "base.jsonl"), str(EVAL / "step-100.jsonl")]) == 0
    table = capsys.readouterr().out
    assert "| accuracy |" in table and "paired s.e." in table and "valid_tool_call_rate" in table
    assert main(["compare", str(EVAL / "base.jsonl"), str(EVAL / "step-20.jsonl"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["metrics"]) == {"accuracy", "format", "used_tool", "code_calls", "tokens",
                                    "valid_tool_call_rate", "name_error_rate", "response_tokens",
                                    "code_lines_per_call", "call_success_rate", "first_call_position",
                                    "self_corrections"}
    # a missing file and a file that is not an eval are clear errors, not tracebacks
    assert main(["compare", str(tmp_path / "nope.jsonl"), str(EVAL / "base.jsonl")]) == 1
    assert "cannot read" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "problem"}\n')
    assert main(["compare", str(bad), str(EVAL / "base.jsonl")]) == 1
    assert "not an eval results file" in capsys.readouterr().err
    # problems are matched by id: a file with one problem less compares the common ones
    partial = tmp_path / "partial.jsonl"
    shutil.copy(EVAL / "step-50.jsonl", partial)
    lines = partial.read_text().splitlines()
    kept = [line for line in lines if '"type": "summary"' not in line][:-1]
    partial.write_text("\n".join(kept) + "\n")
    result = compare(EVAL / "base.jsonl", partial)
    assert result.problems == 3 and result.only_before == 1


def _edited(tmp_path: Path, source: Path, name: str, edit) -> Path:
    """A copy of an eval results file with ``edit(row)`` applied to each parsed line."""
    rows = [json.loads(line) for line in source.read_text().splitlines()]
    out = tmp_path / name
    out.write_text("".join(json.dumps(edit(row)) + "\n" for row in rows))
    return out


def _header(**changes):
    return lambda row: {**row, **changes} if row["type"] == "header" else row


@pytest.mark.parametrize("name, edit, message", [
    ("other-fingerprint", None, "evaluate different problem sets (dataset aime25 aaaaaaaaaaaa, 4 problems vs "
                                "aime25 bbbbbbbbbbbb, 4 problems)"),
    ("other-answer", lambda row: {**row, "answer": "999"} if row.get("problem_id") == "rem-2-100" else row,
     "problem 'rem-2-100' has another answer in each"),
    ("other-problems", lambda row: {**row, "problem_id": "renamed"} if row.get("problem_id") == "rem-2-100" else row,
     "evaluate different problem sets: 2 problem(s) in only one of them"),
    ("other-val-n", _header(val_n=8), "draw different numbers of samples per problem (val_n 4 vs 8)"),
    ("fewer-samples", lambda row: {**row, "samples": row["samples"][:2]} if row["type"] == "problem" else row,
     "draw different numbers of samples per problem (4 vs 2 for"),
])
def test_evals_of_different_problems_or_sample_counts_are_refused(name, edit, message, tmp_path, capsys):
    before = EVAL / "base.jsonl"
    if name == "other-fingerprint":
        before = _edited(tmp_path, before, "before.jsonl", _header(dataset_fingerprint="a" * 64, dataset_problems=4))
        edit = _header(dataset_fingerprint="b" * 64, dataset_problems=4)
    after = _edited(tmp_path, EVAL / "step-100.jsonl", f"{name}.jsonl", edit)
    assert main(["compare", str(before), str(after)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err


def test_legitimate_differences_are_printed_above_the_table(tmp_path, capsys):
    sampling = {"temperature": 0.6, "top_p": 0.7, "max_trajectory_tokens": 8192}
    after = _edited(tmp_path, EVAL / "base-text.jsonl", "text.jsonl", _header(model="other/model", sampling=sampling))
    assert main(["compare", str(EVAL / "base.jsonl"), str(after)]) == 0
    lines = capsys.readouterr().out.splitlines()
    table_start = next(i for i, line in enumerate(lines) if line.startswith("| metric"))
    assert set(lines[1:table_start]) == {
        "differs: mode: 'retool' before, 'text' after",
        "differs: model: 'fixture/tiny' before, 'other/model' after",
        "differs: sampling.temperature: 1.0 before, 0.6 after"}
    assert main(["compare", str(EVAL / "base.jsonl"), str(after), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["differences"]["mode"] == {"before": "retool", "after": "text"}
    assert main(["compare", str(EVAL / "base.jsonl"), str(EVAL / "step-100.jsonl")]) == 0
    assert "differs:" not in capsys.readouterr().out  # same settings: nothing printed


def test_interpreter_modes_are_named_in_the_differences(tmp_path, capsys):
    """A stateless file leaves the interpreter out of its header; compare names it anyway."""
    sandbox = {"timeout_s": 10.0, "memory_mb": 1024}
    before = _edited(tmp_path, EVAL / "base.jsonl", "stateless.jsonl", _header(sandbox=sandbox))
    after = _edited(tmp_path, EVAL / "step-100.jsonl", "stateful.jsonl",
                    _header(sandbox={**sandbox, "interpreter": "stateful"}))
    assert main(["compare", str(before), str(after)]) == 0
    assert "differs: sandbox.interpreter: 'stateless' before, 'stateful' after" in capsys.readouterr().out


def test_behaviour_figures_are_compared_pooled_with_a_paired_clustered_stderr():
    from retool.results import read_results
    from retool.stats import BEHAVIOUR_FIGURES, TrajectoryStats, behaviour_figures, paired_ratio_difference

    result = compare(EVAL / "base.jsonl", EVAL / "step-100.jsonl")
    sides = [[trajectory_stats(p.samples) for p in read_results(EVAL / name).problems]
             for name in ("base.jsonl", "step-100.jsonl")]
    by_id = [{p.problem_id: s for p, s in zip(read_results(EVAL / name).problems, stats)}
             for name, stats in zip(("base.jsonl", "step-100.jsonl"), sides)]
    common = [pid for pid in by_id[0] if pid in by_id[1]]
    before, after = [[d[pid] for pid in common] for d in by_id]
    figures = [behaviour_figures(sum(side, TrajectoryStats())) for side in (before, after)]
    for name in ("response_tokens", "code_lines_per_call", "call_success_rate", "first_call_position",
                 "self_corrections"):
        m = result.metric(name)
        num, den = BEHAVIOUR_FIGURES[name]
        _, stderr = paired_ratio_difference([(getattr(s, num), getattr(s, den)) for s in before],
                                            [(getattr(s, num), getattr(s, den)) for s in after])
        assert (m.before, m.after, m.stderr) == pytest.approx((figures[0][name], figures[1][name], stderr))
    assert "| first_call_position |" in format_table(result)
