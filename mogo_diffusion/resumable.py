"""Whether a loaded checkpoint can continue a run: checked whole before any running state changes.

A checkpoint's state (:meth:`Trainer.state <mogo_diffusion.train.Trainer.state>`) is a JSON
object of :data:`STATE_FIELDS`; files come from strangers too (DESIGN: security), so
:func:`check_resumable` checks its structure, every tensor's shape and dtype against the running
adapters, the gradient scaler's fields, an epoch within ``train.epochs``, and the run's config
against the checkpoint's (equal but for :data:`mogo_diffusion.run_dir.RESUME_MAY_CHANGE`). The
file's bytes against their hashes are :func:`mogo_diffusion.checkpoint.load_checkpoint`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mogo_diffusion import run_dir
from mogo_diffusion.checkpoint import CheckpointError
from mogo_diffusion.config import Config, ConfigError

__all__ = ["STATE_FIELDS", "check_resumable"]

STATE_FIELDS = ("epoch", "trained", "old", "eval_ema", "optimizer", "scaler", "config")
"""The fields of a checkpoint's state (the epochs done, the trained, old and evaluation-EMA adapter
tensors, the optimizer's and gradient scaler's states, and the run's config)."""


def check_resumable(
    state: Any,
    path: Path,
    config: Config,
    *,
    trained: Sequence[torch.Tensor],
    old: Sequence[torch.Tensor],
    scaler: torch.amp.GradScaler,
) -> None:
    """Raise unless ``state``, loaded from checkpoint ``path``, continues the run of ``config``
    whose trained and old adapters are ``trained`` and ``old`` and whose gradient scaler is
    ``scaler``. Whether the optimizer's state fits is left to its ``load_state_dict``.

    Raises:
        CheckpointError: naming ``path/state.json`` and the field that does not fit.
        ConfigError: ``config`` differs from the checkpoint's where a resume cannot honour it,
            naming every such field with both values.
    """
    where = repr(str(path / "state.json"))
    if not isinstance(state, dict):
        fields = ", ".join(STATE_FIELDS)
        raise CheckpointError(
            f"{where} must hold an object with the fields {fields}, got {type(state).__name__}"
        )
    if missing := [name for name in STATE_FIELDS if name not in state]:
        raise CheckpointError(f"{where} lacks the fields {', '.join(missing)}")
    epoch = state["epoch"]
    if type(epoch) is not int or epoch < 0:
        raise CheckpointError(f"{where}: field 'epoch' must be a non-negative integer, got {epoch!r}")
    if epoch > config.train.epochs:
        raise CheckpointError(
            f"{where}: field 'epoch' is {epoch}, beyond this run's train.epochs="
            f"{config.train.epochs}: set train.epochs to {epoch} or more to continue it"
        )
    for name, current in (("trained", trained), ("old", old), ("eval_ema", trained)):
        _check_tensors(state[name], current, f"{where}: field {name!r}")
    for name in ("optimizer", "scaler", "config"):
        if not isinstance(state[name], dict):
            raise CheckpointError(
                f"{where}: field {name!r} must be an object, got {type(state[name]).__name__}"
            )
    _check_scaler(state["scaler"], scaler, where)
    _check_same_run(state["config"], config, path)


def _check_tensors(saved: Any, current: Sequence[torch.Tensor], where: str) -> None:
    """Raise unless ``saved`` is a list of tensors of ``current``'s shapes and dtypes."""
    if not isinstance(saved, list) or not all(
        isinstance(t, torch.Tensor) and t.is_floating_point() for t in saved
    ):
        raise CheckpointError(f"{where} must be a list of floating tensors")
    if len(saved) != len(current):
        raise CheckpointError(
            f"{where} has {len(saved)} tensors where this model's adapter has {len(current)}"
        )
    for i, (t, p) in enumerate(zip(saved, current, strict=True)):
        if t.shape != p.shape or t.dtype != p.dtype:
            raise CheckpointError(
                f"{where}: tensor {i} has shape {tuple(t.shape)} and dtype {t.dtype} where this "
                f"model's adapter has {tuple(p.shape)} and {p.dtype}"
            )


def _check_scaler(saved: dict[str, Any], scaler: torch.amp.GradScaler, where: str) -> None:
    """Raise unless ``saved`` is a state of ``scaler`` (any state when it is disabled: it loads
    nothing)."""
    if not scaler.is_enabled():
        return
    fields = scaler.state_dict()
    if missing := [name for name in fields if name not in saved]:
        raise CheckpointError(
            f"{where}: field 'scaler' lacks {', '.join(missing)} of this run's fp16 gradient scaler"
        )
    if bad := [name for name in fields if type(saved[name]) not in (int, float)]:
        raise CheckpointError(f"{where}: field 'scaler': {', '.join(bad)} must be numbers")


def _check_same_run(saved: dict[str, Any], config: Config, path: Path) -> None:
    """Raise unless ``config`` defines the run of the checkpoint's config ``saved``."""
    where = repr(str(path / "state.json"))
    try:  # read by today's schema: a field removed since (config.REMOVED) is no difference
        checkpointed = Config.from_dict(saved).to_dict()
    except ConfigError as error:
        raise CheckpointError(f"{where}: field 'config' is not a valid config: {error}") from None
    changed = run_dir.defining_differences(checkpointed, config.to_dict())
    if changed:
        raise ConfigError(
            f"{', '.join(f for f, _, _ in changed)}: a resume continues the run of checkpoint "
            f"{str(path)!r} as it was configured, and this config differs: "
            + "; ".join(f"{f}: {then!r} in the checkpoint, {now!r} now" for f, then, now in changed)
            + ". Set them back, or start a new run (another train.out_dir)."
        )
