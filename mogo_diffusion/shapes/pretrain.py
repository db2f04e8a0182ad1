"""Pretrain the tiny SD3 pipeline and a tiny CLIP on the shapes world, deterministically.

``python -m mogo_diffusion.shapes.pretrain --out DIR`` runs three phases on a pool of rendered
training scenes (:func:`~mogo_diffusion.shapes.scenes.sample_scenes`, split ``"train"``):

1. ``vae``: the 3-level, 16-channel VAE of :func:`~mogo_diffusion.models.tiny_sd3` learns to
   reconstruct the scenes (``||D(z) - x||^2 + kl_weight KL(q(z|x) || N(0, I))``, z sampled), then
   ``shift_factor`` and ``scaling_factor`` are set so that the scaled latents
   ``(mode(q(z|x)) - shift) * scale`` have mean 0 and variance 1 over the pool;
2. ``transformer``: the "small" SD3 transformer learns flow matching on (scaled latent, caption):
   ``x_t = (1 - t) x0 + t eps``, loss ``||v(x_t, 1000 t, c) - (eps - x0)||^2``, with
   ``t = s u / (1 + (s - 1) u)``, ``u = sigmoid(N(0, 1))`` (SD3's logit-normal, diffusers'
   ``compute_density_for_timestep_sampling``, shifted by the scheduler's shift s) and no caption
   dropout (our sampler is CFG-free). Text embeddings are computed once per distinct caption; the
   saved weights are an EMA of the trained ones (diffusers' ``EMAModel``). The
   whole pipeline is saved to ``DIR`` (safetensors, fp32), for
   :func:`mogo_diffusion.models.load_pipeline`;
3. ``clip``: a tiny :class:`~transformers.CLIPModel` (width 64, 3 + 3 layers, 32 px, patch 4) learns
   the symmetric contrastive loss on (image, caption), half of the images replaced by their VAE
   reconstructions so that it reads generated images too; captions that repeat within a batch are
   all positives. Saved with its tokenizer and a 32 px :class:`~transformers.CLIPImageProcessor`
   (the pool's mean and std) to ``DIR/clip``, for ``CLIPModel.from_pretrained`` and
   ``CLIPProcessor.from_pretrained``.

Phases not listed in ``--phases`` are loaded from ``DIR`` where a later phase needs them (the VAE),
so one phase can be rerun alone. ``DIR/pretrain_report.json`` records the settings, the losses,
and the evaluations: reconstruction error, caption following of sampled images (read by
:func:`~mogo_diffusion.shapes.detect.detect`), and CLIP's zero-shot caption retrieval on held-out
scenes. The same arguments and thread count give the same files.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL, SD3Transformer2DModel, StableDiffusion3Pipeline
from diffusers.training_utils import EMAModel, compute_density_for_timestep_sampling
from torch import Tensor, nn
from torch.nn import functional
from tqdm.auto import tqdm
from transformers import (
    CLIPConfig,
    CLIPImageProcessor,
    CLIPModel,
    CLIPProcessor,
    CLIPTextConfig,
    CLIPTokenizer,
    CLIPVisionConfig,
)

from mogo_diffusion import streams
from mogo_diffusion.models import encode_prompts, load_component, tiny_sd3
from mogo_diffusion.sampling import decode, encode, sample
from mogo_diffusion.shapes.detect import check, detect_batch
from mogo_diffusion.shapes.scenes import (
    MAX_SEQUENCE_LENGTH,
    SIZE,
    Scene,
    all_prompts,
    corpus,
    render_batch,
    sample_scenes,
)
from mogo_diffusion.streams import stream_seed
from mogo_diffusion.tokenizers import clip_tokenizer

__all__ = [
    "PHASES",
    "Pools",
    "Settings",
    "build_clip",
    "caption_following",
    "caption_phase",
    "clip_phase",
    "clip_processor",
    "flow_matching_loss",
    "latent_factors",
    "main",
    "retrieval_accuracy",
    "train_clip",
    "train_transformer",
    "train_vae",
    "transformer_phase",
    "vae_phase",
]

PHASES: tuple[str, ...] = ("vae", "transformer", "clip")


@dataclass(frozen=True)
class Settings:
    """Everything that decides the result (the CLI's options)."""

    seed: int = 0
    scenes: int = 16384
    vae_steps: int = 400
    vae_batch: int = 64
    vae_lr: float = 2e-3
    kl_weight: float = 1e-6
    steps: int = 2600
    batch: int = 32
    lr: float = 1e-3
    warmup: int = 100
    ema: float = 0.999
    clip_steps: int = 600
    clip_batch: int = 128
    clip_lr: float = 2e-3
    eval_prompts: int = 64
    eval_steps: int = 10
    threads: int = 2


# Schedules ----------------------------------------------------------------------------------------


def _cosine(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warmup over ``warmup`` steps, then cosine decay to 0 at ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def _batches(n: int, batch: int, steps: int, generator: torch.Generator) -> Any:
    """``steps`` index batches drawn from fresh permutations of ``range(n)`` (epochs without repeats)."""
    order = torch.empty(0, dtype=torch.long)
    for _ in range(steps):
        while order.numel() < batch:
            order = torch.cat([order, torch.randperm(n, generator=generator)])
        yield order[:batch]
        order = order[batch:]


# VAE ----------------------------------------------------------------------------------------------


def train_vae(
    vae: AutoencoderKL,
    images: Tensor,
    *,
    steps: int,
    batch: int,
    lr: float,
    kl_weight: float,
    l1_weight: float = 0.0,
    generator: torch.Generator,
) -> list[float]:
    """Train ``vae`` in place on ``[N, 3, H, W]`` images in [0, 1]; returns the per-step losses.

    Loss: ``mean (D(z) - x)^2 + l1_weight mean |D(z) - x| + kl_weight * mean KL`` on
    ``x = 2 images - 1``, ``z ~ q(z|x)`` drawn from ``generator``. AdamW, warmup 20 steps, cosine
    decay; the VAE is left in eval mode.
    """
    optimizer = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _cosine(min(20, steps), steps))
    losses = []
    vae.train()
    progress = tqdm(_batches(len(images), batch, steps, generator), total=steps, desc="vae", mininterval=2)
    for index in progress:
        x = images[index] * 2 - 1
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(
            posterior.mean.shape, generator=generator, dtype=posterior.mean.dtype
        )
        error = vae.decode(z).sample - x
        loss = (
            error.square().mean()
            + l1_weight * error.abs().mean()
            + kl_weight * posterior.kl().mean() / z[0].numel()
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        progress.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
    vae.eval()
    return losses


@torch.no_grad()
def latent_factors(vae: AutoencoderKL, images: Tensor, batch: int = 512) -> tuple[float, float]:
    """``(shift, scale)`` with ``shift`` the mean and ``1 / scale`` the std of ``mode(q(z|x))``."""
    vae.eval()
    modes = torch.cat(
        [vae.encode(images[i : i + batch] * 2 - 1).latent_dist.mode() for i in range(0, len(images), batch)]
    )
    return float(modes.mean()), float(1 / modes.std())


@torch.no_grad()
def _map_batches(fn: Callable[[Tensor], Tensor], x: Tensor, batch: int = 512) -> Tensor:
    return torch.cat([fn(x[i : i + batch]) for i in range(0, len(x), batch)])


# Transformer --------------------------------------------------------------------------------------


def flow_matching_loss(
    transformer: SD3Transformer2DModel,
    x0: Tensor,
    embeds: Tensor,
    pooled: Tensor,
    *,
    shift: float,
    generator: torch.Generator,
) -> Tensor:
    """The rectified-flow loss ``mean ||v(x_t, 1000 t) - (eps - x0)||^2`` (see the module doc).

    Args:
        x0: ``[B, C, h, w]`` scaled clean latents.
        embeds, pooled: ``[B, S, D]`` and ``[B, Dp]`` text embeddings.
        shift: the scheduler's shift s of the logit-normal times.
        generator: RNG of the times and the noise.
    """
    u = compute_density_for_timestep_sampling(
        "logit_normal", x0.shape[0], logit_mean=0.0, logit_std=1.0, generator=generator
    )
    t = shift * u / (1 + (shift - 1) * u)
    eps = torch.randn(x0.shape, generator=generator)
    x_t = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * eps
    v = transformer(
        hidden_states=x_t,
        timestep=1000 * t,
        encoder_hidden_states=embeds,
        pooled_projections=pooled,
        return_dict=False,
    )[0]
    return functional.mse_loss(v.float(), eps - x0)


def train_transformer(
    transformer: SD3Transformer2DModel,
    latents: Tensor,
    caption_index: Tensor,
    embeds: Tensor,
    pooled: Tensor,
    *,
    shift: float,
    steps: int,
    batch: int,
    lr: float,
    warmup: int,
    ema: float,
    generator: torch.Generator,
) -> list[float]:
    """Train ``transformer`` by :func:`flow_matching_loss`; at the end its weights are the EMA.

    Args:
        latents: ``[N, C, h, w]`` scaled latents of the pool.
        caption_index: ``[N]`` row of each latent's caption in ``embeds`` / ``pooled``.
        embeds, pooled: ``[P, S, D]``, ``[P, Dp]`` embeddings of the P distinct captions.
        ema: the largest decay of the weight average (diffusers' ``EMAModel``: the trained weights
            after the first step, then decay ``min(ema, k / (9 + k))`` after step k = 2, 3, ...).

    Returns:
        The per-step losses.
    """
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.99))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _cosine(warmup, steps))
    average = EMAModel(params, decay=ema)
    losses = []
    transformer.train()
    progress = tqdm(
        _batches(len(latents), batch, steps, generator), total=steps, desc="transformer", mininterval=2
    )
    for index in progress:
        rows = caption_index[index]
        loss = flow_matching_loss(
            transformer, latents[index], embeds[rows], pooled[rows], shift=shift, generator=generator
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        average.step(params)
        losses.append(loss.item())
        progress.set_postfix(loss=f"{sum(losses[-50:]) / len(losses[-50:]):.4f}", refresh=False)
    average.copy_to(params)
    transformer.eval()
    return losses


@torch.no_grad()
def caption_following(
    pipeline: StableDiffusion3Pipeline,
    scenes: Sequence[Scene],
    *,
    num_steps: int = 10,
    seed: int = 0,
    batch: int = 64,
) -> tuple[dict[str, float], Tensor]:
    """Sample one image per scene caption (Euler, CFG-free) and check it against the scene's metadata.

    Returns:
        ``(rates, images)``: for each field of :class:`~mogo_diffusion.shapes.detect.Checks` the
        fraction of images where it holds, over the images where it applies; and the
        ``[B, 3, 32, 32]`` images.
    """
    generator = torch.Generator().manual_seed(seed)
    images = []
    for i in range(0, len(scenes), batch):
        chunk = scenes[i : i + batch]
        embeds, pooled = encode_prompts(pipeline, [s.prompt for s in chunk])
        out = sample(pipeline.transformer, pipeline.scheduler, embeds, pooled, num_steps, generator=generator)
        images.append(decode(pipeline.vae, out.latents))
    images_ = torch.cat(images)
    checks = [asdict(check(d, s.metadata)) for d, s in zip(detect_batch(images_), scenes, strict=True)]
    rates = {}
    for key in checks[0]:
        values = [c[key] for c in checks if c[key] is not None]
        rates[key] = sum(values) / len(values) if values else float("nan")
    return rates, images_


# CLIP ---------------------------------------------------------------------------------------------


def build_clip(tokenizer: CLIPTokenizer, *, seed: int = 0) -> CLIPModel:
    """A tiny CLIP (text and vision width 64, 3 layers each, 32 px images in 4 px patches)."""
    text = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=SIZE,
        patch_size=4,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIPModel(
            CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=64)
        )
    return model.eval()


