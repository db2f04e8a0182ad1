"""Projections onto the dual cone of K gradients, from their Gram matrix.

For gradients ``g_1..g_K`` (rows of ``J``, ``G = J J^T``) the dual cone is
``C* = {d : <g_k, d> >= 0 for every k}``, the directions that oppose no gradient. The projection of
``J^T u`` onto it is ``J^T v`` with (Quinton & Rey 2024, Proposition 1)

.. math::

    v^* = \\arg\\min_{v \\ge u} v^\\top G v,

a non-negative quadratic program in ``x = v - u``. :func:`project_dual_cone` solves it exactly with
the active-set method of Lawson & Hanson (1974) on the Gram matrix (the form of Bro & De Jong,
1997): a passive set ``P`` of coordinates with ``v_j > u_j``, on which ``(G v)_P = 0`` is solved
exactly, grows by the most violated constraint and shrinks when a coordinate would leave the
feasible set. It starts from every constraint violated at ``v = u`` (for UPGrad, the gradients
that conflict with ``g_i``), often the optimal set. Every problem of a stack runs in lock step,
one batched linear solve per cycle, with no Python loop over problems.

Optimality is certified without a reference by the KKT conditions, ``G v >= 0`` and
``(G v)_j = 0`` where ``v_j > u_j``: ``DualConeResult.kkt`` is the largest violation, computed in
the coordinates of unit gradients, relative to ``||u||_1 + ||v - u||_1``, which bounds every
``|(G v)_j|`` there and sets the scale of its round-off.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from mogo.solvers import SolverError, _check_shape, _known_dtype, _Output, _precision, _prepare

__all__ = ["DualConeResult", "project_dual_cone"]

DEFAULT_TOL = 1e-12
# Rank test of a passive set, per column of the unit-diagonal Gram matrix: a column whose Schur
# complement against the others is at most 100 K float64 round-offs (the asymmetry min_norm
# tolerates in a float64 G) counts as dependent on them.
RANK_TOL = 100.0 * float(np.finfo(np.float64).eps)


class DualConeResult(NamedTuple):
    """Result of :func:`project_dual_cone` for ``G`` ``(..., K, K)`` and ``U`` ``(..., M, K)``.

    Attributes:
        weights: ``(..., M, K)`` ``v`` for each row ``u`` of ``U``: ``J^T v`` is the projection of
            ``J^T u`` onto the dual cone. Dtype and device of ``G``.
        value: ``(..., M)`` ``v^T G v``, the squared norm of the projection, in the units of ``G``.
        iterations: ``(..., M)`` int64, linear solves per problem.
        kkt: ``(..., M)`` the largest KKT violation (dimensionless, see the module docstring).
        status: ``"success"``, or the reason the solve did not meet ``tol``.
        message: what to do about a status other than success; empty on success.
    """

    weights: Tensor
    value: Tensor
    iterations: Tensor
    kkt: Tensor
    status: str
    message: str


def project_dual_cone(
    G: Tensor | np.ndarray,
    U: Tensor | np.ndarray | None = None,
    *,
    tol: float = DEFAULT_TOL,
    max_iter: int | None = None,
    throw: bool = True,
    precision: torch.dtype | None = None,
) -> DualConeResult:
    """Weights of the projections of ``J^T u`` onto the dual cone of the rows of ``J``.

    Args:
        G: ``(..., K, K)`` symmetric positive semidefinite Gram matrix; computed in float64.
        U: ``(..., M, K)`` the vectors ``u`` to project (broadcast against ``G``'s batch shape);
            ``None`` for the K unit vectors ``e_1..e_K`` (UPGrad's projections, ``M = K``).
        tol: stopping tolerance on the KKT violation (see :class:`DualConeResult`).
        max_iter: linear solves per problem; default ``3 K + 10``.
        throw: raise :class:`mogo.SolverError` unless the status is ``"success"``.
        precision: the dtype whose round-off bounds ``G``'s error, as in :func:`mogo.min_norm`.

    Raises:
        ValueError: as :func:`mogo.min_norm` on a malformed ``G``; ``U`` of the wrong shape or
            not finite.
        SolverError: the solve did not reach ``tol`` and ``throw`` is true.

    Example:
        >>> import torch, mogo
        >>> J = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)  # 135 degrees apart
        >>> result = mogo.project_dual_cone(J @ J.T)
        >>> result.weights  # row i: v with J^T v the projection of g_i
        tensor([[1.0000, 0.5000],
                [1.0000, 1.0000]], dtype=torch.float64)
        >>> inner = J @ (J.T @ result.weights.T)  # <g_k, projection of g_i>, zero up to round-off
        >>> bool((inner >= -1e-15).all())  # every projection is at 90 degrees or less to both
        True
    """
    if not tol > 0:
        raise ValueError(f"tol must be positive, got {tol}")
    G = torch.as_tensor(G)
    batch_shape, K = _check_shape(G)
    max_iter = 3 * K + 10 if max_iter is None else int(max_iter)
    if max_iter < 1:
        raise ValueError(f"max_iter must be at least 1, got {max_iter}")
    host = G.detach()
    if host.dtype != torch.float64 or host.device.type != "cpu":
        host = host.to(device="cpu", dtype=torch.float64)
    # validated, symmetrised, scaled to largest diagonal 1 (scale s); below float64, shifted by
    # the dtype's round-off allowance where not positive definite, as min_norm solves it
    _, work, scale = _prepare(host.numpy().reshape(-1, K, K), _precision(_known_dtype(G, precision), K))
    N = len(work)
    if U is None:
        eye = np.eye(K)
        U_host = eye[None]
    else:
        U_t = torch.as_tensor(U).detach().to(device="cpu", dtype=torch.float64)
        if U_t.ndim < 1 or U_t.shape[-1] != K:
            raise ValueError(f"U must have shape (..., M, {K}), got {tuple(U_t.shape)}")
        if not bool(torch.isfinite(U_t).all()):
            raise ValueError("U contains NaN or Inf")
        U_t = U_t.reshape(1, K) if U_t.ndim == 1 else U_t
        try:
            U_t = U_t.expand(*batch_shape, *U_t.shape[-2:])
        except RuntimeError:
            raise ValueError(
                f"U's shape {tuple(U_t.shape)} does not broadcast to G's batch shape {tuple(batch_shape)}"
            ) from None
        U_host = U_t.reshape(N, -1, K).numpy()
    M = U_host.shape[1]
    # Unit-gradient coordinates: v_hat = D v, u_hat = D u with D = sqrt(diag G); the problem is
    # unchanged and well scaled even when norms differ by decades. Zero gradients keep D = 1.
    diag = np.sqrt(np.maximum(work.diagonal(axis1=1, axis2=2), 0.0))
    D = np.where(diag > 0, diag, 1.0)
    unit = work / (D[:, :, None] * D[:, None, :])
    stacked = unit if M == 1 or N == 1 else np.repeat(unit, M, axis=0)  # one G broadcasts over M
    if U is None:
        # u_hat = D_i e_i; by homogeneity solve for e_i (rhs: -G e_i, a row of G) and scale by D_i
        unit_u = eye if N == 1 else np.tile(eye, (N, 1))
        row_scale = D.reshape(N * K, 1)
        rhs = -unit.reshape(N * K, K)
        size = np.ones(N * K)
    else:
        unit_u = (U_host * D[:, None, :]).reshape(N * M, K)
        row_scale = np.ones((N * M, 1))
        rhs = -np.matmul(stacked, unit_u[:, :, None])[:, :, 0]
        size = np.abs(unit_u).sum(axis=-1)
    x, g, passive, iterations = _lawson_hanson(stacked, rhs, size, tol, max_iter)
    violation = np.maximum(np.where(passive, np.abs(g), -g).max(axis=-1), 0.0)
    size = size + x.sum(axis=-1)  # ||u_hat||_1 + ||v_hat - u_hat||_1
    kkt = (
        violation / size
        if size.min() > 0
        else np.divide(violation, size, out=np.zeros_like(size), where=size > 0)
    )
    value = (((unit_u + x) * g).sum(axis=-1) * row_scale[:, 0] ** 2).reshape(N, M)
    value = np.maximum(value, 0.0) * scale[:, None]
    v = U_host + (x * row_scale).reshape(N, M, K) / D[:, None, :]  # v >= u exactly
    failed = int((kkt > tol).sum())
    status, message = "success", ""
    if failed:
        status = "max_iter" if iterations.max() >= max_iter else "round_off"
        message = (
            f"project_dual_cone did not reach tol={tol:g} on {failed} of {kkt.size} problem(s) "
            f"(worst KKT violation {kkt.max():.3g}, max_iter={max_iter}): G is likely "
            "ill-conditioned beyond float64; raise tol or max_iter"
        )
        if throw:
            raise SolverError(message)
    output = _Output(G, batch_shape)
    return DualConeResult(
        output(v, M, K),
        output(value, M),
        torch.from_numpy(iterations.reshape(*batch_shape, M)),
        output(kkt, M),
        status,
        message,
    )


def _independent_subset(G: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """A maximal numerically independent subset (B, K) of each problem's ``candidates`` (B, K).

    Greedy pivoted Cholesky (as LAPACK's ``pstrf``): each pass takes the candidate with the
    largest Schur complement ``s_j = G_jj - G_jS G_SS^-1 G_Sj`` against the columns ``S`` taken
    so far, while it exceeds ``RANK_TOL * K``: a column below lies closer to their span than
    float64 round-off in ``G`` can tell apart.
    """
    B, K = candidates.shape
    rank_tol = RANK_TOL * K
    rows = np.arange(B)
    schur = np.where(candidates, G.diagonal(axis1=1, axis2=2), 0.0)
    factor = np.zeros((B, K, 0))  # columns of the Cholesky factor of the columns taken
    taken = np.zeros_like(candidates)
    for _ in range(K):
        pivot = schur.argmax(axis=-1)
        grow = schur[rows, pivot] > rank_tol
        if not grow.any():
            break
        column_of_G = G[rows if len(G) > 1 else 0, :, pivot]  # (B, K)
        column = column_of_G - np.matmul(factor, factor[rows, pivot][:, :, None])[:, :, 0]
        column /= np.sqrt(np.where(grow, schur[rows, pivot], 1.0))[:, None]
        column[~grow] = 0.0
        factor = np.concatenate([factor, column[:, :, None]], axis=-1)
        taken[rows[grow], pivot[grow]] = True
        schur = np.where(candidates & ~taken, schur - column**2, 0.0)
    return taken


def _solve_passive(
    G: np.ndarray, rhs: np.ndarray, passive: np.ndarray, *, least_squares: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """``z`` (B, K) with ``G_PP z_P = rhs_P`` and ``z = 0`` off each problem's passive set ``P``,
    and whether each ``P`` passed the rank test (B,).

    The test: the Cholesky factorisation of ``G_PP`` exists and every pivot, the Schur
    complement of a column against the columns of ``P`` before it, exceeds ``RANK_TOL * K``
    (a subset of a set that passes passes too). Coordinates outside ``P`` get identity rows.
    Where the test fails, ``z`` is the least-squares solution (``least_squares``), or
    meaningless for the caller to replace.
    """
    B, K = rhs.shape
    A = np.where(passive[:, :, None] & passive[:, None, :], G, 0.0)
    A.reshape(B, -1)[:, :: K + 1] += ~passive
    b = torch.from_numpy(np.where(passive, rhs, 0.0)[:, :, None])
    factor, info = torch.linalg.cholesky_ex(torch.from_numpy(A))
    pivots = factor.diagonal(dim1=-2, dim2=-1).numpy() ** 2
    independent = (info == 0).numpy() & (pivots.min(axis=-1) > RANK_TOL * K)
    z = torch.cholesky_solve(b, factor)[:, :, 0].numpy()
    if least_squares and not independent.all():
        failed = ~independent
        z[failed] = np.matmul(np.linalg.pinv(A[failed], hermitian=True), b.numpy()[failed])[:, :, 0]
    return np.where(passive, z, 0.0), independent


def _lawson_hanson(
    G: np.ndarray, rhs: np.ndarray, size: np.ndarray, tol: float, max_iter: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``min_{x >= 0} (u + x)^T G (u + x)`` for a stack: ``G`` (B, K, K) unit-diagonal PSD (or one
    ``(1, K, K)`` for all), ``rhs = -G u`` (B, K), ``size = ||u||_1`` (B,).

    Returns ``x`` (B, K), ``g = G (u + x)`` (B, K), the passive sets ``x > 0`` (B, K) and the linear
    solves per problem (B,). The stationarity condition on the passive set is
    ``G_PP x_P = rhs_P``, which has one solution only while the columns of ``P`` are independent:
    Lawson-Hanson keeps them so in exact arithmetic, and here a rank test with a tolerance keeps
    them so in floating point, whatever the BLAS (a singular system is not always flagged by an
    LU solve). The first passive set is a maximal independent subset of the constraints violated
    at ``x = 0`` (for UPGrad: the gradients that conflict with ``g_i``), often the optimal set;
    where its solution is not positive, its positive part is a feasible start for the minor
    cycles. A constraint is added only where its column is independent of the passive set: a
    dependent one cannot be violated in exact arithmetic (its ``g_j`` is a combination of the
    passive ``g_P = 0``), so its violation is round-off, and that problem stops for the KKT
    certificate to judge.
    """
    B, K = rhs.shape
    rows = np.arange(B)
    violated = rhs > tol * size[:, None]
    done = ~violated.any(axis=-1)
    x = np.zeros((B, K))
    iterations = np.zeros(B, dtype=np.int64)
    if done.all():
        return x, -rhs, violated, iterations
    passive = violated
    z, independent = _solve_passive(G, rhs, passive, least_squares=False)
    if not independent.all():
        dependent = np.flatnonzero(~independent)
        own = G if len(G) == 1 else G[dependent]
        passive[dependent] = _independent_subset(own, passive[dependent])
        z[dependent], _ = _solve_passive(own, rhs[dependent], passive[dependent])
    # Shrink it to the coordinates its solution keeps positive until that solution is positive
    # throughout (each solve drops several at once; at most K solves): an exact minimiser on its
    # passive set, where Lawson-Hanson's major cycles start. Subsets of an independent set stay
    # independent.
    iterations += ~done
    interior = done.copy()
    for _ in range(K):
        positive = (z > 0) | ~passive
        interior |= positive.all(axis=-1)
        passive &= positive
        if interior.all():
            break
        z, _ = _solve_passive(G, rhs, passive)
        iterations += ~interior
    x = np.where(passive, z, 0.0)
    for _ in range(max_iter - 1):
        # Major cycle: add the most violated constraint, or stop.
        g = np.matmul(G, x[:, :, None])[:, :, 0] - rhs
        masked = np.where(passive, np.inf, g)
        j = masked.argmin(axis=-1)
        major = interior & ~done
        done |= major & ~(masked[rows, j] < -tol * (size + x.sum(axis=-1)))
        if done.all():
            return x, g, passive, iterations
        grow = major & ~done
        passive[rows, j] |= grow
        # Minor cycle: the passive set's minimiser, or a step back to the first coordinate it
        # would push below u, which then leaves the passive set.
        open_ = ~done
        index = rows if open_.all() else np.flatnonzero(open_)  # open problems only: they finish apart
        z = np.zeros((B, K))
        z[index], independent = _solve_passive(G if len(G) == 1 else G[index], rhs[index], passive[index])
        iterations += open_
        # A constraint whose column depends on the passive set is round-off: take it back, stop.
        dependent = np.zeros(B, dtype=bool)
        dependent[index] = grow[index] & ~independent
        passive[rows[dependent], j[dependent]] = False
        done |= dependent
        open_ &= ~dependent
        positive = ((z > 0) | ~passive).all(axis=-1)
        interior = open_ & positive
        blocked = open_ & ~positive
        x[interior] = z[interior]
        if blocked.any():
            # A constraint just added that cannot be met is round-off, not a violation: stop.
            stalled = blocked & grow & (z[rows, j] <= 0)
            done |= stalled
            blocked &= ~stalled
            blocking = passive & (z <= 0) & blocked[:, None]
            with np.errstate(divide="ignore", invalid="ignore"):
                ratios = np.where(blocking, x / (x - z), np.inf)
            leaving = ratios.argmin(axis=-1)
            theta = np.clip(ratios[rows, leaving], 0.0, 1.0)[:, None]
            stepped = np.where(blocked[:, None], x + theta * (z - x), x)
            stepped[rows[blocked], leaving[blocked]] = 0.0
            passive &= stepped > 0
            x = np.where(passive, stepped, 0.0)
    return x, np.matmul(G, x[:, :, None])[:, :, 0] - rhs, passive, iterations
