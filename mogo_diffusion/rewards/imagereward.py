"""ImageReward (Xu et al., 2023), the human-preference reward of THUDM/ImageReward, on transformers' BLIP.

The model is BLIP: a ViT image encoder, and a BERT text encoder whose layers cross-attend to the
image tokens. The text encoder's output at the ``[CLS]`` token goes through an MLP head (the layout
of :class:`~mogo_diffusion.rewards.clip.AestheticPredictor`: five linear layers, no activations),
and the score is standardised with the published mean and std::

    r = (head(BERT(prompt | ViT(image))[CLS]) - 0.16717362830052426) / 1.0333394966054072

``[B]`` float32, roughly standard normal over typical generations (higher is preferred). Images are
resized (bicubic, antialiased) so that the shorter side is 224, centre-cropped to 224 x 224 and
normalised with CLIP's mean and std (:class:`~mogo_diffusion.rewards.clip.ImageTransform`); prompts
are tokenized by BERT's uncased tokenizer, truncated to 35 tokens, as the original does.

The published checkpoint ``ImageReward.pt`` (hub repository ``THUDM/ImageReward``) is a state dict
of the original BLIP code. :func:`convert_original` maps it onto transformers' ``BlipVisionModel``
and ``BlipTextModel`` (built with cross-attention) and our head; the text encoder's names are
transformers' own, so only the ViT's and the head's change::

    blip.visual_encoder.cls_token              vision_model.embeddings.class_embedding
    blip.visual_encoder.pos_embed              vision_model.embeddings.position_embedding
    blip.visual_encoder.patch_embed.proj       vision_model.embeddings.patch_embedding
    blip.visual_encoder.blocks.N.              vision_model.encoder.layers.N.
        norm1, norm2, attn.qkv                     layer_norm1, layer_norm2, self_attn.qkv
        attn.proj, mlp.fc1, mlp.fc2                self_attn.projection, mlp.fc1, mlp.fc2
    blip.visual_encoder.norm                   vision_model.post_layernorm
    blip.text_encoder.*                        text_encoder.*
    mlp.layers.*                               head.layers.*
    blip.vision_proj, blip.text_proj,          (unused by the score: dropped)
    blip.text_encoder.embeddings.position_ids

A converted model is saved as a directory (:meth:`ImageRewardModel.save_pretrained`, or
:meth:`ImageReward.save_pretrained` with its tokenizer): ``config.json`` (``"format":
"mogo-imagereward/1"``, the two BLIP configs, the mean and std), ``model.safetensors`` (the
converted names above) and the tokenizer's files. To convert the published weights once::

    hf download THUDM/ImageReward ImageReward.pt --local-dir ir
    hf download google-bert/bert-base-uncased --include "*.json" "*.txt" --local-dir bert
    python -c "from mogo_diffusion.rewards.imagereward import ImageReward; \\
               ImageReward('ir/ImageReward.pt', tokenizer='bert').save_pretrained('imagereward')"

after which ``ImageReward("imagereward")`` (reward ``imagereward`` with ``model: imagereward``)
loads it. The published file is read with ``torch.load(weights_only=True)``.

>>> published = {"blip.visual_encoder.blocks.3.attn.proj.bias": torch.zeros(2),
...              "blip.text_proj.bias": torch.zeros(2), "mlp.layers.7.bias": torch.zeros(1)}
>>> sorted(convert_original(published))
['head.layers.7.bias', 'vision_model.encoder.layers.3.self_attn.projection.bias']
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mogo_diffusion import hub
from mogo_diffusion.rewards.base import check_batch, check_batch_size, floating_dtype
from mogo_diffusion.rewards.clip import AestheticPredictor, ImageTransform, tokenize
from mogo_diffusion.rewards.registry import register_reward

__all__ = [
    "BERT_TOKENIZER",
    "IMAGEREWARD_FILE",
    "IMAGEREWARD_MEAN",
    "IMAGEREWARD_REPO",
    "IMAGEREWARD_STD",
    "ImageReward",
    "ImageRewardModel",
    "convert_original",
]

IMAGEREWARD_REPO = "THUDM/ImageReward"
"""The hub repository of the published ImageReward checkpoint."""
IMAGEREWARD_FILE = "ImageReward.pt"
"""The published checkpoint in :data:`IMAGEREWARD_REPO` (a state dict of the original BLIP code)."""
BERT_TOKENIZER = "google-bert/bert-base-uncased"
"""The tokenizer ImageReward's BLIP text encoder reads (BLIP's ``init_tokenizer``)."""
IMAGEREWARD_MEAN = 0.16717362830052426
"""The mean of the head's raw output that the published model subtracts."""
IMAGEREWARD_STD = 1.0333394966054072
"""The std of the head's raw output that the published model divides by."""

