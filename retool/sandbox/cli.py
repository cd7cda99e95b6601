"""``retool sandbox``: serve the sandbox over HTTP, or run one snippet in it.

- ``retool sandbox serve`` starts the SandboxFusion-compatible server
  (:mod:`retool.sandbox.server`) on 127.0.0.1:8080 until SIGINT/SIGTERM.
- ``retool sandbox run [FILE ...]`` runs a file (or stdin) once — in a local sandbox, or
  on a server with ``--endpoint`` — as ``python FILE`` would (``--auto-print``: as the
  model's tool, which also shows a final bare expression's value) and prints the
  :class:`~retool.types.ExecutionResult` as JSON; the exit code is 0 when the snippet
  ran cleanly and 1 otherwise. Several files run one after the other (a JSON list of
  results); with ``--interpreter stateful`` they run in one interpreter session, so a
  later file sees the variables of an earlier one.

Timeouts are bounded: a number of seconds in (0, ``MAX_TIMEOUT_S``]; ``0``, negative
values, ``inf`` and ``nan`` are refused by argparse with one line naming the flag.

The HTTP server and client (aiohttp, pydantic) are imported only by the subcommand
that uses them.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

from retool.flag_checks import listen_address
from retool.sandbox import Sandbox, SandboxConfig, SandboxUnavailableError
from retool.sandbox.executor import MAX_TIMEOUT_S

DEFAULT_WORKERS = 64
"""``retool sandbox serve``'s pool size (= ``retool.sandbox.server.DEFAULT_WORKERS``,
repeated so that ``retool sandbox run`` imports no server code)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sandbox",
        description="The local Python sandbox: a SandboxFusion-compatible HTTP server, "
        "and a one-shot runner for trying snippets.",
    )
    commands = parser.add_subparsers(dest="sandbox_command", metavar="SUBCOMMAND", required=True)
    _register_serve(commands)
    _register_run(commands)


