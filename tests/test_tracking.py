"""Per-objective gradient tracking (MoCo): the weighting weighs the Gram matrix of an EMA of each
objective's gradient, the update applies its weights to the step's own gradients."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import Tensor

import mogo
from mogo.gram import CheckedGram
from mogo.testing import NoisyObjectives

EPS = float(np.finfo(np.float64).eps)


class Recorded(mogo.CheckedWeighting):
    """UPGrad that keeps the checked Gram matrices it was given."""

    def __init__(self) -> None:
        self.seen: list[CheckedGram] = []
        self.upgrad = mogo.UPGrad()

    def weigh(self, gram: CheckedGram, losses: Tensor) -> mogo.Weights:
        self.seen.append(gram)
        return self.upgrad.weigh(gram, losses)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


TARGETS = torch.tensor(
    [[1.0, -1.0, 0.5], [0.5, 0.5, -1.0], [0.0, 1.0, 0.2], [0.3, 0.0, 0.0]], dtype=torch.float64
)


def losses_of(net: torch.nn.Module, step: int, halves: bool = False) -> Tensor:
    """Three objectives of a one-output model on a fresh batch of 16 (two halves of 8)."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(16, 4, generator=generator, dtype=torch.float64)
    errors = (net(x) - x @ TARGETS - torch.randn(16, 3, generator=generator, dtype=torch.float64)) ** 2
    return torch.stack([errors[:8].mean(0), errors[8:].mean(0)]) if halves else errors.mean(0)


def jacobian(net: torch.nn.Module, losses: Tensor) -> Tensor:
    params = list(net.parameters())
    rows = [torch.autograd.grad(loss, params, retain_graph=True) for loss in losses]
    return torch.stack([torch.cat([g.reshape(-1) for g in row]) for row in rows])


def flat_grad(net: torch.nn.Module) -> Tensor:
    return torch.cat([p.grad.reshape(-1) for p in net.parameters()])


def assert_gram(checked: np.ndarray, expected: Tensor) -> None:
    # float64 products of P terms: each entry within P eps of the largest squared norm
    size = float(expected.diagonal().max())
    torch.testing.assert_close(torch.from_numpy(checked), expected, rtol=0, atol=100 * 33 * EPS * size)


@pytest.mark.parametrize("harmonize_every", [1, 2])
def test_the_weighting_weighs_the_ema_of_each_gradient_and_the_update_uses_the_steps_own(harmonize_every):
    net, weighting = model(), Recorded()
    opt = mogo.HarmonizedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.05),
        3,
        weighting=weighting,
        grad_ema=0.8,
        harmonize_every=harmonize_every,
    )
    tracked = None
    for step in range(5):
        opt.zero_grad()
        losses = losses_of(net, step)
        J = jacobian(net, losses)
        harmonizing = opt.amortizer.due
        opt.backward(losses)
        if harmonizing:
            tracked = J if tracked is None else 0.8 * tracked + 0.2 * J  # from the first gradient on
            assert_gram(weighting.seen[-1].host, tracked @ tracked.T)
            expected = opt.last_report.loss_weights @ J
            assert float((flat_grad(net) - expected).norm() / expected.norm()) <= 100 * J.shape[1] * EPS
        opt.step()
    assert len(weighting.seen) == (5 if harmonize_every == 1 else 3)


def test_with_two_halves_each_half_is_tracked_apart():
    net, weighting = model(), Recorded()
    opt = mogo.HarmonizedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.05), 3, weighting=weighting, grad_ema=0.5, gram="cross_fitted"
    )
    first = second = None
    for step in range(3):
        opt.zero_grad()
        losses = losses_of(net, step, halves=True)
        J1, J2 = jacobian(net, losses[0]), jacobian(net, losses[1])
        first = J1 if first is None else 0.5 * first + 0.5 * J1
        second = J2 if second is None else 0.5 * second + 0.5 * J2
        opt.backward(losses)
        cross = first @ second.T
        assert_gram(weighting.seen[-1].estimate, (cross + cross.T) / 2)
        opt.step()


def test_a_dropped_objective_keeps_its_ema_until_it_comes_back():
    net = model()
    tracker = mogo.tracking.GradientTracker(0.5)
    opt = mogo.HarmonizedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.0), 3, grad_ema=0.5, nonfinite="drop"
    )
    opt.tracker = tracker
    Js = []
    for step in range(3):
        opt.zero_grad()
        losses = losses_of(net, step)
        Js.append(jacobian(net, losses))
        if step == 1:
            losses = torch.where(torch.tensor([False, True, False]), float("nan"), losses)
        opt.backward(losses)
        opt.step()
    rows = torch.cat([row.reshape(3, -1) for row in opt.tracker.rows], dim=1)
    ema = [Js[0], 0.5 * Js[0] + 0.5 * Js[1], 0.5 * (0.5 * Js[0] + 0.5 * Js[1]) + 0.5 * Js[2]]
    expected = torch.stack([ema[2][0], 0.5 * Js[0][1] + 0.5 * Js[2][1], ema[2][2]])  # lr 0: one model
    torch.testing.assert_close(rows, expected, rtol=0, atol=100 * EPS * float(expected.abs().max()))


