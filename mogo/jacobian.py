"""Per-objective gradients from one shared forward pass.

Given K losses computed by one forward pass, :func:`objective_grads` returns, for every parameter
``p``, the stacked gradients ``[dL_1/dp, ..., dL_K/dp]`` of shape ``[K, *p.shape]``:

* ``"batched"``: one backward pass vmapped over the K rows of the identity,
  ``torch.autograd.grad(losses, params, grad_outputs=eye(K), is_grads_batched=True)``;
* ``"sequential"``: K backward passes through the retained graph;
* ``"auto"``: batched, falling back to sequential with a warning naming the operation that has
  no batching rule.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

__all__ = ["GradMode", "objective_grads"]

GradMode = Literal["auto", "batched", "sequential"]


def objective_grads(
    losses: Tensor,
    params: Sequence[Tensor],
    *,
    mode: GradMode = "auto",
    retain_graph: bool = False,
    out: Sequence[Tensor] | None = None,
    materialize_grads: bool = True,
) -> tuple[list[Tensor | None], GradMode]:
    """Stacked gradients of K losses with respect to each parameter.

    Args:
        losses: ``(K,)`` losses sharing one autograd graph.
        params: tensors that require grad; parameters no loss depends on get zeros, or ``None``
            with ``materialize_grads=False`` (as in ``torch.autograd.grad``).
        mode: ``"auto"``, ``"batched"`` or ``"sequential"`` (see the module docstring).
        retain_graph: keep the graph for a later backward pass.
        out: buffers for the sequential gradients, one ``[K, *p.shape]`` per parameter. Each
            backward pass's gradients are copied in and freed before the next, so that only one
            row is alive at a time; reusing buffers across steps also spares the allocator fresh
            pages (on the CPU, first-touch page faults cost 20-30% of a step). The batched mode
            returns autograd's own stacked tensors.
        materialize_grads: zeros (True) or ``None`` (False) for parameters no loss depends on.

    Returns:
        The gradients, one ``[K, *p.shape]`` tensor per parameter, and the mode that produced
        them (``"sequential"`` after an ``"auto"`` fallback: pass it next time to skip the retry).

    Example:
        >>> import torch, mogo
        >>> w = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> grads, _ = mogo.objective_grads(torch.stack([w.sum(), (w**2).sum()]), [w])
        >>> grads[0]
        tensor([[1., 1.],
                [2., 4.]])
    """
    if losses.ndim != 1 or losses.numel() == 0:
        raise ValueError(f"losses must have shape (K,) with K >= 1, got {tuple(losses.shape)}")
    if not losses.requires_grad:
        raise ValueError("losses do not require grad: compute them from the parameters, outside no_grad")
    if mode not in ("auto", "batched", "sequential"):
        raise ValueError(f"unknown mode {mode!r}; use 'auto', 'batched' or 'sequential'")
    params = list(params)
    K = losses.shape[0]
    if mode != "sequential" and K > 1:
        eye = torch.eye(K, dtype=losses.dtype, device=losses.device)
        try:
            grads = torch.autograd.grad(
                losses, params, grad_outputs=eye, is_grads_batched=True,
                retain_graph=retain_graph or mode == "auto", allow_unused=True,
            )  # fmt: skip
            return (_fill_unused(grads, params, K) if materialize_grads else list(grads)), "batched"
        except RuntimeError as error:
            if mode == "batched":
                raise
            warnings.warn(
                f"batched per-objective gradients failed ({_failing_op(error)}); falling back to "
                f"{K} sequential backward passes. Pass mode='sequential' to skip the attempt.",
                RuntimeWarning,
                stacklevel=2,
            )
            mode = "sequential"
    grads = _buffers(out, params, K, losses)
    used = [False] * len(params)
    for k, loss in enumerate(losses):
        row = torch.autograd.grad(loss, params, retain_graph=retain_graph or k < K - 1, allow_unused=True)
        for i, (buffer, grad) in enumerate(zip(grads, row, strict=True)):
            buffer[k].zero_() if grad is None else buffer[k].copy_(grad)
            used[i] = used[i] or grad is not None
    if materialize_grads:
        return grads, "sequential"
    return [g if u else None for g, u in zip(grads, used, strict=True)], "sequential"


def _buffers(out: Sequence[Tensor] | None, params: Sequence[Tensor], K: int, losses: Tensor) -> list[Tensor]:
    """``out`` when it fits ``[K, *p.shape]`` for every parameter, else new buffers."""
    if out is not None:
        out = list(out)
        if len(out) != len(params) or any(
            b.shape != (K, *p.shape) or b.dtype != p.dtype or b.device != p.device
            for b, p in zip(out, params, strict=True)
        ):
            raise ValueError("out must hold one [K, *p.shape] tensor per parameter, of its dtype and device")
        return out
    return [p.new_empty(K, *p.shape) for p in params]


def _fill_unused(grads: Sequence[Tensor | None], params: Sequence[Tensor], K: int) -> list[Tensor]:
    return [p.new_zeros(K, *p.shape) if g is None else g for g, p in zip(grads, params, strict=True)]


def _failing_op(error: RuntimeError) -> str:
    """The operator named in a vmap error, or the error's first line."""
    match = re.search(r"aten::\w+(?:\.\w+)?", str(error))
    return match.group(0) if match else str(error).splitlines()[0][:120]
