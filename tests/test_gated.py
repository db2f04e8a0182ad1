"""The gated projection: the weighted sum bit for bit while its gate is closed, never opposing an
objective once it opens, the gate's definition, and its run through the optimizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mogo
from mogo.gram import has_direction
from tests.test_weightings import DEGENERATE, direction_gap, problems, worst_opposition

EPS = float(np.finfo(np.float64).eps)


@st.composite
def estimates(draw: st.DrawFn) -> tuple[mogo.GramEstimate, torch.Tensor]:
    """A cross-fitted estimate of K noisy half-batch gradients around a signal that may pull
    against itself, and a non-negative prior ``(K,)``; scales 1e-6..1e6."""
    K = draw(st.integers(2, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    dim = int(rng.integers(1, 30))
    signal = rng.standard_normal((K, dim))
    if rng.integers(0, 2):  # centred: the objectives pull against each other
        signal -= signal.mean(axis=0)
    noise = 10.0 ** rng.uniform(-2, 1)
    scale = 10.0 ** draw(st.integers(-3, 3))
    first, second = (scale * (signal + noise * rng.standard_normal((K, dim))) for _ in range(2))
    cross = torch.from_numpy(first @ second.T)
    prior = torch.from_numpy(rng.uniform(0, 1, K) * (rng.uniform(size=K) > 0.2) + 1e-3)
    return mogo.GramEstimate((cross + cross.T) / 2, cross), prior


def gate(estimate: mogo.GramEstimate, prior: torch.Tensor, margin: float) -> bool:
    """Independent reference of the gate: an objective whose two one-way estimates of
    ``<d_ws, mu_k>`` average below ``-margin`` times their half-difference."""
    one_way = (estimate.cross.T @ prior, estimate.cross @ prior)  # <d_1, g_2k>, <d_2, g_1k>
    mean, spread = (one_way[0] + one_way[1]) / 2, (one_way[0] - one_way[1]).abs() / 2
    return bool((mean < -margin * spread).any())


@given(estimates(), st.sampled_from([0.0, 1.0, 3.0]))
def test_closed_it_is_the_weighted_sum_bit_for_bit_and_open_it_opposes_no_objective(case, margin):
    estimate, prior = case
    if not has_direction(estimate.gram.numpy()):
        return  # refused by every weighting (tests/test_weightings.py)
    weights = mogo.GatedProjection(prior, margin=margin)(estimate, torch.ones(len(prior)))
    nearest = torch.from_numpy(mogo.check_gram(estimate).host)
    if not gate(estimate, prior, margin):
        plain = mogo.WeightedSum(prior)(nearest, torch.ones(len(prior)))
        for field in ("alpha", "divisor", "scale", "loss_weights"):
            assert torch.equal(getattr(weights, field), getattr(plain, field))
        assert weights.solve is None
        return
    # certified to DEFAULT_TOL relative to ||u||_1 + ||v - u||_1 in unit-gradient coordinates,
    # which worst_opposition's scale, sum_j |w_j| ||g_j||, bounds from above
    assert weights.solve.status == "success"
    assert worst_opposition(nearest, weights.loss_weights) <= 1e-12


@given(estimates())
def test_open_it_adds_to_the_prior_weights_and_no_more_than_the_projection_needs(case):
    # v = argmin_{v >= w} v^T G v: every weight at least the prior's, and the projected direction
    # no longer than the weighted sum (the origin's side of the cone: ||P d|| <= ||d||).
    estimate, prior = case
    if not has_direction(estimate.gram.numpy()) or not gate(estimate, prior, 1.0):
        return
    weights = mogo.GatedProjection(prior)(estimate, torch.ones(len(prior))).loss_weights
    nearest = torch.from_numpy(mogo.check_gram(estimate).host)
    assert bool((weights >= prior * (1 - 4 * EPS)).all())
    assert float(weights @ nearest @ weights) <= float(prior @ nearest @ prior) * (1 + 1e-9)


@given(problems(families=("gaussian", "conflicting", *DEGENERATE)), st.randoms())
def test_permuting_the_objectives_permutes_the_direction(problem, random):
    _, G = problem
    K = G.shape[0]
    order = list(range(K))
    random.shuffle(order)
    prior = torch.linspace(0.5, 1.5, K, dtype=torch.float64)
    w = mogo.GatedProjection(prior)(G, torch.ones(K)).loss_weights
    permuted = mogo.GatedProjection(prior[order])(G[order][:, order], torch.ones(K)).loss_weights
    back = permuted.new_zeros(K).index_copy(0, torch.tensor(order), permuted)
    assert direction_gap(G, w, back) <= 1e-6  # the weights need not be unique on degenerate G


def test_without_halves_the_gate_is_the_sign_of_the_same_batch_test():
    J = torch.tensor([[1.0, 0.0], [-2.0, 1.0]], dtype=torch.float64)
    G = J @ J.T
    assert mogo.GatedProjection().conflicts(mogo.check_gram(G), np.array([0.5, 0.5])).tolist() == [
        True,
        False,
    ]
    aligned = mogo.check_gram(torch.tensor([[1.0, 0.2], [0.2, 1.0]], dtype=torch.float64))
    assert not mogo.GatedProjection().conflicts(aligned, np.array([0.5, 0.5])).any()


def test_at_margin_one_the_gate_opens_when_both_halves_oppose_an_objective():
    # <d_1, g_2k> = (C^T w)_k and <d_2, g_1k> = (C w)_k; w = (1/2, 1/2)
    for cross, opens in (
        ([[1.0, -0.5], [-0.2, 0.1]], True),  # objective 2: -0.05 and -0.2, both negative
        ([[1.0, 0.5], [-0.8, 0.1]], False),  # objective 2: +0.3 and -0.35: the halves disagree
    ):
        cross = torch.tensor(cross, dtype=torch.float64)
        checked = mogo.check_gram(mogo.GramEstimate((cross + cross.T) / 2, cross))
        assert bool(mogo.GatedProjection().conflicts(checked, np.array([0.5, 0.5])).any()) == opens


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"margin": -1.0}, "margin must be a non-negative finite number, got -1.0"),
        ({"tol": 0.0}, "tol must be positive"),
        ({"weights": [1.0, -1.0]}, "weights must be finite and non-negative"),
    ],
)
def test_bad_options_are_refused_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mogo.GatedProjection(**kwargs)


def test_a_prior_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="WeightedSum has 3 weights for 2 objectives"):
        mogo.GatedProjection([1.0, 1.0, 1.0])(torch.eye(2, dtype=torch.float64), torch.ones(2))


# Through the optimizer --------------------------------------------------------------------------


def halves_losses(model: torch.nn.Module, seed: int, targets: torch.Tensor) -> torch.Tensor:
    """``(2, K)`` mean squared errors of a one-output model's two halves of 16 samples each,
    towards ``x @ targets`` (column k for objective k)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 4, generator=generator, dtype=torch.float64)
    errors = (model(x) - x @ targets) ** 2
    return torch.stack([errors[:16].mean(0), errors[16:].mean(0)])


