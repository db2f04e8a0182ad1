"""CLIP-family rewards: PickScore, CLIPScore and the LAION aesthetic predictor.

Each scores ``[B, 3, H, W]`` images in ``[0, 1]`` against their B prompts as DiffusionNFT and
Flow-GRPO do, from the unit embeddings ``u = f_img(x) / ||f_img(x)||`` and ``w = f_txt(p) / ||f_txt(p)||``:

* :class:`PickScore` (``"pickscore"``): ``exp(logit_scale) * <u, w> / 26`` with the PickScore_v1
  CLIP-H model (``exp(logit_scale)`` is its learned temperature, about 100; the 26 brings the reward
  near ``[0, 1]``);
* :class:`ClipScore` (``"clipscore"``): ``<u, w>``, in ``[-1, 1]``, with OpenAI's CLIP ViT-L/14;
* :class:`Aesthetic` (``"aesthetic"``): ``MLP(u)``, the LAION "improved aesthetic predictor" on
  the CLIP ViT-L/14 image embedding (about 1 to 10); the prompt is not used.

HPSv2.1 (``"hpsv21"``) is in :mod:`mogo_diffusion.rewards.hps`. Images are preprocessed in torch
on their own device (:class:`ImageTransform`), in float32, with no 8-bit round trip: the reference
pipelines of PickScore and the aesthetic predictor go through PIL, which differs by about 1/255 per
pixel. Models load from a hub id or a local directory (:mod:`mogo_diffusion.hub`;
``HF_HUB_OFFLINE=1`` reads the local cache only); no remote code is run. Scores are float32 ``[B]``
on the model's device, computed under ``no_grad``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from mogo_diffusion import hub
from mogo_diffusion.rewards.base import check_batch, check_batch_size, floating_dtype
from mogo_diffusion.rewards.registry import register_reward

__all__ = [
    "AESTHETIC_FILE",
    "CLIP_H14",
    "CLIP_L14",
    "PICKSCORE_MODEL",
    "Aesthetic",
    "AestheticPredictor",
    "ClipEncoder",
    "ClipScore",
    "EncoderReward",
    "ImageTransform",
    "PickScore",
    "load_processor",
    "tokenize",
]

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
"""The PickScore weights, a transformers ``CLIPModel``, on the hub."""
CLIP_H14 = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
"""The hub id of LAION's CLIP ViT-H/14, whose tokenizer and image processor PickScore uses and whose
architecture HPSv2.1 has."""
CLIP_L14 = "openai/clip-vit-large-patch14"
"""The hub id of OpenAI's CLIP ViT-L/14, the model of CLIPScore and the aesthetic predictor's encoder."""
AESTHETIC_FILE = "sac+logos+ava1-l14-linearMSE.pth"
"""The aesthetic predictor's weights, in github.com/christophschuhmann/improved-aesthetic-predictor."""

_PICKSCORE_SCALE = 26.0
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # transformers' defaults for CLIP processors
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


