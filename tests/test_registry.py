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


class Mean(mogo.CheckedWeighting):
    """A weighting of one's own on mogo's base: the mean of the gradients, whatever G."""

    def weigh(self, gram: mogo.CheckedGram, losses: torch.Tensor) -> mogo.Weights:
        K = gram.host.shape[0]
        return mogo.Weights.from_combination(torch.full((K,), 1.0 / K, dtype=torch.float64))


def test_a_registered_weighting_on_mogos_base_checks_g_and_its_weights(monkeypatch):
    monkeypatch.setattr(mogo.registry, "WEIGHTINGS", dict(mogo.WEIGHTINGS))
    mogo.register_weighting("mean", Mean)
    weighting = mogo.make_weighting("mean")
    weights = weighting(torch.eye(4, dtype=torch.float64), torch.ones(4)).loss_weights
    assert torch.equal(weights, torch.full((4,), 0.25, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"G contains NaN or Inf: entry \(0, 1\) is nan"):
        weighting(torch.tensor([[1.0, float("nan")], [float("nan"), 1.0]]), torch.ones(2))
    with pytest.raises(TypeError, match=r"abstract method '?weigh"):  # the one method to write
        type("Incomplete", (mogo.CheckedWeighting,), {})()
