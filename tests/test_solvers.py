"""Properties of mogo.min_norm on the families where published solvers fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import mogo
from mogo.testing import FAMILIES, assert_min_norm_optimal, gradient_family
from tests.reference import brute_force_min_norm, cvxpy_min_norm, quadprog_min_norm


@st.composite
def problems(
    draw: st.DrawFn, min_k: int = 1, max_k: int = 64, families: tuple[str, ...] = tuple(sorted(FAMILIES))
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(J, G)``: K gradients of a family at a scale between 1e-30 and 1e30, and their Gram."""
    family = draw(st.sampled_from(families))
    K = draw(st.integers(min_k, max_k))
    dim = draw(st.integers(1, 96))
    scale = 10.0 ** draw(st.integers(-30, 30))
    seed = draw(st.integers(0, 2**31 - 1))
    return gradient_family(family, K, dim=dim, scale=scale, seed=seed)


def max_diag(G: torch.Tensor) -> float:
    return float(G.diagonal(dim1=-2, dim2=-1).max())


def well_conditioned(G: torch.Tensor) -> bool:
    """Strictly convex enough that alpha is unique and stable under perturbation."""
    eigenvalues = torch.linalg.eigvalsh(G)
    return bool(eigenvalues[0] > 1e-6 * eigenvalues[-1])


@given(problems())
def test_alpha_is_feasible_and_satisfies_kkt(problem):
    _, G = problem
    result = mogo.min_norm(G)
    assert result.status == "success"
    assert result.alpha.shape == G.shape[:1]
    assert_min_norm_optimal(G, result.alpha, tol=1e-9)
    assert float(result.kkt) <= 1e-12
    expected = result.alpha @ G @ result.alpha
    assert abs(float(result.value - expected)) <= 1e-12 * max_diag(G)


@given(problems(), st.integers(0, 2**31 - 1))
def test_value_never_above_a_vertex_or_a_random_simplex_point(problem, seed):
    _, G = problem
    value = float(mogo.min_norm(G).value)
    tolerance = 1e-12 * max_diag(G)
    assert value <= float(G.diagonal().min()) + tolerance
    points = torch.from_numpy(np.random.default_rng(seed).dirichlet(np.ones(G.shape[0]), size=64))
    assert value <= float(torch.einsum("ni,ij,nj->n", points, G, points).min()) + tolerance


@given(problems(max_k=10))
def test_agrees_with_brute_force_support_enumeration(problem):
    _, G = problem
    value = float(mogo.min_norm(G).value)
    reference = brute_force_min_norm(G.numpy())
    assert abs(value - reference) <= 1e-9 * max_diag(G)


# quadprog needs G positive definite: the families whose gradients are independent (for dim >= K).
NONSINGULAR = ("conflicting", "gaussian", "huge_1e30", "norm_ratio_1e12", "orthogonal", "tiny_1e-30")


@given(problems(min_k=2, max_k=64, families=NONSINGULAR))
def test_agrees_with_quadprog_where_it_succeeds(problem):
    _, G = problem
    reference = quadprog_min_norm(G.numpy())
    assume(reference is not None)
    value = float(mogo.min_norm(G).value)
    assert value <= reference + 1e-9 * max_diag(G)  # never worse than quadprog
    if well_conditioned(G):
        assert abs(value - reference) <= 1e-9 * max_diag(G)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_agrees_with_cvxpy_on_every_family(family):
    J, G = gradient_family(family, 7, dim=12, seed=3)
    reference = cvxpy_min_norm(J.numpy())
    assert reference is not None
    value = float(mogo.min_norm(G).value)
    # cvxpy's interior point stops at about 1e-8 relative; mogo must be at least as good.
    assert value <= reference + 1e-9 * max_diag(G)
    assert abs(value - reference) <= 1e-6 * max_diag(G)


@given(problems(), st.randoms(use_true_random=False))
def test_permuting_objectives_permutes_alpha(problem, random):
    _, G = problem
    K = G.shape[0]
    permutation = torch.tensor(random.sample(range(K), K))
    result = mogo.min_norm(G)
    permuted = mogo.min_norm(G[permutation][:, permutation])
    assert abs(float(permuted.value - result.value)) <= 1e-9 * max_diag(G)
    if well_conditioned(G):
        torch.testing.assert_close(permuted.alpha, result.alpha[permutation], atol=1e-6, rtol=0)


