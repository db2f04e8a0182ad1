"""Multi-reward evaluation: held-out scores, the composite z-score, run plots and sample grids.

* :func:`reward_zscores`: each reward standardised over the compared runs,
  ``z_rk = (m_rk - mean_r' m_r'k) / std_r' m_r'k``; :func:`composite_zscores` averages them over
  the rewards, so rewards on different scales count alike.
* :func:`plot_run`: the curves of a run directory's ``metrics.jsonl`` (per-reward means, held-out
  means, alpha, conflict rate) in one PNG.
* :func:`save_grid`: ``[N, 3, H, W]`` images in ``[0, 1]`` as one PNG, ``columns`` per row;
  :func:`save_comparison`: the pretrained and trained images of the same prompts side by side.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from PIL import Image
from torch import Tensor

from mogo_diffusion.rewards import to_uint8

__all__ = ["composite_zscores", "plot_run", "read_metrics", "reward_zscores", "save_comparison", "save_grid"]


def _standardized(
    means: Mapping[str, Sequence[float]], reference: Mapping[str, Sequence[float]] | None
) -> tuple[np.ndarray, np.ndarray]:
    """``[R, K]`` z-scores of ``means`` by the mean and std over the runs of ``reference`` (0 for a
    reward on which they all agree), and the ``[K]`` mask of the rewards where they do not."""
    basis = np.asarray(list((means if reference is None else reference).values()), dtype=np.float64)
    if basis.ndim != 2 or len(basis) < 2:
        raise ValueError(f"need the K means of at least two runs, got an array of shape {basis.shape}")
    table = np.asarray(list(means.values()), dtype=np.float64).reshape(-1, basis.shape[1])
    spread = basis.std(axis=0)
    informative = spread > 1e-12
    z = np.zeros_like(table)
    z[:, informative] = (table[:, informative] - basis[:, informative].mean(axis=0)) / spread[informative]
    return z, informative


def reward_zscores(
    means: Mapping[str, Sequence[float]], reference: Mapping[str, Sequence[float]] | None = None
) -> dict[str, list[float]]:
    """Each run's per-reward means z-scored across the runs of ``reference`` (default: ``means``).

    Args:
        means: run name to its K per-reward means (the same K rewards, in the same order).
        reference: the runs whose mean and std standardise each reward (at least two).

    Returns:
        Run name to its K z-scores; 0 for a reward on which every reference run scores the same.
    """
    z, _ = _standardized(means, reference)
    return {name: row.tolist() for name, row in zip(means, z, strict=True)}


def composite_zscores(
    means: Mapping[str, Sequence[float]], reference: Mapping[str, Sequence[float]] | None = None
) -> dict[str, float]:
    """The composite score of each run: its :func:`reward_zscores`, averaged over the rewards.

    Args:
        means, reference: as in :func:`reward_zscores`.

    Returns:
        Run name to composite. A reward on which every reference run scores the same carries no
        information and is left out (its std is 0); with none left, every composite is 0.
    """
    z, informative = _standardized(means, reference)
    composite = z[:, informative].mean(axis=1) if informative.any() else np.zeros(len(z))
    return {name: float(value) for name, value in zip(means, composite, strict=True)}


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


def save_comparison(
    base: Tensor, trained: Tensor, prompts: Sequence[str], path: str | os.PathLike[str], columns: int = 4
) -> Path:
    """Save the pretrained and the trained model's images of the same prompts and noise side by
    side, each pair under its prompt, as one PNG. ``base`` and ``trained``: ``[N, 3, H, W]`` in
    ``[0, 1]``, one image per prompt."""
    if base.shape != trained.shape or base.ndim != 4 or len(base) != len(prompts) or not len(prompts):
        raise ValueError(
            f"base {tuple(base.shape)} and trained {tuple(trained.shape)} must be [N, 3, H, W] for the "
            f"{len(prompts)} prompts"
        )
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = math.ceil(len(prompts) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(2.3 * columns, 1.75 * rows), squeeze=False)
    for axis in axes.flat:
        axis.axis("off")
    for axis, before, after, prompt in zip(
        axes.flat, to_uint8(base), to_uint8(trained), prompts, strict=False
    ):
        gap = np.full((before.shape[0], 2, 3), 255, dtype=np.uint8)
        axis.imshow(np.concatenate([before, gap, after], axis=1), interpolation="nearest")
        axis.set_title("\n".join(textwrap.wrap(prompt, 34)[:3]), fontsize=5.5)
    figure.suptitle("pretrained (left) and trained (right), same prompt and noise", fontsize=8)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=150)
    plt.close(figure)
    return path
