"""Gradient-conflict diagnostics, from the Gram matrix at no extra backward cost.

A step *conflicts* when the weighted-sum direction has a negative cosine with at least one
objective's gradient (the MARBLE paper's measure). The harmonized direction never does, by the
KKT conditions of the min-norm problem.

On one batch that measure is biased towards "no conflict" by the batch's own noise:
``<d_ws, g_k>`` with ``d_ws = sum_j c_j g_j`` holds ``c_k ||n_k||^2`` of objective k's noise
``n_k``, which is positive. Where the optimizer has the gradients of two halves of the batch
(``gram="cross_fitted"``), the report also measures it *across* the halves: the direction from
one half against the gradient from the other,

::

    cos_x_k = (<d_1, g_2k> + <d_2, g_1k>) / 2  /  ((||d_1|| ||g_2k|| + ||d_2|| ||g_1k||) / 2),

with ``d_h = sum_j c_j g_hj`` and ``g_hk`` from half h. Its numerator is ``(S c)_k`` for the
cross-fitted estimate ``S = (G_12 + G_21) / 2`` (:mod:`mogo.cross_fit`), an unbiased estimate
of ``<d_ws, mu_k>`` for the expected gradients ``mu``; its magnitude is at most 1
(Cauchy-Schwarz, term by term). A cross-batch conflict is a negative one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from numbers import Integral, Real
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mogo.cross_fit import batch_gram
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


def _cross_batch_cosines(halves: np.ndarray, coefficients: np.ndarray) -> np.ndarray:
    """``cos^x_k`` (module docstring) of the direction ``sum_j c_j g_j`` for every k, from the
    ``(2K, 2K)`` Gram matrix of both halves' gradients; 0 where its denominator is 0."""
    K = len(coefficients)
    first, cross, second = halves[:K, :K], halves[:K, K:], halves[K:, K:]
    inner = (cross + cross.T) @ coefficients / 2
    direction_norms = [np.sqrt(max(coefficients @ gram @ coefficients, 0.0)) for gram in (first, second)]
    sizes = (direction_norms[0] * gradient_norms(second) + direction_norms[1] * gradient_norms(first)) / 2
    return _safe_divide(inner, sizes)


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
        weighed: what the weights are of (:attr:`mogo.Weights.weighed`): ``"nearest_gram"``
            says that ``kkt`` certifies the solve on the nearest Gram matrix of the cross-fitted
            estimate, not on the estimate.
        cross_batch_weighted_sum_cosines, cross_batch_harmonized_cosines: ``(K,)`` the same two
            cosines measured across two halves of the batch (the module docstring), where the
            step had them (``gram="cross_fitted"``); else None. The other fields are of the
            whole batch's gradients.
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
    weighed: str = "gram"
    cross_batch_weighted_sum_cosines: Tensor | None = None
    cross_batch_harmonized_cosines: Tensor | None = None

    @classmethod
    def from_gram(
        cls,
        gram: Tensor,
        weights: Weights,
        names: tuple[str, ...],
        sum_weights: Tensor | None = None,
        *,
        halves: Tensor | None = None,
    ) -> ConflictReport:
        """Build the report from the raw Gram matrix (K, K) and the weights applied.

        ``sum_weights`` are the weights of the weighted-sum baseline (equal weights by default).
        ``halves``, the ``(2K, 2K)`` Gram matrix of two halves' gradients ``[J_1; J_2]``, adds
        the cross-batch cosines; ``gram`` is then that of the batch's gradients
        ``(J_1 + J_2) / 2`` (:meth:`from_halves` forms it).
        """
        gram = host_float64(gram)
        norms = gradient_norms(gram)
        # A gradient the weighting excluded as zero (round-off, e.g. a reward no sample of the
        # batch applies to) has no direction: its cosines are 0, as for an exact zero.
        norms = np.where(nonzero_gradients(norms), norms, 0.0)
        baseline = np.ones(len(norms)) if sum_weights is None else host_float64(sum_weights)
        loss_weights = host_float64(weights.loss_weights)
        cross_batch = {}
        if halves is not None:
            halves = host_float64(halves)
            cross_batch = {
                "cross_batch_weighted_sum_cosines": torch.from_numpy(_cross_batch_cosines(halves, baseline)),
                "cross_batch_harmonized_cosines": torch.from_numpy(
                    _cross_batch_cosines(halves, loss_weights)
                ),
            }
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
            weighed=weights.weighed,
            **cross_batch,
        )

    @classmethod
    def from_halves(
        cls, halves: Tensor, weights: Weights, names: tuple[str, ...], sum_weights: Tensor | None = None
    ) -> ConflictReport:
        """The report of a step on two halves of a batch, from the ``(2K, 2K)`` Gram matrix of
        their gradients ``[J_1; J_2]``: the batch's ``(J_1 + J_2) / 2`` for the same-batch
        fields, and the cross-batch cosines."""
        return cls.from_gram(batch_gram(halves), weights, names, sum_weights, halves=halves)

    @property
    def conflict(self) -> bool:
        """Whether the weighted-sum direction opposes at least one objective."""
        return bool((self.weighted_sum_cosines < 0).any())

    @property
    def cross_batch_conflict(self) -> bool | None:
        """Whether the weighted-sum direction of one half opposes an objective's gradient of the
        other (a negative cross-batch cosine); None without halves."""
        cosines = self.cross_batch_weighted_sum_cosines
        return None if cosines is None else bool((cosines < 0).any())

    def as_dict(self, prefix: str = "mogo/") -> dict[str, float]:
        """Flat floats for any tracker: per-objective alpha, weight, norm and cosines (and the
        cross-batch ones, ``cos_weighted_sum_cross/`` and ``cos_harmonized_cross/``, where the
        step had halves), and totals."""
        values: dict[str, float] = {}
        for k, name in enumerate(self.names):
            values[f"{prefix}alpha/{name}"] = float(self.alpha[k])
            values[f"{prefix}weight/{name}"] = float(self.loss_weights[k])
            values[f"{prefix}grad_norm/{name}"] = float(self.norms[k])
            values[f"{prefix}cos_weighted_sum/{name}"] = float(self.weighted_sum_cosines[k])
            values[f"{prefix}cos_harmonized/{name}"] = float(self.harmonized_cosines[k])
            if self.cross_batch_weighted_sum_cosines is not None:
                values[f"{prefix}cos_weighted_sum_cross/{name}"] = float(
                    self.cross_batch_weighted_sum_cosines[k]
                )
                values[f"{prefix}cos_harmonized_cross/{name}"] = float(self.cross_batch_harmonized_cosines[k])
        values[f"{prefix}conflict"] = float(self.conflict)
        if self.cross_batch_conflict is not None:
            values[f"{prefix}conflict_cross"] = float(self.cross_batch_conflict)
        values[f"{prefix}direction_norm"] = self.direction_norm
        values[f"{prefix}solver_iterations"] = float(self.iterations)
        values[f"{prefix}solver_kkt"] = self.kkt
        return values


