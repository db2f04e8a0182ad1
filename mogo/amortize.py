"""Amortized harmonization: when to solve for new weights, and which weights to reuse meanwhile.

Every ``harmonize_every`` optimizer steps the K gradients are computed and a weighting solved.
In between, the loss weights ``w_k = s * alpha_k / c_k`` are rebuilt from the cached divisors
``c`` and scale ``s`` of the last harmonization and from ``alpha`` smoothed by an exponential
moving average, ``alpha <- rho * alpha + (1 - rho) * alpha_new``. A step then costs one backward
pass of ``sum_k w_k L_k``; since ``d = sum_k w_k g_k`` is linear in the losses, that pass
reproduces exactly the direction the weights define.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mogo.weighting import Weights

__all__ = ["AmortizedWeights"]


class AmortizedWeights:
    """The schedule and cache of amortized harmonization.

    Args:
        harmonize_every: N; solve on optimizer steps 0, N, 2N, ... (1 solves every step).
        alpha_ema: rho in [0, 1); 0 reuses the last alpha as it is.
    """

    def __init__(self, harmonize_every: int = 1, alpha_ema: float = 0.0) -> None:
        if int(harmonize_every) != harmonize_every or harmonize_every < 1:
            raise ValueError(f"harmonize_every must be a positive integer, got {harmonize_every}")
        if not 0.0 <= alpha_ema < 1.0:
            raise ValueError(f"alpha_ema must be in [0, 1), got {alpha_ema}")
        self.harmonize_every = int(harmonize_every)
        self.alpha_ema = float(alpha_ema)
        self.step = 0
        self.alpha: Tensor | None = None
        self.divisor: Tensor | None = None
        self.scale: Tensor | None = None

    @property
    def due(self) -> bool:
        """Whether the current optimizer step harmonizes."""
        return self.alpha is None or self.step % self.harmonize_every == 0

    def update(self, weights: Weights) -> None:
        """Fold the weights of a harmonization step into the cache."""
        alpha = weights.alpha.detach().to(torch.float64)
        if self.alpha is not None and self.alpha_ema > 0:
            alpha = self.alpha_ema * self.alpha.to(alpha.device) + (1 - self.alpha_ema) * alpha
        self.alpha = alpha
        self.divisor = weights.divisor.detach().to(torch.float64)
        self.scale = weights.scale.detach().to(torch.float64)

    def loss_weights(self) -> Tensor:
        """``(K,)`` float64 ``w_k = s * alpha_k / c_k`` for an amortized step."""
        if self.alpha is None:
            raise RuntimeError("no harmonization step has run yet: there are no weights to reuse")
        return self.scale * self.alpha / self.divisor

    def state_dict(self) -> dict[str, Any]:
        return {
            "harmonize_every": self.harmonize_every,
            "alpha_ema": self.alpha_ema,
            "step": self.step,
            "alpha": self.alpha,
            "divisor": self.divisor,
            "scale": self.scale,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"harmonize_every", "alpha_ema", "step", "alpha", "divisor", "scale"} - set(state)
        if missing:
            raise ValueError(f"amortization state is missing {sorted(missing)}")
        self.harmonize_every = int(state["harmonize_every"])
        self.alpha_ema = float(state["alpha_ema"])
        self.step = int(state["step"])
        self.alpha, self.divisor, self.scale = state["alpha"], state["divisor"], state["scale"]
