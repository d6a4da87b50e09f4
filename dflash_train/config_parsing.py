"""Parsing a recipe into the typed config tree: dotted ``key=value`` overrides applied to the raw
mapping, then each dataclass built from its section with unknown keys, missing keys and wrong
types refused by an error that names the key and says how to fix it (``config.load_config``)."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal

import yaml


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``a.b.c=value`` override; the value is parsed as YAML (``[1,2]``, ``true``, ``3e-4``)."""
    if "=" not in item:
        raise ValueError(f"override {item!r} is not of the form key.sub=value, e.g. train.lr=3e-4")
    key, _, text = item.partition("=")
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {item!r}: {part!r} is not a section")
    node[parts[-1]] = yaml.safe_load(text) if text.strip() else ""


def from_dict(cls: type, raw: Any, prefix: str, source: str) -> Any:
    """Recursively build dataclass ``cls`` from a mapping, checking keys and types."""
    where = prefix.rstrip(".") or "the recipe root"
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: {where} must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in raw if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, list(fields), n=1)
        hint = f"did you mean '{prefix}{close[0]}'? " if close else ""
        raise ValueError(
            f"{source}: unknown key '{prefix}{key}'; {hint}known keys of {where}: {sorted(fields)}"
        )
    kwargs = {}
    for name, f in fields.items():
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(
                    f"{source}: required key '{prefix}{name}' is missing; add it to the recipe or pass {prefix}{name}=..."
                )
            continue
        kwargs[name] = coerce(hints[name], raw[name], f"{prefix}{name}", source)
    return cls(**kwargs)


def coerce(tp: Any, value: Any, key: str, source: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key + ".", source)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(tp):
            if option is type(None):
                if value is None:
                    return None
                continue
            try:
                return coerce(option, value, key, source)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(errors[-1] if errors else f"{source}: '{key}' has an invalid value {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, bool) and {"on", "off"} <= set(allowed):
            value = "on" if value else "off"  # YAML 1.1 reads bare on/off as booleans
        if value not in allowed:
            raise ValueError(f"{source}: '{key}' = {value!r} is not allowed; use one of {list(allowed)}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ValueError(
                f"{source}: '{key}' must be a list, got {type(value).__name__} {value!r}; write e.g. {key}=[1,2]"
            )
        return [coerce(item_tp, v, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        # YAML 1.1 reads "3e-4" (no dot) as a string; accept any float literal.
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool):
        if isinstance(value, bool) and tp is not bool or not isinstance(value, tp):
            raise ValueError(f"{source}: '{key}' must be {tp.__name__}, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"unsupported annotation {tp!r} for '{key}'")
