"""Harmonization across processes: data-parallel ranks and sharded parameters.

Every rank must solve the same QP, or the replicas drift apart. Two layouts reach that with
different traffic (``P`` parameters, ``K`` objectives, payload bytes of one all-reduce):

* :class:`DataParallel`: every rank holds every parameter and its own slice of the batch. On a
  harmonization step the stacked per-objective gradients are averaged with one flat all-reduce
  (``K * P`` elements), so every rank holds the full-batch gradients, the same Gram matrix, the
  same alpha and the same update. DDP's reducer is paused for that step's forward (it expects
  exactly one backward per forward, and a harmonization step runs K). Steps between
  harmonizations are ordinary data-parallel steps: DDP's own all-reduce of ``P`` elements, or one
  flat all-reduce of the gradients for a model not wrapped in DDP.
* :class:`ShardedParameters`: every rank holds a shard of each parameter (tensor parallelism,
  or FSDP-style sharding with the data-parallel reduction done by the sharding framework). The
  Gram matrix is the sum of the ranks' shard Gram matrices, so ``K * K`` numbers cross the
  network; the update is applied shard-wise. DTensor gradients are reduced over their local
  shards.

Both agree on non-finite values before acting (one all-reduce of ``K + 1`` flags per
``backward``, for the losses and the shared loss, and of one flag per step, for its gradient), so
that ``"raise"``, ``"skip"`` and ``"drop"`` take the same branch on every rank and none waits in a
collective that another rank skipped. The order in which a step meets its layout is in
``_Layout``'s docstring.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # torch < 2.4 has no public DTensor: nothing is one (isinstance(x, ()) is False)
    DTensor = Shard = ()

from mogo.gram import gramian

__all__ = ["DataParallel", "ShardedParameters", "sharded_gramian"]


def local_shards(stacked: Tensor, param: Tensor) -> Tensor:
    """``[K, *local shape]``: the rows of a DTensor parameter's stacked gradients, laid out as
    the parameter's own shard (autograd may return them replicated or partial); other tensors
    as they are."""
    if not isinstance(param, DTensor):
        return stacked
    placements = [Shard(p.dim + 1) if isinstance(p, Shard) else p for p in param.placements]
    return stacked.redistribute(param.device_mesh, placements).to_local()


def as_parameter_grad(update: Tensor, param: Tensor) -> Tensor:
    """A local shard of a DTensor parameter's gradient, as a DTensor placed like the parameter."""
    if isinstance(param, DTensor) and not isinstance(update, DTensor):
        return DTensor.from_local(update, param.device_mesh, param.placements, run_check=False)
    return update


def local_tensor(tensor: Tensor) -> Tensor:
    """The local shard of a DTensor; any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def sharded_gramian(stacked_grads: Sequence[Tensor], group: dist.ProcessGroup | None = None) -> Tensor:
    """Gram matrix of gradients sharded across the ranks of ``group``.

    Each rank passes its shards, ``[K, *shard.shape]`` per parameter (DTensors are reduced over
    their local shards); the result, ``sum over ranks of gramian(shards)``, is the Gram matrix of
    the unsharded gradients, with one all-reduce of ``K * K`` float64 numbers.

    Returns:
        ``(K, K)`` float64, the same on every rank.
    """
    gram = gramian([local_tensor(g) for g in stacked_grads])
    dist.all_reduce(gram, group=group)
    return gram


class _Layout:
    """How a step's gradients become the same on every rank. One process is the trivial layout.

    A step meets its layout at these points, in order:

    * :meth:`agree` and :meth:`all_ranks`, in the finiteness checks of every ``backward`` and of
      the step's gradient: each rank's flags become those of all ranks (a NaN anywhere is a NaN
      everywhere);
    * :meth:`expect`, before a forward: whether its backward harmonizes (a DDP reducer pauses)
      or is an ordinary backward; :meth:`reducer_waits` tells a skipped micro-batch whether it
      must still run one;
    * :meth:`reduce`, then :meth:`gram`, on a harmonizing micro-batch's K gradients: the
      gradients and the Gram matrix every rank solves on;
    * :meth:`finish`, at the end of a window with ordinary backwards: their rank-local ``.grad``
      made the same on every rank.
    """

    def agree(self, finite: Tensor) -> Tensor:
        """``(n,)`` bool: True where the flag is True on every rank."""
        return finite

    def all_ranks(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""
        return flag

    def expect(self, harmonizing: bool) -> None:
        """Called before a forward, knowing whether its backward harmonizes."""

    def reducer_waits(self) -> bool:
        """Whether a collective waits for this forward's backward (a DDP reducer)."""
        return False

    def reduce(
        self, rows: list[Tensor | None], params: Sequence[Tensor], objectives: int
    ) -> list[Tensor | None]:
        """The stacked gradients ``[K, *p.shape]`` of ``K = objectives`` rows (``None``: no loss
        depends on ``p``) that this layout solves on: a DTensor parameter's as its local shard."""
        return [None if g is None else local_shards(g, p) for g, p in zip(rows, params, strict=True)]

    def gram(self, rows: Sequence[Tensor], objectives: int) -> Tensor:
        """``(K, K)`` float64 Gram matrix of ``rows`` (zeros when there are none)."""
        if not rows:
            return torch.zeros(objectives, objectives, dtype=torch.float64)
        return gramian(rows)

    def finish(self, params: Sequence[Tensor]) -> None:
        """Make the ``.grad`` that ordinary backwards left rank-local the same on every rank."""


