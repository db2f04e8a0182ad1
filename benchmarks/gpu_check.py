"""One GPU's training step at SD3.5-Medium size: images per second, peak memory, harmonization's parts.

No download: the transformer is built from SD3.5-M's config
(:data:`mogo_diffusion.preflight.SD35M_TRANSFORMER`) with random weights in bfloat16, with the
recipe's LoRA (rank 32, alpha 64, float32). The text encoders and the VAE are not needed: the
prompt embeddings (``77 + max_sequence_length`` tokens of 4096, pooled 2048) and the clean 512 px
latents (16 x 64 x 64) are random, and so are the K = 5 rewards' per-sample scores, turned into
advantages by the strategy itself (the rewards are five rule-based ones, which load nothing: only
their number matters here). Each training step is the trainer's own:
:meth:`mogo_diffusion.train.Trainer.gradients` (the old, reference and trained forwards, the NFT
loss of :mod:`mogo_diffusion.nft`, the strategy's backward and reduction) and
:meth:`~mogo_diffusion.train.Trainer.update` (clip, AdamW), on a trainer built from its
components: a pipeline of the transformer and its scheduler alone. For the weighted sum, MARBLE
N = 1 and MARBLE N = 10 (a whole cycle of 10 steps) it measures the images per second of training
steps (``batch`` images at ``timesteps`` trained timesteps each; the recipe trains 24, the time
grows with it linearly) and the peak memory, eager and compiled side by side (``--compile``, the
trainer's ``train.compile``; the compiled trainer's first step, timed apart, pays the compilation)
under ``--mixed-precision`` (``train.mixed_precision``); then it profiles one harmonization step
of MARBLE N = 1 and gives the shares of mogo's ranges in it (``mogo.objective_grads`` the K
gradients, ``mogo.gramian``, ``mogo.weighting`` the min-norm solve, ``mogo.combine``,
``mogo.report``). Writes JSON.

    python benchmarks/gpu_check.py --out gpu_check.json          # one GPU, about 5 to 8 minutes
    python benchmarks/gpu_check.py --tiny --out tiny.json        # the same on the CPU, tiny SD3
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

import mogo
from mogo_diffusion import models
from mogo_diffusion.config import Config
from mogo_diffusion.preflight import SD35M, SD35M_TRANSFORMER
from mogo_diffusion.prompts import PromptSet, load_prompt_pool
from mogo_diffusion.rewards import MultiReward, make_reward
from mogo_diffusion.streams import generator
from mogo_diffusion.train import Batch, MicroBatch, Trainer

REWARDS = ["jpeg_compressibility", "sharpness", "color_match", "shapes_color", "shapes_shape"]
STRATEGIES = {
    "weighted sum": {"name": "weighted_sum"},
    "marble N=1": {"name": "marble", "harmonize_every": 1},
    "marble N=10": {"name": "marble", "harmonize_every": 10, "alpha_ema": 0.9},
}
REGIONS = ("mogo.objective_grads", "mogo.gramian", "mogo.weighting", "mogo.combine", "mogo.report")
TEXT_TOKENS_CLIP = 77


def build_transformer(tiny: bool, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """SD3.5-M's transformer (random, bfloat16) on ``device``, or the tiny smoke one (float32); the
    same ``seed`` gives the same weights (on the CPU), and the global RNG state is left as it was."""
    if tiny:
        return models.tiny_sd3("smoke", seed=seed).transformer.to(device)
    from diffusers import SD3Transformer2DModel

    previous = torch.get_default_dtype()
    # initialised where it runs and in bfloat16: no float32 copy (9 GB) on the way
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.bfloat16)
        try:
            transformer = SD3Transformer2DModel.from_config(SD35M_TRANSFORMER)
        finally:
            torch.set_default_dtype(previous)
    return transformer.to(torch.bfloat16)  # its positional-embedding table is made in float32


def step_trainer(transformer: torch.nn.Module, config: Config, device: torch.device) -> Trainer:
    """A :class:`Trainer` of ``config`` on a pipeline of ``transformer`` (with its LoRA adapters)
    and a scheduler alone: what :meth:`Trainer.gradients` and :meth:`Trainer.update` use."""
    pipeline = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), vae=None,
        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
        text_encoder_3=None, tokenizer_3=None,
    )  # fmt: skip
    rewards = MultiReward([make_reward(name) for name in REWARDS])
    prompts = load_prompt_pool(PromptSet(["a prompt"], [{}]))  # no epoch is sampled
    accelerator = Accelerator(cpu=device.type == "cpu")
    return Trainer(config, pipeline, rewards, prompts, accelerator=accelerator)


def random_batch(transformer: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> Batch:
    """A batch of ``args.batch`` random latents and embeddings at the transformer's sizes."""
    c = transformer.config
    g = generator(args.seed, "gpu_check_batch")
    side = args.resolution // 8
    tokens = TEXT_TOKENS_CLIP + args.max_sequence_length
    latents = torch.randn(args.batch, c.in_channels, side, side, generator=g).to(device)
    embeds = torch.randn(args.batch, tokens, c.joint_attention_dim, generator=g).to(device)
    pooled = torch.randn(args.batch, c.pooled_projection_dim, generator=g).to(device)
    sigmas = torch.linspace(1.0, 1.0 / args.sampler_steps, args.sampler_steps)
    images = torch.zeros(args.batch, 3, 1, 1)
    prompts = [f"prompt {i // 3}" for i in range(args.batch)]  # groups of 3 images
    return Batch(prompts, [{}] * args.batch, slice(0, args.batch), embeds, pooled, latents, sigmas,
                 (sigmas * 1000).to(device), images)  # fmt: skip


