"""The verl integration's tests, run in ``.venv-verl`` with the real verl package.

verl pins its own transformers, ray and antlr, so its tests live in ``tests/verl`` and
run in the environment ``bash scripts/setup.sh --verl`` makes; this test runs them (and
the renderer's token-exact tests, under verl's transformers 5.10) in a subprocess, so
the README's one test command covers them. Without ``.venv-verl`` it fails in CI
(``CI`` set) and skips locally.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VERL_PYTHON = REPO / ".venv-verl" / "bin" / "python"
MIN_VERL_TESTS = 19


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~1-2 min of verl tests in a subprocess (the default limit is 60 s)
def test_verl_suite_passes_in_its_own_environment():
    if not VERL_PYTHON.exists():
        reason = f"{VERL_PYTHON.parent.parent} is missing: run `bash scripts/setup.sh --verl`"
        if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
            pytest.fail(reason)
        pytest.skip(reason)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.monotonic()
    result = subprocess.run(
        [str(VERL_PYTHON), "-m", "pytest", "-v", "-p", "no:cacheprovider", "tests/verl", "tests/test_render.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    report = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    passed = [line for line in result.stdout.splitlines() if line.startswith("tests/verl/") and "PASSED" in line]
    assert len(passed) >= MIN_VERL_TESTS, f"only {len(passed)} verl tests ran:\n{report}"
    print(f"verl tests: {len(passed)} passed in {time.monotonic() - start:.0f} s")
