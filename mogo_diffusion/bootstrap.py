"""Statistics of a comparison with few seeds: paired bootstrap intervals and verdicts.

Every arm of a comparison is run with the same seeds, and seed ``s`` of every arm starts from the
same adapter initialisation and sees the same prompt draws, so differences between arms are taken
**paired by seed**: ``d_s = m_s(arm) - m_s(reference)``. Their mean's 95 % confidence interval is
the percentile interval of the means of ``d`` over ``resamples`` bootstrap resamples of the seeds
(with replacement, from a fixed generator, so the numbers are reproducible).

With five seeds the smallest and largest attainable bootstrap means are ``min d`` and ``max d``:
the interval never claims more than the seeds show, and it is wide when they disagree. A claim is
decided only when its interval excludes 0; otherwise it is *undecided*.

>>> interval = paired_interval([0.30, 0.32, 0.29, 0.35, 0.31], [0.25, 0.26, 0.27, 0.24, 0.28])
>>> round(interval.mean, 3), interval.low > 0, interval.verdict()
(0.054, True, 'above')
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = ["Interval", "bootstrap_interval", "paired_interval", "verdict_of"]

RESAMPLES = 10_000
"""Bootstrap resamples per interval: the percentile's Monte-Carlo error is then below 1 % of the
interval's width for any distribution of the seeds' differences."""


@dataclass(frozen=True)
class Interval:
    """The mean of per-seed differences and its 95 % bootstrap interval.

    Attributes:
        mean: the mean over seeds of the differences.
        low, high: the 2.5 % and 97.5 % percentiles of the bootstrap means.
        seeds: how many seeds (finite differences) the interval rests on.
    """

    mean: float
    low: float
    high: float
    seeds: int

    def verdict(self) -> Literal["above", "below", "spans 0"]:
        """``"above"`` (``low > 0``), ``"below"`` (``high < 0``) or ``"spans 0"``."""
        return verdict_of(self.low, self.high)

    def __str__(self) -> str:
        return f"{self.mean:+.3f} [{self.low:+.3f}, {self.high:+.3f}]"


def verdict_of(low: float, high: float) -> Literal["above", "below", "spans 0"]:
    """Where an interval ``[low, high]`` lies relative to 0 (NaN bounds span 0)."""
    if low > 0:
        return "above"
    if high < 0:
        return "below"
    return "spans 0"


def bootstrap_interval(
    differences: Sequence[float], *, resamples: int = RESAMPLES, seed: int = 0, level: float = 0.95
) -> Interval:
    """The mean of ``differences`` (one per seed; NaN ones are left out) and its bootstrap interval.

    Raises:
        ValueError: no finite difference, or ``level`` outside (0, 1).
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    values = np.asarray(differences, dtype=np.float64)
    values = values[np.isfinite(values)]
    if values.size == 0:
        raise ValueError(f"no finite difference to bootstrap in {list(differences)}")
    generator = np.random.default_rng(seed)
    means = values[generator.integers(0, values.size, size=(resamples, values.size))].mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return Interval(float(values.mean()), float(low), float(high), int(values.size))


def paired_interval(arm: Sequence[float], reference: Sequence[float] | float, **options: float) -> Interval:
    """:func:`bootstrap_interval` of ``arm[s] - reference[s]`` over the seeds ``s``.

    ``reference`` may be one number (the pretrained model, which has no seeds). Options go to
    :func:`bootstrap_interval`.

    Raises:
        ValueError: ``arm`` and ``reference`` have different numbers of seeds.
    """
    values = np.asarray(arm, dtype=np.float64)
    if isinstance(reference, Sequence) and not isinstance(reference, str):
        base = np.asarray(reference, dtype=np.float64)
        if base.shape != values.shape:
            raise ValueError(f"paired by seed: {values.size} seeds against {base.size}")
    else:
        base = np.full_like(values, float(reference))
    return bootstrap_interval(values - base, **options)
