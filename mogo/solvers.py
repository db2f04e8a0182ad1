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

import functools
import math
from typing import Literal, NamedTuple, NoReturn

import numpy as np
import torch
from scipy.linalg.lapack import dpotrf, dpotrs
from torch import Tensor

from mogo._wolfe import wolfe_batched, wolfe_single

__all__ = ["MinNormResult", "SolverError", "min_norm"]

Method = Literal["auto", "exact", "frank_wolfe", "qpth"]

DEFAULT_TOL = {"exact": 1e-12, "frank_wolfe": 1e-8, "qpth": 1e-6}
DEFAULT_MAX_ITER = {"exact": 1000, "frank_wolfe": 10_000, "qpth": 50}
# qpth needs a strictly positive definite G: it solves on G + QPTH_REG * max_i G_ii * I, which moves
# the optimal value by at most QPTH_REG * max_i G_ii.
QPTH_REG = 1e-9
EPS64 = float(np.finfo(np.float64).eps)


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
        message: what to do about a status other than success; on success, empty for a float64
            ``G`` and the precision certified for a lower one (see :func:`min_norm`).
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
    precision: torch.dtype | None = None,
) -> MinNormResult:
    """Minimum-norm point of the convex hull of K vectors given by their Gram matrix.

    Args:
        G: ``(..., K, K)`` symmetric positive semidefinite; any leading batch shape. Computation is
            in float64 whatever the dtype; results come back in ``G``'s floating dtype and device.
        method: ``"exact"`` (Wolfe's min-norm-point method, finite termination; one Cholesky
            solve when the optimum has full support; K <= 2 of a stack in closed form),
            ``"frank_wolfe"`` (the classic MGDA iteration with exact line search),
            ``"qpth"`` (differentiable interior point, needs the ``qp`` extra), or ``"auto"``
            (exact).
        tol: stopping tolerance relative to ``max_i G_ii``; defaults to 1e-12 (exact), 1e-8
            (Frank-Wolfe, on the duality gap ``f - min_i g_i``) and 1e-6 (qpth, on the KKT
            certificate).
        max_iter: iteration limit per problem (see :class:`MinNormResult`).
        throw: raise :class:`SolverError` unless the status is ``"success"``.
        precision: the floating dtype whose round-off bounds the error of ``G``'s entries (see
            Precision); default ``G``'s own. A float64 ``G`` computed from a float32 one (by
            :func:`mogo.normalize_gram`, say) is known only to float32's: pass
            ``precision=torch.float32`` (:attr:`mogo.NormalizedGram.precision`).

    Precision: each entry of a ``G`` stored in a dtype below float64 (float32, bfloat16, float16)
    is known only to ``eps / 2`` of ``max_i G_ii``, so its eigenvalues only to ``K * eps / 2``
    (the spectral norm of a K x K error of that size). Such a ``G`` is allowed asymmetry and
    negative eigenvalues down to ``rho = K * eps`` of ``max_i G_ii`` (``eps`` of its dtype:
    2**-23, 2**-7, 2**-10; for K = 200 in float32, 2.4e-5); where it is not positive definite
    it is solved as ``G + rho max_i G_ii I``, and the solve succeeds when the certificate on
    ``G`` itself, ``kkt``, is at most ``tol + rho``; the message says so. float64 (and integer)
    ``G`` is allowed ``100 K`` float64 round-offs, solved as given, and judged by ``tol``.

    Raises:
        ValueError: ``G`` is not square, is empty, holds NaN or Inf, is asymmetric beyond
            round-off, or is clearly indefinite (see Precision); ``precision`` is not a floating
            dtype. Round-off asymmetry is symmetrised away, and an eigenvalue that is negative by
            round-off only is tolerated (``value`` is clipped at 0).
        SolverError: the solve did not reach its tolerance and ``throw`` is true.

    Example:
        >>> import torch, mogo
        >>> J = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # two orthogonal unit gradients
        >>> result = mogo.min_norm(J @ J.T)
        >>> result.alpha
        tensor([0.5000, 0.5000])
        >>> result.message
        'certified to kkt <= 2.4e-07 of max_i G_ii: a 2 x 2 float32 G is known only to K * eps = 2.4e-07'
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

    G = G if isinstance(G, Tensor) else torch.as_tensor(G)
    batch_shape, K = _check_shape(G)
    known = _precision(_known_dtype(G, precision), K)
    host = G.detach() if G.requires_grad else G
    if host.dtype != torch.float64 or not host.is_cpu:
        host = host.to(device="cpu", dtype=torch.float64)
    if method == "exact" and G.ndim == 2 and G.is_cpu:
        single = _single(host.numpy(), known, tol, max_iter)
        if single is not None:  # None: a zero or bad G, which the general path handles
            return _single_result(G, *single, known, tol, max_iter, throw)
    normalized, work, scale = _prepare(host.numpy().reshape(-1, K, K), known)
    if method == "qpth":
        alpha = _qpth(G.reshape(-1, K, K), work, scale, max_iter)
        host_alpha, iterations = alpha.detach().cpu().numpy(), np.full(len(work), max_iter)
    elif method == "frank_wolfe":
        host_alpha, iterations = _frank_wolfe(torch.from_numpy(work).to(G.device), tol, max_iter)
    else:
        host_alpha, iterations = _exact(work, scale, tol, max_iter)
    kkt, value = _gap(normalized, host_alpha)
    if method != "qpth":
        return _result(
            G,
            batch_shape,
            host_alpha,
            value * scale,
            kkt,
            iterations,
            method,
            known,
            tol,
            max_iter,
            throw,
        )
    status, message = _status(method, kkt, known, tol, max_iter)
    if throw and status != "success":
        raise SolverError(message)
    output = _Output(G, batch_shape)  # keep the autograd graph from G to alpha and value
    G64 = G.to(torch.float64).reshape(-1, K, K)
    value = torch.einsum("bi,bij,bj->b", alpha, G64, alpha).reshape(batch_shape).to(output.dtype)
    alpha = alpha.reshape(*batch_shape, K).to(output.dtype)
    iterations = torch.from_numpy(iterations.reshape(tuple(batch_shape)))
    return MinNormResult(alpha, value, iterations, output(kkt), status, message)


def _single_result(
    G: Tensor,
    alpha: np.ndarray,
    value: float,
    kkt: float,
    solves: int,
    precision: _Precision,
    tol: float,
    max_iter: int,
    throw: bool,
) -> MinNormResult:
    """:func:`_result` for one problem on the CPU, with as few tensor operations as there are
    fields."""
    if kkt <= tol and not precision.below_float64:
        status, message = "success", ""
    else:
        status, message = _status("exact", np.asarray(kkt), precision, tol, max_iter)
        if throw and status != "success":
            raise SolverError(message)
    fields = torch.from_numpy(alpha), torch.from_numpy(np.array(value)), torch.from_numpy(np.array(kkt))
    if G.dtype != torch.float64:
        dtype = G.dtype if G.is_floating_point() else torch.float64
        fields = tuple(field.to(dtype) for field in fields)
    iterations = torch.from_numpy(np.array(solves, dtype=np.int64))
    return MinNormResult(fields[0], fields[1], iterations, fields[2], status, message)


def _result(
    G: Tensor,
    batch_shape: torch.Size,
    alpha: np.ndarray,
    value: np.ndarray,
    kkt: np.ndarray,
    iterations: np.ndarray,
    method: str,
    precision: _Precision,
    tol: float,
    max_iter: int,
    throw: bool,
) -> MinNormResult:
    """The result from float64 host arrays (``value`` in the units of ``G``, round-off negatives
    clipped to 0), or :class:`SolverError` when ``throw`` and the certificate misses."""
    status, message = _status(method, kkt, precision, tol, max_iter)
    if throw and status != "success":
        raise SolverError(message)
    output = _Output(G, batch_shape)
    iterations = torch.from_numpy(np.asarray(iterations, dtype=np.int64).reshape(output.shape))
    return MinNormResult(
        output(alpha, alpha.shape[-1]),
        output(np.maximum(value, 0.0)),
        iterations,
        output(kkt),
        status,
        message,
    )


class _Output:
    """Converts float64 numpy results to tensors of ``G``'s batch shape, dtype and device."""

    def __init__(self, G: Tensor, batch_shape: torch.Size) -> None:
        self.shape = tuple(batch_shape)
        self.dtype = G.dtype if G.is_floating_point() else torch.float64
        self.device = G.device
        self.converts = self.dtype != torch.float64 or self.device.type != "cpu"

    def __call__(self, array: np.ndarray, *trailing: int) -> Tensor:
        tensor = torch.from_numpy(np.asarray(array).reshape((*self.shape, *trailing)))
        return tensor.to(device=self.device, dtype=self.dtype) if self.converts else tensor


