"""Atomic, durable file and folder writes: a reader sees the old content or the new, never half.

Every write here goes to a temporary sibling (``.NAME.<pid>.<random>.tmp``), is flushed
and fsynced, renamed over the target with ``os.replace``, and then the directory is
fsynced so the rename itself survives a power cut. A write that raises leaves the
target untouched and removes its temporary file. Folders are staged the same way:
build the new folder next to the target, then :func:`replace_folder`.

Used for every file retool replaces as a whole — datasets, configs, manifests, the
metrics file a resumed run trims, trajectory logs, checkpoints. Stdlib only, so the
lowest layers (config, data, log, engines) can use it.

Not covered: appends (eval results and ``metrics.jsonl`` rows are appended and
fsynced line by line by their writers), concurrent writers of one path (the last
rename wins), and file systems without atomic rename (some network mounts).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import secrets
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def fsync_dir(folder: str | Path) -> None:
    """Make the entries of ``folder`` (a rename into it, a new file) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: str | Path) -> None:
    """fsync every file and folder under ``folder`` (itself included)."""
    folder = Path(folder)
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        elif path.is_dir():
            fsync_dir(path)
    fsync_dir(folder)


GZIP_LEVEL = 1
"""gzip level of compressed files: a step's trajectories (64 x ~2,000 tokens, 4 MB of JSON)
compress in 0.06 s instead of level 9's 0.35 s, to a file 10 % larger."""


@contextmanager
def atomic_open(path: str | Path, mode: str = "w", *, compress: bool = False,
                encoding: str = "utf-8") -> Iterator[IO[Any]]:
    """A file to stream into (``mode`` "w" text or "wb" bytes; ``compress`` = gzip) that
    replaces ``path`` when the block exits cleanly, and is discarded when it raises."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode 'w' or 'wb', not {mode!r}")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as raw:
            stream = gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=GZIP_LEVEL) if compress else raw
            f = io.TextIOWrapper(stream, encoding=encoding) if mode == "w" else stream
            try:
                yield f
            finally:
                _close_layers(f, stream)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _close_layers(f: IO[Any], stream: IO[bytes]) -> None:
    """Flush the text and gzip layers into the raw file without closing it."""
    if f is not stream:
        f.detach()  # flushes the text into ``stream``
    if isinstance(stream, gzip.GzipFile):
        stream.close()  # writes the gzip trailer; leaves the raw file open


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Replace ``path`` with ``data``."""
    with atomic_open(path, "wb") as f:
        f.write(data)
    return Path(path)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Replace ``path`` with ``text`` (UTF-8)."""
    with atomic_open(path) as f:
        f.write(text)
    return Path(path)


def atomic_write_json(path: str | Path, data: Any) -> Path:
    """Replace ``path`` with ``data`` as indented JSON."""
    return atomic_write_text(path, json.dumps(data, indent=2))


def atomic_write_jsonl(path: str | Path, rows: Iterable[Any], *, compress: bool = False) -> int:
    """Replace ``path`` with one JSON line per row (UTF-8, not ASCII-escaped); return the count."""
    count = 0
    with atomic_open(path, compress=compress) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    return count


def replace_folder(staging: str | Path, target: str | Path) -> Path:
    """Put the finished folder ``staging`` at ``target``, replacing what is there.

    ``staging`` is fsynced first; the old ``target`` is moved aside to ``.NAME.old`` and
    deleted only after the rename, so a crash leaves either folder whole at ``target``
    (or none, if it crashed between the two renames; the old one is then at ``.NAME.old``).
    """
    staging, target = Path(staging), Path(target)
    fsync_tree(staging)
    old = target.with_name(f".{target.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    staging.rename(target)
    fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)
    return target
