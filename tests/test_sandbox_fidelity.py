"""A call or session call prints what ``python file.py`` prints: two cases that once differed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from retool.sandbox import Sandbox, SandboxConfig

RAISES = "def f():\n    return 1 / 0\n\nf()\n"
REBINDS_STDOUT = ("import io, sys\nprint('before', file=sys.__stdout__)\nsys.stdout = io.StringIO()\n"
                  "print('captured')\nprint('after', file=sys.__stdout__)\n")


@pytest.fixture(scope="module")
def sb():
    with Sandbox(SandboxConfig(timeout_s=10, workers=2, preload=())) as sandbox:
        yield sandbox


def python_file(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "main.py"
    script.write_text(code)
    return subprocess.run([sys.executable, script.name], cwd=tmp_path, capture_output=True, text=True)


def test_a_session_traceback_shows_source_lines_like_a_call(sb, tmp_path):
    call = sb.run_sync(RAISES)
    with sb.session() as s:
        in_session = s.run_sync(RAISES)
    assert "    return 1 / 0\n" in in_session.stderr and "    f()\n" in in_session.stderr
    assert in_session.stderr.replace("call1.py", "main.py") == call.stderr
    expected = python_file(RAISES, tmp_path).stderr.replace(str(tmp_path / "main.py"), "/sandbox/work/main.py")
    assert call.stderr.replace(sb.run_sync("print(__file__)").stdout.strip(), "/sandbox/work/main.py") == expected


def test_a_session_still_uses_the_snippets_own_excepthook(sb):
    with sb.session() as s:
        s.run_sync("import sys\nsys.excepthook = lambda t, v, tb: print('hooked', t.__name__, file=sys.stderr)")
        assert s.run_sync("1 / 0").stderr == "hooked ZeroDivisionError\n"


def test_text_written_to_the_original_stdout_is_kept(sb, tmp_path):
    expected = python_file(REBINDS_STDOUT, tmp_path)
    assert expected.stdout == "before\nafter\n"  # what python prints: the teardown flushes sys.__stdout__
    res = sb.run_sync(REBINDS_STDOUT, auto_print=False)
    assert (res.stdout, res.stderr, res.exit_code) == (expected.stdout, "", 0)


def test_text_written_to_the_original_stdout_is_kept_by_a_session_call(sb):
    with sb.session() as s:
        first = s.run_sync(REBINDS_STDOUT, auto_print=False)
        later = s.run_sync("sys.stdout = sys.__stdout__\nprint('next')")  # the rebinding carried over
    assert first.stdout == "before\nafter\n" and later.stdout == "next\n"  # each call's own output
