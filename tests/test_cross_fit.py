"""Cross-fitted Gram estimates from two halves of a batch: the estimate itself, its declaration
to the weightings, the optimizer's ``gram="cross_fitted"`` and the cross-batch diagnostics, and
the synthetic study's claims (known expected gradients, 5 % signal)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mogo
from mogo.cross_fit import batch_gram, estimate_of_halves
from mogo.testing import STUDY_BATCH, noise_study, planted_conflict

EPS = float(np.finfo(np.float64).eps)


# The estimate ----------------------------------------------------------------------------------


@st.composite
def halves_of_gradients(draw: st.DrawFn) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two halves' K float64 gradients over 1-3 parameters of random shapes."""
    K = draw(st.integers(1, 6))
    shapes = draw(st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=2), min_size=1, max_size=3))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    return tuple(
        [torch.randn(K, *shape, generator=generator, dtype=torch.float64) for shape in shapes]
        for _ in range(2)
    )


def flat(stacked: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(g.shape[0], -1) for g in stacked], dim=1)


@given(halves_of_gradients())
def test_the_estimate_is_the_symmetric_part_of_the_halves_cross_products(halves):
    first, second = halves
    J1, J2 = flat(first), flat(second)
    estimate = mogo.cross_fitted_gram(first, second)
    # float64 products of at most 50 terms: each entry errs by n eps ||g_k|| ||g_l|| at most
    bound = J1.shape[1] * EPS * J1.norm(dim=1)[:, None] * J2.norm(dim=1)[None, :]
    assert bool(((estimate.cross - J1 @ J2.T).abs() <= bound).all())
    torch.testing.assert_close(estimate.gram, (estimate.cross + estimate.cross.T) / 2, rtol=0, atol=0)


@given(halves_of_gradients())
def test_the_estimate_is_the_batch_gram_less_the_gram_of_the_halves_difference(halves):
    first, second = halves
    J1, J2 = flat(first), flat(second)
    batch, difference = (J1 + J2) / 2, (J1 - J2) / 2
    rows = torch.cat([J1, J2])
    halves_gram = rows @ rows.T
    expected = batch @ batch.T - difference @ difference.T
    size = float((J1.norm(dim=1).max() + J2.norm(dim=1).max()) ** 2)
    torch.testing.assert_close(estimate_of_halves(halves_gram).gram, expected, rtol=0, atol=64 * EPS * size)
    torch.testing.assert_close(batch_gram(halves_gram), batch @ batch.T, rtol=0, atol=64 * EPS * size)


def test_halves_of_different_parameters_are_refused():
    with pytest.raises(ValueError, match="the halves hold 2 and 1 parameters' gradients"):
        mogo.cross_fitted_gram([torch.ones(2, 3), torch.ones(2)], [torch.ones(2, 3)])


CROSS = torch.tensor([[1.0, 0.5], [0.3, -0.2]], dtype=torch.float64)


@pytest.mark.parametrize(
    ("cross", "error", "match"),
    [
        (CROSS.numpy(), TypeError, "GramEstimate.cross must be a torch.Tensor or None, got ndarray"),
        (
            torch.ones(3, 3),
            ValueError,
            r"cross must be a real tensor of the gram's shape \(2, 2\), got \(3, 3\)",
        ),
        (CROSS * float("nan"), ValueError, r"cross contains NaN or Inf: entry \(0, 0\) is nan"),
        (CROSS.T * 2, ValueError, "gram is not the symmetric part of GramEstimate.cross: they differ by 0.5"),
    ],
)
def test_a_cross_matrix_that_does_not_fit_its_estimate_is_refused_naming_the_fault(cross, error, match):
    with pytest.raises(error, match=match):
        mogo.check_gram(mogo.GramEstimate((CROSS + CROSS.T) / 2, cross))


