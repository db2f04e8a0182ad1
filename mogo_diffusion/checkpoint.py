"""Run checkpoints: safetensors for tensors, JSON for the rest, hashed, written atomically.

A checkpoint is a directory ``step-000042/`` holding ``tensors.safetensors`` (every tensor of the
saved state, under its path in the state), ``state.json`` (the state with each tensor replaced by a
reference), any extra files the caller writes (the trainer's diffusers-format ``lora/``) and
``manifest.json``, the size and SHA-256 of every other file. Nothing is unpickled on load.

Saving writes everything into ``step-000042.tmp/``, hashes it, and only then renames it into place;
re-saving an existing step renames the old folder aside to ``step-000042.old/`` first and deletes it
only after the new one is in place. A process killed at any point therefore leaves every
checkpoint that was complete before the save complete, and the new one either complete or absent:

* killed before the rename: ``step-N.tmp/`` is left over, ignored, and removed by the next save;
* killed between the two renames of a re-save: ``step-N/`` is missing and ``step-N.old/`` is the
  previous, complete version; :func:`list_checkpoints` reports it, the next save renames it back;
* killed after: ``step-N.old/`` is left over, ignored, and removed by the next save.

Loading verifies every file against the manifest and refuses non-finite tensors, so a damaged
checkpoint raises :class:`CheckpointError` naming the file instead of resuming into NaN.

>>> import tempfile
>>> root = tempfile.mkdtemp()
>>> path = save_checkpoint(root, 3, {"epoch": 3, "weights": [torch.ones(2), torch.zeros(3)]})
>>> sorted(p.name for p in path.iterdir())
['manifest.json', 'state.json', 'tensors.safetensors']
>>> load_checkpoint(latest_checkpoint(root))["weights"][0]
tensor([1., 1.])
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "checkpoint_digest",
    "checkpoint_path",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]

MANIFEST = "manifest.json"
"""The file of a checkpoint that lists the size and SHA-256 of each of its other files."""
_FORMAT = "mogo-checkpoint/1"
_NAME = re.compile(r"step-(\d{6,})(\.old)?")
_TENSOR, _ITEMS, _TUPLE = "__tensor__", "__items__", "__tuple__"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the file."""


def _boundary(name: str) -> None:
    """Called after each write of :func:`save_checkpoint` (its ``name`` says which); a no-op.

    Fault-injection tests replace it with one that kills the process at a chosen boundary."""


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


def _nonfinite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The keys of the floating tensors that hold a NaN or an infinity."""
    return [
        key
        for key, tensor in tensors.items()
        if (tensor.is_floating_point() or tensor.is_complex()) and not bool(torch.isfinite(tensor).all())
    ]


def _digest(file: Path, *, flush: bool = False) -> str:
    """The SHA-256 of ``file``; with ``flush``, after flushing the file to the disk."""
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
        if flush:
            os.fsync(handle.fileno())
    return digest.hexdigest()


def _fsync_directory(directory: Path) -> None:
    if os.name == "posix":  # a directory cannot be opened for fsync elsewhere
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def _write_manifest(directory: Path) -> None:
    """Hash every file under ``directory`` into its ``manifest.json``."""
    files = {}
    for file in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        files[file.relative_to(directory).as_posix()] = {
            "bytes": file.stat().st_size,
            "sha256": _digest(file, flush=True),
        }
    (directory / MANIFEST).write_text(json.dumps({"format": _FORMAT, "files": files}, indent=1))
    _digest(directory / MANIFEST, flush=True)  # on the disk before the rename that publishes it
    _fsync_directory(directory)


def checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    """Where :func:`save_checkpoint` puts step ``step``: ``directory/step-NNNNNN``."""
    return Path(directory) / f"step-{step:06d}"


def checkpoint_digest(path: str | os.PathLike) -> str:
    """The SHA-256 (hex) of checkpoint ``path``'s manifest, which lists the size and hash of every
    other file: a name for the checkpoint's content (unverified; see :func:`verify_checkpoint`)."""
    return _digest(Path(path) / MANIFEST)