def train(opt: mogo.HarmonizedOptimizer, net: torch.nn.Module, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        opt.backward(losses_of(net, step))
        opt.step()


def tracking_optimizer(net: torch.nn.Module, **options) -> mogo.HarmonizedOptimizer:
    return mogo.HarmonizedOptimizer(torch.optim.Adam(net.parameters(), lr=0.01), 3, grad_ema=0.9, **options)


def test_the_ema_is_part_of_the_state_and_a_resumed_run_continues_bit_for_bit():
    straight = model()
    train(tracking_optimizer(straight), straight, range(5))
    net = model()
    opt = tracking_optimizer(net)
    train(opt, net, range(3))
    saved = copy.deepcopy(opt.state_dict())
    assert len(saved["mogo"]["tracker"]["rows"]) == len(list(net.parameters()))
    resumed_net = model()
    resumed_net.load_state_dict(net.state_dict())
    resumed = tracking_optimizer(resumed_net)
    resumed.load_state_dict(saved)
    train(resumed, resumed_net, range(3, 5))
    for a, b in zip(straight.parameters(), resumed_net.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda s: s["mogo"].pop("tracker"), "mogo.tracker: missing"),
        (
            lambda s: s["mogo"]["tracker"].update(seen=[True]),
            r"mogo.tracker.seen: must be a \(R,\) bool tensor",
        ),
        (
            lambda s: s["mogo"]["tracker"]["rows"].pop(),
            "mogo.tracker.rows: must be a list of 4 tensors or None",
        ),
        (
            lambda s: s["mogo"]["tracker"]["rows"][0].fill_(float("nan")),
            "mogo.tracker.rows.0: must be None or a finite",
        ),
    ],
)
def test_a_bad_tracker_state_is_refused_naming_the_field_and_nothing_changes(change, match):
    net = model()
    opt = tracking_optimizer(net)
    train(opt, net, range(2))
    saved = copy.deepcopy(opt.state_dict())
    change(saved)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(saved)
    for a, b in zip(opt.tracker.rows, before["mogo"]["tracker"]["rows"], strict=True):
        assert torch.equal(a, b)


def test_a_state_with_a_tracker_is_refused_by_an_optimizer_without_one():
    net = model()
    opt = tracking_optimizer(net)
    train(opt, net, range(1))
    plain = mogo.HarmonizedOptimizer(torch.optim.Adam(model().parameters(), lr=0.01), 3)
    with pytest.raises(ValueError, match=r"mogo\.tracker: unexpected"):
        plain.load_state_dict(opt.state_dict())


def test_a_skipped_step_returns_the_ema_to_what_it_was():
    net = model()
    opt = tracking_optimizer(net, nonfinite="skip")
    train(opt, net, range(2))
    before = copy.deepcopy(opt.tracker.state_dict())
    opt.zero_grad()
    opt.backward(losses_of(net, 2))  # harmonizes: a new EMA
    opt.backward(losses_of(net, 3) * float("nan"))
    opt.step()
    for a, b in zip(opt.tracker.rows, before["rows"], strict=True):
        assert torch.equal(a, b)


def test_only_the_harmonized_parameters_are_tracked():
    net = model()
    head = list(net[2].parameters())
    opt = mogo.HarmonizedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05), 3, params=head, grad_ema=0.5)
    train(opt, net, range(1))
    trunk = len(list(net[0].parameters()))
    assert opt.tracker.rows[:trunk] == [None] * trunk
    assert [tuple(r.shape) for r in opt.tracker.rows[trunk:]] == [(3, *p.shape) for p in head]


@pytest.mark.parametrize("bad", [1.0, -0.1, True, "0.5"])
def test_a_decay_outside_zero_to_one_is_refused(bad):
    with pytest.raises(ValueError, match="grad_ema must be in \\[0, 1\\)"):
        mogo.HarmonizedOptimizer(torch.optim.SGD(model().parameters(), lr=0.1), 3, grad_ema=bad)


def test_tracking_takes_the_noise_off_the_diagonal_as_it_averages_more_steps():
    # The EMA of iid noise keeps (1 - beta) / (1 + beta) of its variance: the diagonal bias of the
    # tracked Gram matrix is that fraction of one batch's (19x the signal at 5 %), for fixed
    # expected gradients (a stationary problem, as between two slow parameter changes).
    rng = np.random.default_rng(0)
    expected = np.linalg.qr(rng.standard_normal((500, 3)))[0].T
    problem = NoisyObjectives.with_signal_fraction(expected, np.eye(3), 0.05, 64)
    beta, biases = 0.9, []
    for _ in range(40):
        tracker = mogo.tracking.GradientTracker(beta)
        present = torch.ones(3, dtype=torch.bool)
        for _ in range(60):  # 60 steps: the start's weight beta^60 is below 0.2 %
            (rows,) = tracker.update([torch.from_numpy(problem.batch(rng, 64))], present)
        biases.append(np.diagonal(rows.numpy() @ rows.numpy().T).mean() - 1)
    predicted = 19 * (1 - beta) / (1 + beta)  # 1.0
    margin = 4 * np.std(biases, ddof=1) / np.sqrt(len(biases)) + 19 * beta**60
    assert abs(np.mean(biases) - predicted) <= margin
