"""Group-normalised advantages, one per reward (MARBLE) or of the weighted sum (the baseline).

For rewards ``R`` (``[B, K]``, NaN where reward k does not apply to sample i) and prompt groups
``g(i)`` (the G images of one prompt share a group):

.. code-block:: text

    A_ik = clamp((R_ik - mean_{j in g(i)} R_jk) / (std_k + eps), -C, C)

with means and stds over the applicable samples only, ``std_k`` the population std of reward k
over the whole batch (``std_scope="batch"``, as DiffusionNFT and Flow-GRPO) or over i's group
(``"group"``), ``eps = 1e-4`` and ``C = adv_clip = 5``. A non-applicable reward gives a NaN
advantage, which the NFT loss leaves out; a group with one applicable sample gets advantage 0.
Statistics are computed in float64.

>>> import torch
>>> rewards = torch.tensor([[1.0, 0.2], [3.0, float("nan")], [2.0, 0.4], [2.0, 0.4]])
>>> per_reward_advantages(rewards, [0, 0, 1, 1])
tensor([[-1.4140,  0.0000],
        [ 1.4140,     nan],
        [ 0.0000,  0.0000],
        [ 0.0000,  0.0000]])
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "StdScope",
    "nan_mean",
    "normalize_then_sum",
    "per_reward_advantages",
    "weighted_sum_advantages",
    "zscore_rewards",
]

StdScope = Literal["batch", "group"]


def nan_mean(values: Tensor) -> Tensor:
    """Column means of ``[N, K]`` scores over the applicable (non-NaN) rows; NaN for an empty column.

    >>> nan_mean(torch.tensor([[1.0, float("nan")], [3.0, float("nan")]]))
    tensor([2., nan])
    """
    applicable = ~torch.isnan(values)
    total = torch.where(applicable, values, 0.0).sum(0)
    count = applicable.sum(0)
    return torch.where(count > 0, total / count.clamp(min=1), float("nan"))


def _reward_name(names: Sequence[str] | None, k: int) -> str:
    return f"reward {k}" if names is None else f"reward {names[k]!r}"


def _check_rewards(rewards: Tensor, names: Sequence[str] | None) -> None:
    if not isinstance(rewards, Tensor) or rewards.ndim != 2 or not rewards.is_floating_point():
        shape = tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a floating [B, K] tensor, got {shape}")
    if names is not None and len(names) != rewards.shape[1]:
        raise ValueError(f"names has {len(names)} entries for {rewards.shape[1]} rewards")
    infinite = torch.isinf(rewards).any(dim=0).nonzero().flatten().tolist()
    if infinite:
        raise ValueError(
            f"{_reward_name(names, infinite[0])} has infinite values; rewards must be finite or NaN"
        )


def _group_index(group_ids: Tensor | Sequence[Hashable], batch: int, device: torch.device) -> Tensor:
    """Group ids (a ``[B]`` integer tensor or ``B`` hashables, e.g. prompts) as indices ``0..G-1``."""
    if isinstance(group_ids, Tensor):
        if group_ids.shape != (batch,) or group_ids.is_floating_point() or group_ids.is_complex():
            raise ValueError(
                f"group_ids must be an integer tensor of shape ({batch},), "
                f"got {group_ids.dtype} {tuple(group_ids.shape)}"
            )
        return torch.unique(group_ids, return_inverse=True)[1].to(device)
    ids = list(group_ids)
    if len(ids) != batch:
        raise ValueError(f"group_ids has {len(ids)} entries for a batch of {batch}")
    index: dict[Hashable, int] = {}
    return torch.tensor([index.setdefault(i, len(index)) for i in ids], dtype=torch.long, device=device)


def per_reward_advantages(
    rewards: Tensor,
    group_ids: Tensor | Sequence[Hashable],
    *,
    std_scope: StdScope = "batch",
    adv_clip: float = 5.0,
    eps: float = 1e-4,
    names: Sequence[str] | None = None,
    ddof: int = 0,
) -> Tensor:
    """Per-reward group-normalised advantages.

    Args:
        rewards: ``[B, K]`` floating, NaN where a reward does not apply; finite otherwise.
        group_ids: ``[B]`` integer tensor, or B hashables (e.g. the prompts); samples of one
            prompt share an id.
        std_scope: ``"batch"`` (the std of reward k over all its applicable samples) or ``"group"``.
        adv_clip: ``C`` > 0, the advantages are clipped to ``[-C, C]`` (``inf`` disables it).
        eps: > 0, added to the std.
        names: the rewards' names, for error messages.
        ddof: 0 for the population std (DiffusionNFT's ``np.std``), 1 for the Bessel-corrected
            one (``n - 1``, TRL's ``nanstd``); a std over fewer than ``ddof + 1`` samples is 0.

    Returns:
        ``[B, K]`` advantages in ``rewards``' dtype and device, NaN exactly where ``rewards`` is.

    Raises:
        ValueError: bad shapes or options, or an infinite reward (named).
    """
    _check_rewards(rewards, names)
    if std_scope not in ("batch", "group"):
        raise ValueError(f"std_scope must be 'batch' or 'group', got {std_scope!r}")
    if not adv_clip > 0:
        raise ValueError(f"adv_clip must be > 0, got {adv_clip!r}")
    if not 0 < eps < float("inf"):
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
    if ddof not in (0, 1):
        raise ValueError(f"ddof must be 0 (population std) or 1 (Bessel-corrected), got {ddof!r}")
    B, K = rewards.shape
    group = _group_index(group_ids, B, rewards.device)
    G = int(group.max()) + 1 if B else 0
    R = rewards.detach().to(torch.float64)
    valid = ~torch.isnan(R)
    x = torch.where(valid, R, 0.0)

    def group_mean(values: Tensor, count: Tensor) -> Tensor:
        return R.new_zeros(G, K).index_add_(0, group, values) / count.clamp_min(1)

    count = R.new_zeros(G, K).index_add_(0, group, valid.to(R.dtype))
    centred = torch.where(valid, R - group_mean(x, count)[group], 0.0)
    if std_scope == "batch":
        deviation = torch.where(valid, R - nan_mean(R), 0.0)
        std = (deviation.square().sum(0) / (valid.sum(0) - ddof).clamp_min(1)).sqrt()
    else:
        std = group_mean(centred.square(), count - ddof).sqrt()[group]
    advantages = (centred / (std + eps)).clamp(-adv_clip, adv_clip)
    return torch.where(valid, advantages, float("nan")).to(rewards.dtype)


def weighted_sum_advantages(
    rewards: Tensor,
    weights: Tensor | Sequence[float],
    group_ids: Tensor | Sequence[Hashable],
    *,
    nan: Literal["zero", "raise"] = "zero",
    std_scope: StdScope = "batch",
    adv_clip: float = 5.0,
    eps: float = 1e-4,
    names: Sequence[str] | None = None,
) -> Tensor:
    """The baseline's one advantage per sample: the normalisation above applied to ``sum_k w_k R_k``.

    This is how DiffusionNFT and Flow-GRPO train on several rewards. A NaN reward counts as 0 in
    the sum (``nan="zero"``, TRL's ``nansum``): when applicability is a property of the prompt, that
    constant cancels in the group mean and only the batch std sees it. ``nan="raise"`` raises
    instead, naming the reward and the samples.

    Args:
        rewards: ``[B, K]`` as in :func:`per_reward_advantages`.
        weights: ``[K]`` finite weights.
        group_ids, std_scope, adv_clip, eps, names: as in :func:`per_reward_advantages`.

    Returns:
        ``[B]`` advantages in ``rewards``' dtype and device (no NaN).
    """
    _check_rewards(rewards, names)
    if nan not in ("zero", "raise"):
        raise ValueError(f"nan must be 'zero' or 'raise', got {nan!r}")
    w = torch.as_tensor(weights, dtype=torch.float64, device=rewards.device)
    if w.shape != (rewards.shape[1],) or not bool(torch.isfinite(w).all()):
        raise ValueError(f"weights must be {rewards.shape[1]} finite numbers, got {w.tolist()}")
    missing = torch.isnan(rewards)
    if nan == "raise" and bool(missing.any()):
        k = int(missing.any(dim=0).nonzero()[0])
        samples = missing[:, k].nonzero().flatten().tolist()
        raise ValueError(
            f"{_reward_name(names, k)} is NaN (not applicable) for samples {samples}; "
            "a weighted sum needs every reward, or nan='zero' to count it as 0"
        )
    total = torch.where(missing, 0.0, rewards.detach().to(torch.float64)) @ w
    advantages = per_reward_advantages(
        total[:, None], group_ids, std_scope=std_scope, adv_clip=adv_clip, eps=eps
    )
    return advantages[:, 0].to(rewards.dtype)


def zscore_rewards(rewards: Tensor, *, eps: float = 1e-4, names: Sequence[str] | None = None) -> Tensor:
    """Each reward standardised over the batch: ``Z_ik = (R_ik - mean_k) / (std_k + eps)``.

    Means and population stds are over the applicable (non-NaN) samples of reward k, in float64;
    NaN stays NaN. A weighted sum of these (``strategy.reward_scale: zscore``) weighs rewards on
    different scales alike.

    Returns:
        ``[B, K]`` in ``rewards``' dtype and device.
    """
    _check_rewards(rewards, names)
    R = rewards.detach().to(torch.float64)
    valid = ~torch.isnan(R)
    deviation = torch.where(valid, R - nan_mean(R), 0.0)
    std = nan_mean(torch.where(valid, deviation.square(), float("nan"))).nan_to_num(0.0).sqrt()
    return torch.where(valid, deviation / (std + eps), float("nan")).to(rewards.dtype)


def normalize_then_sum(
    rewards: Tensor,
    weights: Tensor | Sequence[float],
    group_ids: Tensor | Sequence[Hashable],
    *,
    std_scope: StdScope = "group",
    ddof: int = 1,
    batch_norm: bool = True,
    rescale_masked: bool = False,
    adv_clip: float = 5.0,
    eps: float = 1e-4,
    names: Sequence[str] | None = None,
) -> Tensor:
    """GDPO's advantage: each reward normalised within its group, then a weighted sum, re-normalised.

    TRL's ``GRPOConfig(multi_objective_aggregation="normalize_then_sum")`` (GDPO, Liu et al. 2026,
    arXiv 2601.05242; MO-GRPO). For rewards ``R [B, K]`` (NaN where a reward does not apply):

    .. code-block:: text

        Z_ik = (R_ik - mean_{g(i)} R_k) / (std_{g(i)} R_k + eps)      (per group, as TRL)
        S_i  = sum_k w_k Z_ik / p_k     over the rewards that apply to i (TRL's nansum)
        A_i  = (S_i - mean S) / (std S + eps)                          (batch_norm)

    ``p_k = 1`` unless ``rescale_masked``: then ``p_k = n_k / B``, the share of the batch reward k
    applies to, so that a reward measured on a third of the samples weighs in the summed
    advantage's gradient as much as one measured on all (its NaN samples count 0 in the sum).
    With TRL's defaults (``std_scope="group"``, ``ddof=1``, ``batch_norm=True``) the result equals
    TRL's, computed here in float64, but where TRL leaves the advantages unclipped (ours are
    clipped to ``+-adv_clip``, which the NFT loss does anyway) and where a sample that no reward
    applies to gets advantage 0 (TRL's ``nan_to_num``; it takes no part in the batch statistics).
    TRL's groups are consecutive runs of ``num_generations`` rows; ours are ``group_ids``.

    Args:
        rewards: ``[B, K]`` as in :func:`per_reward_advantages`.
        weights: ``[K]`` finite weights.
        group_ids: as in :func:`per_reward_advantages`.
        std_scope: ``Z``'s std within each ``"group"`` (TRL) or over the ``"batch"``.
        ddof: 1 for the Bessel-corrected std of TRL's ``nanstd`` (both stds), 0 for the
            population std of :func:`per_reward_advantages`.
        batch_norm: re-normalise the sum over the batch (TRL always does).
        rescale_masked: divide each reward's ``Z`` by the share of the batch it applies to.
        adv_clip, eps, names: as in :func:`per_reward_advantages`.

    Returns:
        ``[B]`` advantages in ``rewards``' dtype and device (no NaN).

    >>> rewards = torch.tensor([[1.0, 0.0], [3.0, float("nan")], [2.0, 1.0], [2.0, 3.0]])
    >>> normalize_then_sum(rewards, [1.0, 1.0], [0, 0, 1, 1])
    tensor([-0.8659,  0.8659, -0.8659,  0.8659])
    """
    _check_rewards(rewards, names)
    w = torch.as_tensor(weights, dtype=torch.float64, device=rewards.device)
    if w.shape != (rewards.shape[1],) or not bool(torch.isfinite(w).all()):
        raise ValueError(f"weights must be {rewards.shape[1]} finite numbers, got {w.tolist()}")
    if not adv_clip > 0:
        raise ValueError(f"adv_clip must be > 0, got {adv_clip!r}")
    options = {"std_scope": std_scope, "eps": eps, "ddof": ddof}
    Z = per_reward_advantages(rewards.detach().to(torch.float64), group_ids, adv_clip=math.inf, **options)
    applies = ~torch.isnan(Z)
    if rescale_masked:
        Z = Z * (len(Z) / applies.sum(0).clamp_min(1).to(Z.dtype))
    total = torch.where(applies, Z, 0.0) @ w
    scored = applies.any(dim=1)
    if batch_norm:
        total = torch.where(scored, total, float("nan"))
        count = int(scored.sum())
        mean = nan_mean(total[:, None])[0].nan_to_num(0.0)
        deviation = torch.where(scored, total - mean, 0.0)
        std = (deviation.square().sum() / max(count - ddof, 1)).sqrt()
        total = deviation / (std + eps)
    total = torch.where(scored, total, 0.0).clamp(-adv_clip, adv_clip)
    return total.to(rewards.dtype)
