"""The conflict-aware weightings against TorchJD's implementations of the same methods, their
defining properties, and their use through HarmonizedOptimizer.

Every comparison with TorchJD is like with like: where TorchJD changes the problem (UPGrad's
``reg_eps``/``norm_eps``), ours is given the same changed problem; where TorchJD's answer is
inexact, its own certificate says so, and ours must then be certified exact instead.
"""

from __future__ import annotations

import copy
import sys
import warnings

import numpy as np
import pytest
import torch
import torchjd.aggregation as torchjd_aggregation
from hypothesis import given, settings
from hypothesis import strategies as st
from qpsolvers.exceptions import ProblemError  # quadprog's refusal
from torchjd.linalg import QuadprogProjector

import mogo
from mogo.cagrad import cagrad_weights
from mogo.testing import FAMILIES, assert_min_norm_optimal, gradient_family

EPS = float(np.finfo(np.float64).eps)
SIZES = [2, 3, 5, 10, 32]
DEGENERATE = ("low_rank", "K_above_dim", "duplicates", "opposite", "zero", "collinear", "norm_ratio_1e12")


@st.composite
def problems(draw: st.DrawFn, families: tuple[str, ...] = tuple(sorted(FAMILIES)), sizes=tuple(SIZES)):
    """``(J, G)``: K gradients of a family (random or degenerate), scaled by 1e-12..1e12."""
    family = draw(st.sampled_from(families))
    K = draw(st.sampled_from(sizes))
    dim = draw(st.integers(1, 64))
    scale = 10.0 ** draw(st.integers(-12, 12))
    return gradient_family(family, K, dim=dim, scale=scale, seed=draw(st.integers(0, 2**31 - 1)))


def direction_gap(G: torch.Tensor, w: torch.Tensor, reference: torch.Tensor) -> float:
    """``||J^T (w - r)||`` relative to ``sum_k (|w_k| + |r_k|) ||g_k|| / 2``, the size of the sums that
    form the two directions (and the scale of their round-off), from the Gram matrix alone."""
    delta = (w - reference).to(torch.float64)
    norms = G.diagonal().clamp_min(0).sqrt()
    size = float(((w.abs() + reference.abs()) * norms).sum()) / 2
    return float((delta @ G @ delta).clamp_min(0).sqrt()) / size if size > 0 else 0.0


def worst_opposition(G: torch.Tensor, w: torch.Tensor, active: torch.Tensor | None = None) -> float:
    """The most negative ``<g_k, d>`` for ``d = J^T w``, relative to ``||g_k|| sum_j |w_j| ||g_j||``."""
    norms = G.diagonal().clamp_min(0).sqrt()
    size = float((w.abs() * norms).sum())
    inner = (G @ w) / (norms * size).clamp_min(1e-300)
    if active is not None:
        inner = inner[active]
    return float((-inner).max().clamp_min(0))


def unit_dual_cone_kkt(G: torch.Tensor, V: torch.Tensor) -> float:
    """Independent KKT residual of projections ``V`` (K, K) of ``e_1..e_K`` (``v >= e_i``,
    ``G v >= 0``, equality where ``v_j > u_j``), in unit-gradient coordinates, relative to
    ``||u||_1 + ||v - u||_1``. ``inf`` when a bound is violated."""
    K = G.shape[0]
    U = torch.eye(K, dtype=torch.float64)
    if bool((V < U - 1e-9).any()):
        return float("inf")
    norms = G.diagonal().clamp_min(0).sqrt()
    D = torch.where(norms > 0, norms, torch.ones_like(norms))
    unit = G / (D[:, None] * D[None, :])
    hat, u_hat = V * D, U * D
    g = hat @ unit
    violation = torch.where(hat > u_hat + 1e-9 * u_hat.abs().sum(-1, keepdim=True), g.abs(), -g)
    size = u_hat.abs().sum(-1) + (hat - u_hat).abs().sum(-1)
    return float((violation.max(-1).values.clamp_min(0) / size).max())


def cagrad_objective(G: np.ndarray, w: np.ndarray, c: float) -> tuple[float, float]:
    """``F(w) = b^T w + rho ||g_w||`` and its Frank-Wolfe gap, both over ``||g0|| max_k ||g_k||``."""
    K = len(G)
    G = G / np.diagonal(G).max()
    b = G @ np.full(K, 1.0 / K)
    g0 = np.sqrt(max(b.mean(), 0.0))
    rho = c * g0
    g_w = np.sqrt(max(w @ G @ w, 0.0))
    grad = b + rho * (G @ w) / g_w
    return (b @ w + rho * g_w) / g0, (w @ grad - grad.min()) / g0


def nash_residual(G: torch.Tensor, alpha: torch.Tensor) -> float:
    return float((alpha * (G @ alpha) - 1).abs().max())


def retained_condition(G: torch.Tensor) -> float:
    """Condition number of G on its numerical range (eigenvalues above K eps lambda_max)."""
    values = torch.linalg.eigvalsh(G)
    kept = values[values > G.shape[0] * EPS * values.max()]
    return float(kept.max() / kept.min()) if len(kept) else 1.0


def torchjd_answer(name: str, J: torch.Tensor, G: torch.Tensor, seed: int) -> torch.Tensor | None:
    """TorchJD's weights for the method (its defaults, but UPGrad without the regularisation that
    changes the problem, see the test of that below), or None where it raises."""
    K = G.shape[0]
    try:
        if name == "upgrad":  # its K projections, (K, K)
            return QuadprogProjector(norm_eps=0.0, reg_eps=0.0)(torch.eye(K, dtype=torch.float64), G)
        if name == "pcgrad":
            state = torch.get_rng_state()
            try:
                torch.manual_seed(seed)  # TorchJD draws from the global RNG
                return torchjd_aggregation.PCGradWeighting()(G)
            finally:
                torch.set_rng_state(state)
        if name == "nash_mtl":  # a weighting of the Jacobian
            return torchjd_aggregation.NashMTL(n_tasks=K, max_norm=0.0).weighting(J).to(torch.float64)
        weighting = {
            "mgda": torchjd_aggregation.MGDAWeighting,
            "cagrad": lambda: torchjd_aggregation.CAGradWeighting(0.5),
            "imtl_g": torchjd_aggregation.IMTLGWeighting,
            "aligned_mtl": torchjd_aggregation.AlignedMTLWeighting,
        }[name]()
        return weighting(G)
    except (ValueError, ProblemError, ArithmeticError):
        return None