def _check_shape(G: Tensor) -> tuple[torch.Size, int]:
    shape = G.shape
    if len(shape) < 2 or shape[-1] != shape[-2]:
        raise ValueError(f"G must have shape (..., K, K), got {tuple(shape)}")
    if 0 in shape:
        raise ValueError(f"G must hold at least one 1 x 1 problem, got shape {tuple(shape)}")
    if G.is_complex():
        raise ValueError(f"G must be real, got dtype {G.dtype}")
    return shape[:-2], shape[-1]


def _known_dtype(G: Tensor, precision: torch.dtype | None) -> torch.dtype:
    """The dtype whose round-off bounds ``G``'s error: ``precision``, or ``G``'s own."""
    if precision is None:
        return G.dtype
    if not (isinstance(precision, torch.dtype) and precision.is_floating_point):
        raise ValueError(f"precision must be a floating torch.dtype, got {precision!r}")
    return precision


class _Precision(NamedTuple):
    """How well a K x K Gram matrix of one dtype is known (see :func:`min_norm`, Precision)."""

    allowance: float  # asymmetry and negative eigenvalues tolerated, relative to max_i G_ii
    below_float64: bool  # solved shifted where not positive definite, judged by tol + allowance
    name: str  # "5 x 5 float32"
    dtype: str  # "float32"