def test_a_checked_estimate_keeps_the_estimate_and_the_cross_matrix_as_declared():
    checked = mogo.check_gram(mogo.GramEstimate((CROSS + CROSS.T) / 2, CROSS))
    np.testing.assert_array_equal(checked.estimate, ((CROSS + CROSS.T) / 2).numpy())
    np.testing.assert_array_equal(checked.cross, CROSS.numpy())
    assert np.linalg.eigvalsh(checked.host).min() >= 0  # the weighings' nearest Gram matrix
    plain = mogo.check_gram(CROSS @ CROSS.T)
    assert plain.estimate is None
    assert plain.cross is None


def test_weights_say_whether_they_are_of_the_gram_matrix_or_an_estimates_nearest_one():
    estimate = mogo.GramEstimate((CROSS + CROSS.T) / 2, CROSS)
    assert mogo.MinNorm()(CROSS @ CROSS.T, torch.ones(2)).weighed == "gram"
    assert mogo.MinNorm()(estimate, torch.ones(2)).weighed == "nearest_gram"
    assert mogo.UPGrad()(estimate, torch.ones(2)).weighed == "nearest_gram"


# Through the optimizer -------------------------------------------------------------------------


def mlp(seed: int = 0, outputs: int = 3) -> torch.nn.Module:
    """A float64 model: a cross-fitted estimate's small entries (an objective whose halves nearly
    cancel) are known to the float64 round-off of its products, not float32's."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, outputs)).double()


def halves_losses(model: torch.nn.Module, seed: int, K: int = 3) -> torch.Tensor:
    """``(2, K)``: the mean squared errors of the two halves (16 samples each) of one batch, on
    targets that depend on the inputs, so that the halves' gradients share a signal and the
    estimate is positive definite (its weights unique): the noise-dominated case is the
    synthetic problem's, below."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 5, generator=generator, dtype=torch.float64)
    mixing = torch.randn(5, K, generator=generator, dtype=torch.float64)
    y = 3 * torch.tanh(x @ mixing) + 0.1 * torch.randn(32, K, generator=generator, dtype=torch.float64)
    errors = (model(x) - y) ** 2
    return torch.stack([errors[:16].mean(0), errors[16:].mean(0)])


def jacobian(model: torch.nn.Module, losses: torch.Tensor) -> torch.Tensor:
    """Independent reference: one backward pass per loss, flattened to (K, P) float64."""
    rows = [torch.autograd.grad(loss, list(model.parameters()), retain_graph=True) for loss in losses]
    return torch.stack([torch.cat([g.reshape(-1) for g in row]) for row in rows]).double()


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def tolerance(J1: torch.Tensor, J2: torch.Tensor) -> float:
    """How closely the optimizer's update can match a reference from the same gradients: Gram
    entries err by about ``P eps ||g||^2`` (products of P float64 terms), which weights dividing
    by the estimated norms feel relative to the smallest squared norm the estimate's nearest
    Gram matrix keeps; a factor 100 for the solvers' conditioning."""
    cross = J1 @ J2.T
    kept = mogo.check_gram(mogo.GramEstimate((cross + cross.T) / 2)).host.diagonal()
    largest = float(torch.cat([J1, J2]).norm(dim=1).max()) ** 2
    return 100 * J1.shape[1] * EPS * largest / max(float(kept.min()), EPS * largest)


def cross_fitted_optimizer(
    model: torch.nn.Module, weighting: mogo.Weighting, **options
) -> mogo.HarmonizedOptimizer:
    return mogo.HarmonizedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        ["a", "b", "c"],
        weighting=weighting,
        gram="cross_fitted",
        **options,
    )


WEIGHTINGS = {
    "upgrad": mogo.UPGrad,
    "min_norm": mogo.MinNorm,
    "weighted_sum": lambda: mogo.WeightedSum([1, 2, 3]),
}


