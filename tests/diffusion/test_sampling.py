"""CFG-free sampling against diffusers' own pipeline and schedulers, and decoding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler
from torch import Tensor, nn

from mogo_diffusion.models import encode_prompts, tiny_sd3
from mogo_diffusion.sampling import decode, encode, sample, timestep_grid


@pytest.fixture(scope="module")
def pipeline():
    return tiny_sd3("smoke", seed=0)


@pytest.fixture(scope="module")
def embeds(pipeline):
    return encode_prompts(pipeline, ["a red circle", 'a sign that says "42"', "a red circle"])


@pytest.fixture(scope="module")
def noise() -> Tensor:
    return torch.randn(3, 16, 8, 8, generator=torch.Generator().manual_seed(1))


def _pipeline_output(pipeline, embeds, noise, num_steps: int, output_type: str) -> Tensor:
    prompt_embeds, pooled = embeds
    return pipeline(
        prompt_embeds=prompt_embeds,
        pooled_prompt_embeds=pooled,
        latents=noise.clone(),
        num_inference_steps=num_steps,
        guidance_scale=1.0,
        output_type=output_type,
    ).images


@pytest.mark.parametrize("num_steps", [1, 4])
def test_euler_equals_the_diffusers_pipeline(pipeline, embeds, noise, num_steps):
    out = sample(pipeline.transformer, pipeline.scheduler, *embeds, num_steps, latents=noise)
    expected = _pipeline_output(pipeline, embeds, noise, num_steps, "latent")
    torch.testing.assert_close(out.latents, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.sigmas, pipeline.scheduler.sigmas, atol=0, rtol=0)
    torch.testing.assert_close(out.timesteps, pipeline.scheduler.timesteps, atol=0, rtol=0)
    images = _pipeline_output(pipeline, embeds, noise, num_steps, "pt")
    torch.testing.assert_close(decode(pipeline.vae, out.latents), images, atol=1e-5, rtol=0)


def test_dynamic_shifting_grid_equals_the_pipeline(pipeline, embeds, noise):
    shifted = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    out = sample(pipeline.transformer, shifted, *embeds, 3, latents=noise)
    original = pipeline.scheduler
    pipeline.scheduler = shifted
    try:
        expected = _pipeline_output(pipeline, embeds, noise, 3, "latent")
    finally:
        pipeline.scheduler = original
    torch.testing.assert_close(out.sigmas, shifted.sigmas, atol=0, rtol=0)
    assert not torch.allclose(out.sigmas, timestep_grid(FlowMatchEulerDiscreteScheduler(), 3)[0])
    torch.testing.assert_close(out.latents, expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="image_seq_len"):
        timestep_grid(shifted.config, 3)
    with pytest.raises(ValueError, match="image_seq_len"):  # an edited config is taken as it reads
        timestep_grid({**pipeline.scheduler.config, "use_dynamic_shifting": True}, 3)


def test_dpmpp2m_equals_diffusers_dpm_solver_on_the_same_grid(pipeline, embeds, noise):
    num_steps = 6
    out = sample(
        pipeline.transformer, pipeline.scheduler, *embeds, num_steps, latents=noise, solver="dpmpp2m"
    )
    dpm = DPMSolverMultistepScheduler(
        algorithm_type="dpmsolver++",
        solver_order=2,
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        final_sigmas_type="zero",
    )
    dpm.set_timesteps(num_steps)
    dpm.sigmas, dpm.timesteps = out.sigmas.clone(), out.timesteps.clone()  # the flow-matching grid
    prompt_embeds, pooled = embeds
    x = noise.clone()
    with torch.no_grad():
        for t in out.timesteps:
            v = pipeline.transformer(
                hidden_states=x,
                timestep=t.expand(3),
                encoder_hidden_states=prompt_embeds,
                pooled_projections=pooled,
                return_dict=False,
            )[0]
            x = dpm.step(v, t, x, return_dict=False)[0]
    torch.testing.assert_close(out.latents, x, atol=1e-5, rtol=0)


@pytest.mark.parametrize("num_steps", [1, 2])
def test_dpmpp2m_is_euler_until_its_third_step(pipeline, embeds, noise, num_steps):
    euler = sample(pipeline.transformer, pipeline.scheduler, *embeds, num_steps, latents=noise)
    dpm = sample(
        pipeline.transformer, pipeline.scheduler, *embeds, num_steps, latents=noise, solver="dpmpp2m"
    )
    torch.testing.assert_close(dpm.latents, euler.latents, atol=1e-5, rtol=0)


class GaussianFlow(nn.Module):
    """The exact velocity field of data ``x0 ~ N(mean, std^2)`` per coordinate.

    Its ODE maps noise ``eps`` at t = 1 to ``mean + std * eps`` at t = 0: along the flow,
    ``(x_t - (1 - t) mean) / sqrt((1 - t)^2 std^2 + t^2)`` is constant.
    """

    dtype = torch.float32

    def __init__(self, mean: float, std: float) -> None:
        super().__init__()
        self.mean, self.std = mean, std
        self.config = SimpleNamespace(in_channels=4, sample_size=4, patch_size=2)

    def forward(self, hidden_states, timestep, encoder_hidden_states, pooled_projections, return_dict):
        x, t, m, s = hidden_states, (timestep / 1000).view(-1, 1, 1, 1), self.mean, self.std
        x0 = m + (1 - t) * s**2 / ((1 - t) ** 2 * s**2 + t**2) * (x - (1 - t) * m)
        return ((x - x0) / t,)


def test_solvers_converge_to_the_exact_flow_euler_first_order_dpmpp2m_second():
    flow, eps = GaussianFlow(0.5, 0.3), torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    exact = 0.5 + 0.3 * eps
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    no_text = torch.zeros(2, 1, 1), torch.zeros(2, 1)
    errors = {
        solver: [
            (sample(flow, scheduler, *no_text, n, latents=eps, solver=solver).latents - exact)
            .abs()
            .max()
            .item()
            for n in (80, 160, 320)
        ]
        for solver in ("euler", "dpmpp2m")
    }
    euler, dpm = errors["euler"], errors["dpmpp2m"]
    assert all(1.8 < euler[i] / euler[i + 1] < 2.2 for i in range(2))
    assert all(dpm[i] / dpm[i + 1] > 3.5 for i in range(2))
    assert dpm[2] < euler[2] / 5


def test_sampling_leaves_the_model_and_the_scheduler_as_they_were(pipeline, embeds, noise):
    transformer, scheduler = pipeline.transformer, pipeline.scheduler
    sigmas = scheduler.sigmas.clone()
    transformer.train()
    try:
        out = sample(transformer, scheduler, *embeds, 3, latents=noise)
        assert transformer.training
    finally:
        transformer.eval()
    torch.testing.assert_close(scheduler.sigmas, sigmas, atol=0, rtol=0)
    assert not out.latents.requires_grad
    # eval mode inside: the result equals a sample taken from the model in eval mode
    torch.testing.assert_close(out.latents, sample(transformer, scheduler, *embeds, 3, latents=noise).latents)


def test_noise_from_a_generator_and_from_a_scheduler_config(pipeline, embeds):
    transformer = pipeline.transformer
    drawn = sample(
        transformer, pipeline.scheduler.config, *embeds, 2, generator=torch.Generator().manual_seed(3)
    )
    noise = torch.randn(3, 16, 8, 8, generator=torch.Generator().manual_seed(3))
    given = sample(transformer, pipeline.scheduler, *embeds, 2, latents=noise)
    torch.testing.assert_close(drawn.latents, given.latents, atol=0, rtol=0)
    assert drawn.latents.shape == (3, 16, 8, 8)


def test_sampling_a_bfloat16_transformer_gives_float32_latents_close_to_float32(pipeline, embeds, noise):
    half = tiny_sd3("smoke", seed=0, torch_dtype=torch.bfloat16)
    out = sample(half.transformer, half.scheduler, *embeds, 3, latents=noise)
    full = sample(pipeline.transformer, pipeline.scheduler, *embeds, 3, latents=noise)
    assert out.latents.dtype == torch.float32
    assert (out.latents - full.latents).abs().max() < 0.1 * full.latents.abs().max()
    images = decode(half.vae, out.latents)
    assert images.dtype == torch.float32
    assert torch.isfinite(images).all()


def test_decode_gives_images_in_the_unit_range(pipeline, noise):
    images = decode(pipeline.vae, 3 * noise)
    assert images.shape == (3, 3, 32, 32)
    assert images.dtype == torch.float32
    assert (images.min(), images.max()) == (0, 1)  # large latents saturate: the clamp is applied


def test_encode_and_decode_apply_inverse_latent_maps(pipeline):
    vae = pipeline.vae
    config = vae.config
    assert (config.shift_factor, config.scaling_factor) == (0.0609, 1.5305)
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    latents = encode(vae, images)
    assert latents.shape == (2, 16, 8, 8)
    with torch.no_grad():
        raw = vae.encode(2 * images - 1).latent_dist.mode()
        expected = (vae.decode(raw).sample / 2 + 0.5).clamp(0, 1)
    torch.testing.assert_close(latents, (raw - config.shift_factor) * config.scaling_factor)
    torch.testing.assert_close(decode(vae, latents), expected, atol=1e-5, rtol=0)


def test_bad_sampler_inputs_are_refused(pipeline, embeds, noise):
    transformer, scheduler = pipeline.transformer, pipeline.scheduler
    with pytest.raises(ValueError, match="solver"):
        sample(transformer, scheduler, *embeds, 2, latents=noise, solver="heun")
    with pytest.raises(ValueError, match="num_steps"):
        sample(transformer, scheduler, *embeds, 0, latents=noise)
    with pytest.raises(ValueError, match=r"latents must be \[3"):
        sample(transformer, scheduler, *embeds, 2, latents=noise[:2])
    with pytest.raises(ValueError, match="pooled_prompt_embeds has 2"):
        sample(transformer, scheduler, embeds[0], embeds[1][:2], 2, latents=noise)
    with pytest.raises(TypeError, match="DPMSolverMultistepScheduler"):
        sample(transformer, DPMSolverMultistepScheduler(), *embeds, 2, latents=noise)
