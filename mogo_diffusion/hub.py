"""Where weights come from: a local path or a model hub id, read online or from the cache alone.

Every loader of mogo_diffusion (the SD3 pipeline and its components, the reward models,
GenEval's detector) and the config name weights the same way (:func:`resolve`): an existing path
is local; else a string ``org/name`` (:data:`HUB_ID`, matched in full) is a hub id; anything else
is a path that does not exist. A hub id is read from the hub, or from the local cache alone when
offline (:func:`offline`: ``local_files_only``, or ``HF_HUB_OFFLINE`` where that is None).
:func:`loading` turns a loader's ``OSError`` into one that names what failed and, for a hub id,
the ``hf download`` command that fetches it (:func:`download_command`). :func:`hub_file` fetches
one file of a hub repository, :func:`checkpoint_file` finds a checkpoint file wherever it is
named, and :func:`read_state_dict` reads one without running its code.

Importing this module imports neither torch nor ``huggingface_hub`` (the config uses it).

>>> resolve("openai/clip-vit-large-patch14", "CLIP model")
Source(location='openai/clip-vit-large-patch14', is_local=False)
>>> download_command("xswu/HPSv2", "HPS_v2.1_compressed.pt", local_dir="hps")
'hf download xswu/HPSv2 HPS_v2.1_compressed.pt --local-dir hps'
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "CONFIG_FILES",
    "HUB_ID",
    "Source",
    "checkpoint_file",
    "download_command",
    "download_hint",
    "hub_file",
    "is_hub_id",
    "loading",
    "offline",
    "read_state_dict",
    "resolve",
]

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""A model hub id, ``org/name`` (matched in full); the config and every loader accept the same."""

CONFIG_FILES = ("*.json", "*.txt")
"""The ``--include`` patterns of a repository's configs, tokenizer and processor without its weights."""


def is_hub_id(reference: object) -> bool:
    """Whether ``reference`` is a string ``org/name`` (:data:`HUB_ID` in full); a path object never is.

    >>> is_hub_id("org/name.v2"), is_hub_id("sd3-medium"), is_hub_id("a/b/c")
    (True, False, False)
    """
    return isinstance(reference, str) and HUB_ID.fullmatch(reference) is not None


class Source(NamedTuple):
    """Where :func:`resolve` found weights: ``location`` (a local path, or the hub id) and which it is."""

    location: str
    is_local: bool


def resolve(
    reference: str | os.PathLike[str],
    what: str,
    *,
    directory: bool = False,
    revision: str | None = None,
    hint: str = "",
) -> Source:
    """The :class:`Source` that ``reference`` names: an existing path (``~`` and ``~user``
    expanded), else a hub id.

    Args:
        reference: a path, or a hub id ``org/name``.
        what: what is loaded, as the errors name it (``"PickScore model"``).
        directory: the local source must be a directory (a saved model), not a file.
        revision: a hub revision, which a local source cannot have.
        hint: how to get the weights, appended to the error for a missing path.

    Raises:
        FileNotFoundError: ``reference`` is neither an existing path nor a hub id.
        NotADirectoryError: ``directory`` and ``reference`` is a file.
        ValueError: a ``revision`` for a local source.
    """
    path = Path(os.path.expanduser(reference))  # Path.expanduser raises on "~user" of no user
    kind = f"{what} directory" if directory else what
    if path.exists():
        if directory and not path.is_dir():
            raise NotADirectoryError(f"{what} path {str(path)!r} is a file; expected a directory")
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to hub ids; {kind} {str(path)!r} is local")
        return Source(str(path), True)
    if not is_hub_id(reference):
        how = f"; {hint}" if hint else ""
        raise FileNotFoundError(f"{kind} {str(path)!r} does not exist (nor is it a hub id 'org/name'){how}")
    return Source(str(reference), False)


