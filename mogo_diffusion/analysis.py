"""Judging the arms of a comparison, paired by seed, against the front the weighted sum traces.

Every arm of a comparison is run with the same seeds, and seed ``s`` of every arm starts from the
same adapter and sees the same prompts, so an arm is judged by its differences to a *reference*
arm taken seed by seed, each with its paired 95 % bootstrap interval
(:func:`~mogo_diffusion.bootstrap.paired_interval`). An arm's *point* at seed ``s`` is its K
held-out means; the pretrained model's point ``R_base`` has no seeds.

* :func:`summarize`: per arm and reward the means, the composite (each run's mean z-score over the
  rewards, standardised by the arms' seed-averaged means, the pretrained model's included), and
  their paired differences to the reference arm and to the pretrained model.
* :func:`normalised_gains`: ``(R - R_base) / (R_specialist - R_base)``, 0 at the pretrained model
  and 1 at the specialist of that reward (the arm ``single:<reward>``, averaged over its seeds);
  the raw gain ``R - R_base`` for a reward without a specialist that beat the pretrained model.
* :func:`dominates`: ``p`` is at least as good as ``q`` on every reward and better on one (a strict
  partial order on points).
* :func:`hypervolume`: the volume that a set of points dominates above a reference point, exact.
* :func:`judge`: per arm the normalised gains, their mean and worst over the rewards, the
  hypervolume of its point over the pretrained model's in normalised units, what it adds to the
  weighted-sum front's hypervolume, how often a point of that front dominates it (by seed), and
  the composite, each paired against the reference arm.

>>> dominates([0.5, 0.2], [0.5, 0.1]), dominates([0.5, 0.2], [0.4, 0.3])
(True, False)
>>> hypervolume([[2.0, 1.0], [1.0, 2.0]], [0.0, 0.0])  # two 2 x 1 boxes overlapping in 1 x 1
3.0
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mogo_diffusion.bootstrap import Interval, bootstrap_interval, paired_interval
from mogo_diffusion.evaluate import composite_zscores

__all__ = [
    "SPECIALIST_PREFIX",
    "as_list",
    "dominates",
    "gain_scales",
    "hypervolume",
    "judge",
    "normalised_gains",
    "summarize",
]

SPECIALIST_PREFIX = "single:"
"""The arm ``single:<reward>`` is the specialist of ``<reward>``, the 1 of its normalised gain."""


def as_list(interval: Interval) -> list[float]:
    """``[mean, low, high]`` of ``interval``, as the summaries store it."""
    return [interval.mean, interval.low, interval.high]


def _paired(values: Sequence[float], reference: Sequence[float] | float, same: bool) -> list[float]:
    """The paired interval of ``values - reference``; ``[0, 0, 0]`` for the reference arm itself,
    NaN where no seed has a finite difference (a reward that applied to no evaluation prompt)."""
    if same:
        return [0.0, 0.0, 0.0]
    differences = np.asarray(values, dtype=np.float64) - np.asarray(reference, dtype=np.float64)
    if not np.isfinite(differences).any():
        return [math.nan, math.nan, math.nan]
    return as_list(paired_interval(values, reference))


def summarize(
    names: Sequence[str],
    base: Sequence[float],
    means: Mapping[str, Mapping[int, Sequence[float]]],
    reference: str,
) -> dict[str, Any]:
    """The held-out means of every arm and seed, their composites, and their paired differences.

    Args:
        names: the K rewards.
        base: the pretrained model's K held-out means.
        means: arm to seed to its run's K held-out means; every arm has the reference's seeds.
        reference: the arm every difference is paired against.

    Returns:
        ``{"rewards", "seeds", "base", "arms"}``; each arm holds its ``means`` (per reward, per
        seed), its ``composite`` (per seed) and its ``vs_reference`` and ``vs_base`` intervals
        (per reward and for the composite, each ``[mean, low, high]``). The composite of a run is
        ``mean_k (m_k - mu_k) / sigma_k`` with ``mu_k, sigma_k`` the mean and std over the arms'
        seed-averaged means and the pretrained model's.

    Raises:
        KeyError: ``reference`` is not an arm, or an arm lacks one of its seeds.
    """
    seeds = sorted(means[reference])
    base = [float(value) for value in base]
    averaged = {arm: np.mean([runs[s] for s in seeds], axis=0).tolist() for arm, runs in means.items()}
    averaged["base"] = base
    composite = {
        arm: [composite_zscores({"run": runs[s]}, reference=averaged)["run"] for s in seeds]
        for arm, runs in means.items()
    }
    base_composite = composite_zscores({"base": base}, reference=averaged)["base"]
    rows: dict[str, Any] = {}
    for arm, runs in means.items():
        own = {k: [runs[s][i] for s in seeds] for i, k in enumerate(names)}
        theirs = {k: [means[reference][s][i] for s in seeds] for i, k in enumerate(names)}
        same = arm == reference
        rows[arm] = {
            "means": own,
            "composite": composite[arm],
            "vs_reference": {
                **{k: _paired(own[k], theirs[k], same) for k in names},
                "composite": _paired(composite[arm], composite[reference], same),
            },
            "vs_base": {
                **{k: _paired(own[k], base[i], False) for i, k in enumerate(names)},
                "composite": _paired(composite[arm], base_composite, False),
            },
        }
    return {"rewards": list(names), "seeds": seeds, "base": base, "arms": rows}


def gain_scales(base: Sequence[float], specialists: Sequence[float | None]) -> np.ndarray:
    """Per reward the unit of its normalised gain: ``R_specialist - R_base`` where a specialist
    (``specialists[k]``, its mean over seeds) scored above the pretrained model, else 1 (the raw
    gain: a specialist that did not beat the pretrained model defines no unit).

    >>> gain_scales([0.5, 0.2, 0.3], [0.75, None, 0.25]).tolist()
    [0.25, 1.0, 1.0]
    """
    base_array = np.asarray(base, dtype=np.float64)
    best = np.array([np.nan if s is None else s for s in specialists], dtype=np.float64)
    spread = best - base_array
    return np.where(np.isfinite(spread) & (spread > 0), spread, 1.0)


def normalised_gains(means: Any, base: Sequence[float], scales: Sequence[float]) -> np.ndarray:
    """``(means - base) / scales``, broadcast over the last axis (rewards): 0 at the pretrained
    model, 1 where a reward's specialist is (:func:`gain_scales`).

    >>> normalised_gains([[0.5, 0.4], [0.75, 0.1]], [0.5, 0.2], [0.25, 1.0]).tolist()
    [[0.0, 0.2], [1.0, -0.1]]
    """
    return (np.asarray(means, dtype=np.float64) - np.asarray(base, dtype=np.float64)) / np.asarray(
        scales, dtype=np.float64
    )


def _finite_points(*points: Any) -> list[np.ndarray]:
    arrays = [np.asarray(p, dtype=np.float64) for p in points]
    if any(a.shape != arrays[0].shape or a.ndim != 1 for a in arrays):
        raise ValueError(f"points must be vectors of one length, got shapes {[a.shape for a in arrays]}")
    if not all(np.isfinite(a).all() for a in arrays):
        raise ValueError(f"points must be finite, got {[a.tolist() for a in arrays]}")
    return arrays


def dominates(p: Sequence[float], q: Sequence[float]) -> bool:
    """Whether ``p`` Pareto-dominates ``q``: at least as high on every coordinate, higher on one.

    Raises:
        ValueError: the points are not finite vectors of one length.
    """
    a, b = _finite_points(p, q)
    return bool((a >= b).all() and (a > b).any())


def hypervolume(points: Any, reference: Sequence[float]) -> float:
    """The volume of the union of the boxes ``[reference, p]`` over the ``[N, K]`` ``points``:
    what the set dominates above ``reference``. A point not above ``reference`` on every
    coordinate adds nothing. Exact (slices along the last coordinate, recursively), for the few
    points of a comparison.

    Raises:
        ValueError: the points or the reference are not finite, or of other lengths.
    """
    origin = _finite_points(reference)[0]
    shifted = np.asarray(points, dtype=np.float64).reshape(-1, origin.size) - origin
    if not np.isfinite(shifted).all():
        raise ValueError(f"points must be finite, got {np.asarray(points).tolist()}")
    return _volume(shifted[(shifted > 0).all(axis=1)])


def _volume(points: np.ndarray) -> float:
    """The volume of the union of the boxes ``[0, p]`` of positive ``points`` ``[N, K]``."""
    if not len(points):
        return 0.0
    if points.shape[1] == 1:
        return float(points.max())
    points = points[np.argsort(-points[:, -1], kind="stable")]
    levels = np.append(points[:, -1], 0.0)
    return sum(
        float(levels[i] - levels[i + 1]) * _volume(points[: i + 1, :-1])
        for i in range(len(points))
        if levels[i] > levels[i + 1]
    )


def _specialist_mean(rows: Mapping[str, Any], reward: str) -> float | None:
    """The mean over seeds of ``reward``'s specialist on ``reward``, None without a specialist."""
    row = rows.get(f"{SPECIALIST_PREFIX}{reward}")
    return None if row is None else statistics.fmean(row["means"][reward])


