"""mogo.project_dual_cone: exact projections onto the dual cone, certified, batched."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mogo
from mogo.testing import FAMILIES, gradient_family

EPS = float(np.finfo(np.float64).eps)


@st.composite
def problems(draw: st.DrawFn, families: tuple[str, ...] = tuple(sorted(FAMILIES))):
    """``(J, G)``: K in {2, 3, 5, 10, 32} gradients of a family, scaled by 1e-12..1e12."""
    family = draw(st.sampled_from(families))
    K = draw(st.sampled_from([2, 3, 5, 10, 32]))
    dim = draw(st.integers(1, 64))
    scale = 10.0 ** draw(st.integers(-12, 12))
    return gradient_family(family, K, dim=dim, scale=scale, seed=draw(st.integers(0, 2**31 - 1)))


def moreau_residuals(J: torch.Tensor, U: torch.Tensor, V: torch.Tensor) -> tuple[float, float, float]:
    """For ``p = J^T u`` and its claimed projection ``d = J^T v``: the worst of ``<g_k, d> < 0``
    (d in the cone), of ``v < u`` (p - d in the polar cone ``-cone(J^T)``) and of
    ``<p - d, d> != 0`` (orthogonality), each relative to the size of the sums that form them."""
    norms = J.norm(dim=1)
    D = V @ J
    # ||d|| <= sum_k (|u_k| + |v_k - u_k|) ||g_k||, the scale of its round-off
    size = ((U.abs() + (V - U).abs()) * norms).sum(-1, keepdim=True)
    inner = (D @ J.T) / (norms * size).clamp_min(1e-300)
    residual = (U - V) @ J
    orthogonal = (residual * D).sum(-1) / (((U - V).abs() * norms).sum(-1) * size[:, 0]).clamp_min(1e-300)
    worst_inner, worst_bound = float((-inner).max().clamp_min(0)), float((U - V).max().clamp_min(0))
    return worst_inner, worst_bound, float(orthogonal.abs().max())


@given(problems())
def test_projections_are_certified_and_satisfy_moreau(problem):
    J, G = problem
    K = G.shape[0]
    result = mogo.project_dual_cone(G)
    assert result.status == "success"
    assert result.weights.shape == (K, K)
    assert result.kkt.shape == (K,)
    assert float(result.kkt.max()) <= 1e-12
    # Round-off of a K-term sum over K terms, in unit-gradient units: a few K eps.
    in_cone, feasible, orthogonal = moreau_residuals(J, torch.eye(K, dtype=J.dtype), result.weights)
    assert in_cone <= 100 * K * EPS
    assert feasible == 0.0
    assert orthogonal <= 100 * K * EPS
    value = torch.einsum("mi,ij,mj->m", result.weights, G, result.weights)
    scale = float(((result.weights.abs() * J.norm(dim=1)).sum(-1) ** 2).max())
    assert float((result.value - value).abs().max()) <= 100 * K * EPS * scale


@given(problems(), st.integers(0, 2**31 - 1))
def test_general_vectors_and_a_batch_match_problem_by_problem(problem, seed):
    J, G = problem
    K = G.shape[0]
    rng = np.random.default_rng(seed)
    U = torch.from_numpy(rng.standard_normal((3, K)))
    stacked = torch.stack([G, 2 * G])
    batched = mogo.project_dual_cone(stacked, U)
    assert batched.weights.shape == (2, 3, K)
    for b, factor in enumerate([1.0, 2.0]):
        alone = mogo.project_dual_cone(factor * G, U)
        atol = 1e-9 * float(U.abs().max())
        torch.testing.assert_close(batched.weights[b], alone.weights, rtol=1e-9, atol=atol)
    in_cone, feasible, orthogonal = moreau_residuals(J, U, batched.weights[0])
    assert in_cone <= 100 * K * EPS
    assert feasible == 0.0
    assert orthogonal <= 100 * K * EPS


@given(st.integers(2, 8), st.integers(0, 2**31 - 1))
def test_equals_quadprog_on_positive_definite_gram_matrices(K, seed):
    import quadprog

    _J, G = gradient_family("gaussian", K, dim=K + 4, seed=seed)
    eigenvalues = torch.linalg.eigvalsh(G)
    ours = mogo.project_dual_cone(G).weights
    for i in range(K):
        # min 1/2 v^T G v s.t. v >= e_i: quadprog's C^T v >= b with C = I.
        reference = quadprog.solve_qp(G.numpy(), np.zeros(K), np.eye(K), np.eye(K)[i])[0]
        error = float((ours[i] - torch.from_numpy(reference)).abs().max())
        # the QP's solution moves by about cond(G) eps
        assert error <= 1e3 * K * EPS * float(eigenvalues[-1] / eigenvalues[0])


def test_no_conflict_leaves_every_vector_in_place():
    J = torch.rand(4, 6, dtype=torch.float64)  # positive entries: every pair at an acute angle
    result = mogo.project_dual_cone(J @ J.T)
    assert torch.equal(result.weights, torch.eye(4, dtype=torch.float64))
    assert torch.equal(result.iterations, torch.zeros(4, dtype=torch.int64))


def test_float32_input_comes_back_float32():
    J = torch.tensor([[1.0, 0.0], [-1.0, 1.0]])
    result = mogo.project_dual_cone(J @ J.T)
    assert result.weights.dtype == torch.float32
    assert result.value.dtype == torch.float32


@pytest.mark.parametrize(
    ("G", "U", "match"),
    [
        (torch.ones(2, 3), None, r"shape \(\.\.\., K, K\)"),
        (torch.tensor([[1.0, 0.0], [0.0, float("nan")]]), None, "NaN or Inf"),
        (torch.tensor([[1.0, 2.0], [2.0, 1.0]]), None, "not positive semidefinite"),
        (torch.eye(2), torch.ones(3), r"U must have shape \(\.\.\., M, 2\)"),
        (torch.eye(2), torch.tensor([1.0, float("inf")]), "U contains NaN or Inf"),
        (torch.eye(2).expand(3, 2, 2), torch.ones(2, 1, 2), "does not broadcast"),
    ],
)
def test_bad_input_raises_naming_the_problem(G, U, match):
    with pytest.raises(ValueError, match=match):
        mogo.project_dual_cone(G, U)


def test_an_iteration_limit_too_small_is_reported():
    _, G = gradient_family("conflicting", 10, seed=1)
    with pytest.raises(mogo.SolverError, match="raise tol or max_iter"):
        mogo.project_dual_cone(G, max_iter=1)
    result = mogo.project_dual_cone(G, max_iter=1, throw=False)
    assert result.status == "max_iter"
    assert float(result.kkt.max()) > 1e-12
