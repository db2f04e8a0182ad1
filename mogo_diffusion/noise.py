"""How much of one step's gradient is noise on the shapes world: ``python -m mogo_diffusion.noise``.

For each reward set of the study (:data:`mogo_diffusion.study.REWARD_SETS`), from the pretrained
model (the adapter at zero), this draws ``--batches`` independent batches of the recipe (its
prompts per epoch and images per prompt, each batch its own epoch's draws), and for each the K
per-reward NFT gradients over the adapter of the two halves of its images, ``J_1`` and ``J_2``
(``K x P``, each half a random half of the batch, at the recipe's trained timesteps: the
``marble`` strategy's ``gram: cross_fitted`` losses). From them (:class:`NoiseMeter`):

* **cosine between batches**: ``cos(g_k, g'_k)`` of consecutive batches' gradients
  ``g = (J_1 + J_2) / 2``. Two batches' gradients share only the expected gradient ``mu_k``, so
  this is about ``||mu_k||^2 / E||g_k||^2``, the signal's share of a batch's squared norm;
* **noise share of the diagonal**: ``1 - sum <J_1k, J_2k> / sum ||g_k||^2`` over the batches:
  how much of the one-batch Gram matrix's diagonal ``||g_k||^2`` is the batch's own noise (the
  halves share only ``mu_k``: ``E <J_1k, J_2k> = ||mu_k||^2``), and the same from the cosines
  between batches, ``1 - sum <g_k, g'_k> / sum ||g_k||^2``;
* **conflict rates**: the share of batches whose weighted-sum direction (the rewards' weights,
  1 each) has a negative cosine with some reward's gradient, measured on one batch (the
  direction and the gradients of the same images, the MARBLE paper's measure) and across its
  halves (the direction of one half against the gradients of the other,
  :class:`mogo.ConflictReport`), with the worst cosine of each.

The table is written to ``--out`` (``.rst``, which the docs include, and ``.json``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np
import torch

import mogo
from mogo_diffusion.tables import rst_table
from mogo_diffusion.train import Trainer

__all__ = ["NoiseMeter", "batch_halves", "main", "measure", "noise_config", "write_table"]


class NoiseMeter:
    """The statistics of the module docstring over a sequence of batches' half-gradients.

    Args:
        names: the K rewards, in the gradients' row order.
        sets: reward sets by name (subsets of ``names``), each with its own conflict rates; by
            default one set ``"all"`` of every reward.
    """

    def __init__(self, names: Sequence[str], sets: Mapping[str, Sequence[str]] | None = None) -> None:
        K = len(names)
        self.names = list(names)
        chosen = sets or {"all": names}
        self.sets = {name: [self.names.index(r) for r in rewards] for name, rewards in chosen.items()}
        self.batches = 0
        self.squared = np.zeros(K)  # sum over batches of ||g_k||^2
        self.crossed = np.zeros(K)  # sum of <J_1k, J_2k>
        self.pair_inner = np.zeros(K)  # sum over consecutive pairs of <g_k, g'_k>
        self.pair_squared = np.zeros(K)  # sum over the same pairs of (||g_k||^2 + ||g'_k||^2) / 2
        self.pair_cosines: list[np.ndarray] = []  # NaN where a gradient of the pair is zero
        self.conflicts = {name: {"same_batch": 0, "cross_batch": 0} for name in self.sets}
        self.worst = {name: {"same_batch": 1.0, "cross_batch": 1.0} for name in self.sets}
        self._previous: np.ndarray | None = None

    def add(self, first: np.ndarray, second: np.ndarray) -> None:
        """Add a batch: the ``(K, P)`` gradients of its two halves (float64)."""
        batch = (first + second) / 2
        squared = (batch**2).sum(axis=1)
        self.batches += 1
        self.squared += squared
        self.crossed += (first * second).sum(axis=1)
        if self._previous is not None:
            before = self._previous
            inner = (batch * before).sum(axis=1)
            product = squared * (before**2).sum(axis=1)
            self.pair_inner += inner
            self.pair_squared += (squared + (before**2).sum(axis=1)) / 2
            cosines = np.full(len(self.names), np.nan)
            np.divide(inner, np.sqrt(product), out=cosines, where=product > 0)
            self.pair_cosines.append(cosines)
        self._previous = batch
        for name, members in self.sets.items():
            present = [k for k in members if squared[k] > 0]
            rows = np.concatenate([first[present], second[present]])
            report = _sum_report(torch.from_numpy(rows @ rows.T), [self.names[k] for k in present])
            for kind, cosines in (
                ("same_batch", report.weighted_sum_cosines),
                ("cross_batch", report.cross_batch_weighted_sum_cosines),
            ):
                self.conflicts[name][kind] += int(bool((cosines < 0).any()))
                self.worst[name][kind] = min(self.worst[name][kind], float(cosines.min()))

    def summary(self) -> dict[str, Any]:
        """Per reward: the mean and std of the cosines between batches (over the pairs where
        neither gradient is zero), and the noise share of the diagonal from the halves and from
        the pairs; per set: the conflict rates and worst cosines."""
        cosines = np.array(self.pair_cosines).reshape(-1, len(self.names))
        rewards = {}
        for k, name in enumerate(self.names):
            pairs = cosines[:, k][~np.isnan(cosines[:, k])]
            measured = len(pairs) > 0
            rewards[name] = {
                "pairs": len(pairs),
                "cosine_between_batches": float(pairs.mean()) if measured else None,
                "cosine_spread": float(pairs.std()) if measured else None,
                "noise_share_halves": float(1 - self.crossed[k] / self.squared[k])
                if self.squared[k]
                else None,
                "noise_share_batches": float(1 - self.pair_inner[k] / self.pair_squared[k])
                if measured
                else None,
            }
        sets = {
            name: {
                "conflict_rate": {kind: count / self.batches for kind, count in self.conflicts[name].items()},
                "worst_cosine": dict(self.worst[name]),
            }
            for name in self.sets
        }
        return {"batches": self.batches, "rewards": rewards, "sets": sets}


def _sum_report(halves: torch.Tensor, names: Sequence[str]) -> mogo.ConflictReport:
    """The conflict report of the plain sum of ``names``' gradients, from the ``(2K, 2K)`` Gram
    matrix of their halves."""
    K = len(names)
    ones = torch.ones(K, dtype=torch.float64)
    weights = mogo.Weights(ones / K, ones, torch.tensor(float(K), dtype=torch.float64))
    return mogo.ConflictReport.from_halves(halves, weights, tuple(names), ones)


def batch_halves(trainer: Trainer, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``(K, P)`` float64 per-reward gradients of the two halves of epoch ``epoch``'s batch at
    the trainer's adapter: each half's NFT losses (``trainer.strategy``, a ``gram: cross_fitted``
    strategy, splits the rows) summed over the trained timesteps of its own draw, and the batch's
    rows in a random order (so that each half is a random half)."""
    batch = trainer.score(trainer.sample(epoch))
    advantages = trainer.advantages(batch, epoch)[batch.local]
    generator = trainer.stream("noise", epoch)
    steps = len(batch.timesteps)
    count = max(1, int(trainer.config.train.timestep_fraction * steps))
    index = torch.randperm(len(batch.latents), generator=generator)
    chosen = torch.randperm(steps, generator=generator)[:count].sort().values.tolist()
    noise = torch.randn((len(chosen), *batch.latents.shape), generator=generator)
    params = trainer.params
    total = None
    for j, eps in zip(chosen, noise, strict=True):
        losses, _ = trainer.losses(batch, index, advantages[index], j, eps[index].to(batch.latents))
        grads, _ = mogo.objective_grads(losses.reshape(-1), params, mode="sequential")
        flat = torch.cat([g.reshape(len(g), -1) for g in grads], dim=1).double()
        total = flat if total is None else total + flat
    K = len(trainer.names)
    rows = total.cpu().numpy()
    return rows[:K], rows[K:]


