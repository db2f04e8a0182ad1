"""Weightings by name."""

from __future__ import annotations

import pytest
import torch

import mogo


def test_make_weighting_builds_the_registered_class_with_its_options():
    weighting = mogo.make_weighting("weighted_sum", weights=[1.0, 3.0])
    assert isinstance(weighting, mogo.WeightedSum)
    weights = weighting(torch.eye(2, dtype=torch.float64), torch.ones(2))
    assert torch.equal(weights.loss_weights, torch.tensor([1.0, 3.0], dtype=torch.float64))


def test_an_unknown_name_suggests_the_closest():
    with pytest.raises(ValueError, match=r"unknown weighting 'min_nrom'; did you mean 'min_norm'"):
        mogo.make_weighting("min_nrom")


def test_a_rejected_option_names_the_weighting():
    with pytest.raises(ValueError, match=r"weighting 'min_norm': .*unexpected keyword argument 'bogus'"):
        mogo.make_weighting("min_norm", bogus=1)


def test_register_weighting_adds_a_name_and_refuses_a_taken_or_malformed_one(monkeypatch):
    monkeypatch.setattr(mogo.registry, "WEIGHTINGS", dict(mogo.WEIGHTINGS))
    mogo.register_weighting("my_sum", mogo.WeightedSum)
    assert isinstance(mogo.make_weighting("my_sum", weights=[1.0]), mogo.WeightedSum)
    with pytest.raises(ValueError, match="already registered"):
        mogo.register_weighting("my_sum", mogo.WeightedSum)
    with pytest.raises(ValueError, match="lower-case identifier"):
        mogo.register_weighting("My-Sum", mogo.WeightedSum)
