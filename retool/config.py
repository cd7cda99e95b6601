"""Flat, documented configs: one dataclass per entry point, TOML presets, CLI overrides.

A config is a plain (non-frozen) dataclass whose fields are declared with
:func:`option`, which records a help text. From such a class:

- :func:`add_config_args` adds one ``--field-name`` flag per field to an argparse
  parser (booleans get ``--flag/--no-flag``), plus ``--config FILE.toml``;
- :func:`config_from_args` builds the config: class defaults, then the TOML preset,
  then the flags the user actually gave — later wins — and calls ``validate()`` if the
  class defines it, so bad values are rejected before any model loads.

Unknown keys in a preset and values of the wrong type are errors that name the file
and the key. A class may list renamed fields in a ``RENAMED`` class attribute
(``{"old": "new"}``): the old flag and the old preset key are refused with one line
that points to the new name.

**Sections.** A field whose type is itself a (frozen) dataclass of :func:`option` fields
is a *section*: the settings of one engine, say. Its fields become flags prefixed with
the section's name (``--local-kv-cache-mb``), shown in ``--help`` under their own
heading, a TOML table in a preset (``[local]`` / ``kv_cache_mb = 512``) and a nested
object in a saved ``config.json``. Sections are one level deep; nothing else nests
(deliberately — one flat config per command).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from retool.atomic import atomic_write_text
from retool.flag_checks import refuse_renamed

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

C = TypeVar("C")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


def option(default: Any, help: str, *, choices: tuple | None = None) -> Any:
    """Declare a config field with its default and a one-line help text."""
    meta = {"help": help, "choices": choices}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _section_class(tp: Any) -> type | None:
    """The dataclass of a section field's type (see the module docstring), else ``None``."""
    base = _base_type(tp)
    return base if isinstance(base, type) and dataclasses.is_dataclass(base) else None


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _section_dest(section: str, name: str) -> str:
    return f"{section}.{name}"


def _base_type(tp: Any) -> Any:
    """``int | None`` → ``int``; ``tuple[str, ...]`` → ``tuple``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0]) if len(args) == 1 else str
    return origin or tp


def _parse_value(raw: str, tp: Any) -> Any:
    base = _base_type(tp)
    if raw.lower() in ("none", "null") and type(None) in typing.get_args(tp):
        return None
    if base in (tuple, list):
        items = [s.strip() for s in raw.split(",") if s.strip()]
        inner = typing.get_args(_strip_optional(tp))
        conv = inner[0] if inner and inner[0] is not Ellipsis else str
        return base(conv(i) for i in items)
    if base is bool:
        return raw.lower() in ("1", "true", "yes", "on")
    return base(raw)


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def add_config_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add ``--config`` and one flag per field of the config dataclass ``cls``
    (a section's fields under their own heading, prefixed with the section's name)."""
    parser.add_argument("--config", type=Path, default=None, metavar="FILE.toml",
                        help="a TOML preset; flags given on the command line override it")
    for old, new in _renamed(cls).items():
        refuse_renamed(parser, _flag(old), _flag(new))
    hints = _field_types(cls)
    for f in dataclasses.fields(cls):
        section = _section_class(hints[f.name])
        if section is None:
            _add_flag(parser, f, hints[f.name], f.name, f.name)
            continue
        group = parser.add_argument_group(f"{f.name} settings", f.metadata.get("help"))
        section_hints = _field_types(section)
        for sub in dataclasses.fields(section):
            _add_flag(group, sub, section_hints[sub.name], f"{f.name}_{sub.name}", _section_dest(f.name, sub.name))


def _renamed(cls: type) -> dict[str, str]:
    """The ``RENAMED`` map of a config class: old field name → new (see the module docstring)."""
    return getattr(cls, "RENAMED", {})


def _add_flag(parser: Any, f: dataclasses.Field, tp: Any, name: str, dest: str) -> None:
    meta = f.metadata
    help_text = f"{meta.get('help', '')} (default: {_default(f)!r})"
    if _base_type(tp) is bool:
        parser.add_argument(_flag(name), dest=dest, action=argparse.BooleanOptionalAction,
                            default=argparse.SUPPRESS, help=help_text)
        return
    parser.add_argument(_flag(name), dest=dest, default=argparse.SUPPRESS, type=_flag_type(tp),
                        choices=meta.get("choices"), metavar=name.upper(), help=help_text)


def _flag_type(tp: Any) -> Any:
    """The argparse ``type`` of a field: a bad value is reported as argparse does, with the
    flag and the expected type ("argument --lr: expected a float, got 'abc'")."""
    def parse(raw: str) -> Any:
        try:
            return _parse_value(raw, tp)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {_type_words(tp)}, got {raw!r}") from None
    return parse


def _type_words(tp: Any) -> str:
    """``float | None`` → "a float (or none)"; ``tuple[str, ...]`` → "a comma-separated list of str"."""
    base = _base_type(tp)
    names = {int: "an integer", float: "a float", str: "a string", bool: "a boolean"}
    if base in (tuple, list):
        inner = typing.get_args(_strip_optional(tp))
        words = f"a comma-separated list of {getattr(inner[0], '__name__', 'str') if inner else 'str'}"
    else:
        words = names.get(base, getattr(base, "__name__", str(base)))
    return words + (" (or none)" if type(None) in typing.get_args(tp) else "")