@dataclass
class ConflictMeter:
    """Running conflict statistics over the harmonization steps of a run: the same-batch ones
    over every step, the cross-batch ones over the steps that had two halves."""

    steps: int = 0
    conflicts: int = 0
    worst_weighted_sum_cosine: float = 1.0
    worst_harmonized_cosine: float = 1.0
    cross_batch_steps: int = 0
    cross_batch_conflicts: int = 0
    worst_cross_batch_weighted_sum_cosine: float = 1.0
    worst_cross_batch_harmonized_cosine: float = 1.0

    def update(self, report: ConflictReport) -> None:
        self.steps += 1
        self.conflicts += int(report.conflict)
        self.worst_weighted_sum_cosine = min(
            self.worst_weighted_sum_cosine, float(report.weighted_sum_cosines.min())
        )
        self.worst_harmonized_cosine = min(
            self.worst_harmonized_cosine, float(report.harmonized_cosines.min())
        )
        if report.cross_batch_conflict is None:
            return
        self.cross_batch_steps += 1
        self.cross_batch_conflicts += int(report.cross_batch_conflict)
        self.worst_cross_batch_weighted_sum_cosine = min(
            self.worst_cross_batch_weighted_sum_cosine, float(report.cross_batch_weighted_sum_cosines.min())
        )
        self.worst_cross_batch_harmonized_cosine = min(
            self.worst_cross_batch_harmonized_cosine, float(report.cross_batch_harmonized_cosines.min())
        )

    @property
    def conflict_rate(self) -> float:
        """Fraction of harmonization steps whose weighted-sum direction opposed an objective."""
        return self.conflicts / self.steps if self.steps else 0.0

    @property
    def cross_batch_conflict_rate(self) -> float:
        """Fraction of the steps with two halves whose weighted-sum direction of one half opposed
        an objective's gradient of the other."""
        return self.cross_batch_conflicts / self.cross_batch_steps if self.cross_batch_steps else 0.0

    def state_dict(self) -> dict[str, Any]:
        """The running statistics, ``{field: value}``, for a checkpoint."""
        return {field.name: getattr(self, field.name) for field in fields(self)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; a bad one raises ``ValueError`` naming every bad field,
        before anything changes. A checkpoint from before the cross-batch statistics loads with
        them at their start (no step with halves yet)."""
        problems = self.state_problems(state)
        if problems:
            raise ValueError(f"invalid conflict meter state: {'; '.join(problems)}")
        for field in fields(self):
            setattr(self, field.name, state.get(field.name, field.default))

    @staticmethod
    def state_problems(state: Any) -> list[str]:
        """Everything wrong with a :meth:`state_dict`, as ``"field: problem"`` strings (empty:
        it loads)."""
        if not isinstance(state, dict):
            return [f"must be a dict, got {type(state).__name__}"]
        names = [field.name for field in fields(ConflictMeter)]
        older = state.keys() <= set(names) - set(_CROSS_BATCH_FIELDS)  # saved before them
        problems = [
            f"{name}: missing"
            for name in names
            if name not in state and not (older and name in _CROSS_BATCH_FIELDS)
        ]
        problems += [f"{name}: unexpected" for name in sorted(map(str, set(state) - set(names)))]
        for steps_name, conflicts_name in (
            ("steps", "conflicts"),
            ("cross_batch_steps", "cross_batch_conflicts"),
        ):
            steps, conflicts = state.get(steps_name, 0), state.get(conflicts_name, 0)
            bad = [
                f"{name}: must be a non-negative integer, got {value!r}"
                for name, value in ((steps_name, steps), (conflicts_name, conflicts))
                if isinstance(value, bool) or not isinstance(value, Integral) or value < 0
            ]
            if not bad and conflicts > steps:
                bad.append(f"{conflicts_name}: {conflicts} is more than the {steps} steps")
            problems += bad
        for name in (
            "worst_weighted_sum_cosine",
            "worst_harmonized_cosine",
            "worst_cross_batch_weighted_sum_cosine",
            "worst_cross_batch_harmonized_cosine",
        ):
            value = state.get(name, 1.0)
            # a cosine, up to the round-off of a float64 quotient of Gram entries
            if isinstance(value, bool) or not isinstance(value, Real) or not abs(value) <= 1 + 1e-12:
                problems.append(f"{name}: must be a cosine in [-1, 1], got {value!r}")
        return problems


_CROSS_BATCH_FIELDS = (
    "cross_batch_steps",
    "cross_batch_conflicts",
    "worst_cross_batch_weighted_sum_cosine",
    "worst_cross_batch_harmonized_cosine",
)
"""The meter's fields added with the cross-batch statistics: a checkpoint may lack all four."""
