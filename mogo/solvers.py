"""The minimum-norm point of a convex hull, from its Gram matrix.

Given the Gram matrix ``G = J J^T`` of K vectors (rows of ``J``), :func:`min_norm` solves

.. math::

    \\alpha^* = \\arg\\min_{\\alpha \\in \\Delta^K} \\alpha^\\top G \\alpha,
    \\qquad \\Delta^K = \\{\\alpha \\ge 0, \\textstyle\\sum_k \\alpha_k = 1\\},

the MGDA direction of Désidéri (2012) and Sener & Koltun (2018), and MARBLE's harmonization step
when ``J`` holds normalised gradients. Optimality is certified without a reference by the
Frank-Wolfe duality gap: with ``g = G alpha`` and ``f = alpha^T G alpha``,
``f - f* <= 2 (f - min_i g_i)``. ``MinNormResult.kkt`` reports that gap relative to
``max_i G_ii``; it also bounds every KKT violation (see :func:`_gap`).
"""

from __future__ import annotations

from typing import Literal, NamedTuple, NoReturn

import numpy as np
import torch
from scipy.linalg.lapack import dpotrf
from torch import Tensor

from mogo._wolfe import wolfe_batched, wolfe_single

__all__ = ["MinNormResult", "SolverError", "min_norm"]

Method = Literal["auto", "exact", "frank_wolfe", "qpth"]

DEFAULT_TOL = {"exact": 1e-12, "frank_wolfe": 1e-8, "qpth": 1e-6}
DEFAULT_MAX_ITER = {"exact": 1000, "frank_wolfe": 10_000, "qpth": 50}
# qpth needs a strictly positive definite G: it solves on G + QPTH_REG * max_i G_ii * I, which moves
# the optimal value by at most QPTH_REG * max_i G_ii.
QPTH_REG = 1e-9


class MinNormResult(NamedTuple):
    """Result of :func:`min_norm` for ``G`` of shape ``(..., K, K)``.

    Attributes:
        alpha: ``(..., K)`` weights on the simplex, in the dtype and on the device of ``G``.
        value: ``(...)`` the objective ``alpha^T G alpha``, in the units of ``G``.
        iterations: ``(...)`` int64, linear solves (exact), line searches (Frank-Wolfe), or the
            iteration limit (qpth, which does not report its count).
        kkt: ``(...)`` the Frank-Wolfe gap ``alpha^T G alpha - min_i (G alpha)_i`` relative to
            ``max_i G_ii`` (dimensionless); it bounds every KKT violation and half of
            ``f - f*``.
        status: ``"success"``, or the reason the solve did not meet ``tol``.
        message: what to do about a status other than success; empty on success.
    """

    alpha: Tensor
    value: Tensor
    iterations: Tensor
    kkt: Tensor
    status: str
    message: str


class SolverError(RuntimeError):
    """Raised by :func:`min_norm` when ``throw=True`` and the status is not ``"success"``."""