# Preprocessing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageTransform:
    """``[B, 3, H, W]`` images in ``[0, 1]`` to CLIP inputs ``[B, 3, size, size]``, float32.

    ``fit="crop"`` (CLIP's image processors): resize so that the shorter side is ``resize``
    (``size`` when None; the longer side becomes ``int(resize * long / short)``), then keep the centre
    ``size x size``. ``fit="pad"`` (HPSv2's ``ResizeMaxSize``): resize so that the longer side is
    ``size``, then pad with zeros (black) to ``size x size``, centred. Resizing is antialiased (as
    PIL's, for ``"bicubic"``). Then each channel ``c`` becomes ``(x_c - mean_c) / std_c``.
    """

    size: int
    mean: tuple[float, float, float] = _CLIP_MEAN
    std: tuple[float, float, float] = _CLIP_STD
    resize: int | None = None
    interpolation: Literal["bicubic", "bilinear"] = "bicubic"
    fit: Literal["crop", "pad"] = "crop"

    def __post_init__(self) -> None:
        if self.size < 1 or (self.resize is not None and self.resize < self.size):
            raise ValueError(f"need 1 <= size <= resize, got size={self.size}, resize={self.resize}")
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise ValueError(f"mean and std must be 3 numbers each, std > 0; got {self.mean}, {self.std}")
        if self.interpolation not in ("bicubic", "bilinear") or self.fit not in ("crop", "pad"):
            raise ValueError(
                f"interpolation must be 'bicubic' or 'bilinear' and fit 'crop' or 'pad', "
                f"got {self.interpolation!r}, {self.fit!r}"
            )

    @classmethod
    def from_processor(cls, config: Mapping[str, Any], **options: Any) -> ImageTransform:
        """From a CLIP image processor's config (``preprocessor_config.json``: ``size``, ``crop_size``,
        ``image_mean``, ``image_std``); ``options`` set the other fields."""
        crop = config.get("crop_size", config.get("size"))
        if isinstance(crop, Mapping):
            if crop.get("height") != crop.get("width"):
                raise ValueError(f"CLIP needs a square crop_size, got {dict(crop)}")
            crop = crop["height"]
        resize = config.get("size", crop)
        if isinstance(resize, Mapping):
            resize = resize.get("shortest_edge", resize.get("height"))
        if not isinstance(crop, int) or not isinstance(resize, int):
            raise ValueError(
                f"unsupported image processor sizes: size={config.get('size')!r}, "
                f"crop_size={config.get('crop_size')!r}"
            )
        mean = tuple(config.get("image_mean", _CLIP_MEAN))
        std = tuple(config.get("image_std", _CLIP_STD))
        return cls(size=crop, mean=mean, std=std, resize=resize, **options)

    def __call__(self, images: Tensor) -> Tensor:
        x = images.to(torch.float32)
        height, width = x.shape[-2:]
        if self.fit == "crop":
            short = self.resize or self.size
            if height <= width:
                shape = (short, int(short * width / height))
            else:
                shape = (int(short * height / width), short)
        else:
            scale = self.size / max(height, width)
            shape = (max(round(height * scale), 1), max(round(width * scale), 1))
        if shape != (height, width):
            x = nn.functional.interpolate(x, size=shape, mode=self.interpolation, antialias=True)
        height, width = shape
        if self.fit == "crop":
            top, left = (height - self.size) // 2, (width - self.size) // 2
            x = x[..., top : top + self.size, left : left + self.size]
        else:
            pad_h, pad_w = self.size - height, self.size - width
            x = nn.functional.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device)[:, None, None]
        std = torch.tensor(self.std, dtype=x.dtype, device=x.device)[:, None, None]
        return (x - mean) / std


# The encoder -------------------------------------------------------------------------------------


