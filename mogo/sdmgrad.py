"""SDMGrad: weights near a preferred direction, by momentum SGD on an unbiased Gram estimate.

Xiao, Ban & Ji (2023), "Direction-oriented Multi-objective Learning: Simple and Provable
Stochastic Algorithms", NeurIPS 2023, arXiv:2305.18409. SDMGrad looks for the direction that
improves every objective most while staying near a preferred combination ``J^T w~`` (the mean
gradient by default): with ``lambda_`` the pull towards it, the weights solve

.. math::

    \\min_{w \\in \\Delta} \\tfrac12 \\|J^\\top (w + \\lambda \\tilde w)\\|^2,
    \\qquad d = J^\\top \\frac{w + \\lambda \\tilde w}{1 + \\lambda},

by ``n_iter`` steps of momentum SGD from the last call's ``w``, each projected on the simplex,
on ``A / s^2`` with ``s`` the mean of ``sqrt(max(A_kk, 0))`` (section 6.1 of the paper: the step
size is then free of the gradients' scale). ``A = J_1 J_2^T`` of two independent batches is an
unbiased estimate of ``M M^T``, and is not symmetric; TorchJD's ``SDMGradWeighting`` takes it.

Here ``A`` is the declared estimate (:class:`mogo.GramEstimate`): under
``HarmonizedOptimizer(..., gram="cross_fitted")`` the cross-fitted ``(G_12 + G_21) / 2``, the
mean of the two one-way matrices, with the same expectation. Given an ordinary Gram matrix it
steps on ``G`` (one batch, biased by the noise). Where no diagonal entry of the estimate is
positive (``s = 0``: no objective's squared norm is estimated above 0) the weights stay as they
were. TorchJD divides by ``s^2 + 1e-8`` rather than ``s^2``, which makes its weights depend on
the gradients' scale below ``s ~ 1e-3``; they agree where ``1e-8`` is below ``s^2``'s round-off.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mogo.gram import CheckedGram
from mogo.simplex import SimplexIterated, project_onto_simplex
from mogo.weighting import Weights

__all__ = ["SDMGrad"]


class SDMGrad(SimplexIterated):
    """SDMGrad weighting (Xiao et al. 2023), as TorchJD's ``SDMGradWeighting``.

    Loss weights ``(w + lambda_ w~) / (1 + lambda_)`` (divisor 1, they sum to 1); ``w`` carries
    over to the next call (:class:`mogo.simplex.SimplexIterated`: uniform at first and when K
    changes; :meth:`~mogo.simplex.SimplexIterated.state_dict`).

    Args:
        lr: step size of the inner SGD, positive (on the scale-free ``A / s^2``).
        momentum: of the inner SGD, in ``[0, 1)``.
        n_iter: inner SGD steps per call, at least 1.
        lambda_: non-negative pull towards the preferred direction (the official experiments'
            0.3; 0 is MGDA's problem).
        preference: ``w~``, ``(K,)`` finite; ``None`` for the uniform ``1/K`` (the mean gradient).

    Example:
        >>> import torch, mogo
        >>> J = torch.tensor([[1.0, 0.0], [-0.5, 1.0]], dtype=torch.float64)
        >>> weights = mogo.SDMGrad()(J @ J.T, torch.ones(2)).loss_weights
        >>> weights, J @ (weights @ J)  # the pull to the mean keeps w > 0: it can oppose one
        (tensor([0.1154, 0.8846], dtype=torch.float64), tensor([-0.3269,  1.0481], dtype=torch.float64))
    """

    def __init__(
        self,
        lr: float = 10.0,
        momentum: float = 0.5,
        n_iter: int = 20,
        lambda_: float = 0.3,
        preference: Tensor | list[float] | None = None,
    ) -> None:
        if not (isinstance(lr, int | float) and 0 < lr < math.inf):
            raise ValueError(f"lr must be a positive finite number, got {lr!r}")
        if not (isinstance(momentum, int | float) and 0 <= momentum < 1):
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if isinstance(n_iter, bool) or not (isinstance(n_iter, int) and n_iter >= 1):
            raise ValueError(f"n_iter must be a positive integer, got {n_iter!r}")
        if not (isinstance(lambda_, int | float) and 0 <= lambda_ < math.inf):
            raise ValueError(f"lambda_ must be a non-negative finite number, got {lambda_!r}")
        if preference is not None:
            preference = torch.as_tensor(preference, dtype=torch.float64)
            if preference.ndim != 1 or not bool(torch.isfinite(preference).all()):
                raise ValueError(f"preference must be a finite (K,) vector, got {preference.tolist()}")
        super().__init__()
        self.lr, self.momentum, self.n_iter, self.lambda_ = float(lr), float(momentum), n_iter, float(lambda_)
        self.preference = preference

    def weigh(self, gram: CheckedGram, losses: Tensor) -> Weights:
        matrix = self.unbiased(gram)
        K = matrix.shape[0]
        preferred = self._preferred(K)
        weights = self.start(K)
        scale = torch.diag(matrix).clamp(min=0.0).sqrt().mean()
        if scale > 0:
            weights = self._descend(matrix / scale.pow(2), weights, preferred)
        self.iterate = weights
        combination = (weights + self.lambda_ * preferred) / (1.0 + self.lambda_)
        return Weights.from_combination(combination, device=gram.device)

    def _descend(self, matrix: Tensor, weights: Tensor, preferred: Tensor) -> Tensor:
        """``n_iter`` projected momentum-SGD steps on ``w`` (TorchJD's operations in its order)."""
        velocity = None
        for _ in range(self.n_iter):
            grad = matrix @ (weights + self.lambda_ * preferred)
            velocity = grad if velocity is None else self.momentum * velocity + grad
            weights = project_onto_simplex(weights - self.lr * velocity)
        return weights

    def _preferred(self, objectives: int) -> Tensor:
        """``w~`` for K objectives: the preference given, or uniform."""
        if self.preference is None:
            return torch.full((objectives,), 1.0 / objectives, dtype=torch.float64)
        if len(self.preference) != objectives:
            raise ValueError(
                f"SDMGrad has a preference of {len(self.preference)} entries for {objectives} objectives"
            )
        return self.preference

    def __repr__(self) -> str:
        preference = None if self.preference is None else self.preference.tolist()
        return (
            f"SDMGrad(lr={self.lr!r}, momentum={self.momentum!r}, n_iter={self.n_iter!r}, "
            f"lambda_={self.lambda_!r}, preference={preference!r})"
        )
