"""Multi-reward DiffusionNFT fine-tuning: ``python -m mogo_diffusion.train``.

One epoch: sample ``group_size`` images for each of ``prompts_per_epoch`` prompts with the old
adapter (CFG-free), score every reward, compute advantages, then for each training batch take one
optimizer step that accumulates one ``backward`` per trained timestep of the sampler's grid; after
the epoch the old adapter follows the trained one by EMA, and an evaluation EMA is kept apart.
What the rewards become (advantages, losses, the gradient of a step) is the strategy's
(:mod:`mogo_diffusion.strategies`), chosen once from ``strategy``; the update after it (unscale,
clip, step, under the run's autocast and gradient scaler) is the same for every strategy.

Every random draw comes from its own stream (:mod:`mogo_diffusion.streams`): the adapter's
initialisation, and each epoch's sampling and training draws, each a child of
``SeedSequence(train.seed)``; so a run resumed from a checkpoint continues exactly as the
uninterrupted run does.

Every ``train.eval_every`` epochs (and after the last) the evaluation EMA samples
``sampling.eval_prompts`` with fixed noise, the same in every run, and the rewards' means are
logged as ``eval/{name}``. The run directory gets ``config.yaml``, ``metrics.jsonl``,
``checkpoints/``, and at the end ``samples.png`` (the pretrained and the trained model's images of
:data:`SAMPLES_SHOWN` distinct evaluation prompts, side by side, same noise) and ``curves.png``;
it is claimed by one process at a time, holds one run, and is marked finished last
(:mod:`mogo_diffusion.run_dir`). An evaluation also logs the rewards' batch diagnostics as
``diagnostic/{name}`` (the shapes world's ``distinct_scenes``: how many different scenes the
detector reads, a guard against collapse).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import diffusers
import torch
from accelerate import Accelerator
from accelerate.tracking import get_available_trackers
from accelerate.utils import LoggerType, broadcast_object_list
from tqdm.auto import tqdm

from mogo._extras import MissingExtraError, require
from mogo.registry import closest
from mogo_diffusion import models, run_dir
from mogo_diffusion.advantages import nan_mean
from mogo_diffusion.attention import use_float32_attention
from mogo_diffusion.checkpoint import (
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from mogo_diffusion.compilation import compile_transformer, should_compile
from mogo_diffusion.config import LORA_TARGETS, Config, ConfigError, add_config_arguments, config_from_args
from mogo_diffusion.evaluate import plot_run, save_comparison
from mogo_diffusion.nft import kl_loss, nft_terms
from mogo_diffusion.prompts import PromptSet, load_prompt_pool, load_prompt_set
from mogo_diffusion.rewards import MultiReward, make_reward, reward_factory
from mogo_diffusion.run_dir import RunDirError
from mogo_diffusion.sampling import Samples, decode, sample
from mogo_diffusion.strategies import Strategy, make_strategy
from mogo_diffusion.streams import stream_seed

__all__ = [
    "DEFAULT_PROMPTS",
    "EVAL_SEED",
    "SAMPLES_SHOWN",
    "Batch",
    "MicroBatch",
    "Trainer",
    "check_config",
    "check_model",
    "main",
]

DEFAULT_PROMPTS = tuple(
    f"a {color} {shape} on a {background} background"
    for color in ("red", "green", "blue", "yellow")
    for shape in ("circle", "square", "triangle")
    for background in ("white", "black")
)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SAMPLES_SHOWN = 16
"""Distinct evaluation prompts whose base and trained images ``samples.png`` shows side by side
(the first evaluation row of each, in order)."""
EVAL_SEED = 20_240_601
"""The seed of the evaluation noise, the same for every run and seed, so that runs compare sample
by sample."""


@dataclass
class Batch:
    """One epoch's samples. ``prompts``, their ``metadata`` and ``rewards [B, K]`` cover all
    processes' samples; this process's share is rows ``local`` of them, and
    ``latents [b, C, h, w]``, the embeddings and ``images [b, 3, H, W]`` hold only those.
    ``rewards`` is None until :meth:`Trainer.score`."""

    prompts: list[str]
    metadata: list[dict[str, Any]]
    local: slice
    embeds: torch.Tensor
    pooled: torch.Tensor
    latents: torch.Tensor
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    images: torch.Tensor
    rewards: torch.Tensor | None = None


class MicroBatch(NamedTuple):
    """One training forward's share of a step: the local rows ``index [b]`` of the epoch's
    :class:`Batch`, their ``advantages [b, J]``, the trained ``timesteps`` (indices into the
    sampler's grid) and their noise ``[len(timesteps), b, *latent]``."""

    index: torch.Tensor
    advantages: torch.Tensor
    timesteps: list[int]
    noise: torch.Tensor


def _trackers(names: Sequence[str]) -> None:
    """Check accelerate tracker names: known, and their package installed."""
    known = [str(kind) for kind in LoggerType if kind != LoggerType.ALL]
    available = {str(kind) for kind in get_available_trackers()}
    for name in names:
        if name not in known:
            raise ConfigError(f"train.log_with: unknown tracker {name!r}; known: {', '.join(known)}")
        if name == "tensorboard":
            try:
                require("train.log_with: tracker 'tensorboard'", "tracking")
            except MissingExtraError as error:
                raise ConfigError(str(error)) from None
        if name not in available:
            raise ConfigError(f"train.log_with: tracker {name!r} needs its package: pip install {name}")


def _precision(mixed_precision: str, device: torch.device) -> str:
    """``train.mixed_precision`` with ``"auto"`` resolved: bf16 on a CUDA device that has it, else no."""
    if mixed_precision != "auto":
        return mixed_precision
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "no"


def _check_rewards(config: Config) -> None:
    """Each reward's name is registered and its options are its factory's arguments."""
    for i, spec in enumerate(config.rewards):
        where = f"rewards.{i}"
        try:
            factory = reward_factory(spec.name)
        except ValueError as error:
            raise ConfigError(f"{where}.name: {error}") from None
        signature = inspect.signature(factory)
        parameters = signature.parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            for option in spec.options:
                if option not in parameters:
                    hint = closest(option, parameters)
                    raise ConfigError(
                        f"{where}.options.{option}: {spec.name!r} has no such option{hint}; "
                        f"it accepts {', '.join(parameters) or 'none'}"
                    )
        try:
            signature.bind(**spec.options)
        except TypeError as error:
            raise ConfigError(f"{where}.options: {spec.name!r}: {error}") from None


def _check_split(config: Config, world: int) -> None:
    """An epoch's prompts split evenly over ``world`` processes, and each process has a batch for
    every one of ``train.steps_per_epoch`` steps."""
    sampling, train = config.sampling, config.train
    if sampling.prompts_per_epoch % world:
        raise ConfigError(
            f"sampling.prompts_per_epoch: {sampling.prompts_per_epoch} prompts do not split evenly over "
            f"{world} processes"
        )
    local = sampling.prompts_per_epoch * sampling.group_size // world
    batches = -(-local // train.batch_size)
    if train.steps_per_epoch is not None and train.steps_per_epoch > batches:
        raise ConfigError(
            f"train.steps_per_epoch: {train.steps_per_epoch} steps, but each process trains {batches} "
            f"batch(es) of train.batch_size={train.batch_size} per epoch ({local} images: "
            f"sampling.prompts_per_epoch x sampling.group_size / {world} process(es))"
        )


def _check_out_dir(out_dir: str) -> None:
    """``train.out_dir`` is a directory or can be made: neither it nor a parent is a file."""
    path = Path(out_dir)
    for existing in (path, *path.parents):
        if existing.exists():
            if not existing.is_dir():
                inside = "" if existing == path else f": the run directory {out_dir!r} cannot be made in it"
                raise ConfigError(f"train.out_dir: {str(existing)!r} is a file, not a directory{inside}")
            return


def check_config(config: Config, world: int = 1) -> None:
    """Everything a run's start depends on but its model: what :meth:`Config.validate
    <mogo_diffusion.config.Config.validate>` checks, reward names and options (against
    :func:`mogo_diffusion.rewards.available_rewards`), the strategy
    (:func:`~mogo_diffusion.strategies.make_strategy`), the trackers, the epoch's split over
    ``world`` processes, and ``train.out_dir``. :class:`Trainer` calls it first (and checks the
    split again over its processes), ``--check`` too; :func:`check_model` checks the rest once
    the model is known.

    Raises:
        ConfigError: naming the dotted field.
    """
    config.validate()
    _check_rewards(config)
    make_strategy(config)
    _trackers(config.train.log_with)
    _check_split(config, world)
    _check_out_dir(config.train.out_dir)


def _check_lora_targets(targets: Sequence[str], transformer: torch.nn.Module) -> None:
    """Each target names a linear layer of ``transformer`` (as peft matches them: the module's
    dotted name, or its end after a dot); peft drops a target that matches nothing silently when
    another one matches."""
    names = [name for name, module in transformer.named_modules() if isinstance(module, torch.nn.Linear)]
    for i, target in enumerate(targets):
        if not any(name == target or name.endswith(f".{target}") for name in names):
            ends = sorted({".".join(name.split(".")[-n:]) for name in names for n in (1, 2)})
            raise ConfigError(
                f"model.lora_targets.{i}: {target!r} names no linear layer of the transformer"
                f"{closest(target, ends)}; "
                f"SD3's attention projections are {', '.join(LORA_TARGETS)}"
            )


def check_model(config: Config, transformer: torch.nn.Module, vae_scale_factor: int) -> None:
    """What ``config`` asks of the model: every ``model.lora_targets`` entry names layers of
    ``transformer``, and ``sampling.resolution`` fits the transformer and the VAE
    (:func:`mogo_diffusion.models.latent_size`). ``transformer`` may be on the ``meta`` device.
    :class:`Trainer` calls it once the pipeline is loaded, ``--check`` on the transformer built
    from its config.

    Raises:
        ConfigError: naming the dotted field and the valid values.
    """
    _check_lora_targets(config.model.lora_targets, transformer)
    try:
        models.latent_size(config.sampling.resolution, transformer.config, vae_scale_factor)
    except ValueError as error:
        raise ConfigError(f"sampling.resolution: {error}") from None


def _read_prompts(load: Callable[[Any], Any], source: Any, field: str) -> Any:
    """``load(source)``, its errors as a :class:`ConfigError` naming ``field``."""
    try:
        return load(source)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{field}: {error}") from None


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
    """The training loop of one run; ``Trainer(config).train()`` runs it to ``train.epochs``.

    An epoch is :meth:`sample` -> :meth:`score` -> :meth:`advantages` -> for each training
    batch :meth:`gradients` (:meth:`losses` and the strategy's ``backward`` per trained
    timestep) -> :meth:`update`; each step can be called, tested and overridden on its own.

    Args:
        config: the run.
        accelerator: the processes and trackers (built from ``config`` when None); its own
            mixed precision is not used: the trainer's autocast and ``scaler`` are.
        strategy: the strategy (default :func:`~mogo_diffusion.strategies.make_strategy` of
            ``config``).
        scaler: the gradient scaler (default: a ``torch.amp.GradScaler`` on the device, enabled
            for ``train.mixed_precision: fp16`` only).
        pipeline: the SD3 pipeline to train, without LoRA adapters (default: loaded from
            ``model.pretrained``, ``revision`` and ``variant`` in ``model.dtype``); a given one is
            trained in its own dtype.

    Raises:
        ConfigError: :func:`check_config` (before anything is loaded) or :func:`check_model`
            (once the pipeline is) refuses the config.
    """

    def __init__(
        self,
        config: Config,
        accelerator: Accelerator | None = None,
        *,
        strategy: Strategy | None = None,
        scaler: torch.amp.GradScaler | None = None,
        pipeline: diffusers.StableDiffusion3Pipeline | None = None,
    ) -> None:
        check_config(config)
        self.config = config
        self.out = Path(config.train.out_dir)
        self.accelerator = accelerator or Accelerator(
            log_with=config.train.log_with or None, project_dir=self.out / "trackers"
        )
        self.world = self.accelerator.num_processes
        _check_split(config, self.world)  # check_config's split, over this run's processes
        self.device = self.accelerator.device
        self.mixed_precision = _precision(config.train.mixed_precision, self.device)
        self.scaler = scaler or torch.amp.GradScaler(self.device.type, enabled=self.mixed_precision == "fp16")
        if pipeline is None:
            pipeline = models.load_pipeline(
                config.model.pretrained,
                revision=config.model.revision,
                variant=config.model.variant,
                torch_dtype=DTYPES[config.model.dtype],
            )
        self.pipeline = pipeline
        self.pipeline.to(self.device)
        check_model(config, self.pipeline.transformer, self.pipeline.vae_scale_factor)
        self.transformer = self.pipeline.transformer
        if self.mixed_precision == "bf16" and self.device.type == "cpu":
            use_float32_attention(self.transformer)  # the CPU's bfloat16 attention backward is slow
        with torch.random.fork_rng(devices=[]):  # the adapter's Gaussian init, from its own stream
            torch.manual_seed(self.seed_of("lora_init"))
            models.add_lora(
                self.transformer,
                config.model.lora_rank,
                config.model.lora_alpha,
                targets=config.model.lora_targets,
            )
        if should_compile(config.train.compile, config.train.epochs):
            compile_transformer(self.transformer)
        self.params = models.lora_parameters(self.transformer)
        for p in self.params:  # trained in float32 whatever the frozen weights' dtype
            p.data = p.data.float()
        self.eval_ema = [p.detach().clone() for p in self.params]
        self.names = [spec.name for spec in config.rewards]
        self.rewards = MultiReward(
            [make_reward(spec.name, **spec.options) for spec in config.rewards],
            threads=config.train.reward_threads,
        ).to(self.device)
        default = PromptSet(list(DEFAULT_PROMPTS), [{} for _ in DEFAULT_PROMPTS])
        self.prompts = _read_prompts(load_prompt_pool, config.sampling.prompts or default, "sampling.prompts")
        self.eval_prompts = (
            None
            if config.sampling.eval_prompts is None
            else _read_prompts(load_prompt_set, config.sampling.eval_prompts, "sampling.eval_prompts")
        )
        self.eval_images: torch.Tensor | None = None
        self._eval_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.strategy = strategy or make_strategy(config, self.world)
        self.optimizer = self.strategy.build(self.params)
        self.epoch = 0
        self._continuing = False  # resumed, or trained here already: train() continues a run

    # ---- the steps of an epoch -----------------------------------------------------------------

    def seed_of(self, purpose: str, *index: int) -> int:
        """The seed of the run's random stream ``(purpose, *index)``
        (:func:`mogo_diffusion.streams.stream_seed`)."""
        return stream_seed(self.config.train.seed, purpose, *index)

    def stream(self, purpose: str, epoch: int) -> torch.Generator:
        """The generator of ``purpose`` (``"sampling"``, ``"training"``) in ``epoch``: the same on
        every process and in a resumed run, independent of every other stream."""
        return torch.Generator().manual_seed(self.seed_of(purpose, epoch))

    def latent_shape(self, rows: int) -> tuple[int, int, int, int]:
        """``(rows, C, h, h)``: the latents of ``rows`` images of ``sampling.resolution`` pixels a
        side, ``h`` = :func:`mogo_diffusion.models.latent_size` (what ``--check`` counts too)."""
        side = models.latent_size(
            self.config.sampling.resolution, self.transformer.config, self.pipeline.vae_scale_factor
        )
        return (rows, self.transformer.config.in_channels, side, side)

    def sample(self, epoch: int) -> Batch:
        """The epoch's prompts and images, sampled with the old adapter (``rewards`` not yet set).

        Every process draws the same prompts and noise and samples its own whole groups (rows
        ``local``)."""
        sampling = self.config.sampling
        generator = self.stream("sampling", epoch)
        chosen = self.prompts.draw(sampling.prompts_per_epoch, generator)
        rows = [i for i in chosen.tolist() for _ in range(sampling.group_size)]
        prompts = [self.prompts.prompts[i] for i in rows]
        metadata = [self.prompts.metadata[i] for i in rows]
        share = len(prompts) // self.world
        local = slice(self.accelerator.process_index * share, (self.accelerator.process_index + 1) * share)
        noise = torch.randn(self.latent_shape(len(prompts)), generator=generator)[local]
        embeds, pooled = models.encode_prompts(
            self.pipeline, prompts[local], self.config.model.max_sequence_length
        )
        with torch.no_grad(), models.merged(self.transformer, models.OLD):
            samples, images = self._sample(embeds, pooled, noise, sampling.num_steps)
        latents, sigmas, timesteps = samples.latents, samples.sigmas, samples.timesteps
        return Batch(prompts, metadata, local, embeds, pooled, latents, sigmas, timesteps, images)

    def score(self, batch: Batch) -> Batch:
        """``batch`` with its ``rewards [B, K]``: this process's images scored, and the scores of
        every process gathered, so that advantages see the whole batch."""
        local = batch.local
        scores = self.rewards(batch.images, batch.prompts[local], batch.metadata[local]).values
        scores = scores.to(self.device)
        if self.world > 1:
            scores = self.accelerator.gather(scores.contiguous())
        return replace(batch, rewards=scores)

    def _sample(
        self, embeds: torch.Tensor, pooled: torch.Tensor, noise: torch.Tensor, num_steps: int
    ) -> tuple[Samples, torch.Tensor]:
        """Sample ``noise`` in batches of ``sampling.batch_size`` with the selected adapter;
        returns the samples (all latents, the grid) and the decoded images ``[B, 3, H, W]``."""
        sampling = self.config.sampling
        latents, images = [], []
        for start in range(0, len(noise), sampling.batch_size):
            part = slice(start, start + sampling.batch_size)
            with self.autocast():
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
        embeds, pooled, noise = self._eval_inputs()
        trained = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, ema in zip(self.params, self.eval_ema, strict=True):
                p.copy_(ema)
        try:
            with torch.no_grad(), models.merged(self.transformer, models.TRAINED):
                _, images = self._sample(embeds, pooled, noise, self.config.sampling.eval_num_steps)
        finally:
            with torch.no_grad():
                for p, value in zip(self.params, trained, strict=True):
                    p.copy_(value)
        self.eval_images = images
        means = nan_mean(self.rewards(images, prompts, metadata).values)
        metrics = {f"eval/{name}": float(m) for name, m in zip(self.names, means, strict=True)}
        metrics.update({f"diagnostic/{k}": v for k, v in self.rewards.diagnostics(images).items()})
        return metrics

    def _eval_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The evaluation prompts' embeddings and pooled embeddings, and the evaluation noise (one
        row per prompt, seeded by :data:`EVAL_SEED`); computed once, they are the same at every
        evaluation."""
        if self._eval_cache is None:
            prompts = self.eval_prompts.prompts
            length = self.config.model.max_sequence_length
            embeds, pooled = models.encode_prompts(self.pipeline, prompts, length)
            generator = torch.Generator().manual_seed(EVAL_SEED)
            noise = torch.randn(self.latent_shape(len(prompts)), generator=generator).to(self.device)
            self._eval_cache = (embeds, pooled, noise)
        return self._eval_cache

    def base_samples(self, rows: Sequence[int]) -> torch.Tensor:
        """The pretrained model's images (adapters disabled) of the evaluation rows ``rows``, from
        the noise :meth:`evaluate` gives them: what its images are compared with."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        embeds, pooled, noise = (part[index.to(part.device)] for part in self._eval_inputs())
        with models.reference(self.transformer):
            _, images = self._sample(embeds, pooled, noise, self.config.sampling.eval_num_steps)
        return images

    def advantages(self, batch: Batch, epoch: int) -> torch.Tensor:
        """``[B, J]`` advantages of the scored ``batch``, one column per objective the strategy
        trains (K for marble, 1 for the others)."""
        return self.strategy.advantages(batch.rewards, batch.prompts, epoch)

    def losses(
        self, batch: Batch, index: torch.Tensor, advantages: torch.Tensor, j: int, eps: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The ``[J]`` NFT losses and the KL term (None when ``nft.kl_coef`` is 0) of the local
        rows ``index`` at the trained timestep ``t = sigma_j`` with noise ``eps``; the trained
        forward has its adapter fused into the weights (:func:`~mogo_diffusion.models.fused`),
        and runs eagerly when the strategy's backward goes through it once per objective (a
        compiled graph is traversed once); all three run under the run's autocast
        (:meth:`autocast`)."""
        nft = self.config.nft
        x0 = batch.latents[index]
        t = float(batch.sigmas[j])
        x_t = (1 - t) * x0 + t * eps
        dtype = self.transformer.dtype
        inputs = {
            "hidden_states": x_t.to(dtype),
            "timestep": batch.timesteps[j].expand(len(index)).to(x_t.device),
            "encoder_hidden_states": batch.embeds[index].to(dtype),
            "pooled_projections": batch.pooled[index].to(dtype),
            "return_dict": False,
        }
        with torch.no_grad(), self.autocast():
            with models.merged(self.transformer, models.OLD):
                v_old = self.transformer(**inputs)[0]
            v_ref = None
            if nft.kl_coef > 0:
                with models.reference(self.transformer):
                    v_ref = self.transformer(**inputs)[0]
        eager = torch.compiler.set_stance("force_eager") if self.strategy.traverses_twice() else nullcontext()
        with self.autocast(), models.fused(self.transformer, models.TRAINED), eager:
            v = self.transformer(**inputs)[0]
        kl = kl_loss(v, v_ref, kl_coef=nft.kl_coef) if v_ref is not None else None
        return self.strategy.losses(nft_terms(v, v_old, x_t, x0, t, beta=nft.beta), advantages), kl

    def autocast(self) -> AbstractContextManager:
        """The autocast of every transformer forward (sampling, the old, reference and trained
        velocities; ``train.mixed_precision``), or nothing for ``"no"``. What they feed stays
        float32: the sampler's state, the NFT loss and KL terms, the advantages and the QP."""
        if self.mixed_precision == "no":
            return nullcontext()
        dtype = torch.bfloat16 if self.mixed_precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def gradients(self, batch: Batch, parts: Sequence[MicroBatch]) -> torch.Tensor:
        """Write one optimizer step's gradient into ``.grad``: the mean over ``parts`` of each
        micro-batch's loss, one (scaled) backward per micro-batch and trained timestep, then the
        strategy's final reduction, then unscaled. Returns the summed KL terms (a 0-d float64
        tensor on the device: no host sync)."""
        if not parts:
            raise ValueError("an optimizer step needs at least one micro-batch")
        self.optimizer.zero_grad()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        weight = 1 / len(parts)
        for part in parts:
            for j, eps in zip(part.timesteps, part.noise, strict=True):
                losses, kl = self.losses(batch, part.index, part.advantages, j, eps.to(batch.latents))
                if len(parts) > 1:
                    losses, kl = losses * weight, None if kl is None else kl * weight
                self.strategy.backward(
                    self.scaler.scale(losses), None if kl is None else self.scaler.scale(kl)
                )
                if kl is not None:
                    total += kl.detach() / weight
        self.strategy.finish()  # .grad final (harmonized, averaged over processes) before clipping
        self.scaler.unscale_(self.optimizer)
        return total

    def update(self) -> None:
        """Clip the (unscaled) gradient and step; a step whose gradient overflowed is skipped
        and the scale lowered (``fp16``)."""
        if self.config.train.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.config.train.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def train_epoch(self, epoch: int) -> dict[str, Any]:
        """Sample, score, advantages, then :meth:`gradients` and :meth:`update` for each of
        ``train.steps_per_epoch`` groups of consecutive training batches (one batch a step when
        None); returns the epoch's metrics."""
        start = time.perf_counter()
        batch = self.score(self.sample(epoch))
        sampled = time.perf_counter()
        advantages = self.advantages(batch, epoch)[batch.local]
        train = self.config.train
        generator = self.stream("training", epoch)
        steps = len(batch.timesteps)
        count = max(1, int(train.timestep_fraction * steps))
        order = torch.randperm(len(batch.latents), generator=generator)
        parts = []
        for begin in range(0, len(order), train.batch_size):
            index = order[begin : begin + train.batch_size]
            chosen = torch.randperm(steps, generator=generator)[:count].sort().values
            noise = torch.randn((len(chosen), *batch.latents[index].shape), generator=generator)
            parts.append(MicroBatch(index, advantages[index], chosen.tolist(), noise))
        kl = torch.zeros((), dtype=torch.float64, device=self.device)
        for group in torch.arange(len(parts)).tensor_split(train.steps_per_epoch or len(parts)):
            kl += self.gradients(batch, [parts[i] for i in group.tolist()])
            self.update()
        trained = count * len(parts)
        decay = min(train.old_decay_rate * epoch, train.old_decay_max)
        models.ema_update(self.transformer, decay)
        with torch.no_grad():
            for ema, p in zip(self.eval_ema, self.params, strict=True):
                ema.lerp_(p.detach(), 1 - train.eval_ema_decay)
        seconds = time.perf_counter() - start
        metrics: dict[str, Any] = {"epoch": epoch, "seconds": seconds, "sampling_seconds": sampled - start}
        metrics["images_per_second"] = len(batch.prompts) / seconds
        metrics["kl"] = float(kl) / max(1, trained)
        means = nan_mean(batch.rewards).tolist()
        metrics.update({f"reward/{name}": m for name, m in zip(self.names, means, strict=True)})
        metrics.update(self.strategy.metrics())
        return metrics

    # ---- checkpoints ---------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Everything a resumed run needs: adapters, evaluation EMA, optimizer, gradient scaler
        (its scale and growth tracker; empty when disabled), epoch, config."""
        return {
            "epoch": self.epoch,
            "trained": [p.detach() for p in self.params],
            "old": [p.detach() for p in models.lora_parameters(self.transformer, models.OLD)],
            "eval_ema": self.eval_ema,
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
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

    resume_may_change: frozenset[str] = run_dir.RESUME_MAY_CHANGE
    """The config fields a resumed run may set apart from its checkpoint's (what is logged, evaluated
    and saved, and how long it runs; :data:`mogo_diffusion.run_dir.RESUME_MAY_CHANGE`). A resume
    refuses every other difference: the saved state (optimizer, amortizer, adapters) carries the
    checkpoint's values of some (``train.lr``, ``strategy.harmonize_every``), and changing the
    others would continue a different run."""

    def resume(self, path: str | Path) -> None:
        """Continue from a checkpoint directory, or ``"latest"`` in this run's directory.

        Everything is checked before anything of the running state changes: the files against
        their hashes, every field of the state (its structure, the tensors' shapes and dtypes, an
        epoch within ``train.epochs``, the gradient scaler's fields), and this run's config against
        the checkpoint's (equal but for :attr:`resume_may_change`). The optimizer's state is
        tried last, and the optimizer restored when it does not fit.

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
        self.scaler.load_state_dict(state["scaler"])
        self.eval_ema = [t.to(p.device) for t, p in zip(state["eval_ema"], self.params, strict=True)]
        self.epoch = state["epoch"]
        self._continuing = True

    def _check_resumable(self, state: Any, path: Path) -> None:
        """Raise unless ``state`` (loaded from checkpoint ``path``) fits this run (see :meth:`resume`)."""
        where = repr(str(path / "state.json"))
        fields = ("epoch", "trained", "old", "eval_ema", "optimizer", "scaler", "config")
        if not isinstance(state, dict):
            raise CheckpointError(
                f"{where} must hold an object with the fields {', '.join(fields)}, got {type(state).__name__}"
            )
        if missing := [name for name in fields if name not in state]:
            raise CheckpointError(f"{where} lacks the fields {', '.join(missing)}")
        epoch = state["epoch"]
        if type(epoch) is not int or epoch < 0:
            raise CheckpointError(f"{where}: field 'epoch' must be a non-negative integer, got {epoch!r}")
        if epoch > self.config.train.epochs:
            raise CheckpointError(
                f"{where}: field 'epoch' is {epoch}, beyond this run's train.epochs="
                f"{self.config.train.epochs}: set train.epochs to {epoch} or more to continue it"
            )
        old = models.lora_parameters(self.transformer, models.OLD)
        for name, current in (("trained", self.params), ("old", old), ("eval_ema", self.params)):
            self._check_tensors(state[name], current, f"{where}: field {name!r}")
        for name in ("optimizer", "scaler", "config"):
            if not isinstance(state[name], dict):
                raise CheckpointError(
                    f"{where}: field {name!r} must be an object, got {type(state[name]).__name__}"
                )
        self._check_scaler(state["scaler"], where)
        try:  # read by today's schema: a field removed since (config.REMOVED) is no difference
            saved = Config.from_dict(state["config"]).to_dict()
        except ConfigError as error:
            raise CheckpointError(f"{where}: field 'config' is not a valid config: {error}") from None
        changed = run_dir.defining_differences(saved, self.config.to_dict())
        if changed:
            raise ConfigError(
                f"{', '.join(f for f, _, _ in changed)}: a resume continues the run of checkpoint "
                f"{str(path)!r} as it was configured, and this config differs: "
                + "; ".join(f"{f}: {saved!r} in the checkpoint, {now!r} now" for f, saved, now in changed)
                + ". Set them back, or start a new run (another train.out_dir)."
            )

    @staticmethod
    def _check_tensors(saved: Any, current: Sequence[torch.Tensor], where: str) -> None:
        """Raise unless ``saved`` is a list of tensors of ``current``'s shapes and dtypes."""
        if not isinstance(saved, list) or not all(
            isinstance(t, torch.Tensor) and t.is_floating_point() for t in saved
        ):
            raise CheckpointError(f"{where} must be a list of floating tensors")
        if len(saved) != len(current):
            raise CheckpointError(
                f"{where} has {len(saved)} tensors where this model's adapter has {len(current)}"
            )
        for i, (t, p) in enumerate(zip(saved, current, strict=True)):
            if t.shape != p.shape or t.dtype != p.dtype:
                raise CheckpointError(
                    f"{where}: tensor {i} has shape {tuple(t.shape)} and dtype {t.dtype} where this "
                    f"model's adapter has {tuple(p.shape)} and {p.dtype}"
                )

    def _check_scaler(self, saved: dict[str, Any], where: str) -> None:
        """Raise unless ``saved`` is a state of this run's gradient scaler (any state when it is
        disabled: it loads nothing)."""
        if not self.scaler.is_enabled():
            return
        fields = self.scaler.state_dict()
        if missing := [name for name in fields if name not in saved]:
            raise CheckpointError(
                f"{where}: field 'scaler' lacks {', '.join(missing)} of this run's fp16 gradient scaler"
            )
        if bad := [name for name in fields if type(saved[name]) not in (int, float)]:
            raise CheckpointError(f"{where}: field 'scaler': {', '.join(bad)} must be numbers")

    # ---- the run -------------------------------------------------------------------------------

    def train(self, epochs: int | None = None, *, overwrite: bool = False) -> list[dict[str, Any]]:
        """Train until ``epochs`` (default ``train.epochs``) epochs are done; returns their metrics.

        The run directory (``train.out_dir``; :mod:`mogo_diffusion.run_dir`) is claimed for the
        whole call, and must hold no run unless this trainer continues the one it holds (resumed
        from its checkpoint, or trained before), or ``overwrite`` deletes that run first. Its
        finished marker is written last, after the final checkpoint and the figures.

        Raises:
            RunDirError: another process holds the directory, or it holds another run; nothing
                is written.
            ValueError: ``overwrite`` of a run this trainer continues, or ``epochs`` before its epoch.
        """
        end = self.config.train.epochs if epochs is None else epochs
        if end < self.epoch:
            raise ValueError(f"train(epochs={end}): this run is at epoch {self.epoch} already")
        if overwrite and self._continuing:
            raise ValueError(f"overwrite starts a run afresh; this one continues at epoch {self.epoch}")
        with self._claimed(overwrite):
            if self.accelerator.log_with:
                self.accelerator.init_trackers("mogo_diffusion", config=_hyperparameters(self.config))
            history = self._train_until(end)
            if not history:  # resumed at the end: its final checkpoint belongs in this directory
                self.save()
            for tracker in self.accelerator.trackers:  # end_training would also end the process group
                tracker.finish()
            if self.accelerator.is_main_process:
                self._figures(history)
                final = checkpoint_path(self.out / "checkpoints", end)
                run_dir.mark_finished(self.out, self.config, end, final)
            self.accelerator.wait_for_everyone()
        return history

    @contextmanager
    def _claimed(self, overwrite: bool) -> Iterator[None]:
        """Hold the run directory's claim on the main process, make the directory this run's
        (:func:`~mogo_diffusion.run_dir.start`) and write ``config.yaml``; a refusal is raised on
        every process."""
        with ExitStack() as claimed:
            refusal = None
            if self.accelerator.is_main_process:
                try:
                    claimed.enter_context(run_dir.claim(self.out))
                    resumed_at = self.epoch if self._continuing else None
                    run_dir.start(self.out, self.config, resumed_at=resumed_at, overwrite=overwrite)
                except RunDirError as error:
                    refusal = str(error)
                else:
                    self.config.save(self.out / "config.yaml")
            if self.world > 1:
                refusal = broadcast_object_list([refusal])[0]
            if refusal is not None:
                raise RunDirError(refusal)
            self._continuing = True
            yield

    def _train_until(self, end: int) -> list[dict[str, Any]]:
        """Train, log, evaluate and save epochs ``self.epoch .. end - 1``; returns their metrics."""
        train = self.config.train
        main = self.accelerator.is_main_process
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
                run_dir.append_metrics(self.out, metrics)
                self.accelerator.log({k: v for k, v in metrics.items() if k != "epoch"}, step=epoch)
            if self.epoch % train.checkpoint_every == 0 or self.epoch == end:
                self.save()
        return history

    def _figures(self, history: list[dict[str, Any]]) -> None:
        """``samples.png`` (after an evaluation) and ``curves.png``, when epochs were trained."""
        if not history:
            return
        if self.eval_images is not None:
            first = {p: i for i, p in reversed(list(enumerate(self.eval_prompts.prompts)))}
            rows = sorted(first.values())[:SAMPLES_SHOWN]
            prompts = [self.eval_prompts.prompts[i] for i in rows]
            trained = self.eval_images[torch.tensor(rows)]
            save_comparison(self.base_samples(rows), trained, prompts, self.out / "samples.png")
        plot_run(self.out)


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
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the run train.out_dir holds (its checkpoints, metrics and figures) and start afresh",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the config, the weights it names (offline) and the memory it needs, then exit",
    )
    args = parser.parse_args(argv)
    if args.resume and args.overwrite:
        parser.error("--overwrite starts a run afresh: it cannot --resume one")
    try:
        defaults = None
        if args.config is None:
            from mogo_diffusion.shapes.recipe import shapes_config

            defaults = shapes_config()
        config = config_from_args(args, defaults)
        check_config(config)
    except (ConfigError, FileNotFoundError) as error:
        parser.error(str(error))
    if args.check:
        from mogo_diffusion.preflight import run

        raise SystemExit(run(config))
    trainer = Trainer(config)
    if args.resume:
        try:
            trainer.resume(args.resume)
        except (CheckpointError, ConfigError, FileNotFoundError) as error:
            parser.error(f"--resume {args.resume}: {error}")
    try:
        trainer.train(overwrite=args.overwrite)
    except RunDirError as error:
        parser.error(str(error))
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