def clip_processor(tokenizer: CLIPTokenizer, mean: Sequence[float], std: Sequence[float]) -> CLIPProcessor:
    """A processor that maps 8-bit images to what :func:`train_clip` fed the model.

    ``(x / 255 - mean) / std`` per channel after a resize of the short side to 32 px and a 32 px
    centre crop (both the identity on 32 px images).
    """
    images = CLIPImageProcessor(
        do_resize=True,
        size={"shortest_edge": SIZE},
        resample=3,
        do_center_crop=True,
        crop_size={"height": SIZE, "width": SIZE},
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=[float(v) for v in mean],
        image_std=[float(v) for v in std],
        do_convert_rgb=True,
    )
    return CLIPProcessor(image_processor=images, tokenizer=tokenizer)


def _normalize(images: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """As the processor: 8-bit rounding, then ``(x - mean) / std``."""
    return ((images * 255).round() / 255 - mean[:, None, None]) / std[:, None, None]


def _tokens(tokenizer: CLIPTokenizer, captions: Sequence[str]) -> dict[str, Tensor]:
    return dict(tokenizer(list(captions), padding="max_length", truncation=True, return_tensors="pt"))


def train_clip(
    model: CLIPModel,
    tokenizer: CLIPTokenizer,
    images: Tensor,
    captions: Sequence[str],
    *,
    mean: Tensor,
    std: Tensor,
    steps: int,
    batch: int,
    lr: float,
    generator: torch.Generator,
) -> list[float]:
    """Contrastive training of ``model`` on ``[N, 3, H, W]`` images in [0, 1] and their N captions.

    Loss: the mean of the image-to-text and text-to-image cross-entropies of
    ``exp(logit_scale) cos(image_i, text_j)``, the target of each row spread evenly over the items
    with the same caption. AdamW (weight decay 0.1), warmup 50 steps, cosine decay.
    """
    distinct = list(dict.fromkeys(captions))
    position = {c: i for i, c in enumerate(distinct)}
    caption_id = torch.tensor([position[c] for c in captions])
    tokens = _tokens(tokenizer, distinct)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _cosine(min(50, steps), steps))
    losses = []
    model.train()
    progress = tqdm(_batches(len(images), batch, steps, generator), total=steps, desc="clip", mininterval=2)
    for index in progress:
        ids = caption_id[index]
        text = model.get_text_features(**{k: v[ids] for k, v in tokens.items()})
        image = model.get_image_features(pixel_values=_normalize(images[index], mean, std))
        text, image = (getattr(f, "pooler_output", f) for f in (text, image))
        logits = (
            model.logit_scale.exp()
            * functional.normalize(image, dim=-1)
            @ functional.normalize(text, dim=-1).T
        )
        same = (ids[:, None] == ids[None, :]).float()
        target = same / same.sum(dim=1, keepdim=True)
        loss = (functional.cross_entropy(logits, target) + functional.cross_entropy(logits.T, target)) / 2
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        losses.append(loss.item())
        progress.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}", refresh=False)
    model.eval()
    return losses


