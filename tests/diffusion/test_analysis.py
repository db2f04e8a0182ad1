"""Judging arms against the weighted-sum front: dominance, hypervolume, normalised gains, paired."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mogo_diffusion.analysis import (
    dominates,
    gain_scales,
    hypervolume,
    judge,
    normalised_gains,
    summarize,
)

# Small integers: ties are frequent, and every volume below is exact in float64.
coordinate = st.integers(-3, 6).map(float)


def points(k: int, min_size: int = 1, max_size: int = 5):
    return st.lists(st.lists(coordinate, min_size=k, max_size=k), min_size=min_size, max_size=max_size)


dimension = st.integers(1, 4)


@given(dimension.flatmap(lambda k: points(k, 3, 3)))
def test_dominance_is_a_strict_partial_order(triple):
    p, q, r = triple
    assert not dominates(p, p)  # irreflexive
    if dominates(p, q):
        assert not dominates(q, p)  # asymmetric
        if dominates(q, r):
            assert dominates(p, r)  # transitive


def test_dominance_needs_one_strict_improvement_and_finite_points():
    assert dominates([1.0, 2.0], [1.0, 1.0])
    assert not dominates([1.0, 1.0], [1.0, 1.0])
    assert not dominates([2.0, 0.0], [1.0, 1.0])  # a trade-off: neither dominates
    with pytest.raises(ValueError, match="finite"):
        dominates([math.nan, 1.0], [0.0, 0.0])
    with pytest.raises(ValueError, match="one length"):
        dominates([1.0], [0.0, 0.0])


def inclusion_exclusion(boxes: list[list[float]]) -> float:
    """The union's volume of boxes ``[0, b]`` (non-negative ``b``), from the intersections of
    every subset: the intersection of boxes from the origin is the box of their minimum."""
    total = 0.0
    for size in range(1, len(boxes) + 1):
        for subset in itertools.combinations(boxes, size):
            total += (-1) ** (size + 1) * math.prod(np.min(subset, axis=0))
    return total


@given(dimension.flatmap(lambda k: st.tuples(points(k, 1, 5), st.lists(coordinate, min_size=k, max_size=k))))
def test_hypervolume_is_exact_against_inclusion_exclusion(case):
    front, reference = case
    boxes = [[max(a - r, 0.0) for a, r in zip(p, reference, strict=True)] for p in front]
    assert hypervolume(front, reference) == inclusion_exclusion(boxes)  # integers: exact


def test_hypervolume_by_hand():
    assert hypervolume([[3.0, 1.0], [1.0, 2.0]], [0.0, 0.0]) == 3 * 1 + 1 * 1  # an L-shaped staircase
    assert hypervolume([[2.0, 2.0, 2.0], [3.0, 1.0, 1.0]], [0.0, 0.0, 0.0]) == 8 + 1 * 1 * 1
    assert hypervolume([[0.5, 4.0]], [1.0, 0.0]) == 0  # not above the reference on every reward
    assert hypervolume(np.empty((0, 2)), [0.0, 0.0]) == 0
    with pytest.raises(ValueError, match="finite"):
        hypervolume([[1.0, math.inf]], [0.0, 0.0])


@given(
    dimension.flatmap(
        lambda k: st.tuples(
            points(k, 0, 4),
            st.lists(coordinate, min_size=k, max_size=k),
            st.lists(st.integers(0, 3).map(float), min_size=k, max_size=k),
        )
    )
)
def test_hypervolume_is_monotone_under_dominance(case):
    rest, p, lift = case
    q = [a + b for a, b in zip(p, lift, strict=True)]  # q is at least p everywhere
    origin = [0.0] * len(p)
    with_p, with_q = hypervolume([*rest, p], origin), hypervolume([*rest, q], origin)
    assert with_q >= with_p >= hypervolume(rest, origin)
    if any(dominates(r, p) or r == p for r in rest):
        assert with_p == hypervolume(rest, origin)  # a dominated point adds nothing


finite = st.floats(-10, 10, allow_nan=False)


@given(st.lists(st.tuples(finite, finite), min_size=1, max_size=6))
def test_normalised_gains_are_zero_at_the_pretrained_model_and_one_at_the_specialist(pairs):
    base, specialist = (list(values) for values in zip(*pairs, strict=True))
    scales = gain_scales(base, specialist)
    assert (normalised_gains(base, base, scales) == 0).all()
    beat = [s > b for b, s in zip(base, specialist, strict=True)]
    gains = normalised_gains(specialist, base, scales)
    # x / x is exactly 1 in floating point; a specialist that did not beat the base gives a raw gain
    assert gains[beat].tolist() == [1.0] * sum(beat)
    raw = [s - b for b, s, won in zip(base, specialist, beat, strict=True) if not won]
    assert gains[~np.asarray(beat)].tolist() == raw


SEEDS = range(4)


def comparison(arms: dict[str, list[float]], noise: list[float] = (0.0, 0.01, -0.01, 0.0)) -> dict:
    """A summary of arms whose seeds share ``noise`` on every reward (paired, it cancels)."""
    means = {arm: {s: [v + noise[s] for v in point] for s in SEEDS} for arm, point in arms.items()}
    return summarize(("r1", "r2"), [0.2, 0.4], means, "weighted_sum")


def test_an_arm_inside_the_front_is_dominated_at_every_seed_and_adds_no_volume():
    summary = comparison(
        {
            "single:r1": [0.6, 0.4],  # r1's unit: 0.4
            "single:r2": [0.2, 0.6],  # r2's unit: 0.2 (its specialist's mean over seeds)
            "weighted_sum": [0.4, 0.5],
            "weighted_sum@2,1": [0.5, 0.45],
            "marble": [0.38, 0.48],  # below weighted_sum on both rewards
            "upgrad": [0.56, 0.55],  # beyond both front points
        }
    )
    judged = judge(summary, reference="weighted_sum", front=["weighted_sum", "weighted_sum@2,1"])
    assert judged["normalised"] == [True, True]
    assert judged["scales"] == pytest.approx([0.4, 0.2])
    arms = judged["arms"]
    assert arms["single:r1"]["gain/r1"]["mean"] == pytest.approx(1.0, abs=1e-12)
    assert arms["marble"]["dominated"] == [1.0, 1.0, 1.0]
    assert arms["marble"]["dominated_by"] == {"weighted_sum": [0, 1, 2, 3]}
    assert arms["marble"]["beyond_front"]["mean"] == pytest.approx(0.0, abs=1e-12)
    assert arms["upgrad"]["dominated"] == [0.0, 0.0, 0.0]
    assert arms["upgrad"]["beyond_front"]["mean"] > 0
    assert arms["weighted_sum"]["dominated"][0] == 0.0  # the other front point trades off against it
    # gains: (0.38 - 0.2) / 0.4 = 0.45 and (0.48 - 0.4) / 0.2 = 0.4, paired against 0.5 and 0.5
    gain = arms["marble"]["gain/r2"]
    assert gain["mean"] == pytest.approx(0.4)
    assert gain["vs_reference"] == pytest.approx([-0.1, -0.1, -0.1])  # on one reward the noise cancels
    noise = np.array([0.0, 0.01, -0.01, 0.0])
    worst = np.minimum((0.18 + noise) / 0.4, (0.08 + noise) / 0.2) - np.minimum(
        (0.2 + noise) / 0.4, (0.1 + noise) / 0.2
    )  # in units of each reward's specialist the noise no longer cancels
    mean, low, high = arms["marble"]["worst_gain"]["vs_reference"]
    assert mean == pytest.approx(worst.mean())
    assert worst.min() - 1e-12 <= low <= high <= worst.max() + 1e-12
    assert arms["weighted_sum"]["composite"]["vs_reference"] == [0.0, 0.0, 0.0]
    assert arms["marble"]["hypervolume"]["mean"] == pytest.approx(np.mean(
        [(0.18 + n) / 0.4 * (0.08 + n) / 0.2 for n in (0.0, 0.01, -0.01, 0.0)]
    ))  # fmt: skip


def test_without_specialists_the_gain_is_raw_and_a_reward_without_means_is_left_out():
    summary = comparison({"weighted_sum": [0.3, 0.5], "marble": [0.5, 0.45]})
    judged = judge(summary, reference="weighted_sum", front=["weighted_sum"])
    assert judged["normalised"] == [False, False]
    assert judged["arms"]["marble"]["gain/r1"]["vs_reference"] == pytest.approx([0.2] * 3)
    means = {"weighted_sum": {0: [0.3, math.nan]}, "marble": {0: [0.5, math.nan]}}
    nan_summary = summarize(("r1", "r2"), [0.2, 0.4], means, "weighted_sum")
    judged = judge(nan_summary, reference="weighted_sum", front=["weighted_sum"])["arms"]["marble"]
    assert judged["dominated"] == [0.0, 0.0, 0.0]
    assert judged["hypervolume"]["mean"] == pytest.approx(0.3)  # r1 alone: 0.5 - 0.2
    assert all(math.isnan(v) for v in judged["gain/r2"]["vs_reference"])
    with pytest.raises(ValueError, match="front must be arms of the comparison"):
        judge(summary, reference="weighted_sum", front=["weighted_sum@1,2"])
