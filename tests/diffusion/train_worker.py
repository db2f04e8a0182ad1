"""One process of the multi-process training test, started by ``accelerate launch``.

    accelerate launch --multi_gpu --num_processes 2 tests/diffusion/train_worker.py OUT_DIR CONFIG...

Trains the run of each ``CONFIG`` with :class:`~mogo_diffusion.train.Trainer` and saves this
rank's final LoRA vectors and per-epoch rewards, by config file name, to ``OUT_DIR/rank{r}.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from mogo_diffusion.config import load_config
from mogo_diffusion.train import Trainer


def main(out: str, *configs: str) -> None:
    torch.set_num_threads(1)
    results, rank = {}, 0
    for config in configs:
        trainer = Trainer.from_config(load_config(config))
        history = trainer.train()
        rank = trainer.accelerator.process_index
        results[Path(config).stem] = {
            "params": torch.cat([p.detach().reshape(-1) for p in trainer.params]),
            "rewards": torch.tensor([[m[f"reward/{name}"] for name in trainer.names] for m in history]),
        }
    torch.save(results, Path(out) / f"rank{rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
