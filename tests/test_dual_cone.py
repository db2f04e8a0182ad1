"""mogo.project_dual_cone: exact projections onto the dual cone, certified, batched."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from threadpoolctl import threadpool_limits

import mogo
from mogo.testing import FAMILIES, gradient_family, rank_deficient

EPS = float(np.finfo(np.float64).eps)


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


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


def assert_same_projection(J: torch.Tensor, U: torch.Tensor, V1: torch.Tensor, V2: torch.Tensor) -> None:
    """Two claimed projections ``J^T v1``, ``J^T v2`` of each ``J^T u`` are the same direction.

    The projection is unique, its weights are not (when ``J`` has dependent rows). With
    ``d_i = J^T v_i``, ``r_i = J^T (u - v_i)`` (``-J^T w_i``, ``w_i >= 0``) the Moreau parts,
    ``||d_1 - d_2||^2 = <r_2 - r_1, d_1 - d_2>``: two orthogonality residuals and two in-cone
    violations, each at most ``100 K eps`` of ``size^2`` (the bounds of
    :func:`moreau_residuals`), so ``||d_1 - d_2|| <= sqrt(400 K eps) * size``.
    """
    K = J.shape[0]
    norms = J.norm(dim=1)
    size = torch.maximum(
        ((U.abs() + (V1 - U).abs()) * norms).sum(-1), ((U.abs() + (V2 - U).abs()) * norms).sum(-1)
    )
    gap = (V1 @ J - V2 @ J).norm(dim=-1)
    bound = (400 * K * EPS) ** 0.5 * size
    worst = float((gap / size.clamp_min(1e-300)).max())
    assert bool((gap <= bound).all()), f"directions differ by {worst:.3g} of their size"


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
        # what is unique: the direction, its squared norm, and the certificate
        assert_same_projection(factor**0.5 * J, U, batched.weights[b], alone.weights)
        scale = float(((alone.weights.abs() * J.norm(dim=1)).sum(-1) ** 2).max()) * factor
        assert float((batched.value[b] - alone.value).abs().max()) <= 400 * K * EPS * scale
        assert float(batched.kkt[b].max()) <= 1e-12
    in_cone, feasible, orthogonal = moreau_residuals(J, U, batched.weights[0])
    assert in_cone <= 100 * K * EPS
    assert feasible == 0.0
    assert orthogonal <= 100 * K * EPS


# Seeds on which that solver failed, under one BLAS thread, two, or both (AMD EPYC, OpenBLAS).
FAILED_BEFORE = [116, 319, 490, 536, 902, 1508, 1725, 1989, 2100, 2109, 2919, 2931]


def assert_certified_alone_batched_and_in_pairs(J: torch.Tensor, partner: torch.Tensor, threads: int) -> None:
    """UPGrad's K projections of ``J`` succeed under ``threads`` BLAS threads (numpy's and
    torch's), and the batched solve, the single projections and a stack with ``partner`` (cut or
    padded with zero gradients to K rows) give one direction."""
    K = J.shape[0]
    G = J @ J.T
    eye = torch.eye(K, dtype=G.dtype)
    other = torch.zeros(K, partner.shape[1], dtype=G.dtype)
    other[: min(K, len(partner))] = partner[:K]
    with threadpool_limits(threads), torch_threads(threads):
        batched = mogo.project_dual_cone(G)
        alone = torch.cat([mogo.project_dual_cone(G, eye[k]).weights for k in range(K)])
        pair = mogo.project_dual_cone(torch.stack([G, other @ other.T]))
    assert batched.status == "success"
    assert float(batched.kkt.max()) <= 1e-12
    assert_same_projection(J, eye, batched.weights, alone)
    assert_same_projection(J, eye, batched.weights, pair.weights[0])
    in_cone, feasible, orthogonal = moreau_residuals(J, eye, batched.weights)
    assert in_cone <= 100 * K * EPS
    assert feasible == 0.0
    assert orthogonal <= 100 * K * EPS


@pytest.mark.parametrize("threads", [1, 2])
@given(seed=st.integers(0, 2**31 - 1), partner=st.integers(0, 2**31 - 1))
def test_rank_deficient_problems_are_certified_alone_batched_and_in_pairs(threads, seed, partner):
    assert_certified_alone_batched_and_in_pairs(rank_deficient(seed), rank_deficient(partner), threads)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("seed", FAILED_BEFORE)
def test_the_problems_a_dependent_passive_set_failed_on_are_certified(threads, seed):
    assert_certified_alone_batched_and_in_pairs(rank_deficient(seed), rank_deficient(seed + 1), threads)


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
