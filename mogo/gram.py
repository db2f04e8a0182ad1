"""Gram matrices of per-objective gradients, and their normalisation.

Gradients of K objectives over a parameter list come as one stacked tensor per parameter,
``[K, *p.shape]``. The Gram matrix ``G_kl = <g_k, g_l>`` is summed over parameters in float64
without concatenating them. Normalising ``g_k -> g_k / s_k`` maps ``G`` to ``G / (s s^T)``:

* ``"l2"``: ``s_k = ||g_k||`` (MARBLE); every objective enters the hull with unit norm;
* ``"loss"``: ``s_k = L_k`` (MGDA-UB style); the losses must be positive;
* ``"none"``: ``s_k = 1`` (plain MGDA).

Objectives whose gradient norm is at most ``rtol`` times the largest are *excluded*: they cannot be
normalised, so they leave the QP and receive weight 0.

:func:`check_gram` is the one check of a Gram matrix that every weighting (and
:func:`normalize_gram`) makes on entry, by :func:`mogo.min_norm`'s rule of how well a ``G`` of a
dtype is known; a :class:`GramEstimate` declares a ``G`` that may be indefinite.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import torch
from scipy.linalg.lapack import dpotrf
from torch import Tensor

from mogo.solvers import _diagnose, _Precision, _precision, _prepare, _single_problem

__all__ = [
    "CheckedGram",
    "GramEstimate",
    "Normalization",
    "NormalizedGram",
    "check_gram",
    "gramian",
    "normalize_gram",
]

Normalization = Literal["l2", "loss", "none"]


def gramian(
    stacked_grads: Iterable[Tensor], *, chunk_size: int = 1024, dtype: torch.dtype | None = None
) -> Tensor:
    """Gram matrix ``G = sum_p flat_p flat_p^T`` of K stacked gradients, summed in float64.

    The columns are cut into blocks of ``w = chunk_size``; the blocks' ``K x K`` products are
    formed in ``dtype``, many blocks to one batched matrix product, and added up in float64
    (gradients narrower than a block are multiplied together, as one matrix of their columns).
    Batched, the products cost about two reads of the gradients (docs/benchmarks.rst).

    Accuracy, on any BLAS: a product of ``w``-column blocks ``x_b, y_b`` formed in a dtype of
    unit round-off ``u`` (2**-24 for float32, in whatever order its kernel sums) errs by at most
    ``gamma_w ||x_b|| ||y_b||``, ``gamma_w = w u / (1 - w u)``; summed over blocks in float64 and
    by Cauchy-Schwarz, ``|G_kl - <g_k, g_l>| <= (gamma_w + gamma'_m) ||g_k|| ||g_l||``, with
    ``gamma'_m`` the float64 round-off of the ``m`` block sums (``m * 2**-53``). With the default
    ``w = 1024`` in float32 that is at most 6.1e-5 of ``||g_k|| ||g_l||`` in the worst case, and
    about ``sqrt(w) u`` (2e-6) for random rounding errors; it hardly grows with the gradients'
    length. Pass ``dtype=torch.float64`` for float64 products (``w * 2**-53``). The K x K result
    is finished on the host: a non-finite one (a product beyond float32's range) is recomputed
    in float64, and negative eigenvalues left by float32 products (nearly dependent gradients)
    are clipped to 0, which moves ``G`` by no more than its error in Frobenius norm: with ``B``
    the bound above, ``|G - J J^T| <= B + ||B||_F`` entrywise.

    Args:
        stacked_grads: tensors of shape ``[K, *p.shape]``, one per parameter, any dtype/device.
        chunk_size: columns per block; the blocks of one batched product hold at most
            ``max(2**18, K * chunk_size)`` entries, which bounds the extra memory.
        dtype: dtype of each block's product; ``None`` for the gradients' own (float32 at least).

    Returns:
        ``(K, K)`` float64 on the device of the gradients.

    Example:
        >>> import torch, mogo
        >>> grads = [torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.tensor([[[2.0]], [[0.0]]])]
        >>> mogo.gramian(grads)
        tensor([[5., 1.],
                [1., 2.]], dtype=torch.float64)
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    stacked_grads = list(stacked_grads)
    if not stacked_grads:
        raise ValueError("stacked_grads is empty: need at least one [K, *p.shape] tensor")
    K, device = _objective_count(stacked_grads[0], 0), stacked_grads[0].device
    gram = torch.zeros(K, K, dtype=torch.float64, device=device)
    narrow: dict[torch.dtype, list[Tensor]] = {}  # gradients narrower than a block, by product dtype
    inexact = False  # some product is formed below float64
    for index, grad in enumerate(stacked_grads):
        if _objective_count(grad, index) != K:
            raise ValueError(f"stacked gradient {index} has {grad.shape[0]} objectives, the first had {K}")
        product_dtype = dtype or torch.promote_types(grad.dtype, torch.float32)
        inexact = inexact or product_dtype != torch.float64
        flat = grad.reshape(K, -1)
        if flat.shape[1] < chunk_size:
            narrow.setdefault(product_dtype, []).append(flat)
        else:
            _add_blocked_gram(gram, flat, chunk_size, product_dtype)
    for product_dtype, flats in narrow.items():  # one matrix of all of them, in blocks
        _add_blocked_gram(gram, torch.cat(flats, 1), chunk_size, product_dtype)
    host = gram.cpu().numpy()
    if dtype is None and not np.isfinite(host).all():
        return gramian(stacked_grads, chunk_size=chunk_size, dtype=torch.float64)  # overflow, or NaN
    host = (host + host.T) / 2  # a float32 product of a block with itself is symmetric only to round-off
    if inexact:
        host = _nearest_psd(host)
    return torch.from_numpy(host).to(device)


def _objective_count(grad: Tensor, index: int) -> int:
    if grad.ndim == 0:
        raise ValueError(f"stacked gradient {index} is a scalar; expected shape [K, *p.shape]")
    return grad.shape[0]


_ELEMENTS_PER_PRODUCT = 1 << 18
"""Gradient entries that :func:`gramian` multiplies in one batched product (1 MiB of float32)."""


def _add_blocked_gram(gram: Tensor, flat: Tensor, width: int, dtype: torch.dtype) -> None:
    """Add ``sum_b B_b B_b^T`` to ``gram`` (float64) over the column blocks ``B_b`` (``[K, width]``,
    the last one narrower) of ``flat`` (``[K, n]``), each product formed in ``dtype``."""
    K, n = flat.shape
    whole = n - n % width  # columns in full blocks
    span = width * max(1, _ELEMENTS_PER_PRODUCT // (K * width))
    for start in range(0, whole, span):
        # [K, m * width] -> [m, K, width]: a view of the m blocks, strided like the gradients
        blocks = flat[:, start : min(start + span, whole)].to(dtype).reshape(K, -1, width).transpose(0, 1)
        gram += torch.bmm(blocks, blocks.transpose(1, 2)).sum(0, dtype=torch.float64)
    if whole < n:
        tail = flat[:, whole:].to(dtype)
        gram += tail @ tail.T


def _nearest_psd(gram: np.ndarray) -> np.ndarray:
    """``G`` with its negative eigenvalues set to 0: products in float32 can leave eigenvalues of
    nearly dependent gradients at -1e-8 of the largest diagonal entry, below zero by their error.
    A Cholesky factorisation that succeeds proves ``G`` positive definite, the common case."""
    if dpotrf(gram)[1] == 0:
        return gram
    values, vectors = np.linalg.eigh(gram)
    if (values >= 0).all():
        return gram
    clipped = (vectors * np.maximum(values, 0.0)) @ vectors.T
    return (clipped + clipped.T) / 2


@dataclass(frozen=True)
class GramEstimate:
    """A symmetric estimate of a Gram matrix that may be indefinite, declared so by its caller.

    An unbiased estimate of ``J J^T`` from noisy gradients, such as the cross-fitted
    ``(G_12 + G_21) / 2`` of two half-batches (``G_ab = J_a J_b^T``), has negative eigenvalues
    where the noise exceeds the signal; an indefinite ``G`` that is not declared so is an error.
    Every weighting takes an estimate in place of ``G``: :func:`check_gram` checks it as it
    checks ``G`` but for positive semidefiniteness, and the weighting works on its nearest Gram
    matrix (:attr:`mogo.Weights.weighed` says so), or, where it is a stochastic method that
    needs the unbiased matrix (:class:`mogo.MoDo`, :class:`mogo.SDMGrad`), on the estimate
    itself. The declaration travels as this type, not as a keyword, so that it passes through
    the ``Weighting(gram, losses)`` protocol and the optimizer unchanged; what else is known of
    an estimate belongs on it as well: :func:`mogo.cross_fitted_gram` keeps the one-way cross
    matrix, whose antisymmetric part measures the estimate's noise.

    Attributes:
        gram: ``(K, K)`` real, finite, and symmetric within its dtype's round-off.
        cross: ``None``, or ``(K, K)`` the one-way cross matrix ``J_1 J_2^T`` of two independent
            estimates of the gradients, whose symmetric part is ``gram`` (within round-off).

    Example:
        >>> import torch, mogo
        >>> first = torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)  # half-batch gradients
        >>> second = torch.tensor([[1.0, 0.0], [-0.1, -0.1]], dtype=torch.float64)
        >>> cross = first @ second.T
        >>> estimate = mogo.GramEstimate((cross + cross.T) / 2)
        >>> estimate.gram  # the halves of objective 1's gradient disagree: G_11 < 0
        tensor([[ 1.0000,  0.4500],
                [ 0.4500, -0.2000]], dtype=torch.float64)
        >>> mogo.check_gram(estimate).host.round(3)  # its nearest Gram matrix, of rank 1
        array([[1.035, 0.345],
               [0.345, 0.115]])
        >>> mogo.UPGrad()(estimate, torch.ones(2)).loss_weights  # no conflict left: the mean
        tensor([0.5000, 0.5000], dtype=torch.float64)
    """

    gram: Tensor
    cross: Tensor | None = None


class CheckedGram(NamedTuple):
    """A Gram matrix that passed :func:`check_gram`, as every weighting works on it.

    Attributes:
        host: ``(K, K)`` float64 numpy array (a view of a float64 ``G`` on the CPU): ``G``,
            symmetric and positive semidefinite within the round-off of ``precision``, or the
            nearest Gram matrix of a :class:`GramEstimate`.
        precision: the dtype ``G`` came in, whose round-off bounds the error of ``host`` (see
            :func:`mogo.min_norm`, Precision): float32 for a float32 ``G``, though ``host`` is
            float64.
        device: where ``G`` was, and where the weights go.
        estimate: for a :class:`GramEstimate`, ``(K, K)`` float64, the symmetric part of the
            estimate as declared (possibly indefinite); ``None`` for a Gram matrix.
        cross: the estimate's one-way cross matrix ``J_1 J_2^T`` as ``(K, K)`` float64, where it
            declared one; else ``None``.
    """

    host: np.ndarray
    precision: torch.dtype
    device: torch.device
    estimate: np.ndarray | None = None
    cross: np.ndarray | None = None


def check_gram(G: Tensor | GramEstimate | CheckedGram) -> CheckedGram:
    """The check of the Gram matrix of K gradients that every weighting makes on entry.

    ``G`` must be one ``(K, K)`` matrix with ``K >= 1`` (a weighting does not take a batch;
    :func:`mogo.min_norm` and :func:`mogo.project_dual_cone` do), real, finite, not 0, and
    symmetric and positive semidefinite within the round-off of its dtype, by the rule of
    :func:`mogo.min_norm` (Precision): asymmetry and negative eigenvalues down to ``K eps`` of
    ``max_i G_ii`` below float64 (``eps`` of the dtype), ``100 K eps`` in float64. A
    :class:`GramEstimate` is not held to the last: its nearest Gram matrix
    ``V max(Lambda, 0) V^T`` (nearest in Frobenius norm, of its symmetric part
    ``V Lambda V^T``) is checked instead. A :class:`CheckedGram` passes as it is.

    Raises:
        TypeError: ``G`` is not a tensor, a :class:`GramEstimate` or a :class:`CheckedGram`.
        ValueError: naming what is wrong: the shape, a complex dtype, the first NaN or Inf, the
            asymmetry or the smallest eigenvalue (relative to ``max_i G_ii``) against the
            allowance, or a ``G`` (or an estimate's nearest Gram matrix) that is 0: every
            gradient is zero, and there is no direction to weigh.

    Example:
        >>> import torch, mogo
        >>> J = torch.tensor([[1.0, 2.0], [2.0, 4.0], [0.5, 1.0]])  # float32, rank 1
        >>> checked = mogo.check_gram(J @ J.T)  # its eigenvalues of 0 are off by round-off
        >>> checked.precision, checked.host.shape
        (torch.float32, (3, 3))
        >>> mogo.check_gram(torch.stack([J @ J.T, J @ J.T]))
        Traceback (most recent call last):
            ...
        ValueError: G must have shape (K, K), got (2, 3, 3): a weighting takes one G, not a batch
    """
    if isinstance(G, CheckedGram):
        return G
    tensor = G.gram if isinstance(G, GramEstimate) else G
    if not isinstance(tensor, Tensor):
        raise TypeError(f"G must be a torch.Tensor or a mogo.GramEstimate, got {type(tensor).__name__}")
    K = _matrix_size(tensor)
    precision = _precision(tensor.dtype, K)
    host = host_float64(tensor)
    if isinstance(G, GramEstimate):
        estimate = _symmetric_estimate(host, precision)
        cross = None if G.cross is None else _checked_cross(G.cross, estimate, precision)
        return CheckedGram(_nearest_gram(estimate, precision), tensor.dtype, tensor.device, estimate, cross)
    if _single_problem(host, precision) is None:  # the fast checks failed: say why, or pass
        if not host.any():
            raise ValueError(f"G is 0: every one of the {K} gradients is zero, so there is no direction")
        _prepare(host[None], precision)  # min_norm's general path: G near overflow passes
    return CheckedGram(host, tensor.dtype, tensor.device)


def _matrix_size(G: Tensor) -> int:
    """``K`` of a real ``(K, K)`` ``G`` with ``K >= 1``, or the ValueError that says what it is."""
    if G.ndim != 2 or G.shape[0] != G.shape[1]:
        batch = ": a weighting takes one G, not a batch" if G.ndim > 2 else ""
        raise ValueError(f"G must have shape (K, K), got {tuple(G.shape)}{batch}")
    if G.shape[0] == 0:
        raise ValueError("G is empty (shape (0, 0)): there is no objective to weigh")
    if G.is_complex():
        raise ValueError(f"G must be real, got dtype {G.dtype}")
    return G.shape[0]


def _symmetric_estimate(estimate: np.ndarray, precision: _Precision) -> np.ndarray:
    """The symmetric part of a finite ``estimate`` (K, K), symmetric within the allowance
    relative to its largest entry, or the ValueError that names what is wrong."""
    size = np.abs(estimate).max()
    if not (size < np.inf and np.abs(estimate - estimate.T).max() <= precision.allowance * size):
        _diagnose(estimate[None], precision, semidefinite=False)
    return (estimate + estimate.T) / 2


def _nearest_gram(estimate: np.ndarray, precision: _Precision) -> np.ndarray:
    """The nearest Gram matrix of a symmetric ``estimate`` (K, K), or the ValueError that says it
    is 0 within round-off."""
    nearest = _nearest_psd(estimate)
    largest = _relative_size(nearest, estimate)
    if not largest > precision.allowance:
        raise ValueError(
            f"the estimate's nearest Gram matrix is 0 within round-off (its largest diagonal entry is "
            f"{largest:.3g} of the estimate's largest entry; a {precision.name} G is known to "
            f"{precision.allowance:.2g}): there is no direction to weigh"
        )
    return nearest


def _relative_size(nearest: np.ndarray, estimate: np.ndarray) -> float:
    """The largest diagonal entry of an estimate's nearest Gram matrix over the estimate's
    largest entry (NaN for an estimate of 0)."""
    size = np.abs(estimate).max()
    return float(nearest.diagonal().max() / size) if size > 0 else math.nan


def has_direction(estimate: np.ndarray) -> bool:
    """Whether :func:`check_gram` finds a direction in a float64 symmetric estimate (K, K): its
    nearest Gram matrix is not 0 within round-off."""
    allowance = _precision(torch.float64, len(estimate)).allowance
    return _relative_size(_nearest_psd(estimate), estimate) > allowance


def _checked_cross(cross: object, estimate: np.ndarray, precision: _Precision) -> np.ndarray:
    """A :class:`GramEstimate`'s ``cross`` as float64 on the host, checked to be a finite
    ``(K, K)`` tensor whose symmetric part is ``estimate`` within the allowance of its largest
    entry, or the ValueError (TypeError for no tensor) that names what is wrong."""
    if not isinstance(cross, Tensor):
        raise TypeError(f"GramEstimate.cross must be a torch.Tensor or None, got {type(cross).__name__}")
    if tuple(cross.shape) != estimate.shape or cross.is_complex():
        raise ValueError(
            f"GramEstimate.cross must be a real tensor of the gram's shape {estimate.shape}, "
            f"got {tuple(cross.shape)} {cross.dtype}"
        )
    host = host_float64(cross)
    if not np.isfinite(host).all():
        i, j = np.argwhere(~np.isfinite(host))[0]
        raise ValueError(f"GramEstimate.cross contains NaN or Inf: entry ({i}, {j}) is {host[i, j]}")
    size = max(np.abs(host).max(), np.abs(estimate).max())
    mismatch = np.abs((host + host.T) / 2 - estimate).max() / size if size > 0 else 0.0
    if not mismatch <= precision.allowance:
        raise ValueError(
            f"GramEstimate.gram is not the symmetric part of GramEstimate.cross: they differ by "
            f"{mismatch:.3g} of the largest entry; a {precision.name} G is known to {precision.allowance:.2g}"
        )
    return host


@dataclass(frozen=True)
class NormalizedGram:
    """A Gram matrix restricted to the objectives that can be normalised.

    Attributes:
        gram: ``(A, A)`` float64, ``G_kl / (s_k s_l)`` over the ``A`` active objectives.
        scale: ``(K,)`` float64, ``s_k`` (1 for excluded objectives).
        active: ``(K,)`` bool, objectives that enter the QP.
        precision: the dtype ``G`` came in, whose round-off bounds the error of ``gram`` (pass it
            to :func:`mogo.min_norm`): normalising in float64 does not make ``G`` better known.
    """

    gram: Tensor
    scale: Tensor
    active: Tensor
    precision: torch.dtype = torch.float64

    @property
    def excluded(self) -> list[int]:
        """Indices of objectives left out because their gradient norm is (numerically) zero."""
        return np.flatnonzero(~self.active.cpu().numpy()).tolist()

    def expand(self, alpha: Tensor) -> Tensor:
        """Scatter ``(A,)`` weights over the active objectives back to ``(K,)``, zeros elsewhere."""
        full = alpha.new_zeros(self.active.shape[0])
        full[self.active] = alpha
        return full


ZERO_RTOL = 1e-10
"""Gradients with a norm at most this times the largest count as zero (excluded, no direction)."""


def host_float64(tensor: Tensor) -> np.ndarray:
    """A small tensor (a Gram matrix, K losses) as float64 numpy on the host, where K x K
    arithmetic costs microseconds; a view when it is there already."""
    return torch.as_tensor(tensor).detach().to(device="cpu", dtype=torch.float64).numpy()


def gradient_norms(gram: np.ndarray) -> np.ndarray:
    """``(K,)`` ``||g_k|| = sqrt(G_kk)`` from a host Gram matrix (``G_kk`` below 0 by round-off
    counts as 0)."""
    return np.sqrt(np.maximum(gram.diagonal(), 0.0))


def nonzero_gradients(norms: np.ndarray, rtol: float = ZERO_RTOL) -> np.ndarray:
    """``(K,)`` bool: the gradients whose norm (of ``norms``, ``(K,)``) exceeds ``rtol`` times the
    largest; the others count as zero."""
    return norms > rtol * norms.max()


def normalize_gram(
    G: Tensor | GramEstimate | CheckedGram,
    mode: Normalization = "l2",
    *,
    losses: Tensor | None = None,
    rtol: float = ZERO_RTOL,
) -> NormalizedGram:
    """Normalise the Gram matrix of K gradients and exclude the zero ones.

    Args:
        G: ``(K, K)`` Gram matrix of the raw gradients, checked by :func:`check_gram`.
        mode: ``"l2"``, ``"loss"`` or ``"none"`` (see the module docstring).
        losses: ``(K,)`` positive loss values, required by ``"loss"``.
        rtol: a gradient whose norm is at most ``rtol * max_k ||g_k||`` is excluded.

    Returns:
        float64 tensors on the device of ``G``, computed on the host; ``precision`` is ``G``'s
        dtype.

    Raises:
        ValueError: on a ``G`` that :func:`check_gram` refuses (every gradient zero among
            them), an unknown mode, or missing or non-positive losses.
    """
    if mode not in ("l2", "loss", "none"):
        raise ValueError(f"unknown normalization {mode!r}; use 'l2', 'loss' or 'none'")
    checked = check_gram(G)
    host = checked.host
    K = host.shape[0]
    if mode == "none":
        sub, scale, active = host, np.ones(K), np.ones(K, dtype=bool)
    else:
        norms = gradient_norms(host)
        active = nonzero_gradients(norms, rtol)
        scale = np.where(active, norms if mode == "l2" else _positive_losses(losses, active), 1.0)
        kept = scale[active]
        sub = host[np.ix_(active, active)] / np.outer(kept, kept)
    tensors = (torch.from_numpy(a).to(checked.device) for a in (sub, scale, active))
    return NormalizedGram(*tensors, precision=checked.precision)


def _positive_losses(losses: Tensor | None, active: np.ndarray) -> np.ndarray:
    """The K losses of ``normalize="loss"`` as float64, checked positive where ``active``."""
    if losses is None:
        raise ValueError("normalize='loss' needs the loss values: pass losses=")
    values = host_float64(losses).reshape(-1)
    if values.shape != active.shape:
        raise ValueError(f"losses must have shape {active.shape}, got {values.shape}")
    bad = active & ~(np.isfinite(values) & (values > 0))
    if bad.any():
        index = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"normalize='loss' needs positive finite losses; objective {index} has {values[index]}"
        )
    return values
