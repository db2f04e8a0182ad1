"""CAGrad: the best worst-case improvement within a ball around the mean gradient.

Liu, Liu, Jin, Stone & Liu (2021), "Conflict-Averse Gradient Descent for Multi-task Learning",
NeurIPS, arXiv:2110.14048. With the mean gradient ``g0``, ``b = G 1 / K`` (``b_i = <g_i, g0>``) and
``rho = c ||g0||``, the dual of the paper's problem is

.. math::

    w^* = \\arg\\min_{w \\in \\Delta^K} F(w) = b^\\top w + \\rho \\sqrt{w^\\top G w},
    \\qquad d = g_0 + \\frac{\\rho}{\\|g_{w^*}\\|} g_{w^*}, \\quad g_w = J^\\top w,

so the loss weights are ``1/K + rho w* / ||g_w*||`` (Algorithm 1; the official code's ``rescale``
divides them by ``1 + c^2``). ``F`` is solved exactly through ``||x|| = min_t (x^2/t + t)/2``: for
``tau = t / rho`` the inner problem is the min-norm point of the hull of ``g_i + tau g0``,

.. math::

    w(\\tau) = \\arg\\min_{w \\in \\Delta^K} \\|g_w + \\tau g_0\\|^2 \\qquad (\\text{one min-norm solve}),

and the optimal ``tau`` is the root of the non-decreasing ``psi(tau) = rho tau - ||g_w(tau)||``
(the derivative's sign of a convex function of ``t``), found by Brent's method to round-off. The
certificate is the Frank-Wolfe gap of ``F`` at ``w*``, ``w^T grad F - min_i (grad F)_i >= F(w) - F*``,
relative to ``(1 + c) ||g0|| max_k ||g_k||``.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import brentq
from torch import Tensor

from mogo.gram import CheckedGram, _nearest_psd
from mogo.solvers import min_norm
from mogo.weighting import Certificate, CheckedWeighting, Weights

__all__ = ["CAGrad"]


class CAGrad(CheckedWeighting):
    """CAGrad weighting (Liu et al. 2021), solved exactly.

    Loss weights ``w = 1/K + rho w* / ||g_w*||`` (``alpha = w / sum w`` on the simplex, divisor 1,
    ``s = sum w``), as TorchJD's ``CAGradWeighting(c)``. Where the optimal ``g_w*`` vanishes (the
    origin in the gradients' hull, e.g. two opposite gradients: ``||g_w*||`` at most
    ``1e-6 max_k ||g_k||``, below what the inner solves resolve) the dual loses the direction
    and the weights are 0, as TorchJD's, which gives 0 whenever ``||g_w*||`` is below
    ``norm_eps`` (1e-4 of ``||J||_F``). ``solve`` is a :class:`mogo.Certificate`: min-norm
    solves, and the Frank-Wolfe gap of ``F``.

    Args:
        c: radius of the ball around ``g0``, relative to ``||g0||`` (``c = 0`` is the mean);
            the paper uses 0.2 to 0.8.
        rescale: divide the weights by ``1 + c^2`` (the official code's ``rescale=1``).

    Example:
        >>> import torch, mogo
        >>> J = torch.tensor([[1.0, 0.0], [-0.5, 1.0]], dtype=torch.float64)
        >>> w = mogo.CAGrad(c=0.5)(J @ J.T, torch.ones(2)).loss_weights
        >>> (J @ (w @ J)).min() > 0  # the worst improvement is positive
        tensor(True)
    """

    def __init__(self, c: float = 0.5, *, rescale: bool = False) -> None:
        if not (np.isfinite(c) and c >= 0):
            raise ValueError(f"c must be a finite number >= 0, got {c}")
        self.c, self.rescale = float(c), bool(rescale)

    def weigh(self, gram: CheckedGram, losses: Tensor) -> Weights:
        K = gram.host.shape[0]
        w, iterations, kkt = cagrad_weights(gram.host, self.c)
        if self.rescale:
            w = w / (1 + self.c**2)
        combination = torch.from_numpy(w).to(gram.device)
        return Weights.from_combination(combination, solve=Certificate(*_certificate(iterations, kkt, K)))

    def __repr__(self) -> str:
        return f"CAGrad(c={self.c!r}, rescale={self.rescale!r})"


_RTOL = 4 * np.finfo(np.float64).eps
VANISHING = 1e-6
"""``||g_w*||``, relative to the largest gradient norm, at or below which the optimum counts as
``g_w* = 0`` (the origin in the hull): each inner solve certifies ``||g_w + tau g0||^2`` to 1e-12
of ``max_k ||g_k||^2`` (``min_norm``'s tolerance), so a smaller ``||g_w*||`` cannot be told from
0, and weights ``rho / ||g_w*||`` would be set by round-off."""


def cagrad_weights(G: np.ndarray, c: float) -> tuple[np.ndarray, int, float]:
    """CAGrad's loss weights ``(K,)`` for the Gram matrix ``G`` (K, K) (checked by
    :func:`mogo.check_gram`), the min-norm solves spent and the certificate (see the module
    docstring)."""
    K = G.shape[0]
    mean = np.full(K, 1.0 / K)
    G = G / np.diagonal(G).max()  # the weights are invariant to the scale of G
    b = G @ mean
    g0_sq = max(float(mean @ b), 0.0)
    rho = c * np.sqrt(g0_sq)
    if not rho > 0:
        return mean, 0, 0.0
    solves = 0

    def inner(tau: float) -> np.ndarray:
        nonlocal solves
        solves += 1
        # The Gram matrix of g_i + tau g0; where those points nearly cancel, forming it from G
        # leaves round-off negative eigenvalues, which are clipped.
        shifted = _nearest_psd(G + tau * (b[:, None] + b[None, :]) + tau**2 * g0_sq)
        return min_norm(shifted, throw=False).alpha.numpy()

    def psi(tau: float) -> float:
        w = inner(tau)
        return rho * tau - np.sqrt(max(float(w @ G @ w), 0.0))

    hi = float(np.sqrt(np.diagonal(G).max())) / rho  # ||g_w|| <= max_k ||g_k||
    lo, value = hi, psi(hi)
    while value > 0 and lo > hi * 1e-18:  # bracket the root from above
        lo /= 16
        value = psi(lo)
    if value > 0:  # psi > 0 down to tau = 0: the optimal g_w vanishes
        return np.zeros(K), solves, 0.0
    tau = brentq(psi, lo, hi, xtol=1e-300, rtol=_RTOL, maxiter=200) if lo < hi else hi
    w = inner(tau)
    g_w = np.sqrt(max(float(w @ G @ w), 0.0))
    if not g_w > VANISHING:  # the dual's optimum is at g_w = 0, where it loses the direction
        return np.zeros(K), solves, 0.0
    grad = b + rho * (G @ w) / g_w
    gap = max(float(w @ grad - grad.min()), 0.0)
    return mean + (rho / g_w) * w, solves, gap / ((1 + c) * np.sqrt(g0_sq))


def _certificate(iterations: int, kkt: float, K: int) -> tuple[Tensor, Tensor, str, str]:
    tol = 1e-9
    status, message = "success", ""
    if kkt > tol:
        status = "round_off"
        message = f"CAGrad's Frank-Wolfe gap {kkt:.3g} is above {tol:g}: G is ill-conditioned beyond float64"
    return torch.tensor(iterations), torch.tensor(kkt, dtype=torch.float64), status, message
