"""MoDo and SDMGrad: the stochastic weightings that step on an unbiased Gram estimate, against
TorchJD's implementations on sequences of cross-fitted Gram matrices, and their properties."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torchjd.aggregation import MoDoWeighting, SDMGradWeighting

import mogo
from mogo.gram import has_direction
from mogo.simplex import project_onto_simplex
from tests.reference import noisy_regression, per_objective_gradients

EPS = float(np.finfo(np.float64).eps)


@st.composite
def cross_fitted_sequences(draw: st.DrawFn) -> list[mogo.GramEstimate]:
    """1-6 cross-fitted estimates of K objectives' noisy half-batch gradients around one signal
    (the halves of successive batches), at scales 1e-6..1e6; most are indefinite somewhere."""
    K = draw(st.integers(2, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    dim = int(rng.integers(1, 30))
    signal = rng.standard_normal((K, dim)) * 10.0 ** rng.uniform(-1, 1, (K, 1))
    scale = 10.0 ** draw(st.integers(-3, 3))
    estimates = []
    for _ in range(draw(st.integers(1, 6))):
        noise = 10.0 ** rng.uniform(-1, 1)
        first, second = (scale * (signal + noise * rng.standard_normal((K, dim))) for _ in range(2))
        cross = torch.from_numpy(first @ second.T)
        estimate = mogo.GramEstimate((cross + cross.T) / 2, cross)
        if has_direction(estimate.gram.numpy()):  # else every weighting refuses it
            estimates.append(estimate)
    return estimates


def weights_of(weighting: mogo.Weighting, estimates: list[mogo.GramEstimate]) -> list[torch.Tensor]:
    return [weighting(e, torch.ones(e.gram.shape[0])).loss_weights for e in estimates]


@given(cross_fitted_sequences(), st.floats(0.01, 1.0), st.floats(0.0, 1.0))
def test_modo_equals_torchjd_on_a_sequence_of_cross_fitted_gram_matrices(estimates, gamma, rho):
    ours = weights_of(mogo.MoDo(gamma, rho), estimates)
    theirs = MoDoWeighting(gamma, rho)
    for weights, estimate in zip(ours, estimates, strict=True):
        # the same operations on the same matrix; loss weights s * (lambda / s) round once more
        torch.testing.assert_close(weights, theirs(estimate.gram), rtol=0, atol=2 * EPS)


@given(cross_fitted_sequences(), st.sampled_from([0.0, 0.3, 1.0]))
def test_sdmgrad_equals_torchjd_where_its_guard_is_below_round_off(estimates, lambda_):
    # TorchJD divides by s^2 + 1e-8 where ours divides by s^2. Scaled by 2**60 (exactly, with its
    # square root 2**30), s^2 of these estimates (above 1e-9) outgrows 1e-8 beyond round-off, and
    # A / (s^2 + 1e-8) is then ours bit for bit. Where s = 0 (no positive diagonal entry) TorchJD
    # divides by 1e-8 alone and ours leaves the weights: those estimates are left out.
    estimates = [e for e in estimates if float(e.gram.diagonal().max()) > 0]
    ours = weights_of(mogo.SDMGrad(lambda_=lambda_), estimates)
    theirs = SDMGradWeighting(lambda_=lambda_)
    for weights, estimate in zip(ours, estimates, strict=True):
        torch.testing.assert_close(weights, theirs(estimate.gram * 2.0**60), rtol=0, atol=2 * EPS)


@given(cross_fitted_sequences(), st.integers(-250, 250))
def test_sdmgrad_is_free_of_the_gradients_scale(estimates, power):
    scaled = [mogo.GramEstimate(e.gram * 4.0**power, e.cross * 4.0**power) for e in estimates]
    for ours, theirs in zip(
        weights_of(mogo.SDMGrad(), estimates), weights_of(mogo.SDMGrad(), scaled), strict=True
    ):
        assert torch.equal(ours, theirs)  # powers of 4 scale exactly, their square roots too


def lipschitz_product(estimates: list[mogo.GramEstimate], step: float) -> float:
    """``prod_t (1 + step ||A_t||_2)``: how far round-off can grow over the calls, the
    projection being nonexpansive."""
    return float(np.prod([1 + step * float(torch.linalg.matrix_norm(e.gram, 2)) for e in estimates]))


@given(cross_fitted_sequences(), st.randoms())
def test_modo_and_one_step_sdmgrad_permute_with_the_objectives(estimates, random):
    K = estimates[0].gram.shape[0]
    order = list(range(K))
    random.shuffle(order)
    permuted = [mogo.GramEstimate(e.gram[order][:, order], e.cross[order][:, order]) for e in estimates]
    # SDMGrad's inner SGD (lr 10) is no contraction: over its 20 default steps round-off may grow
    # beyond any bound worth stating, so it is checked with one step per call, on A / s^2.
    normalized = [
        mogo.GramEstimate(e.gram / float(torch.diag(e.gram).clamp(min=0).sqrt().mean()) ** 2)
        for e in estimates
    ]
    for weighting, step, sequence in (
        (mogo.MoDo(0.1, 0.1), 0.1, estimates),
        (mogo.SDMGrad(n_iter=1), 10.0, normalized),
    ):
        ours = weights_of(copy.deepcopy(weighting), estimates)
        theirs = weights_of(copy.deepcopy(weighting), permuted)
        # each call's matrix-vector product errs by K eps ||A|| ||w|| (w on the simplex)
        bound = (
            4
            * K
            * EPS
            * len(estimates)
            * lipschitz_product(sequence, step)
            * (1 + step * max(float(torch.linalg.matrix_norm(e.gram, 2)) for e in sequence))
        )
        for weights, permuted_weights in zip(ours, theirs, strict=True):
            assert float((weights[order] - permuted_weights).abs().max()) <= bound


def test_modo_steps_on_the_estimate_itself_not_its_nearest_gram_matrix():
    # One step from uniform is linear in A: its expectation is the step on E[A] = M M^T, which the
    # nearest Gram matrix (its negative eigenvalues cut) does not keep.
    cross = torch.tensor([[1.0, 0.2], [0.4, -0.3]], dtype=torch.float64)
    estimate = mogo.GramEstimate((cross + cross.T) / 2, cross)
    weights = mogo.MoDo(gamma=0.5, rho=0.0)(estimate, torch.ones(2))
    uniform = torch.full((2,), 0.5, dtype=torch.float64)
    expected = project_onto_simplex(uniform - 0.5 * (estimate.gram @ uniform))
    torch.testing.assert_close(weights.loss_weights, expected, rtol=0, atol=2 * EPS)
    assert weights.weighed == "estimate"
    nearest = torch.from_numpy(mogo.check_gram(estimate).host)
    assert not torch.allclose(mogo.MoDo(gamma=0.5, rho=0.0)(nearest, torch.ones(2)).loss_weights, expected)


def test_sdmgrad_leaves_its_weights_where_no_squared_norm_is_estimated_above_zero():
    # diagonal 0, an eigenvalue of 1: a direction, but no objective's own norm shows above noise
    estimate = mogo.GramEstimate(torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=torch.float64))
    sdmgrad = mogo.SDMGrad()
    sdmgrad.load_state_dict({"iterate": torch.tensor([0.25, 0.75], dtype=torch.float64)})
    weights = sdmgrad(estimate, torch.ones(2)).loss_weights
    expected = (torch.tensor([0.25, 0.75], dtype=torch.float64) + 0.3 * 0.5) / 1.3
    torch.testing.assert_close(weights, expected, rtol=0, atol=2 * EPS)
    assert torch.equal(sdmgrad.iterate, torch.tensor([0.25, 0.75], dtype=torch.float64))


def test_the_weights_restart_from_uniform_when_the_number_of_objectives_changes():
    G3, G2 = torch.eye(3, dtype=torch.float64), torch.eye(2, dtype=torch.float64)
    modo = mogo.MoDo()
    modo(G3 * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), torch.ones(3))
    fresh = mogo.MoDo()(G2, torch.ones(2)).loss_weights
    assert torch.equal(modo(G2, torch.ones(2)).loss_weights, fresh)


@pytest.mark.parametrize("kind", [mogo.MoDo, mogo.SDMGrad])
def test_a_state_round_trips_and_a_bad_one_is_refused_naming_it(kind):
    weighting = kind()
    weighting(torch.diag(torch.tensor([1.0, 4.0], dtype=torch.float64)), torch.ones(2))
    other = kind()
    other.load_state_dict(copy.deepcopy(weighting.state_dict()))
    G = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
    assert torch.equal(other(G, torch.ones(2)).loss_weights, weighting(G, torch.ones(2)).loss_weights)
    for bad, match in (
        ({"iterate": torch.ones(2)}, "iterate: must be a \\(K,\\) float64 tensor"),
        (
            {"iterate": torch.tensor([-1.0, 2.0], dtype=torch.float64)},
            "iterate: must be finite and non-negative",
        ),
        ({"lambda": None}, "must be {'iterate'"),
    ):
        with pytest.raises(ValueError, match=f"{kind.__name__} state: {match}"):
            other.load_state_dict(bad)


@pytest.mark.parametrize(
    ("kind", "kwargs", "match"),
    [
        (mogo.MoDo, {"gamma": 0}, "gamma must be a positive finite number, got 0"),
        (mogo.MoDo, {"rho": -1}, "rho must be a non-negative finite number, got -1"),
        (mogo.SDMGrad, {"lr": float("inf")}, "lr must be a positive finite number"),
        (mogo.SDMGrad, {"momentum": 1.0}, r"momentum must be in \[0, 1\)"),
        (mogo.SDMGrad, {"n_iter": 0}, "n_iter must be a positive integer"),
        (mogo.SDMGrad, {"lambda_": -0.5}, "lambda_ must be a non-negative finite number"),
        (mogo.SDMGrad, {"preference": [1.0, float("nan")]}, r"preference must be a finite \(K,\) vector"),
    ],
)
def test_bad_options_are_refused_naming_them(kind, kwargs, match):
    with pytest.raises(ValueError, match=match):
        kind(**kwargs)


def test_a_preference_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="a preference of 3 entries for 2 objectives"):
        mogo.SDMGrad(preference=[1.0, 0.0, 0.0])(torch.eye(2, dtype=torch.float64), torch.ones(2))


def test_the_optimizer_checkpoints_the_weights_and_a_skipped_step_restores_them():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).double()
    opt = mogo.HarmonizedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        2,
        weighting=mogo.MoDo(),
        gram="cross_fitted",
        nonfinite="skip",
    )
    x = torch.randn(8, 4, dtype=torch.float64)

    def halves(nan: bool = False) -> torch.Tensor:
        errors = (model(x) - torch.tensor([1.0, -1.0], dtype=torch.float64)) ** 2
        losses = torch.stack([errors[:4].mean(0), errors[4:].mean(0)])
        return losses * float("nan") if nan else losses

    for _ in range(2):
        opt.zero_grad()
        opt.backward(halves())
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    assert torch.equal(saved["mogo"]["weighting"]["iterate"], opt.weighting.iterate)
    opt.zero_grad()
    opt.backward(halves())  # the window's first micro-batch takes a step on the weights
    assert not torch.equal(opt.weighting.iterate, saved["mogo"]["weighting"]["iterate"])
    opt.backward(halves(nan=True))  # its second is not finite: the step goes back
    opt.step()
    assert torch.equal(opt.weighting.iterate, saved["mogo"]["weighting"]["iterate"])


def test_sdmgrad_drives_the_optimizer_with_the_weights_of_the_gram_matrix_it_forms():
    # Its inner SGD (lr 10) amplifies any error of G by up to 1e7 here (float64; a float32 G moved
    # the weights by 1e-3), so the reference weighs the Gram matrix the optimizer forms: the same
    # sequential gradients through mogo.gramian. The update then differs from sum_k w_k g_k by
    # the round-off of P-term sums.
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    opt = mogo.HarmonizedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), 3, weighting=mogo.SDMGrad(), grad_mode="sequential"
    )
    reference = mogo.SDMGrad()
    params = list(model.parameters())
    for step in range(4):
        losses = noisy_regression(model, step, inputs=5)
        stacked, J = per_objective_gradients(losses, params)
        opt.zero_grad()
        opt.backward(losses)
        weights = reference(mogo.gramian(stacked), losses.detach()).loss_weights
        expected = weights @ J
        update = torch.cat([p.grad.reshape(-1) for p in params])
        size = float((weights.abs() * J.norm(dim=1)).sum())
        assert float((update - expected).norm()) <= 100 * J.shape[1] * EPS * size
        opt.step()
