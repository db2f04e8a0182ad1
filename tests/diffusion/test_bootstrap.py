"""Paired bootstrap intervals of a comparison with few seeds."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mogo_diffusion.bootstrap import bootstrap_interval, paired_interval, verdict_of

finite = st.floats(-1e3, 1e3, allow_nan=False)
seeds = st.lists(finite, min_size=1, max_size=12)


@given(seeds)
@settings(max_examples=60, deadline=None)
def test_the_interval_lies_within_the_seeds_and_holds_their_mean(values):
    interval = bootstrap_interval(values, resamples=2000)
    spread = 1e-9 * (1 + max(abs(v) for v in values))
    assert min(values) - spread <= interval.low <= interval.mean + spread
    assert interval.mean - spread <= interval.high <= max(values) + spread
    assert interval.mean == pytest.approx(float(np.mean(values)), abs=spread)
    assert interval.seeds == len(values)


@given(seeds, finite)
@settings(max_examples=40, deadline=None)
def test_a_shift_of_every_seed_shifts_the_interval(values, shift):
    before = bootstrap_interval(values, resamples=500)
    after = bootstrap_interval([v + shift for v in values], resamples=500)
    tolerance = 1e-9 * (1 + abs(shift) + max(abs(v) for v in values))
    assert after.low == pytest.approx(before.low + shift, abs=tolerance)
    assert after.high == pytest.approx(before.high + shift, abs=tolerance)


def test_equal_differences_give_a_point_and_a_decided_verdict():
    interval = bootstrap_interval([0.1] * 5)
    assert (interval.low, interval.high) == pytest.approx((0.1, 0.1))
    assert interval.verdict() == "above"
    assert bootstrap_interval([-0.2] * 5).verdict() == "below"


def test_seeds_that_disagree_in_sign_leave_the_claim_undecided():
    assert bootstrap_interval([0.3, -0.2, 0.1, -0.25, 0.05]).verdict() == "spans 0"


def test_the_interval_is_reproducible():
    values = [0.3, -0.2, 0.1, -0.25, 0.05]
    assert bootstrap_interval(values) == bootstrap_interval(values)


def test_pairing_removes_what_the_seeds_share():
    shared = [0.0, 1.0, -1.0, 2.0, -2.0]  # a large seed effect common to both arms
    arm = [s + 0.05 for s in shared]
    assert paired_interval(arm, shared).verdict() == "above"
    assert bootstrap_interval(arm).verdict() == "spans 0"  # unpaired, the seed effect hides it


def test_a_scalar_reference_and_nan_seeds():
    interval = paired_interval([0.4, math.nan, 0.6], 0.3)
    assert interval.seeds == 2
    assert interval.mean == pytest.approx(0.2)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="paired by seed: 3 seeds against 2"):
        paired_interval([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="no finite difference"):
        bootstrap_interval([math.nan, math.nan])
    with pytest.raises(ValueError, match="level must be in"):
        bootstrap_interval([1.0], level=1.0)


def test_verdict_of_nan_bounds_is_undecided():
    assert verdict_of(math.nan, math.nan) == "spans 0"
