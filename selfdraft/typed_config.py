"""Typed configs read from YAML: a dataclass built from a mapping, unknown keys and wrong types refused."""

from __future__ import annotations

import dataclasses
import math
import types
import typing

from selfdraft.errors import UserError


class ConfigError(UserError):
    """A config file or value that does not fit its dataclass."""


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
    for name, value in raw.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = build_dataclass(hint, value, f"{where}{name}.")
        else:
            values[name] = _check_type(value, hint, f"{where}{name}")
    return cls(**values)
