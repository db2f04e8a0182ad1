"""The DiffusionNFT loss (Zheng et al., arXiv 2509.16117) and its per-reward affine decomposition.

With ``x_t = (1 - t) x0 + t eps``, the trained velocity ``v``, the old policy's ``v_old`` (no
gradient) and the mixing strength ``beta``:

.. code-block:: text

    v_plus  = beta v + (1 - beta) v_old,         x0_plus  = x_t - t v_plus
    v_minus = (1 + beta) v_old - beta v,         x0_minus = x_t - t v_minus
    P_i = mean((x0_plus - x0)^2) / sg(max(mean|x0_plus - x0|, 1e-5))        (per sample i)
    N_i = mean((x0_minus - x0)^2) / sg(max(mean|x0_minus - x0|, 1e-5))
    r_ki = clamp(clamp(A_ki, -C, C) / (2C) + 1/2, 0, 1)                       (C = adv_clip)
    L_k = C / beta * 1/n_k * sum_{i in S_k} [r_ki P_i + (1 - r_ki) N_i]

``sg`` is stop-gradient, ``S_k`` the samples reward k applies to (advantage not NaN) and
``n_k = |S_k|``. Each ``L_k`` is linear in ``(P, N)``: ``L = a @ P + b @ N`` with coefficient
matrices ``a_ki = C r_ki / (beta n_k)`` and ``b_ki = C (1 - r_ki) / (beta n_k)`` on ``S_k``, 0
elsewhere. One forward gives all K losses, and a convex mix ``sum_k w_k L_k`` is the same loss with
coefficients ``w @ a`` and ``w @ b``: amortized MARBLE steps cost one backward pass. A reward that
applies to every sample gives exactly the single-reward DiffusionNFT loss
``C / beta * mean_i [r_i P_i + (1 - r_i) N_i]``; one that applies to none gives ``L_k = 0``.

The KL regulariser ``kl_coef * mean (v - v_ref)^2`` is reward-independent; pass it to
:meth:`mogo.HarmonizedOptimizer.backward` as ``shared``.

>>> import torch
>>> x0, eps, t = torch.randn(4, 2, 3, 3), torch.randn(4, 2, 3, 3), torch.rand(4)
>>> x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
>>> v = (eps - x0 + 0.1 * torch.randn_like(x0)).requires_grad_()
>>> terms = nft_terms(v, eps - x0, x_t, x0, t, beta=0.1)
>>> nan = float("nan")
>>> advantages = torch.tensor([[1.0, nan], [-1.0, 2.0], [0.5, -2.0], [-0.5, nan]])  # [B, K]
>>> nft_losses(terms, nft_coefficients(advantages, beta=0.1)).shape
torch.Size([2])
"""

from __future__ import annotations

from numbers import Real
from typing import Literal, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "NFTCoefficients",
    "NFTTerms",
    "kl_loss",
    "nft_coefficients",
    "nft_loss",
    "nft_losses",
    "nft_terms",
    "positive_weight",
]

_SCALE_FLOOR = 1e-5  # the normaliser's floor, as in DiffusionNFT


class NFTTerms(NamedTuple):
    """The per-sample terms of one forward pass.

    Attributes:
        positive: ``P``, ``[B]``, differentiable in ``v`` only.
        negative: ``N``, ``[B]``, differentiable in ``v`` only.
    """

    positive: Tensor
    negative: Tensor


class NFTCoefficients(NamedTuple):
    """The coefficients of ``L = a @ P + b @ N`` for K rewards (float64, no gradient).

    Attributes:
        a: ``[K, B]``, ``C r_ki / (beta n_k)`` where reward k applies to sample i, else 0.
        b: ``[K, B]``, ``C (1 - r_ki) / (beta n_k)`` where reward k applies, else 0.
        applicable: ``[K, B]`` bool, the advantage is not NaN.
    """

    a: Tensor
    b: Tensor
    applicable: Tensor


def _check_beta(beta: float) -> None:
    if not (isinstance(beta, Real) and 0 < beta < float("inf")):
        raise ValueError(f"beta (the NFT mixing strength) must be a finite number > 0, got {beta!r}")


