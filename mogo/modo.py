"""MoDo: one projected gradient step on the min-norm weights per call, on an unbiased Gram estimate.

Chen, Fernando, Ying & Chen (2023), "Three-Way Trade-Off in Multi-Objective Learning:
Optimization, Generalization and Conflict-Avoidance", NeurIPS 2023; JMLR 25 (2024),
arXiv:2305.20057. MoDo (multi-objective gradient with double sampling) keeps weights ``lambda``
on the simplex and takes, at every step, one projected gradient step on
``f(lambda) = ||J^T lambda||^2 / 2 + rho ||lambda||^2 / 2`` (MGDA's problem, regularised):

.. math::

    \\lambda \\leftarrow \\Pi_\\Delta\\big(\\lambda - \\gamma\\,(A \\lambda + \\rho \\lambda)\\big),
    \\qquad d = J^\\top \\lambda,

where ``A = J_1 J_2^T`` is formed from two independent batches: an unbiased estimate of
``M M^T`` for the expected gradients ``M``, where one batch's ``J J^T`` carries the noise on its
diagonal ("double sampling"). TorchJD's ``MoDoWeighting`` takes that one-way matrix.

Here ``A`` is the declared estimate (:class:`mogo.GramEstimate`): under
``HarmonizedOptimizer(..., gram="cross_fitted")`` the cross-fitted ``(G_12 + G_21) / 2``, the
mean of the two one-way matrices, so the step is the mean of their two steps (it is linear in
``A``) with the same expectation and no more variance. Given an ordinary Gram matrix it steps on
``G`` itself (one batch: the paper's guarantee does not hold). ``gamma`` is a step size in the
units of ``1 / G``: set it from the gradients' scale.
"""

from __future__ import annotations

import math

from torch import Tensor

from mogo.gram import CheckedGram
from mogo.simplex import SimplexIterated, project_onto_simplex
from mogo.weighting import Weights

__all__ = ["MoDo"]


class MoDo(SimplexIterated):
    """MoDo weighting (Chen et al. 2023), TorchJD's ``MoDoWeighting`` on the same matrix.

    Loss weights ``w = lambda`` after this call's step (divisor 1, ``s = sum lambda = 1``);
    ``lambda`` carries over to the next call (:class:`mogo.simplex.SimplexIterated`: uniform at
    first and when K changes; :meth:`~mogo.simplex.SimplexIterated.state_dict`).

    Args:
        gamma: step size of the weights' update, positive, in units of ``1 / G``.
        rho: non-negative l2 regularisation of the weights.

    Example:
        >>> import torch, mogo
        >>> J = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> modo = mogo.MoDo(gamma=0.1, rho=0.0)
        >>> modo(J @ J.T, torch.ones(2)).loss_weights  # (1/2, 1/2) - 0.1 (1/2, 2), projected
        tensor([0.5750, 0.4250], dtype=torch.float64)
        >>> modo(J @ J.T, torch.ones(2)).loss_weights  # the next step, from there
        tensor([0.6312, 0.3688], dtype=torch.float64)
    """

    def __init__(self, gamma: float = 0.1, rho: float = 0.1) -> None:
        if not (isinstance(gamma, int | float) and 0 < gamma < math.inf):
            raise ValueError(f"gamma must be a positive finite number, got {gamma!r}")
        if not (isinstance(rho, int | float) and 0 <= rho < math.inf):
            raise ValueError(f"rho must be a non-negative finite number, got {rho!r}")
        super().__init__()
        self.gamma, self.rho = float(gamma), float(rho)

    def weigh(self, gram: CheckedGram, losses: Tensor) -> Weights:
        matrix = self.unbiased(gram)
        weights = self.start(matrix.shape[0])
        # TorchJD's operations in its order: its answer bit for bit on the same matrix
        self.iterate = project_onto_simplex(weights - self.gamma * (matrix @ weights + self.rho * weights))
        return Weights.from_combination(self.iterate, device=gram.device)

    def __repr__(self) -> str:
        return f"MoDo(gamma={self.gamma!r}, rho={self.rho!r})"
