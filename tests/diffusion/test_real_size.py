"""SD3.5-M's size without a GPU (``benchmarks/real_size.py``): the stand-ins' widths, the benchmark's
code on the tiny model, and (``-m slow``) the real-size run itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import SD3Transformer2DModel

from mogo_diffusion import models
from mogo_diffusion.preflight import SD35M_TRANSFORMER, MemoryEstimate
from mogo_diffusion.sampling import decode
from tests.test_examples import load

ROOT = Path(__file__).resolve().parents[2]
GB = 1e9
RESUMED = {"trained": True, "old": True, "eval_ema": True, "amortizer": True}


def test_the_stand_ins_read_and_write_what_sd35m_s_transformer_does():
    """Prompt embeddings of 77 CLIP and 128 T5 tokens, 4096 wide, pooled 2048; 512 px images of
    64 x 64 latents: the transformer's inputs at the configs' sizes, from components of a few MB."""
    with torch.device("meta"):  # its size only: nothing is allocated
        transformer = SD3Transformer2DModel.from_config(SD35M_TRANSFORMER)
    pipeline = models.tiny_pipeline(transformer)
    c = transformer.config
    encoders = (pipeline.text_encoder, pipeline.text_encoder_2, pipeline.text_encoder_3, pipeline.vae)
    assert sum(p.numel() for module in encoders for p in module.parameters()) < 10_000_000
    embeds, pooled = models.encode_prompts(pipeline, ["a red circle", "a blue square"], 128)
    assert embeds.shape == (2, 77 + 128, c.joint_attention_dim)
    assert pooled.shape == (2, c.pooled_projection_dim)
    side = models.latent_size(512, c, pipeline.vae_scale_factor)
    images = decode(pipeline.vae, torch.zeros(1, c.in_channels, side, side))
    assert images.shape == (1, 3, 512, 512)


def test_the_benchmark_runs_its_phases_on_the_tiny_model(tmp_path):
    """The real-size run's own code (trainer, checkpoint, resume, LoRA export) on the tiny SD3,
    so that the benchmark cannot rot between its real runs."""
    benchmark = load(ROOT / "benchmarks" / "real_size.py")
    result = benchmark.main(["--tiny", "--out", str(tmp_path), "--threads", "1"])
    assert json.loads((tmp_path / "real_size.json").read_text()) == json.loads(json.dumps(result))
    phases = [row["phase"] for row in result["phases"]]
    assert phases[:6] == [
        "build the transformer and the stand-ins",
        "build the trainer (LoRA adapters)",
        "sample 2 images, 32 px, 3 steps",
        "score K = 5 rewards",
        "MARBLE step 1: harmonization",
        "MARBLE step 2: amortized",
    ]
    assert phases[-1] == "weighted-sum step"
    assert result["resumed_bit_for_bit"] == RESUMED
    loaded = result["lora_loaded"]
    assert loaded["tensors_equal"]
    assert loaded["velocity_max_difference"] == 0  # float32: the same weights through the same layers
    assert set(result["estimate"]) == set(MemoryEstimate.TERMS)
    assert "SD3.5-M" not in result["transformer"]
    assert (tmp_path / "real_size.rst").read_text().count("==========") >= 6  # two tables


@pytest.mark.spawns
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sd35m_at_its_real_size_trains_resumes_and_exports_on_a_cpu(tmp_path):
    """The benchmark at SD3.5-M's size, in its own process (its memory is the run's alone)."""
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "real_size.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    result = json.loads((tmp_path / "real_size.json").read_text())
    assert result["resumed_bit_for_bit"] == RESUMED
    loaded = result["lora_loaded"]
    assert loaded["tensors_equal"]
    # the trainer's float32 adapter and the loaded bfloat16 one: two roundings to bfloat16 (the
    # adapter's weights, the output) of values up to the largest, 2^-7 relative each
    assert loaded["velocity_max_difference"] <= 2 * 2**-7 * loaded["velocity_max"]
    measured, estimate = result["measured"], result["estimate"]
    assert measured["peak"] < 16 * GB  # beside other processes on a 24 GiB machine
    # the terms the estimate counts exactly (AdamW's step counters aside), and those that the
    # resident memory shows, where the allocator's free pages and Python's objects come on top
    assert measured["lora"] == pytest.approx(estimate["lora"], rel=1e-4)
    assert measured["weights"] == pytest.approx(estimate["weights"], rel=0.05)
    assert measured["buffers"] == pytest.approx(estimate["buffers"], rel=0.25)
    step = estimate["merged"] + estimate["activations"]
    assert 0.9 * step <= measured["merged and activations"] <= 2 * step
