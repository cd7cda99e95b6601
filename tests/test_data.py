"""Tests for retool.data: DAPO preparation, loaders, bad rows, hub cache, gold validation."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from retool import data
from retool.data import DAPO_PREFIX, DAPO_SUFFIX, DataError, normalise

FIXTURES = Path(__file__).parent / "fixtures" / "data"
SAMPLE = FIXTURES / "dapo_sample.parquet"  # 120 distinct real DAPO problems, verl layout
SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
FULL_DAPO = SHARED / "dapo_math_17k.parquet"


def run_cli(argv: list[str]) -> int:
    """Run a ``retool`` subcommand in-process, through the real command line."""
    from retool.cli import main

    return main(argv)


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def sample_rows() -> list[dict]:
    return pq.read_table(SAMPLE).to_pylist()


def with_question(row: dict, question: str, answer: str | None = None) -> dict:
    row = json.loads(json.dumps(row))
    row["prompt"][0]["content"] = question
    if answer is not None:
        row["reward_model"]["ground_truth"] = answer
    return row


def injected_rows() -> list[dict]:
    """The 120 sample rows plus 14 injected ones (see the counts in the test below)."""
    base = sample_rows()
    q = [r["prompt"][0]["content"] for r in base]
    extra = [dict(base[i]) for i in range(5)]  # 5 exact duplicates
    extra += [with_question(base[i], "  " + q[i].replace(" ", "   ", 3) + " \n") for i in (5, 6, 7)]
    extra += [with_question(base[i], DAPO_PREFIX + q[i] + DAPO_SUFFIX) for i in (8, 9)]
    extra.append(with_question(base[10], q[10], answer="-12345"))  # conflicts with row 11
    new = "What is the answer to this injected problem with conflicting copies?"
    extra += [with_question(base[0], new, "7"), with_question(base[0], new, "7"),
              with_question(base[0], new, "8")]
    return base + extra


def write_parquet(rows: list[dict], path: Path) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# ---------------------------------------------------------------- prepare-data


def check_splits(out: Path) -> tuple[list[dict], list[dict]]:
    """Assert the invariants every prepared output holds; return (train, dev)."""
    train, dev = read_jsonl(out / "train.jsonl"), read_jsonl(out / "dev.jsonl")
    ids = [r["id"] for r in train + dev]
    assert len(ids) == len(set(ids)), "ids must be unique"
    questions = [normalise(r["question"]) for r in train + dev]
    assert len(questions) == len(set(questions)), "dev and train must be disjoint and deduplicated"
    for row in train + dev:
        assert set(row) == {"id", "question", "answer", "data_source"}
        assert not row["question"].startswith("Solve the following math problem step by step")
        assert row["question"] == row["question"].strip() and row["answer"]
    return train, dev


def test_prepare_small_copy_with_injected_duplicates_and_conflicts(tmp_path):
    src = write_parquet(injected_rows(), tmp_path / "dapo.parquet")
    assert run_cli(["prepare-data", "--input", str(src), "--output-dir", str(tmp_path / "out")]) == 0
    stats = data.prepare_dataset([src], tmp_path / "out2")
    # 120 base + 5 exact + 3 whitespace + 2 wrapped + 1 conflicting copy + 3 new (7, 7, 8)
    assert stats.rows_read == 134
    assert stats.wrappers_stripped == 2
    assert stats.problems == 121 and stats.duplicate_rows_removed == 13
    assert stats.conflicting_problems == 2 and stats.conflicting_rows == 2 + 3
    assert (stats.dev, stats.train) == (50, 119 - 50)
    train, dev = check_splits(tmp_path / "out")
    assert (len(train), len(dev)) == (69, 50)
    conflicts = read_jsonl(tmp_path / "out" / "conflicts.jsonl")
    answers = sorted(sorted((a["answer"], a["count"]) for a in c["answers"]) for c in conflicts)
    row11_answer = sample_rows()[10]["reward_model"]["ground_truth"]
    assert answers == sorted([sorted([("-12345", 1), (row11_answer, 1)]), [("7", 2), ("8", 1)]])
    kept = {normalise(r["question"]) for r in train + dev}
    assert all(normalise(c["question"]) not in kept for c in conflicts)
    assert (tmp_path / "out" / "dev.jsonl").read_bytes() == (tmp_path / "out2" / "dev.jsonl").read_bytes()


def test_ids_and_split_do_not_depend_on_row_order_or_layout(tmp_path):
    rows = injected_rows()
    a = data.prepare_dataset([write_parquet(rows, tmp_path / "a.parquet")], tmp_path / "a")
    plain = tmp_path / "b.jsonl"
    plain.write_text("".join(json.dumps({"problem": r["prompt"][0]["content"],
                                         "solution": r["reward_model"]["ground_truth"]}) + "\n"
                             for r in reversed(rows)))
    b = data.prepare_dataset([plain], tmp_path / "b", fields=data.Fields("problem", "solution"))
    assert (a.problems, a.conflicting_problems, a.train) == (b.problems, b.conflicting_problems, b.train)
    for split in ("train.jsonl", "dev.jsonl"):
        assert [r["id"] for r in read_jsonl(tmp_path / "a" / split)] == \
            [r["id"] for r in read_jsonl(tmp_path / "b" / split)]


def test_prepare_bundled_dapo_reproduces_spec_counts(tmp_path, capsys):
    assert run_cli(["prepare-data", "--bundled", "--output-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "read 17,917 rows" in printed and "distinct problems:           17,188" in printed
    assert "DAPO wrappers stripped:      20" in printed  # the Chinese prompts' suffix
    assert "dropped: 12 problems" in printed
    train, dev = check_splits(tmp_path)
    assert (len(train), len(dev)) == (17_126, 50)
    assert len(read_jsonl(tmp_path / "conflicts.jsonl")) == 12
    assert not any("请以“Answer" in r["question"] for r in train + dev)
    for split in ("train.jsonl", "dev.jsonl", "conflicts.jsonl"):  # the normal umask, not 0600
        assert (tmp_path / split).stat().st_mode & 0o777 == 0o666 & ~current_umask()
    if FULL_DAPO.is_file():  # the shared copy gives byte-identical splits
        run_cli(["prepare-data", "--input", str(FULL_DAPO), "--output-dir", str(tmp_path / "shared")])
        for split in ("train.jsonl", "dev.jsonl"):
            assert (tmp_path / split).read_bytes() == (tmp_path / "shared" / split).read_bytes()


def test_prepare_input_and_bundled_are_exclusive(tmp_path, capsys):
    argv = ["prepare-data", "--bundled", "--input", str(SAMPLE), "--output-dir", str(tmp_path)]
    assert run_cli(argv) == 2
    assert "either --input or --bundled" in capsys.readouterr().err


def test_prepare_rejects_bad_rows_or_counts_them_with_skip_bad(tmp_path, capsys):
    rows = sample_rows()
    rows[3]["reward_model"]["ground_truth"] = "  "
    src = write_parquet(rows, tmp_path / "bad.parquet")
    with pytest.raises(DataError) as info:
        data.prepare_dataset([src], tmp_path / "out")
    assert str(info.value) == f"{src}, row 4, field 'reward_model.ground_truth': empty answer"
    assert not (tmp_path / "out" / "train.jsonl").exists()
    assert run_cli(["prepare-data", "--input", str(src), "--output-dir", str(tmp_path / "out")]) == 2
    assert "row 4" in capsys.readouterr().err
    stats = data.prepare_dataset([src], tmp_path / "out", skip_bad=True)
    assert (stats.rows_read, stats.bad_rows_skipped, stats.problems, stats.train) == (120, 1, 119, 69)


def test_prepare_refuses_too_few_problems(tmp_path):
    with pytest.raises(SystemExit):
        run_cli(["prepare-data", "--input", str(SAMPLE), "--output-dir", str(tmp_path), "--dev-size", "0"])
    src = write_parquet(sample_rows()[:50], tmp_path / "few.parquet")
    with pytest.raises(DataError, match="only 50 usable problems"):
        data.prepare_dataset([src], tmp_path / "out")


def test_strip_dapo_wrapper():
    assert data.strip_dapo_wrapper(DAPO_PREFIX + "What is 1+1?" + DAPO_SUFFIX) == ("What is 1+1?", True)
    assert data.strip_dapo_wrapper("Solve the following equation: x=1") == ("Solve the following equation: x=1", False)


def test_prepare_into_an_unwritable_folder_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("keep me")
    assert run_cli(["prepare-data", "--input", str(SAMPLE), "--output-dir", str(blocker / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write --output-dir") and len(err.strip().splitlines()) == 1
    assert blocker.read_text() == "keep me"


def test_strip_dapo_wrapper_chinese_suffix():
    question = "求 1+1 的值。"
    assert data.strip_dapo_wrapper(question + data.DAPO_SUFFIX_ZH) == (question, True)
    # a question that merely mentions the format keeps its text
    own = "请以分数形式 \\(\\frac{k}{m}\\) 作答，并给出 \\(k + m\\) 的值。"
    assert data.strip_dapo_wrapper(own) == (own, False)


# ---------------------------------------------------------------- the hub, offline


def populate_hub_cache(cache: Path, parquet: Path, repo_id: str = data.DAPO_REPO) -> None:
    """Lay out a dataset snapshot exactly as huggingface_hub stores downloads."""
    from huggingface_hub.file_download import repo_folder_name

    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="dataset")
    blob = hashlib.sha256(parquet.read_bytes()).hexdigest()
    commit = hashlib.sha1(b"retool-test-commit").hexdigest()
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / blob).write_bytes(parquet.read_bytes())
    snapshot = repo / "snapshots" / commit / "data"
    snapshot.mkdir(parents=True)
    os.symlink(f"../../../blobs/{blob}", snapshot / "dapo-math-17k.parquet")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def hub_style_rows() -> list[dict]:
    """20 problems, each 3× and wrapped, in the hub copy's layout (uuid index, math_dapo)."""
    rows = []
    for i, row in enumerate(sample_rows()[:20]):
        wrapped = DAPO_PREFIX + row["prompt"][0]["content"] + DAPO_SUFFIX
        for copy in range(3):
            rows.append({"data_source": "math_dapo", "prompt": [{"content": wrapped, "role": "user"}],
                         "ability": "MATH", "reward_model": {"ground_truth": row["reward_model"]["ground_truth"],
                                                             "style": "rule-lighteval/MATH_v2"},
                         "extra_info": {"index": f"{i:08x}-0000-4000-8000-{copy:012x}"}})
    return rows