def judge(summary: Mapping[str, Any], *, reference: str, front: Sequence[str]) -> dict[str, Any]:
    """Each arm of ``summary`` (:func:`summarize`) judged against the reference arm and the
    weighted-sum front, seed by seed.

    The unit of each reward is its specialist's gain (:func:`gain_scales`; specialists are the
    arms ``single:<reward>``). Rewards without a mean in every run (NaN) are left out of
    everything but their own column.

    Args:
        summary: :func:`summarize`'s result.
        reference: the arm every difference is paired against.
        front: the arms that trace the weighted-sum front (at least one).

    Returns:
        ``{"rewards", "scales" (per reward its unit), "normalised" (which rewards have a
        specialist's unit), "front", "arms"}``; each arm holds, for ``gain/<reward>``,
        ``mean_gain``, ``worst_gain``, ``hypervolume`` (of its own point's box over the
        pretrained model, in normalised units), ``beyond_front`` (the hypervolume it adds to the
        front's at the same seed; 0 for a point the front dominates) and ``composite``, a
        ``{"mean": mean over seeds, "vs_reference": [mean, low, high]}``; and ``dominated``: the
        share of seeds at which some front point dominates the arm's point, with its bootstrap
        interval, ``[mean, low, high]``, and ``dominated_by``: per front point the seeds at
        which it dominates the arm.

    Raises:
        ValueError: ``front`` is empty or names an arm not in ``summary``.
    """
    names, rows, seeds = summary["rewards"], summary["arms"], summary["seeds"]
    if not front or any(arm not in rows for arm in front):
        raise ValueError(f"the weighted-sum front must be arms of the comparison, got {list(front)}")
    base = summary["base"]
    specialists = [_specialist_mean(rows, k) for k in names]
    scales = gain_scales(base, specialists)
    points = {
        arm: normalised_gains([[row["means"][k][i] for k in names] for i in range(len(seeds))], base, scales)
        for arm, row in rows.items()
    }
    common = np.all([np.isfinite(p).all(axis=0) for p in points.values()], axis=0)
    origin = np.zeros(int(common.sum()))
    front_volume = [hypervolume([points[f][s, common] for f in front], origin) for s in range(len(seeds))]
    quantities: dict[str, dict[str, list[float]]] = {}
    for arm, point in points.items():
        own = point[:, common]
        quantities[arm] = {
            **{f"gain/{k}": point[:, i].tolist() for i, k in enumerate(names)},
            "mean_gain": own.mean(axis=1).tolist(),
            "worst_gain": own.min(axis=1).tolist(),
            "hypervolume": [hypervolume(own[s : s + 1], origin) for s in range(len(seeds))],
            "beyond_front": [
                hypervolume(np.vstack([own[s], *(points[f][s, common] for f in front)]), origin)
                - front_volume[s]
                for s in range(len(seeds))
            ],
            "composite": list(rows[arm]["composite"]),
        }
    judged = {}
    for arm, values in quantities.items():
        judged[arm] = {
            key: {
                "mean": statistics.fmean(series),
                "vs_reference": _paired(series, quantities[reference][key], arm == reference),
            }
            for key, series in values.items()
        }
        by = {
            f: [s for i, s in enumerate(seeds) if dominates(points[f][i, common], points[arm][i, common])]
            for f in front
            if f != arm
        }
        dominated = [float(any(seed in found for found in by.values())) for seed in seeds]
        judged[arm]["dominated"] = as_list(bootstrap_interval(dominated))
        judged[arm]["dominated_by"] = {f: found for f, found in by.items() if found}
    return {
        "rewards": list(names),
        "scales": scales.tolist(),
        "normalised": [s is not None and s > b for s, b in zip(specialists, base, strict=True)],
        "front": list(front),
        "arms": judged,
    }
