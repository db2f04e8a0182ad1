"""Multi-reward DiffusionNFT fine-tuning: ``python -m mogo_diffusion.train``.

The file reads in the order a run calls it: :func:`main` (the command) builds a :class:`Trainer`
(:meth:`Trainer.from_config`) and :meth:`~Trainer.train`\\ s it. A run evaluates the pretrained
model, then trains epochs; one epoch (:meth:`~Trainer.train_epoch`) is :meth:`~Trainer.sample`
(``group_size`` images for each of ``prompts_per_epoch`` prompts with the old adapter, CFG-free)
-> :meth:`~Trainer.score` (every reward) -> :meth:`~Trainer.advantages` -> :meth:`~Trainer.plan`
(the epoch's micro-batches: rows, trained timesteps, noise) -> for each optimizer step
:meth:`~Trainer.gradients` (one ``backward`` per micro-batch and trained timestep of the
:meth:`~Trainer.losses`) and :meth:`~Trainer.update` -> :meth:`~Trainer.end_epoch` (the old
adapter follows the trained one by EMA; an evaluation EMA is kept apart) ->
:meth:`~Trainer.metrics`; then, every ``train.eval_every`` epochs, :meth:`~Trainer.evaluate`.
Every step is a method a subclass can override. What the rewards become (advantages, losses, the
gradient of a step) is the strategy's (:mod:`mogo_diffusion.strategies`), chosen once from
``strategy``; the update after it (unscale, clip, step, under the run's autocast and gradient
scaler) is the same for every strategy. The checks of a config are :mod:`mogo_diffusion.checks`',
of a checkpoint :mod:`mogo_diffusion.resumable`'s, the figures :mod:`mogo_diffusion.figures`'
and what the command prints :mod:`mogo_diffusion.progress`'.

Every random draw comes from its own stream (:mod:`mogo_diffusion.streams`): the adapter's
initialisation, and each epoch's sampling and training draws, each a child of
``SeedSequence(train.seed)``; so a run resumed from a checkpoint continues exactly as the
uninterrupted run does.

Before the first epoch (when it starts afresh), after every ``train.eval_every`` epochs and after
the last, the evaluation EMA samples ``sampling.eval_prompts`` with fixed noise, the same in every
run, and the rewards' means are logged as ``eval/{name}``; the first evaluation, of the adapters
at their initialisation (``B = 0``: the pretrained model), is the record of epoch
:data:`~mogo_diffusion.run_dir.PRETRAINED_EPOCH`. The run directory gets ``config.yaml``,
``metrics.jsonl``, ``checkpoints/``, and at the end ``samples.png`` (the pretrained and the
trained model's images of :data:`SAMPLES_SHOWN` distinct evaluation prompts, side by side, same
noise) and ``curves.png``; it is claimed by one process at a time, holds one run, and is marked
finished last (:mod:`mogo_diffusion.run_dir`). An evaluation also logs the rewards' batch
diagnostics as ``diagnostic/{name}`` (the shapes world's ``distinct_scenes``: how many different
scenes the detector reads, a guard against collapse).
"""

from __future__ import annotations

import argparse
import copy
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
from accelerate.utils import broadcast_object_list
from diffusers.training_utils import EMAModel