def test_prepare_from_hub_cache_offline(tmp_path, capsys):
    from huggingface_hub import scan_cache_dir

    cache = tmp_path / "hf"
    populate_hub_cache(cache, write_parquet(hub_style_rows(), tmp_path / "hub.parquet"))
    info = scan_cache_dir(cache)
    assert not info.warnings and [r.repo_id for r in info.repos] == [data.DAPO_REPO]
    files = data.fetch_hub_parquets(cache_dir=cache, offline=True)
    assert [f.name for f in files] == ["dapo-math-17k.parquet"]
    out = tmp_path / "out"
    argv = ["prepare-data", "--output-dir", str(out), "--dev-size", "5", "--cache-dir", str(cache), "--offline"]
    assert run_cli(argv) == 0
    printed = capsys.readouterr().out
    assert "read 60 rows" in printed and "DAPO wrappers stripped:      60" in printed
    train, dev = check_splits(out)
    assert (len(train), len(dev)) == (15, 5)
    assert {r["data_source"] for r in train} == {"math_dapo"}


def test_hub_unreachable_gives_a_clear_error(tmp_path, capsys):
    with pytest.raises(DataError, match="cannot fetch from the Hugging Face hub.*--input PATH"):
        data.fetch_hub_parquets(cache_dir=tmp_path / "empty", offline=True)
    argv = ["prepare-data", "--output-dir", str(tmp_path / "o"), "--cache-dir", str(tmp_path / "e"), "--offline"]
    assert run_cli(argv) == 2
    assert "hf://datasets/BytedTsinghua-SIA/DAPO-Math-17k" in capsys.readouterr().err


