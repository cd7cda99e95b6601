"""Imports sit at the top of modules: an import inside a function is there only to keep a
heavy or optional dependency (torch, an SDK) off a light path or to break a cycle, and a
comment on its line or just above it (or above the group of imports it belongs to) says
which."""

from __future__ import annotations

import ast
from pathlib import Path

import retool

PACKAGE = Path(retool.__file__).parent

def _commented(lines: list[str], lineno: int) -> bool:
    """Whether the import on ``lineno`` (1-based), or the first of the run of import lines
    it ends, has a comment on its line or the line above."""
    while lineno >= 1:
        if "#" in lines[lineno - 1] or (lineno >= 2 and lines[lineno - 2].lstrip().startswith("#")):
            return True
        above = lines[lineno - 2].lstrip() if lineno >= 2 else ""
        if not above.startswith(("import ", "from ")):
            return False
        lineno -= 1
    return False


def _local_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every ``import`` statement inside a function or method of ``tree``."""
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return found


def uncommented_local_imports() -> list[str]:
    """``path:line: statement`` for each function-local import without a comment."""
    missing = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for node in _local_imports(ast.parse(text)):
            if not _commented(lines, node.lineno):
                missing.add(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return sorted(missing)


def test_every_function_local_import_says_why_it_is_not_at_the_top():
    assert uncommented_local_imports() == []


def test_the_check_finds_an_uncommented_local_import_and_accepts_a_commented_group():
    source = ("def f():\n    import torch\n\n"
              "def g():\n    # pyarrow: heavy\n    import pyarrow as pa\n    import pyarrow.parquet as pq\n")
    lines = source.splitlines()
    verdicts = {n.lineno: _commented(lines, n.lineno) for n in _local_imports(ast.parse(source))}
    assert verdicts == {2: False, 6: True, 7: True}