def run(weighting: mogo.Weighting, targets: torch.Tensor, steps: int = 3) -> tuple[torch.nn.Module, list]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()  # one output: the objectives share every parameter
    opt = mogo.HarmonizedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        targets.shape[1],
        weighting=weighting,
        gram="cross_fitted",
    )
    reports = []
    for step in range(steps):
        opt.zero_grad()
        opt.backward(halves_losses(model, step, targets))
        opt.step()
        reports.append(opt.last_report)
    return model, reports


def test_through_the_optimizer_it_is_the_weighted_sum_bit_for_bit_where_nothing_conflicts():
    targets = torch.tensor([[1.0, 1.2], [1.0, 0.8], [0.5, 0.4], [0.0, 0.1]], dtype=torch.float64)  # aligned
    gated, reports = run(mogo.GatedProjection([1.0, 2.0]), targets)
    plain, _ = run(mogo.WeightedSum([1.0, 2.0]), targets)
    assert all(report.iterations == 0 for report in reports)  # the gate stayed closed
    for a, b in zip(gated.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)


def test_through_the_optimizer_an_open_gate_leaves_no_objective_opposed_in_the_estimate():
    targets = torch.tensor([[3.0, -3.0], [0.0, 0.2], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)  # opposed
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    opt = mogo.HarmonizedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), 2, weighting=mogo.GatedProjection(), gram="cross_fitted"
    )
    losses = halves_losses(model, 0, targets)
    params = list(model.parameters())
    first, second = (
        torch.stack(
            [
                torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params, retain_graph=True)])
                for loss in half
            ]
        )
        for half in losses
    )
    opt.backward(losses)
    report = opt.last_report
    assert report.iterations > 0  # the gate opened: the mean opposed an objective in both halves
    assert report.weighed == "estimate"
    cross = first @ second.T
    nearest = torch.from_numpy(mogo.check_gram(mogo.GramEstimate((cross + cross.T) / 2)).host)
    assert worst_opposition(nearest, report.loss_weights) <= 1e-12
    update = torch.cat([p.grad.reshape(-1) for p in params])
    expected = report.loss_weights @ ((first + second) / 2)
    assert float((update - expected).norm() / expected.norm()) <= 100 * first.shape[1] * EPS
