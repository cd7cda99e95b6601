"""Every ``retool`` command's ``--help`` renders (argparse formats help strings with ``%``),
the registry matches what the modules register, and ``retool --help`` stays light."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from retool.cli import COMMAND_MODULES, COMMANDS, build_parser


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def _command_parser(name: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in build_parser(name)._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[name]


def test_every_command_help_renders_with_a_description():
    seen = []
    for command in COMMANDS:
        for path, parser in _parsers(_command_parser(command.name), (command.name,)):
            text = parser.format_help()  # raises on a stray '%' in a help string
            assert text.startswith("usage: retool"), path
            assert parser.description, f"retool {' '.join(path)} has no description"
            seen.append(" ".join(path))
    assert {"demo", "train", "eval", "sft", "sandbox serve", "sandbox run"} <= set(seen)


def test_the_registry_names_exactly_the_commands_each_module_registers():
    for module in COMMAND_MODULES:
        parser = argparse.ArgumentParser()
        __import__(module, fromlist=["register"]).register(parser.add_subparsers())
        registered = set(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices)
        assert registered == {c.name for c in COMMANDS if c.module == module}, module


def test_top_level_help_lists_every_command_and_imports_no_command_module():
    script = (
        "import contextlib, io, json, sys, time\n"
        "t0 = time.perf_counter()\n"
        "from retool.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(json.dumps({'help': out.getvalue(), 's': time.perf_counter() - t0,\n"
        "                  'modules': sorted(sys.modules)}))\n"
    )
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    wall_s = time.perf_counter() - start
    report = json.loads(done.stdout)
    for heavy in ("torch", "transformers", "numpy", "retool.train", "retool.evaluate", "retool.sandbox"):
        assert heavy not in report["modules"], heavy
    for command in COMMANDS:
        assert command.name in report["help"] and command.help.split()[0] in report["help"]
    assert report["s"] < 0.5, f"retool --help took {report['s']:.2f} s in-process ({wall_s:.2f} s with start-up)"


def test_one_command_imports_only_its_own_module():
    script = ("import sys\nfrom retool.cli import build_parser\nbuild_parser('task-data')\n"
              "print(' '.join(m for m in sys.modules if m.startswith('retool.')))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    loaded = set(done.stdout.split())
    assert "retool.tasks" in loaded
    assert not loaded & {"retool.train", "retool.evaluate", "retool.demo", "retool.sft", "retool.report.view"}