@pytest.mark.parametrize("name", sorted(WEIGHTINGS))
@given(seed=st.integers(0, 10_000))
def test_a_cross_fitted_step_weighs_the_halves_estimate_and_updates_with_the_batch_gradient(name, seed):
    model = mlp(seed)
    opt = cross_fitted_optimizer(model, WEIGHTINGS[name]())
    losses = halves_losses(model, seed)
    J1, J2 = jacobian(model, losses[0]), jacobian(model, losses[1])
    opt.backward(losses)
    cross = J1 @ J2.T
    reference = WEIGHTINGS[name]()(
        mogo.GramEstimate((cross + cross.T) / 2, cross), losses.detach().mean(0).double()
    )
    # float32 gradients (relative error ~1e-6 in the Gram matrix and the update)
    assert relative_gap(flat_grad(model), reference.loss_weights @ ((J1 + J2) / 2)) <= tolerance(J1, J2)
    report = opt.last_report
    assert report.weighed == "nearest_gram"
    batch = (J1 + J2) / 2
    torch.testing.assert_close(report.norms, batch.norm(dim=1), rtol=100 * batch.shape[1] * EPS, atol=0)


def test_an_amortized_cross_fitted_step_backpropagates_the_weights_through_the_batch_losses():
    model = mlp(1)
    opt = cross_fitted_optimizer(model, mogo.UPGrad(), harmonize_every=2)
    for step in range(2):
        opt.zero_grad()
        losses = halves_losses(model, step)
        batch = jacobian(model, losses.mean(0))
        harmonizing = opt.amortizer.due
        opt.backward(losses)
        if not harmonizing:
            weights = opt.amortizer.loss_weights()
            expected = weights @ batch
            # the same sum formed by autograd: round-off of P-term sums, relative to its terms
            size = float((weights.abs() * batch.norm(dim=1)).sum() / expected.norm())
            assert relative_gap(flat_grad(model), expected) <= 100 * batch.shape[1] * EPS * size
        opt.step()
    assert opt.meter.steps == 1
    assert opt.meter.cross_batch_steps == 1


def test_the_cross_fitted_option_weighs_something_else_than_the_batch_gram():
    # the same data through both options: the weights differ (the estimate leaves out the noise)
    weights = {}
    for gram in ("same_batch", "cross_fitted"):
        model = mlp(4)
        opt = mogo.HarmonizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), 3, gram=gram)
        losses = halves_losses(model, 4)
        opt.backward(losses if gram == "cross_fitted" else losses.mean(0))
        weights[gram] = opt.last_report.loss_weights
    assert float((weights["same_batch"] - weights["cross_fitted"]).abs().max()) > 1e-3


@pytest.mark.parametrize(
    ("gram", "losses", "match"),
    [
        ("cross_fitted", torch.ones(3), r"shape \(2, 3\) \(two halves' losses, gram='cross_fitted'\)"),
        ("cross_fitted", torch.ones(3, 3), r"got \(3, 3\)"),
        ("same_batch", torch.ones(2, 3), r"shape \(3,\) for objectives"),
    ],
)
def test_losses_of_the_wrong_shape_for_the_option_are_refused(gram, losses, match):
    opt = mogo.HarmonizedOptimizer(torch.optim.SGD(mlp().parameters(), lr=0.1), 3, gram=gram)
    with pytest.raises(ValueError, match=match):
        opt.backward(losses)


def test_an_unknown_gram_option_is_refused():
    with pytest.raises(ValueError, match="gram must be 'same_batch' or 'cross_fitted', got 'cross'"):
        mogo.HarmonizedOptimizer(torch.optim.SGD(mlp().parameters(), lr=0.1), 3, gram="cross")


def nan_in_half(losses: torch.Tensor, half: int, objective: int) -> torch.Tensor:
    mask = torch.zeros_like(losses, dtype=torch.bool)
    mask[half, objective] = True
    return torch.where(mask, float("nan"), losses)