def offline(local_files_only: bool | None) -> bool:
    """Whether to read the local cache alone: ``local_files_only``, or ``HF_HUB_OFFLINE`` when it is None."""
    if local_files_only is not None:
        return bool(local_files_only)
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def download_command(
    repo: str,
    *files: str,
    include: Sequence[str] = (),
    revision: str | None = None,
    local_dir: str | os.PathLike[str] | None = None,
) -> str:
    """The ``hf download`` command that fetches ``files`` (all when none) of hub repository ``repo``,
    or those matching the ``include`` patterns, at ``revision``, into ``local_dir``.

    >>> download_command("org/clip", include=CONFIG_FILES, revision="v1")
    'hf download org/clip --include "*.json" "*.txt" --revision v1'
    """
    words = ["hf download", repo, *files]
    words += ["--include", *(f'"{pattern}"' for pattern in include)] if include else []
    words += ["--revision", revision] if revision else []
    words += ["--local-dir", str(local_dir)] if local_dir is not None else []
    return " ".join(words)


def download_hint(repo: str, *files: str, include: Sequence[str] = ()) -> str:
    """``download it with `hf download ... --local-dir DIR` and pass DIR`` (:func:`download_command`)."""
    command = download_command(repo, *files, include=include, local_dir="DIR")
    return f"download it with `{command}` and pass DIR"


@contextmanager
def loading(
    what: str, source: Source, only_local: bool, *files: str, include: Sequence[str] = ()
) -> Iterator[None]:
    """Re-raise an ``OSError`` of the block as one that names ``what`` and ``source``; for a hub id
    also where it was looked for (the hub, or the local cache when ``only_local``) and the command
    that downloads ``files`` or the ``include`` patterns (:func:`download_hint`)."""
    try:
        yield
    except OSError as err:
        if source.is_local:
            raise OSError(f"could not load {what} from {source.location!r}: {err}") from err
        where = "the hub"
        if only_local:
            where = "the local hub cache (offline: HF_HUB_OFFLINE or local_files_only)"
        hint = download_hint(source.location, *files, include=include)
        raise OSError(f"could not load {what} {source.location!r} from {where}; {hint}. ({err})") from err


def hub_file(repo: str, filename: str, what: str, only_local: bool) -> Path:
    """The local path of file ``filename`` of hub repository ``repo``, downloaded unless ``only_local``.

    Raises:
        OSError: the file cannot be had (:func:`loading`'s message, naming ``what``).
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    with loading(f"{what} {filename} of", Source(repo, False), only_local, filename):
        try:
            return Path(hf_hub_download(repo, filename, local_files_only=only_local))
        except EntryNotFoundError as err:  # not an OSError in huggingface_hub >= 1
            raise OSError(str(err)) from err


def checkpoint_file(
    reference: str | os.PathLike[str], filename: str, what: str, *, repo: str, only_local: bool
) -> Path:
    """The checkpoint ``reference`` names: that file, ``filename`` in that directory, or
    ``filename`` of that hub repository (:func:`hub_file`); ``repo`` is where to download it from.

    Raises:
        FileNotFoundError: no such path (nor a hub id), or a directory without ``filename``; the
            message says how to download it.
        OSError: as :func:`hub_file`.
    """
    hint = download_hint(repo, filename)
    source = resolve(reference, what, hint=hint)
    if not source.is_local:
        return hub_file(source.location, filename, what, only_local)
    path = Path(source.location)
    path = path / filename if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"{what} {str(path)!r} not found; {hint}")
    return path


def read_state_dict(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """The state dict in a safetensors file, or in a pickle read with ``torch.load(weights_only=True)``
    (which runs no code of the file's), on the CPU.

    Raises:
        ValueError: the file cannot be read, or holds something else than a dict; the message
            names the file.
    """
    import pickle

    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            return load_file(path)
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, SafetensorError) as err:
        raise ValueError(f"could not read the state dict {str(path)!r}: {err}") from err
    if not isinstance(state, dict):
        raise ValueError(f"{str(path)!r} holds a {type(state).__name__}, not a state dict")
    return state
