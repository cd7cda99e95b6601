"""``examples/minimal_rl.py``, the loop in one file: two real steps on a tiny model, and
its refusals of bad settings."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny import DIGIT_QUESTION, boxed_digit_model_dir

pytestmark = pytest.mark.timeout(300)  # loads a tiny model and starts the sandbox

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "minimal_rl.py"


def run_example(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=280)


def test_two_steps_on_the_tiny_model_log_a_finite_loss(tmp_path):
    data = tmp_path / "digits.jsonl"
    data.write_text("".join(json.dumps({"id": f"d{i}", "question": DIGIT_QUESTION, "answer": "2"}) + "\n"
                            for i in range(4)))
    out = tmp_path / "metrics.jsonl"
    done = run_example("--model", str(boxed_digit_model_dir()), "--train-data", str(data), "--steps", "2",
                       "--batch-size", "2", "--group-size", "4", "--max-turn-tokens", "12",
                       "--max-trajectory-tokens", "800", "--lora-rank", "4", "--lr", "2e-3", "--output", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 1", "step 2"]
    assert all("reward/mean=" in line and "train/loss=" in line for line in lines)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["step"] for row in rows] == [1.0, 2.0]
    for row in rows:
        assert math.isfinite(row["train/loss"])
        assert row["train/sequences"] == 8  # 2 problems x 4 trajectories, every one trained
        assert -1.0 <= row["reward/mean"] <= 1.0
        assert row["tokens/sampled"] > 0 and row["train/optim_steps"] == row["step"]


@pytest.mark.parametrize("args, message", [
    (["--group-size", "1"], "--group-size must be >= 2"),
    (["--clip-high", "0.9"], "clip-low <= 1 <= --clip-high"),
    (["--train-data", "/nonexistent/problems.jsonl"], "no such file"),
    (["--packing", "zigzag"], "does not support --packing zigzag"),
    (["--engine", "nope"], "nope"),
    (["--train-data", "BAD_GOLD"], "1 gold answer(s) the grader cannot use"),
])
def test_bad_settings_get_one_line(args, message, tmp_path):
    bad_gold = tmp_path / "bad-gold.jsonl"
    bad_gold.write_text(json.dumps({"id": "g1", "question": DIGIT_QUESTION, "answer": "\\frac{"}) + "\n")
    args = [str(bad_gold) if a == "BAD_GOLD" else a for a in args]
    done = run_example("--model", str(boxed_digit_model_dir()), "--steps", "1", *args)
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and message in done.stderr
    assert "Traceback" not in done.stderr


def test_a_trajectory_group_reads_its_rewards_and_refuses_to_be_empty():
    from retool.types import Grade, Problem, Trajectory, TrajectoryGroup

    problem = Problem("p1", "What is 1+1?", "2")

    def trajectory(reward: float) -> Trajectory:
        return Trajectory("p1", 1, (1, 2), (0, 1), (0.0, -0.5), (), Grade(reward, reward > 0, True, "2"))

    group = TrajectoryGroup(problem, (trajectory(1.0), trajectory(-1.0), trajectory(-1.0)))
    assert group.rewards_G == (1.0, -1.0, -1.0)
    with pytest.raises(ValueError, match="problem p1"):
        TrajectoryGroup(problem, ())
