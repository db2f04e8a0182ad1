"""End-to-end training throughput (sampling, scoring, update) of MARBLE against weighted sum.

Runs the real training loop (``mogo_diffusion.train.Trainer``) on a tiny SD3 on the CPU with
three rule-based rewards, for ``weighted_sum``, ``marble`` harmonizing every step, and ``marble``
with N=10 estimating alpha on the first micro-batch (timestep) of a step's window or on the whole
window. Epochs of the strategies interleave, so drift in the machine's speed affects them alike;
the first epoch of each (warm-up) is not timed.

    python benchmarks/train_step.py [--quick] [--epochs 10] [--preset small]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mogo_diffusion import models
from mogo_diffusion.config import Config
from mogo_diffusion.train import Trainer

STRATEGIES = {
    "weighted sum": {"name": "weighted_sum"},
    "marble N=1": {"name": "marble", "harmonize_every": 1},
    "marble N=10, alpha on first timestep": {"name": "marble", "harmonize_every": 10, "estimate": "first"},
    "marble N=10, alpha on the window": {"name": "marble", "harmonize_every": 10, "estimate": "window"},
}


def trainer(pipeline_dir: Path, out: Path, strategy: dict, prompts: int) -> Trainer:
    rewards = [{"name": n, "weight": 1.0} for n in ("jpeg_compressibility", "sharpness", "color_match")]
    config = Config.from_dict(
        {
            "model": {"pretrained": str(pipeline_dir), "dtype": "float32", "lora_rank": 8, "lora_alpha": 16,
                      "max_sequence_length": 16},
            "sampling": {"num_steps": 10, "resolution": 32, "group_size": 4, "prompts_per_epoch": prompts,
                         "batch_size": 16, "solver": "euler"},
            "rewards": rewards,
            "strategy": strategy,
            "train": {"batch_size": 8, "mixed_precision": "no", "out_dir": str(out), "lr": 1e-4},
        }
    )  # fmt: skip
    return Trainer.from_config(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 epochs on the smoke model")
    parser.add_argument("--epochs", type=int, default=11)
    parser.add_argument("--preset", choices=sorted(models.TINY_PRESETS), default="small")
    args = parser.parse_args()
    torch.set_num_threads(1)
    epochs, preset = (3, "smoke") if args.quick else (args.epochs, args.preset)
    with tempfile.TemporaryDirectory() as tmp:
        pipeline_dir = Path(tmp) / "pipeline"
        models.tiny_sd3(preset).save_pretrained(pipeline_dir)
        trainers = {label: trainer(pipeline_dir, Path(tmp) / str(i), strategy, 4)
                    for i, (label, strategy) in enumerate(STRATEGIES.items())}  # fmt: skip
        seconds: dict[str, list[float]] = {label: [] for label in trainers}
        images = 0
        for epoch in range(epochs):
            for label, run in trainers.items():
                start = time.perf_counter()
                metrics = run.train_epoch(epoch)
                if epoch > 0:
                    seconds[label].append(time.perf_counter() - start)
                images = metrics["images_per_second"] * metrics["seconds"]
    base = statistics.mean(seconds["weighted sum"])
    print(f"\ntiny SD3 '{preset}', {int(images)} images per epoch, 9 of 10 timesteps trained,", end=" ")
    print(f"{epochs - 1} timed epochs")
    print("| strategy | s per epoch | throughput vs weighted sum |\n|---|---|---|")
    for label, values in seconds.items():
        mean = statistics.mean(values)
        print(f"| {label} | {mean:.2f} | {base / mean:.3f} |")


if __name__ == "__main__":
    main()
