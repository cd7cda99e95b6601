"""The one JSON Lines reader's rule for a cut-off last line, and every reader that uses it."""

from __future__ import annotations

import gzip
import json

import pytest

from retool.jsonl import JsonlError, iter_jsonl, read_jsonl
from retool.log import read_metrics
from retool.report import ReportInputError
from retool.report import read_jsonl as report_read_jsonl
from retool.dialogues import ConversationError, load_dialogues
from retool.trajectory_log import NotATrajectoryLog, TrajectoryLogError, read_trajectory_log

CUT = '{"step": 3, "x": 0.'


def test_complete_lines_are_kept_and_a_cut_off_last_line_is_dropped_once(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2}\n' + CUT)
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    err = capsys.readouterr().err
    assert err == f"warning: {path}:4: dropped a cut-off last line (a writer killed mid-write)\n"


def test_a_whole_last_object_without_its_newline_is_complete(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}')
    lines = list(iter_jsonl(path))
    assert [line.row for line in lines] == [{"step": 1}, {"step": 2}]
    assert [(line.lineno, line.end, line.terminated) for line in lines] == [(1, 12, True), (2, 23, False)]
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("text, message", [
    ('{"step": 1\n{"step": 2}\n', r"m\.jsonl:1: not valid JSON"),
    ('{"step": 1}\n{"step": 2, "x\n', r"m\.jsonl:2: not valid JSON"),  # has its newline: damage, not a cut
    ('{"step": 1}\n[1, 2]\n', r"m\.jsonl:2: expected a JSON object, got list"),
    ('{"step": 1}\n[1, 2]', r"m\.jsonl:2: expected a JSON object, got list"),
    (b'{"a": "\xff"}\n', r"m\.jsonl:1: not valid JSON"),
])
def test_any_other_bad_line_raises_naming_file_and_line(tmp_path, text, message):
    path = tmp_path / "m.jsonl"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(JsonlError, match=message):
        read_jsonl(path)


def test_gzip_files_follow_the_same_rule(tmp_path, capsys):
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"a": 1}\n{"a": 2}\n{"a"'))
    assert read_jsonl(path) == [{"a": 1}, {"a": 2}]
    assert "t.jsonl.gz:3: dropped a cut-off last line" in capsys.readouterr().err
    path.write_bytes(gzip.compress(b'{"a": 1}\n')[:-6])  # the compressed stream itself is cut
    with pytest.raises(JsonlError, match="t.jsonl.gz: cannot read"):
        read_jsonl(path)
    with pytest.raises(JsonlError, match="missing.jsonl: cannot read"):
        read_jsonl(tmp_path / "missing.jsonl")


def test_metrics_reports_and_trajectory_logs_share_the_rule(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n' + CUT)
    assert read_metrics(path) == report_read_jsonl(path) == [{"step": 1}]
    assert capsys.readouterr().err.count("metrics.jsonl:2: dropped a cut-off last line") == 2
    path.write_text('{"step": 1, "x\n{"step": 2}\n')
    with pytest.raises(JsonlError, match="metrics.jsonl:1"):
        read_metrics(path)
    with pytest.raises(ReportInputError, match="metrics.jsonl:1"):
        report_read_jsonl(path)
    with pytest.raises(TrajectoryLogError, match="metrics.jsonl:1: not valid JSON"):
        read_trajectory_log(path)
    path.write_text('{"step": 1}\n')
    with pytest.raises(NotATrajectoryLog, match="not a trajectory log"):
        read_trajectory_log(path)
    path.write_text(json.dumps({"step": 1, "trajectory": {"tokens_T": []}}) + "\n")
    with pytest.raises(TrajectoryLogError, match=r"metrics.jsonl:1: not a valid trajectory-log row"):
        read_trajectory_log(path)


def test_sft_dialogues_share_the_rule(tmp_path, capsys):
    row = {"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "\\boxed{2}"}]}
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps(row)[:20])
    assert len(load_dialogues(path)) == 1
    assert "sft.jsonl:2: dropped a cut-off last line" in capsys.readouterr().err
    path.write_text("{oops\n" + json.dumps(row) + "\n")
    with pytest.raises(ConversationError, match=r"sft.jsonl:1: not valid JSON"):
        load_dialogues(path)
