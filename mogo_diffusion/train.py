"""Multi-reward DiffusionNFT fine-tuning: ``python -m mogo_diffusion.train``.

One epoch: sample ``group_size`` images for each of ``prompts_per_epoch`` prompts with the old
adapter (CFG-free), score every reward, compute advantages, then for each training batch take one
optimizer step that accumulates one ``backward`` per trained timestep of the sampler's grid; after
the epoch the old adapter follows the trained one by EMA, and an evaluation EMA is kept apart.
Strategies share the loop:

* ``marble``: the K per-reward NFT losses into :class:`mogo.HarmonizedOptimizer` (MinNorm);
* ``weighted_sum``: one NFT loss from the advantage of ``sum_k w_k R_k`` (DiffusionNFT's);
* ``sequential``: one reward at a time, by the configured stages;
* ``single``: one reward throughout (the specialist).

Every random draw of an epoch comes from a generator seeded by ``(seed, epoch)``, so a run resumed
from a checkpoint continues exactly as the uninterrupted run does.

Every ``train.eval_every`` epochs (and after the last) the evaluation EMA samples
``sampling.eval_prompts`` with fixed noise, the same in every run, and the rewards' means are
logged as ``eval/{name}``. The run directory gets ``config.yaml``, ``metrics.jsonl``,
``checkpoints/``, and at the end ``samples.png`` (the last evaluation's images) and ``curves.png``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.tracking import get_available_trackers
from accelerate.utils import LoggerType
from tqdm.auto import tqdm

import mogo
from mogo_diffusion import models
from mogo_diffusion.advantages import per_reward_advantages, weighted_sum_advantages, zscore_rewards
from mogo_diffusion.checkpoint import (
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from mogo_diffusion.config import Config, ConfigError, add_config_arguments, config_from_args
from mogo_diffusion.evaluate import nan_mean, plot_run, save_grid
from mogo_diffusion.nft import kl_loss, nft_coefficients, nft_loss, nft_losses, nft_terms
from mogo_diffusion.prompts import PromptSet, load_prompt_set
from mogo_diffusion.rewards import MultiReward, make_reward
from mogo_diffusion.sampling import Samples, decode, sample

__all__ = ["DEFAULT_PROMPTS", "EVAL_SEED", "Batch", "Trainer", "main"]

DEFAULT_PROMPTS = tuple(
    f"a {color} {shape} on a {background} background"
    for color in ("red", "green", "blue", "yellow")
    for shape in ("circle", "square", "triangle")
    for background in ("white", "black")
)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
EVAL_SEED = 20_240_601
"""The seed of the evaluation noise, the same for every run and seed, so that runs compare sample
by sample."""


@dataclass
class Batch:
    """One epoch's samples. ``prompts``, their ``metadata`` and ``rewards [B, K]`` cover all
    processes' samples; this process's share is rows ``local`` of them, and
    ``latents [b, C, h, w]`` and the embeddings hold only those."""

    prompts: list[str]
    metadata: list[dict[str, Any]]
    rewards: torch.Tensor
    local: slice
    embeds: torch.Tensor
    pooled: torch.Tensor
    latents: torch.Tensor
    sigmas: torch.Tensor
    timesteps: torch.Tensor


def _trackers(names: Sequence[str]) -> list[str]:
    """Validate accelerate tracker names: known, and their package installed."""
    known = [str(kind) for kind in LoggerType if kind != LoggerType.ALL]
    available = {str(kind) for kind in get_available_trackers()}
    for name in names:
        if name not in known:
            raise ConfigError(f"train.log_with: unknown tracker {name!r}; known: {', '.join(known)}")
        if name not in available:
            raise ConfigError(f"train.log_with: tracker {name!r} needs its package: pip install {name}")
    return list(names)


def _hyperparameters(config: Config) -> dict[str, Any]:
    """The config as flat ``section.key`` scalars (what trackers accept as hyper-parameters)."""
    flat: dict[str, Any] = {}
    for section, values in config.to_dict().items():
        items = values.items() if isinstance(values, dict) else [(str(i), v) for i, v in enumerate(values)]
        for key, value in items:
            scalar = value if isinstance(value, int | float | str | bool) else json.dumps(value)
            flat[f"{section}.{key}"] = scalar
    return flat


class Trainer:
    """The training loop of one run; ``Trainer(config).train()`` runs it to ``train.epochs``."""

    def __init__(self, config: Config, accelerator: Accelerator | None = None) -> None:
        if not config.rewards:
            raise ConfigError("rewards: configure at least one reward")
        self.config = config
        self.out = Path(config.train.out_dir)
        self.accelerator = accelerator or Accelerator(
            mixed_precision=config.train.mixed_precision,
            log_with=_trackers(config.train.log_with) or None,
            project_dir=self.out / "trackers",
        )
        dtype = DTYPES[config.model.dtype]
        self.pipeline = models.load_pipeline(
            config.model.pretrained,
            revision=config.model.revision,
            variant=config.model.variant,
            torch_dtype=dtype,
        )
        self.pipeline.to(self.accelerator.device)
        self.world = self.accelerator.num_processes
        if config.sampling.prompts_per_epoch % self.world:
            raise ConfigError(
                f"sampling.prompts_per_epoch: {config.sampling.prompts_per_epoch} prompts do not split "
                f"evenly over {self.world} processes"
            )
        self.transformer = self.pipeline.transformer
        with torch.random.fork_rng(devices=[]):  # the adapter's Gaussian init, from the run's seed
            torch.manual_seed(config.train.seed)
            models.add_lora(
                self.transformer,
                config.model.lora_rank,
                config.model.lora_alpha,
                targets=config.model.lora_targets,
            )
        self.params = models.lora_parameters(self.transformer)
        for p in self.params:  # trained in float32 whatever the frozen weights' dtype
            p.data = p.data.float()
        self.eval_ema = [p.detach().clone() for p in self.params]
        self.names = [spec.name for spec in config.rewards]
        self.rewards = MultiReward(
            [make_reward(spec.name, **spec.options) for spec in config.rewards],
            threads=config.train.reward_threads,
        ).to(self.accelerator.device)
        self.prompts = self._load_prompts(config.sampling.prompts, "sampling.prompts")
        self.eval_prompts = (
            None
            if config.sampling.eval_prompts is None
            else self._load_prompts(config.sampling.eval_prompts, "sampling.eval_prompts")
        )
        self.eval_images: torch.Tensor | None = None
        self.optimizer = self._make_optimizer()
        self.epoch = 0
        self.metrics_path = self.out / "metrics.jsonl"

    @staticmethod
    def _load_prompts(source: str | None, field: str) -> PromptSet:
        if source is None:
            return PromptSet(list(DEFAULT_PROMPTS), [{} for _ in DEFAULT_PROMPTS])
        try:
            return load_prompt_set(source)
        except (OSError, ValueError) as error:
            raise ConfigError(f"{field}: {error}") from None

    def _make_optimizer(self) -> torch.optim.Optimizer:
        train, strategy = self.config.train, self.config.strategy
        inner = torch.optim.AdamW(self.params, lr=train.lr, weight_decay=train.weight_decay)
        if strategy.name != "marble":
            return inner
        return mogo.HarmonizedOptimizer(
            inner,
            self.names,
            harmonize_every=strategy.harmonize_every,
            alpha_ema=strategy.alpha_ema,
            grad_mode=strategy.grad_mode,
            nonfinite=strategy.nonfinite,
            accumulation=strategy.estimate,
            sum_weights=[spec.weight if spec.weight is not None else 1.0 for spec in self.config.rewards],
            distributed=mogo.DataParallel() if self.world > 1 else None,
        )

    # ---- one epoch ----------------------------------------------------------------------------

    def _generator(self, epoch: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.config.train.seed * 1_000_003 + epoch)

    def collect(self, epoch: int) -> Batch:
        """Sample the epoch's images with the old adapter and score them.

        Every process draws the same prompts and noise; each samples and scores its own whole
        groups (rows ``local``), and the scores are gathered, so advantages see the whole batch.
        """
        sampling = self.config.sampling
        generator = self._generator(epoch)
        chosen = torch.randint(len(self.prompts.prompts), (sampling.prompts_per_epoch,), generator=generator)
        rows = [i for i in chosen.tolist() for _ in range(sampling.group_size)]
        prompts = [self.prompts.prompts[i] for i in rows]
        metadata = [self.prompts.metadata[i] for i in rows]
        share = len(prompts) // self.world
        local = slice(self.accelerator.process_index * share, (self.accelerator.process_index + 1) * share)
        config = self.transformer.config
        shape = (len(prompts), config.in_channels, config.sample_size, config.sample_size)
        noise = torch.randn(shape, generator=generator)[local]
        embeds, pooled = models.encode_prompts(
            self.pipeline, prompts[local], self.config.model.max_sequence_length
        )
        with models.adapter(self.transformer, models.OLD):
            samples, images = self._sample(embeds, pooled, noise, sampling.num_steps)
        scores = self.rewards(images, prompts[local], metadata[local]).values.to(self.accelerator.device)
        if self.world > 1:
            scores = self.accelerator.gather(scores.contiguous())
        return Batch(
            prompts,
            metadata,
            scores,
            local,
            embeds,
            pooled,
            samples.latents,
            samples.sigmas,
            samples.timesteps,
        )

    def _sample(
        self, embeds: torch.Tensor, pooled: torch.Tensor, noise: torch.Tensor, num_steps: int
    ) -> tuple[Samples, torch.Tensor]:
        """Sample ``noise`` in batches of ``sampling.batch_size`` with the selected adapter;
        returns the samples (all latents, the grid) and the decoded images ``[B, 3, H, W]``."""
        sampling = self.config.sampling
        latents, images = [], []
        for start in range(0, len(noise), sampling.batch_size):
            part = slice(start, start + sampling.batch_size)
            samples = sample(
                self.transformer, self.pipeline.scheduler, embeds[part], pooled[part], num_steps,
                latents=noise[part], solver=sampling.solver,
            )  # fmt: skip
            latents.append(samples.latents)
            with torch.no_grad():
                images.append(decode(self.pipeline.vae, samples.latents))
        return replace(samples, latents=torch.cat(latents)), torch.cat(images)

    def evaluate(self) -> dict[str, float]:
        """The evaluation EMA's mean rewards on ``sampling.eval_prompts`` (``eval/{name}``), from
        noise seeded by :data:`EVAL_SEED`; keeps the images in ``eval_images``. On the main process
        only (the others return ``{}``); empty without eval prompts."""
        if self.eval_prompts is None or not self.accelerator.is_main_process:
            return {}
        prompts, metadata = self.eval_prompts
        config = self.transformer.config
        shape = (len(prompts), config.in_channels, config.sample_size, config.sample_size)
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(EVAL_SEED)).to(
            self.accelerator.device
        )
        embeds, pooled = models.encode_prompts(self.pipeline, prompts, self.config.model.max_sequence_length)
        trained = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, ema in zip(self.params, self.eval_ema, strict=True):
                p.copy_(ema)
        try:
            with models.adapter(self.transformer, models.TRAINED):
                _, images = self._sample(embeds, pooled, noise, self.config.sampling.eval_num_steps)
        finally:
            with torch.no_grad():
                for p, value in zip(self.params, trained, strict=True):
                    p.copy_(value)
        self.eval_images = images
        means = nan_mean(self.rewards(images, prompts, metadata).values)
        return {f"eval/{name}": float(m) for name, m in zip(self.names, means, strict=True)}

    def active_rewards(self, epoch: int) -> list[int]:
        """The rewards the strategy trains on in ``epoch`` (all of them but for sequential/single)."""
        strategy = self.config.strategy
        if strategy.name == "single":
            return [self.names.index(strategy.reward)]
        if strategy.name == "sequential":
            total = sum(stage.epochs for stage in strategy.stages)
            position = epoch % total
            for stage in strategy.stages:
                if position < stage.epochs:
                    return [self.names.index(stage.reward)]
                position -= stage.epochs
        return list(range(len(self.names)))

    def advantages(self, batch: Batch, epoch: int) -> torch.Tensor:
        """``[B, K]`` per-reward advantages for marble, else ``[B, 1]`` of the trained scalar."""
        nft, strategy = self.config.nft, self.config.strategy
        groups = batch.prompts
        options = {"std_scope": nft.std_scope, "adv_clip": nft.adv_clip, "names": self.names}
        if strategy.name == "marble":
            return per_reward_advantages(batch.rewards, groups, **options)
        if strategy.name == "weighted_sum":
            weights = torch.tensor([spec.weight for spec in self.config.rewards], dtype=batch.rewards.dtype)
            rewards = batch.rewards
            if strategy.reward_scale == "zscore":
                rewards = zscore_rewards(rewards, names=self.names)
            return weighted_sum_advantages(rewards, weights, groups, nan=nft.weighted_sum_nan, **options)[
                :, None
            ]
        (k,) = self.active_rewards(epoch)
        return per_reward_advantages(
            batch.rewards[:, k : k + 1], groups, **{**options, "names": [self.names[k]]}
        )

    def train_epoch(self, epoch: int) -> dict[str, Any]:
        """Collect, then one optimizer step per training batch; returns the epoch's metrics."""
        start = time.perf_counter()
        batch = self.collect(epoch)
        sampled = time.perf_counter()
        advantages = self.advantages(batch, epoch)[batch.local]
        train = self.config.train
        generator = self._generator(epoch)
        generator.manual_seed(generator.initial_seed() + 1)  # a stream apart from the sampling draws
        steps = len(batch.timesteps)
        count = max(1, int(train.timestep_fraction * steps))
        order = torch.randperm(len(batch.latents), generator=generator)
        kls = []
        for begin in range(0, len(order), train.batch_size):
            index = order[begin : begin + train.batch_size]
            chosen = torch.randperm(steps, generator=generator)[:count].sort().values
            noise = torch.randn((len(chosen), *batch.latents[index].shape), generator=generator)
            self.optimizer.zero_grad()
            for j, eps in zip(chosen.tolist(), noise, strict=True):
                kls.append(self._backward(batch, index, advantages[index], j, eps.to(batch.latents)))
            if isinstance(self.optimizer, mogo.HarmonizedOptimizer):
                self.optimizer.harmonize()  # .grad final (and averaged over processes) before clipping
            elif self.world > 1:
                self._average_gradients()
            if train.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(self.params, train.grad_clip)
            self.optimizer.step()
        decay = min(train.old_decay_rate * epoch, train.old_decay_max)
        models.ema_update(self.transformer, decay)
        with torch.no_grad():
            for ema, p in zip(self.eval_ema, self.params, strict=True):
                ema.lerp_(p.detach(), 1 - train.eval_ema_decay)
        seconds = time.perf_counter() - start
        return self._metrics(epoch, batch, kls, seconds, sampled - start)

    def _average_gradients(self) -> None:
        """Average ``.grad`` over the processes, in one all-reduce."""
        grads = [p.grad for p in self.params if p.grad is not None]
        averaged = self.accelerator.reduce(torch.cat([g.reshape(-1) for g in grads]), reduction="mean")
        for grad, part in zip(grads, averaged.split([g.numel() for g in grads]), strict=True):
            grad.copy_(part.view_as(grad))

    def _backward(
        self, batch: Batch, index: torch.Tensor, advantages: torch.Tensor, j: int, eps: torch.Tensor
    ) -> float:
        """One trained timestep ``t = sigma_j`` of one training batch: forward(s) and backward."""
        nft = self.config.nft
        x0 = batch.latents[index]  # index: rows of this process's share
        t = float(batch.sigmas[j])
        x_t = (1 - t) * x0 + t * eps
        inputs = {
            "hidden_states": x_t.to(self.transformer.dtype),
            "timestep": batch.timesteps[j].expand(len(index)).to(x_t.device),
            "encoder_hidden_states": batch.embeds[index].to(self.transformer.dtype),
            "pooled_projections": batch.pooled[index].to(self.transformer.dtype),
            "return_dict": False,
        }
        with torch.no_grad():
            with models.adapter(self.transformer, models.OLD):
                v_old = self.transformer(**inputs)[0]
            v_ref = None
            if nft.kl_coef > 0:
                with models.reference(self.transformer):
                    v_ref = self.transformer(**inputs)[0]
        with self.accelerator.autocast():
            v = self.transformer(**inputs)[0]
        kl = kl_loss(v, v_ref, kl_coef=nft.kl_coef) if v_ref is not None else None
        if isinstance(self.optimizer, mogo.HarmonizedOptimizer):
            terms = nft_terms(v, v_old, x_t, x0, t, beta=nft.beta)
            losses = nft_losses(terms, nft_coefficients(advantages, beta=nft.beta, adv_clip=nft.adv_clip))
            self.optimizer.backward(losses, shared=kl)
        else:
            loss = nft_loss(v, v_old, x_t, x0, t, advantages[:, 0], beta=nft.beta, adv_clip=nft.adv_clip)
            self.accelerator.backward(loss if kl is None else loss + kl)
        return 0.0 if kl is None else float(kl.detach())

    def _metrics(
        self, epoch: int, batch: Batch, kls: Sequence[float], seconds: float, sampling_s: float
    ) -> dict:
        rewards = batch.rewards
        metrics: dict[str, Any] = {"epoch": epoch, "seconds": seconds, "sampling_seconds": sampling_s}
        metrics["images_per_second"] = len(batch.prompts) / seconds
        metrics["kl"] = sum(kls) / max(1, len(kls))
        for k, name in enumerate(self.names):
            column = rewards[:, k]
            applicable = column[~torch.isnan(column)]
            metrics[f"reward/{name}"] = float(applicable.mean()) if len(applicable) else math.nan
        if isinstance(self.optimizer, mogo.HarmonizedOptimizer):
            metrics.update(
                {
                    f"alpha/{n}": float(a)
                    for n, a in zip(self.names, self.optimizer.amortizer.alpha, strict=True)
                }
            )
            meter = self.optimizer.meter  # over the run's harmonization steps so far
            metrics["conflict_rate"] = meter.conflict_rate
            metrics["worst_cosine_weighted_sum"] = meter.worst_weighted_sum_cosine
            metrics["worst_cosine_marble"] = meter.worst_harmonized_cosine
        return metrics

    # ---- checkpoints ---------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Everything a resumed run needs: adapters, evaluation EMA, optimizer, epoch, config."""
        return {
            "epoch": self.epoch,
            "trained": [p.detach() for p in self.params],
            "old": [p.detach() for p in models.lora_parameters(self.transformer, models.OLD)],
            "eval_ema": self.eval_ema,
            "optimizer": self.optimizer.state_dict(),
            "config": self.config.to_dict(),
        }

    def save(self) -> Path:
        """Write a checkpoint, its diffusers-format ``lora/`` export included in the same atomic
        rename (on the main process; every process has the same state), and return its path."""
        path = checkpoint_path(self.out / "checkpoints", self.epoch)
        if self.accelerator.is_main_process:
            save_checkpoint(
                self.out / "checkpoints",
                self.epoch,
                self.state(),
                write_extra=lambda staging: models.save_lora(self.transformer, staging / "lora"),
            )
        self.accelerator.wait_for_everyone()
        return path

    _ABSENT = "(absent)"
    resume_may_change: frozenset[str] = frozenset(
        {"train.epochs", "train.eval_every", "train.checkpoint_every", "train.log_every", "train.log_with",
         "train.out_dir", "train.reward_threads", "sampling.eval_prompts", "sampling.eval_num_steps"}
    )  # fmt: skip
    """The config fields a resumed run may set apart from its checkpoint's (what is logged, evaluated
    and saved, and how long it runs). A resume refuses every other difference: the saved state
    (optimizer, amortizer, adapters) carries the checkpoint's values of some (``train.lr``,
    ``strategy.harmonize_every``), and changing the others would continue a different run."""

    def resume(self, path: str | Path) -> None:
        """Continue from a checkpoint directory, or ``"latest"`` in this run's directory.

        Everything is checked before anything of the running state changes: the files against
        their hashes, the state's structure and shapes, and this run's config against the
        checkpoint's (equal but for :attr:`resume_may_change`).

        Raises:
            FileNotFoundError: ``"latest"``, and the run has no checkpoint.
            CheckpointError: the checkpoint is damaged, or its state does not fit this run; the
                message names the file and the field.
            ConfigError: the config differs from the checkpoint's where a resume cannot honour
                it; the message names every such field with both values.
        """
        if str(path) == "latest":
            found = latest_checkpoint(self.out / "checkpoints")
            if found is None:
                raise FileNotFoundError(
                    f"--resume latest: no checkpoint in {str(self.out / 'checkpoints')!r}"
                )
            path = found
        path = Path(path)
        state = load_checkpoint(path)
        self._check_resumable(state, path)
        previous = copy.deepcopy(self.optimizer.state_dict())
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as error:
            self.optimizer.load_state_dict(previous)
            where = repr(str(path / "state.json"))
            raise CheckpointError(
                f"{where}: field 'optimizer' does not fit this run's optimizer: {error!r}"
            ) from error
        old = models.lora_parameters(self.transformer, models.OLD)
        with torch.no_grad():
            for p, value in zip([*self.params, *old], [*state["trained"], *state["old"]], strict=True):
                p.copy_(value)
        self.eval_ema = [t.to(p.device) for t, p in zip(state["eval_ema"], self.params, strict=True)]
        self.epoch = state["epoch"]

    def _check_resumable(self, state: Any, path: Path) -> None:
        """Raise unless ``state`` (loaded from checkpoint ``path``) fits this run (see :meth:`resume`)."""
        where = repr(str(path / "state.json"))
        fields = ("epoch", "trained", "old", "eval_ema", "optimizer", "config")
        if not isinstance(state, dict):
            raise CheckpointError(
                f"{where} must hold an object with the fields {', '.join(fields)}, got {type(state).__name__}"
            )
        if missing := [name for name in fields if name not in state]:
            raise CheckpointError(f"{where} lacks the fields {', '.join(missing)}")
        epoch = state["epoch"]
        if type(epoch) is not int or epoch < 0:
            raise CheckpointError(f"{where}: field 'epoch' must be a non-negative integer, got {epoch!r}")
        old = models.lora_parameters(self.transformer, models.OLD)
        for name, current in (("trained", self.params), ("old", old), ("eval_ema", self.params)):
            saved = state[name]
            if not isinstance(saved, list) or not all(
                isinstance(t, torch.Tensor) and t.is_floating_point() for t in saved
            ):
                raise CheckpointError(f"{where}: field {name!r} must be a list of floating tensors")
            if len(saved) != len(current):
                raise CheckpointError(
                    f"{where}: field {name!r} has {len(saved)} tensors where this model's adapter has "
                    f"{len(current)}"
                )
            for i, (t, p) in enumerate(zip(saved, current, strict=True)):
                if t.shape != p.shape:
                    raise CheckpointError(
                        f"{where}: field {name!r}: tensor {i} has shape {tuple(t.shape)} where this "
                        f"model's adapter has {tuple(p.shape)}"
                    )
        for name in ("optimizer", "config"):
            if not isinstance(state[name], dict):
                raise CheckpointError(
                    f"{where}: field {name!r} must be an object, got {type(state[name]).__name__}"
                )
        changed = [
            (field, saved, now)
            for field, saved, now in self._config_differences(state["config"], self.config.to_dict())
            if not any(field == f or field.startswith(f + ".") for f in self.resume_may_change)
        ]
        if changed:
            raise ConfigError(
                f"{', '.join(f for f, _, _ in changed)}: a resume continues the run of checkpoint "
                f"{str(path)!r} as it was configured, and this config differs: "
                + "; ".join(f"{f}: {saved!r} in the checkpoint, {now!r} now" for f, saved, now in changed)
                + ". Set them back, or start a new run (another train.out_dir)."
            )

    @staticmethod
    def _config_differences(saved: Any, current: Any, field: str = "") -> list[tuple[str, Any, Any]]:
        """``(dotted field, saved value, current value)`` wherever two ``Config.to_dict()`` trees differ
        (a list of another length differs as a whole); a checkpoint's config against the running one."""
        if isinstance(saved, dict) and isinstance(current, dict):
            keys = [*saved, *(key for key in current if key not in saved)]
            return [
                difference
                for key in keys
                for difference in Trainer._config_differences(
                    saved.get(key, Trainer._ABSENT),
                    current.get(key, Trainer._ABSENT),
                    f"{field}.{key}" if field else str(key),
                )
            ]
        if (
            isinstance(saved, list | tuple)
            and isinstance(current, list | tuple)
            and len(saved) == len(current)
        ):
            return [
                d
                for i, (a, b) in enumerate(zip(saved, current, strict=True))
                for d in Trainer._config_differences(a, b, f"{field}.{i}")
            ]
        return [] if saved == current else [(field, saved, current)]

    # ---- the run -------------------------------------------------------------------------------

    def train(self, epochs: int | None = None) -> list[dict[str, Any]]:
        """Train until ``epochs`` (default ``train.epochs``) epochs are done; returns their metrics."""
        train = self.config.train
        end = train.epochs if epochs is None else epochs
        main = self.accelerator.is_main_process
        if main:
            self.out.mkdir(parents=True, exist_ok=True)
            self.config.save(self.out / "config.yaml")
        if self.accelerator.log_with:
            self.accelerator.init_trackers("mogo_diffusion", config=_hyperparameters(self.config))
        history = []
        progress = tqdm(
            range(self.epoch, end),
            initial=self.epoch,
            total=end,
            desc="epochs",
            disable=None if main else True,
        )
        for epoch in progress:
            metrics = self.train_epoch(epoch)
            self.epoch = epoch + 1
            if self.epoch % train.eval_every == 0 or self.epoch == end:
                metrics.update(self.evaluate())
            history.append(metrics)
            progress.set_postfix(
                {k.split("/")[-1]: f"{v:.3g}" for k, v in metrics.items() if k.startswith("reward/")}
            )
            if main and (epoch % train.log_every == 0 or self.epoch == end):
                with self.metrics_path.open("a") as file:
                    file.write(json.dumps(metrics) + "\n")
                self.accelerator.log({k: v for k, v in metrics.items() if k != "epoch"}, step=epoch)
            if self.epoch % train.checkpoint_every == 0 or self.epoch == end:
                self.save()
        for tracker in self.accelerator.trackers:  # end_training would also end the process group
            tracker.finish()
        if main and history:
            if self.eval_images is not None:
                save_grid(self.eval_images, self.out / "samples.png")
            plot_run(self.out)
        self.accelerator.wait_for_everyone()
        return history


def main(argv: list[str] | None = None) -> None:
    """The command. Without ``--config`` it runs the embedded default,
    :func:`mogo_diffusion.shapes.recipe.shapes_config` (MARBLE on the shapes world); ``--set``
    overrides apply over either."""
    parser = argparse.ArgumentParser(
        prog="python -m mogo_diffusion.train",
        description=__doc__.splitlines()[0]
        + " Without --config: MARBLE on the embedded shapes world (about 6 minutes on 2 CPU cores).",
    )
    add_config_arguments(parser)
    parser.add_argument("--resume", default=None, help="'latest' or a checkpoint directory")
    args = parser.parse_args(argv)
    try:
        defaults = None
        if args.config is None:
            from mogo_diffusion.shapes.recipe import shapes_config

            defaults = shapes_config()
        config = config_from_args(args, defaults)
    except (ConfigError, FileNotFoundError) as error:
        parser.error(str(error))
    trainer = Trainer(config)
    if args.resume:
        trainer.resume(args.resume)
    trainer.train()
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
