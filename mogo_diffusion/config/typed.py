"""Plain data (what YAML gives: dicts, lists, scalars) into a tree of typed dataclasses, checked
against their annotations, every error a :class:`ConfigError` naming the dotted field.

It knows no particular schema: :func:`build` reads a dataclass's fields and type hints, and a
union of dataclasses is a tagged union, its member picked by the ``name`` field of the data
(:func:`tagged_member`).

    >>> from dataclasses import dataclass, field
    >>> @dataclass
    ... class Optim:
    ...     lr: float = 1e-3
    ...     betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    >>> build(Optim, {"lr": 1, "betas": [0.8, 0.99]}, "optim")
    Optim(lr=1.0, betas=[0.8, 0.99])
    >>> build(Optim, {"lrr": 1}, "optim")
    Traceback (most recent call last):
    ...
    mogo_diffusion.config.typed.ConfigError: optim.lrr: unknown key (did you mean 'lr'?); optim has lr, betas
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

__all__ = ["ConfigError", "build", "closest", "join", "tagged_member"]

_INT64 = 2**63  # every int field must fit a signed 64-bit integer (torch's and numpy's)


class ConfigError(ValueError):
    """A configuration value is invalid; the message starts with the dotted field."""


def join(path: str, key: Any) -> str:
    """The dotted path of ``key`` inside ``path``."""
    return f"{path}.{key}" if path else str(key)


def closest(word: Any, choices: Sequence[str]) -> str:
    """:func:`mogo.registry.closest`'s did-you-mean hint."""
    from mogo.registry import closest as hint  # here, not above: parsing a config imports no torch

    return hint(word, choices)


def tagged_member(union: Any, name: Any, path: str) -> type:
    """The dataclass of ``union`` tagged ``name``: the member whose ``name`` field is a ``Literal``
    holding it, else the open member (a ``name: str`` field) if there is one."""
    if not isinstance(name, str) or not name:
        section = path.rpartition(".")[2]
        raise ConfigError(f"{path}.name: expected a {section} name, got {name!r}")
    members = [a for a in get_args(union) if a is not type(None)]
    open_member = None
    for member in members:
        tag = get_type_hints(member)["name"]
        if get_origin(tag) is Literal and name in get_args(tag):
            return member
        if tag is str and open_member is None:
            open_member = member
    if open_member is None:
        names = [n for m in members for n in get_args(get_type_hints(m)["name"])]
        raise ConfigError(f"{path}.name: must be one of {', '.join(map(repr, names))}, got {name!r}")
    return open_member


def _default_name(union: Any) -> str:
    """The tag a section of ``union`` has when its data gives none: its first member's."""
    first = next(a for a in get_args(union) if a is not type(None))
    return first.name


def build(
    cls: type, data: Any, path: str, removed: Mapping[str, str] = types.MappingProxyType({}), owner: str = ""
) -> Any:
    """``cls(**data)`` with every value converted to its annotated type; keys missing from
    ``data`` keep their defaults. ``removed`` maps dotted fields that no longer exist to why:
    setting one is an error that says it, and ``None`` there is ignored (a saved old value).
    ``owner`` names the record in the message of an unknown key (default: its path)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__} {data!r}")
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    data = {key: value for key, value in data.items() if not (join(path, key) in removed and value is None)}
    for key in data:
        if join(path, key) in removed:
            raise ConfigError(f"{join(path, key)}: this field was removed: {removed[join(path, key)]}")
        if key not in names:
            raise ConfigError(
                f"{join(path, key)}: unknown key{closest(key, names)}; {owner or path or 'config'} has "
                f"{', '.join(names)}"
            )
    for f in fields:
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in data:
            raise ConfigError(f"{join(path, f.name)}: required")
    hints = get_type_hints(cls)
    return cls(**{key: _convert(value, hints[key], join(path, key), removed) for key, value in data.items()})


def _convert(value: Any, tp: Any, path: str, removed: Mapping[str, str]) -> Any:
    """``value`` as type ``tp``, or a ConfigError naming ``path``."""
    origin, args = get_origin(tp), get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path, removed)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if all(dataclasses.is_dataclass(a) for a in args):  # a tagged union: by ``name``
            name = value.get("name", _default_name(tp)) if isinstance(value, dict) else None
            return build(tagged_member(tp, name, path), value, path, removed, f"{path} {name!r}")
        inner = [a for a in args if a is not type(None)]
        if len(inner) > 1:  # ``str | list[...]``: the value's own shape picks the type
            if not isinstance(value, str | list):
                raise ConfigError(
                    f"{path}: expected a string or a list, got {type(value).__name__} {value!r}"
                )
            inner = [a for a in inner if (get_origin(a) is list) == isinstance(value, list)]
        return _convert(value, inner[0], path, removed)
    if origin is Literal:
        if any(type(value) is type(a) and value == a for a in args):
            return value
        hint = closest(value, [str(a) for a in args])
        raise ConfigError(f"{path}: must be one of {', '.join(map(repr, args))}, got {value!r}{hint}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        return [_convert(item, args[0], join(path, i), removed) for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{path}: expected a mapping with string keys, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(f"{path}: must be finite, got {value!r}")
        return float(value)
    if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        if tp is int and not -_INT64 <= value < _INT64:
            raise ConfigError(f"{path}: must fit a 64-bit integer (|value| < 2**63), got {value}")
        return value
    raise ConfigError(f"{path}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
