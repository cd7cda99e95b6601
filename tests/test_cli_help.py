"""Every ``retool`` command's ``--help`` renders (argparse formats help strings with ``%``)."""

from __future__ import annotations

import argparse

from retool.cli import build_parser


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_every_command_help_renders_with_a_description():
    seen = []
    for path, parser in _parsers(build_parser()):
        text = parser.format_help()  # raises on a stray '%' in a help string
        assert text.startswith("usage: retool"), path
        if path:
            assert parser.description, f"retool {' '.join(path)} has no description"
        seen.append(" ".join(path))
    assert {"demo", "train", "eval", "sft", "sandbox serve", "sandbox run"} <= set(seen)
