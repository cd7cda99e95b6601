"""Datasets: prepare DAPO-Math-17k for training, load evaluation sets, validate gold answers.

Three jobs, each a function and a ``retool`` command:

- ``prepare_dataset`` / ``retool prepare-data``: DAPO-Math-17k, from the Hugging Face hub
  (``BytedTsinghua-SIA/DAPO-Math-17k``, fetched with ``huggingface_hub``) or from a local
  parquet/JSONL file in verl layout (``prompt``, ``reward_model.ground_truth``) or plain
  question/answer layout → strip DAPO's prompt wrapper → deduplicate on
  whitespace-normalised question text → drop problems whose copies disagree on the answer
  → shuffle (seed 42) → ``train.jsonl`` + a disjoint 50-row ``dev.jsonl`` (rows
  ``{"id", "question", "answer", "data_source"}``) and ``conflicts.jsonl`` listing what was
  dropped.
- ``load_problems`` / ``read_problems``: the bundled evaluation sets (``aime24``,
  ``aime25``, ``math500``), the prepared train/dev files, or any question/answer JSONL or
  parquet by field names → ``retool.types.Problem`` records.
- ``check_gold_answers`` / ``retool validate-data``: every gold answer must grade correct
  against itself (``\\boxed{gold}`` through ``retool.reward.check_golds``) before training.

Bad rows (invalid JSON, missing or empty fields, duplicate ids) raise a ``DataError``
naming the file, line (parquet: row) and field; with ``skip_bad`` they are skipped and
counted instead. Nothing is dropped without a count.

Non-goals: no near-duplicate (fuzzy) detection — duplicates are exact after whitespace
normalisation; answers "disagree" when their whitespace-normalised strings differ (so
``1/2`` and ``\\frac{1}{2}`` would count as a conflict — DAPO's answers are all integers);
no prompt building or tokenisation (``retool.protocol`` / ``retool.render`` do that).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from retool import reward
from retool.atomic import atomic_write_jsonl
from retool.flag_checks import UnwritableOutputError, output_folder
from retool.types import Problem

logger = logging.getLogger(__name__)

DAPO_REPO = "BytedTsinghua-SIA/DAPO-Math-17k"
"""The hub dataset ``prepare-data`` reads when no ``--input`` is given."""
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response "
    "should be of the form Answer: $Answer (without quotes) where $Answer is the answer "
    "to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
DAPO_SUFFIX_ZH = (
    "\n让我们一步一步地思考。请以“Answer: \\boxed{<final_answer>}”的格式输出最终答案。"
    "如果是选择题，请按顺序输出正确的选项，不带任何标点或空格。对于其他类型的问题，请只输出最终答案的数值。"
)
"""The instruction suffix of DAPO's Chinese prompts (20 rows of DAPO-Math-17k), stripped like
the English wrapper."""
DEV_SIZE = 50
SEED = 42
ID_HASH_CHARS = 12
"""Hex digits of sha1(normalised question) in a prepared problem id (``dapo-<hash>``)."""


@dataclass(frozen=True)
class Fields:
    """Where a plain (non-verl) row keeps its question, answer and id."""

    question: str = "question"
    answer: str = "answer"
    id: str | None = None
    """``None``: use the row's ``id`` when it has one, else ``<name>-<line>``. A named
    field must be present in every row."""


BUNDLED: dict[str, tuple[str, Fields]] = {
    "aime24": ("aime24.jsonl", Fields("input", "output")),
    "aime25": ("aime25.jsonl", Fields("input", "output")),
    "math500": ("math500.jsonl", Fields("problem", "answer", "unique_id")),
}
"""Evaluation sets shipped in ``retool/assets/data`` (sources and licences in its README)."""

BUNDLED_DAPO = "dapo_math_17k.parquet"
"""DAPO-Math-17k, one row per original problem, shipped for offline ``prepare-data --bundled``."""


class DataError(ValueError):
    """A data file, or one row of it, that cannot be used as it is.

    ``line`` is the 1-based line of a JSONL file or row of a parquet file (``None`` for
    whole-file problems); ``field`` the offending field, dotted for nested ones
    (``reward_model.ground_truth``).
    """

    def __init__(self, path: str | Path, message: str, *, line: int | None = None,
                 field: str | None = None) -> None:
        self.path, self.message, self.line, self.field = str(path), message, line, field
        super().__init__(str(self))

    def __str__(self) -> str:
        where = self.path
        if self.line is not None:
            unit = "row" if self.path.endswith(".parquet") else "line"
            where += f", {unit} {self.line}"
        if self.field is not None:
            where += f", field '{self.field}'"
        return f"{where}: {self.message}"


# ---------------------------------------------------------------- reading rows


@dataclass(frozen=True)
class SourceRow:
    """One well-formed row of an input file, before deduplication."""

    path: str
    line: int
    question: str
    answer: str
    id: str | None
    data_source: str | None
    answer_field: str
    """Where the answer came from (``reward_model.ground_truth`` in verl layout)."""


def normalise(text: str) -> str:
    """Whitespace-normalised text: the key deduplication compares."""
    return " ".join(text.split())


def strip_dapo_wrapper(question: str) -> tuple[str, bool]:
    """Remove DAPO's instruction prefix and suffix (English, or the Chinese
    ``DAPO_SUFFIX_ZH``); return the text and whether any was there.

    Whitespace around the wrapper's parts may differ from ``DAPO_PREFIX``/``DAPO_SUFFIX``.
    """
    text = question.strip()
    inner = text.removeprefix(DAPO_PREFIX.strip()).removesuffix(DAPO_SUFFIX.strip())
    inner = inner.strip().removesuffix(DAPO_SUFFIX_ZH.strip())
    return inner.strip(), inner != text


def iter_source_rows(paths: Iterable[Path], fields: Fields = Fields()) -> Iterator[SourceRow | DataError]:
    """Yield every row of ``paths`` as a ``SourceRow``, or as the ``DataError`` that row raised.

    Rows in verl layout (``prompt`` + ``reward_model``) are recognised whenever the row has
    no ``fields.question``. Errors about a whole file (missing, unreadable, unknown type)
    raise instead of being yielded.
    """
    for path in paths:
        for line, row in _iter_file(Path(path)):
            try:
                yield _parse_row(str(path), line, row, fields)
            except DataError as error:
                yield error


def _iter_file(path: Path) -> Iterator[tuple[int, Any]]:
    if not path.is_file():
        raise DataError(path, "no such file")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _iter_parquet(path)
    if suffix in (".jsonl", ".json", ".ndjson"):
        return _iter_jsonl(path)
    raise DataError(path, f"unsupported file type {suffix!r}: expected .jsonl or .parquet")


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError(path, f"cannot open: {e.strerror}") from e
    with f:
        for line, raw in enumerate(f, 1):
            if raw.strip():
                yield line, _decode_json(path, line, raw)


def _decode_json(path: Path, line: int, raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return DataError(path, f"not UTF-8 text ({e.reason} at byte {e.start})", line=line)
    except json.JSONDecodeError as e:
        return DataError(path, f"invalid JSON ({e.msg}, column {e.colno})", line=line)


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    # pyarrow: heavy, only parquet input needs it
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=8192)
        row = 0
        for batch in batches:
            for record in batch.to_pylist():
                row += 1
                yield row, record
    except (OSError, pa.ArrowException) as e:
        raise DataError(path, f"cannot read parquet: {e}") from e


def _parse_row(path: str, line: int, row: Any, fields: Fields) -> SourceRow:
    if isinstance(row, DataError):
        raise row
    if not isinstance(row, dict):
        raise DataError(path, f"expected an object, got {type(row).__name__}", line=line)
    if fields.question not in row and "reward_model" in row:
        question, answer_field = _verl_question(path, line, row), "reward_model.ground_truth"
    else:
        question = _text(path, line, _get(path, line, row, fields.question), fields.question)
        answer_field = fields.answer
    answer = _answer(path, line, _get(path, line, row, answer_field), answer_field)
    source = row.get("data_source")
    return SourceRow(path, line, question, answer, _row_id(path, line, row, fields),
                     source if isinstance(source, str) and source else None, answer_field)


def _get(path: str, line: int, row: dict, dotted: str) -> Any:
    value: Any = row
    for key in dotted.split("."):
        if not isinstance(value, dict) or value.get(key) is None:
            raise DataError(path, "missing", line=line, field=dotted)
        value = value[key]
    return value


def _text(path: str, line: int, value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise DataError(path, f"expected a string, got {type(value).__name__}", line=line, field=name)
    if not value.strip():
        raise DataError(path, "empty", line=line, field=name)
    return value.strip()


def _answer(path: str, line: int, value: Any, name: str) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise DataError(path, f"expected a string or number, got {type(value).__name__}",
                        line=line, field=name)
    if not value.strip():
        raise DataError(path, "empty answer", line=line, field=name)
    return value.strip()


def _verl_question(path: str, line: int, row: dict) -> str:
    prompt = _get(path, line, row, "prompt")
    if isinstance(prompt, str):
        return _text(path, line, prompt, "prompt")
    messages = prompt if isinstance(prompt, list) else []
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise DataError(path, "expected a list of chat messages with a user message",
                        line=line, field="prompt")
    return _text(path, line, users[-1].get("content"), "prompt.content")


def _row_id(path: str, line: int, row: dict, fields: Fields) -> str | None:
    name = fields.id or "id"
    if fields.id is None and row.get("id") is None:
        return None
    value = _get(path, line, row, name)
    if isinstance(value, bool) or not isinstance(value, (str, int)) or not str(value).strip():
        raise DataError(path, "expected a non-empty string or integer id", line=line, field=name)
    return str(value).strip()


# ---------------------------------------------------------------- loading problems


@dataclass(frozen=True)
class ProblemFile:
    """The problems of one file, with the line each came from and the rows skipped."""

    path: Path
    answer_field: str
    """The field gold answers were read from, for error messages."""
    problems: tuple[Problem, ...]
    lines: tuple[int, ...]
    skipped: tuple[DataError, ...] = ()


def bundled_path(name: str) -> Path:
    """Path of a bundled evaluation set (``aime24``, ``aime25``, ``math500``)."""
    file_name, _ = BUNDLED[name]
    return Path(str(resources.files("retool") / "assets" / "data" / file_name))


def bundled_dapo_path() -> Path:
    """Path of the DAPO-Math-17k copy shipped in the package (verl layout, parquet)."""
    return Path(str(resources.files("retool") / "assets" / "data" / BUNDLED_DAPO))


def read_problems(path_or_name: str | Path, *, question_field: str | None = None,
                  answer_field: str | None = None, id_field: str | None = None,
                  skip_bad: bool = False) -> ProblemFile:
    """Read a bundled set by name, or a JSONL/parquet file, into ``Problem`` records.

    Field arguments left ``None`` take the source's defaults: the bundled set's own
    fields, else ``question``/``answer`` and the row's ``id`` if it has one. Rows without
    an id get ``<name>-<line>`` (name: the set name or the file's stem). A bad row or a
    duplicate id raises ``DataError``; with ``skip_bad`` it is skipped and listed in
    ``ProblemFile.skipped`` instead. Verl-layout rows are read as they are: only
    ``prepare_dataset`` removes DAPO's prompt wrapper and duplicates.
    """
    path, defaults, name = _resolve(path_or_name)
    fields = Fields(question_field or defaults.question, answer_field or defaults.answer,
                    id_field or defaults.id)
    problems, lines, skipped, first_line_of = [], [], [], {}
    answer_field = fields.answer
    for item in iter_source_rows([path], fields):
        if not isinstance(item, DataError):
            pid = item.id or f"{name}-{item.line}"
            if pid in first_line_of:
                item = DataError(path, f"duplicate id {pid!r} (first on line {first_line_of[pid]})",
                                 line=item.line, field=fields.id or "id")
        if isinstance(item, DataError):
            if not skip_bad:
                raise item
            skipped.append(item)
            continue
        first_line_of[pid], answer_field = item.line, item.answer_field
        problems.append(Problem(pid, item.question, item.answer, item.data_source or name))
        lines.append(item.line)
    if not problems and not skipped:
        raise DataError(path, "holds no rows")
    return ProblemFile(path, answer_field, tuple(problems), tuple(lines), tuple(skipped))


def problems_fingerprint(problems: Iterable[Problem]) -> str:
    """sha256 of every problem's id, question and answer, in order (an eval header's
    ``dataset_fingerprint``)."""
    h = hashlib.sha256()
    for p in problems:
        h.update(json.dumps([p.id, p.question, p.answer]).encode() + b"\n")
    return h.hexdigest()


def load_problems(path_or_name: str | Path, *, question_field: str | None = None,
                  answer_field: str | None = None, id_field: str | None = None,
                  skip_bad: bool = False) -> list[Problem]:
    """The problems of a bundled set or file (see ``read_problems``); skipped rows are logged."""
    result = read_problems(path_or_name, question_field=question_field, answer_field=answer_field,
                           id_field=id_field, skip_bad=skip_bad)
    if result.skipped:
        logger.warning("%s: skipped %d bad rows (first: %s)", result.path, len(result.skipped),
                       result.skipped[0])
    return list(result.problems)


def _resolve(path_or_name: str | Path) -> tuple[Path, Fields, str]:
    if isinstance(path_or_name, str) and path_or_name in BUNDLED:
        return bundled_path(path_or_name), BUNDLED[path_or_name][1], path_or_name
    path = Path(path_or_name)
    if not path.is_file():
        raise DataError(path, f"no such file (bundled sets: {', '.join(BUNDLED)})")
    return path, Fields(), path.stem


# ---------------------------------------------------------------- preparing DAPO


@dataclass
class _Group:
    """All copies of one problem (same normalised question) seen while reading."""

    first: SourceRow
    question: str
    first_by_answer: dict[str, SourceRow] = field(default_factory=dict)
    count_by_answer: Counter = field(default_factory=Counter)

    def add(self, row: SourceRow) -> None:
        key = normalise(row.answer)
        self.first_by_answer.setdefault(key, row)
        self.count_by_answer[key] += 1


@dataclass(frozen=True)
class PrepareStats:
    """What ``prepare_dataset`` read, removed and wrote."""

    rows_read: int
    bad_rows_skipped: int
    wrappers_stripped: int
    duplicate_rows_removed: int
    problems: int
    """Distinct problems (normalised question texts) among the good rows."""
    conflicting_problems: int
    conflicting_rows: int
    train: int
    dev: int
    skipped: tuple[DataError, ...] = ()


def prepare_dataset(inputs: Sequence[Path], output_dir: Path, *, fields: Fields = Fields(),
                    dev_size: int = DEV_SIZE, seed: int = SEED, id_prefix: str = "dapo",
                    skip_bad: bool = False) -> PrepareStats:
    """Turn DAPO-style rows into deduplicated ``train.jsonl`` + disjoint ``dev.jsonl``.

    Ids are ``<id_prefix>-<first 12 hex of sha1(normalised question)>``: stable across
    copies and orderings of the data. Problems are sorted by id, shuffled with ``seed``;
    the first ``dev_size`` form the dev split. Problems whose copies disagree on the
    answer go to ``conflicts.jsonl`` with every answer, its count and first location.
    """
    if dev_size < 1:
        raise ValueError(f"dev_size must be at least 1, got {dev_size}")
    groups, counts, skipped = _group_rows(inputs, fields, skip_bad)
    kept = [g for g in groups.values() if len(g.count_by_answer) == 1]
    conflicts = [g for g in groups.values() if len(g.count_by_answer) > 1]
    problems = _shuffled_problems(kept, id_prefix, seed)
    if len(problems) <= dev_size:
        raise DataError(inputs[0], f"only {len(problems)} usable problems: need more than "
                                   f"the {dev_size} of the dev split")
    output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_jsonl(output_dir / "dev.jsonl", map(_problem_row, problems[:dev_size]))
    atomic_write_jsonl(output_dir / "train.jsonl", map(_problem_row, problems[dev_size:]))
    atomic_write_jsonl(output_dir / "conflicts.jsonl", map(_conflict_row, conflicts))
    good_rows = counts["rows"] - len(skipped)
    return PrepareStats(
        rows_read=counts["rows"], bad_rows_skipped=len(skipped),
        wrappers_stripped=counts["wrapped"], duplicate_rows_removed=good_rows - len(groups),
        problems=len(groups), conflicting_problems=len(conflicts),
        conflicting_rows=sum(sum(g.count_by_answer.values()) for g in conflicts),
        train=len(problems) - dev_size, dev=dev_size, skipped=tuple(skipped))


def _group_rows(inputs: Sequence[Path], fields: Fields, skip_bad: bool
                ) -> tuple[dict[str, _Group], Counter, list[DataError]]:
    groups: dict[str, _Group] = {}
    counts: Counter = Counter()
    skipped: list[DataError] = []
    for item in iter_source_rows(inputs, fields):
        counts["rows"] += 1
        if not isinstance(item, DataError):
            question, wrapped = strip_dapo_wrapper(item.question)
            counts["wrapped"] += wrapped
            if not question:
                item = DataError(item.path, "empty once the DAPO wrapper is removed",
                                 line=item.line, field="question")
        if isinstance(item, DataError):
            if not skip_bad:
                raise item
            skipped.append(item)
            continue
        key = normalise(question)
        groups.setdefault(key, _Group(first=item, question=question)).add(item)
    return groups, counts, skipped


def _shuffled_problems(groups: list[_Group], id_prefix: str, seed: int) -> list[Problem]:
    by_id: dict[str, Problem] = {}
    for g in groups:
        digest = hashlib.sha1(normalise(g.question).encode("utf-8")).hexdigest()[:ID_HASH_CHARS]
        problem = Problem(f"{id_prefix}-{digest}", g.question, g.first.answer, g.first.data_source or id_prefix)
        if problem.id in by_id:
            raise DataError(g.first.path, f"id {problem.id} collides with that of another question: "
                            f"{by_id[problem.id].question[:60]!r}", line=g.first.line, field="question")
        by_id[problem.id] = problem
    problems = sorted(by_id.values(), key=lambda p: p.id)
    random.Random(seed).shuffle(problems)
    return problems


def _problem_row(p: Problem) -> dict:
    return {"id": p.id, "question": p.question, "answer": p.answer, "data_source": p.data_source}


def _conflict_row(g: _Group) -> dict:
    answers = [{"answer": row.answer, "count": g.count_by_answer[key], "path": row.path, "line": row.line}
               for key, row in g.first_by_answer.items()]
    return {"question": g.question, "answers": answers}


# ---------------------------------------------------------------- the hub


def fetch_hub_parquets(repo_id: str = DAPO_REPO, *, revision: str | None = None,
                       cache_dir: str | Path | None = None, offline: bool = False) -> list[Path]:
    """Download (or find in the Hugging Face cache) a hub dataset's parquet files.

    Uses ``huggingface_hub.snapshot_download`` and its cache (``HF_HUB_CACHE`` unless
    ``cache_dir`` is given); ``offline`` (or ``HF_HUB_OFFLINE=1``) uses the cache only.
    Raises ``DataError`` when the hub cannot be reached and nothing is cached.
    """
    # huggingface_hub: heavy, only reading from the hub needs it
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, repo_type="dataset", revision=revision,
                                   cache_dir=cache_dir, local_files_only=offline,
                                   allow_patterns=["*.parquet"])
    except (LocalEntryNotFoundError, HfHubHTTPError) as e:
        reason = str(e).strip().splitlines()[0]
        raise DataError(f"hf://datasets/{repo_id}",
                        f"cannot fetch from the Hugging Face hub and no cached copy was found "
                        f"({type(e).__name__}: {reason}). Pass --input PATH with a local parquet "
                        f"or JSONL copy, or point HF_HUB_CACHE/--cache-dir at a cache that holds it.") from e
    files = sorted(Path(folder).rglob("*.parquet"))
    if not files:
        raise DataError(folder, f"the snapshot of {repo_id} holds no parquet files")
    return files


# ---------------------------------------------------------------- gold answers


def check_gold_answers(problems: Sequence[Problem], *,
                       timeout_s: float = reward.DEFAULT_TIMEOUT_S) -> dict[int, str]:
    """Grade each gold answer, boxed, against itself; return ``{index: reason}`` for failures.

    A failure — a gold answer the grader cannot parse, one too long for the answer
    window, or one that does not grade correct against itself — is a data bug
    (``retool.reward.check_golds`` does the grading, in its worker pool).
    """
    errors = reward.check_golds([p.answer for p in problems], timeout_s=timeout_s)
    return {i: error.reason for i, error in enumerate(errors) if error is not None}


def require_usable_golds(path: str | Path, problems: Sequence[Problem]) -> None:
    """Raise :class:`DataError` naming ``path`` and the first few bad ones unless every gold
    answer grades correct against itself (see :func:`check_gold_answers`); for ``train`` and
    ``eval``, before any model loads."""
    failures = check_gold_answers(problems)
    if failures:
        listed = "; ".join(f"{problems[i].id} {problems[i].answer[:40]!r}: {reason}"
                           for i, reason in sorted(failures.items())[:5])
        raise DataError(path, f"{len(failures)} gold answer(s) the grader cannot use ({listed}); "
                              "fix or remove those rows (`retool validate-data` lists them all)")


# ---------------------------------------------------------------- command line


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``prepare-data`` and ``validate-data`` to the ``retool`` command line."""
    _register_prepare(subparsers)
    _register_validate(subparsers)


