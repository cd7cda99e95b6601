"""The ``retool`` command line.

Each subcommand lives in the module that implements it; that module exposes
``register(subparsers)``, which adds its parser and sets ``func`` to a callable taking
the parsed ``argparse.Namespace`` and returning an exit code. Modules are imported
when the CLI starts, so they must keep heavy imports (torch, transformers) inside
functions: ``retool --help`` and every ``retool X --help`` stay fast and work without
optional packages.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from retool import __version__

COMMAND_MODULES: tuple[str, ...] = (
    "retool.data",
    "retool.grade_command",
    "retool.sandbox.cli",
    "retool.tasks",
    "retool.sft",
    "retool.train",
    "retool.evaluate",
    "retool.export",
    "retool.demo",
    "retool.report.compare",
    "retool.report.plots",
    "retool.report.view",
    "retool.integrations.verl.launch",
    "retool.regrade",
    "retool.replay",
)
"""Modules that register subcommands, in the order ``--help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="retool",
        description=(
            "Train a language model with reinforcement learning to call a Python "
            "interpreter while it reasons through math (ReTool), and measure what "
            "the training bought."
        ),
    )
    parser.add_argument("--version", action="version", version=f"retool-rl {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
