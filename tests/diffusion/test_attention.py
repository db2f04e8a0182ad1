"""Float32Attention: diffusers' SD3 attention, with the softmax product in float32 under autocast."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention_processor import JointAttnProcessor2_0

from mogo_diffusion.attention import Float32Attention, use_float32_attention
from mogo_diffusion.models import tiny_sd3

BF16_EPS = 2.0**-8  # bfloat16's unit round-off


@pytest.fixture(scope="module")
def transformer():
    # SD3.5's layout at smoke size: dual attention in block 0, text-free last block (context_pre_only)
    return tiny_sd3("smoke").transformer


def inputs(transformer, batch: int = 3, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    config = transformer.config
    size = config.sample_size
    return {
        "hidden_states": torch.randn(batch, config.in_channels, size, size, generator=generator),
        "encoder_hidden_states": torch.randn(batch, 7, config.joint_attention_dim, generator=generator),
        "pooled_projections": torch.randn(batch, config.pooled_projection_dim, generator=generator),
        "timestep": torch.tensor([100.0, 500.0, 900.0][:batch]),
        "return_dict": False,
    }


def as_tuple(output: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return output if isinstance(output, tuple) else (output,)


def output_and_gradients(transformer, data: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    transformer.zero_grad()
    transformer.requires_grad_(True)
    out = transformer(**data)[0]
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in transformer.parameters()]


def test_without_autocast_it_is_diffusers_attention_bit_for_bit(transformer):
    data = inputs(transformer)
    transformer.set_attn_processor(JointAttnProcessor2_0())
    expected, expected_grads = output_and_gradients(transformer, data)
    use_float32_attention(transformer)
    assert {type(p) for p in transformer.attn_processors.values()} == {Float32Attention}
    got, grads = output_and_gradients(transformer, data)
    assert torch.equal(got, expected)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads, strict=True))


@pytest.mark.parametrize("block", [0, -1])  # dual attention (attn2 without text); the text-free last block
def test_under_bfloat16_autocast_each_attention_is_within_bfloat16_round_off(transformer, block):
    """Rounded inputs, weights and outputs of the projections (the products accumulate in float32)
    make a few bfloat16 round-offs along the path; the float32 softmax adds none."""
    use_float32_attention(transformer)
    attn_block = transformer.transformer_blocks[block]
    generator = torch.Generator().manual_seed(1)
    width = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    x = torch.randn(2, 16, width, generator=generator)
    context = torch.randn(2, 7, width, generator=generator)
    modules = [(attn_block.attn, context)] + (
        [(attn_block.attn2, None)] if attn_block.attn2 is not None else []
    )
    for module, text in modules:
        with torch.no_grad():
            exact = as_tuple(module(x, encoder_hidden_states=text))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                rounded = as_tuple(module(x, encoder_hidden_states=text))
                module.set_processor(JointAttnProcessor2_0())
                theirs = as_tuple(module(x, encoder_hidden_states=text))
                module.set_processor(Float32Attention())
        for a, b, c in zip(exact, rounded, theirs, strict=True):
            assert b.dtype == c.dtype  # the autocast's dtypes, as diffusers' processor gives them
            assert float((b.float() - a).norm() / a.norm()) <= 8 * BF16_EPS


def test_a_mask_is_refused(transformer):
    attn = transformer.transformer_blocks[0].attn2
    with pytest.raises(ValueError, match="takes no mask"):
        Float32Attention()(attn, torch.zeros(1, 4, 64), attention_mask=torch.ones(1, 4))
