"""The gated projection: the weighted sum, projected onto the dual cone only where a conflict shows
above the noise.

Keep the (tuned) weighted-sum direction ``d_ws = sum_k w_k g_k`` and change it only where it
really opposes an objective, ``c_k = <d_ws, mu_k> < 0`` for the expected gradient ``mu_k``. From
the declared estimate ``S`` of ``M M^T`` (:class:`mogo.GramEstimate`; or ``G`` itself),
``c = S w``. Where the estimate keeps its one-way cross matrix ``C = J_1 J_2^T`` of two halves
(:func:`mogo.cross_fitted_gram`, ``gram="cross_fitted"``), ``S w`` is the mean of two estimates
of ``c_k`` with independent noise, ``a_k = <d_1, g_2k> = (C^T w)_k`` and
``b_k = <d_2, g_1k> = (C w)_k``, and their spread is ``|a_k - b_k| / 2 = |(A w)_k|``,
``A = (C - C^T) / 2``. The gate opens where, for some k,

.. math::  (S w)_k < -m \\, |(A w)_k| \\qquad (m = \\text{margin}),

which at ``m = 1`` says that ``max(a_k, b_k) < 0``: the direction from each half opposes the
other half's gradient. Where ``c_k = 0`` and ``a_k``, ``b_k`` are independent Gaussians of one
spread, it opens by chance with probability ``arctan(1/m) / pi`` for that objective (1/4 at
``m = 1``, 0.1 at 3, 0.05 at 6.3). Without a cross matrix (one batch's ``G``) the spread is
taken as 0: the gate is the sign of ``G w``, the same-batch test.

Closed, the weights are those of :class:`mogo.WeightedSum` bit for bit. Open, ``d_ws`` is
projected onto the dual cone ``{d : <mu_k, d> >= 0 for all k}`` of the estimate's nearest Gram
matrix (:func:`mogo.project_dual_cone`: ``v = argmin_{v >= w} v^T G v``, DualProj's projection of
one vector; UPGrad averages K of them), which opposes no objective there and moves ``d_ws`` no
further than it must.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from mogo.dual_cone import DEFAULT_TOL, project_dual_cone
from mogo.gram import CheckedGram
from mogo.weighting import Certificate, CheckedWeighting, WeightedSum, Weights

__all__ = ["GatedProjection"]


class GatedProjection(CheckedWeighting):
    """The weighted sum, projected onto the dual cone where a conflict shows above the noise.

    ``solve`` is None while the gate is closed (the weights are ``WeightedSum(weights)``'s), and
    a :class:`mogo.Certificate` of the projection when it opens (:class:`mogo.DualConeResult`).

    Args:
        weights: the weighted sum's ``(K,)`` loss weights, non-negative, not all zero (as
            :class:`mogo.WeightedSum`); ``None`` for the mean, ``1/K`` each.
        margin: ``m >= 0``, how far below zero ``(S w)_k`` must be, in units of its spread
            between the halves (see the module docstring); 0 opens the gate on any negative
            estimate.
        tol: the projection's KKT tolerance.

    Example:
        >>> import torch, mogo
        >>> J = torch.tensor([[1.0, 0.0], [-2.0, 1.0]], dtype=torch.float64)
        >>> gated = mogo.GatedProjection()
        >>> w = gated(J @ J.T, torch.ones(2)).loss_weights  # the mean (-0.5, 0.5) opposes g_1
        >>> w, J @ (w @ J)  # projected: it no longer does
        (tensor([1.0000, 0.5000], dtype=torch.float64), tensor([0.0000, 0.5000], dtype=torch.float64))
        >>> J = torch.tensor([[1.0, 0.0], [0.5, 1.0]], dtype=torch.float64)  # 63 degrees apart
        >>> gated(J @ J.T, torch.ones(2)).loss_weights  # no conflict: the mean, untouched
        tensor([0.5000, 0.5000], dtype=torch.float64)
    """

    reads_estimate = True

    def __init__(
        self, weights: Tensor | list[float] | None = None, *, margin: float = 1.0, tol: float = DEFAULT_TOL
    ) -> None:
        if not (isinstance(margin, int | float) and 0 <= margin < np.inf):
            raise ValueError(f"margin must be a non-negative finite number, got {margin!r}")
        if not tol > 0:
            raise ValueError(f"tol must be positive, got {tol}")
        self.prior = None if weights is None else WeightedSum(weights)
        self.margin, self.tol = float(margin), float(tol)

    def weigh(self, gram: CheckedGram, losses: Tensor) -> Weights:
        K = gram.host.shape[0]
        prior = self.prior or WeightedSum(torch.full((K,), 1.0 / K, dtype=torch.float64))
        weighted_sum = prior.weigh(gram, losses)
        w = weighted_sum.loss_weights.cpu().numpy()
        if not self.conflicts(gram, w).any():
            return weighted_sum
        result = project_dual_cone(gram.host, w, tol=self.tol, precision=gram.precision)
        certificate = Certificate(
            result.iterations.reshape(()), result.kkt.reshape(()), result.status, result.message
        )
        return Weights.from_combination(result.weights.reshape(K), solve=certificate, device=gram.device)

    def conflicts(self, gram: CheckedGram, weights: np.ndarray) -> np.ndarray:
        """``(K,)`` bool: the objectives the weighted sum of ``weights`` ``(K,)`` opposes beyond
        the margin, ``(S w)_k < -m |(A w)_k|`` (the module docstring)."""
        estimate = gram.host if gram.estimate is None else gram.estimate
        inner = estimate @ weights
        if gram.cross is None:
            return inner < 0
        spread = np.abs((gram.cross - gram.cross.T) @ weights) / 2
        return inner < -self.margin * spread

    def __repr__(self) -> str:
        weights = None if self.prior is None else self.prior.weights.tolist()
        return f"GatedProjection(weights={weights!r}, margin={self.margin!r}, tol={self.tol!r})"
