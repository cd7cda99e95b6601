"""Checks of the flags that say where a command writes or listens, shared by every command.

Each check runs before the command does any work and, apart from a probe file that it
creates and removes at once, writes nothing. A failed check raises :class:`FlagError`,
whose message is one line that names the flag; :func:`retool.cli.main` prints it as
``error: ...`` and exits with status 2 (the code argparse uses for a bad flag):

- :func:`output_file`: a file to write (``--output``): not a folder, and its folder is, or
  can be created as, a folder this process can create files in;
- :func:`output_folder`: a folder to write into (``--output-dir``, ``--run-dir``): not a
  file, and writable (or creatable under a writable folder);
- :func:`listen_address`: a host and a TCP port to serve on: a port in 0..65535, a host
  that resolves, and an address nothing else listens on;
- :func:`refuse_renamed`: an old spelling of a renamed flag, refused with a pointer to
  the new one.

Writability is probed by creating a file, not read from the permission bits: root passes
``os.access`` everywhere, yet cannot create files in ``/proc`` or on a read-only mount.

Not covered: the disk filling up later, and a port taken between the check and the bind
(the server's own bind error is reported too).

Stdlib only, so that every layer (and ``retool --help``) can import it.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import tempfile
from pathlib import Path
from typing import Any, NoReturn


class FlagError(ValueError):
    """A flag's value cannot be used; the message is one line that names the flag."""


class UnwritableOutputError(FlagError):
    """An output file or folder that cannot be written; the message names the flag."""


def output_folder(folder: str | Path, flag: str) -> Path:
    """``folder`` if it is, or can be created as, a folder this process can write in;
    else raise :class:`UnwritableOutputError` naming ``flag``. Leaves nothing behind."""
    folder = Path(folder)
    reason = _folder_problem(folder)
    if reason:
        raise UnwritableOutputError(f"cannot write {flag} {folder}: {reason}; choose a writable folder for {flag}")
    return folder


def output_file(path: str | Path, flag: str) -> Path:
    """``path`` if it can be written as a file (replaced or appended to); else raise
    :class:`UnwritableOutputError` naming ``flag``. Leaves nothing behind."""
    path = Path(path)
    if path.is_dir():
        reason = f"{path} is a folder, not a file"
    elif path.exists() and not os.access(path, os.W_OK):
        reason = f"no permission to write {path}"
    else:
        reason = _folder_problem(path.parent)
    if reason:
        raise UnwritableOutputError(f"cannot write {flag} {path}: {reason}; choose a writable file for {flag}")
    return path


def _folder_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot be written in (or created), or ``None`` when it can."""
    existing = _nearest_existing(folder)
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    return _cannot_create_in(existing)


def _nearest_existing(path: Path) -> Path:
    """``path`` (made absolute) or its nearest ancestor that exists."""
    path = path if path.is_absolute() else Path.cwd() / path
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _cannot_create_in(folder: Path) -> str | None:
    """Why no file can be created in the existing folder ``folder``, or ``None`` when one can
    (probed with a file that is removed at once)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".retool-write-check-", dir=folder)
    except OSError as err:
        return f"cannot create files in {folder} ({err.strerror or err})"
    os.close(fd)
    os.unlink(probe)
    return None


def listen_address(host: str, port: int, host_flag: str = "--host", port_flag: str = "--port") -> None:
    """Check that a server can listen on ``host:port`` (port 0 = any free one); raise
    :class:`FlagError` naming the flag at fault. Binds and closes a socket, with
    ``SO_REUSEADDR`` as asyncio's servers use it."""
    if not 0 <= port <= 65535:
        raise FlagError(f"{port_flag} {port}: a TCP port is a number from 0 to 65535 (0 = any free port)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as err:
        raise FlagError(f"{host_flag} {host}: not an address of this machine ({err})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as err:
            raise FlagError(_bind_error(host, port, host_flag, port_flag, err)) from None


def _bind_error(host: str, port: int, host_flag: str, port_flag: str, err: OSError) -> str:
    if err.errno == errno.EADDRINUSE:
        return f"{port_flag} {port}: the port is in use on {host}; choose another (or 0 for any free port)"
    if err.errno == errno.EACCES:
        return f"{port_flag} {port}: no permission to listen on this port (below 1024 needs privileges)"
    return f"{host_flag} {host}: cannot listen on {host}:{port} ({err.strerror or err})"


def refuse_renamed(parser: argparse.ArgumentParser, old: str, new: str, why: str = "") -> None:
    """Make ``old`` a flag of ``parser`` that is refused with one line pointing to ``new``
    (raised as :class:`FlagError`, so :func:`retool.cli.main` prints it and exits 2).
    Hidden from ``--help``; takes any value, or none, so the pointer is what the user sees."""
    message = f"{old} was renamed: use {new}" + (f" ({why})" if why else "")
    parser.add_argument(old, nargs="?", action=_Refuse, help=argparse.SUPPRESS, default=argparse.SUPPRESS,
                        message=message)


class _Refuse(argparse.Action):
    def __init__(self, *args: Any, message: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.message = message

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> NoReturn:
        raise FlagError(self.message)