class ClipEncoder:
    """A transformers ``CLIPModel`` with its tokenizer and :class:`ImageTransform`: unit embeddings.

    Args:
        model: a ``CLIPModel``, already on its device and in its dtype; it is put in eval mode
            with gradients off.
        tokenizer: its tokenizer; prompts are truncated to the model's context (77 tokens for CLIP).
        transform: images to model inputs.
        batch_size: at most this many images, or prompts, per forward pass.
    """

    def __init__(
        self, model: Any, tokenizer: Any, transform: ImageTransform, *, batch_size: int = 32
    ) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.transform = transform
        self.batch_size = check_batch_size(batch_size)
        context = model.config.text_config.max_position_embeddings
        self.max_length = min(context, tokenizer.model_max_length or context)

    @classmethod
    def from_pretrained(
        cls,
        model: str | os.PathLike[str],
        *,
        processor: str | os.PathLike[str] | None = None,
        what: str = "CLIP model",
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        batch_size: int = 32,
        local_files_only: bool | None = None,
        **transform: Any,
    ) -> ClipEncoder:
        """Load the ``CLIPModel`` of ``model``, and the tokenizer and image processor config of
        ``processor`` (``model`` when None); each a hub id or a local directory.

        ``what`` names the model in errors; ``transform`` (``interpolation``, ``fit``) goes to
        :meth:`ImageTransform.from_processor`; ``local_files_only=None`` follows ``HF_HUB_OFFLINE``.

        Raises:
            FileNotFoundError: a path that does not exist (and is not a hub id).
            OSError: a model that cannot be loaded; for a hub id missing from the cache, the message
                names it and says how to download it.
        """
        from transformers import CLIPModel

        dtype, batch_size = floating_dtype(dtype), check_batch_size(batch_size)
        only_local = hub.offline(local_files_only)
        processor = model if processor is None else processor
        source = hub.resolve(model, what)
        with hub.loading(what, source, only_local):
            clip = CLIPModel.from_pretrained(source.location, local_files_only=only_local)
        config, tokenizer = load_processor(processor, f"{what}'s processor", only_local)
        clip.to(device=device, dtype=dtype)
        return cls(clip, tokenizer, ImageTransform.from_processor(config, **transform), batch_size=batch_size)

    @property
    def device(self) -> torch.device:
        """Where the model is."""
        return self.model.logit_scale.device

    def to(self, device: torch.device | str) -> ClipEncoder:
        """Move the model; returns ``self``."""
        self.model.to(device)
        return self

    def _chunks(self, n: int) -> list[slice]:
        return [slice(i, i + self.batch_size) for i in range(0, n, self.batch_size)]

    @torch.no_grad()
    def image_embeds(self, images: Tensor) -> Tensor:
        """``[B, 3, H, W]`` in ``[0, 1]`` to unit image embeddings ``u``, ``[B, D]`` float32."""
        dtype = self.model.logit_scale.dtype
        out = [torch.empty(0, self.model.config.projection_dim, device=self.device)]  # for B = 0
        for chunk in self._chunks(images.shape[0]):
            pixels = self.transform(images[chunk]).to(device=self.device, dtype=dtype)
            pooled = self.model.vision_model(pixel_values=pixels).pooler_output
            out.append(self.model.visual_projection(pooled).float())
        embeds = torch.cat(out)
        return embeds / embeds.norm(dim=-1, keepdim=True)

    @torch.no_grad()
    def text_embeds(self, prompts: Sequence[str]) -> Tensor:
        """B prompts to unit text embeddings ``w``, ``[B, D]`` float32."""
        out = [torch.empty(0, self.model.config.projection_dim, device=self.device)]  # for B = 0
        for chunk in self._chunks(len(prompts)):
            tokens = tokenize(self.tokenizer, prompts[chunk], self.max_length, self.device)
            output = self.model.text_model(
                input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]
            )
            out.append(self.model.text_projection(output.pooler_output).float())
        embeds = torch.cat(out)
        return embeds / embeds.norm(dim=-1, keepdim=True)

    def cosine(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        """``<u_i, w_i>``, each image with its own prompt: ``[B]`` float32."""
        return (self.image_embeds(images) * self.text_embeds(prompts)).sum(dim=-1)


def tokenize(tokenizer: Any, prompts: Sequence[str], max_length: int, device: torch.device) -> Any:
    """The ``input_ids`` and ``attention_mask`` (``[B, L]``, on ``device``) of ``tokenizer`` for B
    ``prompts``, padded to the longest and truncated to ``max_length`` tokens."""
    options = {"padding": True, "truncation": True, "max_length": max_length, "return_tensors": "pt"}
    return tokenizer(list(prompts), **options).to(device)


def load_processor(
    processor: str | os.PathLike[str], what: str, only_local: bool
) -> tuple[dict[str, Any], Any]:
    """The image processor config (``preprocessor_config.json`` as a dict) and the tokenizer of a
    CLIP hub id or directory; ``what`` names it in errors, ``only_local`` reads the hub cache alone.

    Raises:
        FileNotFoundError, OSError: as :meth:`ClipEncoder.from_pretrained`.
    """
    from transformers import AutoTokenizer, ImageProcessingMixin

    source = hub.resolve(processor, what)
    with hub.loading(what, source, only_local, include=hub.CONFIG_FILES):
        config, _ = ImageProcessingMixin.get_image_processor_dict(
            source.location, local_files_only=only_local
        )
        tokenizer = AutoTokenizer.from_pretrained(source.location, local_files_only=only_local)
    return config, tokenizer


# The rewards -------------------------------------------------------------------------------------


class EncoderReward:
    """The part every CLIP-scored reward shares: a call checks the batch (the metadata is not read)
    and returns :meth:`score`, computed through ``self.encoder``, a :class:`ClipEncoder`, which
    :meth:`to` moves."""

    encoder: ClipEncoder

    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]] | None = None
    ) -> Tensor:
        check_batch(images, prompts, metadata)
        return self.score(images, prompts)

    @torch.no_grad()
    def score(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        """``[B]`` float32 scores of ``[B, 3, H, W]`` images in ``[0, 1]`` and their B prompts: the
        cosine ``<u_i, w_i>`` (:meth:`ClipEncoder.cosine`), unless a reward says otherwise."""
        return self.encoder.cosine(images, prompts)

    def to(self, device: torch.device | str) -> EncoderReward:
        """Move the model; returns ``self``."""
        self.encoder.to(device)
        return self


@register_reward("pickscore")
class PickScore(EncoderReward):
    """PickScore (Kirstain et al., 2023) as DiffusionNFT and Flow-GRPO scale it:
    ``exp(logit_scale) * <u, w> / 26``, ``[B]`` float32.

    Args:
        model: hub id or directory of the PickScore ``CLIPModel`` (:data:`PICKSCORE_MODEL`).
        processor: hub id or directory of its tokenizer and image processor (:data:`CLIP_H14`;
            only its JSON and text files are read).
        device: where the model runs (the CPU by default); images may be on any device.
        dtype: the model's dtype (float32 by default), or its name.
        batch_size: images, or prompts, per forward pass.
        local_files_only: read only the hub cache; None follows ``HF_HUB_OFFLINE``.

    Raises:
        FileNotFoundError, OSError: see :meth:`ClipEncoder.from_pretrained`.
    """

    name = "pickscore"

    def __init__(
        self,
        model: str | os.PathLike[str] = PICKSCORE_MODEL,
        *,
        processor: str | os.PathLike[str] = CLIP_H14,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        batch_size: int = 32,
        local_files_only: bool | None = None,
    ) -> None:
        self.encoder = ClipEncoder.from_pretrained(
            model,
            processor=processor,
            what="PickScore model",
            device=device,
            dtype=dtype,
            batch_size=batch_size,
            local_files_only=local_files_only,
        )

    @torch.no_grad()
    def score(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        """``exp(logit_scale) * <u_i, w_i> / 26``, ``[B]`` float32."""
        temperature = self.encoder.model.logit_scale.float().exp()
        return temperature * self.encoder.cosine(images, prompts) / _PICKSCORE_SCALE


@register_reward("clipscore")
class ClipScore(EncoderReward):
    """CLIPScore: the cosine ``<u, w>`` of each image and its prompt, ``[B]`` float32 in ``[-1, 1]``.

    DiffusionNFT's ``logits_per_image / 100`` (CLIP ViT-L/14's ``exp(logit_scale)`` is 100),
    computed directly; Flow-GRPO divides by 30 instead. Images are resized bilinearly, as
    DiffusionNFT's tensor transform does (torchvision's default), not bicubically as CLIP's
    processor does.

    Args:
        model: hub id or directory of a ``CLIPModel`` with its tokenizer and image processor
            (:data:`CLIP_L14`).
        device, dtype, batch_size, local_files_only: as in :class:`PickScore`.
    """

    name = "clipscore"

    def __init__(
        self,
        model: str | os.PathLike[str] = CLIP_L14,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        batch_size: int = 32,
        local_files_only: bool | None = None,
    ) -> None:
        self.encoder = ClipEncoder.from_pretrained(
            model,
            what="CLIPScore model",
            device=device,
            dtype=dtype,
            batch_size=batch_size,
            local_files_only=local_files_only,
            interpolation="bilinear",
        )


class AestheticPredictor(nn.Module):
    """The LAION aesthetic predictor's MLP: unit CLIP image embeddings ``[B, dim]`` to scores ``[B]``.

    ``Linear(dim, 1024), Dropout(0.2), Linear(1024, 128), Dropout(0.2), Linear(128, 64),
    Dropout(0.1), Linear(64, 16), Linear(16, 1)``, with no activations: the layout (state dict keys
    ``layers.{0,2,4,6,7}.{weight,bias}``) of ``sac+logos+ava1-l14-linearMSE.pth``, where ``dim`` is 768.
    """

    def __init__(self, dim: int = 768) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeds: Tensor) -> Tensor:
        return self.layers(embeds).squeeze(-1)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> AestheticPredictor:
        """Load a ``.pth`` (read with ``torch.load(weights_only=True)``) or ``.safetensors`` state
        dict; ``dim`` is taken from it. The predictor is returned in eval mode, gradients off.

        Raises:
            FileNotFoundError: no such file (the message says where to get it).
            ValueError: the file is not such a state dict (the message names the file and the mismatch).
        """
        path = Path(os.path.expanduser(path))
        if not path.is_file():
            raise FileNotFoundError(
                f"aesthetic predictor weights {str(path)!r} not found; download {AESTHETIC_FILE} from "
                "https://github.com/christophschuhmann/improved-aesthetic-predictor"
            )
        state = hub.read_state_dict(path)
        weight = state.get("layers.0.weight")
        if not isinstance(weight, Tensor) or weight.ndim != 2:
            raise ValueError(
                f"{str(path)!r} is not an aesthetic predictor state dict (no 2-d layers.0.weight)"
            )
        predictor = cls(weight.shape[1])
        try:
            predictor.load_state_dict(state)
        except RuntimeError as err:
            raise ValueError(f"{str(path)!r} does not match the aesthetic predictor: {err}") from None
        return predictor.eval().requires_grad_(False)


@register_reward("aesthetic")
class Aesthetic(EncoderReward):
    """The LAION aesthetic score ``MLP(u)`` of each image, ``[B]`` float32 (about 1 to 10); the
    prompts are not used.

    Args:
        predictor: path of ``sac+logos+ava1-l14-linearMSE.pth`` (:data:`AESTHETIC_FILE`), or of a
            safetensors copy.
        model: hub id or directory of the CLIP model whose image embeddings the predictor reads
            (:data:`CLIP_L14`); its embedding size must be the predictor's input size.
        device, dtype, batch_size, local_files_only: as in :class:`PickScore`; the MLP runs in
            float32.

    Raises:
        FileNotFoundError, ValueError: see :meth:`AestheticPredictor.from_file`; ``ValueError`` also
            when the sizes do not match.
        OSError: see :meth:`ClipEncoder.from_pretrained`.
    """

    name = "aesthetic"

    def __init__(
        self,
        predictor: str | os.PathLike[str],
        *,
        model: str | os.PathLike[str] = CLIP_L14,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        batch_size: int = 32,
        local_files_only: bool | None = None,
    ) -> None:
        self.predictor = AestheticPredictor.from_file(predictor)
        self.encoder = ClipEncoder.from_pretrained(
            model,
            what="aesthetic CLIP model",
            device=device,
            dtype=dtype,
            batch_size=batch_size,
            local_files_only=local_files_only,
        )
        takes, gives = self.predictor.layers[0].in_features, self.encoder.model.config.projection_dim
        if takes != gives:
            raise ValueError(
                f"the aesthetic predictor {str(predictor)!r} takes {takes}-d embeddings; "
                f"the CLIP model {str(model)!r} gives {gives}-d ones"
            )
        self.predictor.to(self.encoder.device)

    def to(self, device: torch.device | str) -> Aesthetic:
        """Move both models; returns ``self``."""
        super().to(device)
        self.predictor.to(device)
        return self

    @torch.no_grad()
    def score(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        """``MLP(u_i)``, ``[B]`` float32; the prompts are not read."""
        return self.predictor(self.encoder.image_embeds(images))
