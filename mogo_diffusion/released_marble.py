"""MARBLE as the released code trains: its schedule, its solve and its amortized advantage.

The released code (aim-uofa/MARBLE at ``1bf9543``, ``train.py`` and
``flow_grpo/pareto_balancer``; read line by line in the project's notes) differs from the
paper's description that :class:`mogo.HarmonizedOptimizer` implements (the ``marble`` strategy).
These are its pieces, which the ``marble_released`` strategy
(:class:`mogo_diffusion.strategies.MarbleReleased`) runs micro-step by micro-step (one micro-step
is one ``backward`` of the trainer: one micro-batch at one timestep):

* **When it solves** (:class:`ReleasedSchedule`). A micro-step reuses the cached alpha when one
  exists, ``step >= warmup`` and ``step - last_solve < N``; otherwise it solves and sets
  ``last_solve = step`` (``step``: the optimizer steps taken). With ``N = 10`` and ``warmup = 1``,
  every micro-step of step 0 solves, the first micro-step of steps 10, 20, ... solves, and every
  other micro-step is amortized.
* **A solve** (:func:`released_direction`). The K per-reward NFT losses, each a mean over the
  samples the reward applies to (NaN advantages 0 first), give K gradients over the adapter
  (non-finite entries set to 0); a gradient of norm at most :data:`NORM_FLOOR` or not finite is
  dropped (alpha 0). With ``u_k = g_k / ||g_k||``, ``alpha`` minimises ``1/2 a^T U U^T a`` on the
  simplex (scipy's SLSQP from the uniform start, ``ftol`` 1e-8, 500 iterations, clipped to
  ``>= 0`` and renormalised; the uniform alpha when SLSQP fails, :func:`slsqp_alpha`), and the
  micro-step's gradient is

  .. math::  d = \\mathrm{mean}_k \\|g_k\\| \\sum_k \\alpha_k u_k \\; + \\; \\nabla L_{KL}

  with the *fresh* alpha (one valid gradient: that gradient; none: 0). Then
  ``cached = rho cached + (1 - rho) alpha`` (the first solve sets it), at every solve, so 192
  blends inside step 0 of the release recipe and one per solve afterwards.
* **An amortized micro-step** (:func:`combined_advantage`): one NFT loss over every sample of the
  micro-batch with the advantage ``A_i = sum_k cached_k nan_to_num(A_ik, 0)`` (clipped to
  ``+-C`` by the loss), plus the KL term: alpha on the *raw* per-reward advantages, with neither
  the solve's division by the gradient norms nor its per-reward masks. At the on-policy point
  its gradient is ``sum_k alpha_k (n_k / B) grad L_k``: a reward that applies to a share
  ``n_k / B`` of the samples gets that share of its alpha, and the direction is not the solve's.
* The equal-alpha ablation: alpha fixed at ``1/K`` (or given values), every micro-step amortized.

The per-reward advantages are :func:`~mogo_diffusion.advantages.per_reward_advantages` with the
std of the whole batch and no clipping (the release clips only inside the loss).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Real
from typing import Any

import numpy as np
import torch
from scipy.optimize import minimize
from torch import Tensor

import mogo

__all__ = [
    "NORM_FLOOR",
    "RELEASE",
    "ReleasedSchedule",
    "combined_advantage",
    "released_direction",
    "slsqp_alpha",
]

RELEASE = "aim-uofa/MARBLE@1bf9543aa44112c6f9f8b852597b159beccd9136"
"""The code these pieces reproduce."""

NORM_FLOOR = 1e-12
"""A gradient of norm at most this (or not finite) takes no part in a solve (the release's floor)."""


def slsqp_alpha(gram: np.ndarray) -> np.ndarray:
    """The release's QP: ``argmin_a 1/2 a^T G a`` over the simplex by scipy's SLSQP.

    Starts from the uniform alpha, ``ftol=1e-8``, ``maxiter=500``, bounds ``[0, 1]`` and
    ``sum a = 1``; the answer is clipped to ``>= 0`` and renormalised, and the uniform alpha is
    returned where SLSQP reports a failure. (The objective's gradient ``G a`` is passed; the
    release's notes do not record whether it does, and without it SLSQP differences it.)

    Args:
        gram: ``(K, K)`` float64 Gram matrix of the unit gradients.

    Returns:
        ``(K,)`` float64 on the simplex.

    >>> slsqp_alpha(np.array([[1.0, 0.0], [0.0, 1.0]])).round(6)
    array([0.5, 0.5])
    """
    K = gram.shape[0]
    start = np.full(K, 1.0 / K)
    result = minimize(
        lambda a: 0.5 * a @ gram @ a,
        start,
        jac=lambda a: gram @ a,
        method="SLSQP",
        bounds=[(0.0, 1.0)] * K,
        constraints=[{"type": "eq", "fun": lambda a: a.sum() - 1.0, "jac": lambda a: np.ones_like(a)}],
        options={"ftol": 1e-8, "maxiter": 500},
    )
    if not result.success:
        return start
    alpha = np.clip(result.x, 0.0, None)
    total = alpha.sum()
    return alpha / total if total > 0 else start


def _exact_alpha(gram: np.ndarray) -> np.ndarray:
    return mogo.min_norm(torch.from_numpy(gram)).alpha.numpy()


SOLVERS = {"slsqp": slsqp_alpha, "exact": _exact_alpha}
"""The QP solvers by ``strategy.solver``: the release's SLSQP, or mogo's exact min-norm point."""


def released_direction(grads: Tensor, solver: str = "slsqp") -> tuple[Tensor, Tensor]:
    """One solve: the fresh alpha and the micro-step's direction from the K per-reward gradients.

    Args:
        grads: ``[K, P]`` the per-reward gradients, flat over the adapter (their losses
            already scaled as the step scales them); non-finite entries count as 0.
        solver: ``"slsqp"`` (:func:`slsqp_alpha`) or ``"exact"`` (:func:`mogo.min_norm`).

    Returns:
        ``alpha`` ``(K,)`` float64 (0 for a dropped gradient) and the direction ``[P]`` in
        ``grads``' dtype: ``mean_k ||g_k|| sum_k alpha_k g_k / ||g_k||`` over the kept gradients;
        the gradient itself when one is kept (alpha 1 there), zeros when none is.
    """
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {', '.join(SOLVERS)}, got {solver!r}")
    grads = torch.nan_to_num(grads, nan=0.0, posinf=0.0, neginf=0.0)
    norms = grads.norm(dim=1)
    kept = (torch.isfinite(norms) & (norms > NORM_FLOOR)).nonzero().flatten()
    alpha = torch.zeros(len(grads), dtype=torch.float64)
    if len(kept) == 0:
        return alpha, torch.zeros_like(grads[0])
    if len(kept) == 1:
        alpha[kept] = 1.0
        return alpha, grads[kept[0]].clone()
    unit = grads[kept] / norms[kept, None]
    unit64 = unit.double()
    solved = SOLVERS[solver]((unit64 @ unit64.T).cpu().numpy())
    alpha[kept.cpu()] = torch.from_numpy(solved)
    direction = norms[kept].mean() * (alpha[kept.cpu()].to(unit) @ unit)
    return alpha, direction


def combined_advantage(advantages: Tensor, alpha: Tensor) -> Tensor:
    """An amortized micro-step's advantage ``A_i = sum_k alpha_k nan_to_num(A_ik, 0)``: ``[b]``
    from ``advantages [b, K]`` and ``alpha (K,)``, in float64 (the loss clips it to ``+-C``).

    >>> combined_advantage(torch.tensor([[1.0, float("nan")], [-1.0, 2.0]]), torch.tensor([0.5, 0.5]))
    tensor([0.5000, 0.5000], dtype=torch.float64)
    """
    return advantages.detach().double().nan_to_num(0.0) @ alpha.double().to(advantages.device)


class ReleasedSchedule:
    """When a micro-step solves, and the cached alpha the others reuse (the module docstring).

    Args:
        objectives: K.
        every: N, optimizer steps from one solve to the next (``amortize_every_n``).
        warmup: optimizer steps whose every micro-step solves (``amortize_warmup``).
        ema: rho in [0, 1), the decay of the cached alpha, blended at every solve.
        fixed: K fixed alphas (the equal-alpha ablation: ``1/K`` each): nothing is ever solved.

    >>> schedule = ReleasedSchedule(2, every=10, warmup=1, ema=0.7)
    >>> [schedule.solving() for _ in range(2)]  # step 0, no alpha cached yet
    [True, True]
    >>> schedule.blend(torch.tensor([1.0, 0.0])); schedule.blend(torch.tensor([0.0, 1.0]))
    >>> schedule.cached
    tensor([0.7000, 0.3000], dtype=torch.float64)
    >>> schedule.step = 1
    >>> schedule.solving()  # step 1: within N steps of the solves of step 0
    False
    """

    def __init__(
        self, objectives: int, *, every: int, warmup: int, ema: float, fixed: Sequence[float] | None = None
    ) -> None:
        if not (isinstance(every, Integral) and every >= 1):
            raise ValueError(f"every must be a positive integer, got {every!r}")
        if not (isinstance(warmup, Integral) and warmup >= 0):
            raise ValueError(f"warmup must be a non-negative integer, got {warmup!r}")
        if not (isinstance(ema, Real) and 0 <= ema < 1):
            raise ValueError(f"ema must be in [0, 1), got {ema!r}")
        self.objectives, self.every, self.warmup, self.ema = objectives, int(every), int(warmup), float(ema)
        self.fixed = None if fixed is None else _fixed_alpha(fixed, objectives)
        self.step = 0
        self.last_solve = 0
        self.solves = 0
        self.cached: Tensor | None = self.fixed

    def solving(self) -> bool:
        """Whether the next micro-step solves (the release's condition, ``train.py`` L1481-1493)."""
        if self.fixed is not None:
            return False
        reuse = (
            self.cached is not None and self.step >= self.warmup and self.step - self.last_solve < self.every
        )
        return not reuse

    def blend(self, fresh: Tensor) -> None:
        """Record a solve of this step: ``cached = ema cached + (1 - ema) fresh`` (the first sets it)."""
        fresh = fresh.detach().to(torch.float64).cpu()
        self.cached = (
            fresh.clone() if self.cached is None else self.ema * self.cached + (1 - self.ema) * fresh
        )
        self.last_solve = self.step
        self.solves += 1

    def state_dict(self) -> dict[str, Any]:
        """``step``, ``last_solve``, ``solves`` and ``cached`` (a list of K floats, or None)."""
        cached = None if self.cached is None else self.cached.tolist()
        return {"step": self.step, "last_solve": self.last_solve, "solves": self.solves, "cached": cached}

    def load_state_dict(self, state: Any) -> None:
        """Restore a :meth:`state_dict`; ``ValueError`` naming every bad field, before anything changes."""
        if not isinstance(state, dict):
            raise ValueError(f"marble_released state must be a dict, got {type(state).__name__}")
        problems = [
            f"{key}: missing" for key in ("step", "last_solve", "solves", "cached") if key not in state
        ]
        for key in ("step", "last_solve", "solves"):
            value = state.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
                problems.append(f"{key}: must be a non-negative integer, got {value!r}")
        cached = state.get("cached")
        valid = isinstance(cached, list) and len(cached) == self.objectives
        if cached is not None and not (
            valid and all(isinstance(a, Real) and math.isfinite(a) for a in cached)
        ):
            problems.append(f"cached: must be None or {self.objectives} finite numbers, got {cached!r}")
        if problems:
            raise ValueError(f"invalid marble_released state: {'; '.join(problems)}")
        self.step, self.last_solve, self.solves = state["step"], state["last_solve"], state["solves"]
        if self.fixed is None:
            self.cached = None if cached is None else torch.tensor(cached, dtype=torch.float64)


def _fixed_alpha(values: Sequence[float], objectives: int) -> Tensor:
    alpha = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    if alpha.shape != (objectives,) or not bool(torch.isfinite(alpha).all()) or bool((alpha < 0).any()):
        raise ValueError(
            f"fixed alphas must be {objectives} finite non-negative numbers, got {list(values)!r}"
        )
    return alpha
