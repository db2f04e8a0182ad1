"""CFG-free ODE sampling of SD3 latents, and decoding them to images.

Convention (diffusers' SD3 flow matching: the scheduler's ``scale_noise`` and the training target
``noise - latents`` of its SD3 scripts): with t = sigma in (0, 1] (the transformer reads
``timestep = 1000 t``),

.. code-block:: text

    x_t = (1 - t) x0 + t eps,        v = eps - x0 (what the transformer predicts),
    x0  = x_t - t v,                 eps = x_t + (1 - t) v.

Sampling integrates ``dx/dt = v(x, t)`` from pure noise at ``t = sigma_0`` (1 for SD3's
schedulers) down the scheduler's shifted grid ``sigma_0 > ... > sigma_{N-1} > sigma_N = 0``:

* ``"euler"``: ``x <- x + (sigma_{i+1} - sigma_i) v``, step for step what
  ``StableDiffusion3Pipeline`` computes with ``guidance_scale=1``;
* ``"dpmpp2m"``: DPM-Solver++ (2M, Lu et al. 2022) on the data prediction ``x0_i = x - sigma_i v``,
  with ``lambda = log((1 - sigma) / sigma)``, ``h_i = lambda_{i+1} - lambda_i`` and
  ``c = sigma_{i+1} / sigma_i``:

  .. code-block:: text

      D = x0_i + (h_i / (2 h_{i-1})) (x0_i - x0_{i-1})      (D = x0_i on the first and last step)
      x <- c x + (1 - c) D

  Its first-order step is exactly the Euler step; the correction vanishes after the step from
  sigma = 1 (h_{-1} is infinite there), so it first differs from Euler on the third step.

Which LoRA adapter samples (the "old" policy) is the caller's choice, e.g.
``with adapter(transformer, OLD): sample(...)`` (:mod:`mogo_diffusion.models`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
from torch import Tensor, nn

__all__ = ["Samples", "Solver", "decode", "encode", "sample", "timestep_grid"]

Solver = Literal["euler", "dpmpp2m"]
SchedulerLike = FlowMatchEulerDiscreteScheduler | Mapping[str, Any]


@dataclass(frozen=True)
class Samples:
    """What :func:`sample` returns.

    Attributes:
        latents: ``[B, C, h, w]`` float32 clean latents x0 (the scaled latents the transformer
            works in; :func:`decode` turns them into images).
        sigmas: ``[N + 1]`` float32 grid ``sigma_0 > ... > sigma_N = 0``.
        timesteps: ``[N]`` float32 transformer timesteps ``1000 * sigma_i`` of the N steps.
    """

    latents: Tensor
    sigmas: Tensor
    timesteps: Tensor


def _scheduler(scheduler: SchedulerLike) -> FlowMatchEulerDiscreteScheduler:
    """A fresh scheduler with the given one's config (the caller's scheduler keeps its state)."""
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return type(scheduler).from_config(scheduler.config)
    if isinstance(scheduler, Mapping):
        # diffusers would reset the keys listed in "_use_default_values" to the class defaults,
        # which silently undoes a caller's edit such as {**config, "shift": 1.0}.
        config = {key: value for key, value in scheduler.items() if key != "_use_default_values"}
        return FlowMatchEulerDiscreteScheduler.from_config(config)
    raise TypeError(
        f"scheduler must be a FlowMatchEulerDiscreteScheduler or its config, got {type(scheduler).__name__}"
    )


def timestep_grid(
    scheduler: SchedulerLike,
    num_steps: int,
    image_seq_len: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The scheduler's N-step grid, as ``StableDiffusion3Pipeline`` sets it.

    Args:
        scheduler: a flow-matching Euler scheduler or its config (with its ``shift``); not modified.
        num_steps: N.
        image_seq_len: ``(h / patch) * (w / patch)`` image tokens; needed only when the config uses
            dynamic shifting (``mu`` interpolated between ``base_shift`` and ``max_shift`` as diffusers).

    Returns:
        ``(sigmas [N + 1], timesteps [N])``, float32 on the CPU.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    fresh = _scheduler(scheduler)
    kwargs: dict[str, float] = {}
    if fresh.config.get("use_dynamic_shifting", False):
        if image_seq_len is None:
            raise ValueError("the scheduler uses dynamic shifting: pass image_seq_len")
        base_len, max_len = fresh.config.base_image_seq_len, fresh.config.max_image_seq_len
        slope = (fresh.config.max_shift - fresh.config.base_shift) / (max_len - base_len)
        kwargs["mu"] = fresh.config.base_shift + slope * (image_seq_len - base_len)
    fresh.set_timesteps(num_steps, device="cpu", **kwargs)
    return fresh.sigmas.to(torch.float32), fresh.timesteps.to(torch.float32)


@contextmanager
def _evaluating(module: nn.Module) -> Iterator[None]:
    training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(training)


@torch.no_grad()
def sample(
    transformer: SD3Transformer2DModel,
    scheduler: SchedulerLike,
    prompt_embeds: Tensor,
    pooled_prompt_embeds: Tensor,
    num_steps: int,
    *,
    latents: Tensor | None = None,
    generator: torch.Generator | None = None,
    solver: Solver = "euler",
) -> Samples:
    """Sample clean latents from the transformer's active adapter without guidance (see the module doc).

    Runs without gradients and in eval mode (the transformer's mode is restored). The ODE state is
    float32; the transformer reads it, and the embeddings, in its own dtype.

    Args:
        transformer: the velocity model ``v(x_t, 1000 t, embeds, pooled)``.
        scheduler: its flow-matching scheduler or the scheduler's config (only the grid is used).
        prompt_embeds: ``[B, S, D]`` from :func:`mogo_diffusion.models.encode_prompts`.
        pooled_prompt_embeds: ``[B, Dp]``.
        num_steps: N transformer evaluations.
        latents: ``[B, C, h, w]`` initial noise at ``t = sigma_0``; ``None`` draws it from
            ``generator`` (shape ``[B, in_channels, sample_size, sample_size]`` of the config).
        generator: RNG for the noise when ``latents`` is ``None``.
        solver: ``"euler"`` or ``"dpmpp2m"``.

    Returns:
        :class:`Samples` with the clean latents and the grid used.
    """
    if solver not in ("euler", "dpmpp2m"):
        raise ValueError(f"solver must be 'euler' or 'dpmpp2m', got {solver!r}")
    batch = prompt_embeds.shape[0]
    if pooled_prompt_embeds.shape[0] != batch:
        raise ValueError(
            f"prompt_embeds has {batch} rows but pooled_prompt_embeds has {pooled_prompt_embeds.shape[0]}"
        )
    config = transformer.config
    device, dtype = prompt_embeds.device, transformer.dtype
    if latents is None:
        shape = (batch, config.in_channels, config.sample_size, config.sample_size)
        noise_device = generator.device if generator is not None else device
        latents = torch.randn(shape, generator=generator, device=noise_device, dtype=torch.float32)
    elif latents.ndim != 4 or latents.shape[0] != batch:
        raise ValueError(
            f"latents must be [{batch}, C, h, w] to match the embeddings, got {tuple(latents.shape)}"
        )
    x = latents.to(device=device, dtype=torch.float32)
    height, width = x.shape[-2:]
    sigmas, timesteps = timestep_grid(
        scheduler, num_steps, (height // config.patch_size) * (width // config.patch_size)
    )
    sigmas_device = sigmas.to(device)
    lambdas = torch.log1p(-sigmas.double()) - torch.log(sigmas.double())  # -inf at 1, +inf at 0
    embeds, pooled = prompt_embeds.to(dtype), pooled_prompt_embeds.to(dtype)
    previous_x0: Tensor | None = None
    with _evaluating(transformer):
        for i, t in enumerate(timesteps.to(device)):
            v = transformer(
                hidden_states=x.to(dtype),
                # a copy, not a view of the grid: a compiled transformer specialises on a view's
                # storage offset (0, 1 and the rest: three graphs), and on a copy's it cannot
                timestep=t.repeat(batch),
                encoder_hidden_states=embeds,
                pooled_projections=pooled,
                return_dict=False,
            )[0]
            if solver == "euler":
                x = x + (sigmas_device[i + 1] - sigmas_device[i]) * v.float()
                continue
            x0 = x - sigmas_device[i] * v.float()
            ratio = float(sigmas[i + 1] / sigmas[i])
            target = x0
            if previous_x0 is not None and sigmas[i + 1] > 0:
                h, h_previous = lambdas[i + 1] - lambdas[i], lambdas[i] - lambdas[i - 1]
                target = x0 + float(h / (2 * h_previous)) * (x0 - previous_x0)
            x = ratio * x + (1 - ratio) * target
            previous_x0 = x0
    return Samples(latents=x, sigmas=sigmas, timesteps=timesteps)


def _factors(vae: AutoencoderKL) -> tuple[float, float]:
    return float(vae.config.scaling_factor), float(vae.config.get("shift_factor") or 0.0)


@torch.no_grad()
def decode(vae: AutoencoderKL, latents: Tensor) -> Tensor:
    """Images of latents: ``vae.decode(latents / scaling_factor + shift_factor)`` mapped to [0, 1].

    Args:
        vae: the pipeline's VAE (its config's ``scaling_factor`` and ``shift_factor`` are applied).
        latents: ``[B, C, h, w]`` scaled latents, as :func:`sample` returns.

    Returns:
        ``[B, 3, H, W]`` float32 images in [0, 1] (``H = h * 2^(levels - 1)``), clamped as
        ``StableDiffusion3Pipeline`` does (``image / 2 + 0.5``). No gradients; eval mode.
    """
    scale, shift = _factors(vae)
    with _evaluating(vae):
        images = vae.decode((latents / scale + shift).to(vae.dtype), return_dict=False)[0]
    return (images.float() / 2 + 0.5).clamp(0, 1)


@torch.no_grad()
def encode(vae: AutoencoderKL, images: Tensor) -> Tensor:
    """Scaled latents of images, inverting :func:`decode`: ``(mean(vae.encode(2 x - 1)) - shift) * scale``.

    Args:
        vae: the pipeline's VAE.
        images: ``[B, 3, H, W]`` in [0, 1].

    Returns:
        ``[B, C, h, w]`` float32 latents (the posterior mean, no sampling). No gradients; eval mode.
    """
    scale, shift = _factors(vae)
    with _evaluating(vae):
        posterior = vae.encode((2 * images - 1).to(vae.dtype), return_dict=False)[0]
    return (posterior.mode().float() - shift) * scale
