"""The reward protocol: a batch of images and prompts in, one score per image out.

A reward is any callable with a ``name``::

    reward(images, prompts, metadata) -> scores

* ``images``: ``[B, 3, H, W]`` floating tensor with values in ``[0, 1]``, on any device; B may be
  0 (every reward then returns an empty ``[0]`` tensor), H and W may not (a zero-size image has
  nothing to score: :func:`check_batch` refuses it);
* ``prompts``: B strings; ``metadata``: B dicts (e.g. the OCR target, GenEval's objects);
* ``scores``: ``[B]`` floating tensor on any device; NaN where the reward does not apply to a
  sample (e.g. OCR on a prompt without quoted text); never infinite.

Rewards that hold models also provide ``to(device)``, returning themselves;
:class:`~mogo_diffusion.rewards.MultiReward` forwards ``to`` to the rewards that have one. Their
options ``dtype`` and ``batch_size`` are read by :func:`floating_dtype` and :func:`check_batch_size`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

__all__ = ["Reward", "check_batch", "check_batch_size", "check_scores", "floating_dtype", "to_uint8"]


@runtime_checkable
class Reward(Protocol):
    """``(images [B, 3, H, W] in [0, 1], prompts, metadata) -> [B]`` scores, NaN = not applicable."""

    name: str

    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> Tensor: ...


def check_batch(
    images: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]] | None = None
) -> None:
    """Raise ``ValueError`` unless the arguments form a valid reward batch (see the module);
    ``metadata=None`` for a reward that reads none."""
    if not isinstance(images, Tensor) or images.ndim != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
        raise ValueError(f"images must be a [B, 3, H, W] tensor, got {shape}")
    if 0 in images.shape[2:]:
        raise ValueError(f"images must have at least 1 x 1 pixels, got {tuple(images.shape)}")
    if not images.is_floating_point():
        raise ValueError(f"images must be floating with values in [0, 1], got {images.dtype}")
    if images.numel() and not bool(((images >= 0) & (images <= 1)).all()):
        raise ValueError(
            f"images must have values in [0, 1], got [{images.min().item()}, {images.max().item()}]"
        )
    if isinstance(prompts, str) or len(prompts) != images.shape[0]:
        got = "a str" if isinstance(prompts, str) else f"{len(prompts)} prompts"
        raise ValueError(f"prompts must be a list of {images.shape[0]} strings, got {got}")
    if metadata is not None and len(metadata) != images.shape[0]:
        raise ValueError(f"metadata must have {images.shape[0]} entries, got {len(metadata)}")


def check_scores(name: str, scores: Tensor, batch: int) -> Tensor:
    """Return ``scores`` if reward ``name`` gave a valid ``[batch]`` result, else raise ``ValueError``."""
    if not isinstance(scores, Tensor) or scores.shape != (batch,) or not scores.is_floating_point():
        shape = (
            f"{scores.dtype} {tuple(scores.shape)}" if isinstance(scores, Tensor) else type(scores).__name__
        )
        raise ValueError(f"reward {name!r} must return a floating [{batch}] tensor, got {shape}")
    if bool(torch.isinf(scores).any()):
        raise ValueError(f"reward {name!r} returned infinite scores: {scores.tolist()}")
    return scores


def to_uint8(images: Tensor) -> np.ndarray:
    """``[B, 3, H, W]`` in ``[0, 1]`` to a ``[B, H, W, 3]`` uint8 array (rounded, as DDPO does)."""
    pixels = (images.detach() * 255).round().clamp(0, 255).to(torch.uint8)
    return pixels.permute(0, 2, 3, 1).cpu().numpy()


def floating_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """A model's floating dtype from a dtype, its name (``"bfloat16"``, as YAML gives it) or None
    (float32).

    >>> floating_dtype("bfloat16"), floating_dtype(None)
    (torch.bfloat16, torch.float32)

    Raises:
        ValueError: not a floating dtype, nor the name of one.
    """
    if dtype is None:
        return torch.float32
    value = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype must be a floating torch dtype or its name, got {dtype!r}")
    return value


def check_batch_size(batch_size: int) -> int:
    """``batch_size`` (images, or prompts, per forward pass) if it is a positive integer; else
    ``ValueError``."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    return batch_size