@functools.lru_cache(maxsize=256)
def _precision(dtype: torch.dtype, K: int) -> _Precision:
    short = str(dtype).removeprefix("torch.")
    if dtype.is_floating_point and torch.finfo(dtype).eps > EPS64:
        return _Precision(K * torch.finfo(dtype).eps, True, f"{K} x {K} {short}", short)
    return _Precision(100.0 * K * EPS64, False, f"{K} x {K} {short}", short)


def _single(
    G: np.ndarray, precision: _Precision, tol: float, max_iter: int
) -> tuple[np.ndarray, float, float, int] | None:
    """One (K, K) float64 problem, checked by :func:`_single_problem`, and its exact solve:
    ``(alpha, value, kkt, solves)``, or None where a check fails (the general path then finds
    out why)."""
    problem = _single_problem(G, precision)
    if problem is None:
        return None
    normalized, scale, factor, factored = problem
    work = factored if precision.below_float64 else normalized
    exact = work is factored  # factor is the Cholesky factor of work
    # The affine minimiser of a positive definite G is proportional to G^-1 1; where it is
    # positive it is optimal, the common case of K independent gradients, in one solve. With the
    # factor of G + rho I instead (float64 G, singular), x = (G + rho I)^-1 1 > 0 gives
    # G x = 1 - rho x, so mu = x / sum(x) is within rho of optimal: often enough, and certified.
    ones = np.empty(len(G))
    ones.fill(1.0)
    x = dpotrs(factor, ones)[0]
    entries = x.tolist()
    mu = x * (1.0 / sum(entries))
    if min(entries) > 0:
        kkt, value = _gap_single(normalized, mu)
        if kkt <= _certified(precision, tol):
            return mu, max(value, 0.0) * scale, kkt, 1
    pivots = factor.diagonal().tolist()  # cond(G) >= (max / min)^2: Wolfe's start needs it small
    affine = mu if exact and min(pivots) ** 2 > 1e-10 * max(pivots) ** 2 else None
    alpha, solves = wolfe_single(work, tol, max_iter, affine)
    kkt, value = _gap_single(normalized, alpha)
    return alpha, max(value, 0.0) * scale, kkt, solves


