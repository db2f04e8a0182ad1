"""Independent references for the min-norm problem and the optimizer's gradients, used only by
the tests."""

from __future__ import annotations

import itertools

import numpy as np
import torch


def brute_force_min_norm(G: np.ndarray) -> float:
    """Smallest ``alpha^T G alpha`` over the affine minimisers of every support (K <= 10).

    Carathéodory: the optimum lies in the relative interior of the hull of an affinely independent
    subset, where it is that subset's affine minimiser. Every candidate with non-negative weights
    is feasible, so the smallest candidate value is the optimum.
    """
    K = G.shape[0]
    best = float(np.min(np.diagonal(G)))
    for size in range(2, K + 1):
        for support in itertools.combinations(range(K), size):
            index = np.array(support)
            bordered = np.ones((size + 1, size + 1))
            bordered[:size, :size] = G[np.ix_(index, index)]
            bordered[size, size] = 0.0
            rhs = np.zeros(size + 1)
            rhs[size] = 1.0
            try:
                mu = np.linalg.solve(bordered, rhs)[:size]
            except np.linalg.LinAlgError:
                continue
            if not np.all(np.isfinite(mu)) or mu.min() < -1e-12:
                continue
            mu = np.clip(mu, 0.0, None)
            mu /= mu.sum()
            best = min(best, float(mu @ G[np.ix_(index, index)] @ mu))
    return best


def quadprog_min_norm(G: np.ndarray) -> float | None:
    """quadprog's value, or None where it refuses G (it needs G positive definite)."""
    import quadprog

    K = G.shape[0]
    constraints = np.hstack([np.ones((K, 1)), np.eye(K)])
    bounds = np.concatenate([[1.0], np.zeros(K)])
    try:
        alpha = quadprog.solve_qp(G, np.zeros(K), constraints, bounds, meq=1)[0]
    except ValueError:
        return None
    alpha = np.clip(alpha, 0.0, None)
    alpha /= alpha.sum()
    return float(alpha @ G @ alpha)


def cvxpy_min_norm(J: np.ndarray) -> float | None:
    """cvxpy's value for ``min ||J^T alpha||^2`` on the simplex, or None if it fails.

    cvxpy's solvers work in absolute tolerances, so J is scaled to unit largest norm first.
    """
    import cvxpy as cp

    scale = float(np.linalg.norm(J, axis=1).max()) or 1.0
    J = J / scale
    alpha = cp.Variable(J.shape[0], nonneg=True)
    problem = cp.Problem(cp.Minimize(cp.sum_squares(J.T @ alpha)), [cp.sum(alpha) == 1])
    try:
        problem.solve()
    except cp.error.SolverError:
        return None
    if alpha.value is None:
        return None
    weights = np.clip(alpha.value, 0.0, None)
    weights /= weights.sum()
    return float(np.sum((J.T @ weights) ** 2)) * scale**2


def per_objective_gradients(
    losses: torch.Tensor, params: list[torch.Tensor]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One backward per loss, as the optimizer's ``grad_mode="sequential"`` takes them: the stacked
    gradients ``[K, *p.shape]`` per parameter (``mogo.gramian`` of them is the Gram matrix the
    optimizer forms, bit for bit) and the flat ``(K, P)`` Jacobian."""
    rows = [torch.autograd.grad(loss, params, retain_graph=True) for loss in losses]
    stacked = [torch.stack(grads) for grads in zip(*rows, strict=True)]
    return stacked, torch.cat([g.reshape(len(losses), -1) for g in stacked], dim=1)


def noisy_regression(model: torch.nn.Module, step: int, inputs: int, K: int = 3) -> torch.Tensor:
    """``(K,)`` float64 mean squared errors of ``model`` on a batch of 16 with random targets,
    drawn from ``step``'s seed."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(16, inputs, generator=generator, dtype=torch.float64)
    return ((model(x) - torch.randn(16, K, generator=generator, dtype=torch.float64)) ** 2).mean(0)