# ---------------------------------------------------------------- loaders


def test_bundled_sets_are_byte_identical_to_their_sources():
    folder = data.bundled_path("aime24").parent
    for line in (folder / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        content = (folder / name).read_bytes()
        assert hashlib.sha256(content).hexdigest() == digest, name
        if (SHARED / name).is_file():
            assert content == (SHARED / name).read_bytes()
    assert {n for n in data.BUNDLED} == {"aime24", "aime25", "math500"}
    assert data.bundled_dapo_path().name in (folder / "SHA256SUMS").read_text()


@pytest.mark.parametrize("name, count", [("aime24", 30), ("aime25", 30), ("math500", 500)])
def test_load_bundled_sets(name, count):
    problems = data.load_problems(name)
    assert len(problems) == count == len({p.id for p in problems})
    assert all(p.question and p.answer and p.data_source == name for p in problems)


def test_load_bundled_set_contents():
    aime25 = data.load_problems("aime25")
    assert (aime25[0].id, aime25[0].answer) == ("aime25-1", "70")
    assert [p.answer for p in aime25].count("336") == 1
    math500 = {p.id: p for p in data.load_problems("math500")}
    assert math500["test/precalculus/807.json"].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"


def test_load_prepared_split_round_trips(tmp_path):
    data.prepare_dataset([SAMPLE], tmp_path)
    rows = read_jsonl(tmp_path / "dev.jsonl")
    problems = data.load_problems(tmp_path / "dev.jsonl")
    assert [(p.id, p.question, p.answer, p.data_source) for p in problems] == \
        [(r["id"], r["question"], r["answer"], r["data_source"]) for r in rows]


def test_load_any_jsonl_by_field_names(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"q": "1+1?", "a": 2, "key": "x"}\n\n{"q": "2+2?", "a": "4", "key": 7}\n')
    problems = data.load_problems(path, question_field="q", answer_field="a", id_field="key")
    assert [(p.id, p.answer, p.data_source) for p in problems] == [("x", "2", "mine"), ("7", "4", "mine")]
    plain = data.load_problems(path, question_field="q", answer_field="a")
    assert [p.id for p in plain] == ["mine-1", "mine-3"]


def test_load_verl_parquet_by_row():
    problems = data.read_problems(SAMPLE)
    assert len(problems.problems) == 120 and problems.lines[:2] == (1, 2)
    first = problems.problems[0]
    assert (first.id, first.answer, first.data_source) == ("dapo_sample-1", "34", "DAPO-17k")
    assert first.question.startswith("In triangle $ABC$, $\\sin \\angle A = \\frac{4}{5}$")


BAD_ROWS = [
    ('{"question": "ok?", "answer": "1"}', None),
    ('{"question": "no answer?"}', "line 2, field 'answer': missing"),
    ('{"question": "empty?", "answer": "  "}', "line 3, field 'answer': empty answer"),
    ('{"question": "list?", "answer": [1]}', "line 4, field 'answer': expected a string or number, got list"),
    ('{"question": 5, "answer": "1"}', "line 5, field 'question': expected a string, got int"),
    ('{"question": "broken", ', "line 6: invalid JSON"),
    ('["not", "an", "object"]', "line 7: expected an object, got list"),
    ('{"id": "a", "question": "dup?", "answer": "1"}', None),
    ('{"id": "a", "question": "dup again?", "answer": "2"}', "line 9, field 'id': duplicate id 'a' (first on line 8)"),
]


def test_bad_rows_name_file_line_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(text for text, _ in BAD_ROWS) + "\n")
    with pytest.raises(DataError) as info:
        data.load_problems(path)
    assert str(info.value) == f"{path}, line 2, field 'answer': missing"
    result = data.read_problems(path, skip_bad=True)
    expected = [f"{path}, {msg}" for _, msg in BAD_ROWS if msg]
    assert len(result.skipped) == len(expected)
    assert [str(e)[:len(m)] for e, m in zip(result.skipped, expected)] == expected
    assert [p.id for p in result.problems] == ["bad-1", "a"] and result.lines == (1, 8)


