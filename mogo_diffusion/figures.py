"""The figures of a run and of every comparison driver (``compare``, ``study``).

Each figure function returns a :class:`~matplotlib.figure.Figure` whose artists carry their data
and an arm's name as their label (what the tests read); :func:`save` writes one as a PNG and
closes it.

* :func:`front`: every arm's point in normalised gains (:func:`~mogo_diffusion.analysis.judge`),
  one panel per pair of rewards, the weighted-sum front in gray and the pretrained model at 0.
* :func:`intervals`: paired differences with their 95 % intervals, one panel per quantity or
  reward set.
* :func:`curves`: each reward's held-out mean against the images trained on and the CPU minutes
  of training, per arm, averaged over seeds (each seed thin).
* :func:`alphas`: the weights of each harmonized arm over its epochs.
* :func:`run_curves`: one run's training and held-out rewards, weights and conflict rate;
  :func:`plot_run` writes it from a run directory's ``metrics.jsonl`` (``curves.png``).
* :func:`save_comparison`: the pretrained and trained model's images of the same prompts side by
  side (``samples.png``), of the rows :func:`first_rows` picks; :func:`save_grid`: images as one
  PNG grid.
"""

from __future__ import annotations

import io
import itertools
import math
import os
import statistics
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from matplotlib.figure import Figure  # the class only: no backend is chosen by importing it
from torch import Tensor

from mogo_diffusion.rewards import to_uint8
from mogo_diffusion.run_dir import read_metrics

if TYPE_CHECKING:
    from types import ModuleType

__all__ = [
    "CURVE_AXES",
    "RUN_PANELS",
    "alphas",
    "curves",
    "first_rows",
    "front",
    "intervals",
    "learning_curve",
    "plot_run",
    "run_curves",
    "save",
    "save_comparison",
    "save_grid",
]

CURVE_AXES = (("images", "images trained on"), ("minutes", "CPU minutes of training (one thread)"))
"""The rows of :func:`curves`: each a key of :func:`learning_curve`'s points and its axis label."""