def min_norm(
    G: Tensor | np.ndarray,
    *,
    method: Method = "auto",
    tol: float | None = None,
    max_iter: int | None = None,
    throw: bool = True,
) -> MinNormResult:
    """Minimum-norm point of the convex hull of K vectors given by their Gram matrix.

    Args:
        G: ``(..., K, K)`` symmetric positive semidefinite; any leading batch shape. Computation is
            in float64 whatever the dtype; results come back in ``G``'s floating dtype and device.
        method: ``"exact"`` (Wolfe's min-norm-point method, finite termination; K <= 2 in closed
            form), ``"frank_wolfe"`` (the classic MGDA iteration with exact line search),
            ``"qpth"`` (differentiable interior point, needs the ``qp`` extra), or ``"auto"``
            (exact).
        tol: stopping tolerance relative to ``max_i G_ii``; defaults to 1e-12 (exact), 1e-8
            (Frank-Wolfe, on the duality gap ``f - min_i g_i``) and 1e-6 (qpth, on the KKT
            certificate).
        max_iter: iteration limit per problem (see :class:`MinNormResult`).
        throw: raise :class:`SolverError` unless the status is ``"success"``.

    Raises:
        ValueError: ``G`` is not square, is empty, holds NaN or Inf, is asymmetric beyond
            round-off, or is clearly indefinite. Round-off asymmetry is symmetrised away, and an
            eigenvalue that is negative by round-off only is tolerated (``value`` is clipped at 0).
        SolverError: the solve did not reach ``tol`` and ``throw`` is true.

    Example:
        >>> import torch, mogo
        >>> J = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # two orthogonal unit gradients
        >>> mogo.min_norm(J @ J.T).alpha
        tensor([0.5000, 0.5000])
    """
    method = "exact" if method == "auto" else method
    if method not in DEFAULT_TOL:
        raise ValueError(f"unknown method {method!r}; use 'auto', 'exact', 'frank_wolfe' or 'qpth'")
    tol = DEFAULT_TOL[method] if tol is None else float(tol)
    max_iter = DEFAULT_MAX_ITER[method] if max_iter is None else int(max_iter)
    if not tol > 0:
        raise ValueError(f"tol must be positive, got {tol}")
    if max_iter < 1:
        raise ValueError(f"max_iter must be at least 1, got {max_iter}")

    G = torch.as_tensor(G)
    batch_shape, K = _check_shape(G)
    host = G.detach()
    if host.dtype != torch.float64 or host.device.type != "cpu":
        host = host.to(device="cpu", dtype=torch.float64)
    work, scale = _prepare(host.numpy().reshape(-1, K, K), _round_off(G.dtype, K))
    if method == "qpth":
        alpha = _qpth(G.reshape(-1, K, K), work, scale, max_iter)
        host_alpha, iterations = alpha.detach().cpu().numpy(), np.full(len(work), max_iter)
    elif method == "frank_wolfe":
        host_alpha, iterations = _frank_wolfe(torch.from_numpy(work).to(G.device), tol, max_iter)
    else:
        host_alpha, iterations = _exact(work, scale, tol, max_iter)
    kkt, value = _gap(work, host_alpha)
    status, message = _status(method, kkt, tol, max_iter)
    if throw and status != "success":
        raise SolverError(message)
    output = _Output(G, batch_shape)
    if method == "qpth":  # keep the autograd graph from G to alpha and value
        G64 = G.to(torch.float64).reshape(-1, K, K)
        value = torch.einsum("bi,bij,bj->b", alpha, G64, alpha).reshape(batch_shape).to(output.dtype)
        alpha = alpha.reshape(*batch_shape, K).to(output.dtype)
    else:
        value = output(np.maximum(value, 0.0) * scale)  # round-off negatives clipped
        alpha = output(host_alpha, K)
    iterations = torch.from_numpy(np.asarray(iterations, dtype=np.int64).reshape(tuple(batch_shape)))
    return MinNormResult(alpha, value, iterations, output(kkt), status, message)


class _Output:
    """Converts float64 numpy results to tensors of ``G``'s batch shape, dtype and device."""

    def __init__(self, G: Tensor, batch_shape: torch.Size) -> None:
        self.shape = tuple(batch_shape)
        self.dtype = G.dtype if G.is_floating_point() else torch.float64
        self.device = G.device
        self.converts = self.dtype != torch.float64 or self.device.type != "cpu"

    def __call__(self, array: np.ndarray, *trailing: int) -> Tensor:
        tensor = torch.from_numpy(array.reshape((*self.shape, *trailing)))
        return tensor.to(device=self.device, dtype=self.dtype) if self.converts else tensor


def _check_shape(G: Tensor) -> tuple[torch.Size, int]:
    if G.ndim < 2 or G.shape[-1] != G.shape[-2]:
        raise ValueError(f"G must have shape (..., K, K), got {tuple(G.shape)}")
    if G.shape[-1] == 0 or G.numel() == 0:
        raise ValueError(f"G must hold at least one 1 x 1 problem, got shape {tuple(G.shape)}")
    if G.is_complex():
        raise ValueError(f"G must be real, got dtype {G.dtype}")
    return G.shape[:-2], G.shape[-1]