def _check_clip(adv_clip: float) -> None:
    if not (isinstance(adv_clip, Real) and 0 < adv_clip < float("inf")):
        raise ValueError(f"adv_clip must be a finite number > 0, got {adv_clip!r}")


def _normalised_error(diff: Tensor) -> Tensor:
    """``mean(diff^2) / sg(max(mean|diff|, 1e-5))`` per sample: ``[B, ...] -> [B]``."""
    dims = tuple(range(1, diff.ndim))
    scale = diff.detach().abs().mean(dims).clamp_min(_SCALE_FLOOR)
    return diff.square().mean(dims) / scale


def nft_terms(
    v: Tensor, v_old: Tensor, x_t: Tensor, x0: Tensor, t: Tensor | float, *, beta: float
) -> NFTTerms:
    """The per-sample terms ``P`` and ``N`` of the DiffusionNFT loss.

    Args:
        v: ``[B, ...]`` the trained model's velocity; the only input gradients flow to.
        v_old: ``[B, ...]`` the old policy's velocity (detached here).
        x_t: ``[B, ...]`` the noised latents ``(1 - t) x0 + t eps`` (detached here).
        x0: ``[B, ...]`` the clean latents sampled by the old policy (detached here).
        t: the time in (0, 1], a scalar or ``[B]`` (detached here).
        beta: the mixing strength, > 0 (0.1 to 1 in practice).

    Returns:
        :class:`NFTTerms` of ``[B]`` tensors, in ``v``'s dtype promoted to float32 at least.

    Raises:
        ValueError: naming the argument whose shape does not match ``v``'s, or a bad ``beta``.
    """
    _check_beta(beta)
    for arg, value in (("v", v), ("v_old", v_old), ("x_t", x_t), ("x0", x0)):
        if not isinstance(value, Tensor):
            raise TypeError(f"{arg} must be a tensor, got {type(value).__name__}")
    if v.ndim < 2:
        raise ValueError(f"v must have shape [B, ...] with at least 2 dims, got {tuple(v.shape)}")
    for arg, value in (("v_old", v_old), ("x_t", x_t), ("x0", x0)):
        if value.shape != v.shape:
            raise ValueError(f"{arg} has shape {tuple(value.shape)}, expected v's shape {tuple(v.shape)}")
    dtype = torch.promote_types(v.dtype, torch.float32)
    t = torch.as_tensor(t, device=v.device).detach()
    if t.shape not in ((), (v.shape[0],)):
        raise ValueError(f"t must be a scalar or of shape ({v.shape[0]},), got {tuple(t.shape)}")
    t = t.to(dtype).reshape(-1, *([1] * (v.ndim - 1)))
    v = v.to(dtype)
    v_old, x_t, x0 = (value.detach().to(dtype) for value in (v_old, x_t, x0))
    v_plus = beta * v + (1 - beta) * v_old
    v_minus = (1 + beta) * v_old - beta * v
    return NFTTerms(_normalised_error(x_t - t * v_plus - x0), _normalised_error(x_t - t * v_minus - x0))


def positive_weight(advantages: Tensor, *, adv_clip: float = 5.0) -> Tensor:
    """``r = clamp(clamp(A, -C, C) / (2C) + 1/2, 0, 1)``, elementwise; NaN stays NaN."""
    _check_clip(adv_clip)
    return (advantages.clamp(-adv_clip, adv_clip) / (2 * adv_clip) + 0.5).clamp(0.0, 1.0)