def _tidy(directory: Path) -> None:
    """Finish what an interrupted save left: remove ``.tmp`` folders, rename an ``.old`` folder
    back where its step is missing, and remove it where the step is in place."""
    for leftover in sorted(directory.iterdir()):
        if not leftover.is_dir():
            continue
        if leftover.suffix == ".tmp" and _NAME.fullmatch(leftover.stem):
            shutil.rmtree(leftover)
        elif (m := _NAME.fullmatch(leftover.name)) and m.group(2):
            final = leftover.with_suffix("")
            if final.exists():
                shutil.rmtree(leftover)
            else:
                os.replace(leftover, final)


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    state: dict[str, Any],
    *,
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``state`` (nested dicts, lists, tuples, scalars, tensors) as ``directory/step-N``.

    ``write_extra(staging)``, when given, writes more files into the staging folder; they are
    hashed and published with the rest, in the same rename. Returns the checkpoint's path.

    Raises:
        CheckpointError: a tensor of ``state`` holds NaN or infinity (nothing is written).
        TypeError: ``state`` holds a value that is not one of the kinds above.
    """
    final = checkpoint_path(directory, step)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _flatten(state, "state", tensors)
    if bad := _nonfinite(tensors):
        raise CheckpointError(f"not saving {str(final)!r}: non-finite values in {', '.join(bad)}")
    final.parent.mkdir(parents=True, exist_ok=True)
    _tidy(final.parent)
    staging, aside = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")
    staging.mkdir()
    _boundary("staging")
    save_file(tensors, staging / "tensors.safetensors")
    _boundary("tensors")
    (staging / "state.json").write_text(json.dumps(skeleton))
    _boundary("state")
    if write_extra is not None:
        write_extra(staging)
        _boundary("extra")
    _write_manifest(staging)
    _boundary("manifest")
    if final.exists():
        os.replace(final, aside)
        _boundary("aside")
    try:
        os.replace(staging, final)
    except BaseException:
        if aside.exists():
            os.replace(aside, final)
        raise
    _fsync_directory(final.parent)
    _boundary("rename")
    if aside.exists():
        shutil.rmtree(aside)
        _boundary("cleanup")
    return final


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """The checkpoints of ``directory`` as ``(step, path)``, by step, unverified.

    A step's path is ``step-N/``, or ``step-N.old/`` where a re-save of step N was killed between
    its two renames (the previous version, complete). Unfinished ``.tmp`` folders are not listed."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found: dict[int, Path] = {}
    for path in sorted(directory.iterdir()):
        m = _NAME.fullmatch(path.name)
        if m and path.is_dir() and (not m.group(2) or int(m.group(1)) not in found):  # N/ wins over N.old/
            found[int(m.group(1))] = path
    return sorted(found.items())


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The intact checkpoint of the highest step in ``directory`` (see :func:`verify_checkpoint`),
    or None when there is no checkpoint.

    A damaged checkpoint is skipped with a warning naming it and the damage.

    Raises:
        CheckpointError: there are checkpoints, but none is intact (the message names each one's damage).
    """
    damaged = []
    for _, path in reversed(list_checkpoints(directory)):
        try:
            verify_checkpoint(path)
        except CheckpointError as error:
            warnings.warn(f"skipping a damaged checkpoint: {error}", stacklevel=2)
            damaged.append(str(error))
            continue
        return path
    if damaged:
        raise CheckpointError(f"no intact checkpoint in {str(directory)!r}: " + "; ".join(damaged))
    return None


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Check every file of the checkpoint ``path`` against its ``manifest.json`` (size and SHA-256).

    Raises:
        CheckpointError: the manifest or a file it lists is missing, unreadable or differs; the
            message names the file.
    """
    path = Path(path)
    manifest = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist or is not a directory")
    if not manifest.is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no {MANIFEST}: it is incomplete, not a checkpoint, or was "
            "written by a version of mogo_diffusion that did not hash its checkpoints"
        )
    try:
        listing = json.loads(manifest.read_text())
        files = listing["files"] if listing.get("format") == _FORMAT else None
        entries = {name: (int(entry["bytes"]), str(entry["sha256"])) for name, entry in files.items()}
    except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{str(manifest)!r} is corrupt: {error!r}") from error
    for name in ("state.json", "tensors.safetensors"):
        if name not in entries:
            raise CheckpointError(f"{str(manifest)!r} does not list {name}")
    for name, (size, sha256) in entries.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{str(file)!r} is missing (listed in {MANIFEST})")
        if file.stat().st_size != size or _digest(file) != sha256:
            raise CheckpointError(
                f"{str(file)!r} differs from its hash in {MANIFEST}: it was damaged or changed after the save"
            )


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The state saved by :func:`save_checkpoint` in ``path``, verified.

    Raises:
        CheckpointError: the checkpoint fails :func:`verify_checkpoint`, a file cannot be parsed,
            or a tensor holds NaN or infinity; the message names the file (and the tensor).
    """
    path = Path(path)
    verify_checkpoint(path)
    try:
        skeleton = json.loads((path / "state.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{str(path / 'state.json')!r} is corrupt: {error}") from error
    try:
        tensors = load_file(path / "tensors.safetensors")
    except Exception as error:  # safetensors raises its own error types for truncated files
        raise CheckpointError(f"{str(path / 'tensors.safetensors')!r} is corrupt: {error}") from error
    if bad := _nonfinite(tensors):
        raise CheckpointError(
            f"{str(path / 'tensors.safetensors')!r} holds non-finite values in {', '.join(bad)}"
        )
    try:
        return _unflatten(skeleton, tensors)
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{str(path / 'state.json')!r} refers to a missing tensor {error}") from error
