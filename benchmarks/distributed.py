"""Bytes all-reduced per optimizer step on 2 data-parallel ranks (gloo, CPU), by strategy.

DDP's own traffic is counted by a communication hook on its buckets; mogo's by
``DataParallel.bytes_reduced``. Payload bytes per rank of each all-reduce are reported (a ring
all-reduce sends ``2 (n - 1) / n`` times that over the wire), with time per step on loopback.

    python benchmarks/distributed.py [--steps 20] [--objectives 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import mogo


def mlp(K: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, K),
    )  # fmt: skip


class ByteCount:
    bytes = 0


def counting_all_reduce(state: ByteCount, bucket):  # no annotation: DDP checks it is GradBucket
    """DDP's averaging all-reduce of one bucket, adding its payload to ``state.bytes``."""
    buffer = bucket.buffer()
    state.bytes += buffer.numel() * buffer.element_size()
    buffer.div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda future: future.value()[0])


def measure(strategy: str, K: int, steps: int) -> tuple[float, float, float]:
    """(DDP bytes, mogo bytes, seconds) per step."""
    model = DistributedDataParallel(mlp(K))
    count = ByteCount()
    model.register_comm_hook(count, counting_all_reduce)
    generator = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(128, 512, generator=generator), torch.randn(128, K, generator=generator)
    inner = torch.optim.SGD(model.parameters(), lr=1e-4)
    distributed = mogo.DataParallel(model)
    every = {"harmonized, every step": 1, "amortized, N=10": 10}.get(strategy)
    opt = (
        None
        if every is None
        else mogo.HarmonizedOptimizer(inner, K, harmonize_every=every, distributed=distributed)
    )
    start = time.perf_counter()
    for _ in range(steps):
        losses = ((model(x) - y) ** 2).mean(0)
        if opt is None:
            inner.zero_grad()
            losses.sum().backward()
            inner.step()
        else:
            opt.zero_grad()
            opt.backward(losses)
            opt.step()
    seconds = (time.perf_counter() - start) / steps
    return count.bytes / steps, distributed.bytes_reduced / steps if opt else 0.0, seconds


def worker(K: int, steps: int) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    P = sum(p.numel() for p in mlp(K).parameters())
    rows = [
        (name, *measure(name, K, steps))
        for name in ("weighted sum", "harmonized, every step", "amortized, N=10")
    ]
    if dist.get_rank() == 0:
        print(f"\nMLP, {P / 1e6:.2f}M float32 parameters (P), K={K}, 2 ranks, {steps} steps")
        print("| strategy | DDP MB/step | mogo MB/step | total, in units of 4P bytes | ms/step |")
        print("|---|---|---|---|---|")
        for name, ddp_bytes, mogo_bytes, seconds in rows:
            total = (ddp_bytes + mogo_bytes) / (4 * P)
            megabytes = f"{ddp_bytes / 1e6:.2f} | {mogo_bytes / 1e6:.2f}"
            print(f"| {name} | {megabytes} | {total:.2f} | {seconds * 1e3:.1f} |")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--objectives", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.objectives, args.steps)
        return
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        __file__,
    ]
    arguments = ["--worker", "--steps", str(args.steps), "--objectives", str(args.objectives)]
    subprocess.run([*command, *arguments], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    main()