def torchjd_certified(name: str, G: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Whether TorchJD's answer is accurate to about 1e-6, by a certificate that needs no reference."""
    K = G.shape[0]
    if not bool(torch.isfinite(theirs).all()):
        return False
    if name == "upgrad":
        return unit_dual_cone_kkt(G, theirs) <= 1e-9
    if name == "mgda":  # ||d' - d*||^2 <= f(w') - f* <= 2 gap max_i G_ii
        g = G @ theirs
        return bool(theirs.min() >= 0) and float(theirs @ g - g.min()) <= 1e-13 * float(G.diagonal().max())
    if name == "cagrad":
        lam_w = theirs.numpy() - 1.0 / K
        if not lam_w.sum() > 0:
            return False  # TorchJD declared g_w* = 0 (its norm_eps test)
        return cagrad_objective(G.numpy(), np.clip(lam_w / lam_w.sum(), 0, None), 0.5)[1] <= 1e-12
    if name == "nash_mtl":
        return nash_residual(G, theirs) <= 1e-8
    if name in ("imtl_g", "aligned_mtl"):  # closed forms: accurate where G is well conditioned
        return retained_condition(G) <= 1e6 and bool(theirs.abs().sum() > 0)
    return True  # PCGrad: the same arithmetic


# Like with like: TorchJD keeps every non-zero gradient (rtol=0) and does not clip Nash-MTL.
OPTIONS = {"upgrad": {"rtol": 0.0}, "cagrad": {"c": 0.5}, "nash_mtl": {"max_norm": 0.0, "rtol": 0.0}}


def ours(name: str, G: torch.Tensor, seed: int) -> mogo.Weights:
    options = {"seed": seed} if name == "pcgrad" else OPTIONS.get(name, {})
    return mogo.make_weighting(name, **options)(G, torch.ones(G.shape[0], dtype=torch.float64))


def classify(name: str, J: torch.Tensor, G: torch.Tensor, seed: int) -> str:
    """``"agree"`` (TorchJD certified, directions within 1e-6), ``"differ"``, ``"inexact"`` (TorchJD
    not certified) or ``"failed"`` (TorchJD raised)."""
    theirs = torchjd_answer(name, J, G, seed)
    if theirs is None:
        return "failed"
    if not torchjd_certified(name, G, theirs):
        return "inexact"
    w = ours(name, G, seed).loss_weights
    if name == "mgda":  # its contract is relative to the largest gradient (see torchjd_certified)
        delta = w - theirs
        gap = float((delta @ G @ delta).clamp_min(0).sqrt()) / float(G.diagonal().max().sqrt())
    else:
        gap = direction_gap(G, w, theirs.mean(0) if name == "upgrad" else theirs)
    return "agree" if gap <= 1e-6 else "differ"


def certified(name: str, G: torch.Tensor) -> bool:
    """Whether our answer carries a passing certificate (closed forms: by construction)."""
    weights = ours(name, G, 0)
    if isinstance(weights.solve, mogo.MinNormResult):
        return weights.solve.status == "success"
    return weights.solve is None or weights.solve.status == "success"


COMPARED = ["upgrad", "mgda", "cagrad", "imtl_g", "aligned_mtl", "pcgrad"]


@pytest.mark.parametrize("name", COMPARED)
@given(problem=problems(), seed=st.integers(0, 2**31 - 1))
def test_no_weighting_differs_from_torchjd_where_torchjd_is_certified(name, problem, seed):
    J, G = problem
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert classify(name, J, G, seed) != "differ"
    assert certified(name, G)


# UPGrad ---------------------------------------------------------------------------------------


@given(problems())
def test_upgrad_equals_torchjd_default_on_the_gram_matrix_it_regularises(problem):
    _, G = problem
    K = G.shape[0]
    trace = float(G.diagonal().sum())
    if trace < 1e-4:  # TorchJD's norm_eps: it replaces G by 0 and returns the mean
        return
    regularised = G / trace + 1e-4 * torch.eye(K, dtype=torch.float64)  # what TorchJD solves on
    theirs = torchjd_aggregation.UPGradWeighting()(G)
    ours = mogo.UPGrad()(regularised, torch.ones(K)).loss_weights
    assert float((ours - theirs).abs().max() / theirs.abs().max()) <= 1e-6


@given(problems())
def test_upgrad_never_opposes_a_gradient(problem):
    _, G = problem
    K = G.shape[0]
    weights = mogo.UPGrad()(G, torch.ones(K))
    active = weights.alpha > 0  # gradients below 1e-10 of the largest count as zero
    # A K-term sum of K-term sums in float64, in units of its own size.
    assert worst_opposition(G, weights.loss_weights, active) <= 100 * K * EPS


@given(st.sampled_from(SIZES), st.integers(1, 64), st.integers(0, 2**31 - 1))
def test_upgrad_is_the_mean_when_no_pair_conflicts(K, dim, seed):
    rng = np.random.default_rng(seed)
    # norms within 1e8 of each other: none counts as zero (1e-10 of the largest)
    J = torch.from_numpy(rng.uniform(0, 1, (K, dim)) * 10.0 ** rng.uniform(-4, 4, (K, 1)))
    assert bool(((J @ J.T) >= 0).all())
    weights = mogo.UPGrad()(J @ J.T, torch.ones(K))
    torch.testing.assert_close(weights.loss_weights, torch.full((K,), 1.0 / K, dtype=torch.float64))


# MGDA (MinNorm without normalisation) ---------------------------------------------------------


@settings(max_examples=25)
@given(problems(sizes=(2, 3, 5, 10)))
def test_mgda_equals_torchjd_where_its_frank_wolfe_gap_is_small(problem):
    _, G = problem
    K = G.shape[0]
    ours = mogo.make_weighting("mgda")(G, torch.ones(K)).loss_weights
    assert_min_norm_optimal(G, ours, tol=1e-12)
    theirs = torchjd_aggregation.MGDAWeighting(epsilon=1e-12, max_iters=2000)(G)
    scale = float(G.diagonal().max())
    if not scale > 0:
        return
    g = G @ theirs
    gap = float(theirs @ g - g.min()) / scale  # bounds f(theirs) - f* / max_i G_ii
    if gap <= 1e-13:
        # ||d' - d*||^2 <= f(w') - f* for the min-norm point of a convex set
        distance = float(((ours - theirs) @ G @ (ours - theirs)).clamp_min(0).sqrt()) / np.sqrt(scale)
        assert distance <= 1e-6


@given(problems())
def test_mgda_never_opposes_a_gradient(problem):
    _, G = problem
    K = G.shape[0]
    alpha = mogo.make_weighting("mgda")(G, torch.ones(K)).loss_weights
    # min_norm's contract: (G alpha)_k >= f - kkt max_i G_ii >= -1e-12 max_i G_ii
    assert float((G @ alpha).min()) >= -1e-12 * float(G.diagonal().max())


# CAGrad ---------------------------------------------------------------------------------------


@settings(max_examples=30)
@given(problems(families=("gaussian", "low_rank", "K_above_dim", "duplicates", "conflicting", "orthogonal")))
def test_cagrad_is_certified_and_never_worse_than_torchjd(problem):
    _, G = problem
    K, c = G.shape[0], 0.5
    weights = mogo.CAGrad(c)(G, torch.ones(K))
    assert weights.solve.status == "success"
    ours = weights.loss_weights.numpy()
    if not ours.any():
        return  # the optimal g_w vanishes: the direction is 0 (see CAGrad's docstring)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = torchjd_aggregation.CAGradWeighting(c)(G).numpy()
    lam_w = ours - 1.0 / K  # = rho / ||g_w*|| * w*, with w* on the simplex
    value, gap = cagrad_objective(G.numpy(), lam_w / lam_w.sum(), c)
    assert gap <= 1e-9
    if (theirs - 1.0 / K).sum() > 0:  # TorchJD did not declare g_w* = 0
        w_theirs = (theirs - 1.0 / K) / (theirs - 1.0 / K).sum()
        their_value, their_gap = cagrad_objective(G.numpy(), np.clip(w_theirs, 0, None), c)
        # F(theirs) - F* <= their gap, and ours is optimal to 1e-9: the sandwich is the test.
        assert value <= their_value + 1e-9
        assert their_value - value <= their_gap + 1e-9


def test_cagrad_with_c_zero_is_the_mean_and_rescale_divides_by_one_plus_c_squared():
    _, G = gradient_family("conflicting", 4, seed=3)
    torch.testing.assert_close(
        mogo.CAGrad(0.0)(G, torch.ones(4)).loss_weights, torch.full((4,), 0.25).double()
    )
    plain = mogo.CAGrad(0.4)(G, torch.ones(4)).loss_weights
    rescaled = mogo.CAGrad(0.4, rescale=True)(G, torch.ones(4)).loss_weights
    torch.testing.assert_close(rescaled, plain / 1.16)


def test_cagrad_is_invariant_to_the_scale_of_the_gram_matrix():
    _, G = gradient_family("gaussian", 5, seed=4)
    w, _, _ = cagrad_weights(G.numpy(), 0.5)
    for scale in (1e-24, 1e24):
        np.testing.assert_allclose(cagrad_weights(scale * G.numpy(), 0.5)[0], w, rtol=1e-9)


# Nash-MTL -------------------------------------------------------------------------------------


@settings(max_examples=8)
@given(problems(families=("gaussian", "orthogonal", "duplicates"), sizes=(2, 3, 5)))
def test_nash_mtl_equals_torchjd_where_its_solution_is_certified(problem):
    J, G = problem
    K = G.shape[0]
    weights = mogo.NashMTL(max_norm=0)(G, torch.ones(K))
    ours = weights.loss_weights
    assert weights.solve.status == "success"
    if not ours.any():  # the origin is in the hull: no bargaining solution exists
        assert float(mogo.min_norm(G).value) <= 1e-12 * float(G.diagonal().max())
        return
    assert nash_residual(G, ours) <= 1e-10
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = torchjd_aggregation.NashMTL(n_tasks=K, max_norm=0.0).weighting(J).to(torch.float64)
    if nash_residual(G, theirs) <= 1e-8:
        assert float((ours - theirs).abs().max() / ours.abs().max()) <= 1e-6


@given(problems(families=("gaussian", "orthogonal", "duplicates", "norm_ratio_1e12", "tiny_1e-30")))
def test_nash_mtl_solves_the_bargaining_condition_or_reports_pareto_stationarity(problem):
    _, G = problem
    K = G.shape[0]
    weights = mogo.NashMTL(max_norm=0)(G, torch.ones(K))
    if not weights.loss_weights.any():  # the origin is in the hull: no bargaining solution
        assert float(mogo.min_norm(G).value) <= 1e-12 * float(G.diagonal().max())
        return
    active = weights.alpha > 0
    alpha = weights.loss_weights[active]
    assert nash_residual(G[active][:, active], alpha) <= 1e-10
    # ||d||^2 = alpha^T G alpha = (number of objectives in the bargain)
    clipped = mogo.NashMTL(max_norm=1.0)(G, torch.ones(K)).loss_weights
    torch.testing.assert_close(clipped @ G @ clipped, torch.tensor(1.0, dtype=torch.float64))


def test_nash_mtl_gives_zero_where_the_origin_is_in_the_hull():
    _, G = gradient_family("opposite", 4, seed=0)
    assert not mogo.NashMTL()(G, torch.ones(4)).loss_weights.any()


# IMTL-G and Aligned-MTL -------------------------------------------------------------------------


@given(problems())
def test_imtl_g_is_scale_free_and_sums_to_one(problem):
    _, G = problem
    K = G.shape[0]
    ours = mogo.IMTLG()(G, torch.ones(K)).loss_weights
    if retained_condition(G) > 1e6:
        return  # G^+ n is set by round-off there, in TorchJD's answer and in ours
    # TorchJD's test |sum v| < 1e-12 is absolute: it gives 0 for every G above about 1e12
    torch.testing.assert_close(mogo.IMTLG()(1e20 * G, torch.ones(K)).loss_weights, ours, rtol=1e-6, atol=1e-9)
    if ours.any():
        assert abs(float(ours.sum()) - 1) <= 1e3 * K * EPS * float(ours.abs().sum())


@given(problems(families=("gaussian", "orthogonal", "conflicting")))
def test_imtl_g_projects_equally_on_every_unit_gradient(problem):
    _, G = problem
    K = G.shape[0]
    if retained_condition(G) > 1e6 or torch.linalg.matrix_rank(G) < K:
        return
    w = mogo.IMTLG()(G, torch.ones(K)).loss_weights
    projections = (G @ w) / G.diagonal().sqrt()
    assert float(projections.max() - projections.min()) <= 1e6 * K * EPS * float(projections.abs().max())


@pytest.mark.parametrize("scale_mode", ["min", "median", "rmse"])
@given(problem=problems())
def test_aligned_mtl_equals_torchjd_where_it_is_accurate(scale_mode, problem):
    _, G = problem
    K = G.shape[0]
    ours = mogo.AlignedMTL(scale_mode)(G, torch.ones(K)).loss_weights
    theirs = torchjd_aggregation.AlignedMTLWeighting(scale_mode=scale_mode)(G)
    if retained_condition(G) > 1e6:
        return  # the retained eigenvalues and vectors are set by round-off there
    assert direction_gap(G, ours, theirs) <= 1e-6
    torch.testing.assert_close(
        mogo.AlignedMTL(scale_mode)(1e20 * G, torch.ones(K)).loss_weights, ours, rtol=1e-6, atol=1e-9
    )


# PCGrad ---------------------------------------------------------------------------------------


@given(problems(), st.integers(0, 2**31 - 1))
def test_pcgrad_equals_torchjd_with_the_same_seed(problem, seed):
    _, G = problem
    K = G.shape[0]
    ours = mogo.PCGrad(seed=seed)(G, torch.ones(K)).loss_weights
    state = torch.get_rng_state()
    try:
        torch.manual_seed(seed)  # TorchJD draws from the global RNG
        theirs = torchjd_aggregation.PCGradWeighting()(G)
    finally:
        torch.set_rng_state(state)
    # the same operations in the same order: round-off of K-term dot products
    assert float((ours - theirs).abs().max()) <= 100 * K * EPS * float(theirs.abs().max())


def test_pcgrad_never_touches_the_global_rng_and_is_reproducible():
    _, G = gradient_family("conflicting", 6, seed=2)
    state = torch.get_rng_state()
    first = mogo.PCGrad(seed=7)
    a, b = first(G, torch.ones(6)).loss_weights, first(G, torch.ones(6)).loss_weights
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(mogo.PCGrad(seed=7)(G, torch.ones(6)).loss_weights, a)
    generator = torch.Generator().manual_seed(7)
    assert torch.equal(mogo.PCGrad(generator=generator)(G, torch.ones(6)).loss_weights, a)
    assert not torch.equal(a, b)  # the generator advanced: new orders on the second call
    with pytest.raises(TypeError, match=r"torch\.Generator"):
        mogo.PCGrad(generator=7)


# Every weighting ------------------------------------------------------------------------------

# PCGrad is left out: its answer depends on a random order, so it is equivariant only in law.
DETERMINISTIC = ["upgrad", "cagrad", "nash_mtl", "imtl_g", "aligned_mtl", "mgda"]


@pytest.mark.parametrize("name", DETERMINISTIC)
@given(problem=problems(families=("gaussian", *DEGENERATE)), permutation=st.randoms())
def test_permuting_the_objectives_permutes_the_direction_weights(name, problem, permutation):
    _, G = problem
    K = G.shape[0]
    order = list(range(K))
    permutation.shuffle(order)
    if name in ("imtl_g", "aligned_mtl") and retained_condition(G) > 1e6:
        return  # closed forms of an ill-conditioned G: round-off, which permuting changes
    weighting = mogo.make_weighting(name)
    w = weighting(G, torch.ones(K)).loss_weights
    permuted = weighting(G[order][:, order], torch.ones(K)).loss_weights
    # weights need not be unique on degenerate G; the direction is (to the solvers' accuracy)
    assert direction_gap(G, w, permuted.new_zeros(K).index_copy(0, torch.tensor(order), permuted)) <= 1e-6


@pytest.mark.parametrize(
    ("name", "options", "kind"),
    [
        ("upgrad", {}, mogo.UPGrad),
        ("cagrad", {"c": 0.4}, mogo.CAGrad),
        ("nash_mtl", {"max_norm": 0.0}, mogo.NashMTL),
        ("imtl_g", {}, mogo.IMTLG),
        ("aligned_mtl", {"scale_mode": "median"}, mogo.AlignedMTL),
        ("pcgrad", {"seed": 3}, mogo.PCGrad),
        ("mgda", {}, mogo.MinNorm),
    ],
)
def test_make_weighting_builds_each_by_name(name, options, kind):
    weighting = mogo.make_weighting(name, **options)
    assert isinstance(weighting, kind)
    assert repr(weighting).startswith(kind.__name__)


def test_mgda_is_min_norm_without_normalisation():
    assert repr(mogo.make_weighting("mgda")) == repr(mogo.MinNorm("none"))


@pytest.mark.parametrize(
    ("kind", "kwargs", "match"),
    [
        (mogo.UPGrad, {"tol": 0}, "tol must be positive"),
        (mogo.CAGrad, {"c": -1}, "c must be a finite number >= 0"),
        (mogo.NashMTL, {"max_norm": -1}, "max_norm must be"),
        (mogo.NashMTL, {"max_iter": 0}, "max_iter must be at least 1"),
        (mogo.AlignedMTL, {"scale_mode": "max"}, "unknown scale_mode 'max'"),
    ],
)
def test_bad_options_raise_naming_them(kind, kwargs, match):
    with pytest.raises(ValueError, match=match):
        kind(**kwargs)


def test_signed_weights_keep_their_sign_in_alpha():
    J = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
    weights = mogo.IMTLG()(J @ J.T, torch.ones(3))
    assert float(weights.alpha.abs().sum()) == pytest.approx(1.0)
    torch.testing.assert_close(weights.scale * weights.alpha, weights.loss_weights)


# The checks of G and of the weights (issue 39) --------------------------------------------------

# Options a weighting cannot do without, by name; every other registered weighting is built with
# its defaults, so one registered later is covered by the tests below as it is.
REQUIRED = {"weighted_sum": lambda K: {"weights": [1.0] * K}}
NAMES = [*sorted(mogo.WEIGHTINGS), "torchjd_upgrad"]
NAN, INF = float("nan"), float("inf")


def build(name: str, K: int) -> mogo.Weighting:
    """The weighting registered as ``name`` for K objectives, or the TorchJD adapter."""
    if name == "torchjd_upgrad":
        return mogo.TorchJDWeighting(torchjd_aggregation.UPGradWeighting())
    return mogo.make_weighting(name, **REQUIRED.get(name, lambda K: {})(K))


def allowance(dtype: torch.dtype, K: int) -> float:
    """min_norm's documented round-off allowance of a K x K G, relative to max_i G_ii."""
    eps = torch.finfo(dtype).eps
    return K * eps if eps > EPS else 100 * K * EPS


BAD_GRAMS = {
    "nan": (torch.tensor([[1.0, NAN], [NAN, 1.0]]), r"G contains NaN or Inf: entry \(0, 1\) is nan"),
    "nan_diagonal": (torch.tensor([[NAN, 0.0], [0.0, 1.0]]), r"NaN or Inf: entry \(0, 0\) is nan"),
    "inf_diagonal": (torch.tensor([[1.0, 0.0], [0.0, INF]]), r"NaN or Inf: entry \(1, 1\) is inf"),
    "indefinite": (
        torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=torch.float64),
        r"not positive semidefinite: smallest eigenvalue / max_i G_ii = -1; round-off in a 2 x 2 "
        r"float64 G allows 4\.4e-14$",
    ),
    "negative_diagonal": (torch.tensor([[-1.0, 0.0], [0.0, -2.0]]), "largest diagonal entry is -1$"),
    "asymmetric": (
        torch.tensor([[1.0, 0.5], [0.0, 1.0]]),
        r"not symmetric: max \|G - G\^T\| / max_i G_ii = 0\.5; round-off in a 2 x 2 float32 G "
        r"allows 2\.4e-07",
    ),
    "complex": (torch.eye(2, dtype=torch.complex128), "G must be real, got dtype torch.complex128"),
    "not_square": (torch.ones(2, 3), r"G must have shape \(K, K\), got \(2, 3\)$"),
    "batched": (torch.eye(2).expand(3, 2, 2), r"got \(3, 2, 2\): a weighting takes one G, not a batch"),
    "empty": (torch.zeros(0, 0), r"G is empty \(shape \(0, 0\)\)"),
    "zero": (torch.zeros(2, 2), "G is 0: every one of the 2 gradients is zero, so there is no direction"),
}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("fault", sorted(BAD_GRAMS))
def test_every_weighting_refuses_a_bad_gram_matrix_naming_what_is_wrong(name, fault):
    # Issue 39, item 8: CAGrad, IMTLG, AlignedMTL and PCGrad returned weights for a NaN, Inf,
    # indefinite or asymmetric G, all accepted a complex one, the others named the wrong fault.
    G, match = BAD_GRAMS[fault]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no casting or arithmetic warning on the way to the error
        with pytest.raises(ValueError, match=match):
            build(name, 2)(G, torch.ones(2))