def _round_off(dtype: torch.dtype, K: int) -> float:
    """Relative size of round-off in a K x K Gram matrix computed in ``dtype``."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float64).eps
    return 100.0 * K * eps


def _prepare(G: np.ndarray, round_off: float) -> tuple[np.ndarray, np.ndarray]:
    """Validate a (B, K, K) float64 stack and scale each problem to largest diagonal 1.

    Returns ``(G / s, s)`` with ``s`` (B,) the largest diagonal of each problem (and G / s = 0
    where s = G = 0). The checks run in numpy, as few operations as possible on the happy path
    (NaN fails every comparison); :func:`_diagnose` finds out what is wrong only when one fails.
    """
    scale = G.diagonal(axis1=1, axis2=2).max(axis=-1)
    if not scale.max() < np.inf:  # NaN or Inf: say so before arithmetic on it warns
        _diagnose(G, round_off)
    if scale.min() > 0:
        normalized = G / scale[:, None, None]
    else:
        zero = ~G.any(axis=(1, 2))
        if not (scale[~zero] > 0).all():
            _diagnose(G, round_off)
        normalized = G / np.where(zero, 1.0, scale)[:, None, None]
    transposed = normalized.transpose(0, 2, 1)
    if not np.isfinite(normalized).all() or not np.abs(normalized - transposed).max() <= round_off:
        _diagnose(G, round_off)  # an Inf off the diagonal, or asymmetry
    normalized = 0.5 * (normalized + transposed)
    # Cholesky of G + round_off I exists iff no eigenvalue is below -round_off. Eigenvalues that
    # are negative by round-off only are harmless to Wolfe's method and are left in place.
    shifted = normalized + round_off * np.eye(G.shape[-1])
    if len(G) == 1:
        positive_definite = dpotrf(shifted[0])[1] == 0  # LAPACK directly: 20x less overhead
    else:
        try:
            np.linalg.cholesky(shifted)
            positive_definite = True
        except np.linalg.LinAlgError:
            positive_definite = False
    if not positive_definite:
        _diagnose(G, round_off)
    return normalized, scale


def _diagnose(G: np.ndarray, round_off: float) -> NoReturn:
    """Raise the ValueError that names what is wrong with the (B, K, K) stack ``G``."""
    where = "of the flattened batch)"
    finite = np.isfinite(G).all(axis=(1, 2))
    if not finite.all():
        raise ValueError(f"G contains NaN or Inf (problem {_first(~finite)} {where}")
    scale = G.diagonal(axis1=1, axis2=2).max(axis=-1)
    zero = ~G.any(axis=(1, 2))
    if ((scale <= 0) & ~zero).any():
        worst = _first((scale <= 0) & ~zero)
        raise ValueError(
            f"G is not positive semidefinite: its largest diagonal entry is {scale[worst]:.3g} "
            f"(problem {worst} {where}"
        )
    G = G / np.where(zero, 1.0, scale)[:, None, None]
    asymmetry = np.abs(G - G.transpose(0, 2, 1)).max(axis=(1, 2))
    if asymmetry.max() > round_off:
        worst = int(asymmetry.argmax())
        raise ValueError(
            f"G is not symmetric: max |G - G^T| / max_i G_ii = {asymmetry[worst]:.3g} "
            f"(problem {worst} {where}"
        )
    lowest = np.linalg.eigvalsh(0.5 * (G + G.transpose(0, 2, 1)))[:, 0]
    worst = int(lowest.argmin())
    raise ValueError(
        f"G is not positive semidefinite: smallest eigenvalue / max_i G_ii = {lowest[worst]:.3g} "
        f"(problem {worst} {where}"
    )


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _exact(G: np.ndarray, scale: np.ndarray, tol: float, max_iter: int) -> tuple[np.ndarray, np.ndarray]:
    """Closed form for K <= 2, Wolfe otherwise; on the CPU, where K x K problems solve fastest.

    Where every gradient is zero (``scale`` 0), every alpha is optimal; the uniform one is returned.
    """
    B, K = G.shape[:2]
    if K <= 2:
        alpha, iterations = _closed_form(G), np.ones(B, dtype=np.int64)
    elif B == 1:
        alpha, solves = wolfe_single(G[0], tol, max_iter)
        alpha, iterations = alpha[None], np.array([solves])
    else:
        alpha, iterations = (t.numpy() for t in wolfe_batched(torch.from_numpy(G), tol, max_iter))
    if not scale.min() > 0:
        alpha[scale == 0] = 1.0 / K
    return alpha, iterations


def _closed_form(G: np.ndarray) -> np.ndarray:
    """K = 1 and K = 2: ``alpha_1 = clip((G22 - G12) / (G11 + G22 - 2 G12), 0, 1)``."""
    if G.shape[-1] == 1:
        return np.ones((G.shape[0], 1))
    a, b, c = G[:, 0, 0], G[:, 1, 1], G[:, 0, 1]
    curvature = a + b - 2 * c  # ||p_1 - p_2||^2
    first = np.divide(b - c, curvature, out=np.full_like(curvature, 0.5), where=curvature > 0)
    np.clip(first, 0.0, 1.0, out=first)
    return np.stack([first, 1.0 - first], axis=-1)


def _frank_wolfe(G: Tensor, tol: float, max_iter: int) -> tuple[np.ndarray, np.ndarray]:
    """Classic MGDA: from the centre, step toward the best vertex with exact line search,
    until the duality gap ``f - min_i g_i`` is at most ``tol``. Batched in lock step."""
    B, K = G.shape[:2]
    alpha = G.new_full((B, K), 1.0 / K)
    diag = G.diagonal(dim1=-2, dim2=-1)
    iterations = torch.zeros(B, dtype=torch.long, device=G.device)
    converged = torch.zeros(B, dtype=torch.bool, device=G.device)
    for _ in range(max_iter):
        g = torch.einsum("bij,bj->bi", G, alpha)
        value = (alpha * g).sum(-1)
        g_min, j = g.min(-1)
        converged = value - g_min <= tol
        if bool(converged.all()):
            break
        # f((1 - s) alpha + s e_j) is a parabola in s with these coefficients.
        slope = value - g_min
        curvature = value - 2 * g_min + diag.gather(-1, j.unsqueeze(-1)).squeeze(-1)
        step = (slope / curvature.clamp_min(torch.finfo(G.dtype).tiny)).clamp(0, 1)
        step = torch.where(converged, torch.zeros_like(step), step)
        alpha = alpha * (1 - step).unsqueeze(-1)
        alpha[torch.arange(B, device=G.device), j] += step
        iterations += (~converged).long()
    return alpha.cpu().numpy(), iterations.cpu().numpy()


def _qpth(G: Tensor, work: np.ndarray, scale: np.ndarray, max_iter: int) -> Tensor:
    """Interior point through qpth on ``G / s + QPTH_REG I``; differentiable in ``G``.

    ``G`` (B, K, K) is the caller's tensor; ``work`` its validated normalised copy, whose values
    are used while gradients flow through ``G / s``.
    """
    try:
        from qpth.qp import QPFunction, QPSolvers
    except ImportError as error:
        raise ImportError("method='qpth' needs qpth: pip install 'mogo[qp]'") from error
    B, K = G.shape[:2]
    divisor = torch.from_numpy(np.where(scale > 0, scale, 1.0)).to(G.device)
    raw = G.to(torch.float64) / divisor[:, None, None]
    normalized = torch.from_numpy(work).to(G.device) + (raw - raw.detach())
    eye = torch.eye(K, dtype=torch.float64, device=G.device)
    Q = 2 * (normalized + QPTH_REG * eye)
    p = Q.new_zeros(B, K)
    inequality, bound = -eye.expand(B, K, K), Q.new_zeros(B, K)
    equality, total = Q.new_ones(B, 1, K), Q.new_ones(B, 1)
    solve = QPFunction(verbose=-1, eps=1e-14, maxIter=max_iter, solver=QPSolvers.PDIPM_BATCHED)
    alpha = solve(Q, p, inequality, bound, equality, total).clamp_min(0)
    return alpha / alpha.sum(-1, keepdim=True)


def _gap(G: np.ndarray, alpha: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Frank-Wolfe gap ``f - min_i g_i`` (B,) and objective ``f`` (B,) of ``alpha`` (B, K).

    For feasible ``alpha`` the gap bounds every KKT violation: ``sum_i alpha_i (g_i - f) = 0``
    and each negative term is at least ``-alpha_i * gap``, so ``alpha_i |g_i - f| <= gap``.
    """
    g = np.matmul(G, alpha[:, :, None])[:, :, 0]
    value = (alpha * g).sum(axis=-1)
    return np.maximum(value - g.min(axis=-1), 0.0), value


def _status(method: str, kkt: np.ndarray, tol: float, max_iter: int) -> tuple[str, str]:
    if kkt.max() <= tol:
        return "success", ""
    failed = int((kkt > tol).sum())
    advice = {
        "exact": "G is likely ill-conditioned beyond float64; raise tol or max_iter",
        "frank_wolfe": "raise max_iter, loosen tol, or use method='exact'",
        "qpth": "raise max_iter, loosen tol, or use method='exact'",
    }[method]
    return "max_iter", (
        f"{method} did not reach tol={tol:g} on {failed} of {kkt.size} problem(s) "
        f"within max_iter={max_iter} (worst KKT violation {kkt.max():.3g}): {advice}"
    )
