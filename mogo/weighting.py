"""Weightings: from the Gram matrix of K gradients to the weights of their combination.

A weighting maps the raw Gram matrix ``G`` (K x K, float64) and the loss values to
:class:`Weights`. The update direction is always ``d = sum_k w_k g_k`` with loss weights

.. math::  w_k = s \\, \\alpha_k / c_k,

where ``alpha`` lies on the simplex, ``c_k`` divides objective k's gradient (its norm, for MARBLE)
and ``s`` sets the step's scale. Backpropagating ``sum_k w_k L_k`` reproduces ``d`` exactly, which is
what lets amortized steps reuse ``alpha``, ``c`` and ``s`` with a single backward pass.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import ClassVar, Literal, NamedTuple, Protocol

import numpy as np
import torch
from torch import Tensor

from mogo.gram import (
    CheckedGram,
    GramEstimate,
    Normalization,
    check_gram,
    gradient_norms,
    host_float64,
    normalize_gram,
)
from mogo.solvers import Method, MinNormResult, min_norm

__all__ = ["Certificate", "CheckedWeighting", "MinNorm", "WeightedSum", "Weighting", "Weights"]


class Certificate(NamedTuple):
    """How a weighting's own solve went, for the diagnostics (:class:`mogo.ConflictReport`).

    Attributes:
        iterations: 0-d int64, the solver's iterations (linear solves, Newton steps, ...).
        kkt: 0-d float64, the worst violation of the method's optimality conditions
            (dimensionless; each weighting says how it is scaled).
        status: ``"success"`` or the reason the solve did not meet its tolerance.
        message: what to do about a status other than success; empty on success.
    """

    iterations: Tensor
    kkt: Tensor
    status: str = "success"
    message: str = ""


@dataclass(frozen=True)
class Weights:
    """The combination chosen by a weighting, for K objectives.

    Attributes:
        alpha: ``(K,)`` float64 with ``sum_k |alpha_k| = 1`` (0 for excluded objectives). It lies
            on the simplex for every weighting whose loss weights are non-negative (MinNorm,
            WeightedSum, UPGrad, CAGrad, NashMTL, PCGrad); where a method's weights can be
            negative (IMTLG, AlignedMTL) it keeps their signs. Amortized steps average it by EMA
            either way, which is linear in the loss weights.
        divisor: ``(K,)`` float64 ``c_k`` (1 where the weighting does not normalise).
        scale: ``s``, a 0-d float64 tensor (``sum_k |s alpha_k|``: the weights need not sum to 1).
        solve: the solver's result where one ran: a :class:`mogo.MinNormResult` or a
            :class:`Certificate` (0-d ``iterations`` and ``kkt`` either way).
        weighed: what the weights, and ``solve``'s certificate, are of: ``"gram"``, the Gram
            matrix given; ``"nearest_gram"``, the nearest Gram matrix of a declared
            :class:`mogo.GramEstimate` (the certificate is of that matrix, not of the estimate,
            which is indefinite where noise exceeds signal); ``"estimate"``, the estimate itself
            (a weighting that reads it, :attr:`mogo.CheckedWeighting.reads_estimate`).
    """

    alpha: Tensor
    divisor: Tensor
    scale: Tensor
    solve: MinNormResult | Certificate | None = None
    weighed: Literal["gram", "nearest_gram", "estimate"] = "gram"

    @property
    def loss_weights(self) -> Tensor:
        """``(K,)`` float64 ``w_k = s * alpha_k / c_k``."""
        return self.scale * self.alpha / self.divisor

    def check(self, weighting: object) -> Weights:
        """These weights, if ``alpha``, ``divisor``, ``scale`` and the loss weights are finite and
        every ``c_k`` is positive.

        Raises:
            ValueError: naming ``weighting`` (its repr) and the values, e.g. an overflow of
                ``s * alpha_k / c_k`` or a NaN from a weighting of one's own.
        """
        # A few dozen numbers: Python floats cost less than torch's ops, and s * a / c rounds
        # as loss_weights does (a NaN anywhere makes some loss weight NaN).
        alpha, divisor, scale = self.alpha.tolist(), self.divisor.tolist(), self.scale.item()
        if (
            all(map(math.isfinite, divisor))
            and min(divisor) > 0
            and all(math.isfinite(scale * a / c) for a, c in zip(alpha, divisor, strict=True))
        ):
            return self

        def shown(tensor: Tensor) -> str:
            return str([float(f"{x:.4g}") for x in tensor.reshape(-1).tolist()]).replace("'", "")

        raise ValueError(
            f"{weighting!r} returned weights that are not finite: loss weights {shown(self.loss_weights)} "
            f"= scale {float(self.scale):.4g} * alpha {shown(self.alpha)} / divisor {shown(self.divisor)}"
        )

    @classmethod
    def from_combination(
        cls,
        combination: Tensor | np.ndarray,
        divisor: Tensor | np.ndarray | None = None,
        solve: Certificate | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> Weights:
        """The weights ``w = combination / divisor``, that is ``d = sum_k combination_k g_k / c_k``:
        ``s = sum_k |combination_k|`` and ``alpha = combination / s`` (uniform when ``s = 0``).

        Args:
            combination: ``(K,)`` the coefficients on the divided gradients ``g_k / c_k``.
            divisor: ``(K,)`` ``c_k``, default 1.
            solve: the weighting's :class:`Certificate`, if it solved anything.
            device: where the tensors go (default: ``combination``'s device, the CPU for numpy).
        """
        if device is None:
            device = combination.device if isinstance(combination, Tensor) else "cpu"
        values = host_float64(combination)
        total = float(np.abs(values).sum())
        alpha = values / total if total > 0 else np.full_like(values, 1.0 / values.shape[-1])
        divisor = np.ones_like(values) if divisor is None else host_float64(divisor)
        tensors = (
            torch.from_numpy(np.array(a, dtype=np.float64)).to(device) for a in (alpha, divisor, total)
        )
        return cls(*tensors, solve)


class Weighting(Protocol):
    """Anything that maps ``(G (K, K) float64, losses (K,))`` to :class:`Weights`.

    mogo's own derive from :class:`CheckedWeighting`, which checks ``G`` and the weights. A
    weighting with state of its own (:class:`mogo.PCGrad`'s generator) also defines
    ``state_dict()``, ``load_state_dict(state)`` and ``state_problems(state) -> list[str]``;
    :class:`mogo.HarmonizedOptimizer` then checkpoints that state and restores it on a skipped step.
    """

    def __call__(self, gram: Tensor, losses: Tensor) -> Weights: ...


class CheckedWeighting(ABC):
    """A :class:`Weighting` that checks what it is given and what it returns, so that a subclass's
    :meth:`weigh` sees a valid ``G`` and its weights are finite: every weighting of mogo is one.

    Calling it checks ``G`` by :func:`mogo.check_gram` (a :class:`mogo.GramEstimate` may be
    indefinite) and the weights by :meth:`Weights.check`, each raising a ``ValueError`` that
    names the problem, and records in :attr:`Weights.weighed` whether the weights are of a
    declared estimate's nearest Gram matrix or of the estimate itself.
    """

    #: Whether :meth:`weigh` reads a declared estimate itself (:attr:`mogo.CheckedGram.estimate`
    #: or ``cross``), as a stochastic method that needs the unbiased matrix does, rather than only
    #: its nearest Gram matrix ``host``.
    reads_estimate: ClassVar[bool] = False

    def __call__(self, gram: Tensor | GramEstimate, losses: Tensor) -> Weights:
        """The weights for ``gram`` ``(K, K)`` and ``losses`` ``(K,)``, both checked."""
        checked = check_gram(gram)
        weights = self.weigh(checked, losses).check(self)
        if checked.estimate is None:
            return weights
        return replace(weights, weighed="estimate" if self.reads_estimate else "nearest_gram")

    @abstractmethod
    def weigh(self, gram: CheckedGram, losses: Tensor) -> Weights:
        """The weights for a checked Gram matrix and the ``(K,)`` losses."""


class MinNorm(CheckedWeighting):
    """MGDA / MARBLE: the minimum-norm point of the hull of the normalised gradients.

    Args:
        normalize: ``"l2"`` (MARBLE, ``c_k = ||g_k||``), ``"loss"`` (``c_k = L_k``) or ``"none"``.
        method: min-norm solver method (see :func:`mogo.min_norm`).
        scale: ``"mean_norm"`` (the default for ``"l2"``: ``s`` is the mean gradient norm, so the
            update equals the mean gradient when all gradients agree and learning rates carry
            over from weighted-sum training), ``"unit"`` (``s = 1``, the default otherwise) or a
            positive finite number.

    Example:
        >>> import torch, mogo
        >>> J = torch.tensor([[2.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
        >>> weights = mogo.MinNorm()(J @ J.T, torch.ones(2))
        >>> weights.alpha, weights.loss_weights
        (tensor([0.5000, 0.5000], dtype=torch.float64), tensor([0.3750, 0.7500], dtype=torch.float64))
    """

    def __init__(
        self,
        normalize: Normalization = "l2",
        *,
        method: Method = "auto",
        scale: Literal["mean_norm", "unit"] | float | None = None,
    ) -> None:
        if normalize not in ("l2", "loss", "none"):
            raise ValueError(f"unknown normalization {normalize!r}; use 'l2', 'loss' or 'none'")
        scale = ("mean_norm" if normalize == "l2" else "unit") if scale is None else scale
        if isinstance(scale, str) and scale not in ("mean_norm", "unit"):
            raise ValueError(f"scale must be 'mean_norm', 'unit' or a positive number, got {scale!r}")
        if not isinstance(scale, str) and not 0 < float(scale) < math.inf:
            raise ValueError(f"scale must be a positive finite number, got {scale}")
        self.normalize, self.method, self.scale = normalize, method, scale

    def weigh(self, gram: CheckedGram, losses: Tensor) -> Weights:
        normalized = normalize_gram(gram, self.normalize, losses=losses)
        result = min_norm(normalized.gram, method=self.method, precision=normalized.precision)
        if self.scale == "mean_norm":
            scale = float(gradient_norms(gram.host).mean())
        else:
            scale = 1.0 if self.scale == "unit" else float(self.scale)
        scale = torch.tensor(scale, dtype=torch.float64, device=gram.device)
        return Weights(normalized.expand(result.alpha), normalized.scale, scale, result)

    def __repr__(self) -> str:
        return f"MinNorm(normalize={self.normalize!r}, method={self.method!r}, scale={self.scale!r})"


class WeightedSum(CheckedWeighting):
    """The scalarisation baseline ``d = sum_k w_k g_k`` with fixed weights, through the same path.

    Args:
        weights: ``(K,)`` non-negative, not all zero, with a finite sum.
    """

    def __init__(self, weights: Tensor | list[float]) -> None:
        weights = torch.as_tensor(weights, dtype=torch.float64).reshape(-1)
        if weights.numel() == 0 or not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()):
            raise ValueError(f"weights must be finite and non-negative, got {weights.tolist()}")
        total = float(weights.sum())
        if not total > 0:
            raise ValueError("weights must not all be zero")
        if total == math.inf:
            raise ValueError(f"weights must have a finite sum, got {weights.tolist()}, whose sum overflows")
        self.weights = weights

    def weigh(self, gram: CheckedGram, losses: Tensor) -> Weights:
        K = gram.host.shape[0]
        if self.weights.numel() != K:
            raise ValueError(f"WeightedSum has {self.weights.numel()} weights for {K} objectives")
        weights = self.weights.to(gram.device)
        total = weights.sum()
        return Weights(weights / total, torch.ones_like(weights), total)

    def __repr__(self) -> str:
        return f"WeightedSum({self.weights.tolist()})"
