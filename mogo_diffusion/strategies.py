"""Training strategies: how the K rewards of a batch become advantages, losses and one update.

A strategy is chosen once, from the config's ``strategy`` record, by :func:`make_strategy`, and
the trainer then only calls it:

.. code-block:: text

    advantages(rewards [B, K], groups, epoch) -> [B, J]   one column per trained objective
    losses(terms, advantages [b, J])          -> [J]      the J NFT losses of one forward
    backward(losses [J], shared)                           accumulate .grad (losses already scaled)
    finish()                                               .grad final: harmonized, averaged

followed by the same update for every strategy (the trainer's: unscale, clip, ``scaler.step``).

======================  ===  =========================================================
strategy                J    objectives and update
======================  ===  =========================================================
``marble``              K    per-reward advantages, :class:`mogo.HarmonizedOptimizer` with
                             :class:`mogo.MinNorm` (MARBLE)
any weighting           K    the same, with the weighting registered under that name in
                             :data:`mogo.WEIGHTINGS` (``strategy.options`` are its
                             arguments; one that takes ``weights``, e.g.
                             ``gated_projection``, gets ``rewards[*].weight`` unless the
                             options set them)
``marble_released``     K    MARBLE as the released code trains it, micro-step by
                             micro-step (:mod:`mogo_diffusion.released_marble`), AdamW
``weighted_sum``        1    one advantage of ``sum_k w_k R_k`` (DiffusionNFT's
                             baseline), AdamW
``normalize_then_sum``  1    one advantage, the weighted sum of per-reward normalised
                             rewards (GDPO, TRL's), AdamW
``famo``                1    the weighted sum, its weights moved by the rewards'
                             improvement rates (:mod:`mogo_diffusion.reward_rates`), AdamW
``sequential``          1    one reward per stage, AdamW
``single``              1    one reward throughout (the specialist), AdamW
======================  ===  =========================================================

The harmonized strategies take the optimizer's noise-aware options from their record
(``gram: cross_fitted``: :meth:`Marble.losses` splits each micro-batch's rows into two halves and
returns their ``(2, K)`` losses; ``grad_ema``; ``smooth_harmonized``). A strategy with state of
its own (``famo``'s weights, ``marble_released``'s schedule) keeps it in the optimizer's
``state_dict`` under ``"strategy"``, so that a checkpoint resumes it.

The trainer's ``weighted_sum`` is DiffusionNFT's scalarisation *of the rewards* (one
advantage); mogo's ``weighted_sum`` weighting combines K per-reward *gradients* with fixed
weights, a different baseline, which this name does not reach.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

import mogo
from mogo.registry import closest
from mogo_diffusion.advantages import (
    nan_mean,
    normalize_then_sum,
    per_reward_advantages,
    weighted_sum_advantages,
    zscore_rewards,
)
from mogo_diffusion.config import (
    Config,
    ConfigError,
    FamoConfig,
    HarmonizedConfig,
    MarbleConfig,
    MarbleReleasedConfig,
    NormalizeThenSumConfig,
    SequentialConfig,
    SingleConfig,
    WeightedSumConfig,
)
from mogo_diffusion.nft import NFTTerms, nft_coefficients, nft_losses
from mogo_diffusion.released_marble import ReleasedSchedule, combined_advantage, released_direction
from mogo_diffusion.reward_rates import ImprovementWeights

__all__ = [
    "STATE_KEY",
    "Famo",
    "Harmonized",
    "Marble",
    "MarbleReleased",
    "NormalizeThenSum",
    "Sequential",
    "Single",
    "Strategy",
    "WeightedSum",
    "make_strategy",
]

STATE_KEY = "strategy"
"""The entry of the optimizer's ``state_dict`` that holds a strategy's own state."""


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
        self.keep_state_in(self.optimizer)
        return self.optimizer

    def traverses_twice(self) -> bool:
        """Whether the next :meth:`backward` goes through the losses' graph more than once (one
        gradient per objective): a compiled forward cannot serve it
        (:mod:`mogo_diffusion.compilation`)."""
        return False

    def state_dict(self) -> dict[str, Any] | None:
        """The strategy's own state for a checkpoint (plain data), or None: it has none."""
        return None

    def load_state_dict(self, state: Any) -> None:
        """Restore a :meth:`state_dict`; ``ValueError`` naming what is wrong, before anything changes."""

    def keep_state_in(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep this strategy's state in ``optimizer``'s ``state_dict`` under :data:`STATE_KEY`
        (through its public state-dict hooks), so that the trainer's checkpoints resume it; a
        state without it raises ``ValueError`` on load. Nothing for a strategy without state."""
        if self.state_dict() is None:
            return
        name = self.config.strategy.name

        def save(_: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
            return {**state, STATE_KEY: self.state_dict()}

        def load(_: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
            if STATE_KEY not in state:
                raise ValueError(f"the optimizer state holds no {STATE_KEY!r} entry of the {name} strategy")
            self.load_state_dict(state[STATE_KEY])
            return {key: value for key, value in state.items() if key != STATE_KEY}

        optimizer.register_state_dict_post_hook(save)
        optimizer.register_load_state_dict_pre_hook(load)

    def params(self) -> list[Tensor]:
        """The trained parameters, as the optimizer holds them."""
        return [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]

    def backward(self, losses: Tensor, shared: Tensor | None) -> None:
        """Accumulate the gradient of ``sum(losses) + shared`` into ``.grad``."""
        total = losses.sum()
        (total if shared is None else total + shared).backward()

    def finish(self) -> None:
        """Make ``.grad`` final before it is unscaled and clipped: averaged over the processes."""
        if self.distributed is not None:
            self.distributed.finish(self.params())

    def metrics(self) -> dict[str, float]:
        """What the strategy reports after an epoch (flat floats)."""
        return {}


class WeightedSum(Strategy):
    """DiffusionNFT's baseline: one advantage of ``sum_k w_k R_k`` (raw or z-scored rewards)."""

    def weights(self) -> list[float]:
        """The K weights ``w_k`` of this epoch's sum."""
        return [spec.weight for spec in self.config.rewards]

    def advantages(self, rewards: Tensor, groups: Sequence[Hashable], epoch: int) -> Tensor:
        strategy = self.config.strategy
        weights = torch.tensor(self.weights(), dtype=rewards.dtype)
        if strategy.reward_scale == "zscore":
            rewards = zscore_rewards(rewards, names=self.names)
        options = self._options(self.names)
        return weighted_sum_advantages(rewards, weights, groups, nan=strategy.nan, **options)[:, None]


class NormalizeThenSum(Strategy):
    """GDPO / TRL's ``normalize_then_sum``: one advantage, each reward normalised within its group
    first, weighted by ``rewards[*].weight`` (1 each without), summed and re-normalised
    (:func:`mogo_diffusion.advantages.normalize_then_sum`)."""

    def advantages(self, rewards: Tensor, groups: Sequence[Hashable], epoch: int) -> Tensor:
        strategy, nft = self.config.strategy, self.config.nft
        weights = [1.0 if spec.weight is None else spec.weight for spec in self.config.rewards]
        advantages = normalize_then_sum(
            rewards,
            weights,
            groups,
            std_scope=strategy.std_scope,
            ddof=int(strategy.bessel),
            batch_norm=strategy.batch_norm,
            rescale_masked=strategy.rescale_masked,
            adv_clip=nft.adv_clip,
            names=self.names,
        )
        return advantages[:, None]


class Famo(WeightedSum):
    """The weighted sum with weights moved by the rewards' improvement rates, FAMO-style (Liu et
    al. 2023): each epoch's per-reward batch means and stds go to
    :class:`mogo_diffusion.reward_rates.ImprovementWeights`, whose weights (from
    ``rewards[*].weight``, equal without) then weigh that epoch's sum."""

    def __init__(self, config: Config, world: int = 1) -> None:
        super().__init__(config, world)
        prior = [1.0 if spec.weight is None else spec.weight for spec in config.rewards]
        if not all(w > 0 for w in prior):
            i = next(i for i, w in enumerate(prior) if not w > 0)
            raise ConfigError(f"rewards.{i}.weight: the famo strategy's weights start there and must be > 0")
        strategy = config.strategy
        self.rates = ImprovementWeights(prior, window=strategy.window, lr=strategy.lr)

    def weights(self) -> list[float]:
        return self.rates.weights.tolist()

    def advantages(self, rewards: Tensor, groups: Sequence[Hashable], epoch: int) -> Tensor:
        valid = ~torch.isnan(rewards)
        means = nan_mean(rewards.double())
        deviation = torch.where(valid, rewards.double() - means, 0.0)
        stds = (deviation.square().sum(0) / valid.sum(0).clamp_min(1)).sqrt()
        self.rates.observe(epoch, means, torch.where(valid.any(0), stds, math.nan))
        return super().advantages(rewards, groups, epoch)

    def metrics(self) -> dict[str, float]:
        return {f"weight/{name}": w for name, w in zip(self.names, self.weights(), strict=True)}

    def state_dict(self) -> dict[str, Any]:
        return self.rates.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.rates.load_state_dict(state)


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

    def losses(self, terms: NFTTerms, advantages: Tensor) -> Tensor:
        """The ``[K]`` per-reward NFT losses; with ``gram: cross_fitted`` the ``(2, K)`` losses of
        the micro-batch's two halves of rows (the first ``b // 2`` rows and the rest; the trainer
        draws a micro-batch's rows at random), each a mean over its own rows."""
        if self.config.strategy.gram == "same_batch":
            return super().losses(terms, advantages)
        b = len(advantages)
        if b < 2:
            raise ValueError(
                f"gram 'cross_fitted' splits a micro-batch into two halves; this one has {b} row"
            )
        halves = (slice(0, b // 2), slice(b // 2, b))
        one = super().losses
        return torch.stack([one(NFTTerms(*(t[rows] for t in terms)), advantages[rows]) for rows in halves])

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
            sum_weights=self.reward_weights(),
            distributed=mogo.DataParallel() if self.world > 1 else None,
            gram=strategy.gram,
            smooth_harmonized=strategy.smooth_harmonized,
            grad_ema=strategy.grad_ema,
        )
        return self.optimizer

    def traverses_twice(self) -> bool:
        return self.optimizer.solves_next

    def reward_weights(self) -> list[float]:
        """``rewards[*].weight`` (1 each without): the weighted sum the diagnostics compare with."""
        return [1.0 if spec.weight is None else spec.weight for spec in self.config.rewards]

    def backward(self, losses: Tensor, shared: Tensor | None) -> None:
        self.optimizer.backward(losses, shared=shared)

    def finish(self) -> None:
        self.optimizer.harmonize()

    def metrics(self) -> dict[str, float]:
        """alpha (once known), and the conflict statistics over the run's harmonizations so far: of the
        micro-batch's own gradients, and (``gram: cross_fitted``) across its two halves
        (``_cross``: the weighted sum of one half against each reward's gradient of the other,
        free of the bias of a gradient's own noise; :class:`mogo.ConflictReport`)."""
        optimizer = self.optimizer
        alpha = optimizer.amortizer.alpha  # None until a harmonization found a direction
        metrics = (
            {} if alpha is None else {f"alpha/{n}": float(a) for n, a in zip(self.names, alpha, strict=True)}
        )
        meter = optimizer.meter
        metrics["conflict_rate"] = meter.conflict_rate
        metrics["worst_cosine_weighted_sum"] = meter.worst_weighted_sum_cosine
        metrics["worst_cosine_marble"] = meter.worst_harmonized_cosine
        if self.config.strategy.gram == "cross_fitted":
            metrics["conflict_rate_cross"] = meter.cross_batch_conflict_rate
            metrics["worst_cosine_weighted_sum_cross"] = meter.worst_cross_batch_weighted_sum_cosine
            metrics["worst_cosine_marble_cross"] = meter.worst_cross_batch_harmonized_cosine
        return metrics


class Harmonized(Marble):
    """MARBLE's loop with the weighting registered as ``strategy.name`` in :data:`mogo.WEIGHTINGS`;
    a weighting whose factory takes ``weights`` (``gated_projection``) gets ``rewards[*].weight``
    unless ``strategy.options`` sets them."""

    def weighting(self) -> mogo.Weighting:
        strategy = self.config.strategy
        options = dict(strategy.options)
        factory = mogo.WEIGHTINGS.factory(strategy.name)
        if "weights" in inspect.signature(factory).parameters and "weights" not in options:
            options["weights"] = self.reward_weights()
        return mogo.make_weighting(strategy.name, **options)


class MarbleReleased(Strategy):
    """MARBLE as the released code trains (:mod:`mogo_diffusion.released_marble`), AdamW.

    Each trainer ``backward`` is one of the release's micro-steps: :meth:`losses` asks the
    schedule whether it solves and returns the K per-reward losses (masked means) for a solve,
    or the one loss of the combined advantage for an amortized micro-step; :meth:`backward`
    then solves (K gradients, the QP, the mean-norm direction plus the KL gradient into
    ``.grad``, the cached alpha blended) or backpropagates. :meth:`finish` counts the step.
    """

    def __init__(self, config: Config, world: int = 1) -> None:
        super().__init__(config, world)
        strategy, nft = config.strategy, config.nft
        for field, value, released in (
            ("nft.std_scope", nft.std_scope, "batch"),
            ("nft.nonapplicable", nft.nonapplicable, "exclude"),
        ):
            if value != released:
                raise ConfigError(
                    f"{field}: the marble_released strategy normalises and masks as the release does "
                    f"({released!r}), got {value!r}"
                )
        K = len(self.names)
        fixed = (
            strategy.alpha
            if isinstance(strategy.alpha, list)
            else {"solved": None, "equal": [1.0 / K] * K}[strategy.alpha]
        )
        try:
            self.schedule = ReleasedSchedule(
                K,
                every=strategy.harmonize_every,
                warmup=strategy.warmup_steps,
                ema=strategy.alpha_ema,
                fixed=fixed,
            )
        except ValueError as error:
            raise ConfigError(f"strategy.alpha: {error}") from None
        self._solving = False

    def advantages(self, rewards: Tensor, groups: Sequence[Hashable], epoch: int) -> Tensor:
        """Per-reward advantages with the batch's std and no clipping (the loss clips)."""
        return per_reward_advantages(rewards, groups, std_scope="batch", adv_clip=math.inf, names=self.names)

    def traverses_twice(self) -> bool:
        """A solving micro-step takes K gradients through one graph."""
        return self.schedule.solving()

    def losses(self, terms: NFTTerms, advantages: Tensor) -> Tensor:
        """``[K]`` masked per-reward losses when this micro-step solves, else ``[1]``: the NFT loss
        of :func:`~mogo_diffusion.released_marble.combined_advantage` over every row."""
        nft = self.config.nft
        self._solving = self.schedule.solving()
        if not self._solving:
            advantages = combined_advantage(advantages, self.schedule.cached)[:, None]
        coefficients = nft_coefficients(
            advantages, beta=nft.beta, adv_clip=nft.adv_clip, nonapplicable="exclude"
        )
        return nft_losses(terms, coefficients)

    def backward(self, losses: Tensor, shared: Tensor | None) -> None:
        if not self._solving:
            return super().backward(losses, shared)
        params = self.params()
        rows = []
        for loss in losses:  # one backward per reward, as released
            grads = torch.autograd.grad(loss, params, retain_graph=True, materialize_grads=True)
            rows.append(torch.cat([g.reshape(-1) for g in grads]))
        stacked = torch.stack(rows)
        if self.world > 1:  # the mean over the processes of each reward's gradient, as released
            torch.distributed.all_reduce(stacked)
            stacked /= self.world
        if shared is not None:
            shared.backward()  # the KL gradient, unweighted
        alpha, direction = released_direction(stacked, self.config.strategy.solver)
        with torch.no_grad():
            for p, chunk in zip(params, direction.split([p.numel() for p in params]), strict=True):
                chunk = chunk.view_as(p)
                if p.grad is None:
                    p.grad = chunk.clone()
                else:
                    p.grad.add_(chunk)
        self.schedule.blend(alpha)

    def finish(self) -> None:
        super().finish()
        self.schedule.step += 1

    def metrics(self) -> dict[str, float]:
        """The cached alpha (``alpha/{name}``) and the solves so far."""
        cached = self.schedule.cached
        metrics = (
            {}
            if cached is None
            else {f"alpha/{n}": float(a) for n, a in zip(self.names, cached, strict=True)}
        )
        return {**metrics, "solves": float(self.schedule.solves)}

    def state_dict(self) -> dict[str, Any]:
        return self.schedule.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.schedule.load_state_dict(state)


_CLASSES: dict[type, type[Strategy]] = {
    MarbleConfig: Marble,
    HarmonizedConfig: Harmonized,
    WeightedSumConfig: WeightedSum,
    SequentialConfig: Sequential,
    SingleConfig: Single,
    NormalizeThenSumConfig: NormalizeThenSum,
    MarbleReleasedConfig: MarbleReleased,
    FamoConfig: Famo,
}


def make_strategy(config: Config, world: int = 1) -> Strategy:
    """The strategy of ``config.strategy`` (the one place a strategy is chosen).

    Raises:
        ConfigError: ``strategy.name`` is neither one of the trainer's strategies nor a weighting
            registered in :data:`mogo.WEIGHTINGS`, or the weighting rejects ``strategy.options``.
    """
    strategy = _CLASSES[type(config.strategy)](config, world)
    if isinstance(config.strategy, MarbleConfig) and config.strategy.gram == "cross_fitted":
        _check_halves(config, world)
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


def _check_halves(config: Config, world: int) -> None:
    """Every micro-batch of an epoch has two rows at least, for ``gram: cross_fitted`` to split."""
    local = config.sampling.prompts_per_epoch * config.sampling.group_size // world
    size = config.train.batch_size
    smallest = min(size, local % size or size)
    if smallest < 2:
        raise ConfigError(
            f"strategy.gram: 'cross_fitted' splits each micro-batch into two halves, and with "
            f"train.batch_size={size} and {local} images a process per epoch one has {smallest} row"
        )
