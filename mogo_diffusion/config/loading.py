"""The YAML and override engine: a config from defaults, a YAML file and dotted ``KEY=VALUE``
overrides, in that order, and the command-line flags that give them.

.. code-block:: python

    config = load_config("run.yaml", ["train.lr=1e-4", "rewards.0.weight=2"])

Values are parsed by ``yaml.safe_load`` rules, except that ``1e-4`` is a float (YAML 1.2), not the
string PyYAML makes of it, that only ``true`` and ``false`` are booleans (YAML 1.2: ``no`` and
``yes`` stay strings), and that aliases (``*name``) are refused: they would let a few hundred bytes
expand to gigabytes when the config is saved; a key given twice in one mapping is an error naming
both lines (YAML would keep the last silently), and so is nesting deeper than
:data:`~mogo_diffusion.config.schema.MAX_DEPTH` levels. Overrides ``KEY=VALUE`` take a dotted key
(list entries by index: ``rewards.0.weight``; the index one past the end appends) and a YAML value
(``train.lr=1e-4``, ``model.lora_targets=[to_q, to_k]``). Setting ``strategy.name`` to another
strategy (in a file or an override) starts that strategy's fields from their defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from mogo_diffusion.config.schema import MAX_DEPTH, Config, StrategyConfig
from mogo_diffusion.config.typed import ConfigError, join, tagged_member

__all__ = ["add_config_arguments", "config_from_args", "load_config"]


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that reads YAML 1.2 floats such as ``1e-4`` and YAML 1.2 booleans (only
    ``true`` and ``false``: ``no``, ``yes``, ``on`` and ``off`` stay strings, so
    ``train.mixed_precision=no`` is the string its field takes), and refuses aliases, keys given
    twice in a mapping and nesting deeper than :data:`~mogo_diffusion.config.schema.MAX_DEPTH`."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0  # the collections around the node being composed

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        mark = event.start_mark
        if isinstance(event, yaml.AliasEvent):
            raise ConfigError(
                f"{mark.name}: line {mark.line + 1}: YAML aliases (*{event.anchor}) are not allowed in a "
                "config; write the value out"
            )
        if self.depth > MAX_DEPTH:  # before the composer's recursion overflows Python's stack
            raise ConfigError(f"{mark.name}: line {mark.line + 1}: nested deeper than {MAX_DEPTH} levels")
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # a collection as a key is refused below; ``<<`` merges are YAML's overrides
            key = self.construct_object(key_node)
            if key in first:
                mark, before = key_node.start_mark, first[key].start_mark
                raise ConfigError(
                    f"{mark.name}: line {mark.line + 1}: key {key!r} is given twice in one mapping "
                    f"(first on line {before.line + 1}); YAML would keep the last silently"
                )
            first[key] = key_node
        return super().construct_mapping(node, deep=deep)


_BOOL = "tag:yaml.org,2002:bool"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _parse_yaml(text: str, source: str) -> Any:
    loader = _Loader(text)  # a SafeLoader: no arbitrary objects
    loader.name = source
    try:
        return loader.get_single_data()
    except yaml.YAMLError as error:
        raise ConfigError(f"{source}: not valid YAML: {error}") from None
    finally:
        loader.dispose()


def _merge(base: Any, update: Any, path: str = "") -> Any:
    """``update`` over ``base``: mappings merge key by key, anything else is replaced; a tagged
    section (``strategy``) whose ``name`` changes is replaced whole."""
    if isinstance(base, dict) and isinstance(update, dict):
        if path == "strategy" and update.get("name", base.get("name")) != base.get("name"):
            return update
        return {**base, **{k: _merge(base.get(k), v, join(path, k)) for k, v in update.items()}}
    return update


def _set(data: dict[str, Any], override: str) -> None:
    """Apply one ``KEY=VALUE`` override to plain data."""
    key, sep, text = override.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {override!r}: expected KEY=VALUE with a dotted KEY, e.g. train.lr=1e-4")
    value = _parse_yaml(text, f"override {override!r}")
    parts = key.split(".")
    if parts == ["strategy", "name"] and isinstance(value, str) and value != data["strategy"].get("name"):
        member = tagged_member(StrategyConfig, value, "strategy")
        data["strategy"] = {**dataclasses.asdict(member()), "name": value}
        return  # another strategy, its fields at their defaults
    node: Any = data
    for depth, part in enumerate(parts):
        last, where = depth == len(parts) - 1, ".".join(parts[: depth + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) > len(node):
                raise ConfigError(
                    f"{where}: no entry {part!r} in a list of {len(node)} ({len(node)} appends)"
                )
            index = int(part)
            if index == len(node):
                node.append({})
            if last:
                node[index] = value
            node = node[index]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            elif not isinstance(node.get(part), dict | list):
                node[part] = {}
            node = node[part]
        else:
            raise ConfigError(f"{where}: cannot set a key inside {type(node).__name__} {node!r}")


def _read_file(path: Path) -> Any:
    """The mapping in the YAML file at ``path``, or a ConfigError saying what is wrong with it."""
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory, not a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (byte {error.start}: {error.reason})"
        ) from None
    loaded = _parse_yaml(text, str(path))
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(loaded).__name__}")
    return loaded or {}


def load_config(
    path: str | os.PathLike | None = None, overrides: Sequence[str] = (), defaults: Config | None = None
) -> Config:
    """``defaults`` (:class:`Config`'s own if None), updated by the YAML file at ``path`` (if
    given), then by ``overrides``."""
    data = (defaults or Config()).to_dict()
    if path is not None:
        data = _merge(data, _read_file(Path(path)))
    for override in overrides:
        _set(data, override)
    return Config.from_dict(data)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--config PATH`` and repeatable ``--set KEY=VALUE`` to ``parser``."""
    parser.add_argument("--config", type=Path, default=None, help="YAML config file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field, e.g. --set train.lr=1e-4 (repeatable)",
    )
    return parser


def config_from_args(args: argparse.Namespace, defaults: Config | None = None) -> Config:
    """The config of a namespace parsed with :func:`add_config_arguments`, over ``defaults``."""
    return load_config(args.config, args.overrides, defaults)
