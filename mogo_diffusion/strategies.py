"""Training strategies: how the K rewards of a batch become advantages, losses and one update.

A strategy is chosen once, from the config's ``strategy`` record, by :func:`make_strategy`, and
the trainer then only calls it:

.. code-block:: text

    advantages(rewards [B, K], groups, epoch) -> [B, J]   one column per trained objective
    losses(terms, advantages [b, J])          -> [J]      the J NFT losses of one forward
    backward(losses [J], shared)                           accumulate .grad (losses already scaled)
    finish()                                               .grad final: harmonized, averaged

followed by the same update for every strategy (the trainer's: unscale, clip, ``scaler.step``).

=================  ===  ==============================================================
strategy           J    objectives and update
=================  ===  ==============================================================
``marble``         K    per-reward advantages, :class:`mogo.HarmonizedOptimizer` with
                        :class:`mogo.MinNorm` (MARBLE)
any weighting      K    the same, with the weighting registered under that name in
                        :data:`mogo.WEIGHTINGS` (``strategy.options`` are its arguments)
``weighted_sum``   1    one advantage of ``sum_k w_k R_k`` (DiffusionNFT's baseline), AdamW
``sequential``     1    one reward per stage, AdamW
``single``         1    one reward throughout (the specialist), AdamW
=================  ===  ==============================================================

The trainer's ``weighted_sum`` is DiffusionNFT's scalarisation *of the rewards* (one
advantage); mogo's ``weighted_sum`` weighting combines K per-reward *gradients* with fixed
weights, a different baseline, which this name does not reach.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

import mogo
from mogo.registry import closest
from mogo_diffusion.advantages import per_reward_advantages, weighted_sum_advantages, zscore_rewards
from mogo_diffusion.config import (
    Config,
    ConfigError,
    HarmonizedConfig,
    MarbleConfig,
    SequentialConfig,
    SingleConfig,
    WeightedSumConfig,
)
from mogo_diffusion.nft import NFTTerms, nft_coefficients, nft_losses

__all__ = [
    "Harmonized",
    "Marble",
    "Sequential",
    "Single",
    "Strategy",
    "WeightedSum",
    "make_strategy",
]


class Strategy:
    """The base: one NFT loss from one advantage column, AdamW, ``.grad`` averaged over processes.

    Args:
        config: the whole run's config (its ``strategy`` record is this strategy's).
        world: the number of processes (``> 1`` needs an initialised process group).
    """

    def __init__(self, config: Config, world: int = 1) -> None:
        self.config = config
        self.names = [spec.name for spec in config.rewards]
        self.world = world
        self.optimizer: torch.optim.Optimizer | None = None
        self.distributed: mogo.DataParallel | None = None

    def columns(self, epoch: int) -> list[int]:
        """The reward columns trained in ``epoch``."""
        return list(range(len(self.names)))

    def advantages(self, rewards: Tensor, groups: Sequence[Hashable], epoch: int) -> Tensor:
        """``[B, J]`` advantages of ``rewards [B, K]`` (NaN where an objective does not apply)."""
        (k,) = self.columns(epoch)
        return per_reward_advantages(rewards[:, k : k + 1], groups, **self._options([self.names[k]]))

    def _options(self, names: Sequence[str]) -> dict[str, Any]:
        nft = self.config.nft
        return {"std_scope": nft.std_scope, "adv_clip": nft.adv_clip, "names": names}

    def losses(self, terms: NFTTerms, advantages: Tensor) -> Tensor:
        """The ``[J]`` NFT losses of one forward's ``terms`` under ``advantages [b, J]``."""
        nft = self.config.nft
        coefficients = nft_coefficients(
            advantages, beta=nft.beta, adv_clip=nft.adv_clip, nonapplicable=nft.nonapplicable
        )
        return nft_losses(terms, coefficients)

    def build(self, params: Sequence[Tensor]) -> torch.optim.Optimizer:
        """Create the optimizer over ``params``; returns it (also ``self.optimizer``)."""
        train = self.config.train
        self.optimizer = torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay)
        self.distributed = mogo.DataParallel() if self.world > 1 else None
        return self.optimizer

    def traverses_twice(self) -> bool:
        """Whether the next :meth:`backward` goes through the losses' graph more than once (one
        gradient per objective): a compiled forward cannot serve it
        (:mod:`mogo_diffusion.compilation`)."""
        return False

    def backward(self, losses: Tensor, shared: Tensor | None) -> None:
        """Accumulate the gradient of ``sum(losses) + shared`` into ``.grad``."""
        total = losses.sum()
        (total if shared is None else total + shared).backward()

    def finish(self) -> None:
        """Make ``.grad`` final before it is unscaled and clipped: averaged over the processes."""
        if self.distributed is not None:
            self.distributed.finish([p for group in self.optimizer.param_groups for p in group["params"]])

    def metrics(self) -> dict[str, float]:
        """What the strategy reports after an epoch (flat floats)."""
        return {}