def _register_prepare(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "prepare-data",
        description="Read DAPO-Math-17k from the Hugging Face hub (default) or a local "
        "parquet/JSONL file, strip DAPO's prompt wrapper, deduplicate on whitespace-normalised "
        "question text, drop problems whose copies disagree on the answer (listed in "
        "conflicts.jsonl), shuffle (seed 42) and write DIR/train.jsonl and a disjoint "
        "DIR/dev.jsonl with rows {id, question, answer, data_source}. Prints the counts.")
    p.add_argument("--input", type=Path, help="local .parquet or .jsonl file, verl layout "
                   "(prompt, reward_model.ground_truth) or plain question/answer rows; "
                   "default: the hub dataset")
    p.add_argument("--bundled", action="store_true",
                   help="read the copy of DAPO-Math-17k shipped in the package (17,917 rows, one per "
                   "original problem, English wrapper already removed; the 20 Chinese prompts' "
                   "instruction suffix is stripped here, so 'DAPO wrappers stripped' reads 20; no network needed)")
    p.add_argument("--output-dir", type=Path, required=True, help="where to write the splits")
    p.add_argument("--dev-size", type=_positive_int, default=DEV_SIZE, help="problems in dev.jsonl (default %(default)s)")
    p.add_argument("--seed", type=int, default=SEED, help="shuffle seed (default %(default)s)")
    p.add_argument("--question-field", default="question", help="question field of plain rows (default %(default)s)")
    p.add_argument("--answer-field", default="answer", help="answer field of plain rows (default %(default)s)")
    p.add_argument("--id-prefix", default="dapo", help="ids are PREFIX-<hash of question> (default %(default)s)")
    p.add_argument("--skip-bad", action="store_true", help="skip malformed rows and count them "
                   "instead of stopping at the first one")
    p.add_argument("--hub-repo", default=DAPO_REPO, help="hub dataset to read without --input (default %(default)s)")
    p.add_argument("--revision", help="hub revision (branch, tag or commit)")
    p.add_argument("--cache-dir", type=Path, help="Hugging Face cache (default: HF_HUB_CACHE)")
    p.add_argument("--offline", action="store_true", help="use the hub cache only; never download")
    p.set_defaults(func=_run_prepare)


