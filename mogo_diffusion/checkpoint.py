"""Run checkpoints: safetensors for tensors, JSON for the rest, written atomically.

A checkpoint is a directory ``step-000042/`` holding ``tensors.safetensors`` (every tensor of the
saved state, under its path in the state) and ``state.json`` (the state with each tensor replaced
by a reference). It is written to ``step-000042.tmp/`` and renamed when complete, so a run killed
mid-write leaves the previous checkpoint as the latest. Nothing is unpickled on load.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

__all__ = ["CheckpointError", "checkpoint_path", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]

_NAME = re.compile(r"step-(\d{6,})")
_TENSOR, _ITEMS, _TUPLE = "__tensor__", "__items__", "__tuple__"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the file."""


def _flatten(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-able ``value`` with tensors moved to ``tensors`` (non-string keys and tuples kept)."""
    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach().cpu().contiguous()
        return {_TENSOR: path}
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value):
            return {key: _flatten(item, f"{path}.{key}", tensors) for key, item in value.items()}
        return {_ITEMS: [[key, _flatten(item, f"{path}.{key}", tensors)] for key, item in value.items()]}
    if isinstance(value, tuple):
        return {_TUPLE: [_flatten(item, f"{path}.{i}", tensors) for i, item in enumerate(value)]}
    if isinstance(value, list):
        return [_flatten(item, f"{path}.{i}", tensors) for i, item in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot checkpoint {path} of type {type(value).__name__}")


def _unflatten(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            return tensors[value[_TENSOR]]
        if set(value) == {_ITEMS}:
            return {key: _unflatten(item, tensors) for key, item in value[_ITEMS]}
        if set(value) == {_TUPLE}:
            return tuple(_unflatten(item, tensors) for item in value[_TUPLE])
        return {key: _unflatten(item, tensors) for key, item in value.items()}
    if isinstance(value, list):
        return [_unflatten(item, tensors) for item in value]
    return value


def checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    """Where :func:`save_checkpoint` puts step ``step``: ``directory/step-NNNNNN``."""
    return Path(directory) / f"step-{step:06d}"


def save_checkpoint(directory: str | os.PathLike, step: int, state: dict[str, Any]) -> Path:
    """Write ``state`` (nested dicts, lists, tuples, scalars, tensors) as ``directory/step-N``."""
    final = checkpoint_path(directory, step)
    partial = final.with_name(final.name + ".tmp")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _flatten(state, "state", tensors)
    save_file(tensors, partial / "tensors.safetensors")
    (partial / "state.json").write_text(json.dumps(skeleton))
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    return final


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The complete checkpoint of the highest step in ``directory``, or None."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    steps = [
        (int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.fullmatch(p.name)) and p.is_dir()
    ]
    return max(steps)[1] if steps else None


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The state saved by :func:`save_checkpoint` in ``path``; raises :class:`CheckpointError`."""
    path = Path(path)
    for name in ("state.json", "tensors.safetensors"):
        if not (path / name).is_file():
            raise CheckpointError(
                f"checkpoint {str(path)!r} has no {name}: it is incomplete or not a checkpoint"
            )
    try:
        skeleton = json.loads((path / "state.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{str(path / 'state.json')!r} is corrupt: {error}") from error
    try:
        tensors = load_file(path / "tensors.safetensors")
    except Exception as error:  # safetensors raises its own error types for truncated files
        raise CheckpointError(f"{str(path / 'tensors.safetensors')!r} is corrupt: {error}") from error
    try:
        return _unflatten(skeleton, tensors)
    except KeyError as error:
        raise CheckpointError(f"checkpoint {str(path)!r} refers to a missing tensor {error}") from error
