"""HPSv2.1, the Human Preference Score v2.1 (Wu et al., 2023), as DiffusionNFT and Flow-GRPO score it.

The reward is the raw cosine ``<u, w>`` of the unit image and prompt embeddings of open_clip's
ViT-H/14 fine-tuned on human preferences: ``[B]`` float32, in ``[-1, 1]`` (about 0.2 to 0.4 for
typical images).

The checkpoint ``HPS_v2.1_compressed.pt`` (hub repository ``xswu/HPSv2``) is an open_clip state dict.
open_clip is not needed (its wheel pulls torchvision): :func:`convert_open_clip` maps the state
dict onto a transformers ``CLIPModel`` whose config, tokenizer and image processor come from
``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``, the model HPS was fine-tuned from. Attention's packed
``in_proj`` is split into ``q, k, v``, and the projections are transposed::

    visual.conv1.weight                         vision_model.embeddings.patch_embedding.weight
    visual.class_embedding                      vision_model.embeddings.class_embedding
    visual.positional_embedding                 vision_model.embeddings.position_embedding.weight
    visual.ln_pre / visual.ln_post              vision_model.pre_layrnorm / .post_layernorm
    visual.proj (transposed)                    visual_projection.weight
    token_embedding.weight                      text_model.embeddings.token_embedding.weight
    positional_embedding                        text_model.embeddings.position_embedding.weight
    ln_final                                    text_model.final_layer_norm
    text_projection (transposed)                text_projection.weight
    logit_scale                                 logit_scale
    [visual.]transformer.resblocks.N.           {vision,text}_model.encoder.layers.N.
        ln_1, ln_2                                  layer_norm1, layer_norm2
        attn.in_proj_{weight,bias} (split)          self_attn.{q,k,v}_proj.{weight,bias}
        attn.out_proj, mlp.c_fc, mlp.c_proj         self_attn.out_proj, mlp.fc1, mlp.fc2

Images are resized (bicubic, antialiased) so that the longer side is 224, padded with black to a
square, as HPSv2's ``ResizeMaxSize`` does, and normalised with CLIP's mean and std. Prompts are
tokenized by the CLIP tokenizer (open_clip's pads with zeros instead; the causal text encoder makes
that irrelevant to the pooled token).

>>> packed = {"visual.transformer.resblocks.0.attn.in_proj_bias": torch.arange(6.0)}
>>> {k: v.tolist() for k, v in convert_open_clip(packed).items()}  # doctest: +NORMALIZE_WHITESPACE
{'vision_model.encoder.layers.0.self_attn.q_proj.bias': [0.0, 1.0],
 'vision_model.encoder.layers.0.self_attn.k_proj.bias': [2.0, 3.0],
 'vision_model.encoder.layers.0.self_attn.v_proj.bias': [4.0, 5.0]}
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import torch
from torch import Tensor

from mogo_diffusion import hub
from mogo_diffusion.rewards.base import check_batch_size, floating_dtype
from mogo_diffusion.rewards.clip import CLIP_H14, ClipEncoder, EncoderReward, ImageTransform, load_processor
from mogo_diffusion.rewards.registry import register_reward

__all__ = ["HPS_FILE", "HPS_REPO", "HPSv21", "convert_open_clip"]

HPS_REPO = "xswu/HPSv2"
"""The hub repository of the HPS checkpoints."""
HPS_FILE = "HPS_v2.1_compressed.pt"
"""The HPSv2.1 checkpoint in :data:`HPS_REPO`."""

_NAMES = {
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",
    "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
    "visual.ln_post.weight": "vision_model.post_layernorm.weight",
    "visual.ln_post.bias": "vision_model.post_layernorm.bias",
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "ln_final.weight": "text_model.final_layer_norm.weight",
    "ln_final.bias": "text_model.final_layer_norm.bias",
    "logit_scale": "logit_scale",
}
_TRANSPOSED = {"visual.proj": "visual_projection.weight", "text_projection": "text_projection.weight"}
_BLOCK = re.compile(r"(visual\.)?transformer\.resblocks\.(\d+)\.(.+)\.(weight|bias)")
_BLOCK_NAMES = {
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "attn.out_proj": "self_attn.out_proj",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
}


def convert_open_clip(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An open_clip ``CLIP`` state dict (ViT image tower, built-in text tower) as a transformers
    ``CLIPModel`` state dict (the table in the module docstring).

    A ``module.`` prefix (from DistributedDataParallel) is dropped. ``ValueError`` names the keys
    that are not part of that layout.
    """
    out: dict[str, Tensor] = {}
    unknown = []
    for key, value in state_dict.items():
        key = key.removeprefix("module.")
        block = _BLOCK.fullmatch(key.replace("attn.in_proj_", "attn.in_proj."))
        if key in _NAMES:
            out[_NAMES[key]] = value
        elif key in _TRANSPOSED:
            out[_TRANSPOSED[key]] = value.T.contiguous()
        elif block is None:
            unknown.append(key)
        else:
            tower, layer, module, kind = block.groups()
            prefix = f"{'vision' if tower else 'text'}_model.encoder.layers.{layer}."
            if module == "attn.in_proj":
                for name, part in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3), strict=True):
                    out[f"{prefix}self_attn.{name}.{kind}"] = part.contiguous()
            elif module in _BLOCK_NAMES:
                out[f"{prefix}{_BLOCK_NAMES[module]}.{kind}"] = value
            else:
                unknown.append(key)
    if unknown:
        raise ValueError(f"not an open_clip CLIP state dict: unexpected keys {unknown[:8]}")
    return out