def _single_problem(
    G: np.ndarray, precision: _Precision
) -> tuple[np.ndarray, float, np.ndarray, np.ndarray] | None:
    """The checks of :func:`_prepare` on one (K, K) float64 Gram matrix, each done once:
    ``(normalized, s, factor, factored)`` with ``s = max_i G_ii``, ``normalized`` the symmetric
    part of ``G / s`` and ``factor`` the Cholesky factor of ``factored``: ``normalized`` itself,
    or ``normalized + allowance I`` where that is not positive definite. None where ``s`` is not
    positive and finite, an entry is NaN or Inf, or ``G`` is asymmetric or indefinite beyond
    the allowance (:func:`_diagnose` says which).

    Python's ``max`` and ``sum`` on lists are used where numpy's reductions cost more than the
    arithmetic (K*K <= 64 numbers). A sum is finite iff no entry is NaN or Inf (or the entries
    are near overflow, which the general path handles); ``G - G^T`` is antisymmetric, so its
    max is its largest magnitude. ``G`` is divided by ``s``, not multiplied by ``1 / s``, which
    overflows for a subnormal ``s``.
    """
    scale = max(G.diagonal().tolist())
    small = len(G) <= 8
    if not (
        0.0 < scale < math.inf and (math.isfinite(sum(G.ravel().tolist())) if small else np.isfinite(G).all())
    ):
        return None
    difference = G - G.T.copy()  # contiguous operands take numpy's fast loops
    asymmetry = max(difference.ravel().tolist()) if small else difference.max()
    if not asymmetry <= precision.allowance * scale:
        return None
    normalized = G / scale
    if asymmetry > 0:
        normalized += normalized.T.copy()
        normalized *= 0.5
    factor, info = dpotrf(normalized)
    if info == 0:
        return normalized, scale, factor, normalized
    shifted = normalized.copy()
    shifted.flat[:: len(G) + 1] += precision.allowance
    factor, info = dpotrf(shifted)
    return (normalized, scale, factor, shifted) if info == 0 else None


def _gap_single(G: np.ndarray, alpha: np.ndarray) -> tuple[float, float]:
    """:func:`_gap` of one (K, K) problem, as floats."""
    g = G.dot(alpha)
    value = float(alpha.dot(g))
    return max(value - min(g.tolist()), 0.0), value


def _certified(precision: _Precision, tol: float) -> float:
    """The largest ``kkt`` that counts as success."""
    return tol + precision.allowance if precision.below_float64 else tol