class _Collective(_Layout):
    """What both multi-process layouts share: the process group, a byte count, agreement."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"{type(self).__name__} needs an initialised process group: call "
                "torch.distributed.init_process_group (torchrun and accelerate launch set it up)"
            )
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.bytes_reduced = 0  # payload of every all-reduce mogo issued, on this rank

    def _all_reduce(self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
        self.bytes_reduced += tensor.numel() * tensor.element_size()
        dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def agree(self, finite: Tensor) -> Tensor:
        return self._all_reduce(finite.to(torch.int32), dist.ReduceOp.MIN).bool()

    def all_ranks(self, flag: bool) -> bool:
        return bool(self.agree(torch.tensor([flag])))


class DataParallel(_Collective):
    """Data parallelism: the same alpha and update on every rank, from averaged K gradients.

    Args:
        model: the ``DistributedDataParallel`` module (or any module with DDP's
            ``require_backward_grad_sync`` switch, as ``accelerator.prepare`` returns under
            multi-process launches); its reducer is paused for harmonization forwards. ``None``
            for a model that is not wrapped: mogo then averages ``.grad`` itself before each
            update, with one flat all-reduce.
        group: the process group; by default the model's, else the default group.

    Example (under ``torchrun``; run by the test suite on two gloo processes)::

        model = torch.nn.parallel.DistributedDataParallel(net)
        opt = mogo.HarmonizedOptimizer(torch.optim.AdamW(model.parameters()), objectives=3,
                                       distributed=mogo.DataParallel(model))
    """

    def __init__(self, model: torch.nn.Module | None = None, group: dist.ProcessGroup | None = None) -> None:
        if model is not None and not hasattr(model, "require_backward_grad_sync"):
            raise TypeError(
                f"model must be wrapped in DistributedDataParallel, got {type(model).__name__}; "
                "pass model=None for a model that is not wrapped"
            )
        super().__init__(group if group is not None else getattr(model, "process_group", None))
        self.model = model

    def expect(self, harmonizing: bool) -> None:
        if self.model is not None:
            self.model.require_backward_grad_sync = not harmonizing

    def reducer_waits(self) -> bool:
        return self.model is not None and bool(self.model.require_backward_grad_sync)

    def reduce(
        self, rows: list[Tensor | None], params: Sequence[Tensor], objectives: int
    ) -> list[Tensor | None]:
        """The mean over ranks of the K gradients, by one all-reduce of ``K * P`` elements; a
        parameter stays ``None`` only where no rank's losses depend on it (as DDP keeps it)."""
        K = objectives
        used = torch.tensor([g is not None for g in rows], dtype=params[0].dtype)
        full = [p.new_zeros(K, *p.shape) if g is None else g for g, p in zip(rows, params, strict=True)]
        *averaged, used = self._average([*full, used])
        return [g if bool(u) else None for g, u in zip(averaged, used > 0, strict=True)]

    def finish(self, params: Sequence[Tensor]) -> None:
        if self.model is not None:  # DDP's reducer averaged them in the backward
            return
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            for grad, averaged in zip(grads, self._average(grads), strict=True):
                grad.copy_(averaged)

    def _average(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """The mean over ranks of each tensor, by one all-reduce of their concatenation."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self._all_reduce(flat).div_(self.world_size)
        return [
            chunk.view_as(t)
            for chunk, t in zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)
        ]


class ShardedParameters(_Collective):
    """Sharded parameters: the Gram matrix summed over the ranks' shards (``K * K`` numbers).

    Use it where each rank's ``.grad`` already holds its shard of the full gradient (tensor
    parallelism; sharded data parallelism whose framework reduces gradients across data ranks).

    Args:
        group: the process group over which the parameters are sharded; default the world.
    """

    def gram(self, rows: Sequence[Tensor], objectives: int) -> Tensor:
        gram = super().gram([local_tensor(g) for g in rows], objectives)
        return self._all_reduce(gram)