def run_config(args: argparse.Namespace, strategy: dict[str, Any], compiled: bool) -> Config:
    return Config.from_dict(
        {
            "model": {"pretrained": SD35M, "dtype": "float32" if args.tiny else "bfloat16",
                      "lora_rank": args.rank, "lora_alpha": 2.0 * args.rank,
                      "max_sequence_length": args.max_sequence_length},
            "sampling": {"resolution": args.resolution},
            "rewards": [{"name": name, "weight": 1.0} for name in REWARDS],
            "strategy": strategy,
            "train": {"batch_size": args.batch, "mixed_precision": args.mixed_precision,
                      "compile": "yes" if compiled else "no"},
        }
    )  # fmt: skip


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_steps(trainer: Trainer, batch: Batch, args: argparse.Namespace, steps: int, seed: int) -> float:
    """``steps`` training steps on ``batch`` (random scores into the strategy's advantages, random
    trained timesteps and noise from the step's stream); their seconds."""
    g = generator(args.seed, "gpu_check_step", seed)
    scores = torch.rand(args.batch, len(REWARDS), generator=g)
    advantages = trainer.strategy.advantages(scores, batch.prompts, 0).to(trainer.device)
    index = torch.arange(args.batch)
    synchronize(trainer.device)
    start = time.perf_counter()
    for _ in range(steps):
        chosen = torch.randperm(args.sampler_steps, generator=g)[: args.timesteps].sort().values
        noise = torch.randn((len(chosen), *batch.latents.shape), generator=g)
        trainer.gradients(batch, [MicroBatch(index, advantages, chosen.tolist(), noise)])
        trainer.update()
    synchronize(trainer.device)
    return time.perf_counter() - start


def profile_harmonization(trainer: Trainer, batch: Batch, args: argparse.Namespace) -> dict[str, Any]:
    """One profiled harmonization step: seconds in each of mogo's ranges and their shares of the step
    (device time on a GPU, where the host only launches kernels; host time on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        seconds = train_steps(trainer, batch, args, 1, seed=10**6)
    found: dict[str, float] = {}
    for event in prof.key_averages():
        if event.key in REGIONS:
            host = event.cpu_time_total / 1e6
            device = getattr(event, "device_time_total", 0.0) / 1e6
            found[event.key] = max(found.get(event.key, 0.0), device if cuda else host)
    return {
        "step_seconds": seconds,
        "clock": "device" if cuda else "host",
        "seconds": {name: found.get(name, 0.0) for name in REGIONS},
        "shares": {name: found.get(name, 0.0) / seconds for name in REGIONS},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny SD3 on the CPU (a test of this script)")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--batch", type=int, default=None, help="images a step (9; tiny 4)")
    parser.add_argument("--timesteps", type=int, default=2, help="trained timesteps a step (the recipe: 24)")
    parser.add_argument(
        "--steps", type=int, default=10, help="timed steps a strategy (>= 10: a MARBLE cycle)"
    )
    parser.add_argument(
        "--compile", choices=("no", "yes", "both"), default="both", help="eager steps, compiled ones, or both"
    )
    parser.add_argument(
        "--mixed-precision",
        choices=("no", "bf16", "fp16"),
        default=None,
        help="the autocast (bf16; tiny: no)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.mixed_precision = args.mixed_precision or ("no" if args.tiny else "bf16")
    if args.tiny:
        args.batch, args.rank, args.resolution, args.max_sequence_length = args.batch or 4, 4, 32, 16
    else:
        args.batch, args.rank, args.resolution, args.max_sequence_length = args.batch or 9, 32, 512, 128
    args.sampler_steps = 25  # the multi-reward recipe's sampler grid
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if args.tiny:
        torch.set_num_threads(1)
    transformer = build_transformer(args.tiny, device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        models.add_lora(transformer, args.rank, 2.0 * args.rank)
    for p in models.lora_parameters(transformer):  # trained in float32, as the trainer does
        p.data = p.data.float()
    batch = random_batch(transformer, args, device)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "mogo": mogo.__version__,
        "transformer": "tiny smoke" if args.tiny else "SD3.5-M (random weights)",
        "transformer_parameters": sum(p.numel() for p in transformer.parameters()),
        "lora_parameters": sum(p.numel() for p in models.lora_parameters(transformer)),
        "rewards": len(REWARDS),
        **{k: getattr(args, k) for k in ("batch", "timesteps", "steps", "resolution", "max_sequence_length")},
        "mixed_precision": args.mixed_precision,
        "strategies": {},
    }
    modes = {"no": [False], "yes": [True], "both": [False, True]}[args.compile]
    for compiled in modes:  # eager first: compiling changes the shared transformer in place
        for i, (label, strategy) in enumerate(STRATEGIES.items()):
            trainer = step_trainer(transformer, run_config(args, strategy, compiled), device)
            first = train_steps(trainer, batch, args, 1, seed=2 * i)  # warm-up (N=10: a harmonization)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            seconds = train_steps(trainer, batch, args, args.steps, seed=2 * i + 1)
            result["strategies"].setdefault(label, {})["compiled" if compiled else "eager"] = {
                "images_per_second": args.batch * args.steps / seconds,
                "seconds_per_step": seconds / args.steps,
                "first_step_seconds": first,
                "peak_memory_bytes": torch.cuda.max_memory_allocated(device)
                if device.type == "cuda"
                else None,
            }
            if label == "marble N=1" and "harmonization" not in result:
                result["harmonization"] = profile_harmonization(trainer, batch, args)
            del trainer
    for measured in result["strategies"].values():
        if len(measured) == 2:
            measured["compiled / eager"] = (
                measured["compiled"]["images_per_second"] / measured["eager"]["images_per_second"]
            )
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
