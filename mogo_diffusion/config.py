"""Run configuration: typed nested dataclasses, YAML files and dotted command-line overrides.

.. code-block:: python

    config = load_config("run.yaml", ["train.lr=1e-4", "rewards.0.weight=2"])
    config.save(out_dir / "config.yaml")

A file sets any subset of the fields below; the rest keep their defaults, which follow the
published SD3.5-Medium multi-reward DiffusionNFT recipe. Values are parsed by ``yaml.safe_load``
rules, except that ``1e-4`` is a float (YAML 1.2), not the string PyYAML makes of it. Overrides
``KEY=VALUE`` take a dotted key (list entries by index: ``rewards.0.weight``; the index one past
the end appends) and a YAML value (``train.lr=1e-4``, ``model.lora_targets=[to_q, to_k]``).

Everything is validated, and every error is a :class:`ConfigError` naming the dotted field:
unknown keys (with the closest known key), types, ranges, reward names (against the registry) and
options (against the reward's signature), reward weights against the strategy, sequential stages
and the single strategy's reward against the configured rewards, and a local model directory
that does not exist.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import math
import os
import re
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from mogo_diffusion.rewards import available_rewards, reward_factory

__all__ = [
    "Config",
    "ConfigError",
    "ModelConfig",
    "NFTConfig",
    "RewardSpec",
    "SamplingConfig",
    "StageConfig",
    "StrategyConfig",
    "TrainConfig",
    "add_config_arguments",
    "config_from_args",
    "load_config",
]


class ConfigError(ValueError):
    """A configuration value is invalid; the message starts with the dotted field."""


Check = tuple[str, Callable[[Any], bool]]
POSITIVE: Check = ("> 0", lambda x: x > 0)
NON_NEGATIVE: Check = (">= 0", lambda x: x >= 0)
FRACTION: Check = ("in (0, 1]", lambda x: 0 < x <= 1)
DECAY: Check = ("in [0, 1)", lambda x: 0 <= x < 1)
NON_EMPTY: Check = ("non-empty", bool)


def _field(default: Any = dataclasses.MISSING, *, check: Check) -> Any:
    """A dataclass field whose value (when not None) must pass ``check``."""
    return field(default=default, metadata={"check": check})


LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


@dataclass
class ModelConfig:
    """The pretrained SD3 pipeline and the trained LoRA adapter.

    Attributes:
        pretrained: a hub id (``org/name``) or a local directory (``/...``, ``./...``, ``~/...``).
        revision: the hub revision (branch, tag or commit), or None.
        variant: the weights variant (e.g. ``"fp16"``), or None.
        dtype: the dtype of the frozen weights.
        lora_rank, lora_alpha: the adapter's rank r and scale alpha.
        lora_targets: the attention projections that get an adapter.
        max_sequence_length: T5 tokens per prompt (16 to 32 suit tiny models).
    """

    pretrained: str = _field("stabilityai/stable-diffusion-3.5-medium", check=NON_EMPTY)
    revision: str | None = None
    variant: str | None = None
    dtype: Literal["float32", "float16", "bfloat16"] = "float16"
    lora_rank: int = _field(32, check=POSITIVE)
    lora_alpha: float = _field(64.0, check=POSITIVE)
    lora_targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS), metadata={"check": NON_EMPTY})
    max_sequence_length: int = _field(256, check=POSITIVE)


@dataclass
class SamplingConfig:
    """Sampling from the old policy (CFG-free, deterministic).

    Attributes:
        num_steps: sampler steps per image in training (10 single-reward, 25 multi-reward).
        eval_num_steps: sampler steps in evaluation.
        solver: the ODE solver.
        resolution: image side in pixels, a multiple of 16.
        group_size: images per prompt, G >= 2 (advantages are relative to the group).
        prompts_per_epoch: prompt groups sampled per epoch.
        prompts: the training prompts, a source of :func:`mogo_diffusion.prompts.load_prompt_set`
            (a text file, a GenEval ``.jsonl``, ``shapes:train``); None for a small built-in set.
        eval_prompts: the held-out prompts of the evaluation, a source as ``prompts``; None: none.
        batch_size: images per sampler call.
    """

    num_steps: int = _field(25, check=POSITIVE)
    eval_num_steps: int = _field(40, check=POSITIVE)
    solver: Literal["euler", "dpmpp2m"] = "dpmpp2m"
    resolution: int = _field(512, check=("a positive multiple of 16", lambda x: x > 0 and x % 16 == 0))
    group_size: int = _field(24, check=(">= 2", lambda x: x >= 2))
    prompts_per_epoch: int = _field(48, check=POSITIVE)
    prompts: str | None = None
    eval_prompts: str | None = None
    batch_size: int = _field(9, check=POSITIVE)


@dataclass
class NFTConfig:
    """The DiffusionNFT loss and the advantages (see :mod:`mogo_diffusion.nft`).

    Attributes:
        beta: the mixing strength of the implicit positive and negative policies, in (0, 1].
        adv_clip: C, the advantage clip and the loss scale ``C / beta``.
        kl_coef: the weight of ``mean (v - v_ref)^2`` (0 skips the reference forward).
        std_scope: the advantages' std over the whole ``"batch"`` or each prompt ``"group"``.
        weighted_sum_nan: a NaN reward in the weighted-sum baseline counts as ``"zero"`` or
            ``"raise"``-s (see :func:`mogo_diffusion.advantages.weighted_sum_advantages`).
    """

    beta: float = _field(0.1, check=FRACTION)
    adv_clip: float = _field(5.0, check=POSITIVE)
    kl_coef: float = _field(1e-4, check=NON_NEGATIVE)
    std_scope: Literal["batch", "group"] = "batch"
    weighted_sum_nan: Literal["zero", "raise"] = "zero"


@dataclass
class RewardSpec:
    """One reward: its registered ``name``, a ``weight`` (>= 0) and its factory's ``options``."""

    name: str
    weight: float | None = _field(None, check=NON_NEGATIVE)
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class StageConfig:
    """A stage of the sequential strategy: train on ``reward`` for ``epochs`` epochs."""

    reward: str
    epochs: int = _field(check=POSITIVE)