def noise_config(rewards: Sequence[str], *, quick: bool = False, out: str = "runs/noise") -> Any:
    """The shapes recipe on ``rewards`` with the ``marble`` strategy's cross-fitted halves, no KL
    term (only the rewards' gradients are measured) and no evaluation; ``quick``: 4 prompts of 4
    images, one timestep."""
    from mogo_diffusion.compare import frozen_sections
    from mogo_diffusion.shapes.recipe import reward_specs, shapes_config

    frozen = frozen_sections()
    sampling: dict[str, Any] = {"eval_prompts": None}
    train: dict[str, Any] = {"out_dir": out}
    if quick:
        sampling.update(prompts_per_epoch=4, group_size=4)
        train.update(batch_size=16, timestep_fraction=0.1)
    return shapes_config(
        rewards=reward_specs(rewards),
        nft={**frozen["nft"], "kl_coef": 0.0},
        strategy={"name": "marble", "gram": "cross_fitted"},
        sampling=sampling,
        train=train,
    )


def measure(
    trainer: Trainer, batches: int, sets: Mapping[str, Sequence[str]] | None = None, first_epoch: int = 10_000
) -> dict[str, Any]:
    """:class:`NoiseMeter`'s summary over ``batches`` independent batches of ``trainer``'s config
    (epochs ``first_epoch`` on: draws that no training run of the same seed makes)."""
    meter = NoiseMeter(trainer.names, sets)
    for b in range(batches):
        meter.add(*batch_halves(trainer, first_epoch + b))
        print(f"batch {b + 1}/{batches}", flush=True)
    return meter.summary()


