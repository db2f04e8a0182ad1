"""Weights from the rewards' improvement rates (FAMO-style): more weight to the reward that lags.

FAMO (Liu, Liu, Jin, Stone & Liu 2023, "FAMO: Fast Adaptive Multitask Optimization", NeurIPS)
keeps weights ``z = softmax(xi)`` over K objectives and after each step moves the logits against
the objectives' improvements ``delta_k`` (the drop of each log loss):

.. math::  \\xi \\leftarrow \\xi - \\eta \\, (\\partial z / \\partial \\xi)^\\top \\delta
           = \\xi - \\eta \\; z \\odot (\\delta - \\langle z, \\delta \\rangle)

An objective that improved more than the z-weighted average loses weight and one that lagged
gains it, so the weights balance the rates of improvement, read from objective values alone:
no per-objective gradient, whose per-step noise (a cosine of 0.05 between two batches' gradients
of one reward on the shapes world) dominates every Gram matrix.

Here the objectives are rewards, to be raised, and the signal is their per-epoch batch means
``m_k(t)`` over the samples each applies to. A reward's improvement rate is the least-squares
slope of its last ``window`` means per epoch, in units of its spread within an epoch (the mean of
its batch stds ``s_k(t)`` over the window):

.. math::  \\delta_k = \\mathrm{slope}_t\\, m_k(t) \\; / \\; \\overline{s_k}

and one step of the update above follows each epoch once ``window`` means exist. A reward with
no mean or no spread in the window (it applied to no sample) takes the z-weighted mean rate of
the others, so that its own logit stays put. Where this differs from FAMO: one step per epoch
from a slope over a window (FAMO: one per optimizer step, from consecutive losses), plain gradient
steps (FAMO's are Adam's), and no decay of the logits (FAMO's ``gamma = 0.01`` pulls the weights
towards uniform): equal improvements leave the weights as they are. They start at the prior,
the rewards' configured weights normalised to sum 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Real
from typing import Any

import torch
from torch import Tensor

__all__ = ["ImprovementWeights", "improvement_rates", "logit_step"]


def improvement_rates(epochs: Sequence[int], means: Tensor, stds: Tensor) -> Tensor:
    """``delta_k``: the least-squares slope of ``means [W, K]`` over ``epochs`` (W of them), over
    the mean of ``stds [W, K]``; NaN for a reward with a NaN mean or no spread in the window.

    >>> improvement_rates([0, 1, 2], torch.tensor([[0.0, 1.0], [0.1, 1.0], [0.2, 1.0]]),
    ...                   torch.full((3, 2), 0.5, dtype=torch.float64))
    tensor([0.2000, 0.0000], dtype=torch.float64)
    """
    t = torch.as_tensor(list(epochs), dtype=torch.float64)
    centred = t - t.mean()
    means, stds = means.to(torch.float64), stds.to(torch.float64)
    slope = centred @ (means - means.mean(0)) / centred.square().sum()
    scale = stds.mean(0)
    return torch.where(scale > 0, slope / scale, math.nan)


def logit_step(logits: Tensor, rates: Tensor, lr: float) -> Tensor:
    """FAMO's update ``xi - lr z (delta - <z, delta>)`` with ``z = softmax(xi)``; a NaN rate is
    replaced by the z-weighted mean of the others first (its own logit then stays put).

    >>> logit_step(torch.zeros(2, dtype=torch.float64), torch.tensor([0.2, 0.0], dtype=torch.float64), 1.0)
    tensor([-0.0500,  0.0500], dtype=torch.float64)
    """
    z = torch.softmax(logits, 0)
    known = ~torch.isnan(rates)
    if not bool(known.any()):
        return logits.clone()
    mean = (z[known] @ rates[known]) / z[known].sum()
    delta = torch.where(known, rates, mean)
    return logits - lr * z * (delta - z @ delta)


class ImprovementWeights:
    """The weights ``z`` of the rewards, moved each epoch from their improvement rates.

    Args:
        prior: the K starting weights, positive and finite (normalised to sum 1).
        window: epochs (>= 2) whose means give a rate.
        lr: the step size ``eta`` (> 0), in logits per unit of rate (a rate is a reward's change
            per epoch in units of its within-epoch std).

    >>> weights = ImprovementWeights([1.0, 1.0], window=2, lr=10.0)
    >>> weights.observe(0, torch.tensor([0.0, 0.0]), torch.tensor([1.0, 1.0]))
    >>> weights.observe(1, torch.tensor([0.1, 0.0]), torch.tensor([1.0, 1.0]))  # reward 0 improved
    >>> weights.weights  # so reward 1 gains weight
    tensor([0.3775, 0.6225], dtype=torch.float64)
    """

    def __init__(self, prior: Sequence[float], *, window: int, lr: float) -> None:
        prior_t = torch.as_tensor(list(prior), dtype=torch.float64)
        if prior_t.ndim != 1 or not len(prior_t) or not bool((torch.isfinite(prior_t) & (prior_t > 0)).all()):
            raise ValueError(f"prior must be positive finite weights, got {list(prior)!r}")
        if isinstance(window, bool) or not (isinstance(window, Integral) and window >= 2):
            raise ValueError(f"window must be an integer >= 2, got {window!r}")
        if not (isinstance(lr, Real) and 0 < lr < math.inf):
            raise ValueError(f"lr must be a positive finite number, got {lr!r}")
        self.window, self.lr = int(window), float(lr)
        self.logits = (prior_t / prior_t.sum()).log()
        self.epochs: list[int] = []
        self.means: list[list[float]] = []
        self.stds: list[list[float]] = []

    @property
    def weights(self) -> Tensor:
        """``(K,)`` float64 on the simplex: ``softmax(logits)``."""
        return torch.softmax(self.logits, 0)

    def observe(self, epoch: int, means: Tensor, stds: Tensor) -> None:
        """Record an epoch's per-reward means and stds ``(K,)`` (NaN: the reward applied to no
        sample) and, once ``window`` epochs are recorded, take one step. Observing the last
        recorded epoch again changes nothing (a repeated epoch is not new evidence).

        Raises:
            ValueError: ``epoch`` is before the last recorded one, or the shapes are not ``(K,)``.
        """
        K = len(self.logits)
        if means.shape != (K,) or stds.shape != (K,):
            raise ValueError(
                f"means and stds must have shape ({K},), got {tuple(means.shape)}, {tuple(stds.shape)}"
            )
        if self.epochs and epoch <= self.epochs[-1]:
            if epoch == self.epochs[-1]:
                return
            raise ValueError(f"epoch {epoch} is before the last observed epoch {self.epochs[-1]}")
        self.epochs = [*self.epochs, int(epoch)][-self.window :]
        self.means = [*self.means, means.double().tolist()][-self.window :]
        self.stds = [*self.stds, stds.double().tolist()][-self.window :]
        if len(self.epochs) == self.window:
            rates = improvement_rates(self.epochs, torch.tensor(self.means), torch.tensor(self.stds))
            self.logits = logit_step(self.logits, rates, self.lr)

    def state_dict(self) -> dict[str, Any]:
        """The logits and the recorded window, as plain lists (JSON's ``null`` for NaN)."""
        means, stds = (
            [[None if math.isnan(x) else x for x in row] for row in rows] for rows in (self.means, self.stds)
        )
        return {"logits": self.logits.tolist(), "epochs": list(self.epochs), "means": means, "stds": stds}

    def load_state_dict(self, state: Any) -> None:
        """Restore a :meth:`state_dict`; ``ValueError`` naming every bad field, before anything changes."""
        if not isinstance(state, dict):
            raise ValueError(f"famo state must be a dict, got {type(state).__name__}")
        K, problems = len(self.logits), []
        logits = state.get("logits")
        if not (isinstance(logits, list) and len(logits) == K and all(_finite(x) for x in logits)):
            problems.append(f"logits: must be {K} finite numbers, got {logits!r}")
        epochs = state.get("epochs")
        if not (isinstance(epochs, list) and len(epochs) <= self.window and all(_index(e) for e in epochs)):
            problems.append(f"epochs: must be at most {self.window} non-negative integers, got {epochs!r}")
        count = len(epochs) if isinstance(epochs, list) else -1
        for key in ("means", "stds"):
            rows = state.get(key)
            if not (isinstance(rows, list) and len(rows) == count and all(_row(r, K) for r in rows)):
                problems.append(f"{key}: must be one row of {K} numbers per recorded epoch, got {rows!r}")
        if problems:
            raise ValueError(f"invalid famo state: {'; '.join(problems)}")
        self.logits = torch.tensor(logits, dtype=torch.float64)
        self.epochs = list(epochs)
        self.means, self.stds = (
            [[math.nan if x is None else float(x) for x in row] for row in state[key]]
            for key in ("means", "stds")
        )


def _finite(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def _index(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool) and value >= 0


def _row(row: Any, K: int) -> bool:
    """A list of K numbers or None (a reward that applied to no sample)."""
    return isinstance(row, list) and len(row) == K and all(x is None or _finite(x) for x in row)
