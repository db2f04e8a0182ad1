"""Per-objective gradient tracking: an EMA of each objective's gradient before the weighting.

Fernando, Shen, Liu, Chaudhury, Murugesan & Chen (2023), "Mitigating Gradient Bias in
Multi-objective Learning: A Provably Convergent Approach" (MoCo), ICLR. The min-norm weights of
noisy gradients are biased (the noise sits on the Gram matrix's diagonal); MoCo tracks each
objective's gradient across steps,

.. math::  y_k \\leftarrow \\beta\\, y_k + (1 - \\beta)\\, g_k,

and weighs the Gram matrix of the tracked ``y`` instead, whose noise falls with the number of
steps it averages (about ``(1 + beta) / (1 - beta)`` of them). :class:`GradientTracker` is that
EMA over the harmonization steps of :class:`mogo.HarmonizedOptimizer` (``grad_ema=beta``): it
starts each row at its first gradient, tracks the rows of both halves apart under
``gram="cross_fitted"`` (each half's EMA averages independent samples, so their cross products
stay free of the noise), and holds only the harmonized parameters. The weights it leads to are
applied to the step's own gradients, as every harmonization applies its weights, so amortized
steps stay exact; MoCo's update ``sum_k lambda_k y_k`` would add a second momentum to the
wrapped optimizer's.

Memory: ``R`` rows (K, or 2K with two halves) of the harmonized parameters, and as much again
while a harmonization forms the next EMA beside the last, which a skipped step returns to.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["GradientTracker"]


class GradientTracker:
    """The EMA of each gradient row across harmonizations (MoCo), one ``[R, *p.shape]`` per parameter.

    Args:
        decay: ``beta`` in ``[0, 1)``; 0 tracks nothing (the weighting sees each step's gradients).
    """

    def __init__(self, decay: float = 0.0) -> None:
        if isinstance(decay, bool) or not (isinstance(decay, int | float) and 0 <= decay < 1):
            raise ValueError(f"grad_ema must be in [0, 1), got {decay!r}")
        self.decay = float(decay)
        self.rows: list[Tensor | None] | None = None  # per parameter: [R, *p.shape] or None
        self.seen: Tensor | None = None  # (R,) bool: rows that have had a gradient

    @property
    def tracking(self) -> bool:
        """Whether it tracks anything (``decay > 0``)."""
        return self.decay > 0

    def update(self, grads: list[Tensor | None], present: Tensor) -> list[Tensor | None]:
        """Fold in a harmonization's gradient rows and return their EMA.

        Args:
            grads: one ``[A, *p.shape]`` or None (no gradient: zero) per parameter, the rows
                flagged in ``present``.
            present: ``(R,)`` bool, which of the R rows ``grads`` holds (the others, an
                objective dropped for this step, keep their EMA).

        Returns:
            The tracked rows ``[A, *p.shape]`` of ``present``, one per parameter (None where a
            parameter has had no gradient yet). The state is replaced, not changed in place.
        """
        seen = torch.zeros_like(present) if self.seen is None else self.seen
        rows = [None] * len(grads) if self.rows is None else self.rows
        self.rows = [self._fold(row, grad, present, seen) for row, grad in zip(rows, grads, strict=True)]
        self.seen = seen | present
        return [None if row is None else row[present.to(row.device)] for row in self.rows]

    def _fold(self, row: Tensor | None, grad: Tensor | None, present: Tensor, seen: Tensor) -> Tensor | None:
        """One parameter's new EMA ``[R, *p.shape]``: ``beta y + (1 - beta) g`` on the present rows
        seen before, ``g`` on the present rows new to it, ``y`` elsewhere."""
        if grad is None and row is None:
            return None
        if row is None:
            row = grad.new_zeros(len(present), *grad.shape[1:])
        elif grad is not None:
            row = row.to(grad.device)  # a checkpoint loaded elsewhere
        present, seen = present.to(row.device), seen.to(row.device)
        grad = row.new_zeros(int(present.sum()), *row.shape[1:]) if grad is None else grad
        old = row[present]
        started = seen[present].reshape(-1, *[1] * (row.ndim - 1))
        folded = row.clone()
        folded[present] = torch.where(
            started, torch.lerp(old, grad.to(row.dtype), 1 - self.decay), grad.to(row.dtype)
        )
        return folded

    def state_dict(self) -> dict[str, Any]:
        """``{"rows": the EMA per parameter (None before a gradient), "seen": (R,) bool}``."""
        return {"rows": self.rows, "seen": self.seen}

    @staticmethod
    def state_problems(state: Any, parameters: int) -> list[str]:
        """What is wrong with a :meth:`state_dict` for ``parameters`` parameters, as
        ``"field: problem"`` strings (empty: it loads)."""
        if not isinstance(state, dict) or set(state) != {"rows", "seen"}:
            return [f"must be {{'rows': ..., 'seen': ...}}, got {state!r:.80}"]
        rows, seen = state["rows"], state["seen"]
        if rows is None and seen is None:
            return []
        if not (isinstance(seen, Tensor) and seen.dtype == torch.bool and seen.ndim == 1):
            return [f"seen: must be a (R,) bool tensor, got {seen!r:.80}"]
        if not (isinstance(rows, list) and len(rows) == parameters):
            got = f"{len(rows)} entries" if isinstance(rows, list) else type(rows).__name__
            return [f"rows: must be a list of {parameters} tensors or None, got {got}"]
        return [
            f"rows.{index}: must be None or a finite floating tensor of {len(seen)} rows"
            for index, row in enumerate(rows)
            if row is not None
            and not (
                isinstance(row, Tensor)
                and row.is_floating_point()
                and row.shape[:1] == seen.shape
                and bool(torch.isfinite(row).all())
            )
        ]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state checked by :meth:`state_problems` (the tensors are kept, not copied:
        the EMA replaces them, never changes them)."""
        self.rows, self.seen = state["rows"], state["seen"]

    def __repr__(self) -> str:
        return f"GradientTracker(decay={self.decay!r})"
