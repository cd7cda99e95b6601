"""``retool replay``: recorded code calls run again; identical ones reproduce, others do not.

Adversarial snippets: the time and a random number (never the recorded output), a recorded
output that a sandbox change would alter, a final bare expression (auto-printed as in the
rollout), an error traceback and a timeout (deterministic: they reproduce).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from retool.cli import main
from retool.replay import Limits, load_source, run_replay
from retool.results import ProblemResult, ResultsHeader, SandboxSettings
from retool.runs import save_trajectories
from retool.types import ExecStatus, ExecutionResult, Grade, StopReason, ToolCall, ToolExchange, Trajectory, Turn

TIMEOUT_OBSERVATION = "Execution timed out after 1 s"
CALLS = [  # (code, recorded status, recorded stdout/observation)
    ("print(2 + 3)", ExecStatus.OK, "5\n"),
    ("2 ** 10", ExecStatus.OK, "1024\n"),
    ("import time\nprint(time.time())", ExecStatus.OK, "1700000000.0\n"),
    ("import random\nrandom.random()", ExecStatus.OK, "0.5\n"),
    ("print('recorded by an older sandbox')", ExecStatus.OK, "something else\n"),
]


def traj(pid: str, calls) -> Trajectory:
    turns = []
    for code, status, output in calls:
        stdout = output if status is ExecStatus.OK else ""
        result = ExecutionResult(status, stdout, observation=output)
        turns.append(Turn("calling", 2, StopReason.STOP, ToolExchange(ToolCall(code), result, output)))
    turns.append(Turn("\\boxed{5}", 2, StopReason.STOP))
    n = 2 * len(turns)
    return Trajectory(pid, 1, tuple(range(n + 1)), (0,) + (1,) * n, (0.0,) + (-0.1,) * n, tuple(turns),
                      Grade(1.0, True, True, "5"))


def eval_file(path: Path) -> Path:
    problems = [ProblemResult("p1", "q", "5", (traj("p1", CALLS[:2]), traj("p1", CALLS[2:])), index=0),
                ProblemResult("p2", "q", "5", (traj("p2", [("1/0", ExecStatus.ERROR, "")]),), index=1)]
    rows = [ResultsHeader(model="m", mode="retool", val_n=2, sandbox=SandboxSettings(1.0, 512)).to_json(),
            *(p.to_json() for p in problems)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _items_for(calls):
    from retool.replay import Recorded

    return [Recorded("probe", traj("probe", calls))]


def test_one_trajectory_call_by_call(tmp_path, capsys):
    source = eval_file(tmp_path / "eval.jsonl")
    before = source.read_bytes()
    assert main(["replay", str(source), "--problem", "p1", "--index", "0"]) == 0
    out = capsys.readouterr().out
    assert "problem p1 #0 (problem p1): 2 code call(s)" in out
    assert out.count("ok → ok, output identical — reproduces") == 2
    assert main(["replay", str(source), "--problem", "p1", "--index", "1"]) == 1
    out = capsys.readouterr().out
    assert out.count("DIFFERS") == 3 and "recorded: '1700000000.0'" in out and "recorded: '0.5'" in out
    assert source.read_bytes() == before


def test_whole_file_summary_counts_what_reproduces(tmp_path, capsys):
    source = eval_file(tmp_path / "eval.jsonl")
    assert main(["replay", str(source)]) == 1
    out = capsys.readouterr().out
    # 1/0 was recorded without its traceback text: it is an error again, but its output differs.
    assert "6 code calls in 3 trajectories; 2 reproduce, 4 do not" in out
    assert "ok → ok, output differs: 3" in out and "error → error, output differs: 1" in out
    assert "problem p1 #1 call 1: ok → ok" in out


def test_errors_and_timeouts_reproduce_and_run_limits_come_from_the_config(tmp_path, capsys):
    probe = run_replay(_items_for([("1/0", ExecStatus.ERROR, "")]), Limits(1.0, 512))[0].replayed.observation
    calls = [("1/0", ExecStatus.ERROR, probe), ("while True: pass", ExecStatus.TIMEOUT, TIMEOUT_OBSERVATION)]
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"sandbox_timeout_s": 1.0, "sandbox_memory_mb": 512}))
    save_trajectories(run, 3, [([traj("p9", calls)], [0.0])])
    items, limits = load_source(run)
    assert limits == Limits(1.0, 512) and items[0].where == "step 3 · group 0 · #0"
    assert main(["replay", str(run / "trajectories" / "step_000003.jsonl.gz"), "--problem", "p9"]) == 0
    out = capsys.readouterr().out
    assert "error → error, output identical" in out and "timeout → timeout, output identical" in out


@pytest.mark.parametrize("args, message", [
    (["nope.jsonl"], "no such file or folder"),
    (["eval.jsonl", "--problem", "p7"], "problem 'p7' is not in the source"),
    (["eval.jsonl", "--problem", "p2", "--index", "3"], "--index 0..0"),
    (["eval.jsonl", "--index", "1"], "give --problem too"),
    (["plain.jsonl"], "neither an eval results file nor a trajectory log"),
])
def test_bad_inputs_give_one_line(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    eval_file(tmp_path / "eval.jsonl")
    (tmp_path / "plain.jsonl").write_text('{"a": 1}\n')
    assert main(["replay", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