from mogo_diffusion import figures, models, preflight, run_dir
from mogo_diffusion.advantages import nan_mean
from mogo_diffusion.attention import use_float32_attention
from mogo_diffusion.checkpoint import (
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from mogo_diffusion.checks import check_config, check_model, check_split
from mogo_diffusion.compilation import compile_transformer, should_compile
from mogo_diffusion.config import Config, ConfigError, add_config_arguments, config_from_args
from mogo_diffusion.nft import kl_loss, nft_terms
from mogo_diffusion.progress import EpochProgress, run_summary
from mogo_diffusion.prompts import PromptPool, PromptSet, load_prompt_pool, load_prompt_set
from mogo_diffusion.quiet import quiet_loading
from mogo_diffusion.resumable import check_resumable
from mogo_diffusion.rewards import MultiReward, make_reward
from mogo_diffusion.run_dir import PRETRAINED_EPOCH, RunDirError
from mogo_diffusion.sampling import Samples, decode, sample
from mogo_diffusion.strategies import Strategy, make_strategy
from mogo_diffusion.streams import generator, stream_seed

__all__ = [
    "DEFAULT_PROMPTS",
    "EVAL_SEED",
    "SAMPLES_SHOWN",
    "Batch",
    "MicroBatch",
    "Trainer",
    "main",
]

DEFAULT_PROMPTS = tuple(
    f"a {color} {shape} on a {background} background"
    for color in ("red", "green", "blue", "yellow")
    for shape in ("circle", "square", "triangle")
    for background in ("white", "black")
)
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


def main(argv: list[str] | None = None) -> None:
    """The command. Without ``--config`` it runs the embedded default,
    :func:`mogo_diffusion.shapes.recipe.shapes_config` (MARBLE on the shapes world); ``--set``
    overrides apply over either. It reports each epoch (:class:`~mogo_diffusion.progress.EpochProgress`)
    and ends with the held-out rewards of the pretrained and the trained model and the paths of
    what it wrote (:func:`~mogo_diffusion.progress.run_summary`)."""
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
        raise SystemExit(preflight.run(config))
    trainer = Trainer.from_config(config)
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
    if trainer.accelerator.is_main_process:
        final = checkpoint_path(trainer.out / "checkpoints", trainer.epoch)
        print(run_summary(trainer.out, trainer.names, final), flush=True)


class Trainer:
    """The training loop of one run; ``Trainer.from_config(config).train()`` runs it to
    ``train.epochs``. Each step of an epoch (see the module) can be called, tested and
    overridden on its own.

    Args:
        config: the run (:func:`~mogo_diffusion.checks.check_config` refuses a bad one).
        pipeline: the SD3 pipeline whose transformer carries the trained and old LoRA adapters
            (:func:`mogo_diffusion.models.add_lora`); moved to the accelerator's device, its
            adapters made float32 whatever the frozen weights' dtype.
        rewards: the rewards of ``config.rewards``, in order.
        prompts: the training prompts an epoch draws from (:func:`~mogo_diffusion.prompts.load_prompt_pool`).
        eval_prompts: the evaluation prompts (None: no evaluation).
        strategy: the strategy (default :func:`~mogo_diffusion.strategies.make_strategy` of
            ``config``).
        accelerator: the processes and trackers (default: built from ``config``); its own mixed
            precision is not used: the trainer's autocast and ``scaler`` are.
        scaler: the gradient scaler (default: a ``torch.amp.GradScaler`` on the device, enabled
            for ``train.mixed_precision: fp16`` only).

    Raises:
        ConfigError: :func:`~mogo_diffusion.checks.check_config` refuses the config (the split
            checked over the accelerator's processes).
        ValueError: the transformer has no LoRA adapters, or ``rewards`` are not the config's.
    """

    @classmethod
    def from_config(
        cls,
        config: Config,
        *,
        pipeline: diffusers.StableDiffusion3Pipeline | None = None,
        strategy: Strategy | None = None,
        accelerator: Accelerator | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> Trainer:
        """The trainer of ``config`` with the components it names: the accelerator, the prompts,
        the pipeline (loaded from ``model.pretrained``, ``revision`` and ``variant`` in
        ``model.dtype`` unless given; a given one is trained in its own dtype, and must carry no
        adapters), the LoRA adapters (:func:`~mogo_diffusion.models.add_lora`, initialised from
        the run's ``"lora_init"`` stream) and the rewards. The config is checked before anything
        is loaded, the model (:func:`~mogo_diffusion.checks.check_model`) once it is; loading
        shows no third-party progress bars (:func:`~mogo_diffusion.quiet.quiet_loading`).

        Raises:
            ConfigError: the config, its prompt sources or its model are refused, naming the field.
        """
        check_config(config)
        accelerator = accelerator or _accelerator(config)
        check_split(config, accelerator.num_processes)
        default = PromptSet(list(DEFAULT_PROMPTS), [{} for _ in DEFAULT_PROMPTS])
        prompts = _read_prompts(load_prompt_pool, config.sampling.prompts or default, "sampling.prompts")
        eval_prompts = (
            None
            if config.sampling.eval_prompts is None
            else _read_prompts(load_prompt_set, config.sampling.eval_prompts, "sampling.eval_prompts")
        )
        with quiet_loading():
            if pipeline is None:
                pipeline = models.load_pipeline(
                    config.model.pretrained,
                    revision=config.model.revision,
                    variant=config.model.variant,
                    torch_dtype=_DTYPES[config.model.dtype],
                )
            rewards = MultiReward(
                [make_reward(spec.name, **spec.options) for spec in config.rewards],
                threads=config.train.reward_threads,
            )
        pipeline.to(accelerator.device)  # the adapter's initialisation draws on the device's generator
        check_model(config, pipeline.transformer, pipeline.vae_scale_factor)
        with torch.random.fork_rng(devices=[]):  # the adapter's Gaussian init, from its own stream
            torch.manual_seed(stream_seed(config.train.seed, "lora_init"))
            m = config.model
            models.add_lora(pipeline.transformer, m.lora_rank, m.lora_alpha, targets=m.lora_targets)
        return cls(
            config, pipeline, rewards, prompts, eval_prompts,
            strategy=strategy, accelerator=accelerator, scaler=scaler,
        )  # fmt: skip

    def __init__(
        self,
        config: Config,
        pipeline: diffusers.StableDiffusion3Pipeline,
        rewards: MultiReward,
        prompts: PromptPool,
        eval_prompts: PromptSet | None = None,
        *,
        strategy: Strategy | None = None,
        accelerator: Accelerator | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        check_config(config)
        self.config = config
        self.out = Path(config.train.out_dir)
        self.accelerator = accelerator or _accelerator(config)
        self.world = self.accelerator.num_processes
        check_split(config, self.world)  # check_config's split, over this run's processes
        self.device = self.accelerator.device
        self.mixed_precision = _precision(config.train.mixed_precision, self.device)
        self.scaler = scaler or torch.amp.GradScaler(self.device.type, enabled=self.mixed_precision == "fp16")
        self.pipeline = pipeline.to(self.device)
        self.transformer = pipeline.transformer
        if self.mixed_precision == "bf16" and self.device.type == "cpu":
            use_float32_attention(self.transformer)  # the CPU's bfloat16 attention backward is slow
        if not getattr(self.transformer, "peft_config", None):
            raise ValueError(
                "pipeline.transformer has no LoRA adapters: add them with mogo_diffusion.models.add_lora, "
                "or build the trainer with Trainer.from_config"
            )
        if should_compile(config.train.compile, config.train.epochs, self.device.type, self.mixed_precision):
            compile_transformer(self.transformer)
        self.params = models.lora_parameters(self.transformer)
        for p in self.params:  # trained in float32 whatever the frozen weights' dtype
            p.data = p.data.float()
        # diffusers' EMAModel holds the evaluation EMA and swaps it in for an evaluation (store,
        # copy_to, restore); its step() is not used: its decay warms up from 0 (a constant decay
        # is asked for) and its update rounds otherwise than lerp_, which earlier runs used.
        self.eval_ema = EMAModel(self.params, decay=config.train.eval_ema_decay)
        self.names = [spec.name for spec in config.rewards]
        if list(rewards.names) != self.names:
            raise ValueError(f"rewards {list(rewards.names)} are not the config's rewards {self.names}")
        self.rewards = rewards.to(self.device)
        self.prompts = prompts
        self.eval_prompts = eval_prompts
        self.eval_images: torch.Tensor | None = None
        self._eval_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.strategy = strategy or make_strategy(config, self.world)
        self.optimizer = self.strategy.build(self.params)
        self.epoch = 0
        self._continuing = False  # resumed, or trained here already: train() continues a run

    # ---- the run ---------------------------------------------------------------------------------

    def train(self, epochs: int | None = None, *, overwrite: bool = False) -> list[dict[str, Any]]:
        """Train until ``epochs`` (default ``train.epochs``) epochs are done; returns their metrics.

        The run directory (``train.out_dir``; :mod:`mogo_diffusion.run_dir`) is claimed for the
        whole call, and must hold no run unless this trainer continues the one it holds (resumed
        from its checkpoint, or trained before), or ``overwrite`` deletes that run first. A run
        started afresh first evaluates the pretrained model. Its finished marker is written last,
        after the final checkpoint and the figures.

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
        fresh = not self._continuing
        with self._claimed(overwrite):
            if self.accelerator.log_with:
                self.accelerator.init_trackers("mogo_diffusion", config=_hyperparameters(self.config))
            history = self._train_until(end, fresh=fresh)
            if not history:  # resumed at the end: its final checkpoint belongs in this directory
                self.save()
            for tracker in self.accelerator.trackers:  # end_training would also end the process group
                tracker.finish()
            if self.accelerator.is_main_process:
                if history:
                    self.save_figures()
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

    def _train_until(self, end: int, *, fresh: bool) -> list[dict[str, Any]]:
        """Train, log, evaluate and save epochs ``self.epoch .. end - 1``; returns their metrics.
        A ``fresh`` run first logs the evaluation of the adapters at their initialisation (the
        pretrained model: LoRA's ``B`` is 0) as the record of epoch
        :data:`~mogo_diffusion.run_dir.PRETRAINED_EPOCH`; trackers get epochs 0 on only."""
        train = self.config.train
        main = self.accelerator.is_main_process
        history = []
        with EpochProgress(self.epoch, end, enabled=main) as progress:
            if fresh and (pretrained := self.evaluate()):
                run_dir.append_metrics(self.out, {"epoch": PRETRAINED_EPOCH, **pretrained})
                progress.evaluated("pretrained model", pretrained)
            for epoch in range(self.epoch, end):
                metrics = self.train_epoch(epoch)
                self.epoch = epoch + 1
                if self.epoch % train.eval_every == 0 or self.epoch == end:
                    metrics.update(self.evaluate())
                history.append(metrics)
                logged = epoch % train.log_every == 0 or self.epoch == end
                if main and logged:
                    run_dir.append_metrics(self.out, metrics)
                    self.accelerator.log({k: v for k, v in metrics.items() if k != "epoch"}, step=epoch)
                progress.epoch(metrics, logged=logged)
                if self.epoch % train.checkpoint_every == 0 or self.epoch == end:
                    self.save()
        return history

    # ---- one epoch, step by step -----------------------------------------------------------------

    def train_epoch(self, epoch: int) -> dict[str, Any]:
        """Sample, score, advantages, plan, then :meth:`gradients` and :meth:`update` for each of
        ``train.steps_per_epoch`` groups of consecutive micro-batches (one a step when None), then
        :meth:`end_epoch`; returns the epoch's :meth:`metrics`."""
        start = time.perf_counter()
        batch = self.score(self.sample(epoch))
        sampled = time.perf_counter()
        advantages = self.advantages(batch, epoch)[batch.local]
        parts = self.plan(batch, advantages, epoch)
        kl = torch.zeros((), dtype=torch.float64, device=self.device)
        for group in torch.arange(len(parts)).tensor_split(self.config.train.steps_per_epoch or len(parts)):
            kl += self.gradients(batch, [parts[i] for i in group.tolist()])
            self.update()
        self.end_epoch(epoch)
        seconds = time.perf_counter() - start
        return self.metrics(epoch, batch, parts, kl, seconds=seconds, sampling_seconds=sampled - start)

    def sample(self, epoch: int) -> Batch:
        """The epoch's prompts and images, sampled with the old adapter (``rewards`` not yet set).

        Every process draws the same prompts and noise and samples its own whole groups (rows
        ``local``)."""
        sampling = self.config.sampling
        draws = self.stream("sampling", epoch)
        chosen = self.prompts.draw(sampling.prompts_per_epoch, draws)
        rows = [i for i in chosen.tolist() for _ in range(sampling.group_size)]
        prompts = [self.prompts.prompts[i] for i in rows]
        metadata = [self.prompts.metadata[i] for i in rows]
        share = len(prompts) // self.world
        local = slice(self.accelerator.process_index * share, (self.accelerator.process_index + 1) * share)
        noise = torch.randn(self.latent_shape(len(prompts)), generator=draws)[local]
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

    def advantages(self, batch: Batch, epoch: int) -> torch.Tensor:
        """``[B, J]`` advantages of the scored ``batch``, one column per objective the strategy
        trains (K for marble, 1 for the others)."""
        return self.strategy.advantages(batch.rewards, batch.prompts, epoch)

    def plan(self, batch: Batch, advantages: torch.Tensor, epoch: int) -> list[MicroBatch]:
        """The epoch's training forwards: this process's rows of ``batch`` in a random order, in
        micro-batches of ``train.batch_size``, each with its rows of ``advantages [b, J]`` (local
        rows), ``max(1, int(train.timestep_fraction * num_steps))`` of the sampler's timesteps
        (distinct, in increasing order) and their noise; drawn from the epoch's ``"training"``
        stream, the same on every process and in a resumed run."""
        train = self.config.train
        draws = self.stream("training", epoch)
        steps = len(batch.timesteps)
        count = max(1, int(train.timestep_fraction * steps))
        order = torch.randperm(len(batch.latents), generator=draws)
        parts = []
        for begin in range(0, len(order), train.batch_size):
            index = order[begin : begin + train.batch_size]
            chosen = torch.randperm(steps, generator=draws)[:count].sort().values
            noise = torch.randn((len(chosen), *batch.latents[index].shape), generator=draws)
            parts.append(MicroBatch(index, advantages[index], chosen.tolist(), noise))
        return parts

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
            "timestep": batch.timesteps[j].repeat(len(index)).to(x_t.device),  # a copy: one compiled graph
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

    def update(self) -> None:
        """Clip the (unscaled) gradient and step; a step whose gradient overflowed is skipped
        and the scale lowered (``fp16``)."""
        if self.config.train.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.config.train.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def end_epoch(self, epoch: int) -> None:
        """After ``epoch``'s steps: the old adapter follows the trained one by EMA with decay
        ``min(train.old_decay_rate * epoch, train.old_decay_max)``
        (:func:`~mogo_diffusion.models.ema_update`), and the evaluation EMA with decay
        ``train.eval_ema_decay``: ``ema <- ema + (1 - decay) (theta - ema)``."""
        train = self.config.train
        models.ema_update(self.transformer, min(train.old_decay_rate * epoch, train.old_decay_max))
        with torch.no_grad():
            for ema, p in zip(self.eval_ema.shadow_params, self.params, strict=True):
                ema.lerp_(p.detach(), 1 - train.eval_ema_decay)

    def metrics(
        self,
        epoch: int,
        batch: Batch,
        parts: Sequence[MicroBatch],
        kl: torch.Tensor,
        *,
        seconds: float,
        sampling_seconds: float,
    ) -> dict[str, Any]:
        """The record of ``epoch``: its ``seconds`` (``sampling_seconds`` of them sampling and
        scoring), ``images_per_second``, the mean ``kl`` term per trained forward of ``parts``
        (``kl`` their sum), the rewards' batch means ``reward/{name}`` and the strategy's own
        metrics (:meth:`Strategy.metrics <mogo_diffusion.strategies.Strategy.metrics>`)."""
        metrics: dict[str, Any] = {"epoch": epoch, "seconds": seconds, "sampling_seconds": sampling_seconds}
        metrics["images_per_second"] = len(batch.prompts) / seconds
        metrics["kl"] = float(kl) / max(1, sum(len(part.timesteps) for part in parts))
        means = nan_mean(batch.rewards).tolist()
        metrics.update({f"reward/{name}": m for name, m in zip(self.names, means, strict=True)})
        metrics.update(self.strategy.metrics())
        return metrics

    # ---- evaluation --------------------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """The evaluation EMA's mean rewards on ``sampling.eval_prompts`` (``eval/{name}``), from
        noise seeded by :data:`EVAL_SEED`, and the rewards' diagnostics (``diagnostic/{name}``);
        keeps the images in ``eval_images``. On the main process only (the others return ``{}``);
        empty without eval prompts. The trained adapter is left as it was."""
        if self.eval_prompts is None or not self.accelerator.is_main_process:
            return {}
        prompts, metadata = self.eval_prompts
        embeds, pooled, noise = self._eval_inputs()
        self.eval_ema.store(self.params)
        self.eval_ema.copy_to(self.params)
        try:
            with torch.no_grad(), models.merged(self.transformer, models.TRAINED):
                _, images = self._sample(embeds, pooled, noise, self.config.sampling.eval_num_steps)
        finally:
            self.eval_ema.restore(self.params)
        self.eval_images = images
        means = nan_mean(self.rewards(images, prompts, metadata).values)
        metrics = {f"eval/{name}": float(m) for name, m in zip(self.names, means, strict=True)}
        metrics.update({f"diagnostic/{k}": v for k, v in self.rewards.diagnostics(images).items()})
        return metrics

    def save_figures(self) -> None:
        """``samples.png`` (after an evaluation: the pretrained and the last evaluation's images of
        the first :data:`SAMPLES_SHOWN` distinct evaluation prompts;
        :func:`~mogo_diffusion.figures.save_comparison`) and ``curves.png``
        (:func:`~mogo_diffusion.figures.plot_run`) in the run directory."""
        if self.eval_images is not None:
            rows = figures.first_rows(self.eval_prompts.prompts, SAMPLES_SHOWN)
            prompts = [self.eval_prompts.prompts[i] for i in rows]
            trained = self.eval_images[torch.tensor(rows)]
            figures.save_comparison(self.base_samples(rows), trained, prompts, self.out / "samples.png")
        figures.plot_run(self.out)

    def base_samples(self, rows: Sequence[int]) -> torch.Tensor:
        """The pretrained model's images (adapters disabled) of the evaluation rows ``rows``, from
        the noise :meth:`evaluate` gives them: what its images are compared with."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        embeds, pooled, noise = (part[index.to(part.device)] for part in self._eval_inputs())
        with models.reference(self.transformer):
            _, images = self._sample(embeds, pooled, noise, self.config.sampling.eval_num_steps)
        return images

    def _eval_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The evaluation prompts' embeddings and pooled embeddings, and the evaluation noise (one
        row per prompt, seeded by :data:`EVAL_SEED`); computed once, they are the same at every
        evaluation."""
        if self._eval_cache is None:
            prompts = self.eval_prompts.prompts
            length = self.config.model.max_sequence_length
            embeds, pooled = models.encode_prompts(self.pipeline, prompts, length)
            draws = torch.Generator().manual_seed(EVAL_SEED)
            noise = torch.randn(self.latent_shape(len(prompts)), generator=draws).to(self.device)
            self._eval_cache = (embeds, pooled, noise)
        return self._eval_cache

    # ---- checkpoints -------------------------------------------------------------------------------

    def save(self) -> Path:
        """Write a checkpoint of :meth:`state`, its diffusers-format ``lora/`` export included in the
        same atomic rename (on the main process; every process has the same state), and return
        its path."""
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

    def state(self) -> dict[str, Any]:
        """Everything a resumed run needs (:data:`~mogo_diffusion.resumable.STATE_FIELDS`):
        adapters, evaluation EMA, optimizer, gradient scaler (its scale and growth tracker; empty
        when disabled), epoch, config."""
        return {
            "epoch": self.epoch,
            "trained": [p.detach() for p in self.params],
            "old": [p.detach() for p in models.lora_parameters(self.transformer, models.OLD)],
            "eval_ema": self.eval_ema.shadow_params,
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "config": self.config.to_dict(),
        }

    resume_may_change: frozenset[str] = run_dir.RESUME_MAY_CHANGE
    """The config fields a resumed run may set apart from its checkpoint's (what is logged, evaluated
    and saved, and how long it runs; :data:`mogo_diffusion.run_dir.RESUME_MAY_CHANGE`). A resume
    refuses every other difference: the saved state (optimizer, amortizer, adapters) carries the
    checkpoint's values of some (``train.lr``, ``strategy.harmonize_every``), and changing the
    others would continue a different run."""

    def resume(self, path: str | Path) -> None:
        """Continue from a checkpoint directory, or ``"latest"`` in this run's directory.

        Everything is checked before anything of the running state changes: the files against
        their hashes (:func:`~mogo_diffusion.checkpoint.load_checkpoint`), then the state
        (:func:`~mogo_diffusion.resumable.check_resumable`: its structure, the tensors' shapes
        and dtypes, an epoch within ``train.epochs``, the gradient scaler's fields, and this run's
        config against the checkpoint's, equal but for :attr:`resume_may_change`). The
        optimizer's state is tried last, and the optimizer restored when it does not fit.

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
        old = models.lora_parameters(self.transformer, models.OLD)
        check_resumable(state, path, self.config, trained=self.params, old=old, scaler=self.scaler)
        previous = copy.deepcopy(self.optimizer.state_dict())
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as error:
            self.optimizer.load_state_dict(previous)
            where = repr(str(path / "state.json"))
            raise CheckpointError(
                f"{where}: field 'optimizer' does not fit this run's optimizer: {error!r}"
            ) from error
        with torch.no_grad():
            for p, value in zip([*self.params, *old], [*state["trained"], *state["old"]], strict=True):
                p.copy_(value)
        self.scaler.load_state_dict(state["scaler"])
        self.eval_ema.shadow_params = [
            t.to(p.device) for t, p in zip(state["eval_ema"], self.params, strict=True)
        ]
        self.epoch = state["epoch"]
        self._continuing = True

    # ---- what the steps share ----------------------------------------------------------------------

    def stream(self, purpose: str, epoch: int) -> torch.Generator:
        """The generator of ``purpose`` (``"sampling"``, ``"training"``) in ``epoch``
        (:func:`mogo_diffusion.streams.generator`): the same on every process and in a resumed
        run, independent of every other stream."""
        return generator(self.config.train.seed, purpose, epoch)

    def seed_of(self, purpose: str, *index: int) -> int:
        """The seed of the run's random stream ``(purpose, *index)``
        (:func:`mogo_diffusion.streams.stream_seed`)."""
        return stream_seed(self.config.train.seed, purpose, *index)

    def latent_shape(self, rows: int) -> tuple[int, int, int, int]:
        """``(rows, C, h, h)``: the latents of ``rows`` images of ``sampling.resolution`` pixels a
        side, ``h`` = :func:`mogo_diffusion.models.latent_size` (what ``--check`` counts too)."""
        side = models.latent_size(
            self.config.sampling.resolution, self.transformer.config, self.pipeline.vae_scale_factor
        )
        return (rows, self.transformer.config.in_channels, side, side)

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

    def autocast(self) -> AbstractContextManager:
        """The autocast of every transformer forward (sampling, the old, reference and trained
        velocities; ``train.mixed_precision``), or nothing for ``"no"``. What they feed stays
        float32: the sampler's state, the NFT loss and KL terms, the advantages and the QP."""
        if self.mixed_precision == "no":
            return nullcontext()
        dtype = torch.bfloat16 if self.mixed_precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _accelerator(config: Config) -> Accelerator:
    """The accelerator of a run: its processes, and the trackers of ``train.log_with`` writing
    under ``train.out_dir/trackers``."""
    return Accelerator(
        log_with=config.train.log_with or None, project_dir=Path(config.train.out_dir) / "trackers"
    )


def _read_prompts(load: Callable[[Any], Any], source: Any, field: str) -> Any:
    """``load(source)``, its errors as a :class:`ConfigError` naming ``field``."""
    try:
        return load(source)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{field}: {error}") from None


def _precision(mixed_precision: str, device: torch.device) -> str:
    """``train.mixed_precision`` with ``"auto"`` resolved: bf16 on a CUDA device that has it, else no."""
    if mixed_precision != "auto":
        return mixed_precision
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "no"


def _hyperparameters(config: Config) -> dict[str, Any]:
    """The config as flat ``section.key`` scalars (what trackers accept as hyper-parameters)."""
    flat: dict[str, Any] = {}
    for section, values in config.to_dict().items():
        items = values.items() if isinstance(values, dict) else [(str(i), v) for i, v in enumerate(values)]
        for key, value in items:
            scalar = value if isinstance(value, int | float | str | bool) else json.dumps(value)
            flat[f"{section}.{key}"] = scalar
    return flat


if __name__ == "__main__":
    main()
