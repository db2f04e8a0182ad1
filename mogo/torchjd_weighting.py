"""Any TorchJD Gram-based weighting as a mogo :class:`~mogo.Weighting`.

TorchJD (``pip install torchjd``) offers weightings as callables from a Gramian to weights,
``torchjd.aggregation.UPGradWeighting()(G) -> (K,)``. :class:`TorchJDWeighting` wraps one so that
it drives :class:`mogo.HarmonizedOptimizer`, amortization and diagnostics included: its weights
``w`` become ``Weights.from_combination(w)`` (``alpha = w / sum |w|``, divisor 1,
``s = sum |w|``). torchjd is imported only when an adapter is built.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from mogo._extras import require
from mogo.gram import CheckedGram
from mogo.weighting import CheckedWeighting, Weights

__all__ = ["TorchJDWeighting"]


class TorchJDWeighting(CheckedWeighting):
    """Adapt a TorchJD weighting of the Gramian (``UPGradWeighting()``, ``MGDAWeighting()``, ...).

    Args:
        weighting: a ``torchjd.aggregation.Weighting`` of a PSD matrix; it receives the raw
            ``(K, K)`` float64 Gram matrix on its device and returns ``(K,)`` weights.

    Raises:
        ImportError: torchjd is not installed.
        TypeError: ``weighting`` is not callable.

    Example:
        >>> import torch, mogo
        >>> from torchjd.aggregation import MeanWeighting
        >>> weighting = mogo.TorchJDWeighting(MeanWeighting())
        >>> weighting(torch.eye(2, dtype=torch.float64), torch.ones(2)).loss_weights
        tensor([0.5000, 0.5000], dtype=torch.float64)
    """

    def __init__(self, weighting: Callable[[Tensor], Tensor]) -> None:
        require("mogo.TorchJDWeighting", "torchjd")
        if not callable(weighting):
            raise TypeError(f"weighting must be a TorchJD weighting, got {type(weighting).__name__}")
        self.weighting = weighting

    def weigh(self, gram: CheckedGram, losses: Tensor) -> Weights:
        K = gram.host.shape[0]
        with torch.no_grad():
            weights = self.weighting(torch.from_numpy(gram.host).to(gram.device))
        if weights.shape != (K,):
            raise ValueError(
                f"{self.weighting!r} returned weights of shape {tuple(weights.shape)} for {K} objectives"
            )
        return Weights.from_combination(weights.detach().to(torch.float64))

    def __repr__(self) -> str:
        return f"TorchJDWeighting({self.weighting!r})"