def test_file_level_errors(tmp_path):
    with pytest.raises(DataError, match="no such file .bundled sets: aime24, aime25, math500"):
        data.load_problems(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("q,a\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        data.load_problems(tmp_path / "x.csv")
    (tmp_path / "x.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="cannot read parquet"):
        data.load_problems(tmp_path / "x.parquet")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="empty.jsonl: holds no rows"):
        data.load_problems(tmp_path / "empty.jsonl")
    (tmp_path / "latin.jsonl").write_bytes(b'{"question": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(DataError, match="line 1: not UTF-8"):
        data.load_problems(tmp_path / "latin.jsonl")


# ---------------------------------------------------------------- validate-data (uses retool.reward)


@pytest.mark.parametrize("name", ["aime24", "aime25", "math500"])
def test_validate_bundled_sets_pass(name, capsys):
    assert run_cli(["validate-data", name]) == 0
    assert "0 fail" in capsys.readouterr().out


def test_validate_reports_broken_gold_answers_with_line(tmp_path, capsys):
    path = tmp_path / "gold.jsonl"
    rows = [{"question": "fine", "answer": "\\frac{14}{3}"},
            {"question": "unclosed brace", "answer": "\\frac{1}{2"},
            {"question": "nothing to parse", "answer": "$"},
            {"question": "fine too", "answer": "(3, \\frac{\\pi}{2})"},
            {"question": "too long for the answer window", "answer": "1" * 400},
            {"question": "closes the box early", "answer": "}{"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert run_cli(["validate-data", str(path)]) == 1
    captured = capsys.readouterr()
    failed_lines = re.findall(rf"^error: {re.escape(str(path))}, line (\d+), field 'answer': ", captured.err, re.M)
    assert failed_lines == ["2", "3", "5", "6"]
    assert "1111111111…" in captured.err and "1" * 100 not in captured.err
    assert "2 of 6 gold answers grade correct against themselves; 4 fail" in captured.out


def test_validate_skip_bad_lists_but_tolerates_malformed_rows(tmp_path, capsys):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"question": "a", "answer": "1"}\n{"question": "b"}\n')
    assert run_cli(["validate-data", str(path)]) == 1
    assert "error: " + f"{path}, line 2, field 'answer': missing" in capsys.readouterr().err
    assert run_cli(["validate-data", str(path), "--skip-bad"]) == 0
    captured = capsys.readouterr()
    assert "skipped: " in captured.err and "1 malformed rows skipped" in captured.out


def test_validate_parquet_names_row_and_nested_field(tmp_path, capsys):
    rows = sample_rows()[:3]
    rows[1]["reward_model"]["ground_truth"] = "\\sqrt{"
    path = write_parquet(rows, tmp_path / "verl.parquet")
    assert run_cli(["validate-data", str(path)]) == 1
    assert f"error: {path}, row 2, field 'reward_model.ground_truth': gold answer '\\\\sqrt{{'" \
        in capsys.readouterr().err


def test_cli_help_describes_both_commands(capsys):
    for command in ("prepare-data", "validate-data"):
        with pytest.raises(SystemExit) as info:
            run_cli([command, "--help"])
        assert info.value.code == 0
    assert "--skip-bad" in capsys.readouterr().out