@register_reward("hpsv21")
class HPSv21(EncoderReward):
    """HPSv2.1: the cosine ``<u, w>`` of each image and its prompt under the HPS model, ``[B]`` float32.

    Args:
        model: the checkpoint (:data:`HPS_FILE`): a ``.pt`` file (read with
            ``torch.load(weights_only=True)``) or a ``.safetensors`` file holding the open_clip
            state dict (or a dict with it under ``"state_dict"``), a directory holding
            :data:`HPS_FILE`, or a hub id (:data:`HPS_REPO`).
        base: hub id or directory of the transformers CLIP-H model HPS was fine-tuned from
            (:data:`~mogo_diffusion.rewards.clip.CLIP_H14`): its config, tokenizer and image
            processor are read, not its weights.
        device, dtype, batch_size, local_files_only: as in
            :class:`~mogo_diffusion.rewards.clip.PickScore`.

    Raises:
        FileNotFoundError: a checkpoint or ``base`` path that does not exist.
        OSError: a hub id that cannot be loaded (offline: not in the cache); the message says how
            to download it.
        ValueError: a checkpoint that cannot be read or does not match ``base``'s architecture; the
            message names the file.
    """

    name = "hpsv21"

    def __init__(
        self,
        model: str | os.PathLike[str] = HPS_REPO,
        *,
        base: str | os.PathLike[str] = CLIP_H14,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        batch_size: int = 32,
        local_files_only: bool | None = None,
    ) -> None:
        from accelerate import init_empty_weights
        from transformers import CLIPConfig, CLIPModel

        dtype, batch_size = floating_dtype(dtype), check_batch_size(batch_size)
        only_local = hub.offline(local_files_only)
        path = hub.checkpoint_file(model, HPS_FILE, "HPS checkpoint", repo=HPS_REPO, only_local=only_local)
        state = hub.read_state_dict(path)
        if isinstance(state.get("state_dict"), Mapping):
            state = state["state_dict"]
        try:
            state = convert_open_clip(state)
        except ValueError as err:
            raise ValueError(f"{str(path)!r}: {err}") from None
        source = hub.resolve(base, "HPS base model")
        with hub.loading("HPS base model config", source, only_local, include=hub.CONFIG_FILES):
            config = CLIPConfig.from_pretrained(source.location, local_files_only=only_local)
        image_config, tokenizer = load_processor(base, "HPS base model's processor", only_local)
        with init_empty_weights():  # parameters on the meta device: no random init of 1B weights
            clip = CLIPModel(config)
        try:
            clip.load_state_dict(state, assign=True)
        except RuntimeError as err:
            raise ValueError(
                f"{str(path)!r} does not match the CLIP architecture of {source.location!r}: {err}"
            ) from None
        clip.to(device=device, dtype=dtype)
        transform = ImageTransform.from_processor(image_config, fit="pad")
        self.encoder = ClipEncoder(clip, tokenizer, transform, batch_size=batch_size)
