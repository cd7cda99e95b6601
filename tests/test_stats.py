"""pass@k estimators, Average@k, stderr and the eval summary, against hand computations."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from retool import stats
from retool.results import ProblemResult, summarize
from retool.serialize import to_jsonable
from retool.types import (
    ExecStatus,
    ExecutionResult,
    Grade,
    InvalidToolCall,
    StopReason,
    ToolCall,
    ToolExchange,
    Trajectory,
    Turn,
)


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (5, 2, 1, 0.4),            # k = 1 is c / n
    (5, 2, 2, 0.7),            # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (5, 2, 3, 0.9),            # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (5, 2, 4, 1.0),            # fewer wrong samples than k: certain
    (10, 0, 3, 0.0),
    (10, 10, 1, 1.0),
    (12, 1, 12, 1.0),
    (12, 3, 4, 1 - 126 / 495),  # 1 - C(9,4)/C(12,4)
])
def test_pass_at_k_hand_values(n, c, k, expected):
    assert stats.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(100, 7, 10), (1000, 3, 500), (2000, 1990, 5), (400, 0, 200)])
def test_pass_at_k_matches_exact_binomials_for_large_n(n, c, k):
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert stats.pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        stats.pass_at_k(n, c, k)


def test_aggregates_by_hand():
    counts = [(4, 0), (4, 2), (4, 4)]
    assert stats.average_at_k(counts) == pytest.approx(0.5)
    assert stats.pass_at_k_empirical(counts) == pytest.approx(2 / 3)
    # accuracies 0, .5, 1: sample variance 0.25, stderr sqrt(0.25 / 3)
    assert stats.average_at_k_stderr(counts) == pytest.approx(math.sqrt(0.25 / 3))
    # per problem pass@2: 0, 1 - C(2,2)/C(4,2) = 5/6, 1
    assert stats.unbiased_pass_at_k(counts, 2) == pytest.approx((0 + 5 / 6 + 1) / 3)
    assert stats.unbiased_pass_at_k(counts, 4) == stats.pass_at_k_empirical(counts)
    assert stats.average_at_k_stderr([(4, 1)]) == 0.0
    with pytest.raises(ValueError, match="no problems"):
        stats.average_at_k([])


def test_seed_base_row_is_reproduced_from_counts():
    """The seed's base checkpoint on AIME 2025 (30 problems × 12 samples): 85 of 360
    generations correct, 15 of 30 problems solved; Average@12 23.61 %, Pass@12 50.00 %."""
    correct = [12, 11, 10, 9, 8, 7, 6, 5, 4, 4, 3, 2, 2, 1, 1] + [0] * 15
    counts = [(12, c) for c in correct]
    assert sum(correct) == 85
    assert f"{100 * stats.average_at_k(counts):.2f}" == "23.61"
    assert f"{100 * stats.pass_at_k_empirical(counts):.2f}" == "50.00"
    assert stats.unbiased_pass_at_k(counts, 1) == pytest.approx(85 / 360)


# ---------------------------------------------------------------- summarize


def _traj(correct: bool, formatted: bool = True, calls: int = 0, invalid: int = 0,
          prompt: int = 3, sampled: int = 4, stop: StopReason = StopReason.STOP) -> Trajectory:
    """A small but well-formed trajectory: ``calls`` executed calls, ``invalid`` bad ones."""
    ok = ExecutionResult(status=ExecStatus.OK, stdout="1\n", observation="1\n")
    exchanges = [ToolExchange(ToolCall("print(1)"), ok, "1\n")] * calls
    exchanges += [ToolExchange(InvalidToolCall("bad_json", "not JSON"), None, "not JSON")] * invalid
    turns = [Turn("call", 1, StopReason.STOP, e) for e in exchanges] + [Turn("answer", 1, stop)]
    policy = len(turns) * [1]
    tokens = prompt + sampled + len(turns)
    mask = [0] * prompt + policy + [0] * (tokens - prompt - len(policy))
    return Trajectory(problem_id="p", prompt_len=prompt, tokens_T=tuple(range(tokens)), mask_T=tuple(mask),
                      logprobs_T=tuple(-0.5 * m for m in mask), turns=tuple(turns),
                      grade=Grade(1.0 if correct else -1.0, correct, formatted), stop_reason=stop)


def test_summarize_by_hand():
    rows = [
        {"type": "problem", "samples": [_traj(True, calls=1), _traj(False, calls=2, invalid=1)]},
        {"type": "problem", "samples": [_traj(False, formatted=False), _traj(False, stop=StopReason.LENGTH)]},
    ]
    s = summarize(row["samples"] for row in rows).to_json()
    assert s["average@k"] == pytest.approx(0.25)       # (1/2 + 0/2) / 2
    assert s["pass@k"] == pytest.approx(0.5)
    assert s["pass@k_unbiased"] == {"1": pytest.approx(0.25), "2": pytest.approx(0.5)}
    assert s["format"] == pytest.approx(0.75)
    assert s["reward"] == pytest.approx(-0.5)
    assert s["code_calls"] == pytest.approx(3 / 4)     # executed calls only
    assert s["tool_call_attempts"] == pytest.approx(4 / 4)
    assert s["used_tool_rate"] == pytest.approx(2 / 4)
    assert s["turns"] == pytest.approx((2 + 4 + 1 + 1) / 4)
    assert s["average@k_stderr"] == pytest.approx(math.sqrt(((0.5 - 0.25) ** 2 * 2) / 1 / 2))
    assert s["tokens"] == pytest.approx((9 + 11 + 8 + 8) / 4)
    assert s["sampled_tokens"] == s["turns"]
    assert (s["k"], s["num_problems"], s["num_samples"], s["num_correct"]) == (2, 2, 4, 1)
    assert (s["num_formatted"], s["num_solved"]) == (3, 1)
    assert s["stop_reasons"] == {"stop": 3, "length": 1}


def test_summarize_reads_serialised_samples_the_same():
    rows = [{"samples": [_traj(True), _traj(False, calls=1)]}, {"samples": [_traj(False), _traj(True)]}]
    as_json = [{"samples": to_jsonable(row["samples"])} for row in rows]
    assert summarize([ProblemResult.from_json({"problem_id": "p", "question": "", "answer": "", **row}).samples
                      for row in as_json]) == summarize(row["samples"] for row in rows)


def test_summarize_uses_the_smallest_sample_count_as_k():
    s = summarize([[_traj(True)] * 3, [_traj(False)] * 2]).to_json()
    assert s["k"] == 2 and set(s["pass@k_unbiased"]) == {"1", "2"}


def test_summarize_rejects_empty_input():
    with pytest.raises(ValueError, match="no problems"):
        summarize([])
    with pytest.raises(ValueError, match="0 samples"):
        summarize([[_traj(True)], []])


# ---------------------------------------------------------------- behaviour figures


def _by_turns(turns: list[Turn]) -> Trajectory:
    sampled = sum(t.num_tokens for t in turns)
    mask = (0, 0) + (1,) * sampled
    return Trajectory(problem_id="p", prompt_len=2, tokens_T=tuple(range(len(mask))), mask_T=mask,
                      logprobs_T=(0.0,) * len(mask), turns=tuple(turns), grade=Grade(1.0, True, True))


def test_behaviour_figures_by_hand():
    ok = ExecutionResult(status=ExecStatus.OK, stdout="2\n", observation="2\n")
    error = ExecutionResult(status=ExecStatus.ERROR, stderr="NameError: y", observation="NameError: y")
    caller = _by_turns([
        Turn("a", 10, StopReason.STOP, ToolExchange(ToolCall("x = 1\n\nprint(y)\n"), error, "NameError")),
        Turn("b", 6, StopReason.STOP, ToolExchange(InvalidToolCall("bad_json", "not JSON"), None, "not JSON")),
        Turn("c", 4, StopReason.STOP, ToolExchange(ToolCall("print(2)"), ok, "2")),  # fixes the failed calls
        Turn("d", 5, StopReason.STOP, ToolExchange(ToolCall("print(3)"), ok, "2")),  # after a good one: no
        Turn("answer", 5, StopReason.STOP),
    ])
    silent = _by_turns([Turn("answer", 20, StopReason.STOP)])
    assert stats.first_call_position(caller) == pytest.approx(10 / 30)  # the first call that ran ends at 10
    assert stats.first_call_position(silent) is None
    assert stats.self_corrections(caller) == 1
    figures = stats.behaviour_figures(stats.trajectory_stats([caller, silent]))
    assert figures == pytest.approx({
        "response_tokens": (30 + 20) / 2,  # sampled tokens only
        "call_rate": 1 / 2,
        "code_lines_per_call": (2 + 1 + 1) / 3,  # blank lines and the invalid call do not count
        "call_success_rate": 2 / 3,
        "first_call_position": 1 / 3,
        "self_corrections": 1 / 2,
    })
    # without calls, the figures per call are left out, not divided by zero
    assert set(stats.behaviour_figures(stats.trajectory_stats([silent]))) == {
        "response_tokens", "call_rate", "self_corrections"}
    assert summarize([[caller, silent]]).behaviour == figures


def test_summaries_written_before_the_behaviour_figures_still_load():
    from retool.results import EvalSummary

    row = summarize([[_traj(True, calls=1)]]).to_json()
    del row["behaviour"]
    assert EvalSummary.from_json(row).behaviour is None


def test_proportion_difference_is_the_two_sample_difference_and_its_standard_error():
    diff, stderr = stats.proportion_difference((40, 40), (37, 40))
    assert diff == pytest.approx(-0.075) and stderr == pytest.approx(math.sqrt(0.925 * 0.075 / 40))
    diff, stderr = stats.proportion_difference((9, 10), (9, 10))
    assert diff == 0 and stderr == pytest.approx(math.sqrt(2 * 0.09 / 10))
    assert all(math.isnan(x) for x in stats.proportion_difference((0, 0), (3, 4)))
