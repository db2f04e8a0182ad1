"""Weights on the simplex carried from call to call: the stochastic weightings' common part.

MoDo and SDMGrad do not solve for their weights at each harmonization; they take projected
gradient steps on them, one call after the other, from the uniform weights. Their step is taken
on an unbiased estimate of the Gram matrix of the expected gradients, the declared
:class:`mogo.GramEstimate` itself (``CheckedGram.estimate``), not its nearest Gram matrix, whose
clipping of negative eigenvalues biases it. :func:`project_onto_simplex` is the Euclidean
projection both use, in the arithmetic of TorchJD's (its reference implementations).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mogo.gram import CheckedGram
from mogo.weighting import CheckedWeighting

__all__ = ["SimplexIterated", "project_onto_simplex"]


def project_onto_simplex(y: Tensor) -> Tensor:
    """The Euclidean projection of ``y`` ``(K,)`` onto the simplex, ``max(y - theta, 0)``.

    ``theta = (sum of the i + 1 largest entries - 1) / (i + 1)`` for the first i at which that
    exceeds the (i + 2)-th largest entry, else ``(sum(y) - 1) / K`` (Held, Wolfe & Crowder 1974).
    The partial sums are a sequential ``cumsum`` and each quantity is formed by the same
    operations as TorchJD's loop, so the two agree bit for bit on the same input.

    Example:
        >>> import torch, mogo.simplex
        >>> mogo.simplex.project_onto_simplex(torch.tensor([0.5, 2.0, -1.0], dtype=torch.float64))
        tensor([0., 1., 0.], dtype=torch.float64)
    """
    K = len(y)
    ordered = torch.sort(y, descending=True)[0]
    thresholds = (torch.cumsum(ordered, 0)[:-1] - 1.0) / torch.arange(1, K, dtype=y.dtype)
    reached = torch.nonzero(thresholds > ordered[1:])
    theta = thresholds[reached[0, 0]] if len(reached) else (torch.sum(y) - 1.0) / K
    return (y - theta).clamp(min=0.0)


class SimplexIterated(CheckedWeighting):
    """A weighting that carries its weights ``(K,)`` on the simplex from one call to the next.

    They start uniform, and start again whenever the number of objectives changes (a
    harmonization that drops an objective, then the next that keeps all: both restart). Their
    state is :meth:`state_dict`, which :class:`mogo.HarmonizedOptimizer` checkpoints and
    restores on a skipped step.
    """

    reads_estimate = True

    def __init__(self) -> None:
        self.iterate: Tensor | None = None  # (K,) float64 on the CPU

    def start(self, objectives: int) -> Tensor:
        """The weights the next step starts from: the last ones, or uniform ``1/K``."""
        if self.iterate is not None and len(self.iterate) == objectives:
            return self.iterate
        return torch.full((objectives,), 1.0 / objectives, dtype=torch.float64)

    @staticmethod
    def unbiased(gram: CheckedGram) -> Tensor:
        """``(K, K)`` float64 on the CPU: the declared estimate itself, or ``G``."""
        return torch.from_numpy(gram.host if gram.estimate is None else gram.estimate)

    def state_dict(self) -> dict[str, Tensor | None]:
        """``{"iterate": the (K,) weights, or None before the first call}``."""
        return {"iterate": self.iterate}

    @staticmethod
    def state_problems(state: Any) -> list[str]:
        """What is wrong with a :meth:`state_dict` (``"field: problem"``)."""
        if not isinstance(state, dict) or set(state) != {"iterate"}:
            return [f"must be {{'iterate': a (K,) tensor or None}}, got {state!r:.80}"]
        iterate = state["iterate"]
        if iterate is None:
            return []
        if not isinstance(iterate, Tensor) or iterate.dtype != torch.float64 or iterate.ndim != 1:
            got = (
                f"{iterate.dtype} of shape {tuple(iterate.shape)}" if isinstance(iterate, Tensor) else iterate
            )
            return [f"iterate: must be a (K,) float64 tensor or None, got {got!r:.80}"]
        if not (bool(torch.isfinite(iterate).all()) and bool((iterate >= 0).all())):
            return [f"iterate: must be finite and non-negative, got {iterate.tolist()}"]
        return []

    def load_state_dict(self, state: dict[str, Tensor | None]) -> None:
        """Restore a :meth:`state_dict` (``ValueError`` naming the problem, nothing changed)."""
        if problems := self.state_problems(state):
            raise ValueError(f"{type(self).__name__} state: {'; '.join(problems)}")
        iterate = state["iterate"]
        self.iterate = None if iterate is None else iterate.detach().to("cpu").clone()
