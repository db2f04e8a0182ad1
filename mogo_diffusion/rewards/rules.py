"""Rule-based rewards, computed from the pixels and the prompt: nothing to download.

All take ``[B, 3, H, W]`` images in ``[0, 1]`` and return ``[B]`` float32 scores.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from mogo_diffusion.rewards.base import check_batch, to_uint8
from mogo_diffusion.rewards.registry import register_reward

__all__ = ["PALETTE", "ColorMatch", "JpegCompressibility", "Sharpness"]

PALETTE: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
    "cyan": (0.0, 1.0, 1.0),
    "magenta": (1.0, 0.0, 1.0),
    "orange": (1.0, 0.5, 0.0),
    "purple": (0.5, 0.0, 0.5),
    "white": (1.0, 1.0, 1.0),
    "black": (0.0, 0.0, 0.0),
    "gray": (0.5, 0.5, 0.5),
    "grey": (0.5, 0.5, 0.5),
}

_LUMA = (0.299, 0.587, 0.114)  # ITU-R BT.601


@register_reward("jpeg_compressibility")
class JpegCompressibility:
    """Minus the JPEG file size in kB (1 kB = 1000 bytes), as in DDPO (Flow-GRPO divides by 500).

    Each image is rounded to 8 bits and encoded by PIL at ``quality`` (1 to 100, default 95). A
    flat image scores near 0; noise scores much lower.
    """

    name = "jpeg_compressibility"

    def __init__(self, quality: int = 95) -> None:
        if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
            raise ValueError(f"quality must be an integer in [1, 100], got {quality!r}")
        self.quality = quality

    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> Tensor:
        check_batch(images, prompts, metadata)
        sizes = []
        for pixels in to_uint8(images):
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="JPEG", quality=self.quality)
            sizes.append(buffer.tell())
        return -torch.tensor(sizes, dtype=torch.float32) / 1000


@register_reward("sharpness")
class Sharpness:
    """Edge energy of the luminance ``Y = 0.299 R + 0.587 G + 0.114 B``, in ``[0, 2]``::

        mean (Y[y, x+1] - Y[y, x])^2 + mean (Y[y+1, x] - Y[y, x])^2

    0 for a flat image, 2 for a black-and-white checkerboard. Needs ``H, W >= 2``.
    """

    name = "sharpness"

    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> Tensor:
        check_batch(images, prompts, metadata)
        if min(images.shape[2:]) < 2:
            raise ValueError(
                f"sharpness needs images of at least 2 x 2 pixels, got {tuple(images.shape[2:])}"
            )
        luma = torch.tensor(_LUMA, dtype=torch.float64, device=images.device)
        Y = torch.einsum("bchw,c->bhw", images.detach().to(torch.float64), luma)
        dx = (Y[:, :, 1:] - Y[:, :, :-1]).square().mean(dim=(1, 2))
        dy = (Y[:, 1:, :] - Y[:, :-1, :]).square().mean(dim=(1, 2))
        return (dx + dy).to(torch.float32)


@register_reward("color_match")
class ColorMatch:
    """How close the image is to the colour its sample asks for, in ``[0, 1]``::

        1 - mean over pixels ||p - c||_2 / sqrt(3)

    The target ``c`` is ``metadata["color"]`` (a palette name or an RGB triple in ``[0, 1]``) if
    present, else the first palette word in the prompt (whole words, any case). The score is NaN
    (not applicable) for a sample that names no colour.

    Args:
        palette: colour names to RGB triples in ``[0, 1]``;
            :data:`~mogo_diffusion.rewards.PALETTE` by default.
    """

    name = "color_match"

    def __init__(self, palette: Mapping[str, Sequence[float]] | None = None) -> None:
        palette = PALETTE if palette is None else palette
        self.palette = {str(k).lower(): self._rgb(v, f"palette[{k!r}]") for k, v in palette.items()}
        if not self.palette:
            raise ValueError("palette must name at least one colour")
        words = sorted(self.palette, key=len, reverse=True)
        self._pattern = re.compile(r"\b(" + "|".join(map(re.escape, words)) + r")\b", re.IGNORECASE)

    @staticmethod
    def _rgb(value: Any, what: str) -> tuple[float, float, float]:
        if isinstance(value, str) or not isinstance(value, Sequence) or len(value) != 3:
            raise ValueError(f"{what} must be an RGB triple in [0, 1], got {value!r}")
        r, g, b = (float(x) for x in value)
        if not all(0.0 <= x <= 1.0 for x in (r, g, b)):
            raise ValueError(f"{what} must be an RGB triple in [0, 1], got {value!r}")
        return r, g, b

    def target(self, prompt: str, metadata: Mapping[str, Any]) -> tuple[float, float, float] | None:
        """The RGB target of one sample, or None when it names no colour."""
        if "color" in metadata:
            color = metadata["color"]
            if isinstance(color, str):
                if color.lower() not in self.palette:
                    raise ValueError(f"metadata color {color!r} is not in the palette {sorted(self.palette)}")
                return self.palette[color.lower()]
            return self._rgb(color, "metadata['color']")
        found = self._pattern.search(prompt)
        return None if found is None else self.palette[found.group(1).lower()]

    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> Tensor:
        check_batch(images, prompts, metadata)
        targets = [self.target(p, m) for p, m in zip(prompts, metadata, strict=True)]
        applies = torch.tensor([c is not None for c in targets], dtype=torch.bool, device=images.device)
        rgb = torch.tensor([c or (0.0, 0.0, 0.0) for c in targets], dtype=torch.float64, device=images.device)
        rgb = rgb.reshape(-1, 3)  # [B, 3], also for B = 0
        distance = (images.detach().to(torch.float64) - rgb[:, :, None, None]).norm(dim=1)
        score = 1 - distance.mean(dim=(1, 2)) / math.sqrt(3)
        return torch.where(applies, score, float("nan")).to(torch.float32)
