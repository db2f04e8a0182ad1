"""What a run's config asks that :class:`~mogo_diffusion.config.Config` alone cannot check.

:func:`check_config` needs the reward registry, the strategies, accelerate's trackers and the file
system; :func:`check_model` needs the transformer. The trainer runs both before it trains
(:meth:`Trainer.from_config <mogo_diffusion.train.Trainer.from_config>`), and ``--check``
(:mod:`mogo_diffusion.preflight`) runs the same ones offline, so it refuses every config the
trainer refuses. Every refusal is a :class:`~mogo_diffusion.config.ConfigError` naming the dotted
field.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path

import torch
from accelerate.tracking import get_available_trackers
from accelerate.utils import LoggerType

from mogo._extras import MissingExtraError, require
from mogo.registry import closest
from mogo_diffusion import models
from mogo_diffusion.config import LORA_TARGETS, Config, ConfigError
from mogo_diffusion.rewards import reward_factory
from mogo_diffusion.strategies import make_strategy

__all__ = ["check_config", "check_model", "check_split", "check_trackers"]


def check_config(config: Config, world: int = 1) -> None:
    """Everything a run's start depends on but its model: what :meth:`Config.validate
    <mogo_diffusion.config.Config.validate>` checks, reward names and options (against
    :func:`mogo_diffusion.rewards.available_rewards`), the strategy
    (:func:`~mogo_diffusion.strategies.make_strategy`), the trackers (:func:`check_trackers`),
    the epoch's split over ``world`` processes (:func:`check_split`), and ``train.out_dir``.
    :func:`check_model` checks the rest once the model is known.

    Raises:
        ConfigError: naming the dotted field.
    """
    config.validate()
    _check_rewards(config)
    make_strategy(config)
    check_trackers(config.train.log_with)
    check_split(config, world)
    _check_out_dir(config.train.out_dir)


def _check_rewards(config: Config) -> None:
    """Each reward's name is registered and its options are its factory's arguments."""
    for i, spec in enumerate(config.rewards):
        where = f"rewards.{i}"
        try:
            factory = reward_factory(spec.name)
        except ValueError as error:
            raise ConfigError(f"{where}.name: {error}") from None
        signature = inspect.signature(factory)
        parameters = signature.parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            for option in spec.options:
                if option not in parameters:
                    hint = closest(option, parameters)
                    raise ConfigError(
                        f"{where}.options.{option}: {spec.name!r} has no such option{hint}; "
                        f"it accepts {', '.join(parameters) or 'none'}"
                    )
        try:
            signature.bind(**spec.options)
        except TypeError as error:
            raise ConfigError(f"{where}.options: {spec.name!r}: {error}") from None


def check_trackers(names: Sequence[str]) -> None:
    """``train.log_with``: each name an accelerate tracker, its package installed.

    Raises:
        ConfigError: an unknown tracker (naming the known ones), or one whose package is missing.
    """
    known = [str(kind) for kind in LoggerType if kind != LoggerType.ALL]
    available = {str(kind) for kind in get_available_trackers()}
    for name in names:
        if name not in known:
            raise ConfigError(f"train.log_with: unknown tracker {name!r}; known: {', '.join(known)}")
        if name == "tensorboard":
            try:
                require("train.log_with: tracker 'tensorboard'", "tracking")
            except MissingExtraError as error:
                raise ConfigError(str(error)) from None
        if name not in available:
            raise ConfigError(f"train.log_with: tracker {name!r} needs its package: pip install {name}")


def check_split(config: Config, world: int) -> None:
    """An epoch's prompts split evenly over ``world`` processes, and each process has a batch for
    every one of ``train.steps_per_epoch`` steps.

    Raises:
        ConfigError: naming ``sampling.prompts_per_epoch`` or ``train.steps_per_epoch``.
    """
    sampling, train = config.sampling, config.train
    if sampling.prompts_per_epoch % world:
        raise ConfigError(
            f"sampling.prompts_per_epoch: {sampling.prompts_per_epoch} prompts do not split evenly over "
            f"{world} processes"
        )
    local = sampling.prompts_per_epoch * sampling.group_size // world
    batches = -(-local // train.batch_size)
    if train.steps_per_epoch is not None and train.steps_per_epoch > batches:
        raise ConfigError(
            f"train.steps_per_epoch: {train.steps_per_epoch} steps, but each process trains {batches} "
            f"batch(es) of train.batch_size={train.batch_size} per epoch ({local} images: "
            f"sampling.prompts_per_epoch x sampling.group_size / {world} process(es))"
        )


def _check_out_dir(out_dir: str) -> None:
    """``train.out_dir`` is a directory or can be made: neither it nor a parent is a file."""
    path = Path(out_dir)
    for existing in (path, *path.parents):
        if existing.exists():
            if not existing.is_dir():
                inside = "" if existing == path else f": the run directory {out_dir!r} cannot be made in it"
                raise ConfigError(f"train.out_dir: {str(existing)!r} is a file, not a directory{inside}")
            return


def check_model(config: Config, transformer: torch.nn.Module, vae_scale_factor: int) -> None:
    """What ``config`` asks of the model: every ``model.lora_targets`` entry names layers of
    ``transformer`` (before the adapters are added), and ``sampling.resolution`` fits the
    transformer and the VAE (:func:`mogo_diffusion.models.latent_size`). ``transformer`` may be on
    the ``meta`` device: ``--check`` builds it from its config.

    Raises:
        ConfigError: naming the dotted field and the valid values.
    """
    _check_lora_targets(config.model.lora_targets, transformer)
    try:
        models.latent_size(config.sampling.resolution, transformer.config, vae_scale_factor)
    except ValueError as error:
        raise ConfigError(f"sampling.resolution: {error}") from None


def _check_lora_targets(targets: Sequence[str], transformer: torch.nn.Module) -> None:
    """Each target names a linear layer of ``transformer`` (as peft matches them: the module's
    dotted name, or its end after a dot); peft drops a target that matches nothing silently when
    another one matches."""
    names = [name for name, module in transformer.named_modules() if isinstance(module, torch.nn.Linear)]
    for i, target in enumerate(targets):
        if not any(name == target or name.endswith(f".{target}") for name in names):
            ends = sorted({".".join(name.split(".")[-n:]) for name in names for n in (1, 2)})
            raise ConfigError(
                f"model.lora_targets.{i}: {target!r} names no linear layer of the transformer"
                f"{closest(target, ends)}; "
                f"SD3's attention projections are {', '.join(LORA_TARGETS)}"
            )