@torch.no_grad()
def retrieval_accuracy(
    model: CLIPModel,
    processor: CLIPProcessor,
    images: Tensor,
    captions: Sequence[str],
    candidates: Sequence[str],
    *,
    k: int = 5,
) -> tuple[float, float]:
    """Zero-shot caption retrieval: how often an image's own caption ranks first (and in the top ``k``)
    among ``candidates`` by CLIP similarity. Images go through ``processor``, as a reward would.

    Returns:
        ``(top1, topk)`` accuracies in [0, 1].
    """
    position = {c: i for i, c in enumerate(candidates)}
    missing = [c for c in captions if c not in position]
    if missing:
        raise ValueError(f"captions missing from the candidates, e.g. {missing[0]!r}")
    text = model.get_text_features(**processor(text=list(candidates), padding=True, return_tensors="pt"))
    pixels = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    image = model.get_image_features(**processor(images=list(pixels), return_tensors="pt"))
    text, image = (getattr(f, "pooler_output", f) for f in (text, image))
    similarity = functional.normalize(image, dim=-1) @ functional.normalize(text, dim=-1).T
    target = torch.tensor([position[c] for c in captions])
    ranks = (similarity > similarity.gather(1, target[:, None])).sum(dim=1)
    return float((ranks == 0).float().mean()), float((ranks < k).float().mean())