# TorchJD's UPGrad overflows tr(G); MoDo's step size is in units of 1 / G (the paper's and
# TorchJD's), so its weights depend on G's scale by design.
@pytest.mark.parametrize("name", sorted(set(mogo.WEIGHTINGS) - {"modo"}))
def test_every_weighting_weighs_a_gram_matrix_near_overflow_as_it_does_a_small_one(name):
    # The entries' sum overflows (the fast check's test of finiteness), and (G + G^T) / 2 would:
    # every step must stay finite. 2**1023 scales exactly; the normalisations that are not
    # powers of two (square roots of G_kk) round by an eps, moved to the weights by at most the
    # condition number (checked below 1000) times K eps.
    K = 12
    J = torch.randn(K, K + 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    small = J @ J.T / float((J @ J.T).diagonal().max())
    condition = float(torch.linalg.cond(small))
    assert condition < 1000
    huge = small * 2.0**1023
    assert not np.isfinite(huge.sum().item())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        weights = build(name, K)(huge, torch.ones(K))
    expected = build(name, K)(small, torch.ones(K))
    assert float((weights.alpha - expected.alpha).abs().max()) <= condition * K * EPS


@st.composite
def perturbed(draw: st.DrawFn) -> tuple[torch.Tensor, float, float]:
    """``(G, asymmetry, lowest)``: a family's Gram matrix with its smallest eigenvalue moved and an
    antisymmetric part added, each a random multiple (0 to 10) of its dtype's allowance ``a``, at
    a scale the dtype holds, rounded to the dtype; then its asymmetry ``max |G - G^T|`` and the
    smallest eigenvalue of its symmetric part, both over ``max_i G_ii`` and ``a``, measured in
    float64 on the rounded matrix (rounding moves them by up to about ``a / 2``)."""
    dtype = draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]))
    family = draw(st.sampled_from(sorted(FAMILIES)))
    K = draw(st.integers(2, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    _, G = gradient_family(family, K, dim=draw(st.integers(1, 16)), seed=seed)
    if not float(G.diagonal().max()) > 0:
        G = torch.eye(K, dtype=torch.float64)
    a = allowance(dtype, K)
    values, vectors = torch.linalg.eigh(G / G.diagonal().max())
    values[0] = -draw(st.floats(0, 10)) * a
    noise = torch.from_numpy(np.random.default_rng(seed).standard_normal((K, K)))
    antisymmetric = (noise - noise.T) / (noise - noise.T).abs().max().clamp_min(1e-300)
    G = (vectors * values) @ vectors.T + draw(st.floats(0, 10)) * a * antisymmetric
    exponent = draw(st.integers(-2, 2) if dtype == torch.float16 else st.integers(-30, 30))
    G = (G * 10.0**exponent).to(dtype)
    G64 = G.to(torch.float64)
    scale = float(G64.diagonal().max())
    asymmetry = float((G64 - G64.T).abs().max()) / scale / a
    lowest = float(torch.linalg.eigvalsh((G64 + G64.T) / 2)[0]) / scale / a
    return G, asymmetry, lowest


def refuses(solve) -> bool:
    try:
        solve()
    except ValueError:
        return True
    return False


@given(perturbed())
def test_check_gram_allows_what_min_norm_allows_and_no_more(case):
    # The one rule: asymmetry and negative eigenvalues within the dtype's allowance a (relative to
    # max_i G_ii) are round-off; beyond it, an error. Judged where the rounded matrix is clearly on
    # one side (below a / 2, above 2 a): float64 eigenvalues err by about K eps64, far less.
    G, asymmetry, lowest = case
    if asymmetry <= 0.5 and lowest >= -0.5:
        expected = False
    elif asymmetry >= 2 or lowest <= -2:
        expected = True
    else:
        return
    assert refuses(lambda: mogo.check_gram(G)) == expected
    assert refuses(lambda: mogo.min_norm(G, throw=False)) == expected


@st.composite
def cross_fitted(draw: st.DrawFn) -> torch.Tensor:
    """``(G_12 + G_21) / 2`` from two half-batches of K noisy gradients: often indefinite."""
    K = draw(st.integers(2, 10))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    signal = rng.standard_normal((K, 6)) * 10.0 ** rng.uniform(-2, 2, (K, 1))
    noise = 10.0 ** draw(st.floats(-2, 1))
    first, second = (signal + noise * rng.standard_normal((K, 6)) for _ in range(2))
    cross = torch.from_numpy(first @ second.T)
    return (cross + cross.T) / 2


@given(cross_fitted())
def test_a_declared_estimate_is_weighed_as_its_nearest_gram_matrix(S):
    K = S.shape[0]
    values, vectors = torch.linalg.eigh(S)
    nearest = (vectors * values.clamp_min(0)) @ vectors.T
    # Refused where the nearest Gram matrix is round-off: its largest diagonal entry within the
    # allowance of the estimate's largest entry (judged with a margin of 2 either way).
    largest = float(nearest.diagonal().max() / S.abs().max()) / allowance(torch.float64, K)
    if largest <= 0.5:
        with pytest.raises(ValueError, match="nearest Gram matrix is 0 within round-off"):
            mogo.check_gram(mogo.GramEstimate(S))
    if largest < 2:
        return
    checked = mogo.check_gram(mogo.GramEstimate(S))
    # The projection on the PSD cone is 1-Lipschitz in Frobenius norm, and each eigensolver is
    # backward stable (an error of about K eps ||S||_F): the two projections differ by a few of it.
    assert float((torch.from_numpy(checked.host) - nearest).norm()) <= 10 * K * EPS * float(S.norm())
    if float(values[0]) < -2 * allowance(torch.float64, K) * float(S.diagonal().max()):
        with pytest.raises(ValueError, match="not positive semidefinite"):  # undeclared: an error
            mogo.check_gram(S)
    plain = torch.from_numpy(checked.host.copy())
    for name in NAMES:
        if build(name, K).reads_estimate:  # the estimate itself: tests/test_modo_sdmgrad.py, test_gated.py
            continue
        weights = build(name, K)(mogo.GramEstimate(S), torch.ones(K)).loss_weights
        assert torch.equal(weights, build(name, K)(plain, torch.ones(K)).loss_weights), name


def test_an_estimate_is_checked_but_for_semidefiniteness():
    with pytest.raises(ValueError, match=r"not symmetric: max \|G - G\^T\| / max_ij \|G_ij\| = 0\.5"):
        mogo.check_gram(mogo.GramEstimate(torch.tensor([[-1.0, 0.5], [0.0, 1.0]])))
    with pytest.raises(ValueError, match=r"NaN or Inf: entry \(0, 0\) is nan"):
        mogo.check_gram(mogo.GramEstimate(torch.tensor([[NAN, 0.0], [0.0, 1.0]])))
    with pytest.raises(ValueError, match="nearest Gram matrix is 0 within round-off"):
        mogo.UPGrad()(mogo.GramEstimate(-torch.eye(3)), torch.ones(3))
    with pytest.raises(TypeError, match=r"G must be a torch\.Tensor or a mogo\.GramEstimate, got ndarray"):
        mogo.check_gram(np.eye(2))


LOW_PRECISION = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("name", sorted(mogo.WEIGHTINGS))  # TorchJD's quadprog refuses some
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_every_weighting_accepts_a_low_precision_gram_that_min_norm_certifies(name, dtype):
    # Issue 39, item 10: MinNorm, mgda, UPGrad and NashMTL refused these: normalize_gram cast G to
    # float64 and the solvers then allowed it float64's round-off instead of its own.
    K = 10
    for seed in range(10):
        J = torch.randn(K, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        J = (J / J.norm(dim=1).max()).to(dtype)
        G = J @ J.T  # rank 3, its seven zero eigenvalues off by the dtype's round-off
        assert mogo.min_norm(G).status == "success"
        weights = build(name, K)(G, torch.ones(K))
        if isinstance(weights.solve, mogo.MinNormResult):
            assert float(weights.solve.kkt) <= 1e-12 + allowance(dtype, K)


def duplicated(r: int, seed: int) -> torch.Tensor:
    """The Gram matrix (float64, K = 2 r) of r orthonormal directions, each twice, at random
    norms in [1, 2]: blocks ``[[a^2, a b], [a b, b^2]]``, eigenvalues ``a^2 + b^2`` (2 to 8) and 0."""
    rng = np.random.default_rng(seed)
    U, _ = np.linalg.qr(rng.standard_normal((r + 3, r)))
    J = torch.from_numpy(np.repeat(U.T, 2, axis=0) * rng.uniform(1, 2, size=(2 * r, 1)))
    return J @ J.T


@pytest.mark.parametrize("name", ["imtl_g", "aligned_mtl"])
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_closed_forms_of_a_low_precision_gram_cut_its_round_off_eigenvalues(name, dtype):
    # Issue 39, item 10: the pseudo-inverse cut eigenvalues at float64's K eps lambda_max, so a
    # float32 G's zero eigenvalues, off by 1e-8, were inverted and set the weights.
    # Rounding errs by eps/2 of each entry (at most 4): 4 eps in spectral norm per block, against
    # kept eigenvalues of 2 to 8 and zero ones within the allowance. To first order (Wedin's bound
    # for G^+, 1.62 ||E|| ||G^+||^2; G^(-1/2) is better conditioned) the weights move by a few eps
    # times the condition number (4) of the kept part: 32 eps bounds it.
    eps = torch.finfo(dtype).eps
    for r in (1, 2, 3, 5, 8):
        for seed in range(10):
            G = duplicated(r, seed)
            exact = build(name, 2 * r)(G, torch.ones(2 * r)).loss_weights
            rounded = build(name, 2 * r)(G.to(dtype), torch.ones(2 * r)).loss_weights
            assert float((rounded - exact).abs().max()) <= 32 * eps * float(exact.abs().max())


def test_mgda_solves_a_subnormal_gram_matrix():
    # Issue 39, item 11: 1e-309 G raised ZeroDivisionError in min_norm's single-problem path.
    G = torch.tensor([[2.0, 1.0], [1.0, 4.0]], dtype=torch.float64) * 1e-309
    weights = mogo.make_weighting("mgda")(G, torch.ones(2)).loss_weights
    # alpha_1 = (G22 - G12) / (G11 + G22 - 2 G12) = 3/4, to the 47 bits a subnormal 1e-309 keeps
    torch.testing.assert_close(weights, torch.tensor([0.75, 0.25], dtype=torch.float64), rtol=1e-6, atol=0)


def test_constructor_arguments_that_make_weights_overflow_are_refused():
    # Issue 39, item 9: MinNorm(scale=inf) was accepted; WeightedSum([1e308, 1e308]) gave NaN.
    for scale in (INF, NAN, -1.0):
        with pytest.raises(ValueError, match=f"scale must be a positive finite number, got {scale}"):
            mogo.MinNorm(scale=scale)
    with pytest.raises(ValueError, match=r"finite sum, got \[1e\+308, 1e\+308\], whose sum overflows"):
        mogo.WeightedSum([1e308, 1e308])
    with pytest.raises(ValueError, match="finite and non-negative"):
        mogo.WeightedSum([INF, 1.0])


def test_weights_that_are_not_finite_raise_naming_the_weighting_and_the_values():
    # Issue 39, item 9: a TorchJD weighting's NaN passed through; an overflow of s alpha_k / c_k
    # (a scale of 1e308 over gradient norms of 1e-100) gave infinite loss weights.
    nan_weighting = torchjd_aggregation.ConstantWeighting(torch.tensor([NAN, 1.0], dtype=torch.float64))
    with pytest.raises(
        ValueError,
        match=r"^TorchJDWeighting\(ConstantWeighting\(.*\)\) returned weights that are not finite: "
        r"loss weights \[nan, nan\] = scale nan \* alpha \[0\.5, 0\.5\] / divisor \[1\.0, 1\.0\]$",
    ):
        mogo.TorchJDWeighting(nan_weighting)(torch.eye(2, dtype=torch.float64), torch.ones(2))
    tiny = 1e-200 * torch.eye(2, dtype=torch.float64)
    with pytest.raises(
        ValueError,
        match=r"^MinNorm\(normalize='l2', method='auto', scale=1e\+308\) returned weights that are not "
        r"finite: loss weights \[inf, inf\] = scale 1e\+308 \* alpha \[0\.5, 0\.5\] / divisor "
        r"\[1e-100, 1e-100\]$",
    ):
        mogo.MinNorm(scale=1e308)(tiny, torch.ones(2))
    assert torch.isfinite(mogo.MinNorm(scale=1.0)(tiny, torch.ones(2)).loss_weights).all()


# Through HarmonizedOptimizer ------------------------------------------------------------------


def mlp(seed: int, outputs: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, outputs))


def regression_losses(model: torch.nn.Module, seed: int, K: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 5, generator=generator)
    y = torch.randn(32, K, generator=generator) * 3
    return ((model(x) - y) ** 2).mean(0)


def jacobian(model: torch.nn.Module, losses: torch.Tensor) -> torch.Tensor:
    rows = [torch.autograd.grad(loss, list(model.parameters()), retain_graph=True) for loss in losses]
    return torch.stack([torch.cat([g.reshape(-1) for g in row]) for row in rows]).double()


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()


FACTORIES = {
    **{name: (lambda name=name: mogo.make_weighting(name)) for name in DETERMINISTIC},
    "pcgrad": lambda: mogo.PCGrad(seed=5),
    "modo": mogo.MoDo,  # a second instance steps alike; SDMGrad: tests/test_modo_sdmgrad.py (float64)
    "torchjd_upgrad": lambda: mogo.TorchJDWeighting(torchjd_aggregation.UPGradWeighting()),
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_each_weighting_drives_the_optimizer_with_amortization(name):
    model = mlp(0)
    opt = mogo.HarmonizedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        ["a", "b", "c"],
        weighting=FACTORIES[name](),
        harmonize_every=3,
        alpha_ema=0.5,
    )
    reference = FACTORIES[name]()  # a second instance: PCGrad's generator starts alike
    expected_alpha = None
    for step in range(7):
        opt.zero_grad()
        losses = regression_losses(model, step)
        J = jacobian(model, losses)
        harmonizes = opt.amortizer.due
        opt.backward(losses)
        if harmonizes:
            weights = reference(J @ J.T, losses.detach().double())
            # the harmonization step writes sum_k w_k g_k (float32 gradients: ~1e-6 relative)
            direction = weights.loss_weights @ J
            error = float((flat_grad(model) - direction).norm() / direction.norm().clamp_min(1e-30))
            assert error <= 1e-5
            alpha = weights.alpha if expected_alpha is None else 0.5 * expected_alpha + 0.5 * weights.alpha
            expected_alpha = alpha
            divisor, scale = weights.divisor, weights.scale
        else:
            # an amortized step backpropagates the cached weights: sum_k w_k g_k with EMA alpha
            cached = scale * expected_alpha / divisor
            direction = cached @ J
            error = float((flat_grad(model) - direction).norm() / direction.norm().clamp_min(1e-30))
            assert error <= 1e-5
        torch.testing.assert_close(opt.amortizer.alpha, expected_alpha, rtol=1e-6, atol=1e-9)
        opt.step()
    assert opt.meter.steps == 3


def test_the_adapter_names_the_package_when_torchjd_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchjd", None)
    with pytest.raises(ImportError, match="pip install torchjd"):
        mogo.TorchJDWeighting(object())


def test_the_adapter_checks_the_weights_it_gets():
    adapter = mogo.TorchJDWeighting(lambda G: torch.ones(G.shape[0] + 1))
    with pytest.raises(ValueError, match=r"weights of shape \(3,\) for 2 objectives"):
        adapter(torch.eye(2, dtype=torch.float64), torch.ones(2))
    with pytest.raises(TypeError, match="must be a TorchJD weighting"):
        mogo.TorchJDWeighting(3)


def test_pcgrads_generator_is_checkpointed_and_restored_on_a_skipped_step():
    """A resumed PCGrad run draws the orders the uninterrupted one draws, and a skipped step leaves
    the generator where it was."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 4), torch.randn(32, 3)

    def make():
        torch.manual_seed(1)
        model = torch.nn.Linear(4, 3)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, mogo.HarmonizedOptimizer(inner, 3, weighting=mogo.PCGrad(seed=5), nonfinite="skip")

    def step(model, opt, scale=1.0):
        opt.zero_grad()
        opt.backward(((model(x) - y) ** 2).mean(0) * scale)
        opt.step()

    model, opt = make()
    for _ in range(3):
        step(model, opt)
    state = copy.deepcopy(opt.state_dict())
    saved = [p.detach().clone() for p in model.parameters()]
    assert set(state["mogo"]["weighting"]) == {"generator"}
    before = opt.weighting.generator.get_state()
    step(model, opt, scale=float("nan"))  # skipped: the generator it advanced is put back
    assert torch.equal(opt.weighting.generator.get_state(), before)
    step(model, opt)
    resumed_model, resumed = make()
    with torch.no_grad():
        for p, value in zip(resumed_model.parameters(), saved, strict=True):
            p.copy_(value)
    resumed.load_state_dict(state)
    step(resumed_model, resumed, scale=float("nan"))
    step(resumed_model, resumed)
    for p, q in zip(resumed_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    bad = {**state, "mogo": {**state["mogo"], "weighting": {"generator": torch.zeros(3, dtype=torch.uint8)}}}
    with pytest.raises(ValueError, match=r"mogo\.weighting\.generator: not a CPU generator's state"):
        resumed.load_state_dict(bad)
    missing = {**state, "mogo": {k: v for k, v in state["mogo"].items() if k != "weighting"}}
    with pytest.raises(ValueError, match=r"mogo\.weighting: missing"):
        resumed.load_state_dict(missing)


class OwnAdapter:
    """A weighting of one's own, outside mogo's checks (the Weighting protocol only): a TorchJD
    weighting's answer taken as it comes."""

    def __init__(self, weighting) -> None:
        self.weighting = weighting

    def __call__(self, gram: torch.Tensor, losses: torch.Tensor) -> mogo.Weights:
        return mogo.Weights.from_combination(self.weighting(gram))

    def __repr__(self) -> str:
        return f"OwnAdapter({self.weighting!r})"


@pytest.mark.parametrize("nonfinite", ["raise", "skip", "drop"])
@pytest.mark.parametrize("adapter", [mogo.TorchJDWeighting, OwnAdapter])
def test_the_optimizer_refuses_weights_that_are_not_finite_under_every_policy(nonfinite, adapter):
    # Issue 39, item 9: NaN weights made .grad NaN; the optimizer then blamed the parameters, and
    # under nonfinite="skip" every step was skipped without a word.
    model = mlp(0)
    before = [p.detach().clone() for p in model.parameters()]
    weighting = adapter(
        torchjd_aggregation.ConstantWeighting(torch.tensor([1.0, NAN, 1.0], dtype=torch.float64))
    )
    opt = mogo.HarmonizedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), 3, weighting=weighting, nonfinite=nonfinite
    )
    opt.zero_grad()
    with pytest.raises(
        ValueError, match=rf"^{adapter.__name__}\(ConstantWeighting.*not finite: loss weights \[nan"
    ):
        opt.backward(regression_losses(model, 0))
    assert opt.amortizer.step == 0
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q)