def _prepare(G: np.ndarray, precision: _Precision) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate a (B, K, K) float64 stack and scale each problem to largest diagonal 1.

    Returns ``(G / s, work, s)``: ``s`` (B,) the largest diagonal of each problem (and G / s = 0
    where s = G = 0), and the matrices to solve on: ``G / s``, shifted by the allowance where it
    is not positive definite and below float64 (see :func:`min_norm`). The checks run in numpy,
    as few operations as possible on the happy path (NaN fails every comparison);
    :func:`_diagnose` finds out what is wrong only when one fails.
    """
    scale = G.diagonal(axis1=1, axis2=2).max(axis=-1)
    if not scale.max() < np.inf:  # NaN or Inf: say so before arithmetic on it warns
        _diagnose(G, precision)
    if scale.min() > 0:
        normalized = G / scale[:, None, None]
    else:
        zero = ~G.any(axis=(1, 2))
        if not (scale[~zero] > 0).all():
            _diagnose(G, precision)
        normalized = G / np.where(zero, 1.0, scale)[:, None, None]
    transposed = normalized.transpose(0, 2, 1)
    # An Inf off the diagonal, or asymmetry (G - G^T is antisymmetric: its max is its largest
    # magnitude).
    if not np.isfinite(normalized).all() or not (normalized - transposed).max() <= precision.allowance:
        _diagnose(G, precision)
    normalized = 0.5 * (normalized + transposed)
    # Cholesky of G + allowance I exists iff no eigenvalue is below -allowance. Eigenvalues that
    # are negative by float64 round-off only are harmless to Wolfe's method and are left in place.
    definite = _positive_definite(normalized)
    work = normalized
    if not definite.all():
        shifted = normalized[~definite] + precision.allowance * np.eye(G.shape[-1])
        if not _positive_definite(shifted).all():
            _diagnose(G, precision)
        if precision.below_float64:
            work = normalized.copy()
            work[~definite] = shifted
    return normalized, work, scale


def _positive_definite(G: np.ndarray) -> np.ndarray:
    """(B,) bool: which of the (B, K, K) symmetric matrices have a Cholesky factorisation."""
    return (torch.linalg.cholesky_ex(torch.from_numpy(G)).info == 0).numpy()


def _diagnose(G: np.ndarray, precision: _Precision, *, semidefinite: bool = True) -> NoReturn:
    """Raise the ValueError that names what is wrong with the (B, K, K) stack ``G``: NaN or Inf,
    asymmetry beyond the allowance, or (``semidefinite``) a largest diagonal entry that is not
    positive or an eigenvalue below ``-allowance``. Relative to ``max_i G_ii``, or for a
    symmetric estimate that need not be semidefinite, to its largest entry ``max_ij |G_ij|``.
    The problem is named where the stack holds more than one."""

    def where(problem: int) -> str:
        return f" (problem {problem} of the flattened batch)" if len(G) > 1 else ""

    allows = f"; round-off in a {precision.name} G allows {precision.allowance:.2g}"
    if precision.below_float64:
        allows += (
            f" (a G computed in {precision.dtype} from long dot products errs by more: form it in float64)"
        )
    finite = np.isfinite(G).all(axis=(1, 2))
    if not finite.all():
        problem = _first(~finite)
        i, j = np.argwhere(~np.isfinite(G[problem]))[0]
        raise ValueError(f"G contains NaN or Inf{where(problem)}: entry ({i}, {j}) is {G[problem, i, j]}")
    zero = ~G.any(axis=(1, 2))
    if semidefinite:
        scale, unit = G.diagonal(axis1=1, axis2=2).max(axis=-1), "max_i G_ii"
        if ((scale <= 0) & ~zero).any():
            worst = _first((scale <= 0) & ~zero)
            raise ValueError(
                "G is not positive semidefinite: its largest diagonal entry is "
                f"{scale[worst]:.3g}{where(worst)}"
            )
    else:
        scale, unit = np.abs(G).max(axis=(1, 2)), "max_ij |G_ij|"
    G = G / np.where(zero, 1.0, scale)[:, None, None]
    asymmetry = np.abs(G - G.transpose(0, 2, 1)).max(axis=(1, 2))
    if asymmetry.max() > precision.allowance or not semidefinite:  # an estimate fails on nothing else
        worst = int(asymmetry.argmax())
        raise ValueError(
            f"G is not symmetric: max |G - G^T| / {unit} = {asymmetry[worst]:.3g}{where(worst)}{allows}"
        )
    lowest = np.linalg.eigvalsh(0.5 * (G + G.transpose(0, 2, 1)))[:, 0]
    worst = int(lowest.argmin())
    raise ValueError(
        f"G is not positive semidefinite: smallest eigenvalue / max_i G_ii = {lowest[worst]:.3g}"
        f"{where(worst)}{allows}"
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
    from mogo._extras import require

    require("method='qpth'", "qp")
    from qpth.qp import QPFunction, QPSolvers

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


def _status(
    method: str, kkt: np.ndarray, precision: _Precision, tol: float, max_iter: int
) -> tuple[str, str]:
    if not precision.below_float64 and kkt.max() <= tol:
        return "success", ""
    certified = _certified(precision, tol)
    known = f"a {precision.name} G is known only to K * eps = {precision.allowance:.2g}"
    if kkt.max() <= certified:
        return (
            "success",
            f"certified to kkt <= {certified:.2g} of max_i G_ii: {known}" if precision.below_float64 else "",
        )
    failed = int((kkt > certified).sum())
    if precision.below_float64:
        target = f"tol={tol:g} + {precision.allowance:.2g} ({known} of max_i G_ii)"
        exact = f"raise tol or max_iter, or pass G in float64 if it holds more digits than {precision.dtype}"
    else:
        target, exact = f"tol={tol:g}", "G is likely ill-conditioned beyond float64; raise tol or max_iter"
    advice = {
        "exact": exact,
        "frank_wolfe": "raise max_iter, loosen tol, or use method='exact'",
        "qpth": "raise max_iter, loosen tol, or use method='exact'",
    }[method]
    return "max_iter", (
        f"{method} did not reach {target} on {failed} of {kkt.size} problem(s) "
        f"within max_iter={max_iter} (worst KKT violation {kkt.max():.3g}): {advice}"
    )
