"""YAML in for :mod:`slurm_resilience.config`: reading the file and checking values.

Knows nothing of the sections (``config.load_config`` does): it turns a path into
a mapping and a YAML scalar into the annotated Python type, each failure a
one-line ``ConfigError`` naming the file, the key or the position.
"""

from __future__ import annotations

import os
import typing
from typing import Any, Iterable, Mapping

import yaml

from slurm_resilience.errors import ConfigError

__all__ = ["check_type", "read_source"]


def check_type(where: str, value: Any, annotation: Any) -> Any:
    """Return ``value`` (ints widened to float, a list of strings to a tuple for
    ``tuple[str, ...]``) or raise ConfigError."""
    if typing.get_origin(annotation) is tuple:
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ConfigError(f"{where} must be a list of strings, got {value!r}")
    args = () if typing.get_origin(annotation) is dict else typing.get_args(annotation)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), annotation) if args else annotation
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where} must be {_type_word(base)}, got null")
    plain = [a for a in args if a is not type(None)]
    if len(plain) > 1 and typing.get_origin(annotation) is not dict:  # e.g. ``int | str``
        if any(isinstance(value, a) and not (a is int and isinstance(value, bool)) for a in plain):
            return value
        raise ConfigError(f"{where} must be {' or '.join(_type_word(a) for a in plain)}, got {value!r}")
    origin = typing.get_origin(base)
    if origin is dict:
        if isinstance(value, Mapping):
            return dict(value)  # the owning section checks names and values
        raise ConfigError(f"{where} must be a mapping of option → value, got {value!r}")
    if base is bool:
        if isinstance(value, bool):
            return value
    elif base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif base is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{where} must be {_type_word(base)}, got {value!r}")


def _type_word(tp: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def read_source(source: str | os.PathLike | Mapping | None,
                sections: Iterable[str]) -> tuple[Mapping, str]:
    """The document and where it came from (for messages); ``sections`` only names
    the valid sections when the file holds something other than a mapping.

    Raises:
        ConfigError: missing or unreadable file, invalid YAML, not a mapping.
    """
    if source is None:
        return {}, "defaults"
    if isinstance(source, Mapping):
        return source, "config"
    path = os.fspath(source)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"invalid YAML in {path}{where}: {problem}") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{path} must hold a mapping of sections ({', '.join(sections)}), got {type(doc).__name__}")
    return doc, os.path.basename(path)
