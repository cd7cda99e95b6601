"""``in_own_process``: a stage in a spawned process gives back its result, its exceptions
as themselves, and one line when its process dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from retool.config import ConfigError
from retool.stage_process import StageDied, StageTraceback, in_own_process


def fail_with_config_error(message: str) -> None:
    raise ConfigError(message)


def kill_myself() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("no pickling")


def raise_unpicklable() -> None:
    raise Unpicklable("the stage's own words")


def test_the_stage_runs_in_another_process_and_its_result_comes_back():
    assert in_own_process("probe", os.getpid) != os.getpid()
    assert in_own_process("probe", pow, 2, 10) == 1024


def test_an_exception_comes_back_as_itself_with_the_stages_traceback():
    with pytest.raises(ConfigError, match="^bad --seed$") as caught:
        in_own_process("probe", fail_with_config_error, "bad --seed")
    assert isinstance(caught.value.__cause__, StageTraceback)
    assert "fail_with_config_error" in str(caught.value.__cause__)  # where in the stage it was raised


def test_an_exception_that_cannot_be_sent_back_keeps_its_message():
    with pytest.raises(RuntimeError, match="Unpicklable: the stage's own words"):
        in_own_process("probe", raise_unpicklable)


def test_a_killed_stage_process_is_one_line_naming_the_stage_and_the_signal():
    with pytest.raises(StageDied) as caught:
        in_own_process("RL", kill_myself)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("the RL stage's process was killed by SIGKILL")
    assert "out-of-memory" in message


def test_a_stage_process_that_exits_early_says_its_exit_code():
    with pytest.raises(StageDied, match="the SFT stage's process exited with code 3 before it finished"):
        in_own_process("SFT", os._exit, 3)


def write_pid_and_sleep(path: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    time.sleep(120)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has ended
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_stage_process_ends_when_the_command_is_killed(tmp_path):
    """``kill -9`` of the command (no Ctrl-C to the group) leaves no orphaned stage running."""
    pid_file = tmp_path / "stage.pid"
    code = ("from retool.stage_process import in_own_process; from tests.test_stage_process import "
            f"write_pid_and_sleep; in_own_process('probe', write_pid_and_sleep, {str(pid_file)!r})")
    command = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        stage = int(pid_file.read_text())
        time.sleep(1.5)
        assert alive(stage)  # the probe sees the stage while its command runs
        command.kill()
        command.wait()
        deadline = time.monotonic() + 10
        while alive(stage) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(stage)
    finally:
        command.kill()
