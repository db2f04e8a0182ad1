"""Do independent batches agree on the policy gradient? The signal-to-noise of one optimizer step.

For one reward of the shapes world (the ``single`` strategy), this samples ``--batches``
independent batches from the pretrained model (``--prompts`` prompts x ``--group`` images each,
each batch its own epoch's draws), computes each batch's whole NFT gradient at the zero adapter
(every image at ``--timesteps`` of the sampler's grid), and prints the cosines between them, and
how many prompt groups give the reward no advantage at all (:func:`ties`: every image scored alike).

If one batch's gradient is ``g = mu + noise`` with per-sample signal-to-noise ``s``, the expected
cosine of two independent ``n``-sample gradients is ``c = n s^2 / (1 + n s^2)``: near 0 when a
step is noise and near 1 when the batch is large enough for its direction to be the signal's.
The estimate ``n* = (1 - c) n / c`` is the batch at which two steps would agree at ``c = 0.5``.

    python benchmarks/gradient_agreement.py --reward shapes_shape --prompts 8 --batches 4
    python benchmarks/gradient_agreement.py --reward shapes_color --same-prompt  # one prompt only
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

from mogo_diffusion.compare import frozen_sections
from mogo_diffusion.prompts import PromptPool, PromptSet
from mogo_diffusion.shapes.recipe import REWARDS, shapes_config
from mogo_diffusion.train import MicroBatch, Trainer


def batch_gradients(
    trainer: Trainer, batches: int, timesteps: int, first_epoch: int = 1000
) -> tuple[np.ndarray, np.ndarray]:
    """``[batches, P]`` gradients (float64) of independent batches at the trainer's current adapter,
    and the ``[batches * N, K]`` rewards of their images."""
    grads, rewards = [], []
    for b in range(batches):
        batch = trainer.score(trainer.sample(first_epoch + b))
        rewards.append(batch.rewards.double().numpy())
        advantages = trainer.advantages(batch, 0)[batch.local]
        grid = len(batch.timesteps)
        chosen = np.linspace(0, grid - 1, timesteps).round().astype(int).tolist()
        noise = torch.randn(
            (len(chosen), *batch.latents.shape), generator=trainer.stream("agreement", first_epoch + b)
        )
        trainer.gradients(batch, [MicroBatch(torch.arange(len(batch.latents)), advantages, chosen, noise)])
        grads.append(torch.cat([p.grad.reshape(-1) for p in trainer.params]).double().numpy().copy())
    return np.stack(grads), np.concatenate(rewards)


def ties(rewards: np.ndarray, group: int) -> dict[str, float]:
    """How many of a reward's prompt groups can give an advantage: ``rewards`` ``(N,)`` in
    consecutive groups of ``group`` images (one prompt each; NaN scores left out, groups of fewer
    than two scores ignored). A group whose scores all tie gets advantage 0 throughout."""
    groups = [g[~np.isnan(g)] for g in rewards.reshape(-1, group)]
    groups = [g for g in groups if len(g) > 1]
    return {
        "distinct_per_group": float(np.mean([len(np.unique(g)) for g in groups])),
        "tied_groups": float(np.mean([np.ptp(g) == 0 for g in groups])),
    }


def agreement(grads: np.ndarray) -> dict[str, float]:
    """Pairwise cosines of the rows of ``grads``: their mean, spread and extremes."""
    unit = grads / np.linalg.norm(grads, axis=1, keepdims=True)
    cosines = (unit @ unit.T)[np.triu_indices(len(grads), k=1)]
    return {
        "mean_cosine": float(cosines.mean()),
        "std_cosine": float(cosines.std()),
        "min_cosine": float(cosines.min()),
        "max_cosine": float(cosines.max()),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reward", default="shapes_shape", choices=REWARDS)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    parser.add_argument("--group", type=int, default=8, help="images per prompt")
    parser.add_argument("--batches", type=int, default=4, help="independent batches (>= 2)")
    parser.add_argument("--timesteps", type=int, default=9, help="trained timesteps per image")
    parser.add_argument("--beta", type=float, default=1.0, help="nft.beta")
    parser.add_argument("--same-prompt", action="store_true", help="every batch from one prompt")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    if args.batches < 2:
        parser.error("--batches must be at least 2")
    torch.set_num_threads(1)
    frozen = frozen_sections()  # the world's six rewards, as the study's specialists
    config = shapes_config(
        rewards=frozen["rewards"],
        strategy={"name": "single", "reward": args.reward},
        nft={**frozen["nft"], "beta": args.beta, "kl_coef": 0.0},
        sampling={"prompts_per_epoch": args.prompts, "group_size": args.group, "eval_prompts": None},
        train={"out_dir": "runs/gradient-agreement"},
    )
    trainer = Trainer.from_config(config)
    if args.same_prompt:
        trainer.prompts = PromptPool(
            [PromptSet(trainer.prompts.prompts[:1], trainer.prompts.metadata[:1])], [1]
        )
    started = time.perf_counter()
    grads, rewards = batch_gradients(trainer, args.batches, args.timesteps)
    if not np.linalg.norm(grads, axis=1).all():
        parser.error("a batch's gradient is zero (every image of a group scored alike): use larger --group")
    result = {
        **vars(args),
        "out": None if args.out is None else str(args.out),
        "images_per_batch": args.prompts * args.group,
        **agreement(grads),
        "gradient_norms": np.linalg.norm(grads, axis=1).tolist(),
        **ties(rewards[:, trainer.names.index(args.reward)], args.group),
        "seconds": time.perf_counter() - started,
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} thread",
    }
    c, n = result["mean_cosine"], result["images_per_batch"]
    result["images_for_agreement_0.5"] = (1 - c) * n / c if c > 0 else float("inf")
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
