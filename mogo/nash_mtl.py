"""Nash-MTL: the Nash bargaining solution between the objectives.

Navon, Shamsian, Achituve, Maron, Kawaguchi, Chechik & Fetaya (2022), "Multi-Task Learning as a
Bargaining Game", ICML, arXiv:2202.01017. The update ``d = J^T alpha`` maximises
``sum_i log <g_i, d>`` in a ball; its weights are the positive solution of

.. math::

    \\alpha_i \\, (G \\alpha)_i = 1 \\quad (i = 1..K), \\qquad \\alpha > 0,

which is the stationarity condition of the strictly convex
``phi(alpha) = alpha^T G alpha / 2 - sum_i log alpha_i``. It is solved here by damped Newton steps
to round-off, in unit-gradient coordinates ``beta_i = ||g_i|| alpha_i`` (``beta_i (Gu beta)_i = 1``
on the Gram ``Gu`` of unit gradients), and certified by ``max_i |beta_i (Gu beta)_i - 1|``. A
solution exists exactly when the origin is outside the gradients' convex hull; when it is inside
(a Pareto-stationary point, where ``alpha`` would grow without bound) the direction is 0.

``||d||^2 = alpha^T G alpha = K`` whatever the gradients' scale; as in the paper's code, ``d`` is
then clipped to ``max_norm``.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.linalg.lapack import dposv
from torch import Tensor

from mogo.gram import ZERO_RTOL, CheckedGram, normalize_gram
from mogo.solvers import _precision, min_norm
from mogo.weighting import Certificate, CheckedWeighting, Weights

__all__ = ["NashMTL"]


class NashMTL(CheckedWeighting):
    """Nash-MTL weighting (Navon et al. 2022), solved exactly.

    Loss weights ``w_k = alpha_k`` (times the clipping factor), split as ``alpha`` on the simplex
    over ``beta / sum beta`` with divisor ``||g_k||`` and ``s = sum beta``. TorchJD's ``NashMTL``
    (an aggregator on the Jacobian, not a Gram weighting) reaches the same point by the paper's
    sequential convex approximation (20 cvxpy/ECOS solves, warm-started from its previous call, so
    its answer depends on its history); here the answer is the exact one every time. Gradients
    with a norm at most ``rtol`` times the largest count as zero and get weight 0 (with an exact
    zero in, no solution would exist). ``solve`` is a :class:`mogo.Certificate` (Newton steps, residual).

    Args:
        max_norm: clip ``||d||`` to this (the paper's and TorchJD's default 1.0); 0 disables.
        tol: residual tolerance of ``beta_i (Gu beta)_i = 1``.
        max_iter: Newton steps.
        rtol: gradients with a norm at most this times the largest count as zero.

    Example:
        >>> import torch, mogo
        >>> J = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> w = mogo.NashMTL(max_norm=0)(J @ J.T, torch.ones(2)).loss_weights
        >>> w  # alpha_i (G alpha)_i = 1: 1 * 1 = 1 and 0.5 * 2 = 1
        tensor([1.0000, 0.5000], dtype=torch.float64)
    """

    def __init__(
        self, *, max_norm: float = 1.0, tol: float = 1e-12, max_iter: int = 100, rtol: float = ZERO_RTOL
    ) -> None:
        if not (np.isfinite(max_norm) and max_norm >= 0):
            raise ValueError(f"max_norm must be a finite number >= 0, got {max_norm}")
        if not tol > 0:
            raise ValueError(f"tol must be positive, got {tol}")
        if max_iter < 1:
            raise ValueError(f"max_iter must be at least 1, got {max_iter}")
        if not 0 <= rtol < 1:
            raise ValueError(f"rtol must be in [0, 1), got {rtol}")
        self.max_norm, self.tol, self.max_iter, self.rtol = float(max_norm), float(tol), int(max_iter), rtol

    def weigh(self, gram: CheckedGram, losses: Tensor) -> Weights:
        normalized = normalize_gram(gram, "l2", rtol=self.rtol)
        unit = normalized.gram.cpu().numpy()
        A = unit.shape[0]
        # 0 in the hull, to the round-off that G's dtype allows
        closest = float(min_norm(unit, precision=normalized.precision).value)
        if closest <= _precision(normalized.precision, A).allowance:
            beta, steps, residual = np.zeros(A), 0, 0.0
        else:
            beta, steps, residual = nash_point(unit, self.tol, self.max_iter)
        norm = float(np.sqrt(max(beta @ unit @ beta, 0.0)))  # ||d||, sqrt(A) at the solution
        if self.max_norm > 0 and norm > self.max_norm:
            beta = beta * (self.max_norm / norm)
        status, message = "success", ""
        if residual > self.tol:
            status = "max_iter"
            message = (
                f"NashMTL's Newton iteration left a residual {residual:.3g} above tol={self.tol:g} "
                f"after {steps} steps: the origin is nearly in the gradients' hull; raise max_iter"
            )
        certificate = Certificate(
            torch.tensor(steps), torch.tensor(residual, dtype=torch.float64), status, message
        )
        combination = normalized.expand(torch.from_numpy(beta).to(gram.device))
        return Weights.from_combination(combination, normalized.scale, certificate)

    def __repr__(self) -> str:
        return (
            f"NashMTL(max_norm={self.max_norm!r}, tol={self.tol!r}, max_iter={self.max_iter!r}, "
            f"rtol={self.rtol!r})"
        )


def nash_point(G: np.ndarray, tol: float, max_iter: int) -> tuple[np.ndarray, int, float]:
    """``beta > 0`` with ``beta_i (G beta)_i = 1`` for a unit-diagonal Gram ``G`` (K, K) whose
    hull excludes the origin; the Newton steps taken and the residual ``max_i |beta_i (G beta)_i - 1|``.
    """
    K = G.shape[0]
    beta = np.full(K, np.sqrt(K / max(float(G.sum()), np.finfo(np.float64).tiny)))

    def phi(b: np.ndarray) -> float:
        return 0.5 * float(b @ G @ b) - float(np.log(b).sum())

    for steps in range(max_iter):
        Gb = G @ beta
        residual = float(np.abs(beta * Gb - 1).max())
        if residual <= tol:
            return beta, steps, residual
        gradient = Gb - 1 / beta
        hessian = G + np.diag(1 / beta**2)
        _, step, info = dposv(hessian, -gradient)
        if info != 0:
            step = np.linalg.lstsq(hessian, -gradient, rcond=None)[0]
        # Stay positive (a step of 0.99 of the way to the boundary at most), then backtrack.
        shrinking = step < 0
        t = min(1.0, 0.99 * float((beta[shrinking] / -step[shrinking]).min())) if shrinking.any() else 1.0
        current, slope = phi(beta), float(gradient @ step)
        # Near the solution (Newton decrement -slope small) the full step converges
        # quadratically, and phi's differences are round-off: no line search there.
        while -slope > 1e-8 and t > 1e-12 and phi(beta + t * step) > current + 0.25 * t * slope:
            t /= 2
        beta = beta + t * step
    Gb = G @ beta
    return beta, max_iter, float(np.abs(beta * Gb - 1).max())
