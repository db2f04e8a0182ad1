"""Gradient-conflict diagnostics, from the Gram matrix at no extra backward cost.

A step *conflicts* when the weighted-sum direction has a negative cosine with at least one
objective's gradient (the MARBLE paper's measure). The harmonized direction never does, by the
KKT conditions of the min-norm problem.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from numbers import Integral, Real
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mogo.gram import gradient_norms, host_float64, nonzero_gradients
from mogo.weighting import Weights

__all__ = ["ConflictMeter", "ConflictReport"]


def _safe_divide(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """``numerator / denominator``, and 0 where the denominator (a product of norms) is 0."""
    out = np.zeros(np.broadcast_shapes(numerator.shape, denominator.shape))
    return np.divide(numerator, denominator, out=out, where=denominator > 0)


def _cosines_with(gram: np.ndarray, norms: np.ndarray, coefficients: np.ndarray) -> np.ndarray:
    """``cos(g_k, sum_j c_j g_j)`` for every k, from the Gram matrix; 0 where a norm is 0."""
    inner = gram @ coefficients
    return _safe_divide(inner, norms * np.sqrt(max(coefficients @ inner, 0.0)))


@dataclass(frozen=True)
class ConflictReport:
    """What one harmonization step saw, for K objectives. All tensors are float64 on the CPU.

    Attributes:
        names: the objectives' names.
        alpha: ``(K,)`` simplex weights; ``loss_weights``: ``(K,)`` ``w_k``.
        norms: ``(K,)`` gradient norms; ``cosines``: ``(K, K)`` pairwise cosines.
        weighted_sum_cosines: ``(K,)`` cosine of each gradient with the weighted-sum direction.
        harmonized_cosines: ``(K,)`` cosine of each gradient with ``d = sum_k w_k g_k``.
        direction_norm: ``||d||``.
        iterations, kkt: the solver's, where a QP was solved (else 0 and 0.0).
    """

    names: tuple[str, ...]
    alpha: Tensor
    loss_weights: Tensor
    norms: Tensor
    cosines: Tensor
    weighted_sum_cosines: Tensor
    harmonized_cosines: Tensor
    direction_norm: float
    iterations: int
    kkt: float

    @classmethod
    def from_gram(
        cls, gram: Tensor, weights: Weights, names: tuple[str, ...], sum_weights: Tensor | None = None
    ) -> ConflictReport:
        """Build the report from the raw Gram matrix (K, K) and the weights applied.

        ``sum_weights`` are the weights of the weighted-sum baseline (equal weights by default).
        """
        gram = host_float64(gram)
        norms = gradient_norms(gram)
        # A gradient the weighting excluded as zero (round-off, e.g. a reward no sample of the
        # batch applies to) has no direction: its cosines are 0, as for an exact zero.
        norms = np.where(nonzero_gradients(norms), norms, 0.0)
        baseline = np.ones(len(norms)) if sum_weights is None else host_float64(sum_weights)
        loss_weights = host_float64(weights.loss_weights)
        return cls(
            names=names,
            alpha=torch.from_numpy(host_float64(weights.alpha).copy()),
            loss_weights=torch.from_numpy(loss_weights.copy()),
            norms=torch.from_numpy(norms),
            cosines=torch.from_numpy(_safe_divide(gram, np.outer(norms, norms))),
            weighted_sum_cosines=torch.from_numpy(_cosines_with(gram, norms, baseline)),
            harmonized_cosines=torch.from_numpy(_cosines_with(gram, norms, loss_weights)),
            direction_norm=float(np.sqrt(max(loss_weights @ gram @ loss_weights, 0.0))),
            iterations=int(weights.solve.iterations) if weights.solve is not None else 0,
            kkt=float(weights.solve.kkt) if weights.solve is not None else 0.0,
        )

    @property
    def conflict(self) -> bool:
        """Whether the weighted-sum direction opposes at least one objective."""
        return bool((self.weighted_sum_cosines < 0).any())

    def as_dict(self, prefix: str = "mogo/") -> dict[str, float]:
        """Flat floats for any tracker: per-objective alpha, weight, norm and cosines, and totals."""
        values: dict[str, float] = {}
        for k, name in enumerate(self.names):
            values[f"{prefix}alpha/{name}"] = float(self.alpha[k])
            values[f"{prefix}weight/{name}"] = float(self.loss_weights[k])
            values[f"{prefix}grad_norm/{name}"] = float(self.norms[k])
            values[f"{prefix}cos_weighted_sum/{name}"] = float(self.weighted_sum_cosines[k])
            values[f"{prefix}cos_harmonized/{name}"] = float(self.harmonized_cosines[k])
        values[f"{prefix}conflict"] = float(self.conflict)
        values[f"{prefix}direction_norm"] = self.direction_norm
        values[f"{prefix}solver_iterations"] = float(self.iterations)
        values[f"{prefix}solver_kkt"] = self.kkt
        return values


@dataclass
class ConflictMeter:
    """Running conflict statistics over the harmonization steps of a run."""

    steps: int = 0
    conflicts: int = 0
    worst_weighted_sum_cosine: float = 1.0
    worst_harmonized_cosine: float = 1.0

    def update(self, report: ConflictReport) -> None:
        self.steps += 1
        self.conflicts += int(report.conflict)
        self.worst_weighted_sum_cosine = min(
            self.worst_weighted_sum_cosine, float(report.weighted_sum_cosines.min())
        )
        self.worst_harmonized_cosine = min(
            self.worst_harmonized_cosine, float(report.harmonized_cosines.min())
        )

    @property
    def conflict_rate(self) -> float:
        """Fraction of harmonization steps whose weighted-sum direction opposed an objective."""
        return self.conflicts / self.steps if self.steps else 0.0

    def state_dict(self) -> dict[str, Any]:
        """The running statistics, ``{field: value}``, for a checkpoint."""
        return {field.name: getattr(self, field.name) for field in fields(self)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; a bad one raises ``ValueError`` naming every bad field,
        before anything changes."""
        problems = self.state_problems(state)
        if problems:
            raise ValueError(f"invalid conflict meter state: {'; '.join(problems)}")
        for name, value in state.items():
            setattr(self, name, value)

    @staticmethod
    def state_problems(state: Any) -> list[str]:
        """Everything wrong with a :meth:`state_dict`, as ``"field: problem"`` strings (empty:
        it loads)."""
        if not isinstance(state, dict):
            return [f"must be a dict, got {type(state).__name__}"]
        names = [field.name for field in fields(ConflictMeter)]
        problems = [f"{name}: missing" for name in names if name not in state]
        problems += [f"{name}: unexpected" for name in sorted(map(str, set(state) - set(names)))]
        steps, conflicts = state.get("steps", 0), state.get("conflicts", 0)
        for name, value in (("steps", steps), ("conflicts", conflicts)):
            if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
                problems.append(f"{name}: must be a non-negative integer, got {value!r}")
        if not problems and conflicts > steps:
            problems.append(f"conflicts: {conflicts} is more than the {steps} steps")
        for name in ("worst_weighted_sum_cosine", "worst_harmonized_cosine"):
            value = state.get(name, 1.0)
            # a cosine, up to the round-off of a float64 quotient of Gram entries
            if isinstance(value, bool) or not isinstance(value, Real) or not abs(value) <= 1 + 1e-12:
                problems.append(f"{name}: must be a cosine in [-1, 1], got {value!r}")
        return problems