# The command --------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    defaults = Settings()
    parser = argparse.ArgumentParser(
        prog="python -m mogo_diffusion.shapes.pretrain",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--out", required=True, type=Path, help="output directory (the pipeline; clip/ in it)"
    )
    parser.add_argument(
        "--phases",
        default=",".join(PHASES),
        help=f"comma-separated phases to run, of {','.join(PHASES)}; a skipped VAE is read from --out",
    )
    help_ = {
        "seed": "seed of the weights, the scenes and every random draw",
        "scenes": "training scenes in the pool",
        "vae_steps": "VAE training steps",
        "vae_batch": "VAE batch size",
        "vae_lr": "VAE peak learning rate",
        "kl_weight": "weight of the VAE's KL term (per latent element)",
        "steps": "transformer training steps",
        "batch": "transformer batch size",
        "lr": "transformer peak learning rate",
        "warmup": "transformer warmup steps",
        "ema": "transformer EMA decay",
        "clip_steps": "CLIP training steps (0: skip the phase)",
        "clip_batch": "CLIP batch size",
        "clip_lr": "CLIP peak learning rate",
        "eval_prompts": "sampled images per split for the caption-following check (0: none)",
        "eval_steps": "Euler steps of those samples",
        "threads": "torch threads",
    }
    for name, text in help_.items():
        value = getattr(defaults, name)
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value, help=text)
    return parser


