"""IMTL-G: the direction with equal projections on every unit gradient.

Liu, Li, Kuang, Xue, Chen, Yang, Liao & Zhang (2021), "Towards Impartial Multi-task Learning",
ICLR. The update ``d = J^T alpha`` with ``sum_k alpha_k = 1`` has the same inner product with
every unit gradient, ``<d, g_i / ||g_i||> = const``, that is ``G alpha = lambda n`` with
``n_i = ||g_i||``. With linearly dependent gradients, TorchJD's generalisation (Quinton & Rey 2024)
takes the least-squares solution of least norm,

.. math::

    v = G^+ n, \\qquad \\alpha = v / \\textstyle\\sum_k v_k,

which is used here; ``G^+`` is the pseudo-inverse from the eigendecomposition of ``G`` with the
eigenvalues within round-off of zero set to zero: those at most the allowance of ``G``'s dtype,
``K eps`` of ``max_i G_ii`` below float64 and ``100 K eps`` in float64, as :func:`mogo.min_norm`
allows (TorchJD cuts at ``torch.linalg.pinv``'s ``K eps lambda_max``, float64's ``eps`` whatever
the dtype).
The weights can be negative. Where ``sum_k v_k`` vanishes (``n`` orthogonal to the range of
``G``, e.g. two opposite gradients) there is no such direction and the weights are 0.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from mogo.gram import CheckedGram
from mogo.solvers import _precision
from mogo.weighting import CheckedWeighting, Weights

__all__ = ["IMTLG"]


class IMTLG(CheckedWeighting):
    """IMTL-G weighting (Liu et al. 2021), as generalised by TorchJD.

    Loss weights ``w = G^+ n / sum(G^+ n)``: they sum to 1 and may be negative, so ``alpha`` is
    ``w / sum |w|`` (signed, not on the simplex), divisor 1, ``s = sum |w|``. Unlike TorchJD,
    whose test ``|sum v| < 1e-12`` is absolute (it returns 0 for every Gram matrix above about
    1e12), the degenerate case is judged relative to ``sum |v|``, so the weights do not depend on
    the scale of ``G``.

    Example:
        >>> import torch, mogo
        >>> J = torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
        >>> w = mogo.IMTLG()(J @ J.T, torch.ones(2)).loss_weights
        >>> d = w @ J
        >>> (J @ d) / J.norm(dim=1)  # equal projections on both unit gradients
        tensor([1.0000, 1.0000], dtype=torch.float64)
    """

    def weigh(self, gram: CheckedGram, losses: Tensor) -> Weights:
        G = gram.host / np.diagonal(gram.host).max()  # scale-free: max_i G_ii = 1, far from overflow
        K = G.shape[0]
        values, vectors = np.linalg.eigh((G + G.T) / 2)
        kept = values > _precision(gram.precision, K).allowance
        norms = np.sqrt(np.maximum(np.diagonal(G), 0.0))
        v = (vectors[:, kept] / values[kept]) @ (vectors[:, kept].T @ norms)
        total = float(v.sum())
        if abs(total) <= K * np.finfo(np.float64).eps * float(np.abs(v).sum()):
            v, total = np.zeros(K), 1.0
        return Weights.from_combination(torch.from_numpy(v / total).to(gram.device))

    def __repr__(self) -> str:
        return "IMTLG()"
