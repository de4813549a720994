"""Typed configs read from YAML: a dataclass built from a mapping; unknown keys, wrong types, values out
of a field's range and YAML that says one key twice are refused, naming the key, the value and the fix.

A field states its range where it is declared: `count(4)` (an int >= 1), `at_least(0, 0.0)`,
`fraction(0.02)` (in [0, 1)), `positive(1.0)` (> 0), or `bounded(default, lo=..., hi=..., lo_open=...)`;
None always passes (an unset optional value)."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path

import yaml

from selfdraft.errors import UserError


class ConfigError(UserError):
    """A config file or value that does not fit its dataclass."""


def bounded(default=dataclasses.MISSING, *, lo=None, hi=None, lo_open=False, hi_open=False, fix: str = ""):
    """A dataclass field whose values (each item, for a list) must lie within [lo, hi] (open ends as
    flagged); `fix` says what to write instead."""
    kwargs = {"default_factory": default} if callable(default) else {"default": default}
    rule = {"lo": lo, "hi": hi, "lo_open": lo_open, "hi_open": hi_open, "fix": fix}
    return dataclasses.field(**kwargs, metadata={"range": rule})


def count(default=dataclasses.MISSING, fix: str = "a whole number >= 1"):
    return bounded(default, lo=1, fix=fix)


def at_least(lo, default=dataclasses.MISSING, fix: str = ""):
    return bounded(default, lo=lo, fix=fix or f"a number >= {lo}")


def positive(default=dataclasses.MISSING, fix: str = "a number > 0"):
    return bounded(default, lo=0, lo_open=True, fix=fix)


def fraction(default=dataclasses.MISSING, fix: str = "a fraction in [0, 1)"):
    return bounded(default, lo=0, hi=1, hi_open=True, fix=fix)


def _check_range(value, rule: dict, where: str) -> None:
    if value is None:
        return
    for item in value if isinstance(value, list) else [value]:
        lo, hi = rule["lo"], rule["hi"]
        low = lo is not None and (item <= lo if rule["lo_open"] else item < lo)
        high = hi is not None and (item >= hi if rule["hi_open"] else item > hi)
        if low or high:
            raise ConfigError(f"{where}: {value!r} is out of range; use {rule['fix']}")


class _StrictLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (PyYAML keeps the last, silently)."""


def _no_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False):
    seen = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError(
                f"key {key!r} appears twice in one mapping (lines {seen[key] + 1} and "
                f"{key_node.start_mark.line + 1}); YAML would keep only the last: merge them"
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def read_yaml(path: str | Path, what: str = "config") -> object:
    """A YAML file, strictly: a syntax error, a key given twice, a folder or an unreadable file is one
    ConfigError naming the file; an empty file reads as None."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a folder; pass a YAML file")
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist; pass the path of a YAML file")
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader)
    except ConfigError as err:
        raise ConfigError(f"{what} {path}: {err}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(f"{what} {path} is not valid YAML{at} ({problem}); fix it") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{what} {path} cannot be read as UTF-8 text ({err}); pass a YAML file") from None


def _check_type(value, annotation, where: str):
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in typing.get_args(annotation):
            try:
                return _check_type(value, arg, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(f"{where}: {value!r} does not fit {annotation}")
    if annotation is type(None):
        if value is not None:
            raise ConfigError(f"{where}: expected null, got {value!r}")
        return None
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item,) = typing.get_args(annotation)
        return [_check_type(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if annotation is float and isinstance(value, str):
        # YAML 1.1 reads `1e-3` (no dot) as a string; a number written that way is still a number
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got the string {value!r}") from None
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: {value!r} is not a finite number")
    if annotation in (int, float, str, bool):
        if not isinstance(value, annotation) or (annotation is int and isinstance(value, bool)):
            raise ConfigError(f"{where}: expected {annotation.__name__}, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {annotation}")


def build_dataclass(cls, raw: dict, where: str = ""):
    """Instantiate dataclass `cls` from a mapping, recursively; unknown keys and wrong types are errors."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"unknown key {where}{unknown[0]!r} (allowed: {', '.join(sorted(names))})")
    values = {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name, value in raw.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = build_dataclass(hint, value, f"{where}{name}.")
        else:
            values[name] = _check_type(value, hint, f"{where}{name}")
            if "range" in fields[name].metadata:
                _check_range(values[name], fields[name].metadata["range"], f"{where}{name}")
    return cls(**values)