def _pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the file-only backend (comparisons run where there is no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(figure: Figure, path: Path, dpi: int = 100) -> Path:
    """Write ``figure`` to ``path`` as a PNG of 256 colours (``dpi`` dots per inch: a third of the
    bytes of matplotlib's true-colour PNG, for figures that are committed) and close it."""
    from PIL import Image

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    _pyplot().close(figure)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(256).save(path, format="png", optimize=True)
    return path


def front(judged: Mapping[str, Any]) -> Figure:
    """Each arm's point (its normalised gains, averaged over seeds) in one panel per pair of
    rewards (one panel of the single reward's gain per arm for K = 1): the arms of the weighted-sum
    front as gray squares, the others in colour, the pretrained model as a cross at 0. Each
    arm's marker is a collection labelled with its name."""
    plt = _pyplot()
    names, arms = judged["rewards"], judged["arms"]
    on_front = set(judged["front"])
    colours = itertools.cycle(plt.cm.tab10.colors)
    styles = {arm: ("tab:gray", "s") if arm in on_front else (next(colours), "o") for arm in arms}
    points = {arm: [row[f"gain/{n}"]["mean"] for n in names] for arm, row in arms.items()}
    pairs = list(itertools.combinations(range(len(names)), 2)) or [(0, None)]
    columns = min(len(pairs), 3)
    rows = math.ceil(len(pairs) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(3.6 * columns, 3.2 * rows), squeeze=False)
    for axis, (i, j) in zip(axes.flat, pairs, strict=False):
        for index, (arm, point) in enumerate(points.items()):
            colour, marker = styles[arm]
            x, y = point[i], index if j is None else point[j]
            axis.scatter([x], [y], color=colour, marker=marker, label=arm, zorder=3)
            axis.annotate(arm, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        axis.scatter([0.0], [0.0] if j is not None else [-1], color="black", marker="x", label="pretrained")
        axis.set_xlabel(f"{names[i]} gain", fontsize=8)
        axis.set_ylabel("arm" if j is None else f"{names[j]} gain", fontsize=8)
    for axis in axes.flat[len(pairs) :]:
        axis.set_visible(False)
    figure.suptitle(
        "Held-out gains over the pretrained model (1 = the reward's specialist), mean over seeds; "
        "gray: the weighted-sum front",
        fontsize=9,
    )
    figure.tight_layout(rect=(0, 0, 1, 1 - 0.4 / figure.get_figheight()))  # room for the title
    return figure


def intervals(panels: Mapping[str, Mapping[str, Sequence[float]]], xlabel: str) -> Figure:
    """One panel per title of ``panels``, each arm's ``[mean, low, high]`` as a point with its
    interval (an errorbar container labelled with the panel's title), 0 marked."""
    plt = _pyplot()
    figure, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for axis, (title, rows) in zip(axes[0], panels.items(), strict=True):
        arms = list(rows)
        means = [rows[arm][0] for arm in arms]
        below = [rows[arm][0] - rows[arm][1] for arm in arms]
        above = [rows[arm][2] - rows[arm][0] for arm in arms]
        axis.errorbar(
            means, range(len(arms)), xerr=[below, above], fmt="o", color="tab:red", ecolor="gray", capsize=3,
            label=title,
        )  # fmt: skip
        axis.axvline(0, color="black", linewidth=0.5)
        axis.set_yticks(range(len(arms)), arms, fontsize=7)
        axis.set_xlabel(xlabel)
        axis.set_title(title, fontsize=9)
    figure.tight_layout()
    return figure


def learning_curve(history: Sequence[Mapping[str, Any]], key: str, start: float) -> list[dict[str, float]]:
    """A run's evaluations of ``key`` from its metrics records ``history``: the images trained on
    until then (each epoch's ``images_per_second * seconds``), the CPU minutes of training (the
    epochs' ``seconds`` of one thread, evaluations excluded) and the value, after the pretrained
    model's value ``start`` at 0; empty if the run logged none."""
    points, seconds, images = [{"images": 0.0, "minutes": 0.0, "value": start}], 0.0, 0.0
    for record in history:
        seconds += record.get("seconds", 0.0)
        images += record.get("images_per_second", 0.0) * record.get("seconds", 0.0)
        if key in record:
            points.append({"images": float(round(images)), "minutes": seconds / 60, "value": record[key]})
    return points if len(points) > 1 else []


def curves(
    names: Sequence[str],
    base: Mapping[str, float],
    lines: Mapping[str, Mapping[str, Sequence[Sequence[Mapping[str, Any]]]]],
    title: str,
) -> Figure:
    """One column per reward of ``names``: its held-out mean at every evaluation of each line of
    ``lines`` (label to reward to the metrics records of its seeds), averaged over seeds (labelled
    with the line's label) and for each seed (thin, labelled ``_<label> seed <i>``, out of the
    legend), with the pretrained model's value ``base["eval/<reward>"]`` dashed; against the images
    trained on in the top row, the CPU minutes in the bottom row (:data:`CURVE_AXES`)."""
    plt = _pyplot()
    figure, axes = plt.subplots(2, len(names), figsize=(3.1 * len(names), 5.6), squeeze=False)
    colours = dict(zip(lines, itertools.cycle(plt.cm.tab10.colors), strict=False))
    for column, name in enumerate(names):
        key = f"eval/{name}"
        for label, histories in lines.items():
            found = [c for c in (learning_curve(h, key, base[key]) for h in histories.get(name, ())) if c]
            if not found:
                continue
            length = min(len(c) for c in found)
            for row, (x, _) in enumerate(CURVE_AXES):
                axis = axes[row][column]
                for seed, curve in enumerate(found):
                    axis.plot([p[x] for p in curve], [p["value"] for p in curve], color=colours[label],
                              alpha=0.25, linewidth=0.8, label=f"_{label} seed {seed}")  # fmt: skip
                xs = [statistics.fmean(c[i][x] for c in found) for i in range(length)]
                ys = [statistics.fmean(c[i]["value"] for c in found) for i in range(length)]
                axis.plot(xs, ys, color=colours[label], marker="o", markersize=3, label=label)
        for axis, (_, xlabel) in zip(axes[:, column], CURVE_AXES, strict=True):
            axis.axhline(base[key], color="black", linestyle="--", linewidth=0.8, label="pretrained")
            axis.set_xlabel(xlabel, fontsize=8)
        axes[0][column].set_title(name, fontsize=9)
    for row in axes:
        row[0].set_ylabel("held-out mean", fontsize=8)
    axes[0][-1].legend(fontsize=7)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    return figure


def alphas(histories: Mapping[str, Sequence[Mapping[str, Any]]], names: Sequence[str]) -> Figure | None:
    """One panel per arm of ``histories`` (arm to one run's metrics records) that logged weights
    (``alpha/<reward>``): each reward's weight over the epochs (a line labelled with the reward);
    None when no arm did."""
    plt = _pyplot()
    weighted = {arm: h for arm, h in histories.items() if any(f"alpha/{names[0]}" in r for r in h)}
    if not weighted:
        return None
    figure, axes = plt.subplots(1, len(weighted), figsize=(4.6 * len(weighted), 3.4), squeeze=False)
    for axis, (arm, history) in zip(axes[0], weighted.items(), strict=True):
        for name in names:
            logged = [r for r in history if f"alpha/{name}" in r]
            axis.plot([r["epoch"] for r in logged], [r[f"alpha/{name}"] for r in logged], label=name)
        axis.set_title(f"alpha, {arm}", fontsize=9)
        axis.set_xlabel("epoch")
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    return figure


RUN_PANELS = (
    ("reward/", "training reward (mean of the epoch's samples)"),
    ("eval/", "held-out reward"),
    ("alpha/", "alpha (MARBLE weights)"),
    ("conflict_rate", "conflict rate of the weighted sum"),
)
"""The panels of :func:`run_curves`: the metrics each draws (a name or a prefix) and its title."""

_EPOCHS_TRAINED = {"reward/": 0, "eval/": 1}
"""The epochs trained before what a record of epoch ``e`` measures, less ``e``: its training
rewards score the samples of the model after ``e`` epochs, its evaluation the model after
``e + 1`` (the pretrained model's evaluation is the record of epoch -1)."""


def run_curves(records: Sequence[Mapping[str, Any]]) -> Figure:
    """One run's metrics ``records`` (one per epoch), one panel per kind of :data:`RUN_PANELS` that
    the run logged, side by side: each metric of the kind against the epochs, a line labelled
    with its name (the prefix removed). The rewards are drawn against the epochs trained before
    the model they score, so the held-out curve starts at the pretrained model, at 0."""
    plt = _pyplot()
    present = [
        (key, title) for key, title in RUN_PANELS if any(k.startswith(key) for r in records for k in r)
    ]
    figure, axes = plt.subplots(1, len(present), figsize=(4.2 * len(present), 3.4), squeeze=False)
    for axis, (key, title) in zip(axes[0], present, strict=True):
        offset = _EPOCHS_TRAINED.get(key)
        series = sorted({k for r in records for k in r if k.startswith(key)})
        for name in series:
            points = [(r["epoch"] + (offset or 0), r[name]) for r in records if r.get(name) is not None]
            if points:
                axis.plot(*zip(*points, strict=True), label=name.removeprefix(key) or name, marker=".")
        axis.set_title(title, fontsize=9)
        axis.set_xlabel("epoch" if offset is None else "epochs trained")
        if len(series) > 1:
            axis.legend(fontsize=7)
    figure.tight_layout()
    return figure


def plot_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Plot a run's per-reward curves, alpha and conflict rate (:func:`run_curves` of its
    metrics, the pretrained model's evaluation included); returns the PNG (default
    ``run_dir/curves.png``)."""
    path = Path(out) if out is not None else Path(run_dir) / "curves.png"
    return save(run_curves(read_metrics(run_dir, pretrained=True)), path, dpi=110)


def first_rows(prompts: Sequence[str], count: int) -> list[int]:
    """The first row of each of the first ``count`` distinct prompts of ``prompts``, in order.

    >>> first_rows(["a", "a", "b", "c", "b"], 2)
    [0, 2]
    """
    first = {p: i for i, p in reversed(list(enumerate(prompts)))}
    return sorted(first.values())[:count]


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
    plt = _pyplot()
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


def save_grid(images: Tensor, path: str | os.PathLike[str], columns: int = 8, scale: int = 2) -> Path:
    """Save ``[N, 3, H, W]`` images in ``[0, 1]`` as one PNG grid, each pixel ``scale`` x ``scale``."""
    from PIL import Image

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