@pytest.mark.parametrize("half", [0, 1])
def test_a_nan_in_one_half_drops_that_objective_from_both(half):
    model = mlp(2)
    opt = cross_fitted_optimizer(model, mogo.UPGrad(), nonfinite="drop")
    losses = halves_losses(model, 2)
    J1, J2 = jacobian(model, losses[0, [0, 2]]), jacobian(model, losses[1, [0, 2]])
    opt.backward(nan_in_half(losses, half, 1))
    cross = J1 @ J2.T
    reference = mogo.UPGrad()(mogo.GramEstimate((cross + cross.T) / 2, cross), torch.ones(2))
    assert opt.last_report.names == ("a", "c")
    assert relative_gap(flat_grad(model), reference.loss_weights @ ((J1 + J2) / 2)) <= tolerance(J1, J2)


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_nan_in_one_half_follows_the_policy_for_the_objective(policy):
    model = mlp(2)
    opt = cross_fitted_optimizer(model, mogo.UPGrad(), nonfinite=policy)
    before = [p.detach().clone() for p in model.parameters()]
    losses = nan_in_half(halves_losses(model, 2), 1, 2)
    if policy == "raise":
        with pytest.raises(FloatingPointError, match=r"non-finite loss for objective\(s\) \['c'\]"):
            opt.backward(losses)
    else:
        opt.backward(losses)
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_a_window_solves_on_each_halfs_gradients_summed_over_its_micro_batches():
    model = mlp(5)
    opt = cross_fitted_optimizer(model, mogo.UPGrad(), accumulation="window")
    opt.zero_grad()
    J1 = J2 = 0
    for seed in (5, 6):
        losses = halves_losses(model, seed)
        J1, J2 = J1 + jacobian(model, losses[0]), J2 + jacobian(model, losses[1])
        opt.backward(losses)
    opt.harmonize()
    cross = J1 @ J2.T
    reference = mogo.UPGrad()(mogo.GramEstimate((cross + cross.T) / 2, cross), torch.ones(3))
    assert relative_gap(flat_grad(model), reference.loss_weights @ ((J1 + J2) / 2)) <= tolerance(J1, J2)


def test_a_cross_fitted_run_resumes_bit_identically():
    def run(steps, model=None, opt=None):
        if model is None:
            model = mlp(6)
            opt = mogo.HarmonizedOptimizer(
                torch.optim.Adam(model.parameters(), lr=1e-2),
                3,
                harmonize_every=2,
                alpha_ema=0.5,
                gram="cross_fitted",
            )
        for _ in range(steps):
            opt.zero_grad()
            opt.backward(halves_losses(model, 100 + opt.amortizer.step))
            opt.step()
        return model, opt

    straight, _ = run(5)
    model, opt = run(3)
    saved = copy.deepcopy(opt.state_dict())
    resumed_model = mlp(6)
    resumed_model.load_state_dict(model.state_dict())
    resumed_opt = mogo.HarmonizedOptimizer(
        torch.optim.Adam(resumed_model.parameters(), lr=1e-2), 3, harmonize_every=2, gram="cross_fitted"
    )
    resumed_opt.load_state_dict(saved)
    run(2, resumed_model, resumed_opt)
    for a, b in zip(straight.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_an_estimate_without_signal_takes_a_reported_no_op_step():
    # Two objectives whose halves' gradients are exactly opposite: the estimate is -(its batch
    # Gram matrix's noise), negative definite, so no direction shows above the noise.
    w = torch.nn.Parameter(torch.zeros(4))
    a, b = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0, 0.0])
    opt = mogo.HarmonizedOptimizer(torch.optim.SGD([w], lr=0.1), 2, gram="cross_fitted")
    opt.backward(torch.stack([torch.stack([w @ a, w @ b]), torch.stack([-(w @ a), -(w @ b)])]))
    assert torch.equal(w.grad, torch.zeros(4))
    assert torch.equal(opt.last_report.loss_weights, torch.zeros(2, dtype=torch.float64))
    assert opt.meter.steps == 0
    assert opt.amortizer.due


# Diagnostics -------------------------------------------------------------------------------------


