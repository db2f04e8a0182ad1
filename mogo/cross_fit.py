"""Gram estimates that sampling noise does not bias: two halves of a batch, cross-fitted.

The gradient of objective k on a batch is its expected gradient plus sampling noise,
``g_k = mu_k + n_k``, and the batch's Gram matrix carries the noise:
``E[<g_k, g_l>] = <mu_k, mu_l> + E[<n_k, n_l>]``, with ``E ||n_k||^2`` on the diagonal. Where the
signal is weak (a cosine of 0.05 between two batches' gradients of one objective means about
95 % of ``||g_k||^2`` is noise) that term, not the objectives' geometry, sets the weights.

Split the batch into two disjoint halves, with the K gradients ``J_1`` and ``J_2`` of their mean
losses: each estimates the expected gradients ``M``, with independent noise. The cross products
``G_12 = J_1 J_2^T`` then have the expectation ``M M^T``, and so has the cross-fitted estimate

.. math::  S = (G_{12} + G_{21}) / 2 = G_{batch} - D,

the batch's own Gram matrix ``G_batch`` (of ``J = (J_1 + J_2) / 2``) less ``D``, the Gram matrix
of half the halves' difference ``(J_1 - J_2) / 2``, whose expectation is the batch's noise.
``S`` is free of the noise on the diagonal; its error is the noise's cross terms, which fall as
1/batch (``benchmarks/noisy_gram.py``). It is symmetric and indefinite where noise exceeds the
signal, so it is a :class:`mogo.GramEstimate`; its antisymmetric part ``(G_12 - G_21) / 2`` has
the expectation 0 and measures its noise (:class:`mogo.GatedProjection` reads it).

:func:`cross_fitted_gram` forms it from two lists of gradients; ``HarmonizedOptimizer(...,
gram="cross_fitted")`` from a ``(2, K)`` tensor of the halves' losses, through
:class:`CrossFitted`. :class:`SameBatch` is the default, one batch's ``(K,)`` losses.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor

from mogo.gram import GramEstimate, gramian, has_direction

__all__ = ["CrossFitted", "SameBatch", "batch_gram", "cross_fitted_gram", "estimate_of_halves"]


def cross_fitted_gram(
    first: Iterable[Tensor],
    second: Iterable[Tensor],
    *,
    chunk_size: int = 1024,
    dtype: torch.dtype | None = None,
) -> GramEstimate:
    """The cross-fitted estimate ``(G_12 + G_21) / 2`` of the Gram matrix of the expected gradients.

    Args:
        first, second: the K stacked gradients of each half, one ``[K, *p.shape]`` tensor per
            parameter in the same order (as :func:`mogo.gramian` takes them); each half's
            gradients estimate the same expected gradients (the gradients of the halves' mean
            losses, of disjoint samples).
        chunk_size, dtype: as :func:`mogo.gramian`, whose accuracy bound holds for every entry.

    Returns:
        A :class:`mogo.GramEstimate`, float64 on the gradients' device, with ``cross`` the
        one-way ``G_12 = J_1 J_2^T``.

    Raises:
        ValueError: the halves hold different numbers of parameters, or as :func:`mogo.gramian`.

    The Gram matrix of the ``2K`` rows of both halves is formed by :func:`mogo.gramian`, one
    parameter's halves concatenated at a time (a copy of the gradients;
    :class:`mogo.HarmonizedOptimizer` computes them as one stack and copies nothing).

    Example:
        >>> import torch, mogo
        >>> first = [torch.tensor([[1.0, 0.0], [1.0, 1.0]])]  # K = 2 gradients of one half
        >>> second = [torch.tensor([[1.0, 0.0], [-0.1, -0.1]])]
        >>> estimate = mogo.cross_fitted_gram(first, second)
        >>> estimate.gram  # objective 1's halves disagree: its squared norm is estimated below 0
        tensor([[ 1.0000,  0.4500],
                [ 0.4500, -0.2000]], dtype=torch.float64)
    """
    first, second = list(first), list(second)
    if len(first) != len(second):
        raise ValueError(f"the halves hold {len(first)} and {len(second)} parameters' gradients")
    rows = (torch.cat([a, b]) for a, b in zip(first, second, strict=True))
    return estimate_of_halves(gramian(rows, chunk_size=chunk_size, dtype=dtype))


def _blocks(halves: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(G_11, G_12, G_22)`` of the ``(2K, 2K)`` Gram matrix of ``[J_1; J_2]``."""
    K = halves.shape[0] // 2
    return halves[:K, :K], halves[:K, K:], halves[K:, K:]


