"""PCGrad: project each gradient off the ones it conflicts with, in random order, and sum.

Yu, Kumar, Gupta, Levine, Hausman & Finn (2020), "Gradient Surgery for Multi-Task Learning",
NeurIPS, arXiv:2001.06782 (Algorithm 1). For each i, starting from ``g_i^PC = g_i``, for j in a
random order of the other objectives:

.. math::

    \\text{if } \\langle g_i^{PC}, g_j \\rangle < 0: \\quad
    g_i^{PC} \\leftarrow g_i^{PC} - \\frac{\\langle g_i^{PC}, g_j \\rangle}{\\|g_j\\|^2} g_j,
    \\qquad d = \\sum_i g_i^{PC}.

Every ``g_i^PC`` is a combination ``J^T c^(i)`` with ``c^(i)_i = 1`` and non-negative other
coefficients, so it runs on the Gram matrix: ``<g_i^PC, g_j> = (G c^(i))_j``. The K sequences run
side by side, one vectorised step per position of the orders. Random orders come from an explicit
``torch.Generator``, never the global RNG: the i-th of K ``torch.randperm(K)`` draws orders
``g_i``'s projections, so a generator seeded like TorchJD's global RNG reproduces its result.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from mogo.gram import CheckedGram
from mogo.weighting import CheckedWeighting, Weights

__all__ = ["PCGrad"]


class PCGrad(CheckedWeighting):
    """PCGrad weighting (Yu et al. 2020), as TorchJD's ``PCGradWeighting``.

    Loss weights ``w = sum_i c^(i)`` (non-negative; the paper's sum, so ``d = sum_k g_k`` when
    nothing conflicts), ``alpha = w / sum w`` on the simplex, divisor 1, ``s = sum w``.

    Args:
        seed: seeds a new ``torch.Generator`` (ignored when ``generator`` is given).
        generator: the generator the orders are drawn from; it advances with every call.

    Example:
        >>> import torch, mogo
        >>> J = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
        >>> mogo.PCGrad(seed=0)(J @ J.T, torch.ones(2)).loss_weights  # c1 = (1, 1/2), c2 = (1, 1)
        tensor([2.0000, 1.5000], dtype=torch.float64)
    """

    def __init__(self, *, seed: int = 0, generator: torch.Generator | None = None) -> None:
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        self.seed = None if generator is not None else int(seed)
        self.generator = torch.Generator().manual_seed(int(seed)) if generator is None else generator

    def weigh(self, gram: CheckedGram, losses: Tensor) -> Weights:
        G = gram.host
        K = G.shape[0]
        orders = torch.stack([torch.randperm(K, generator=self.generator) for _ in range(K)]).numpy()
        rows = np.arange(K)
        coefficients = np.eye(K)
        for position in range(K):
            j = orders[:, position]
            inner = (G[j] * coefficients).sum(axis=1)  # <g_i^PC, g_j> for every i
            conflict = (j != rows) & (inner < 0)
            coefficients[rows[conflict], j[conflict]] -= inner[conflict] / G[j[conflict], j[conflict]]
        return Weights.from_combination(torch.from_numpy(coefficients.sum(axis=0)).to(gram.device))

    def state_dict(self) -> dict[str, Tensor]:
        """``{"generator": its state}``: what :class:`mogo.HarmonizedOptimizer` checkpoints, so a
        resumed run draws the orders the uninterrupted one would."""
        return {"generator": self.generator.get_state()}

    @staticmethod
    def state_problems(state: Any) -> list[str]:
        """What is wrong with a :meth:`state_dict` (``"field: problem"``), checked on a scratch
        generator: nothing of this weighting changes."""
        if not isinstance(state, dict) or set(state) != {"generator"}:
            return [f"must be {{'generator': a generator state}}, got {state!r:.80}"]
        try:
            torch.Generator().set_state(state["generator"])
        except (TypeError, RuntimeError) as error:
            return [f"generator: not a CPU generator's state ({error})"]
        return []

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore a :meth:`state_dict` (``ValueError`` naming the problem, nothing changed)."""
        if problems := self.state_problems(state):
            raise ValueError(f"PCGrad state: {'; '.join(problems)}")
        self.generator.set_state(state["generator"])

    def __repr__(self) -> str:
        return f"PCGrad(seed={self.seed!r})"
