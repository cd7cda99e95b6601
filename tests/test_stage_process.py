"""``in_own_process``: a stage in a spawned process gives back its result, its exceptions
as themselves, and one line when its process dies."""

from __future__ import annotations

import os
import signal

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
