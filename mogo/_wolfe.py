"""Wolfe's minimum-norm-point method on a Gram matrix.

Wolfe (1976), "Finding the nearest point in a polytope", Math. Programming 11. The points
``p_1..p_K`` are known only through their inner products ``G_ij = <p_i, p_j>``. The method keeps a
*corral* ``S`` of affinely independent points and a feasible ``lam`` on it. A major cycle adds the
point ``j`` that most violates optimality, ``(G lam)_j < lam^T G lam``; minor cycles move ``lam``
toward the affine minimiser of ``S`` and drop points that reach zero weight. It terminates
finitely in exact arithmetic.

Two implementations of the same iteration follow: one corral per call in numpy, which costs a few
microseconds per cycle for single problems, and a lock-step masked version in torch for stacks
of problems, where every cycle is a handful of batched tensor operations and no Python loop runs
over problems. Both expect ``G`` symmetric PSD in float64 with largest diagonal 1.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.linalg.lapack import dgecon, dgesv
from torch import Tensor

__all__ = ["wolfe_batched", "wolfe_single"]


def _affine_min_norm(G_SS: np.ndarray, min_rcond: float = 0.0) -> np.ndarray | None:
    """Minimiser of ``mu^T G_SS mu`` subject to ``sum(mu) = 1``; None if the corral is singular,
    or if the system's reciprocal condition number is below ``min_rcond``.

    It solves the bordered KKT system ``[[G_SS, 1], [1^T, 0]] [mu; nu] = [0; 1]`` through LAPACK's
    ``dgesv`` directly: ``numpy.linalg.solve`` spends six times longer in argument checks. The
    condition number is estimated with ``n + 1`` for the system's 1-norm, its bound when the
    entries of ``G_SS`` are at most 1 in magnitude (a normalised PSD matrix).
    """
    n = G_SS.shape[0]
    bordered = np.ones((n + 1, n + 1))
    bordered[:n, :n] = G_SS
    bordered[n, n] = 0.0
    rhs = np.zeros(n + 1)
    rhs[n] = 1.0
    lu, _, solution, info = dgesv(bordered, rhs, overwrite_a=True, overwrite_b=True)
    if info != 0 or (min_rcond > 0 and dgecon(lu, n + 1.0)[0] < min_rcond):
        return None
    return solution[:n]


def _initial_corral(G: np.ndarray, mu: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, bool]:
    """A feasible start: the affine minimiser ``mu`` over all K points (computed here unless
    given) if that system is regular (at once optimal when the optimum has full support) or its
    positive part, else the vertex of smallest norm. Returns the corral, its weights and whether
    they are its affine minimiser.

    A nearly singular system (rank-deficient G) would start Wolfe from noise, so it is refused."""
    if mu is None:
        mu = _affine_min_norm(G, min_rcond=1e-10)
    if mu is not None:
        positive = mu > 0
        if positive.all():
            return np.arange(G.shape[0]), mu, True
        if positive.any():
            support = np.flatnonzero(positive)
            weights = mu[support]
            return support, weights / weights.sum(), False
    return np.array([int(G.diagonal().argmin())]), np.ones(1), True


def _corral_cycles(
    G: np.ndarray, support: np.ndarray, lam: np.ndarray, budget: int
) -> tuple[np.ndarray, np.ndarray, int, bool]:
    """Minor cycles: move ``lam`` toward the affine minimiser of the corral until it is interior.

    Returns the new corral, its weights, the number of solves spent and whether the corral was
    regular throughout.
    """
    solves = 0
    while solves < budget:
        solves += 1
        mu = _affine_min_norm(G.take(support, 0).take(support, 1))
        if mu is None:
            return support, lam, solves, False
        if min(mu.tolist()) > 0:
            return support, mu, solves, True
        blocking = mu <= 0
        ratios = lam[blocking] / (lam[blocking] - mu[blocking])
        leaving = ratios.argmin()
        lam = lam + ratios[leaving] * (mu - lam)
        # The blocking point leaves the corral exactly; others at round-off zero go with it.
        lam[np.flatnonzero(blocking)[leaving]] = 0.0
        keep = lam > 0
        support, lam = support[keep], lam[keep]
        lam = lam / lam.sum()
    return support, lam, solves, True


def wolfe_single(
    G: np.ndarray, tol: float, max_iter: int, affine: np.ndarray | None = None
) -> tuple[np.ndarray, int]:
    """Solve one problem. ``G``: (K, K) float64, normalised. Returns (alpha, solves).

    ``affine``, the affine minimiser over all K points where the caller has it from a
    factorisation of a well-conditioned ``G``, saves the first solve. Stops when
    ``min_i (G alpha)_i >= alpha^T G alpha - tol``, after ``max_iter`` solves, or when round-off
    stalls the corral twice; the caller judges the result by its KKT certificate.
    """
    K = G.shape[0]
    support, lam, interior = _initial_corral(G, affine)
    regular, restarted = True, False
    iterations = 1
    while True:
        if not interior:
            support, lam, solves, regular = _corral_cycles(G, support, lam, max_iter - iterations)
            iterations += solves
        g = G.take(support, 1).dot(lam)
        value = lam.dot(g[support])
        j = int(g.argmin())
        optimal = g[j] >= value - tol
        if optimal or iterations >= max_iter:
            break
        if not regular or j in support:
            # Round-off made the corral's solve inaccurate. Wolfe's own start (one vertex)
            # builds the corral one point at a time and keeps it well conditioned.
            if restarted:
                break
            restarted, interior, regular = True, True, True
            support, lam = np.array([int(G.diagonal().argmin())]), np.ones(1)
            continue
        support, lam, interior = np.concatenate((support, [j])), np.concatenate((lam, [0.0])), False
    alpha = np.zeros(K)
    alpha[support] = lam
    return alpha, iterations


def _affine_min_norm_batched(G: Tensor, corral: Tensor) -> tuple[Tensor, Tensor]:
    """Affine minimisers on each problem's corral. ``G`` (B, K, K), ``corral`` (B, K) bool.

    Points outside the corral get identity rows, hence weight exactly 0. Returns ``mu`` (B, K)
    and a (B,) mask of regular systems.
    """
    B, K = corral.shape
    inside = corral.to(G.dtype)
    bordered = G.new_zeros(B, K + 1, K + 1)
    pair = inside.unsqueeze(-1) * inside.unsqueeze(-2)
    bordered[:, :K, :K] = G * pair + torch.diag_embed(1.0 - inside)
    bordered[:, :K, K] = inside
    bordered[:, K, :K] = inside
    rhs = G.new_zeros(B, K + 1, 1)
    rhs[:, K] = 1.0
    solution, info = torch.linalg.solve_ex(bordered, rhs)
    mu = solution[:, :K, 0]
    regular = (info == 0) & torch.isfinite(mu).all(-1)
    return torch.where(corral, mu, torch.zeros_like(mu)), regular


def wolfe_batched(G: Tensor, tol: float, max_iter: int) -> tuple[Tensor, Tensor]:
    """Solve a stack of problems in lock step. ``G``: (B, K, K) float64, each normalised.

    Returns ``alpha`` (B, K) and solves per problem (B,), stopping as :func:`wolfe_single` does.
    """
    B, K = G.shape[:2]
    rows = torch.arange(B, device=G.device)
    start = G.diagonal(dim1=-2, dim2=-1).argmin(-1)
    corral = torch.zeros(B, K, dtype=torch.bool, device=G.device)
    corral[rows, start] = True
    lam = corral.to(G.dtype)
    interior = torch.ones(B, dtype=torch.bool, device=G.device)  # lam is the corral's minimiser
    done = torch.zeros_like(interior)
    iterations = torch.zeros(B, dtype=torch.long, device=G.device)
    inf = torch.tensor(float("inf"), dtype=G.dtype, device=G.device)
    for _ in range(max_iter):
        # Major cycle, for problems whose weights are the affine minimiser of their corral.
        g = torch.einsum("bij,bj->bi", G, lam)
        value = (lam * g).sum(-1)
        g_min, j = g.masked_fill(corral, inf).min(-1)
        major = interior & ~done
        optimal = major & (g_min >= value - tol)
        done |= optimal | (major & torch.isinf(g_min))  # full corral, not optimal: stalled
        grow = major & ~done
        corral = corral | (torch.nn.functional.one_hot(j, K).bool() & grow.unsqueeze(-1))
        if bool(done.all()):
            break
        # Minor cycle for every open problem.
        mu, regular = _affine_min_norm_batched(G, corral)
        open_ = ~done
        done |= open_ & ~regular
        open_ &= regular
        iterations += open_.long()
        interior = open_ & ((mu > 0) | ~corral).all(-1)
        lam = torch.where(interior.unsqueeze(-1), mu, lam)
        blocked = open_ & ~interior
        blocking = corral & (mu <= 0)
        ratios = torch.where(blocking, lam / (lam - mu).clamp_min(torch.finfo(G.dtype).tiny), inf)
        theta, leaving = ratios.min(-1)
        stepped = lam + theta.clamp(0.0, 1.0).unsqueeze(-1) * (mu - lam)
        leave = torch.nn.functional.one_hot(leaving, K).bool() | (stepped <= 0)
        stepped = stepped.masked_fill(leave, 0.0)
        stepped = stepped / stepped.sum(-1, keepdim=True).clamp_min(torch.finfo(G.dtype).tiny)
        lam = torch.where(blocked.unsqueeze(-1), stepped, lam)
        corral = torch.where(blocked.unsqueeze(-1), corral & ~leave, corral)
    return lam, iterations
