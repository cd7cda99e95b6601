"""Regenerate the flag tables of docs/cli.md from the config dataclasses.

A table follows a marker line ``<!-- flags:TrainConfig ... -->`` (or ``SFTConfig``) and
runs until the first line that does not start with ``|``. Run after changing a config:
``python scripts/flag_tables.py`` (tests check the tables are current).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from retool.config import markdown_table
from retool.sft import SFTConfig
from retool.train import TrainConfig

CONFIGS = {"TrainConfig": TrainConfig, "SFTConfig": SFTConfig}
FILES = ("docs/cli.md",)
MARKER = re.compile(r"<!-- flags:(\w+)")


def regenerate(text: str) -> str:
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        out.append(lines[i])
        match = MARKER.match(lines[i])
        i += 1
        if match:
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
            out.extend(markdown_table(CONFIGS[match[1]]).rstrip("\n").split("\n"))
    return "\n".join(out)


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    for name in FILES:
        path = root / name
        path.write_text(regenerate(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