def timeout_seconds(text: str) -> float:
    """argparse type of a timeout: seconds in (0, MAX_TIMEOUT_S]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value <= MAX_TIMEOUT_S:  # also false for nan
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds > 0 and <= {MAX_TIMEOUT_S:g} (the sandbox's maximum), got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type of a count or size that must be >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def _add_limit_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout", type=timeout_seconds, metavar="S",
                        help="wall-clock limit per run in seconds, at most 3600 (default: the sandbox default)")
    parser.add_argument("--memory-mb", type=positive_int, metavar="MB",
                        help="memory the snippet may allocate, in MiB, on top of what the sandbox "
                             "preloaded (default: the sandbox default)")


def _register_serve(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "serve",
        help="serve POST /run_code (SandboxFusion-compatible) until interrupted",
        description="Serve the sandbox over HTTP with SandboxFusion's POST /run_code, so verl, "
        "the sandbox-fusion client or curl can run Python in it. No authentication: the "
        "server binds 127.0.0.1 unless --host says otherwise. See docs/sandbox-server.md.",
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8080, help="TCP port, 0 for any free one (default: %(default)s)")
    p.add_argument("--workers", type=positive_int, default=DEFAULT_WORKERS, metavar="N",
                   help="runs executed at once; more requests queue (default: %(default)s, verl's "
                        "default concurrency; sizing rule in docs/sandbox-server.md)")
    _add_limit_flags(p)
    p.add_argument("--max-timeout", type=timeout_seconds, default=300.0, metavar="S",
                   help="largest run_timeout a request may ask for, at most 3600 (default: %(default)s)")
    p.add_argument("--max-memory-mb", type=positive_int, default=16384, metavar="MB",
                   help="largest memory_limit_MB a request may ask for (default: %(default)s)")
    p.add_argument("--max-request-mb", type=float, default=64.0, metavar="MB",
                   help="largest request body, code and files included (default: %(default)s)")
    p.add_argument("--allow-network", action="store_true",
                   help="let snippets use the network (default: no network where the OS allows)")
    p.add_argument("--strict", "--sandbox-strict", action="store_true", dest="strict",
                   help="refuse to start unless the sandbox has full isolation (namespaces, "
                        "read-only filesystem, privilege drop, rlimits)")
    p.add_argument("--max-sessions", type=positive_int, default=64, metavar="N",
                   help="stateful sessions open at once (POST /sessions); one more is refused with 429 "
                        "(default: %(default)s)")
    p.add_argument("--session-idle", type=timeout_seconds, default=300.0, metavar="S",
                   help="close a session after this many seconds without a run (default: %(default)s)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="server log level (default: %(default)s)")
    p.set_defaults(func=_serve)


def _register_run(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "run",
        help="run a Python file or stdin once and print the result as JSON",
        description="Run a snippet once in the sandbox (locally, or on a server with --endpoint) "
        "as `python FILE` would run it, and print the ExecutionResult as JSON. Exit code 0 "
        "when it ran cleanly, 1 otherwise.",
    )
    p.add_argument("files", nargs="*", metavar="FILE",
                   help="Python files to run, one after the other; '-' or nothing reads stdin")
    _add_limit_flags(p)
    p.add_argument("--stdin-file", metavar="PATH", help="file whose text is fed to the snippet's stdin")
    p.add_argument("--put", action="append", default=[], metavar="PATH[=NAME]",
                   help="copy a local file into the run's working directory (as NAME); repeatable")
    p.add_argument("--fetch", action="append", default=[], metavar="NAME",
                   help="return this file from the working directory (base64 in 'files'); repeatable")
    p.add_argument("--endpoint", metavar="URL",
                   help="run on this SandboxFusion-compatible server instead of a local sandbox")
    p.add_argument("--auto-print", action="store_true",
                   help="also show the value of a final bare expression, as the model's code tool does")
    p.add_argument("--interpreter", choices=("stateless", "stateful"), default="stateless",
                   help="stateless: each FILE in a fresh process; stateful: all FILEs in one interpreter "
                        "session, which keeps their variables (no --stdin-file/--put/--fetch) "
                        "(default: %(default)s)")
    p.set_defaults(func=_run)


# ---------------------------------------------------------------- serve


def _serve(args: argparse.Namespace) -> int:
    from retool.sandbox.server import ServerConfig, serve  # aiohttp and pydantic: only serve needs them

    listen_address(args.host, args.port)  # before the sandbox starts: a bad --host/--port is one line
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServerConfig(
        host=args.host,
        port=args.port,
        sandbox=_sandbox_config(args, workers=args.workers, network=args.allow_network or None,
                                strict=args.strict or None),
        max_timeout_s=args.max_timeout,
        max_memory_mb=args.max_memory_mb,
        max_request_mb=args.max_request_mb,
        max_sessions=args.max_sessions,
        session_idle_s=args.session_idle,
    )
    try:
        asyncio.run(serve(config))
    except SandboxUnavailableError as e:
        print(f"retool sandbox serve: the sandbox could not start: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # taken since the check: a clear line, not a traceback
        print(f"error: --port {args.port}: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    return 0


def _sandbox_config(args: argparse.Namespace, **extra: Any):
    """A SandboxConfig with only the flags the user gave overriding its defaults."""
    given = {"timeout_s": args.timeout, "memory_mb": args.memory_mb, **extra}
    return SandboxConfig(**{k: v for k, v in given.items() if v is not None})


# ---------------------------------------------------------------- run


def _run(args: argparse.Namespace) -> int:
    stateful = args.interpreter == "stateful"
    if stateful and (args.stdin_file or args.put or args.fetch):
        print("retool sandbox run: --interpreter stateful takes no --stdin-file, --put or --fetch "
              "(a session's interpreter is already running)", file=sys.stderr)
        return 2
    try:
        codes = [sys.stdin.read() if name == "-" else Path(name).read_text() for name in args.files or ["-"]]
        stdin = Path(args.stdin_file).read_text() if args.stdin_file else None
        files = dict(_read_put(spec) for spec in args.put)
    except OSError as e:
        print(f"retool sandbox run: {e}", file=sys.stderr)
        return 2
    kwargs = {"auto_print": args.auto_print} if stateful else dict(
        stdin=stdin, files=files or None, fetch_files=tuple(args.fetch), auto_print=args.auto_print)

    try:
        run = _run_remote if args.endpoint else _run_local
        results = run(args, codes, kwargs, stateful)
    except (SandboxUnavailableError, ValueError) as e:  # ValueError: a request the sandbox refuses
        print(f"retool sandbox run: the sandbox could not run the file: {e}", file=sys.stderr)
        return 2
    records = [result_to_json(r) for r in results]
    print(json.dumps(records[0] if len(records) == 1 else records, indent=2))
    return 0 if all(r.ok for r in results) else 1


def _read_put(spec: str) -> tuple[str, bytes]:
    path, _, name = spec.partition("=")
    return name or Path(path).name, Path(path).read_bytes()


def _run_local(args: argparse.Namespace, codes: list[str], kwargs: dict[str, Any], stateful: bool) -> list:
    sandbox = Sandbox(_sandbox_config(args, workers=1))
    try:
        if not stateful:
            return [sandbox.run_sync(code, **kwargs) for code in codes]
        with sandbox.session() as session:
            return [session.run_sync(code, **kwargs) for code in codes]
    finally:
        sandbox.close()


def _run_remote(args: argparse.Namespace, codes: list[str], kwargs: dict[str, Any], stateful: bool) -> list:
    from retool.sandbox.client import SandboxClient  # aiohttp: only --endpoint needs it

    client = SandboxClient(args.endpoint, auto_print=kwargs.pop("auto_print"))
    limits = {"timeout_s": args.timeout, "memory_mb": args.memory_mb}
    if not stateful:
        return [client.run_sync(code, **limits, **kwargs) for code in codes]

    async def in_one_session() -> list:
        async with client, client.session() as session:
            return [await session.run(code, **limits) for code in codes]

    return asyncio.run(in_one_session())


def result_to_json(result) -> dict[str, Any]:
    """An ExecutionResult as plain JSON (status by value, fetched files base64)."""
    record = dataclasses.asdict(result)
    record["status"] = result.status.value
    record["isolation"] = list(result.isolation)
    record["files"] = {p: base64.b64encode(data).decode("ascii") for p, data in result.files.items()}
    return record