class WeightedSum(Strategy):
    """DiffusionNFT's baseline: one advantage of ``sum_k w_k R_k`` (raw or z-scored rewards)."""

    def advantages(self, rewards: Tensor, groups: Sequence[Hashable], epoch: int) -> Tensor:
        strategy = self.config.strategy
        weights = torch.tensor([spec.weight for spec in self.config.rewards], dtype=rewards.dtype)
        if strategy.reward_scale == "zscore":
            rewards = zscore_rewards(rewards, names=self.names)
        options = self._options(self.names)
        return weighted_sum_advantages(rewards, weights, groups, nan=strategy.nan, **options)[:, None]


class Sequential(Strategy):
    """One reward at a time: ``strategy.stages`` in order, cycling."""

    def columns(self, epoch: int) -> list[int]:
        stages = self.config.strategy.stages
        position = epoch % sum(stage.epochs for stage in stages)
        for stage in stages:
            if position < stage.epochs:
                return [self.names.index(stage.reward)]
            position -= stage.epochs
        raise AssertionError("unreachable: position < total epochs")


class Single(Strategy):
    """One reward throughout: the specialist."""

    def columns(self, epoch: int) -> list[int]:
        return [self.names.index(self.config.strategy.reward)]


class Marble(Strategy):
    """MARBLE: K per-reward losses into :class:`mogo.HarmonizedOptimizer` with :class:`mogo.MinNorm`."""

    def weighting(self) -> mogo.Weighting:
        return mogo.MinNorm()

    def advantages(self, rewards: Tensor, groups: Sequence[Hashable], epoch: int) -> Tensor:
        return per_reward_advantages(rewards, groups, **self._options(self.names))

    def build(self, params: Sequence[Tensor]) -> torch.optim.Optimizer:
        strategy, train = self.config.strategy, self.config.train
        self.optimizer = mogo.HarmonizedOptimizer(
            torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay),
            self.names,
            weighting=self.weighting(),
            harmonize_every=strategy.harmonize_every,
            alpha_ema=strategy.alpha_ema,
            grad_mode=strategy.grad_mode,
            nonfinite=strategy.nonfinite,
            accumulation=strategy.estimate,
            sum_weights=[1.0 if spec.weight is None else spec.weight for spec in self.config.rewards],
            distributed=mogo.DataParallel() if self.world > 1 else None,
        )
        return self.optimizer

    def traverses_twice(self) -> bool:
        return self.optimizer.solves_next

    def backward(self, losses: Tensor, shared: Tensor | None) -> None:
        self.optimizer.backward(losses, shared=shared)

    def finish(self) -> None:
        self.optimizer.harmonize()

    def metrics(self) -> dict[str, float]:
        optimizer = self.optimizer
        metrics = {f"alpha/{n}": float(a) for n, a in zip(self.names, optimizer.amortizer.alpha, strict=True)}
        meter = optimizer.meter  # over the run's harmonization steps so far
        metrics["conflict_rate"] = meter.conflict_rate
        metrics["worst_cosine_weighted_sum"] = meter.worst_weighted_sum_cosine
        metrics["worst_cosine_marble"] = meter.worst_harmonized_cosine
        return metrics


class Harmonized(Marble):
    """MARBLE's loop with the weighting registered as ``strategy.name`` in :data:`mogo.WEIGHTINGS`."""

    def weighting(self) -> mogo.Weighting:
        strategy = self.config.strategy
        return mogo.make_weighting(strategy.name, **strategy.options)


_CLASSES: dict[type, type[Strategy]] = {
    MarbleConfig: Marble,
    HarmonizedConfig: Harmonized,
    WeightedSumConfig: WeightedSum,
    SequentialConfig: Sequential,
    SingleConfig: Single,
}


def make_strategy(config: Config, world: int = 1) -> Strategy:
    """The strategy of ``config.strategy`` (the one place a strategy is chosen).

    Raises:
        ConfigError: ``strategy.name`` is neither one of the trainer's strategies nor a weighting
            registered in :data:`mogo.WEIGHTINGS`, or the weighting rejects ``strategy.options``.
    """
    strategy = _CLASSES[type(config.strategy)](config, world)
    if isinstance(strategy, Harmonized):
        name = config.strategy.name
        if name not in mogo.WEIGHTINGS:
            own = [record().name for record in _CLASSES if record is not HarmonizedConfig]
            known = [*own, *sorted(n for n in mogo.WEIGHTINGS if n not in own)]
            hint = closest(name, known)
            raise ConfigError(
                f"strategy.name: unknown strategy {name!r}{hint}; strategies: {', '.join(own)}, or a "
                f"weighting of mogo.WEIGHTINGS: {', '.join(known[len(own) :])}"
            )
        try:
            strategy.weighting()
        except (TypeError, ValueError) as error:
            raise ConfigError(f"strategy.options: {error}") from None
    return strategy