def cross_batch_cosine(J1: torch.Tensor, J2: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Independent reference of the module's definition, from the gradients themselves."""
    d1, d2 = c @ J1, c @ J2
    inner = (J2 @ d1 + J1 @ d2) / 2
    return inner / ((d1.norm() * J2.norm(dim=1) + d2.norm() * J1.norm(dim=1)) / 2)


def test_the_report_measures_conflict_across_the_halves_as_defined():
    model = mlp(7)
    opt = cross_fitted_optimizer(model, mogo.UPGrad(), sum_weights=[1.0, 2.0, 0.5])
    losses = halves_losses(model, 7)
    J1, J2 = jacobian(model, losses[0]), jacobian(model, losses[1])
    opt.backward(losses)
    report = opt.last_report
    baseline = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    atol = 100 * J1.shape[1] * EPS  # cosines of float64 products of P terms
    torch.testing.assert_close(
        report.cross_batch_weighted_sum_cosines, cross_batch_cosine(J1, J2, baseline), rtol=0, atol=atol
    )
    torch.testing.assert_close(
        report.cross_batch_harmonized_cosines,
        cross_batch_cosine(J1, J2, report.loss_weights),
        rtol=0,
        atol=atol,
    )
    values = report.as_dict()
    assert values["mogo/cos_weighted_sum_cross/b"] == float(report.cross_batch_weighted_sum_cosines[1])
    assert values["mogo/conflict_cross"] == float(report.cross_batch_conflict)
    assert opt.meter.worst_cross_batch_weighted_sum_cosine == float(
        report.cross_batch_weighted_sum_cosines.min()
    )


@given(halves_of_gradients(), st.lists(st.floats(0, 10), min_size=6, max_size=6))
def test_cross_batch_cosines_are_cosines(halves, coefficients):
    first, second = (flat(h) for h in halves)
    K = first.shape[0]
    rows = torch.cat([first, second])
    c = torch.tensor(coefficients[:K], dtype=torch.float64)
    weights = mogo.Weights.from_combination(c if float(c.sum()) > 0 else torch.ones(K, dtype=torch.float64))
    report = mogo.ConflictReport.from_halves(rows @ rows.T, weights, tuple("abcdef"[:K]))
    for cosines in (report.cross_batch_weighted_sum_cosines, report.cross_batch_harmonized_cosines):
        assert bool((cosines.abs() <= 1 + 8 * EPS).all())


def test_a_report_of_one_batch_has_no_cross_batch_measures():
    model = mlp(8)
    opt = mogo.HarmonizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 3)
    opt.backward(halves_losses(model, 8).mean(0))
    assert opt.last_report.cross_batch_conflict is None
    assert not any("cross" in key for key in opt.last_report.as_dict())
    assert opt.meter.cross_batch_steps == 0
    assert opt.meter.steps == 1


def test_a_meter_state_from_before_the_cross_batch_statistics_loads():
    meter = mogo.ConflictMeter(steps=4, conflicts=1, worst_weighted_sum_cosine=-0.2)
    older = {k: v for k, v in meter.state_dict().items() if "cross" not in k}
    loaded = mogo.ConflictMeter(cross_batch_steps=3)
    loaded.load_state_dict(older)
    assert loaded == meter
    partial = {**older, "cross_batch_steps": 1}  # some but not all of them: a bad state
    with pytest.raises(ValueError, match="cross_batch_conflicts: missing"):
        loaded.load_state_dict(partial)
    with pytest.raises(ValueError, match="cross_batch_conflicts: 5 is more than the 1 steps"):
        loaded.load_state_dict({**meter.state_dict(), "cross_batch_steps": 1, "cross_batch_conflicts": 5})


# The synthetic study (benchmarks/noisy_gram.py runs it at length) -----------------------------------

BATCH = STUDY_BATCH  # samples per batch; the expected gradients hold 5 % of a batch gradient's squared norm