def nft_coefficients(
    advantages: Tensor,
    *,
    beta: float,
    adv_clip: float = 5.0,
    nonapplicable: Literal["exclude", "neutral"] = "exclude",
) -> NFTCoefficients:
    """The coefficient matrices of the K per-reward NFT losses.

    Args:
        advantages: ``[B, K]``, NaN where reward k does not apply to sample i.
        beta: the mixing strength, > 0.
        adv_clip: ``C``, > 0; clips the advantages and scales the loss by ``C / beta``.
        nonapplicable: what a NaN advantage does. ``"exclude"``: the sample is left out of that
            reward's loss, whose mean runs over the ``n_k`` samples it applies to; a reward that
            applies to none has zero coefficients (loss 0, no gradient). ``"neutral"``: the
            sample counts with ``A = 0`` (``r = 1/2``) in a mean over all B samples, as masking
            in DiffusionNFT's code does; its ``(P + N) / 2`` is smallest at ``v = v_old``, so it
            holds the model near the old policy on that sample.
    """
    _check_beta(beta)
    _check_clip(adv_clip)
    if nonapplicable not in ("exclude", "neutral"):
        raise ValueError(f"nonapplicable must be 'exclude' or 'neutral', got {nonapplicable!r}")
    if not isinstance(advantages, Tensor) or advantages.ndim != 2 or not advantages.is_floating_point():
        shape = tuple(advantages.shape) if isinstance(advantages, Tensor) else type(advantages).__name__
        raise ValueError(f"advantages must be a floating [B, K] tensor, got {shape}")
    A = advantages.detach().to(torch.float64).T
    if nonapplicable == "neutral":
        A = A.nan_to_num(0.0)
    applicable = ~torch.isnan(A)
    r = positive_weight(A, adv_clip=adv_clip)
    scale = adv_clip / beta / applicable.sum(dim=1, keepdim=True).clamp_min(1).to(A.dtype)
    a = torch.where(applicable, r * scale, 0.0)
    b = torch.where(applicable, (1 - r) * scale, 0.0)
    return NFTCoefficients(a, b, applicable)


def nft_losses(terms: NFTTerms, coefficients: NFTCoefficients) -> Tensor:
    """The K per-reward losses ``L = a @ P + b @ N``, ``[K]``, in the terms' dtype."""
    P, N = terms
    if P.ndim != 1 or N.shape != P.shape:
        raise ValueError(f"terms must be two [B] tensors, got {tuple(P.shape)} and {tuple(N.shape)}")
    a, b = coefficients.a, coefficients.b
    if a.ndim != 2 or a.shape[1] != P.shape[0] or b.shape != a.shape:
        raise ValueError(
            f"coefficients have shapes {tuple(a.shape)} and {tuple(b.shape)}, expected [K, {P.shape[0]}]"
        )
    return a.to(P) @ P + b.to(N) @ N


def nft_loss(
    v: Tensor,
    v_old: Tensor,
    x_t: Tensor,
    x0: Tensor,
    t: Tensor | float,
    advantages: Tensor,
    *,
    beta: float,
    adv_clip: float = 5.0,
) -> Tensor:
    """The single-advantage DiffusionNFT policy loss ``C / beta * mean_i [r_i P_i + (1 - r_i) N_i]``.

    This is the loss of the ``single`` and ``weighted_sum`` strategies. ``advantages`` is ``[B]``
    (NaN samples are left out of the mean); the other arguments are those of :func:`nft_terms`.
    Returns a 0-d tensor.
    """
    if not isinstance(advantages, Tensor) or advantages.ndim != 1:
        shape = tuple(advantages.shape) if isinstance(advantages, Tensor) else type(advantages).__name__
        raise ValueError(f"advantages must be a [B] tensor, got {shape}")
    terms = nft_terms(v, v_old, x_t, x0, t, beta=beta)
    if advantages.shape[0] != terms.positive.shape[0]:
        raise ValueError(
            f"advantages has {advantages.shape[0]} entries for a batch of {terms.positive.shape[0]}"
        )
    return nft_losses(terms, nft_coefficients(advantages[:, None], beta=beta, adv_clip=adv_clip))[0]


def kl_loss(v: Tensor, v_ref: Tensor, *, kl_coef: float) -> Tensor:
    """``kl_coef * mean (v - v_ref)^2`` over all elements, a 0-d tensor; ``v_ref`` is detached.

    ``v_ref`` is the reference model's velocity (the adapter disabled). The mean over all elements
    equals the mean over samples of each sample's mean, as in DiffusionNFT.
    """
    if not (isinstance(kl_coef, Real) and 0 <= kl_coef < float("inf")):
        raise ValueError(f"kl_coef must be a finite number >= 0, got {kl_coef!r}")
    if v_ref.shape != v.shape:
        raise ValueError(f"v_ref has shape {tuple(v_ref.shape)}, expected v's shape {tuple(v.shape)}")
    dtype = torch.promote_types(v.dtype, torch.float32)
    return kl_coef * (v.to(dtype) - v_ref.detach().to(dtype)).square().mean()
