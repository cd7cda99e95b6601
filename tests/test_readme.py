"""The front door stays a front door: the README's size, its commands, its links, its
rendered trajectory, and one name for the reproduced experiment across the docs."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
DOCS = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_readme_is_short():
    assert len(README) <= 10_000, f"README.md has {len(README)} characters; move detail to docs/"


def test_the_readme_test_command_is_the_one_ci_runs():
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in README
    assert "bash scripts/setup.sh && .venv/bin/retool demo --output-dir runs/demo" in README


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(doc):
    targets = [t.split("#")[0] for t in LINK.findall(doc.read_text()) if not re.match(r"[a-z]+:", t)]
    missing = [t for t in targets if t and not (doc.parent / t).exists()]
    assert not missing, f"{doc.name} links to missing files: {missing}"


def test_the_reproduced_experiment_has_one_name():
    for doc in DOCS:
        text = doc.read_text()
        assert not re.search(r"\bthe seed's\b|\bseed's (run|configuration)\b", text, re.I), doc.name
    assert README.count("ByteDance") == 1 and "the reference run" in README


@pytest.mark.timeout(180)  # loads the SmolLM2 tokenizer and starts a sandbox
def test_the_readme_trajectory_is_what_the_renderer_prints(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["show_trajectory.py"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(REPO / "examples" / "show_trajectory.py"), run_name="__main__")
    assert done.value.code == 0
    printed = capsys.readouterr().out.strip("\n")
    assert "--- mask 1 ---" in printed and "<tool_response>" in printed
    assert f"```text\n{printed}\n```" in README