def _coerce(cls: type, key: str, value: Any, source: str) -> Any:
    tp = _field_types(cls)[key]
    section = _section_class(tp)
    if section is not None:
        return _coerce_section(section, key, value, source)
    base = _base_type(tp)
    if value is None or base is Any:
        return value
    if base in (tuple, list) and isinstance(value, (list, tuple)):
        return base(value)
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base in (int, float, str, bool) and not isinstance(value, base):
        raise ConfigError(f"{source}: {key} must be {base.__name__}, got {value!r}")
    if base is int and isinstance(value, bool):
        raise ConfigError(f"{source}: {key} must be int, got {value!r}")
    return value


def _coerce_section(section: type, key: str, value: Any, source: str) -> Any:
    """A section's value (a TOML table, a saved dict or an instance) as an instance of ``section``."""
    if isinstance(value, section):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {key} must be a table of settings, got {value!r}")
    names = {f.name for f in dataclasses.fields(section)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {', '.join(f'{key}.{u}' for u in unknown)}")
    return section(**{k: _coerce(section, k, v, f"{source}: {key}") for k, v in value.items()})


def load_toml(cls: type, path: Path) -> dict[str, Any]:
    """Read a TOML preset for ``cls``; unknown keys and wrong types raise ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    names = {f.name for f in dataclasses.fields(cls)}
    renamed = sorted(set(raw) & set(_renamed(cls)))
    if renamed:
        raise ConfigError(f"{path}: {renamed[0]} was renamed: use {_renamed(cls)[renamed[0]]}")
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)} for {cls.__name__}")
    return {k: _coerce(cls, k, v, str(path)) for k, v in raw.items()}


def config_from_args(cls: type[C], args: argparse.Namespace) -> C:
    """Defaults ← TOML preset (``--config``) ← explicit flags; then ``validate()``."""
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(load_toml(cls, args.config))
    hints = _field_types(cls)
    for f in dataclasses.fields(cls):
        section = _section_class(hints[f.name])
        if section is None:
            if hasattr(args, f.name):
                values[f.name] = getattr(args, f.name)
            continue
        flags = {sub.name: getattr(args, _section_dest(f.name, sub.name)) for sub in dataclasses.fields(section)
                 if hasattr(args, _section_dest(f.name, sub.name))}
        if flags:
            values[f.name] = dataclasses.replace(values.get(f.name, _default(f)), **flags)
    return make_config(cls, **values)


def make_config(cls: type[C], **values: Any) -> C:
    """Build and validate a config from keyword values."""
    try:
        cfg = cls(**values)
    except TypeError as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from None
    validate = getattr(cfg, "validate", None)
    if validate is not None:
        validate()
    return cfg


def validate_sections(cfg: Any) -> None:
    """Call ``validate()`` of every section of ``cfg`` that defines one."""
    for f in dataclasses.fields(cfg):
        validate = getattr(getattr(cfg, f.name), "validate", None)
        if _section_class(_field_types(type(cfg))[f.name]) is not None and validate is not None:
            validate()


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-ready dict of a config (tuples become lists, paths strings)."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            out[f.name] = config_to_dict(v)
        else:
            out[f.name] = list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v
    return out


def config_from_dict(cls: type[C], data: dict[str, Any], source: str = "saved config") -> C:
    """Rebuild a config saved with :func:`config_to_dict` (e.g. from a run folder)."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)} for {cls.__name__}")
    return make_config(cls, **{k: _coerce(cls, k, v, source) for k, v in data.items()})


def resumed_config(cls: type[C], args: argparse.Namespace) -> C:
    """The saved config of the run folder ``args.resume`` (its ``config.json``), with
    ``run_dir`` pointing there and ``--max-steps`` (and ``--max-cost``, for a run that
    stopped at its budget) applied when given.

    Raises :class:`ConfigError` when the folder has no ``config.json``.
    """
    saved = Path(args.resume) / "config.json"
    if not saved.is_file():
        raise ConfigError(f"--resume {args.resume}: no config.json there (not a run folder)")
    try:
        data = json.loads(saved.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"--resume {args.resume}: config.json is not valid JSON ({err}); restore it "
                          "from a backup or start a new run") from None
    upgrade = getattr(cls, "upgrade_saved", None)
    if upgrade is not None:  # a config saved by an older retool
        data = upgrade(data)
    data["run_dir"] = str(args.resume)
    for name in ("max_steps", "max_cost"):
        if hasattr(args, name):
            data[name] = getattr(args, name)
    return config_from_dict(cls, data, str(saved))


def save_config(cfg: Any, path: Path) -> None:
    """Write ``cfg`` to ``path`` as sorted, indented JSON, atomically (:mod:`retool.atomic`)."""
    atomic_write_text(path, json.dumps(config_to_dict(cfg), indent=2, sort_keys=True) + "\n")


def require(condition: bool, message: str) -> None:
    """Raise ConfigError(message) unless ``condition`` holds (for ``validate()`` methods)."""
    if not condition:
        raise ConfigError(message)


def markdown_table(cls: type, prefix: str = "") -> str:
    """A Markdown table of a config's flags, defaults and help (for the docs); ``prefix``
    names a section's flags as its parent config does (``markdown_table(LocalSettings, "local_")``)."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    hints = _field_types(cls)
    for f in dataclasses.fields(cls):
        section = _section_class(hints[f.name])
        if section is None:
            rows.append(_table_row(prefix + f.name, f))
        else:
            rows.extend(_table_row(f"{f.name}_{sub.name}", sub) for sub in dataclasses.fields(section))
    return "\n".join(rows) + "\n"


def _table_row(name: str, f: dataclasses.Field) -> str:
    default = _default(f)
    if isinstance(default, tuple):
        default = ",".join(map(str, default))
    help_text = f.metadata.get("help", "")
    if f.metadata.get("choices"):
        help_text += f" ({' / '.join(f.metadata['choices'])})"
    return f"| `{_flag(name)}` | `{default}` | {help_text} |"