@dataclass
class StrategyConfig:
    """How the K reward losses become one update.

    Attributes:
        name: ``"marble"`` (harmonized), ``"weighted_sum"`` (one advantage of ``sum_k w_k R_k``),
            ``"sequential"`` (one reward per stage) or ``"single"`` (one reward: the specialist).
        harmonize_every: N, optimizer steps between harmonizations (marble).
        alpha_ema: rho, the EMA decay of the reused alpha, in [0, 1) (marble).
        stages: the sequential strategy's stages, in order.
        reward: the single strategy's reward.
        estimate: an optimizer step accumulates one ``backward`` per trained timestep; alpha is
            estimated on the ``"first"`` of them or on the whole ``"window"``.
        reward_scale: the weighted sum adds the ``"raw"`` rewards or their batch ``"zscore"``-s
            (:func:`mogo_diffusion.advantages.zscore_rewards`).
        grad_mode, nonfinite: passed to :class:`mogo.HarmonizedOptimizer`.
    """

    name: Literal["marble", "weighted_sum", "sequential", "single"] = "marble"
    harmonize_every: int = _field(10, check=POSITIVE)
    alpha_ema: float = _field(0.9, check=DECAY)
    stages: list[StageConfig] = field(default_factory=list)
    reward: str | None = None
    estimate: Literal["first", "window"] = "first"
    reward_scale: Literal["raw", "zscore"] = "raw"
    grad_mode: Literal["auto", "batched", "sequential"] = "auto"
    nonfinite: Literal["raise", "skip", "drop"] = "raise"


