"""``retool.results``: typed results records, the reader and the appender; ``TrajectoryStats``.

The report fixtures were written by the dict-based code this module replaced, so reading
them back and writing them again byte for byte checks that the file format is unchanged.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import pytest

from retool.config import ConfigError
from retool.results import (
    EvalSummary,
    ProblemResult,
    ResultsFile,
    ResultsFileError,
    ResultsHeader,
    SamplingSettings,
    SandboxSettings,
    is_results_file,
    iter_results,
    read_results,
    summarize,
)
from retool.rollout import rollout_metrics
from retool.stats import TrajectoryStats, trajectory_stats
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

EVAL = Path(__file__).parent / "fixtures" / "report" / "eval"


def traj(correct: bool, calls: int = 0, invalid: int = 0, over_budget: int = 0,
         stop: StopReason = StopReason.STOP, pid: str = "p") -> Trajectory:
    """``calls`` executed calls, ``invalid`` malformed ones, ``over_budget`` valid ones not run."""
    ok = ExecutionResult(status=ExecStatus.OK, stdout="1\n", observation="1\n")
    exchanges = [ToolExchange(ToolCall("print(1)"), ok, "1\n")] * calls
    exchanges += [ToolExchange(InvalidToolCall("bad_json", "not JSON"), None, "not JSON")] * invalid
    exchanges += [ToolExchange(ToolCall("print(2)"), None, "budget spent")] * over_budget
    turns = [Turn("call", 1, StopReason.STOP, e) for e in exchanges] + [Turn("answer", 1, stop)]
    mask = [0, 0] + [1] * len(turns) + [0]
    return Trajectory(problem_id=pid, prompt_len=2, tokens_T=tuple(range(len(mask))), mask_T=tuple(mask),
                      logprobs_T=tuple(-0.5 * m for m in mask), turns=tuple(turns),
                      grade=Grade(1.0 if correct else -1.0, correct, True, "1"), stop_reason=stop)


def header(**overrides) -> ResultsHeader:
    fields = dict(model="m", label="base", dataset="set", mode="retool", val_n=2, seed=42, seeded=True,
                  sampling=SamplingSettings(temperature=1.0, top_p=0.7), sandbox=SandboxSettings(30.0, 2048))
    return ResultsHeader(**{**fields, **overrides})


def problem(pid: str, index: int, *correct: bool) -> ProblemResult:
    return ProblemResult(problem_id=pid, question=f"q {pid}", answer="1",
                         samples=tuple(traj(c, calls=i, pid=pid) for i, c in enumerate(correct)),
                         index=index, seed=7, sampler_requests=2, time_s=0.5)


# ---------------------------------------------------------------- records and the file format


@pytest.mark.parametrize("name", ["base", "base-text", "step-20", "step-50", "step-100"])
def test_fixture_lines_read_and_write_back_byte_for_byte(name):
    path = EVAL / f"{name}.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines()
    results = read_results(path)
    assert [json.dumps(p.to_json(), ensure_ascii=False) for p in results.problems] == lines[1:-1]
    assert json.dumps(results.summary.to_json(), ensure_ascii=False) == lines[-1]
    # the summary recomputed from the problems is the one the old code wrote, plus the
    # behaviour figures those files predate
    recomputed = summarize(p.samples for p in results.problems)
    assert results.summary.behaviour is None and recomputed.behaviour["response_tokens"] > 0
    assert dataclasses.replace(recomputed, behaviour=None) == results.summary


def test_header_round_trip_and_label():
    h = header(step=5, label=None, checkpoint="/runs/a/checkpoints/step_000005")
    row = h.to_json()
    assert row["type"] == "header" and row["sampling"]["top_p"] == 0.7 and row["sandbox"]["memory_mb"] == 2048
    assert list(row)[:3] == ["type", "model", "checkpoint"] and list(row)[-2:] == ["retool_version", "created"]
    assert ResultsHeader.from_json(row) == h and h.display_label == "step 5"
    assert ResultsHeader.from_json({"type": "header"}).display_label == "base"  # a bare header still reads
    with pytest.raises(ValueError, match="header step must be an integer or null, got '5'"):
        ResultsHeader.from_json({"type": "header", "step": "5"})


def test_header_engine_matches_and_old_files_read_as_local():
    assert header(engine=None).differences(header(engine="local")) == []  # written before engines were recorded
    assert header(engine="local").differences(header(engine="vllm")) == [
        "engine: file has 'local', this run has 'vllm'"]


def test_header_differences_name_the_nested_setting():
    old = header()
    assert old.differences(header(label="other", dataset_path="elsewhere")) == []  # not matched fields
    assert old.differences(header(sampling=SamplingSettings(temperature=1.0, top_p=0.9))) == [
        "sampling.top_p: file has 0.7, this run has 0.9"]
    diffs = old.differences(header(mode="text", sandbox=None))
    assert "mode: file has 'retool', this run has 'text'" in diffs
    assert "sandbox.timeout_s: file has 30.0, this run has '(not set)'" in diffs


def test_problem_and_summary_keep_the_json_keys():
    p = problem("a", 0, True, False)
    row = p.to_json()
    assert list(row) == ["type", "index", "problem_id", "question", "answer", "seed", "samples", "num_correct",
                         "num_formatted", "sampler_requests", "time_s"]
    assert (row["num_correct"], row["num_formatted"]) == (1, 2)
    assert ProblemResult.from_json(json.loads(json.dumps(row))) == p
    summary = summarize([p.samples, problem("b", 1, True, True).samples])
    row = summary.to_json()
    assert list(row)[:4] == ["type", "average@k", "pass@k", "pass@k_unbiased"]
    assert row["pass@k_unbiased"] == {"1": 0.75, "2": 1.0} and row["average@k_stderr"] == pytest.approx(0.25)
    assert EvalSummary.from_json(json.loads(json.dumps(row))) == summary


# ---------------------------------------------------------------- the reader


def write(path: Path, rows: list, tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r.to_json() if hasattr(r, "to_json") else r) + "\n" for r in rows) + tail)
    return path


def test_reader_drops_a_torn_last_line_and_reads_gzip(tmp_path, capsys):
    rows = [header(), problem("a", 0, True, False), problem("b", 1, False, False)]
    path = write(tmp_path / "r.jsonl", rows, tail='{"type": "problem", "problem_id": "c", "sam')
    results = read_results(path)
    assert [p.problem_id for p in results.problems] == ["a", "b"] and results.summary is None
    assert "r.jsonl:4: dropped a cut-off last line" in capsys.readouterr().err
    gz = tmp_path / "r.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert read_results(gz) == dataclasses.replace(results, path=gz)
    assert is_results_file(gz) and is_results_file(path)


SUMMARY = summarize([[traj(True)]]).to_json()


@pytest.mark.parametrize("rows, message", [
    ([{"step": 1, "reward/mean": 0.5}], r"not an eval results file \(its first line is not a header\)"),
    ([{"type": "header"}, {"type": "header"}], r"r\.jsonl:2: unexpected line type 'header'"),
    ([{"type": "header"}, SUMMARY, {"type": "problem"}], r"r\.jsonl:2: a summary line before the end"),
    ([{"type": "header"}, {"type": "problem", "problem_id": "a"}], r"r\.jsonl:2: not a valid problem line: KeyError"),
    ([{"type": "header", "step": 1.5}], r"r\.jsonl:1: not a valid header line: header step must be an integer"),
    ([{"type": "header"}, {"type": "summary", "average@k": 0.5}], r"r\.jsonl:2: not a valid summary line"),
])
def test_reader_names_file_and_line_of_a_bad_line(tmp_path, rows, message):
    path = write(tmp_path / "r.jsonl", rows)
    with pytest.raises(ResultsFileError, match=message):
        read_results(path)


def test_reader_rejects_bad_json_a_bad_trajectory_and_a_repeated_problem(tmp_path):
    path = write(tmp_path / "r.jsonl", [header(), problem("a", 0, True, True)], tail="{not json\n")
    with pytest.raises(ResultsFileError, match=r"r\.jsonl:3: not valid JSON"):
        read_results(path)
    bad = problem("a", 0, True, True).to_json()
    bad["samples"][1]["mask_T"].pop()
    write(path, [header(), bad])
    with pytest.raises(ResultsFileError, match=r"r\.jsonl:2: .*problem 'a' sample 2: not a valid trajectory"):
        read_results(path)
    write(path, [header(), problem("a", 0, True, True), problem("a", 0, True, True)])
    with pytest.raises(ResultsFileError, match=r"r\.jsonl:3: problem 'a' appears twice"):
        read_results(path)
    with pytest.raises(ResultsFileError, match="cannot read"):
        read_results(tmp_path / "missing.jsonl")
    assert not is_results_file(tmp_path / "missing.jsonl")


# ---------------------------------------------------------------- the appender


def test_appender_writes_resumes_and_summarises_in_dataset_order(tmp_path):
    path, index_of = tmp_path / "out" / "r.jsonl", {"a": 0, "b": 1, "c": 2}
    first = ResultsFile.open(path, header(), index_of, overwrite=False)
    assert not path.exists()  # nothing written before prepare
    first.append(problem("c", 2, False, False))
    first.append(problem("a", 0, True, False))
    partial = first.summary()
    assert partial.num_problems == 2 and first.running_average() == pytest.approx(0.25)

    text = path.read_text()
    path.write_text(text + '{"type": "problem", "problem_id": "b", "q')  # killed mid-write
    again = ResultsFile.open(path, header(created="later"), index_of, overwrite=False)
    assert set(again.done) == {"a", "c"} and again.summary() == partial
    assert all(isinstance(d.stats, TrajectoryStats) for d in again.done.values())  # no trajectories kept
    again.append(problem("b", 1, True, True))
    summary = again.finish()
    assert path.read_text().startswith(text)  # the torn piece was cut before appending
    everything = [problem(p, i, *c) for p, i, c in (("a", 0, (True, False)), ("b", 1, (True, True)),
                                                    ("c", 2, (False, False)))]
    assert summary == summarize(p.samples for p in everything)
    assert read_results(path).summary == summary

    done = ResultsFile.open(path, header(), index_of, overwrite=False)  # the old summary is dropped
    assert done.finish() == summary and [r.record.__class__.__name__ for r in iter_results(path)].count(
        "EvalSummary") == 1


def test_appender_refuses_other_settings_and_wrong_sample_counts(tmp_path):
    path = tmp_path / "r.jsonl"
    results = ResultsFile.open(path, header(), {"a": 0}, overwrite=False)
    results.append(problem("a", 0, True, False))
    with pytest.raises(ConfigError, match=r"(?s)val_n: file has 2, this run has 3.*--overwrite"):
        ResultsFile.open(path, header(val_n=3), {"a": 0}, overwrite=False)
    write(path, [header(), problem("a", 0, True)])
    with pytest.raises(ResultsFileError, match=r"r\.jsonl:2: problem 'a' has 1 samples, expected 2"):
        ResultsFile.open(path, header(), {"a": 0}, overwrite=False)
    fresh = ResultsFile.open(path, header(val_n=3), {"a": 0}, overwrite=True)
    assert fresh.done == {} and fresh.header.val_n == 3


# ---------------------------------------------------------------- one aggregation


def test_trajectory_stats_by_hand_and_by_parts():
    trajs = [traj(True, calls=2, invalid=1), traj(False, over_budget=1, stop=StopReason.LENGTH), traj(True)]
    s = trajectory_stats(trajs)
    assert (s.trajectories, s.correct, s.reward, s.turns) == (3, 2, 1.0, 4 + 2 + 1)
    assert (s.tool_call_attempts, s.valid_tool_calls, s.code_calls, s.used_tool) == (4, 3, 2, 1)
    assert s.valid_tool_call_rate == 0.75 and s.budget_exhausted_calls == 1
    assert s.invalid_calls == {"bad_json": 1} and s.stop_reasons == {"stop": 2, "length": 1}
    assert trajectory_stats(trajs[:1]) + trajectory_stats(trajs[1:]) == s
    assert trajectory_stats([]) == TrajectoryStats() and TrajectoryStats().valid_tool_call_rate == 1.0


def test_training_metrics_and_the_eval_summary_read_the_same_figures():
    samples = [traj(True, calls=1), traj(False, invalid=2), traj(False, over_budget=1), traj(True, calls=3)]
    metrics, summary = rollout_metrics(samples), summarize([samples[:2], samples[2:]])
    pairs = [("reward/correct", summary.average_at_k), ("reward/format", summary.format),
             ("reward/mean", summary.reward), ("rollout/code_calls", summary.code_calls),
             ("rollout/tool_call_attempts", summary.tool_call_attempts),
             ("rollout/used_tool_rate", summary.used_tool_rate), ("rollout/turns", summary.turns),
             ("rollout/trajectory_tokens", summary.tokens), ("rollout/sampled_tokens", summary.sampled_tokens)]
    assert [metrics[name] for name, _ in pairs] == [value for _, value in pairs]
    # valid calls: 1 + 1 (over budget) + 3 of 7 attempts
    assert metrics["rollout/valid_tool_call_rate"] == 5 / 7 and metrics["rollout/invalid_calls/bad_json"] == 2.0
