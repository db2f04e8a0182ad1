"""Problem generators and certificate checks for testing min-norm solvers.

The families are the inputs on which published solvers fail: rank-deficient sets (K larger than
the dimension), exactly opposite gradients (optimum 0), duplicates, zero gradients, norms spread
over many decades, nearly collinear sets. Tests and benchmarks draw from the same generators, so a
benchmark table and a property test speak about the same problems. :class:`NoisyObjectives` draws
batch gradients with known expected gradients and controlled sampling noise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "FAMILIES",
    "STUDY_BATCH",
    "NoisyObjectives",
    "assert_min_norm_optimal",
    "gradient_family",
    "noise_study",
    "planted_conflict",
    "rank_deficient",
]


def _gaussian(rng: np.random.Generator, K: int, dim: int) -> np.ndarray:
    return rng.standard_normal((K, dim))


def _low_rank(rng: np.random.Generator, K: int, dim: int) -> np.ndarray:
    rank = max(1, K // 3)
    return rng.standard_normal((K, rank)) @ rng.standard_normal((rank, dim))


def _more_objectives_than_dims(rng: np.random.Generator, K: int, dim: int) -> np.ndarray:
    return rng.standard_normal((K, max(1, K // 4)))


def _opposite(rng: np.random.Generator, K: int, dim: int) -> np.ndarray:
    J = rng.standard_normal((K, dim))
    J[1::2] = -J[0:-1:2] * rng.uniform(0.5, 2.0, size=(K // 2, 1))
    return J


def _duplicates(rng: np.random.Generator, K: int, dim: int) -> np.ndarray:
    distinct = rng.standard_normal((max(1, K // 2), dim))
    return distinct[rng.integers(0, len(distinct), size=K)]


def _zero(rng: np.random.Generator, K: int, dim: int) -> np.ndarray:
    J = rng.standard_normal((K, dim))
    J[rng.permutation(K)[: max(1, K // 4)]] = 0.0
    return J


def _norm_ratio(rng: np.random.Generator, K: int, dim: int) -> np.ndarray:
    norms = np.logspace(0, -12, K) if K > 1 else np.ones(1)
    return rng.standard_normal((K, dim)) * rng.permutation(norms)[:, None]


def _collinear(rng: np.random.Generator, K: int, dim: int) -> np.ndarray:
    return rng.standard_normal(dim) + 1e-6 * rng.standard_normal((K, dim))


def _conflicting(rng: np.random.Generator, K: int, dim: int) -> np.ndarray:
    # Centred points of a random simplex: pairwise obtuse, with the origin near their hull.
    J = rng.standard_normal((K, dim))
    return J - J.mean(axis=0) + 1e-3 * rng.standard_normal(dim)


def _orthogonal(rng: np.random.Generator, K: int, dim: int) -> np.ndarray:
    q, _ = np.linalg.qr(rng.standard_normal((max(dim, K), K)))
    return q.T * rng.uniform(0.1, 10.0, size=(K, 1))


def _tiny(rng: np.random.Generator, K: int, dim: int) -> np.ndarray:
    return 1e-15 * rng.standard_normal((K, dim))  # G ~ 1e-30


def _huge(rng: np.random.Generator, K: int, dim: int) -> np.ndarray:
    return 1e15 * rng.standard_normal((K, dim))  # G ~ 1e30


FAMILIES: dict[str, Callable[[np.random.Generator, int, int], np.ndarray]] = {
    "gaussian": _gaussian,
    "low_rank": _low_rank,
    "K_above_dim": _more_objectives_than_dims,
    "opposite": _opposite,
    "duplicates": _duplicates,
    "zero": _zero,
    "norm_ratio_1e12": _norm_ratio,
    "collinear": _collinear,
    "conflicting": _conflicting,
    "orthogonal": _orthogonal,
    "tiny_1e-30": _tiny,
    "huge_1e30": _huge,
}
"""Gradient-set generators ``(rng, K, dim) -> (K, dim')`` by family name."""


def gradient_family(
    name: str, K: int, *, dim: int = 64, scale: float = 1.0, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """K gradients of a named family and their Gram matrix, both float64.

    Returns ``(J, G)`` with ``J`` of shape ``(K, dim')`` (``dim'`` is ``dim`` except for the
    families that fix it) and ``G = J J^T``.
    """
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; choose from {sorted(FAMILIES)}")
    J = torch.from_numpy(FAMILIES[name](np.random.default_rng(seed), K, dim) * scale)
    return J, J @ J.T


def rank_deficient(seed: int) -> Tensor:
    """``J`` (K, dim), float64, with K in 3..24 above dim: a centred cloud (pairwise conflict, the
    origin near its hull) or Gaussian rows, scaled by 1e-12..1e12, all drawn from ``seed``.

    The family on which a dual-cone solver that spots dependent passive sets by an exception
    failed about once in 300 problems, depending on the BLAS's thread count.
    """
    rng = np.random.default_rng(seed)
    K = int(rng.integers(3, 25))
    dim = int(rng.integers(1, K))
    J = rng.standard_normal((K, dim))
    if rng.integers(0, 2):
        J = J - J.mean(axis=0) + 1e-3 * rng.standard_normal(dim)
    return torch.from_numpy(J * 10.0 ** rng.uniform(-12, 12))


def assert_min_norm_optimal(G: Tensor, alpha: Tensor, *, tol: float = 1e-9) -> None:
    """Assert that ``alpha`` (..., K) solves ``min_{alpha in simplex} alpha^T G alpha``.

    Checks feasibility (``alpha >= 0``, ``sum = 1`` to ``tol``) and the KKT conditions
    ``(G alpha)_i >= f - tol * s`` for every i, with equality on the support, where
    ``f = alpha^T G alpha`` and ``s = max_i G_ii``. By the Frank-Wolfe duality gap this bounds
    ``f - f*`` by ``2 tol s``.
    """
    G = G.to(torch.float64)
    alpha = alpha.to(torch.float64)
    scale = G.diagonal(dim1=-2, dim2=-1).amax(-1, keepdim=True).clamp_min(torch.finfo(G.dtype).tiny)
    assert bool((alpha >= -tol).all()), f"alpha has negative entries: {alpha.min().item():.3g}"
    total = alpha.sum(-1)
    assert bool(((total - 1).abs() <= tol).all()), f"alpha does not sum to 1: {total}"
    g = (G @ alpha.unsqueeze(-1)).squeeze(-1) / scale
    value = (alpha * g).sum(-1, keepdim=True)
    below = (value - g).amax(-1)
    assert bool((below <= tol).all()), f"KKT violated: (G alpha)_i below alpha^T G alpha by {below.max():.3g}"
    off_support = (alpha * (g - value)).abs().amax(-1)
    assert bool((off_support <= tol).all()), f"complementarity violated by {off_support.max():.3g}"


@dataclass(frozen=True)
class NoisyObjectives:
    """K objectives with known expected gradients whose per-sample gradients carry noise that
    co-varies across objectives as their per-sample advantages do.

    Sample i's gradient of objective k is ``mu_k + s_k a_ik h_i``: ``h_i ~ N(0, I / P)`` is the
    sample's own direction in the ``P`` parameters (``E ||h_i||^2 = 1``), shared by its K
    objectives, and its advantages ``a_i ~ N(0, C)`` weigh it per objective. A batch's
    gradient (the mean over its samples) has the expectation ``mu_k`` and the noise
    ``n_k = s_k mean_i a_ik h_i``, whose Gram matrix has the expectation
    ``diag(s) C diag(s) / batch``: the same-batch Gram matrix's bias, which the advantages'
    correlation ``C`` shapes.

    Attributes:
        expected: ``(K, P)`` float64, the expected gradients ``mu_k``.
        noise: ``(K,)`` float64, ``s_k``, the per-sample noise scale.
        correlation: ``(K, K)`` float64 correlation matrix ``C`` of the advantages.
    """

    expected: np.ndarray
    noise: np.ndarray
    correlation: np.ndarray

    @classmethod
    def with_signal_fraction(
        cls, expected: np.ndarray, correlation: np.ndarray, fraction: float, batch: int
    ) -> NoisyObjectives:
        """Noise scaled so that ``||mu_k||^2`` is ``fraction`` of ``E ||g_k||^2`` at ``batch``
        samples: ``s_k^2 = batch ||mu_k||^2 (1 / fraction - 1)``."""
        squared_norms = (expected**2).sum(axis=1)
        return cls(expected, np.sqrt(batch * squared_norms * (1 / fraction - 1)), correlation)

    @property
    def gram(self) -> np.ndarray:
        """``(K, K)`` the Gram matrix of the expected gradients, ``M M^T``."""
        return self.expected @ self.expected.T

    def noise_gram(self, batch: int) -> np.ndarray:
        """``(K, K)`` the expected Gram matrix of a ``batch``'s noise, ``diag(s) C diag(s) / batch``."""
        return self.noise[:, None] * self.correlation * self.noise[None, :] / batch

    def halves(self, rng: np.random.Generator, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``(K, P)`` gradients of two disjoint halves (``batch // 2`` samples each) of a
        batch; the batch's gradient is their mean."""
        return self.batch(rng, batch // 2), self.batch(rng, batch // 2)

    def averaged_grams(
        self, rng: np.random.Generator, batches: int, size: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The same-batch Gram matrix and the cross-fitted estimate ``(G_12 + G_21) / 2`` of
        ``batches`` batches of ``size`` samples, each averaged over the batches, ``(K, K)``."""
        K = len(self.expected)
        same, cross = np.zeros((K, K)), np.zeros((K, K))
        for _ in range(batches):
            first, second = self.halves(rng, size)
            batch = (first + second) / 2
            same += batch @ batch.T
            product = first @ second.T
            cross += (product + product.T) / 2
        return same / batches, cross / batches

    def batch(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """The ``(K, P)`` gradient of a batch of ``size`` samples (the mean of theirs)."""
        K, P = self.expected.shape
        advantages = rng.multivariate_normal(np.zeros(K), self.correlation, size=size)  # (size, K)
        directions = rng.standard_normal((size, P)) / np.sqrt(P)
        return self.expected + self.noise[:, None] * (advantages.T @ directions) / size


STUDY_BATCH = 64
"""Samples per batch of :func:`noise_study` and :func:`planted_conflict`, at which the expected
gradients hold 5 % of a batch gradient's squared norm (as measured on the NFT gradients of 64
images: a cosine of 0.05 between two batches)."""


def _orthonormal_rows(rng: np.random.Generator, dim: int, count: int) -> np.ndarray:
    return np.linalg.qr(rng.standard_normal((dim, count)))[0].T


def noise_study(seed: int = 1, dim: int = 1000) -> NoisyObjectives:
    """Three objectives at 5 % signal whose advantages' correlation differs: the first two's
    correlate (0.8), the third's hardly (0.2), so the noise of one batch leans the min-norm
    weights towards the third. Their true min-norm weights leave the second out."""
    basis = _orthonormal_rows(np.random.default_rng(seed), dim, 3)
    expected = np.stack(
        [basis[0], 0.9 * basis[0] + 1.2 * basis[1], -0.2 * basis[0] + 0.3 * basis[1] + 0.6 * basis[2]]
    )
    correlation = np.array([[1.0, 0.8, 0.2], [0.8, 1.0, 0.2], [0.2, 0.2, 1.0]])
    return NoisyObjectives.with_signal_fraction(expected, correlation, 0.05, STUDY_BATCH)


def planted_conflict(seed: int = 3, dim: int = 2000, conflict: bool = True) -> NoisyObjectives:
    """Three unit expected gradients at 5 % signal, advantages correlated 0.3: with ``conflict``
    their mean opposes the third, ``<mean, mu_3> = -0.25``; without, the third is turned so that
    the mean agrees with each, by at least 0.25."""
    basis = _orthonormal_rows(np.random.default_rng(seed), dim, 3)
    third = (-0.9 if conflict else 0.3) * basis[0] + 0.2 * basis[2]
    expected = np.stack([basis[0], 0.8 * basis[0] + 0.6 * basis[1], third])
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    correlation = np.array([[1.0, 0.3, 0.3], [0.3, 1.0, 0.3], [0.3, 0.3, 1.0]])
    return NoisyObjectives.with_signal_fraction(expected, correlation, 0.05, STUDY_BATCH)