def _log(report: dict[str, Any], out: Path, message: str) -> None:
    tqdm.write(message)
    (out / "pretrain_report.json").write_text(json.dumps(report, indent=2) + "\n")


def _summary(losses: Sequence[float]) -> dict[str, float]:
    tail = losses[-max(1, len(losses) // 20) :]
    return {"first": losses[0], "last_5pct": sum(tail) / len(tail)} if losses else {}


@dataclass
class Pools:
    """The rendered scenes the phases train and evaluate on: the training pool (``images``
    ``[N, 3, 32, 32]`` and their ``captions``) and 512 held-out scenes."""

    images: Tensor
    captions: list[str]
    heldout_images: Tensor
    heldout_captions: list[str]

    @classmethod
    def sample(cls, settings: Settings) -> Pools:
        scenes = sample_scenes(settings.scenes, stream_seed(settings.seed, "train_pool"), "train")
        heldout = sample_scenes(512, stream_seed(settings.seed, "heldout_pool"), "heldout")
        return cls(
            render_batch(scenes),
            [s.prompt for s in scenes],
            render_batch(heldout),
            [s.prompt for s in heldout],
        )


def vae_phase(pipeline: StableDiffusion3Pipeline, pools: Pools, settings: Settings, out: Path) -> dict:
    """Phase 1: train the VAE, set its latent shift and scale, save it to ``out/vae``; returns
    its report (losses, factors, reconstruction errors)."""
    started = time.perf_counter()
    losses = train_vae(
        pipeline.vae,
        pools.images,
        steps=settings.vae_steps,
        batch=settings.vae_batch,
        lr=settings.vae_lr,
        kl_weight=settings.kl_weight,
        generator=streams.generator(settings.seed, "vae"),
    )
    shift, scale = latent_factors(pipeline.vae, pools.images)
    pipeline.vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    pipeline.vae.save_pretrained(out / "vae")
    report = {"loss": _summary(losses), "shift_factor": shift, "scaling_factor": scale}
    report["seconds"] = time.perf_counter() - started
    for split, pool in (("train", pools.images[:2048]), ("heldout", pools.heldout_images)):
        recon = _map_batches(lambda x: decode(pipeline.vae, encode(pipeline.vae, x)), pool)
        report[f"reconstruction_mse_{split}"] = float(functional.mse_loss(recon, pool))
    return report


def transformer_phase(
    pipeline: StableDiffusion3Pipeline, pools: Pools, settings: Settings, out: Path
) -> dict:
    """Phase 2: train the transformer by flow matching on the pool's latents and captions, save
    the whole pipeline to ``out``; returns its report."""
    started = time.perf_counter()
    latents = _map_batches(lambda x: encode(pipeline.vae, x), pools.images)
    distinct = list(dict.fromkeys(pools.captions))
    position = {c: i for i, c in enumerate(distinct)}
    embeds, pooled = encode_prompts(pipeline, distinct)
    losses = train_transformer(
        pipeline.transformer,
        latents,
        torch.tensor([position[c] for c in pools.captions]),
        embeds,
        pooled,
        shift=float(pipeline.scheduler.config.shift),
        steps=settings.steps,
        batch=settings.batch,
        lr=settings.lr,
        warmup=min(settings.warmup, settings.steps),
        ema=settings.ema,
        generator=streams.generator(settings.seed, "transformer"),
    )
    pipeline.save_pretrained(out, safe_serialization=True)
    return {"loss": _summary(losses), "captions": len(distinct), "seconds": time.perf_counter() - started}


def caption_phase(pipeline: StableDiffusion3Pipeline, settings: Settings) -> dict:
    """After phase 2: caption following of ``eval_prompts`` sampled images per split."""
    return {
        split: caption_following(
            pipeline,
            sample_scenes(settings.eval_prompts, stream_seed(settings.seed, "caption_scenes", code), split),
            num_steps=settings.eval_steps,
            seed=stream_seed(settings.seed, "caption_noise", code),
        )[0]
        for code, split in enumerate(("train", "heldout"))
    }


def clip_phase(pipeline: StableDiffusion3Pipeline, pools: Pools, settings: Settings, out: Path) -> dict:
    """Phase 3: train the tiny CLIP (half of the images through the VAE), save it with its
    tokenizer and processor to ``out/clip``; returns its report (losses, retrieval accuracy)."""
    started = time.perf_counter()
    images, captions = pools.images, pools.captions
    tokenizer = clip_tokenizer(corpus(), model_max_length=MAX_SEQUENCE_LENGTH)
    mean, std = images.mean(dim=(0, 2, 3)), images.std(dim=(0, 2, 3))
    vae = pipeline.vae
    half = len(images) // 2  # the second half read through the VAE, as generated images are
    clip_images = torch.cat(
        [images[:half], _map_batches(lambda x: decode(vae, encode(vae, x)), images[half:])]
    )
    model = build_clip(tokenizer, seed=stream_seed(settings.seed, "clip_init"))
    losses = train_clip(
        model,
        tokenizer,
        clip_images,
        captions,
        mean=mean,
        std=std,
        steps=settings.clip_steps,
        batch=settings.clip_batch,
        lr=settings.clip_lr,
        generator=streams.generator(settings.seed, "clip"),
    )
    processor = clip_processor(tokenizer, mean.tolist(), std.tolist())
    model.save_pretrained(out / "clip")
    processor.save_pretrained(out / "clip")
    processor.image_processor.save_pretrained(out / "clip")  # preprocessor_config.json, for older loaders
    retrieval = {}
    for split, pool, pool_captions in (
        ("heldout", pools.heldout_images, pools.heldout_captions),
        ("train", images[:512], captions[:512]),
    ):
        candidates = all_prompts(split)
        top1, top5 = retrieval_accuracy(model, processor, pool, pool_captions, candidates)
        retrieval[f"retrieval_{split}"] = {"top1": top1, "top5": top5, "candidates": len(candidates)}
    return {
        "loss": _summary(losses),
        **retrieval,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": time.perf_counter() - started,
    }


def _settings(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[Settings, list[str], Path]:
    """The checked settings, phases and output directory of the command line."""
    args = parser.parse_args(argv)
    phases = [p for p in args.phases.split(",") if p]
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        parser.error(f"unknown phases {unknown}; expected some of {list(PHASES)}")
    settings = Settings(**{k: getattr(args, k) for k in Settings.__dataclass_fields__})
    for name in ("scenes", "vae_batch", "batch", "clip_batch", "eval_steps", "threads"):
        if getattr(settings, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(settings, name)}")
    if settings.seed < 0:
        parser.error(f"--seed must be >= 0, got {settings.seed}")
    out: Path = args.out
    if out.is_file():
        parser.error(f"--out {str(out)!r} is a file")
    if "vae" not in phases and "transformer" in phases and not (out / "vae").is_dir():
        parser.error(f"phase 'transformer' without 'vae' needs a trained VAE in {str(out / 'vae')!r}")
    return settings, phases, out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the command; returns the report (also written to ``OUT/pretrain_report.json``)."""
    settings, phases, out = _settings(_parser(), argv)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(settings.threads)
    torch.manual_seed(stream_seed(settings.seed, "global"))
    report_path = out / "pretrain_report.json"
    report: dict[str, Any] = json.loads(report_path.read_text()) if report_path.is_file() else {}
    report["settings"] = asdict(settings)
    started = time.perf_counter()
    pools = Pools.sample(settings)
    pipeline = tiny_sd3(
        "small",
        seed=stream_seed(settings.seed, "sd3_init"),
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        corpus=corpus(),
    )
    pipeline.set_progress_bar_config(disable=True)
    if "vae" in phases:
        report["vae"] = vae_phase(pipeline, pools, settings, out)
        _log(report, out, f"vae: {json.dumps(report['vae'])}")
    elif "transformer" in phases or "clip" in phases:
        pipeline.vae = load_component(out, "vae")
    if "transformer" in phases:
        report["transformer"] = transformer_phase(pipeline, pools, settings, out)
        _log(report, out, f"transformer: {json.dumps(report['transformer'])}")
        if settings.eval_prompts:
            report["caption_following"] = caption_phase(pipeline, settings)
            _log(report, out, f"caption following: {json.dumps(report['caption_following'])}")
    if "clip" in phases and settings.clip_steps:
        report["clip"] = clip_phase(pipeline, pools, settings, out)
        _log(report, out, f"clip: {json.dumps(report['clip'])}")
    report["seconds"] = time.perf_counter() - started
    _log(report, out, f"done in {report['seconds']:.0f} s: {out}")
    return report


if __name__ == "__main__":
    main()
