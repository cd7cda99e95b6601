"""Every command refuses an output it cannot write, or an address it cannot listen on,
with one line on stderr that names the flag, exit code 2, no traceback, and nothing
written (``retool.flag_checks``); renamed output flags are refused with a pointer.

Three ways an output goes wrong: its folder is under a file (``FILE/x``), a folder is
where a file is expected and vice versa, and a folder no file can be created in
(``/proc``: root passes every permission check there, so the check must probe).
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from retool.cli import COMMANDS, main

REPO = Path(__file__).resolve().parents[1]
REPORT = REPO / "tests" / "fixtures" / "report"
EVAL_FILE = REPORT / "eval" / "base.jsonl"
RUN = REPORT / "run"

# What each command needs besides the output flag to reach its checks: {data} is a
# problems file in the test's folder, {place} that folder. The last flag is the one checked.
FILE_OUTPUTS = {
    "grade": ["grade", "--output"],
    "task-data": ["task-data", "--output"],
    "eval": ["eval", "--dataset", "{data}", "--output"],
    "view": ["view", str(RUN), "--output"],
    "regrade": ["regrade", str(EVAL_FILE), "--output"],
}
FOLDER_OUTPUTS = {
    "prepare-data": ["prepare-data", "--bundled", "--output-dir"],
    "sft": ["sft", "--data", "{data}", "--run-dir"],
    "train": ["train", "--train-data", "{data}", "--run-dir"],
    "eval": ["eval", "--dataset", "{data}", "--output-dir"],
    "export": ["export", str(RUN), "--output-dir"],
    "demo": ["demo", "--output-dir"],
    "plot checkpoints": ["plot", "checkpoints", str(REPORT / "eval"), "--output-dir"],
    "plot training": ["plot", "training", str(RUN), "--output-dir"],
    "verl-config": ["verl-config", "--train-data", "{data}", "--output-dir"],
    "regrade run": ["regrade", str(RUN), "--output-dir"],
    "prepare-data cache": ["prepare-data", "--offline", "--output-dir", "{place}/data", "--cache-dir"],
    "train vllm adapters": ["train", "--engine", "vllm", "--train-data", "{data}", "--run-dir", "{place}/run",
                            "--vllm-url", "http://127.0.0.1:9", "--vllm-adapter-dir"],
}
NO_OUTPUT = {"validate-data", "compare", "replay", "sandbox"}
"""Commands that write no file (they print), and ``sandbox``, whose flags are addresses."""


@pytest.fixture
def place(tmp_path: Path) -> Path:
    """A folder holding a file (``blocker``), a folder (``folder.jsonl``) and a problems file."""
    (tmp_path / "blocker").write_text("keep me")
    (tmp_path / "folder.jsonl").mkdir()
    (tmp_path / "problems.jsonl").write_text('{"id": "a", "question": "1+1?", "answer": "2"}\n')
    return tmp_path


def snapshot(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def refused(capsys, argv: list[str], *needles: str) -> str:
    """Run ``retool argv`` in-process; assert exit 2 and one line on stderr holding ``needles``."""
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (argv, err)
    return err


def fill(argv: list[str], place: Path) -> list[str]:
    return [a.format(data=place / "problems.jsonl", place=place) for a in argv]


def test_every_command_with_an_output_is_covered():
    covered = {argv[0] for argv in (*FILE_OUTPUTS.values(), *FOLDER_OUTPUTS.values())} | NO_OUTPUT
    assert covered == {c.name for c in COMMANDS}


@pytest.mark.parametrize("name", FILE_OUTPUTS)
@pytest.mark.parametrize("bad, reason", [("blocker/x.jsonl", "is a file, not a folder"),
                                         ("folder.jsonl", "is a folder, not a file"),
                                         ("/proc/retool-test/x.jsonl", "cannot create files in /proc")])
def test_an_output_file_that_cannot_be_written_is_one_line(name, bad, reason, place, capsys):
    before = snapshot(place)
    flag = FILE_OUTPUTS[name][-1]
    refused(capsys, [*fill(FILE_OUTPUTS[name], place), str(place / bad)], f"cannot write {flag} ", reason)
    assert snapshot(place) == before


@pytest.mark.parametrize("name", FOLDER_OUTPUTS)
@pytest.mark.parametrize("bad, reason", [("blocker/sub", "is a file, not a folder"),
                                         ("blocker", "is a file, not a folder"),
                                         ("/proc/retool-test", "cannot create files in /proc")])
def test_an_output_folder_that_cannot_be_written_is_one_line(name, bad, reason, place, capsys):
    before = snapshot(place)
    flag = FOLDER_OUTPUTS[name][-1]
    refused(capsys, [*fill(FOLDER_OUTPUTS[name], place), str(place / bad)], f"cannot write {flag} ", reason)
    assert snapshot(place) == before


@pytest.mark.parametrize("argv, new", [
    (["view", str(RUN), "--out", "x.html"], "--output"),
    (["plot", "training", str(RUN), "--out", "plots"], "--output-dir"),
    (["plot", "checkpoints", str(REPORT / "eval"), "--out", "plots"], "--output-dir"),
    (["verl-config", "--out", "launch"], "--output-dir"),
    (["export", str(RUN), "--output", "adapter"], "--output-dir"),
])
def test_old_output_flags_are_refused_with_a_pointer(argv, new, place, capsys, monkeypatch):
    monkeypatch.chdir(place)
    before = snapshot(place)
    old = next(a for a in argv if a.startswith("--out"))
    refused(capsys, argv, f"{old} was renamed: use {new}")
    assert snapshot(place) == before


def test_an_old_key_in_a_preset_is_refused_with_a_pointer(place, capsys):
    preset = place / "launch.toml"
    preset.write_text('out = "launch"\n')
    refused(capsys, ["verl-config", "--train-data", str(place / "problems.jsonl"), "--config", str(preset)],
            "out was renamed: use output_dir")


@pytest.fixture
def taken_port():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


@pytest.mark.parametrize("flags, needle", [
    (["--port", "99999"], "--port 99999: a TCP port is a number from 0 to 65535"),
    (["--port", "-1"], "--port -1: a TCP port is a number from 0 to 65535"),
    (["--host", "no-such-host.invalid"], "--host no-such-host.invalid: not an address of this machine"),
    (["--host", "192.0.2.1"], "--host 192.0.2.1: cannot listen on 192.0.2.1"),
])
def test_a_bad_listen_address_is_one_line(flags, needle, capsys):
    refused(capsys, ["sandbox", "serve", *flags], needle)


def test_a_port_in_use_is_one_line(taken_port, capsys):
    refused(capsys, ["sandbox", "serve", "--port", str(taken_port)], f"--port {taken_port}: the port is in use")


@pytest.mark.parametrize("argv, needle", [
    (["task-data", "--output", "/proc/x.jsonl"], "error: cannot write --output /proc/x.jsonl"),
    (["sandbox", "serve", "--port", "99999"], "error: --port 99999"),
])
def test_the_reported_cases_from_a_real_process(argv, needle):
    """The two cases as a user meets them: a separate ``python -m retool``, real stderr."""
    done = subprocess.run([sys.executable, "-m", "retool", *argv], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(needle) and len(done.stderr.strip().splitlines()) == 1, done.stderr
