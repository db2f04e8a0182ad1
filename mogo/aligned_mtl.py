"""Aligned-MTL: align the principal components of the gradients, then average.

Senushkin, Patakin, Kuznetsov & Konushin (2023), "Independent Component Alignment for Multi-Task
Learning", CVPR. With the eigendecomposition ``G = V Lambda V^T`` restricted to its rank ``r``
(the eigenvalues above the allowance of ``G``'s dtype, ``K eps`` of ``max_i G_ii`` below float64
and ``100 K eps`` in float64, as :func:`mogo.min_norm` allows), the balance transformation

.. math::

    B = \\sqrt{\\lambda_{\\text{scale}}} \\; V_r \\Lambda_r^{-1/2} V_r^\\top,
    \\qquad w = B \\, p,

makes the rows of ``B J`` orthogonal with equal norms ``sqrt(lambda_scale)`` (a condition number
of 1), and ``d = J^T w = (B J)^T p`` averages them with the preference ``p`` (uniform ``1/K``).
``lambda_scale`` is the smallest retained eigenvalue (``"min"``, the paper's choice), their
median (``"median"``, the lower one for an even count, as ``torch.median``) or their mean
(``"rmse"``, the original code). The weights can be negative and need not sum to 1.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from torch import Tensor

from mogo.gram import CheckedGram
from mogo.solvers import _precision
from mogo.weighting import CheckedWeighting, Weights

__all__ = ["AlignedMTL"]


class AlignedMTL(CheckedWeighting):
    """Aligned-MTL weighting (Senushkin et al. 2023), as TorchJD's ``AlignedMTLWeighting``.

    ``alpha = w / sum |w|`` (signed, not on the simplex), divisor 1, ``s = sum |w|``. ``w`` does
    not depend on the scale of ``G``. A ``G`` of rank 0 at its precision (every eigenvalue
    within round-off of zero) gives the uniform weights ``p``.

    Args:
        scale_mode: ``"min"``, ``"median"`` or ``"rmse"`` (see the module docstring).

    Example:
        >>> import torch, mogo
        >>> J = torch.tensor([[2.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
        >>> mogo.AlignedMTL()(J @ J.T, torch.ones(2)).loss_weights  # both rows scaled to norm 1
        tensor([0.2500, 0.5000], dtype=torch.float64)
    """

    def __init__(self, scale_mode: Literal["min", "median", "rmse"] = "min") -> None:
        if scale_mode not in ("min", "median", "rmse"):
            raise ValueError(f"unknown scale_mode {scale_mode!r}; use 'min', 'median' or 'rmse'")
        self.scale_mode = scale_mode

    def weigh(self, gram: CheckedGram, losses: Tensor) -> Weights:
        G = gram.host / np.diagonal(gram.host).max()  # scale-free: max_i G_ii = 1, far from overflow
        K = G.shape[0]
        preference = np.full(K, 1.0 / K)
        values, vectors = np.linalg.eigh((G + G.T) / 2)
        kept = values > _precision(gram.precision, K).allowance
        if not kept.any():
            w = preference
        else:
            values, vectors = values[kept], vectors[:, kept]  # ascending
            if self.scale_mode == "min":
                scale = values[0]
            elif self.scale_mode == "median":
                scale = values[(len(values) - 1) // 2]
            else:
                scale = values.mean()
            w = np.sqrt(scale) * ((vectors / np.sqrt(values)) @ (vectors.T @ preference))
        return Weights.from_combination(torch.from_numpy(w).to(gram.device))

    def __repr__(self) -> str:
        return f"AlignedMTL(scale_mode={self.scale_mode!r})"
