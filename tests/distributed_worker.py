"""One rank of the multi-process tests, started by ``torchrun`` or ``accelerate launch``.

    torchrun --nproc_per_node 2 tests/distributed_worker.py OUT_DIR [--accelerate]

Each rank trains on its half of a fixed batch and saves what it saw (alpha per step, final
parameters, non-finite outcomes, sharded Gram matrices) to ``OUT_DIR/rank{r}.pt``; the tests
compare the ranks with each other and with one process on the full batch
(:func:`train_single`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import mogo

K, BATCH, STEPS = 3, 16, 5
CLIP = 0.05  # below the gradient norms, so clipping acts


def build(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, K))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 6, generator=generator, dtype=torch.float64)
    # Objective 2 pulls against the others, so alpha is not trivial.
    y = torch.stack([x[:, 0], x[:, 1] + x[:, 0], -x[:, 0]], dim=1)
    return x, y


def losses_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean(0)


def halves_losses_of(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, chunks: int = 1
) -> torch.Tensor:
    """``(2, K)``: the mean losses of two halves of the batch, half h made of the h-th half of
    each of its ``chunks`` (the ranks' slices), so that one process on the whole batch with
    ``chunks`` = world size sees the halves that the ranks' halves, averaged, make."""
    errors = (model(x) - y) ** 2
    parts = [chunk.chunk(2) for chunk in errors.chunk(chunks)]
    return torch.stack([torch.cat([part[h] for part in parts]).mean(0) for h in (0, 1)])


def make_optimizer(
    model, every, distributed=None, nonfinite="raise", gram="same_batch"
) -> mogo.HarmonizedOptimizer:
    inner = torch.optim.Adam(model.parameters(), lr=0.05)
    return mogo.HarmonizedOptimizer(
        inner,
        K,
        harmonize_every=every,
        alpha_ema=0.5,
        distributed=distributed,
        nonfinite=nonfinite,
        gram=gram,
    )


def sqrt_at_zero(tensor: torch.Tensor) -> torch.Tensor:
    """A loss of value 0 whose gradient is NaN: d sqrt(u)/du = inf at u = 0, times du/dw = 0."""
    return torch.sqrt(((tensor - tensor.detach()) ** 2).sum())


def train(
    model, opt, rank=0, world=1, nan_at=None, spread=False, clip=None, nan_gradient=False, halves_of=None
) -> dict:
    """STEPS steps on this rank's slice of the batch; NaN in objective 1 on the last rank at
    step ``nan_at`` (``spread``: into the shared graph too; ``nan_gradient``: a finite loss
    whose gradient is NaN); ``clip``: the gradient norm is clipped between ``harmonize`` and
    ``step``; ``halves_of``: the slice's ``(2, K)`` halves' losses come from
    ``halves_losses_of`` over that many chunks (``gram="cross_fitted"``). Returns alpha and
    parameters after each step, and what raised."""
    alphas, params, raised = [], [], None
    # accelerate's wrapper holds ours as .optimizer
    harmonized = opt if isinstance(opt, mogo.HarmonizedOptimizer) else opt.optimizer
    for step in range(STEPS):
        x, y = data(step)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad()
        losses = losses_of(model, x, y) if halves_of is None else halves_losses_of(model, x, y, halves_of)
        if step == nan_at and rank == world - 1 and nan_gradient:
            losses = losses + sqrt_at_zero(next(model.parameters())) * torch.tensor([0.0, 1.0, 0.0])
        elif step == nan_at and rank == world - 1:
            nan = torch.tensor([False, True, False])
            # torch.where keeps the NaN out of the gradients; a product spreads it into all of them
            losses = (
                losses * torch.where(nan, float("nan"), 1.0)
                if spread
                else torch.where(nan, float("nan"), losses)
            )
        try:
            harmonized.backward(losses)
            if clip is not None:
                harmonized.harmonize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
        except FloatingPointError as error:
            raised = str(error)
            break
        alphas.append(harmonized.amortizer.alpha.clone())
        params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return {"alphas": alphas, "params": params, "raised": raised}


def train_single(every: int, clip: float | None = None, gram: str = "same_batch", world: int = 2) -> dict:
    """One process on the whole batch; with ``gram="cross_fitted"``, on the halves that
    ``world`` ranks' halves make."""
    model = build().double()
    halves_of = world if gram == "cross_fitted" else None
    return train(model, make_optimizer(model, every, gram=gram), clip=clip, halves_of=halves_of)


def ddp_runs(rank: int, world: int) -> dict:
    results = {}
    for every in (1, 3):
        model = torch.nn.parallel.DistributedDataParallel(build().double())
        results[f"ddp_every{every}"] = train(
            model, make_optimizer(model, every, mogo.DataParallel(model)), rank, world
        )
        model = build().double()
        results[f"unwrapped_every{every}"] = train(
            model, make_optimizer(model, every, mogo.DataParallel()), rank, world
        )
        for layout in ("ddp", "unwrapped"):
            model = build().double()
            if layout == "ddp":
                model = torch.nn.parallel.DistributedDataParallel(model)
            distributed = mogo.DataParallel(model if layout == "ddp" else None)
            opt = make_optimizer(model, every, distributed)
            results[f"{layout}_clip_every{every}"] = train(model, opt, rank, world, clip=CLIP)
            model = build().double()
            if layout == "ddp":
                model = torch.nn.parallel.DistributedDataParallel(model)
            distributed = mogo.DataParallel(model if layout == "ddp" else None)
            opt = make_optimizer(model, every, distributed, gram="cross_fitted")
            results[f"{layout}_cross_fitted_every{every}"] = train(model, opt, rank, world, halves_of=1)
    for policy in ("raise", "skip", "drop"):
        for nan_at in (1, 2):  # with N=2: an amortized step, then a harmonization step
            model = torch.nn.parallel.DistributedDataParallel(build().double())
            opt = make_optimizer(model, 2, mogo.DataParallel(model), nonfinite=policy)
            results[f"nan_{policy}_{nan_at}"] = train(model, opt, rank, world, nan_at=nan_at)
    for nan_at in (1, 2):
        model = torch.nn.parallel.DistributedDataParallel(build().double())
        opt = make_optimizer(model, 2, mogo.DataParallel(model), nonfinite="drop")
        results[f"nan_spread_{nan_at}"] = train(model, opt, rank, world, nan_at=nan_at, spread=True)
    for policy in ("raise", "skip", "drop"):
        for layout in ("ddp", "unwrapped"):  # step 1 of N=2: between harmonizations
            model = build().double()
            model = torch.nn.parallel.DistributedDataParallel(model) if layout == "ddp" else model
            opt = make_optimizer(model, 2, mogo.DataParallel(model if layout == "ddp" else None), policy)
            results[f"nan_gradient_{policy}_{layout}"] = train(
                model, opt, rank, world, nan_at=1, nan_gradient=True
            )
    results["unused_parameters"] = unused_parameters(rank, world)
    return results


def unused_parameters(rank: int, world: int) -> dict:
    """Harmonization steps with a parameter no loss uses (``idle``) and one only rank 0's loss
    uses (``partial``): the averaged gradients keep ``idle`` without one, and give ``partial``
    the mean over ranks."""
    model = build().double()
    idle, partial = (torch.nn.Parameter(torch.ones(3, dtype=torch.float64)) for _ in range(2))
    inner = torch.optim.SGD([*model.parameters(), idle, partial], lr=0.05)
    opt = mogo.HarmonizedOptimizer(inner, K, distributed=mogo.DataParallel())
    x, y = (t.chunk(world)[rank] for t in data(0))
    opt.zero_grad()
    losses = losses_of(model, x, y)
    if rank == 0:
        losses = losses + torch.stack([(partial**2).sum(), torch.zeros(()), torch.zeros(())])
    opt.backward(losses)
    opt.harmonize()
    return {"idle": idle.grad, "partial": partial.grad, "first": next(model.parameters()).grad.clone()}


class _ReduceForward(torch.autograd.Function):
    """Sum over ranks in the forward, identity in the backward: each rank's shard of ``w``
    receives its part of the gradient of the one full-model loss (tensor parallelism)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def tensor_parallel_problem() -> tuple[torch.Tensor, ...]:
    """``losses_k = mean(((x @ w @ mix)_k - y_k)^2)``; ``mix`` couples the objectives."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(BATCH, 8, generator=generator, dtype=torch.float64)
    w = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    mix = torch.randn(4, K, generator=generator, dtype=torch.float64)
    y = torch.randn(BATCH, K, generator=generator, dtype=torch.float64)
    return x, w, mix, y


def train_tensor_parallel(rank: int = 0, world: int = 1) -> dict:
    """Three harmonized SGD steps on ``w``, split by rows across the ranks (whole when world=1)."""
    x, w_full, mix, y = tensor_parallel_problem()
    w = torch.nn.Parameter(w_full.chunk(world)[rank].clone())
    distributed = mogo.ShardedParameters() if world > 1 else None
    opt = mogo.HarmonizedOptimizer(torch.optim.SGD([w], lr=0.1), K, distributed=distributed)
    alphas = []
    for _ in range(3):
        opt.zero_grad()
        partial = x.chunk(world, dim=1)[rank] @ w
        prediction = (_ReduceForward.apply(partial) if world > 1 else partial) @ mix
        opt.backward(((prediction - y) ** 2).mean(0))
        opt.step()
        alphas.append(opt.amortizer.alpha.clone())
    return {"alphas": alphas, "w": w.detach().clone()}


def train_dtensor() -> dict:
    """``train_tensor_parallel`` with ``w`` a DTensor sharded by rows over a 1-D CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x, w_full, mix, y = tensor_parallel_problem()
    w = torch.nn.Parameter(distribute_tensor(w_full.clone(), mesh, [Shard(0)]))
    x = distribute_tensor(x, mesh, [Replicate()])
    opt = mogo.HarmonizedOptimizer(torch.optim.SGD([w], lr=0.1), K, distributed=mogo.ShardedParameters())
    alphas = []
    for _ in range(3):
        opt.zero_grad()
        prediction = (x @ w).full_tensor() @ mix
        opt.backward(((prediction - y) ** 2).mean(0))
        opt.step()
        alphas.append(opt.amortizer.alpha.clone())
    return {"alphas": alphas, "w": w.detach().full_tensor(), "grad_type": type(w.grad).__name__}


def sharded_runs(rank: int, world: int) -> dict:
    generator = torch.Generator().manual_seed(7)
    grads = [torch.randn(K, 10, 4, generator=generator, dtype=torch.float64)]
    grads.append(torch.randn(K, 6, generator=generator, dtype=torch.float64))
    shards = [g.chunk(world, dim=1)[rank] for g in grads]
    return {
        "sharded_gram": mogo.sharded_gramian(shards),
        "full_gram": mogo.gramian(grads, dtype=torch.float64),
        "tensor_parallel": train_tensor_parallel(rank, world),
        "dtensor": train_dtensor(),
    }


def accelerate_runs() -> dict:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    results = {}
    for every in (1, 3):
        model = accelerator.prepare(build().double())
        opt = accelerator.prepare(make_optimizer(model, every, mogo.DataParallel(model)))
        results[f"accelerate_every{every}"] = train(
            model, opt, accelerator.process_index, accelerator.num_processes
        )
    return results


def main(out: Path, use_accelerate: bool) -> None:
    if use_accelerate:
        results = accelerate_runs()
    else:
        dist.init_process_group("gloo")
        results = {
            **ddp_runs(dist.get_rank(), dist.get_world_size()),
            **sharded_runs(dist.get_rank(), dist.get_world_size()),
        }
    rank = dist.get_rank()
    torch.save(results, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), "--accelerate" in sys.argv[2:])
    # Skip interpreter finalization: there, gloo's worker threads of an accelerate-made group are
    # destroyed while joinable and abort the process (std::terminate, about 1 exit in 10), after
    # every result is already saved.
    sys.stdout.flush()
    os._exit(0)