@dataclass
class TrainConfig:
    """The optimisation loop.

    Attributes:
        lr, weight_decay: AdamW's learning rate and weight decay.
        grad_clip: the gradient-norm clip, or None.
        epochs: sampling-and-training rounds.
        batch_size: samples per training forward.
        timestep_fraction: the fraction of the sampler's timesteps trained per sample
            (``int(fraction * num_steps)`` of them, at least one).
        old_decay_rate, old_decay_max: the old policy follows the trained one by EMA with decay
            ``min(old_decay_rate * step, old_decay_max)``.
        eval_ema_decay: the decay of the separate evaluation EMA, in [0, 1).
        mixed_precision: accelerate's mixed precision.
        reward_threads: rewards scored at once (see :class:`mogo_diffusion.rewards.MultiReward`).
        seed, out_dir: the random seed and the run directory.
        log_every, eval_every, checkpoint_every: periods in epochs.
        log_with: accelerate trackers that also receive the metrics (e.g. ``["tensorboard"]``,
            written under ``out_dir/trackers``); the JSONL file is always written.
    """

    lr: float = _field(3e-4, check=POSITIVE)
    weight_decay: float = _field(1e-4, check=NON_NEGATIVE)
    grad_clip: float | None = _field(1.0, check=POSITIVE)
    epochs: int = _field(1000, check=POSITIVE)
    batch_size: int = _field(9, check=POSITIVE)
    timestep_fraction: float = _field(0.99, check=FRACTION)
    old_decay_rate: float = _field(0.001, check=NON_NEGATIVE)
    old_decay_max: float = _field(0.5, check=DECAY)
    eval_ema_decay: float = _field(0.9, check=DECAY)
    mixed_precision: Literal["no", "fp16", "bf16"] = "fp16"
    reward_threads: int = _field(1, check=POSITIVE)
    seed: int = 42
    out_dir: str = _field("runs/marble", check=NON_EMPTY)
    log_every: int = _field(1, check=POSITIVE)
    eval_every: int = _field(10, check=POSITIVE)
    checkpoint_every: int = _field(30, check=POSITIVE)
    log_with: list[str] = field(default_factory=list)


@dataclass
class Config:
    """A whole run: ``model``, ``sampling``, ``nft``, ``rewards``, ``strategy``, ``train``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    nft: NFTConfig = field(default_factory=NFTConfig)
    rewards: list[RewardSpec] = field(default_factory=list)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Build and :meth:`validate` a config from plain data (missing fields keep defaults)."""
        config = _build(cls, data, "")
        config.validate()
        return config

    def to_dict(self) -> dict[str, Any]:
        """Plain data (dicts, lists, scalars) that :meth:`from_dict` turns back into this config."""
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | os.PathLike) -> None:
        """Write the config as YAML, e.g. next to a run's checkpoints."""
        Path(path).write_text(self.to_yaml())

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first invalid field."""
        _check_ranges(self, "")
        _check_model_path(self.model.pretrained)
        _check_rewards(self.rewards)
        _check_strategy(self.strategy, self.rewards)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _closest(word: Any, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__} {data!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            where = _join(path, key)
            hint = _closest(key, names)
            raise ConfigError(f"{where}: unknown key{hint}; {path or 'config'} has {', '.join(names)}")
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and f.name not in data
    ]
    if missing:
        raise ConfigError(f"{_join(path, missing[0])}: required")
    hints = get_type_hints(cls)
    return cls(**{key: _convert(value, hints[key], _join(path, key)) for key, value in data.items()})


def _convert(value: Any, tp: Any, path: str) -> Any:
    """``value`` as type ``tp``, or a ConfigError naming ``path``."""
    origin, args = get_origin(tp), get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(value, inner, path)
    if origin is Literal:
        if any(type(value) is type(a) and value == a for a in args):
            return value
        hint = _closest(value, [str(a) for a in args])
        raise ConfigError(f"{path}: must be one of {', '.join(map(repr, args))}, got {value!r}{hint}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        return [_convert(item, args[0], _join(path, i)) for i, item in enumerate(value)]
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
        return value
    raise ConfigError(f"{path}: expected {tp.__name__}, got {type(value).__name__} {value!r}")


def _check_ranges(node: Any, path: str) -> None:
    """The fields' ``check`` metadata, through nested dataclasses and lists of them."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            _check_ranges(item, _join(path, i))
        return
    if not dataclasses.is_dataclass(node):
        return
    for f in dataclasses.fields(node):
        value, where = getattr(node, f.name), _join(path, f.name)
        check = f.metadata.get("check")
        if check is not None and value is not None and not check[1](value):
            raise ConfigError(f"{where}: must be {check[0]}, got {value!r}")
        _check_ranges(value, where)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _check_model_path(pretrained: str) -> None:
    """A hub id passes; a path (absolute, ``./``, ``~``, several ``/``) must be a directory."""
    path = os.path.expanduser(pretrained)
    if os.path.isdir(path):
        return
    looks_local = (
        pretrained.startswith(("/", ".", "~", "\\"))
        or os.path.isabs(pretrained)
        or pretrained.count("/") > 1
        or "\\" in pretrained
    )
    if looks_local:
        raise ConfigError(f"model.pretrained: local directory {pretrained!r} does not exist")
    if not _HUB_ID.match(pretrained):
        raise ConfigError(
            f"model.pretrained: {pretrained!r} is neither an existing directory nor a hub id like 'org/name'"
        )