def write_table(results: dict[str, Any], out: Path) -> None:
    """``out.json`` (everything) and ``out.rst``: a row per reward, and a row per reward set of
    the conflict rates."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")

    def number(value: float | None, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    header = ["reward", "cosine between batches", "noise share (halves)", "noise share (batches)"]
    rows = [
        [
            reward,
            f"{number(values['cosine_between_batches'])} +- {number(values['cosine_spread'])}",
            number(values["noise_share_halves"]),
            number(values["noise_share_batches"]),
        ]
        for reward, values in results["rewards"].items()
    ]
    conflict_header = [
        "reward set",
        "conflict rate, one batch",
        "across halves",
        "worst cosine, one",
        "across",
    ]
    conflicts = [
        [
            name,
            number(summary["conflict_rate"]["same_batch"], 2),
            number(summary["conflict_rate"]["cross_batch"], 2),
            number(summary["worst_cosine"]["same_batch"]),
            number(summary["worst_cosine"]["cross_batch"]),
        ]
        for name, summary in results["sets"].items()
    ]
    text = rst_table([header, *rows], "Noise in one batch's gradients") + "\n\n"
    text += rst_table([conflict_header, *conflicts], "The weighted sum's conflicts") + "\n"
    out.with_suffix(".rst").write_text(text)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from mogo_diffusion.shapes.recipe import REWARDS
    from mogo_diffusion.study import REWARD_SETS

    parser = argparse.ArgumentParser(
        prog="python -m mogo_diffusion.noise", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--batches", type=int, default=16, help="independent batches (>= 2)")
    parser.add_argument("--quick", action="store_true", help="a smoke check: small batches, one timestep")
    parser.add_argument("--out", type=Path, default=None, help="the table's path without suffix")
    args = parser.parse_args(argv)
    if args.batches < 2:
        parser.error("--batches must be at least 2 (the cosines are between batches)")
    out = args.out or Path("runs/noise-quick/shapes_noise" if args.quick else "docs/_generated/shapes_noise")
    torch.set_num_threads(1)
    started = time.perf_counter()
    trainer = Trainer.from_config(noise_config(REWARDS, quick=args.quick, out="runs/noise"))
    results = measure(trainer, args.batches, REWARD_SETS)
    sampling, train = trainer.config.sampling, trainer.config.train
    results.update(
        images_per_batch=sampling.prompts_per_epoch * sampling.group_size,
        timesteps=max(1, int(train.timestep_fraction * sampling.num_steps)),
        seconds=round(time.perf_counter() - started),
        date=date.today().isoformat(),
        machine=f"{platform.machine()}, torch {torch.__version__}, 1 thread",
        command=" ".join(["python -m mogo_diffusion.noise", *(argv if argv is not None else sys.argv[1:])]),
    )
    write_table(results, out)
    print(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