def estimate_of_halves(halves: Tensor) -> GramEstimate:
    """``GramEstimate((G_12 + G_21) / 2, cross=G_12)`` from the ``(2K, 2K)`` Gram matrix of
    ``[J_1; J_2]``."""
    _, cross, _ = _blocks(halves)
    return GramEstimate((cross + cross.T) / 2, cross.clone())


def batch_gram(halves: Tensor) -> Tensor:
    """``(K, K)`` Gram matrix of the batch's gradients ``(J_1 + J_2) / 2``, from the
    ``(2K, 2K)`` Gram matrix of ``[J_1; J_2]``."""
    first, cross, second = _blocks(halves)
    return (first + cross + cross.T + second) / 4


class SameBatch:
    """A ``backward`` of one batch's K losses ``(K,)``: the weighting weighs their Gram matrix.

    The methods below are how :class:`mogo.HarmonizedOptimizer` reads losses, gradient rows and
    their Gram matrix (``R`` rows for ``A`` objectives: ``R = A`` here, ``2A`` for
    :class:`CrossFitted`, whose rows are the halves' in turn); the optimizer chooses one of the
    two once, by its ``gram`` option, and calls it.
    """

    halves = 1

    def loss_shape(self, objectives: int) -> tuple[int, ...]:
        """The shape of ``backward``'s losses for K objectives."""
        return (objectives,)

    def batch_losses(self, losses: Tensor) -> Tensor:
        """The batch's ``(K,)`` losses, whose weighted sum an amortized step backpropagates."""
        return losses

    def rows(self, losses: Tensor, active: Tensor) -> Tensor:
        """The ``(R,)`` losses whose gradients are taken, of the ``active`` objectives."""
        return losses[active]

    def objectives_of(self, row_flags: np.ndarray) -> np.ndarray:
        """``(A,)`` bool: the objectives all of whose rows are flagged in ``row_flags`` ``(R,)``."""
        return row_flags.reshape(self.halves, -1).all(axis=0)

    def rows_of(self, objectives: np.ndarray) -> np.ndarray:
        """``(R,)`` bool: the rows of the objectives flagged in ``objectives`` ``(A,)``."""
        return np.tile(objectives, self.halves)

    def row_weights(self, loss_weights: Tensor) -> Tensor:
        """``(R,)`` weights of the rows whose combination is ``sum_k w_k g_k`` of the batch."""
        return loss_weights

    def weighed(self, gram: Tensor) -> Tensor | GramEstimate:
        """What the weighting weighs, from the ``(R, R)`` Gram matrix of the rows."""
        return gram

    def no_direction(self, gram: np.ndarray) -> bool:
        """Whether the ``(R, R)`` Gram matrix of the rows leaves a weighting no direction: every
        gradient is zero."""
        return not bool((gram.diagonal() > 0).any())

    def report_grams(self, gram: Tensor) -> tuple[Tensor, Tensor | None]:
        """The batch's ``(A, A)`` Gram matrix, and the ``(2A, 2A)`` one of its halves or None,
        for :meth:`mogo.ConflictReport.from_gram`."""
        return gram, None


class CrossFitted(SameBatch):
    """A ``backward`` of two halves' losses ``(2, K)``, row h the mean losses of half h: the
    weighting weighs the cross-fitted estimate, and the update is ``sum_k w_k g_k`` of the
    batch's gradients, those of ``losses.mean(0)``."""

    halves = 2

    def loss_shape(self, objectives: int) -> tuple[int, ...]:
        return (2, objectives)

    def batch_losses(self, losses: Tensor) -> Tensor:
        return losses.mean(0)

    def rows(self, losses: Tensor, active: Tensor) -> Tensor:
        return losses[:, active].reshape(-1)

    def row_weights(self, loss_weights: Tensor) -> Tensor:
        return torch.cat([loss_weights, loss_weights]) / 2

    def weighed(self, gram: Tensor) -> GramEstimate:
        return estimate_of_halves(gram)

    def no_direction(self, gram: np.ndarray) -> bool:
        """Whether the estimate's nearest Gram matrix is 0 within round-off (so that
        :func:`mogo.check_gram` refuses it): no objective's signal shows above its noise, or
        every gradient is zero."""
        _, cross, _ = _blocks(gram)
        return not has_direction((cross + cross.T) / 2)

    def report_grams(self, gram: Tensor) -> tuple[Tensor, Tensor]:
        return batch_gram(gram), gram


GRAM_ESTIMATES: dict[str, SameBatch] = {"same_batch": SameBatch(), "cross_fitted": CrossFitted()}
"""The optimizer's ``gram`` option, by name."""
