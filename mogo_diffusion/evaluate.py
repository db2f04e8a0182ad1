"""Multi-reward evaluation: held-out scores, the composite z-score, run plots and sample grids.

* :func:`composite_zscores`: each reward standardised over the compared runs, then averaged, so
  rewards on different scales count alike: ``c_r = mean_k (m_rk - mean_r' m_r'k) / std_r' m_r'k``.
* :func:`plot_run`: the curves of a run directory's ``metrics.jsonl`` (per-reward means, held-out
  means, alpha, conflict rate) in one PNG.
* :func:`save_grid`: ``[N, 3, H, W]`` images in ``[0, 1]`` as one PNG, ``columns`` per row.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from mogo_diffusion.rewards import to_uint8

__all__ = ["composite_zscores", "nan_mean", "plot_run", "read_metrics", "save_grid"]


def nan_mean(values: Tensor) -> Tensor:
    """Column means of ``[N, K]`` scores over the applicable (non-NaN) rows; NaN for an empty column."""
    applicable = ~torch.isnan(values)
    total = torch.where(applicable, values, 0.0).sum(0)
    count = applicable.sum(0)
    return torch.where(count > 0, total / count.clamp(min=1), math.nan)


def composite_zscores(means: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """The composite score of each run: its per-reward means z-scored across runs, then averaged.

    Args:
        means: run name to its K per-reward means (the same K rewards, in the same order).

    Returns:
        Run name to composite. A reward on which every run scores the same carries no information
        and is left out (its std is 0).
    """
    names = list(means)
    table = np.asarray([means[name] for name in names], dtype=np.float64)
    if table.ndim != 2 or len(names) < 2:
        raise ValueError(f"need the K means of at least two runs, got an array of shape {table.shape}")
    spread = table.std(axis=0)
    informative = spread > 1e-12
    z = (table[:, informative] - table[:, informative].mean(axis=0)) / spread[informative]
    composite = z.mean(axis=1) if informative.any() else np.zeros(len(names))
    return {name: float(value) for name, value in zip(names, composite, strict=True)}


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict]:
    """The records of ``run_dir/metrics.jsonl``, one per logged epoch."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {str(path)!r}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Plot a run's per-reward curves, alpha and conflict rate; returns the PNG (default
    ``run_dir/curves.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    panels = [("reward/", "training reward (mean of the epoch's samples)"), ("eval/", "held-out reward")]
    panels += [("alpha/", "alpha (MARBLE weights)"), ("conflict_rate", "conflict rate of the weighted sum")]
    present = [(key, title) for key, title in panels if any(k.startswith(key) for r in records for k in r)]
    figure, axes = plt.subplots(1, len(present), figsize=(4.2 * len(present), 3.4), squeeze=False)
    for axis, (key, title) in zip(axes[0], present, strict=True):
        series = sorted({k for r in records for k in r if k.startswith(key)})
        for name in series:
            points = [(r["epoch"], r[name]) for r in records if name in r and r[name] is not None]
            if points:
                axis.plot(*zip(*points, strict=True), label=name.removeprefix(key) or name, marker=".")
        axis.set_title(title, fontsize=9)
        axis.set_xlabel("epoch")
        if len(series) > 1:
            axis.legend(fontsize=7)
    figure.tight_layout()
    path = Path(out) if out is not None else Path(run_dir) / "curves.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def save_grid(images: Tensor, path: str | os.PathLike[str], columns: int = 8, scale: int = 2) -> Path:
    """Save ``[N, 3, H, W]`` images in ``[0, 1]`` as one PNG grid, each pixel ``scale`` x ``scale``."""
    if images.ndim != 4 or images.shape[1] != 3 or not len(images):
        raise ValueError(f"images must be a non-empty [N, 3, H, W] tensor, got {tuple(images.shape)}")
    pixels = to_uint8(images.clamp(0, 1))
    n, h, w, _ = pixels.shape
    rows = math.ceil(n / columns)
    grid = np.full((rows * (h + 1) + 1, columns * (w + 1) + 1, 3), 255, dtype=np.uint8)
    for i, image in enumerate(pixels):
        r, c = divmod(i, columns)
        grid[1 + r * (h + 1) : 1 + r * (h + 1) + h, 1 + c * (w + 1) : 1 + c * (w + 1) + w] = image
    picture = Image.fromarray(grid)
    picture = picture.resize((picture.width * scale, picture.height * scale), Image.NEAREST)
    path = Path(path)
    picture.save(path)
    return path