@given(problems(), st.integers(-20, 20))
def test_positive_scaling_leaves_alpha_unchanged(problem, exponent):
    _, G = problem
    factor = 10.0**exponent
    result = mogo.min_norm(G)
    scaled = mogo.min_norm(G * factor)
    assert abs(float(scaled.value) / factor - float(result.value)) <= 1e-9 * max_diag(G)
    if well_conditioned(G):
        torch.testing.assert_close(scaled.alpha, result.alpha, atol=1e-6, rtol=0)


@given(st.sampled_from(sorted(FAMILIES)), st.integers(1, 24), st.integers(1, 40), st.integers(0, 1000))
def test_batched_solve_matches_single_solves(family, K, batch, seed):
    stack = torch.stack([gradient_family(family, K, dim=16, seed=seed + b)[1] for b in range(batch)])
    stack = stack.reshape(1, batch, K, K) if batch % 2 else stack.reshape(batch, 1, K, K)
    result = mogo.min_norm(stack)
    assert result.alpha.shape == (*stack.shape[:-1],)
    assert result.value.shape == stack.shape[:-2]
    assert_min_norm_optimal(stack, result.alpha, tol=1e-9)
    flat = stack.reshape(-1, K, K)
    singles = torch.stack([mogo.min_norm(G).value for G in flat])
    scales = flat.diagonal(dim1=-2, dim2=-1).amax(-1)
    assert bool(((result.value.reshape(-1) - singles).abs() <= 1e-9 * scales).all())


@given(problems(max_k=16))
def test_frank_wolfe_is_within_its_duality_gap_of_exact(problem):
    _, G = problem
    exact = mogo.min_norm(G)
    fw = mogo.min_norm(G, method="frank_wolfe", max_iter=2000, throw=False)
    assert_min_norm_optimal(G, fw.alpha, tol=max(float(fw.kkt), 1e-9) * 1.01)
    # The duality gap certifies the error: f_fw - f* <= 2 (f_fw - min_i g_i) <= 2 kkt max_i G_ii.
    assert float(fw.value - exact.value) <= (2 * float(fw.kkt) + 1e-12) * max_diag(G)
    if fw.status == "success":
        assert float(fw.kkt) <= 1e-8


def test_frank_wolfe_reaches_its_tolerance_on_a_strictly_convex_problem():
    _, G = gradient_family("gaussian", 5, dim=50, seed=0)
    result = mogo.min_norm(G, method="frank_wolfe", tol=1e-10)
    assert float(result.kkt) <= 1e-10
    assert abs(float(result.value - mogo.min_norm(G).value)) <= 1e-10 * max_diag(G)


@given(problems(max_k=12))
def test_qpth_is_within_its_tolerance_of_exact(problem):
    _, G = problem
    exact = mogo.min_norm(G)
    qp = mogo.min_norm(G, method="qpth", throw=False)
    # An interior point can stall on degenerate problems; its certificate then says so.
    assert float(qp.value - exact.value) <= (2 * float(qp.kkt) + 1e-12) * max_diag(G)
    if well_conditioned(G):
        assert qp.status == "success"
    if qp.status == "success":
        assert_min_norm_optimal(G, qp.alpha, tol=1e-6)
        assert abs(float(qp.value - exact.value)) <= 2e-6 * max_diag(G)


