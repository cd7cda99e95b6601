"""The ``retool`` command line.

Each command lives in the module that implements it; that module exposes
``register(subparsers)``, which adds its parser (and the other commands it owns, listed
in :data:`COMMANDS` under the same module) and sets ``func`` to a callable taking the
parsed ``argparse.Namespace`` and returning an exit code.

:data:`COMMANDS` is the registry: a command's name, module and one-line help. A command's
module is imported only when that command runs (or prints its ``--help``), so
``retool --help`` imports no torch or transformers and answers at once, and a command
does not pay for the imports of the others.

Output flags follow one convention on every command: ``--output`` names a file,
``--output-dir`` a folder (the old ``--out``, and ``export --output``, are refused with
a pointer to the new name).

A :class:`~retool.flag_checks.FlagError` raised while the flags are parsed or the command
runs (an unwritable ``--output``, a port in use, a renamed flag) is printed as one line,
``error: ...``, with exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from retool import __version__
from retool.flag_checks import FlagError


@dataclass(frozen=True)
class Command:
    """One ``retool`` command: its name, the module whose ``register`` adds it, its help line."""

    name: str
    module: str
    help: str


COMMANDS: tuple[Command, ...] = (
    Command("prepare-data", "retool.data", "DAPO-Math-17k → deduplicated train.jsonl + 50-row dev.jsonl"),
    Command("validate-data", "retool.data", "check every gold answer grades correct against itself"),
    Command("grade", "retool.grade_command", "grade model answers against gold answers (JSONL in, JSONL out)"),
    Command("sandbox", "retool.sandbox.cli", "serve the code sandbox over HTTP (SandboxFusion API) or run one snippet"),
    Command("task-data", "retool.tasks", "write the synthetic arithmetic task: SFT dialogues or RL/test problems"),
    Command("sft", "retool.sft", "cold-start SFT on tool dialogues (loss on assistant tokens only)"),
    Command("train", "retool.train", "RL-train a model to use the code interpreter (GRPO/PPO)"),
    Command("eval", "retool.evaluate", "evaluate a base model or checkpoint: Average@k, Pass@k, Format (resumable)"),
    Command("export", "retool.export", "write a run's trained LoRA adapter as a PEFT folder"),
    Command("demo", "retool.demo", "the whole pipeline on CPU: SmolLM2 → cold-start SFT → RL → evals, plots, viewer"),
    Command("compare", "retool.report.compare",
            "compare two evals of the same problems: difference and paired standard error"),
    Command("plot", "retool.report.plots", "draw the checkpoint comparison or a run's training curves (PNG + SVG)"),
    Command("view", "retool.report.view", "write a self-contained HTML page of trajectories (runs or eval results)"),
    Command("verl-config", "retool.integrations.verl.launch",
            "write a verl launch folder (data, agent loop, reward hook, run.sh) for multi-node runs"),
    Command("regrade", "retool.regrade",
            "grade recorded answers again with the current grader (eval file or run folder)"),
    Command("replay", "retool.replay", "run recorded code calls again in the current sandbox and check they reproduce"),
)
"""Every command, in the order ``retool --help`` lists them."""

COMMAND_MODULES: tuple[str, ...] = tuple(dict.fromkeys(c.module for c in COMMANDS))
"""The modules that register commands (each once)."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``retool`` parser, with the full parser of ``command`` (its module imported)
    and a one-line entry for every other command; ``None``: entries only."""
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
    chosen = next((c for c in COMMANDS if c.name == command), None)
    if chosen is not None:
        importlib.import_module(chosen.module).register(subparsers)
    for c in COMMANDS:
        if c.name not in subparsers.choices:
            subparsers.add_parser(c.name, help=c.help, add_help=False)
    return parser


def command_name(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names: its first word that is not an option (``retool``'s own
    options, ``--help`` and ``--version``, take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` parsed by the parser of the command it names, as :func:`main` parses it."""
    return build_parser(command_name(argv)).parse_args(list(argv))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(command_name(argv))
    try:
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except FlagError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
