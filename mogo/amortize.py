"""Amortized harmonization: when to solve for new weights, and which weights to reuse meanwhile.

Every ``harmonize_every`` optimizer steps the K gradients are computed and a weighting solved.
In between, the loss weights ``w_k = s * alpha_k / c_k`` are rebuilt from the cached divisors
``c`` and scale ``s`` of the last harmonization and from ``alpha`` smoothed by an exponential
moving average, ``alpha <- rho * alpha + (1 - rho) * alpha_new`` (the first harmonization's
``alpha`` as it is). A step then costs one backward pass of ``sum_k w_k L_k``; since
``d = sum_k w_k g_k`` is linear in the losses, that pass reproduces exactly the direction the
weights define.

The average is CR-MOGM's (Zhou, Zhang, Jiang, Yang, Chen & Ye 2022, "On the Convergence of
Stochastic Multi-Objective Gradient Manipulation and Beyond", NeurIPS; TorchJD's
``CRMOGMWeighting``): weights smoothed across the harmonizations against their noise. Two
choices differ from it. A harmonization step applies its fresh weights, and the smoothed ones
serve the steps between (MARBLE as released), unless ``smooth_harmonized``, which applies them
at the harmonization too: CR-MOGM itself, with ``harmonize_every=1`` every step. And the average
is of ``alpha``, with the last harmonization's ``c`` and ``s``: the loss weights CR-MOGM smooths
where ``c`` and ``s`` stay put (MinNorm without normalisation, WeightedSum, MoDo, SDMGrad), the
smoothed direction in the unit gradients' coordinates with today's norms where they do not.
"""

from __future__ import annotations

from dataclasses import replace
from numbers import Integral, Real
from typing import Any

import torch
from torch import Tensor

from mogo.weighting import Weights

__all__ = ["AmortizedWeights"]

_FIELDS = ("harmonize_every", "alpha_ema", "step", "alpha", "divisor", "scale")


def _is_integer(value: Any) -> bool:
    """An int (not a bool), or a float with an integer value."""
    if isinstance(value, bool) or not isinstance(value, Real):
        return False
    return isinstance(value, Integral) or float(value).is_integer()


def _schedule_problems(harmonize_every: Any, alpha_ema: Any) -> dict[str, str]:
    """``{field: problem}`` for a bad ``harmonize_every`` or ``alpha_ema``."""
    problems = {}
    if not (_is_integer(harmonize_every) and harmonize_every >= 1):
        problems["harmonize_every"] = f"harmonize_every must be a positive integer, got {harmonize_every!r}"
    if isinstance(alpha_ema, bool) or not (isinstance(alpha_ema, Real) and 0.0 <= alpha_ema < 1.0):
        problems["alpha_ema"] = f"alpha_ema must be in [0, 1), got {alpha_ema!r}"
    return problems


def _cache_problem(value: Any, shape: tuple[int, ...], nonzero: bool) -> str | None:
    """What is wrong with a cached tensor (alpha, divisor, scale) that should have ``shape``."""
    if not isinstance(value, Tensor) or not value.is_floating_point() or tuple(value.shape) != shape:
        got = (
            f"shape {tuple(value.shape)}, {value.dtype}"
            if isinstance(value, Tensor)
            else type(value).__name__
        )
        return f"must be a floating tensor of shape {shape}, got {got}"
    if not bool(torch.isfinite(value).all()) or (nonzero and bool((value == 0).any())):
        return f"must be finite{' and non-zero' if nonzero else ''}, got {value.tolist()}"
    return None


class AmortizedWeights:
    """The schedule and cache of amortized harmonization.

    Args:
        harmonize_every: N; solve on optimizer steps 0, N, 2N, ... (1 solves every step).
        alpha_ema: rho in [0, 1); 0 reuses the last alpha as it is.
        smooth_harmonized: a harmonization step applies the smoothed weights too (CR-MOGM),
            not its own (the module docstring). A setting, as the optimizer's are: it is not
            part of its ``state_dict``.
    """

    def __init__(
        self, harmonize_every: int = 1, alpha_ema: float = 0.0, smooth_harmonized: bool = False
    ) -> None:
        problems = _schedule_problems(harmonize_every, alpha_ema)
        if problems:
            raise ValueError("; ".join(problems.values()))
        if not isinstance(smooth_harmonized, bool):
            raise TypeError(f"smooth_harmonized must be True or False, got {smooth_harmonized!r}")
        self.harmonize_every = int(harmonize_every)
        self.alpha_ema = float(alpha_ema)
        self.smooth_harmonized = smooth_harmonized
        self.step = 0
        self.alpha: Tensor | None = None
        self.divisor: Tensor | None = None
        self.scale: Tensor | None = None

    @property
    def due(self) -> bool:
        """Whether the current optimizer step harmonizes."""
        return self.alpha is None or self.step % self.harmonize_every == 0

    def update(self, weights: Weights) -> Weights:
        """Fold the weights of a harmonization step into the cache, and return the weights the
        step applies: its own, or with ``smooth_harmonized`` the smoothed ones."""
        alpha = weights.alpha.detach().to(torch.float64)
        if self.alpha is not None and self.alpha_ema > 0:
            alpha = self.alpha_ema * self.alpha.to(alpha.device) + (1 - self.alpha_ema) * alpha
        self.alpha = alpha
        self.divisor = weights.divisor.detach().to(torch.float64)
        self.scale = weights.scale.detach().to(torch.float64)
        if not self.smooth_harmonized:
            return weights
        return replace(weights, alpha=self.alpha, divisor=self.divisor, scale=self.scale)

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

    @staticmethod
    def state_problems(state: Any, objectives: int | None = None) -> list[str]:
        """Everything wrong with a :meth:`state_dict`, as ``"field: problem"`` strings (empty:
        it loads). ``objectives``: the K that alpha and the divisors must have (default:
        alpha's own length). Alpha may be any finite vector (weightings other than
        MinNorm need not stay on the simplex); the divisors must be finite and non-zero."""
        if not isinstance(state, dict):
            return [f"must be a dict, got {type(state).__name__}"]
        problems = [f"{field}: missing" for field in _FIELDS if field not in state]
        problems += [f"{field}: unexpected" for field in sorted(map(str, set(state) - set(_FIELDS)))]
        schedule = _schedule_problems(state.get("harmonize_every", 1), state.get("alpha_ema", 0.0))
        problems += [f"{field}: {problem}" for field, problem in schedule.items()]
        if not (_is_integer(state.get("step", 0)) and state.get("step", 0) >= 0):
            problems.append(f"step: must be a non-negative integer, got {state['step']!r}")
        alpha = state.get("alpha")
        if any(state.get(name) is not None for name in ("alpha", "divisor", "scale")):
            if objectives is None:
                objectives = alpha.shape[0] if isinstance(alpha, Tensor) and alpha.ndim == 1 else 0
            for name, shape, nonzero in (("alpha", (objectives,), False), ("divisor", (objectives,), True),
                                         ("scale", (), False)):  # fmt: skip
                problem = _cache_problem(state.get(name), shape, nonzero)
                problems += [] if problem is None else [f"{name}: {problem}"]
        return problems

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; a bad one raises ``ValueError`` naming every bad field,
        before anything changes."""
        problems = self.state_problems(state)
        if problems:
            raise ValueError(f"invalid amortization state: {'; '.join(problems)}")
        self.harmonize_every = int(state["harmonize_every"])
        self.alpha_ema = float(state["alpha_ema"])
        self.step = int(state["step"])
        self.alpha, self.divisor, self.scale = state["alpha"], state["divisor"], state["scale"]