def test_qpth_is_differentiable_and_matches_the_envelope_theorem():
    _, G = gradient_family("gaussian", 4, dim=20, seed=1)
    G = G.clone().requires_grad_(True)
    result = mogo.min_norm(G, method="qpth")
    result.value.backward()
    # d/dG of min_alpha alpha^T G alpha is alpha* alpha*^T at the optimum.
    alpha = result.alpha.detach()
    torch.testing.assert_close(G.grad, torch.outer(alpha, alpha), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_returns_the_input_dtype_and_computes_in_float64(dtype):
    _, G = gradient_family("gaussian", 6, dim=8, seed=2)
    result = mogo.min_norm(G.to(dtype))
    assert result.alpha.dtype == dtype
    assert result.value.dtype == dtype
    assert result.kkt.dtype == dtype
    assert result.iterations.dtype == torch.int64
    reference = mogo.min_norm(G.to(dtype).to(torch.float64))
    torch.testing.assert_close(result.alpha, reference.alpha.to(dtype))


def test_accepts_numpy_arrays_and_closed_forms():
    assert mogo.min_norm(np.array([[4.0]])).alpha.tolist() == [1.0]
    # K = 2 closed form: alpha_1 = (G22 - G12) / (G11 + G22 - 2 G12).
    result = mogo.min_norm(np.array([[4.0, 1.0], [1.0, 2.0]]))
    torch.testing.assert_close(result.alpha, torch.tensor([0.25, 0.75], dtype=torch.float64))
    torch.testing.assert_close(result.value, torch.tensor(1.75, dtype=torch.float64))


def test_all_zero_gradients_give_uniform_weights_and_zero_value():
    result = mogo.min_norm(torch.zeros(2, 5, 5))
    torch.testing.assert_close(result.alpha, torch.full((2, 5), 0.2))
    assert result.value.abs().max() == 0


def test_round_off_asymmetry_and_tiny_negative_eigenvalues_are_repaired():
    _, G = gradient_family("K_above_dim", 12, seed=4)  # rank 3: nine zero eigenvalues
    noisy = G + 1e-15 * max_diag(G) * torch.randn(12, 12, dtype=torch.float64)
    assert torch.linalg.eigvalsh(0.5 * (noisy + noisy.T))[0] < 0
    assert not torch.equal(noisy, noisy.T)
    result = mogo.min_norm(noisy)
    assert_min_norm_optimal(G, result.alpha, tol=1e-9)
    assert float(result.value) >= 0


@pytest.mark.parametrize(
    ("G", "match"),
    [
        (torch.ones(3), r"shape \(\.\.\., K, K\)"),
        (torch.ones(2, 3), r"shape \(\.\.\., K, K\)"),
        (torch.ones(0, 0), "at least one"),
        (torch.ones(0, 3, 3), "at least one"),
        (torch.tensor([[1.0, float("nan")], [float("nan"), 1.0]]), "NaN or Inf"),
        (
            torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[float("inf"), 0.0], [0.0, 1.0]]]),
            r"NaN or Inf \(problem 1",
        ),
        (torch.tensor([[1.0, 0.5], [0.2, 1.0]]), "not symmetric"),
        (torch.tensor([[1.0, 2.0], [2.0, 1.0]]), "not positive semidefinite: smallest eigenvalue"),
        (torch.tensor([[-1.0, 0.0], [0.0, -2.0]]), "largest diagonal entry"),
        (torch.eye(3, dtype=torch.complex64), "must be real"),
    ],
)
def test_bad_input_raises_value_error_naming_the_problem(G, match):
    with pytest.raises(ValueError, match=match):
        mogo.min_norm(G)


def test_indefinite_matrix_that_passes_every_2x2_minor_is_rejected():
    # Each 2 x 2 principal minor is PSD, but the 3 x 3 matrix has eigenvalue -0.5.
    G = torch.tensor([[1.0, -0.75, -0.75], [-0.75, 1.0, -0.75], [-0.75, -0.75, 1.0]])
    with pytest.raises(ValueError, match=r"smallest eigenvalue / max_i G_ii = -0\.5"):
        mogo.min_norm(G)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "newton"}, "unknown method 'newton'"),
        ({"tol": 0.0}, "tol must be positive"),
        ({"max_iter": 0}, "max_iter must be at least 1"),
    ],
)
def test_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mogo.min_norm(torch.eye(3), **kwargs)


def test_unconverged_solve_raises_with_advice_or_reports_status():
    _, G = gradient_family("gaussian", 8, dim=10, seed=5)
    with pytest.raises(mogo.SolverError, match="raise max_iter"):
        mogo.min_norm(G, method="frank_wolfe", max_iter=3)
    result = mogo.min_norm(G, method="frank_wolfe", max_iter=3, throw=False)
    assert result.status == "max_iter"
    assert "frank_wolfe did not reach tol=1e-08 on 1 of 1 problem(s)" in result.message
    assert float(result.kkt) > 1e-8


DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
SIZES = (2, 3, 5, 8, 13, 32, 64, 100)