def _check_rewards(rewards: list[RewardSpec]) -> None:
    if not rewards:
        raise ConfigError(
            f"rewards: at least one reward is needed; known rewards: {', '.join(available_rewards())}"
        )
    seen: dict[str, int] = {}
    for i, spec in enumerate(rewards):
        where = f"rewards.{i}"
        if spec.name in seen:
            raise ConfigError(f"{where}.name: {spec.name!r} is already rewards.{seen[spec.name]}")
        seen[spec.name] = i
        try:
            factory = reward_factory(spec.name)
        except ValueError as error:
            raise ConfigError(f"{where}.name: {error}") from None
        signature = inspect.signature(factory)
        parameters = signature.parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            for option in spec.options:
                if option not in parameters:
                    hint = _closest(option, list(parameters))
                    accepted = ", ".join(parameters) or "none"
                    raise ConfigError(
                        f"{where}.options.{option}: {spec.name!r} has no such option{hint}; "
                        f"it accepts {accepted}"
                    )
        try:
            signature.bind(**spec.options)
        except TypeError as error:
            raise ConfigError(f"{where}.options: {spec.name!r}: {error}") from None
        if spec.weight is not None and not math.isfinite(spec.weight):
            raise ConfigError(f"{where}.weight: must be finite, got {spec.weight!r}")


def _check_strategy(strategy: StrategyConfig, rewards: list[RewardSpec]) -> None:
    names = [spec.name for spec in rewards]
    weighted = [spec.weight is not None for spec in rewards]
    if strategy.name == "weighted_sum":
        if not all(weighted):
            i = weighted.index(False)
            raise ConfigError(
                f"rewards.{i}.weight: the weighted_sum strategy needs a weight for every reward"
            )
        if not any(spec.weight for spec in rewards):
            raise ConfigError("rewards: the weighted_sum strategy needs a positive weight")
    elif any(weighted) and not all(weighted):
        i = weighted.index(False)
        raise ConfigError(
            f"rewards.{i}.weight: give a weight for every reward or for none "
            f"(rewards.{weighted.index(True)} has one)"
        )

    def check_reward(name: str, where: str) -> None:
        if name not in names:
            raise ConfigError(
                f"{where}: {name!r} is not a configured reward{_closest(name, names)}; rewards: {names}"
            )

    if strategy.name == "sequential":
        if not strategy.stages:
            raise ConfigError("strategy.stages: the sequential strategy needs at least one stage")
        for i, stage in enumerate(strategy.stages):
            check_reward(stage.reward, f"strategy.stages.{i}.reward")
    elif strategy.stages:
        raise ConfigError(f"strategy.stages: only the sequential strategy has stages, not {strategy.name!r}")
    if strategy.name == "single":
        if strategy.reward is None:
            raise ConfigError("strategy.reward: the single strategy needs the name of its reward")
        check_reward(strategy.reward, "strategy.reward")
    elif strategy.reward is not None:
        raise ConfigError(f"strategy.reward: only the single strategy has one reward, not {strategy.name!r}")


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads YAML 1.2 floats such as ``1e-4``."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # a SafeLoader: no arbitrary objects
    except yaml.YAMLError as error:
        raise ConfigError(f"{source}: not valid YAML: {error}") from None


def _merge(base: Any, update: Any) -> Any:
    """``update`` over ``base``: mappings merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(update, dict):
        return {**base, **{k: _merge(base.get(k), v) for k, v in update.items()}}
    return update


def _set(data: dict[str, Any], override: str) -> None:
    """Apply one ``KEY=VALUE`` override to plain data."""
    key, sep, text = override.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {override!r}: expected KEY=VALUE with a dotted KEY, e.g. train.lr=1e-4")
    value = _parse_yaml(text, f"override {override!r}")
    parts = key.split(".")
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


def load_config(
    path: str | os.PathLike | None = None, overrides: Sequence[str] = (), defaults: Config | None = None
) -> Config:
    """``defaults`` (:class:`Config`'s own if None), updated by the YAML file at ``path`` (if
    given), then by ``overrides``."""
    data = (defaults or Config()).to_dict()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        loaded = _parse_yaml(path.read_text(), str(path))
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level, got {type(loaded).__name__}")
        data = _merge(data, loaded or {})
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