_FORMAT = "mogo-imagereward/1"
_MAX_LENGTH = 35  # the original's tokenizer call: padding to 35, truncation
_VISION_EPS, _TEXT_EPS = 1e-6, 1e-12  # BLIP's ViT LayerNorm, and BERT's (med_config.json)
_VIT = "blip.visual_encoder."
_VIT_NAMES = {
    "cls_token": "embeddings.class_embedding",
    "pos_embed": "embeddings.position_embedding",
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
    "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
}
_VIT_BLOCK = re.compile(r"blocks\.(\d+)\.(norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(weight|bias)")
_VIT_BLOCK_NAMES = {
    "norm1": "layer_norm1",
    "norm2": "layer_norm2",
    "attn.qkv": "self_attn.qkv",
    "attn.proj": "self_attn.projection",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
_DROPPED = re.compile(
    r"blip\.(vision_proj|text_proj)\.(weight|bias)|blip\.text_encoder\.embeddings\.position_ids"
)


def convert_original(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The published ``ImageReward.pt`` state dict in :class:`ImageRewardModel`'s names (the
    table in the module docstring); the projections the score does not use are dropped.

    Raises:
        ValueError: a key outside that layout (the first few are named).
    """
    out: dict[str, Tensor] = {}
    unknown = []
    for key, value in state_dict.items():
        key = key.removeprefix("module.")
        if _DROPPED.fullmatch(key):
            continue
        if key.startswith("mlp.layers."):
            out["head." + key.removeprefix("mlp.")] = value
        elif key.startswith("blip.text_encoder."):
            out["text_encoder." + key.removeprefix("blip.text_encoder.")] = value
        elif key.startswith(_VIT) and key.removeprefix(_VIT) in _VIT_NAMES:
            out["vision_model." + _VIT_NAMES[key.removeprefix(_VIT)]] = value
        elif key.startswith(_VIT) and (block := _VIT_BLOCK.fullmatch(key.removeprefix(_VIT))):
            layer, module, kind = block.groups()
            out[f"vision_model.encoder.layers.{layer}.{_VIT_BLOCK_NAMES[module]}.{kind}"] = value
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"not an ImageReward state dict: unexpected keys {unknown[:8]}")
    return out


def _layers(state: Mapping[str, Tensor], prefix: str) -> int:
    found = {int(m.group(1)) for key in state if (m := re.match(re.escape(prefix) + r"(\d+)\.", key))}
    return max(found) + 1 if found else 0


def _configs(state: Mapping[str, Tensor], vision_heads: int, text_heads: int) -> tuple[Any, Any]:
    """The BLIP vision and text configs of a converted state dict (the sizes read from its shapes,
    the head counts given)."""
    from transformers import BlipTextConfig, BlipVisionConfig

    try:
        patch = state["vision_model.embeddings.patch_embedding.weight"]
        positions = state["vision_model.embeddings.position_embedding"].shape[1]
        words = state["text_encoder.embeddings.word_embeddings.weight"]
        vision = BlipVisionConfig(
            hidden_size=patch.shape[0],
            intermediate_size=state["vision_model.encoder.layers.0.mlp.fc1.weight"].shape[0],
            num_hidden_layers=_layers(state, "vision_model.encoder.layers."),
            num_attention_heads=vision_heads,
            patch_size=patch.shape[-1],
            image_size=patch.shape[-1] * math.isqrt(positions - 1),
            layer_norm_eps=_VISION_EPS,
        )
        text = BlipTextConfig(
            vocab_size=words.shape[0],
            hidden_size=words.shape[1],
            encoder_hidden_size=state["text_encoder.encoder.layer.0.crossattention.self.key.weight"].shape[1],
            intermediate_size=state["text_encoder.encoder.layer.0.intermediate.dense.weight"].shape[0],
            num_hidden_layers=_layers(state, "text_encoder.encoder.layer."),
            num_attention_heads=text_heads,
            max_position_embeddings=state["text_encoder.embeddings.position_embeddings.weight"].shape[0],
            layer_norm_eps=_TEXT_EPS,
            is_decoder=True,  # builds the cross-attention; the score runs it bidirectionally
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=None,
            sep_token_id=None,
        )
    except (KeyError, IndexError) as err:
        raise ValueError(f"not an ImageReward state dict: no {err}") from None
    return vision, text


class ImageRewardModel(nn.Module):
    """ImageReward's network: ``(pixels [B, 3, S, S], tokens [B, L]) -> [B]`` standardised scores.

    Args:
        vision_config: a transformers ``BlipVisionConfig`` (ViT-L/16 at 224 px for the published model).
        text_config: a ``BlipTextConfig`` with ``is_decoder=True`` (so that its layers have
            cross-attention) and ``encoder_hidden_size`` the ViT's width.
        mean, std: the standardisation of the head's output.
    """

    def __init__(
        self,
        vision_config: Any,
        text_config: Any,
        *,
        mean: float = IMAGEREWARD_MEAN,
        std: float = IMAGEREWARD_STD,
    ) -> None:
        from transformers import BlipTextModel, BlipVisionModel

        super().__init__()
        if text_config.encoder_hidden_size != vision_config.hidden_size:
            raise ValueError(
                f"the text encoder cross-attends to {text_config.encoder_hidden_size}-d image tokens; "
                f"the ViT gives {vision_config.hidden_size}-d ones"
            )
        self.vision_model = BlipVisionModel(vision_config)
        self.text_encoder = BlipTextModel(text_config, add_pooling_layer=False)
        self.head = AestheticPredictor(text_config.hidden_size)
        self.mean, self.std = float(mean), float(std)

    def forward(self, pixel_values: Tensor, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        image = self.vision_model(pixel_values=pixel_values).last_hidden_state
        text = self.text_encoder(
            input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image, is_decoder=False
        ).last_hidden_state
        return (self.head(text[:, 0].float()) - self.mean) / self.std

    @classmethod
    def from_original(
        cls, state_dict: Mapping[str, Tensor], *, vision_heads: int = 16, text_heads: int = 12
    ) -> ImageRewardModel:
        """The model of a published-layout state dict (:func:`convert_original`); the sizes are read
        from its shapes, the attention head counts (not in the file) given: 16 and 12 published.

        Raises:
            ValueError: the state dict is not of that layout, or does not fit the sizes.
        """
        state = convert_original(state_dict)
        vision, text = _configs(state, vision_heads, text_heads)
        model = cls(vision, text)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"ImageReward state dict: missing {missing[:8]}, unexpected {unexpected[:8]}")
        return model.eval().requires_grad_(False)

    def save_pretrained(self, directory: str | os.PathLike[str]) -> None:
        """Write ``config.json`` and ``model.safetensors`` (float32) into ``directory``."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = {
            "format": _FORMAT,
            "vision_config": self.vision_model.config.to_dict(),
            "text_config": self.text_encoder.config.to_dict(),
            "mean": self.mean,
            "std": self.std,
        }
        (directory / "config.json").write_text(json.dumps(config, indent=1))
        state = {k: v.detach().float().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(state, directory / "model.safetensors")

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str]) -> ImageRewardModel:
        """Load what :meth:`save_pretrained` wrote; in eval mode, gradients off.

        Raises:
            ValueError: ``config.json`` is not of this format, or the weights do not fit it (the
                message names the file).
        """
        from transformers import BlipTextConfig, BlipVisionConfig

        directory = Path(directory)
        where = directory / "config.json"
        try:
            config = json.loads(where.read_text())
            if config.get("format") != _FORMAT:
                raise ValueError(f"format {config.get('format')!r}, expected {_FORMAT!r}")
            vision = BlipVisionConfig.from_dict(config["vision_config"])
            text = BlipTextConfig.from_dict(config["text_config"])
            model = cls(vision, text, mean=config["mean"], std=config["std"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{str(where)!r} is not an ImageReward config: {err}") from None
        weights = directory / "model.safetensors"
        try:
            model.load_state_dict(hub.read_state_dict(weights))
        except RuntimeError as err:
            raise ValueError(f"{str(weights)!r} does not match {str(where)!r}: {err}") from None
        return model.eval().requires_grad_(False)


def _is_converted(path: Path) -> bool:
    config = path / "config.json"
    return path.is_dir() and config.is_file() and _FORMAT in config.read_text()


def _original_checkpoint(model: str | os.PathLike[str], only_local: bool) -> Path | None:
    """The published checkpoint named by ``model`` (a file, a directory holding
    :data:`IMAGEREWARD_FILE`, or a hub id), or None where ``model`` is a converted directory."""
    if _is_converted(Path(os.path.expanduser(model))):
        return None
    return hub.checkpoint_file(
        model, IMAGEREWARD_FILE, "ImageReward checkpoint", repo=IMAGEREWARD_REPO, only_local=only_local
    )


@register_reward("imagereward")
class ImageReward:
    """ImageReward of each image and its prompt, ``[B]`` float32 (see the module docstring).

    Args:
        model: a converted directory (:meth:`save_pretrained`; its tokenizer is read from it), or
            the published checkpoint, converted on loading: ``ImageReward.pt``
            (:data:`IMAGEREWARD_FILE`), a directory holding it, or a hub id (:data:`IMAGEREWARD_REPO`).
        tokenizer: hub id or directory of the BERT tokenizer, for a published checkpoint
            (:data:`BERT_TOKENIZER`); a converted directory's own is used otherwise.
        vision_heads, text_heads: the attention heads of a published checkpoint (16 and 12; the
            file does not record them); a converted directory's config holds its own.
        device, dtype, batch_size, local_files_only: as in
            :class:`~mogo_diffusion.rewards.clip.PickScore`; the head runs in float32.

    Raises:
        FileNotFoundError: a path that does not exist, or a directory that holds no model.
        OSError: a hub id that cannot be loaded (offline: not in the cache); the message says how
            to download it.
        ValueError: weights that are not ImageReward's or do not fit its config (names the file).
    """

    name = "imagereward"

    def __init__(
        self,
        model: str | os.PathLike[str] = IMAGEREWARD_REPO,
        *,
        tokenizer: str | os.PathLike[str] = BERT_TOKENIZER,
        vision_heads: int = 16,
        text_heads: int = 12,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        batch_size: int = 32,
        local_files_only: bool | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        dtype, self.batch_size = floating_dtype(dtype), check_batch_size(batch_size)
        only_local = hub.offline(local_files_only)
        original = _original_checkpoint(model, only_local)
        if original is None:
            self.model = ImageRewardModel.from_pretrained(model)
            tokenizer = model
        else:
            try:
                self.model = ImageRewardModel.from_original(
                    hub.read_state_dict(original), vision_heads=vision_heads, text_heads=text_heads
                )
            except ValueError as err:
                raise ValueError(f"{str(original)!r}: {err}") from None
        source = hub.resolve(tokenizer, "ImageReward tokenizer")
        with hub.loading("ImageReward tokenizer", source, only_local, include=hub.CONFIG_FILES):
            self.tokenizer = AutoTokenizer.from_pretrained(source.location, local_files_only=only_local)
        self.model.to(device=device, dtype=dtype)
        self.model.head.float()
        size = self.model.vision_model.config.image_size
        self.transform = ImageTransform(size=size, resize=size)
        positions = self.model.text_encoder.config.max_position_embeddings
        self.max_length = min(_MAX_LENGTH, positions)

    def save_pretrained(self, directory: str | os.PathLike[str]) -> None:
        """Save the model and its tokenizer as a converted directory (see the module docstring)."""
        self.model.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)

    @property
    def device(self) -> torch.device:
        """Where the model is."""
        return self.model.head.layers[0].weight.device

    def to(self, device: torch.device | str) -> ImageReward:
        """Move the model; returns ``self``."""
        self.model.to(device)
        return self

    @torch.no_grad()
    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]] | None = None
    ) -> Tensor:
        check_batch(images, prompts, metadata)
        dtype = self.model.vision_model.embeddings.patch_embedding.weight.dtype
        out = [torch.empty(0, device=self.device)]  # for B = 0
        for start in range(0, images.shape[0], self.batch_size):
            part = slice(start, start + self.batch_size)
            pixels = self.transform(images[part]).to(device=self.device, dtype=dtype)
            tokens = tokenize(self.tokenizer, prompts[part], self.max_length, self.device)
            out.append(self.model(pixels, tokens["input_ids"], tokens["attention_mask"]))
        return torch.cat(out)
