"""UPGrad: the mean of the gradients' projections onto their dual cone.

Quinton & Rey (2024), "Jacobian Descent for Multi-Objective Optimization", arXiv:2406.16232.
Each gradient ``g_i`` is projected onto the dual cone ``{d : <g_k, d> >= 0 for all k}`` and the
projections are averaged:

.. math::

    d = \\frac{1}{K} \\sum_i \\pi(g_i) = J^\\top w, \\qquad
    w = \\frac{1}{K} \\sum_i v^{(i)}, \\qquad v^{(i)} = \\arg\\min_{v \\ge e_i} v^\\top G v.

``d`` opposes no gradient (``J d >= 0``: it lies in the cone), equals the mean gradient when no
pair conflicts (each ``g_i`` already lies in the cone), and depends on the gradients' norms
only through the projections, so it does not lean toward the most opposed objective as the
min-norm point does. The K projections are solved exactly, in one batch, by
:func:`mogo.project_dual_cone`.
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

from mogo.dual_cone import DEFAULT_TOL, project_dual_cone
from mogo.gram import ZERO_RTOL, CheckedGram, gradient_norms, nonzero_gradients
from mogo.weighting import Certificate, CheckedWeighting, Weights

__all__ = ["UPGrad"]


class UPGrad(CheckedWeighting):
    """UPGrad weighting (Quinton & Rey 2024), solved exactly.

    Loss weights are ``w_k = s alpha_k / ||g_k||`` with ``s alpha_k = (1/K) sum_i ||g_i|| u^(i)_k``,
    where ``u^(i) = argmin_{u >= e_i} u^T Gu u`` are the projections on the Gram matrix ``Gu`` of
    the unit gradients (the same problem, well scaled): ``alpha`` is on the simplex, and ``s`` is
    the mean gradient norm when nothing conflicts. Gradients with a norm at most ``rtol`` times
    the largest count as zero (as in :func:`mogo.normalize_gram`): they constrain nothing and get
    weight 0. TorchJD keeps every gradient and gives an exact zero ``1/K``, which moves no
    direction; ``rtol=0`` does the same but for that weight.
    ``solve`` is a :class:`mogo.Certificate`: the most linear solves of any projection and the
    worst KKT violation (:class:`mogo.DualConeResult`).

    Args:
        tol: KKT tolerance of the projections.
        rtol: gradients with a norm at most this times the largest count as zero.

    Example:
        >>> import torch, mogo
        >>> J = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
        >>> w = mogo.UPGrad()(J @ J.T, torch.ones(2)).loss_weights
        >>> w
        tensor([1.0000, 0.7500], dtype=torch.float64)
        >>> J @ (w @ J)  # no gradient is opposed
        tensor([0.2500, 0.5000], dtype=torch.float64)
    """

    def __init__(self, *, tol: float = DEFAULT_TOL, rtol: float = ZERO_RTOL) -> None:
        if not tol > 0:
            raise ValueError(f"tol must be positive, got {tol}")
        if not 0 <= rtol < 1:
            raise ValueError(f"rtol must be in [0, 1), got {rtol}")
        self.tol, self.rtol = tol, rtol

    def weigh(self, gram: CheckedGram, losses: Tensor) -> Weights:
        G = gram.host
        K = G.shape[0]
        all_norms = gradient_norms(G)
        active = nonzero_gradients(all_norms, self.rtol)
        norms = all_norms[active]
        if not active.all():
            G = G[np.ix_(active, active)]
        # The K projections on the unit gradients' Gram matrix: the same problem, well scaled,
        # and known as well as G.
        result = project_dual_cone(G / np.outer(norms, norms), tol=self.tol, precision=gram.precision)
        # v^(i) >= ||g_i|| e_i in those coordinates: by homogeneity ||g_i|| times the solve's rows.
        combination = np.zeros(K)
        combination[active] = norms @ result.weights.numpy() / K
        divisor = np.where(active, all_norms, 1.0)
        certificate = Certificate(result.iterations.max(), result.kkt.max(), result.status, result.message)
        return Weights.from_combination(combination, divisor, certificate, device=gram.device)

    def __repr__(self) -> str:
        return f"UPGrad(tol={self.tol!r}, rtol={self.rtol!r})"
