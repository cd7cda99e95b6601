"""How long ``retool --help`` takes with the lazy command registry, against the eager
start-up it replaced (every command module imported and registered), in one run.

Each variant runs in a fresh ``python`` process, alternating, ``--repeats`` times; the
script prints the median wall time of each, their ratio, how many modules each left
in ``sys.modules``, and the load average (this machine is shared, so absolute times
drift; the ratio is the figure to compare).

Usage:  .venv/bin/python bench/cli_startup.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LAZY = """
import contextlib, io, json, sys
from retool.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main(["--help"])
    except SystemExit:
        pass
print(json.dumps({"modules": len(sys.modules), "torch": "torch" in sys.modules}))
"""

EAGER = """
import argparse, importlib, json, sys
from retool.cli import COMMAND_MODULES
parser = argparse.ArgumentParser(prog="retool")
subparsers = parser.add_subparsers()
for name in COMMAND_MODULES:
    importlib.import_module(name).register(subparsers)
parser.format_help()
print(json.dumps({"modules": len(sys.modules), "torch": "torch" in sys.modules}))
"""


def run_once(code: str) -> tuple[float, dict]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return time.perf_counter() - start, json.loads(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="runs of each variant (default: %(default)s)")
    args = parser.parse_args()
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {"lazy": [], "eager": []}
    info: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, code in (("eager", EAGER), ("lazy", LAZY)):
            seconds, info[name] = run_once(code)
            times[name].append(seconds)
    lazy, eager = statistics.median(times["lazy"]), statistics.median(times["eager"])
    print(f"retool --help, median of {args.repeats} fresh processes each (python start-up included)")
    for name, median in (("eager (every command imported)", eager), ("lazy registry", lazy)):
        key = name.split()[0]
        print(f"  {name:32s} {median * 1000:7.1f} ms   {info[key]['modules']:5d} modules   "
              f"torch imported: {info[key]['torch']}")
    print(f"  ratio eager / lazy: {eager / lazy:.2f}x")
    print(f"  load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f} (1-minute)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
