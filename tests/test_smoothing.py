"""Weights smoothed across harmonizations: ``alpha_ema`` is CR-MOGM's average (TorchJD's
``CRMOGMWeighting``), applied between harmonizations (MARBLE) or at them too
(``smooth_harmonized``, CR-MOGM itself)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor
from torchjd.aggregation import CRMOGMWeighting
from torchjd.aggregation import Weighting as TorchJDWeighting

import mogo
from mogo.testing import gradient_family
from tests.reference import noisy_regression, per_objective_gradients

EPS = float(np.finfo(np.float64).eps)


class Mogo(TorchJDWeighting):
    """A mogo weighting as a TorchJD one, for CR-MOGM to wrap: its loss weights of the Gramian."""

    def __init__(self, weighting: mogo.Weighting) -> None:
        super().__init__()
        self.weighting = weighting

    def forward(self, gramian: Tensor, /) -> Tensor:
        return self.weighting(gramian, torch.ones(gramian.shape[0])).loss_weights


@st.composite
def gram_sequences(draw: st.DrawFn) -> list[Tensor]:
    """1-8 Gram matrices of K gradients, each of a family and seed of its own."""
    K = draw(st.integers(2, 6))
    families = ("gaussian", "conflicting", "orthogonal", "low_rank")
    return [
        gradient_family(draw(st.sampled_from(families)), K, dim=8, seed=draw(st.integers(0, 2**31 - 1)))[1]
        for _ in range(draw(st.integers(1, 8)))
    ]


def same_average(ours: Tensor, theirs: Tensor, steps: int) -> None:
    """The same average to round-off: TorchJD's first output is ``rho x + (1 - rho) x`` where ours
    is ``x`` (an eps at most, weights being at most 1), and each later step rounds both once
    more; the average carries an earlier difference on times ``rho < 1``."""
    torch.testing.assert_close(ours, theirs, rtol=0, atol=(2 * steps + 1) * EPS)


@given(gram_sequences(), st.floats(0.0, 0.99))
def test_smoothing_every_harmonization_is_cr_mogm(grams, rho):
    # MGDA's weights have divisor 1 and scale 1: alpha is the loss weights, which CR-MOGM smooths
    # by the same operations, rho * last + (1 - rho) * new.
    amortizer = mogo.AmortizedWeights(1, rho, smooth_harmonized=True)
    weighting, theirs = (
        mogo.make_weighting("mgda"),
        CRMOGMWeighting(Mogo(mogo.make_weighting("mgda")), alpha=rho),
    )
    for step, G in enumerate(grams, 1):
        applied = amortizer.update(weighting(G, torch.ones(G.shape[0])))
        same_average(applied.loss_weights, theirs(G), step)
        assert torch.equal(amortizer.loss_weights(), applied.loss_weights)  # and the steps between


@given(gram_sequences(), st.floats(0.0, 0.99))
def test_by_default_a_harmonization_applies_its_own_weights_and_the_average_serves_the_steps_between(
    grams, rho
):
    amortizer = mogo.AmortizedWeights(3, rho)
    weighting, theirs = (
        mogo.make_weighting("mgda"),
        CRMOGMWeighting(Mogo(mogo.make_weighting("mgda")), alpha=rho),
    )
    for step, G in enumerate(grams, 1):
        fresh = weighting(G, torch.ones(G.shape[0]))
        assert amortizer.update(fresh) is fresh  # MARBLE as released: the fresh alpha
        same_average(amortizer.loss_weights(), theirs(G), step)


@given(gram_sequences(), st.floats(0.0, 0.99))
def test_with_normalised_gradients_the_average_is_of_alpha_with_the_last_norms(grams, rho):
    amortizer = mogo.AmortizedWeights(1, rho, smooth_harmonized=True)
    average = None
    for G in grams:
        fresh = mogo.MinNorm()(G, torch.ones(G.shape[0]))
        average = fresh.alpha if average is None else rho * average + (1 - rho) * fresh.alpha
        applied = amortizer.update(fresh)
        assert torch.equal(applied.loss_weights, fresh.scale * average / fresh.divisor)


def test_through_the_optimizer_smooth_harmonized_applies_cr_mogms_weights_every_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    opt = mogo.HarmonizedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), 3, weighting=mogo.make_weighting("mgda"),
        alpha_ema=0.7, smooth_harmonized=True, grad_mode="sequential",
    )  # fmt: skip
    theirs = CRMOGMWeighting(Mogo(mogo.make_weighting("mgda")), alpha=0.7)
    params = list(model.parameters())
    for step in range(4):
        losses = noisy_regression(model, step, inputs=4)
        stacked, J = per_objective_gradients(losses, params)
        opt.zero_grad()
        opt.backward(losses)
        expected = theirs(mogo.gramian(stacked))  # the Gram matrix the optimizer forms
        same_average(opt.last_report.loss_weights, expected, step + 1)
        update = torch.cat([p.grad.reshape(-1) for p in params])
        size = float((expected.abs() * J.norm(dim=1)).sum())
        assert float((update - expected @ J).norm()) <= 100 * J.shape[1] * EPS * size
        opt.step()


def test_smooth_harmonized_must_be_a_bool():
    with pytest.raises(TypeError, match="smooth_harmonized must be True or False, got 'yes'"):
        mogo.AmortizedWeights(1, 0.5, smooth_harmonized="yes")