def test_the_cross_fitted_error_falls_as_one_over_the_samples_and_the_same_batch_bias_stays():
    problem, rng = noise_study(), np.random.default_rng(0)
    true, bias = problem.gram, problem.noise_gram(BATCH)
    assert np.allclose(np.diagonal(bias), 19 * np.diagonal(true))  # 5 % signal: the noise is 19x
    errors = {}
    for batches, draws in ((1, 400), (16, 100)):
        estimates = [problem.averaged_grams(rng, batches, BATCH) for _ in range(draws)]
        errors[batches] = {
            "same": np.array([same - true for same, _ in estimates]),
            "cross": np.array([cross - true for _, cross in estimates]),
        }

    def mean_and_error(values: np.ndarray) -> tuple[float, float]:  # the mean, and 4 standard errors
        return float(values.mean()), 4 * float(values.std(ddof=1)) / np.sqrt(len(values))

    for error in errors.values():
        diagonal = np.diagonal(error["cross"], axis1=1, axis2=2) / np.diagonal(true)
        mean, margin = mean_and_error(diagonal.mean(axis=1))
        assert abs(mean) <= margin  # unbiased, whatever the number of batches averaged
        diagonal = np.diagonal(error["same"], axis1=1, axis2=2) / np.diagonal(true)
        mean, margin = mean_and_error(diagonal.mean(axis=1))
        assert abs(mean - 19) <= margin  # the noise's 19x, which averaging batches keeps
    # E ||mean of n unbiased iid estimates - G||^2 = E ||one - G||^2 / n
    squared = {n: (e["cross"] ** 2).sum(axis=(1, 2)) for n, e in errors.items()}
    ratio = 16 * squared[16].mean() / squared[1].mean()
    relative = np.sqrt(sum(s.var(ddof=1) / len(s) / s.mean() ** 2 for s in squared.values()))
    assert abs(ratio - 1) <= 4 * relative


def test_min_norm_weights_of_the_averaged_estimate_approach_the_true_ones_and_the_same_batch_ones_do_not():
    problem, rng = noise_study(), np.random.default_rng(2)
    weighting = mogo.MinNorm()

    def alpha(G: np.ndarray | mogo.GramEstimate) -> np.ndarray:
        G = G if isinstance(G, mogo.GramEstimate) else torch.from_numpy(G)
        return weighting(G, torch.ones(3)).alpha.numpy()

    true = alpha(problem.gram)
    biased = alpha(problem.gram + problem.noise_gram(BATCH))  # where the same-batch average tends
    gap = np.abs(true - biased).max()
    assert gap > 0.2  # the noise's shape (objective 3's advantages correlate least) moves them
    same, cross = problem.averaged_grams(rng, 256, BATCH)
    assert np.abs(alpha(mogo.GramEstimate(torch.from_numpy(cross))) - true).max() <= gap / 4
    assert np.abs(alpha(same) - biased).max() <= gap / 4


def test_the_cross_batch_conflict_rate_recovers_a_planted_conflict_the_same_batch_rate_misses():
    problem, rng = planted_conflict(), np.random.default_rng(4)
    mean = problem.expected.mean(axis=0)
    assert (problem.expected @ mean)[2] < -0.2  # the weighted sum opposes objective 3 on every batch
    meter = mogo.ConflictMeter()
    weights = mogo.WeightedSum([1.0, 1.0, 1.0])(torch.from_numpy(problem.gram), torch.ones(3))
    for _ in range(200):
        rows = np.vstack(problem.halves(rng, BATCH))
        meter.update(
            mogo.ConflictReport.from_halves(torch.from_numpy(rows @ rows.T), weights, ("a", "b", "c"))
        )
    # On one batch <d_ws, g_3> holds (1/3) E<n_1 + n_2 + n_3, n_3> = 19 (0.3 + 0.3 + 1) / 3 = 10 of
    # noise, 40 times the conflict, with a spread of about 2 over batches: never negative. Across
    # the halves that term is gone: -0.25 with a spread of about 0.5 over batches, negative in
    # about 70 % (200 batches: a binomial standard error of 0.03).
    assert meter.conflict_rate <= 0.02
    assert meter.cross_batch_conflict_rate >= 0.5