def _register_validate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "validate-data",
        description="Load FILE (a JSONL/parquet file, or a bundled set: aime24, aime25, "
        "math500) and grade each gold answer, written as \\boxed{gold}, against itself with "
        "the reward's grader. Every failure and every malformed row is reported with its "
        "file and line. Exit status 0 when all pass, 1 otherwise. With --skip-bad, malformed "
        "rows are still listed and counted but do not fail the check (gold answers that do "
        "not grade always fail it).")
    p.add_argument("source", metavar="FILE", help="data file or bundled set name")
    p.add_argument("--question-field", help="question field (default: question, or the bundled set's)")
    p.add_argument("--answer-field", help="answer field (default: answer, or the bundled set's)")
    p.add_argument("--id-field", help="id field (default: the row's id if any, else NAME-LINE)")
    p.add_argument("--skip-bad", action="store_true", help="malformed rows do not fail the check")
    p.add_argument("--timeout-s", type=float, default=reward.DEFAULT_TIMEOUT_S,
                   help="wall-clock bound per grade (default %(default)s)")
    p.set_defaults(func=_run_validate)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _run_prepare(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    try:
        output_folder(args.output_dir, "--output-dir")
        if args.cache_dir is not None and args.input is None and not args.bundled:  # the hub download goes there
            output_folder(args.cache_dir, "--cache-dir")
        if args.input is not None and args.bundled:
            raise DataError(args.input, "give either --input or --bundled, not both")
        if args.input is not None:
            inputs = [args.input]
        elif args.bundled:
            inputs = [bundled_dapo_path()]
        else:
            print(f"fetching {args.hub_repo} from the Hugging Face hub ...")
            inputs = fetch_hub_parquets(args.hub_repo, revision=args.revision,
                                        cache_dir=args.cache_dir, offline=args.offline)
        fields = Fields(args.question_field, args.answer_field)
        stats = prepare_dataset(inputs, args.output_dir, fields=fields, dev_size=args.dev_size,
                                seed=args.seed, id_prefix=args.id_prefix, skip_bad=args.skip_bad)
    except (DataError, UnwritableOutputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _print_prepare(stats, inputs, args.output_dir, time.perf_counter() - start)
    return 0


def _print_prepare(stats: PrepareStats, inputs: Sequence[Path], out: Path, seconds: float) -> None:
    for error in stats.skipped[:5]:
        print(f"skipped: {error}", file=sys.stderr)
    print(f"read {stats.rows_read:,} rows from {', '.join(map(str, inputs))}")
    print(f"  bad rows skipped:            {stats.bad_rows_skipped:,}")
    print(f"  DAPO wrappers stripped:      {stats.wrappers_stripped:,}")
    print(f"  duplicate rows removed:      {stats.duplicate_rows_removed:,}")
    print(f"  distinct problems:           {stats.problems:,}")
    print(f"  conflicting answers dropped: {stats.conflicting_problems:,} problems "
          f"({stats.conflicting_rows:,} rows) -> {out / 'conflicts.jsonl'}")
    print(f"wrote {stats.train:,} train -> {out / 'train.jsonl'}")
    print(f"wrote {stats.dev:,} dev   -> {out / 'dev.jsonl'}")
    print(f"done in {seconds:.1f} s")


def _run_validate(args: argparse.Namespace) -> int:
    try:
        data = read_problems(args.source, question_field=args.question_field,
                             answer_field=args.answer_field, id_field=args.id_field, skip_bad=True)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for error in data.skipped:
        print(f"{'skipped' if args.skip_bad else 'error'}: {error}", file=sys.stderr)
    failures = check_gold_answers(data.problems, timeout_s=args.timeout_s)
    for i, reason in sorted(failures.items()):
        p = data.problems[i]
        shown = p.answer if len(p.answer) <= 60 else p.answer[:60] + "…"
        error = DataError(data.path, f"gold answer {shown!r} (id {p.id}): {reason}",
                          line=data.lines[i], field=data.answer_field)
        print(f"error: {error}", file=sys.stderr)
    print(f"{data.path}: {len(data.problems) - len(failures):,} of {len(data.problems):,} gold "
          f"answers grade correct against themselves; {len(failures):,} fail; "
          f"{len(data.skipped):,} malformed rows{' skipped' if args.skip_bad else ''}")
    ok = not failures and (args.skip_bad or not data.skipped)
    return 0 if ok else 1