def documented_tolerance(dtype: torch.dtype, K: int, tol: float = 1e-12) -> float:
    """What min_norm's docstring certifies: tol, plus rho = K * eps(dtype) below float64."""
    return tol if dtype == torch.float64 else tol + K * torch.finfo(dtype).eps


@st.composite
def problems_in(draw: st.DrawFn, dtype: torch.dtype) -> torch.Tensor:
    """The Gram matrix of a family's gradients, rounded to ``dtype``, with its largest diagonal
    entry at a power of ten that ``dtype`` holds with room (1e-2..1e2 for float16)."""
    family = draw(st.sampled_from(sorted(FAMILIES)))
    K = draw(st.sampled_from(SIZES))
    _, G = gradient_family(family, K, dim=draw(st.integers(1, 96)), seed=draw(st.integers(0, 2**31 - 1)))
    span = 2 if dtype == torch.float16 else 30
    G = G / max_diag(G) * 10.0 ** draw(st.integers(-span, span))
    return G.to(dtype)


def assert_certified_to_the_documented_tolerance(G: torch.Tensor) -> None:
    """min_norm on ``G`` (of any dtype) succeeds, and its alpha is optimal on ``G`` as given to
    the documented tolerance, checked independently of ``result.kkt``."""
    dtype, K = G.dtype, G.shape[0]
    result = mogo.min_norm(G)
    bound = documented_tolerance(dtype, K)
    eps = torch.finfo(dtype).eps
    assert result.status == "success"
    assert float(result.kkt) <= bound * (1 + eps)  # kkt itself is rounded to the dtype
    # Independently, on the matrix as given: rounding alpha to the dtype moves each (G alpha)_i
    # by up to eps/2 max_i G_ii and alpha^T G alpha by up to eps, hence 2 eps more.
    G64, alpha = G.to(torch.float64), result.alpha.to(torch.float64)
    assert_min_norm_optimal(G64, alpha, tol=bound + 2 * eps)
    value = float(alpha @ G64 @ alpha)
    assert abs(float(result.value) - value) <= 2 * eps * max_diag(G64)
    if dtype != torch.float64:
        assert f"{K} x {K} {str(dtype).removeprefix('torch.')}" in result.message


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(data=st.data())
def test_every_family_in_every_dtype_is_solved_to_the_documented_tolerance(dtype, data):
    assert_certified_to_the_documented_tolerance(data.draw(problems_in(dtype)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_dtype_and_size_of_issue_18(family, dtype):
    # The grid of issue 18, each cell solved: the Gram matrix rounded to the dtype, and formed
    # in it from gradients in it (unit largest norm, so that float16 holds every entry).
    for K in SIZES:
        J, G = gradient_family(family, K, seed=K)
        J = (J / J.norm(dim=1).max()).to(dtype)
        assert_certified_to_the_documented_tolerance((G / max_diag(G)).to(dtype))
        assert_certified_to_the_documented_tolerance(J @ J.T)


@pytest.mark.parametrize(("K", "D"), [(10, 3), (200, 50)])
def test_float32_gram_of_more_objectives_than_dimensions_is_certified(K, D):
    # Issue 18: float32 J @ J.T raised SolverError at 12 of 20 seeds (K=10, D=3), 20 of 20 (K=200).
    for seed in range(20):
        J = torch.randn(K, D, generator=torch.Generator().manual_seed(seed))
        G = J @ J.T  # computed in float32, its negative eigenvalues at float32 round-off
        result = mogo.min_norm(G)
        assert result.status == "success"
        assert "certified to kkt <= " in result.message
        assert float(result.kkt) <= documented_tolerance(torch.float32, K)
        assert_min_norm_optimal(G, result.alpha, tol=documented_tolerance(torch.float32, K) + 1e-6)


def indefinite(K: int, lowest: float, seed: int = 0) -> torch.Tensor:
    """Q diag(lowest, 1, ..., 1) Q^T in float64: max_i G_ii is about 1."""
    Q, _ = torch.linalg.qr(
        torch.randn(K, K, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    )
    eigenvalues = torch.ones(K, dtype=torch.float64)
    eigenvalues[0] = lowest
    return (Q * eigenvalues) @ Q.T


@pytest.mark.parametrize(
    ("G", "match"),
    [
        # Issue 18: each was accepted (or raised SolverError) under the allowance 100 K eps(dtype).
        (torch.tensor([[1.0, 2.0], [2.0, 1.0]]).bfloat16(), r"smallest eigenvalue / max_i G_ii = -1\b"),
        (torch.tensor([[1.0, 0.8], [0.0, 1.0]]).bfloat16(), "not symmetric"),
        (indefinite(200, -1e-3).float(), "round-off in a 200 x 200 float32 G allows 2.4e-05"),
        (indefinite(11, -1.0).half(), "round-off in a 11 x 11 float16 G allows 0.011"),
    ],
    ids=["bfloat16 indefinite", "bfloat16 asymmetric", "float32 K=200", "float16 K=11"],
)
def test_low_precision_allowance_is_k_eps_not_100_k_eps(G, match):
    with pytest.raises(ValueError, match=match):
        mogo.min_norm(G)


def test_low_precision_messages_name_the_dtype_not_float64():
    _, G = gradient_family("gaussian", 8, dim=10, seed=5)
    result = mogo.min_norm(G.float(), max_iter=1, throw=False)
    assert result.status == "max_iter"
    assert "float64" not in result.message.replace("pass G in float64", "")
    assert "tol=1e-12 + 9.5e-07 (a 8 x 8 float32 G is known only to K * eps = 9.5e-07" in result.message
    assert mogo.min_norm(G).message == ""
    assert mogo.min_norm(G.float()).message == (
        "certified to kkt <= 9.5e-07 of max_i G_ii: a 8 x 8 float32 G is known only to K * eps = 9.5e-07"
    )


@pytest.mark.parametrize("K", [2, 12])  # the single-problem path counts small K in Python
@pytest.mark.parametrize(("i", "j"), [(0, 0), (1, 1), (0, 1)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_anywhere_raises_value_error_without_warnings(K, i, j, bad):
    G = torch.eye(K, dtype=torch.float64)
    G[i, j] = G[j, i] = bad  # symmetric Infs subtract to NaN: no warning may escape (pyproject)
    with pytest.raises(ValueError, match="NaN or Inf"):
        mogo.min_norm(G)


def outcome(G: torch.Tensor) -> mogo.MinNormResult | str:
    """min_norm's result on ``G``, or the message of its ValueError."""
    try:
        return mogo.min_norm(G, throw=False)
    except ValueError as error:
        return str(error)


@given(problems(max_k=8), st.integers(-323, -308))
def test_a_subnormal_gram_matrix_is_solved_alone_as_in_a_batch(problem, exponent):
    # Issue 39, item 11: the single-problem path multiplied by 1 / max_i G_ii, which overflows for
    # a subnormal G, and raised ZeroDivisionError where the batched path solved the same G.
    _, G = problem
    scale = max_diag(G)
    G = G / scale * 10.0**exponent if scale > 0 else G  # rounded to the subnormal's few bits
    single, batched = outcome(G), outcome(G[None])
    if isinstance(batched, str):
        assert single == batched  # e.g. rounding made it indefinite: the same error
        return
    assert (single.status, single.message) == (batched.status, batched.message)
    # both certified on G as rounded (G / max_i G_ii is exact: a division of subnormals by one)
    unit = G / max_diag(G) if max_diag(G) > 0 else G
    for alpha in (single.alpha, batched.alpha[0]):
        assert_min_norm_optimal(unit, alpha, tol=2e-12)


def test_precision_declares_how_well_a_float64_gram_matrix_is_known():
    J = torch.randn(10, 3, generator=torch.Generator().manual_seed(0))
    G = J @ J.T  # float32, rank 3: its zero eigenvalues off by float32's round-off
    with pytest.raises(ValueError, match=r"round-off in a 10 x 10 float64 G allows 2\.2e-13"):
        mogo.min_norm(G.double())
    declared = mogo.min_norm(G.double(), precision=torch.float32)
    assert declared.message == mogo.min_norm(G).message  # certified as the float32 G itself
    torch.testing.assert_close(declared.alpha, mogo.min_norm(G).alpha.double(), rtol=0, atol=1e-6)
    assert mogo.project_dual_cone(G.double(), precision=torch.float32).status == "success"
    assert mogo.normalize_gram(G).precision == torch.float32
    with pytest.raises(ValueError, match=r"precision must be a floating torch\.dtype, got 'float32'"):
        mogo.min_norm(G, precision="float32")
