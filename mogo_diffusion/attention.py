"""SD3's attention with its softmax product computed in float32, whatever the autocast.

Under a bfloat16 autocast the transformer's matrix products run at the CPU's bfloat16 rate
(AVX-512 BF16, AMX), and ``F.scaled_dot_product_attention`` runs in bfloat16 too. On the CPU its
bfloat16 backward is several times slower than the float32 one at the shapes world's short
sequences (docs/benchmarks.rst, "Training speed"), and float32 keeps the softmax's sums exact to
float32. :class:`Float32Attention` computes what diffusers' ``JointAttnProcessor2_0`` computes
(the joint image-text attention of SD3's blocks, and with no text, the second attention of SD3.5's
dual-attention blocks), with the projections in the autocast's dtype and
``softmax(q k^T / sqrt(d)) v`` in float32:

.. math::

    q = [W_q x; W'_q c],\\; k = [W_k x; W'_k c],\\; v = [W_v x; W'_v c],\\qquad
    o = \\mathrm{softmax}(q k^\\top / \\sqrt{d})\\, v,

split back into the image rows (``to_out``) and the text rows (``to_add_out``). Without an
autocast it is the same computation as diffusers' processor, operation for operation.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.attention_processor import Attention
from torch import Tensor, nn
from torch.nn.functional import scaled_dot_product_attention

__all__ = ["Float32Attention", "use_float32_attention"]


class Float32Attention:
    """An attention processor for SD3's ``Attention`` modules (``attn`` and ``attn2``)."""

    def __call__(
        self,
        attn: Attention,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Tensor | tuple[Tensor, Tensor]:
        if attention_mask is not None:
            raise ValueError("Float32Attention: SD3's attention takes no mask")
        batch = hidden_states.shape[0]

        def heads(projected: Tensor) -> Tensor:  # [b, n, h * d] -> [b, h, n, d]
            return projected.view(batch, -1, attn.heads, projected.shape[-1] // attn.heads).transpose(1, 2)

        query, key, value = (heads(layer(hidden_states)) for layer in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        image_tokens = hidden_states.shape[1]
        if encoder_hidden_states is not None:
            context = [
                heads(layer(encoder_hidden_states))
                for layer in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            ]
            if attn.norm_added_q is not None:
                context[0] = attn.norm_added_q(context[0])
            if attn.norm_added_k is not None:
                context[1] = attn.norm_added_k(context[1])
            query, key, value = (
                torch.cat(pair, dim=2) for pair in zip((query, key, value), context, strict=True)
            )
        dtype = query.dtype
        with torch.autocast(hidden_states.device.type, enabled=False):
            attended = scaled_dot_product_attention(query.float(), key.float(), value.float())
        attended = attended.to(dtype).transpose(1, 2).reshape(batch, -1, attn.heads * attended.shape[-1])
        image = attn.to_out[1](attn.to_out[0](attended[:, :image_tokens]))
        if encoder_hidden_states is None:
            return image
        text = attended[:, image_tokens:]
        return image, (text if attn.context_pre_only else attn.to_add_out(text))


def use_float32_attention(transformer: nn.Module) -> None:
    """Give every attention module of an SD3 ``transformer`` a :class:`Float32Attention`."""
    transformer.set_attn_processor(Float32Attention())
