"""Stable Diffusion 3 / 3.5 models: loading, a tiny offline builder, prompt encoding and LoRA adapters.

Loading. :func:`load_pipeline` and :func:`load_component` take a hub id (``"org/name"``) or a local
directory laid out by ``save_pretrained``. Weights are read from safetensors files only (pickled
``.bin`` checkpoints are refused). ``local_files_only=None`` follows ``HF_HUB_OFFLINE``; what is a hub
id and what a path is decided by :func:`mogo_diffusion.hub.resolve`.

Tiny models. :func:`tiny_sd3` builds a complete :class:`~diffusers.StableDiffusion3Pipeline` from
configs with seeded random weights and tokenizers built in memory (:mod:`mogo_diffusion.tokenizers`):
no file is read. It saves with ``save_pretrained`` and loads back through :func:`load_pipeline`.
:func:`tiny_pipeline` puts the same tiny text encoders and VAE, at the widths a transformer reads,
around any transformer: SD3.5-M's at its real size, say, built from its config.

Geometry. Square images of ``resolution`` pixels are latents of :func:`latent_size` a side, which
the trainer samples and ``--check`` counts.

LoRA. DiffusionNFT evaluates one transformer three ways: the trained adapter (``"default"``), the
old sampling adapter (``"old"``, an EMA of the trained one) and the base model (adapters disabled,
the KL reference). :func:`add_lora` adds both adapters on
:data:`~mogo_diffusion.config.schema.LORA_TARGETS`; :func:`adapter` and :func:`reference` select what a
forward uses; :func:`ema_update` moves the old adapter,

.. code-block:: text

    theta_old <- decay * theta_old + (1 - decay) * theta

and :func:`save_lora` writes an adapter in the diffusers format, which
``StableDiffusion3Pipeline.load_lora_weights(directory)`` loads into any pipeline.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import diffusers
import torch
import transformers
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from packaging.version import Version
from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from peft.utils import get_peft_model_state_dict
from torch import Tensor, nn
from transformers import (
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

from mogo_diffusion import hub
from mogo_diffusion.config import LORA_TARGETS
from mogo_diffusion.peft_adapters import selected
from mogo_diffusion.tokenizers import DEFAULT_CORPUS, clip_tokenizer, t5_tokenizer

__all__ = [
    "LORA_TARGETS",
    "OLD",
    "TINY_PRESETS",
    "TRAINED",
    "adapter",
    "add_lora",
    "ema_update",
    "encode_prompts",
    "fused",
    "latent_size",
    "load_component",
    "load_pipeline",
    "lora_parameters",
    "merged",
    "reference",
    "save_lora",
    "tiny_pipeline",
    "tiny_sd3",
]

TRAINED = "default"
"""Name of the trained LoRA adapter."""
OLD = "old"
"""Name of the old (sampling) LoRA adapter."""
TINY_PRESETS: dict[str, dict[str, int]] = {
    "smoke": {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 32},
    "small": {"num_layers": 4, "num_attention_heads": 4, "attention_head_dim": 32},
}
"""Transformer sizes of :func:`tiny_sd3`: "smoke" (0.32M parameters), "small" (2.4M)."""

_COMPONENTS: dict[str, Any] = {
    "transformer": SD3Transformer2DModel,
    "vae": AutoencoderKL,
    "text_encoder": CLIPTextModelWithProjection,
    "text_encoder_2": CLIPTextModelWithProjection,
    "text_encoder_3": T5EncoderModel,
    "tokenizer": CLIPTokenizer,
    "tokenizer_2": CLIPTokenizer,
    "tokenizer_3": T5Tokenizer,
    "scheduler": FlowMatchEulerDiscreteScheduler,
}
# from_pretrained's dtype argument: "torch_dtype" was renamed "dtype" (deprecated in diffusers 0.42.1
# and transformers 5, the versions checked here; older ones know only "torch_dtype").
_DTYPE_KEYWORD = {
    "diffusers": "dtype" if Version(diffusers.__version__) >= Version("0.42.1") else "torch_dtype",
    "transformers": "dtype" if Version(transformers.__version__) >= Version("5") else "torch_dtype",
}


def _dtype_argument(cls: type, torch_dtype: torch.dtype | None) -> dict[str, torch.dtype]:
    return {} if torch_dtype is None else {_DTYPE_KEYWORD[cls.__module__.split(".")[0]]: torch_dtype}


# Loading ------------------------------------------------------------------------------------------


def load_pipeline(
    model: str | os.PathLike[str],
    *,
    revision: str | None = None,
    variant: str | None = None,
    torch_dtype: torch.dtype | None = None,
    local_files_only: bool | None = None,
    **components: Any,
) -> StableDiffusion3Pipeline:
    """Load a :class:`~diffusers.StableDiffusion3Pipeline` from a hub id or a local directory.

    Args:
        model: a hub id ``"org/name"`` or a directory with ``model_index.json``.
        revision: hub branch, tag or commit (hub ids only).
        variant: weight file variant, e.g. ``"fp16"`` for ``*.fp16.safetensors``.
        torch_dtype: dtype of the loaded weights; ``None`` keeps the stored dtype.
        local_files_only: read the hub cache only; ``None`` follows ``HF_HUB_OFFLINE``.
        components: replacements passed to ``from_pretrained``, e.g. ``text_encoder_3=None``.

    Raises:
        FileNotFoundError: ``model`` is neither a hub id nor an existing directory, or the directory
            has no ``model_index.json``; the message names the path.
        NotADirectoryError: ``model`` is a file.
        ValueError: a ``revision`` for a local directory.
        OSError: the pipeline cannot be loaded (a hub id not cached, when offline); the message
            names the source and, for a hub id, how to download it (:func:`mogo_diffusion.hub.loading`).
    """
    source = hub.resolve(model, "model", directory=True, revision=revision)
    index = Path(source.location) / "model_index.json"
    if source.is_local and not index.is_file():
        raise FileNotFoundError(f"{str(index)!r} not found: not a saved pipeline")
    offline = hub.offline(local_files_only)
    with hub.loading("the pipeline", source, offline):
        return StableDiffusion3Pipeline.from_pretrained(
            source.location,
            revision=revision,
            variant=variant,
            local_files_only=offline,
            use_safetensors=True,
            **_dtype_argument(StableDiffusion3Pipeline, torch_dtype),
            **components,
        )


def load_component(
    model: str | os.PathLike[str],
    name: str,
    *,
    revision: str | None = None,
    variant: str | None = None,
    torch_dtype: torch.dtype | None = None,
    local_files_only: bool | None = None,
) -> Any:
    """Load one component of a saved SD3 pipeline (its subfolder ``name``) without the others.

    Args:
        model: a hub id ``"org/name"`` or a pipeline directory.
        name: ``"transformer"``, ``"vae"``, ``"text_encoder"``, ``"text_encoder_2"``,
            ``"text_encoder_3"``, ``"tokenizer"``, ``"tokenizer_2"``, ``"tokenizer_3"`` or ``"scheduler"``.
        revision, variant, torch_dtype, local_files_only: as in :func:`load_pipeline` (``variant`` and
            ``torch_dtype`` apply to models only).

    Raises:
        ValueError: unknown ``name``.
        FileNotFoundError: missing directory or subfolder; the message names the path.
        OSError: as :func:`load_pipeline`.
    """
    if name not in _COMPONENTS:
        raise ValueError(f"unknown SD3 component {name!r}; expected one of {sorted(_COMPONENTS)}")
    source = hub.resolve(model, "model", directory=True, revision=revision)
    if source.is_local and not (Path(source.location) / name).is_dir():
        raise FileNotFoundError(f"component directory {str(Path(source.location) / name)!r} does not exist")
    offline = hub.offline(local_files_only)
    cls = _COMPONENTS[name]
    kwargs: dict[str, Any] = {"subfolder": name, "revision": revision, "local_files_only": offline}
    if issubclass(cls, nn.Module):
        kwargs.update(variant=variant, use_safetensors=True, **_dtype_argument(cls, torch_dtype))
    with hub.loading(f"the {name}", source, offline):
        return cls.from_pretrained(source.location, **kwargs)


# Tiny pipelines -----------------------------------------------------------------------------------


def tiny_sd3(
    preset: str = "smoke",
    *,
    seed: int = 0,
    max_sequence_length: int = 16,
    corpus: Sequence[str] = DEFAULT_CORPUS,
    torch_dtype: torch.dtype = torch.float32,
) -> StableDiffusion3Pipeline:
    """A complete SD3 pipeline with random weights, built offline from configs.

    The transformer follows SD3.5 (patch 2, RMS qk-norm, dual attention in block 0) at the size of
    ``TINY_PRESETS[preset]``; a 3-level VAE with 16 latent channels (0.25M parameters) makes
    ``[B, 16, 8, 8]`` latents of 32 px images, with SD3.5's shift 0.0609 and scale 1.5305 so that
    code which forgets them fails on tiny models too; two CLIP encoders (width 32, projection 32)
    and a T5 encoder (width 64) read 16-token prompts by default; the scheduler is SD3's
    flow-matching Euler with shift 3. The same ``seed`` gives the same weights in every process,
    and the global RNG state is left as it was.

    Args:
        preset: ``"smoke"`` (2 layers, width 64, 0.32M transformer parameters) for unit tests or
            ``"small"`` (4 layers, 4 heads x 32, 2.4M) for demos.
        seed: seed of the random weights.
        max_sequence_length: tokens per prompt of each tokenizer (CLIP pads to it; T5 is read at
            this length by :func:`encode_prompts`'s default). Prompt embeddings have
            ``2 * max_sequence_length`` tokens.
        corpus: the texts the tokenizers are learned from (:mod:`mogo_diffusion.tokenizers`); a
            model's own captions make each of their words one token, so short prompts stay short.
        torch_dtype: dtype of all weights.

    Returns:
        A pipeline whose default image is 32 x 32 px (``transformer.config.sample_size`` 8 latents).
    """
    if preset not in TINY_PRESETS:
        raise ValueError(f"unknown tiny SD3 preset {preset!r}; expected one of {sorted(TINY_PRESETS)}")
    if max_sequence_length < 2:
        raise ValueError(f"max_sequence_length must be >= 2, got {max_sequence_length}")
    size = TINY_PRESETS[preset]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel(
            sample_size=8,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            joint_attention_dim=64,
            caption_projection_dim=size["num_attention_heads"] * size["attention_head_dim"],
            pooled_projection_dim=64,
            pos_embed_max_size=8,
            dual_attention_layers=(0,),
            qk_norm="rms_norm",
            **size,
        )
        pipeline = _around(transformer, 4, max_sequence_length, max_sequence_length, corpus)
    return pipeline if torch_dtype == torch.float32 else pipeline.to(dtype=torch_dtype)


def tiny_pipeline(
    transformer: SD3Transformer2DModel,
    *,
    vae_scale_factor: int = 8,
    clip_length: int = 77,
    t5_length: int = 256,
    seed: int = 0,
    corpus: Sequence[str] = DEFAULT_CORPUS,
) -> StableDiffusion3Pipeline:
    """An SD3 pipeline of ``transformer`` whose text encoders and VAE are tiny random stand-ins
    (float32, built as :func:`tiny_sd3`'s) with the output widths and geometry it reads.

    The T5 stand-in is ``joint_attention_dim`` wide, the CLIP stand-ins project to half of
    ``pooled_projection_dim`` each, and the VAE has ``in_channels`` latent channels and
    ``log2(vae_scale_factor) + 1`` levels: prompt embeddings are ``[B, clip_length + L, D]`` and
    images ``vae_scale_factor`` pixels per latent a side, as SD3.5's (``clip_length`` 77, a scale
    factor of 8), but the components compute next to nothing. For a pipeline of a transformer
    too large to save or download, e.g. SD3.5-M's built from its config with random weights.

    Args:
        transformer: an SD3 transformer (any dtype and size; it is not copied).
        vae_scale_factor: pixels per latent a side, a power of 2.
        clip_length: the CLIP tokenizers' length (CLIP pads to it).
        t5_length: the T5 tokenizer's longest input (:func:`encode_prompts` reads at most 256).
        seed: seed of the stand-ins' weights; the global RNG state is left as it was.
        corpus: the texts the tokenizers are learned from.

    Raises:
        ValueError: ``vae_scale_factor`` is not a power of 2, or ``pooled_projection_dim`` is odd.
    """
    if vae_scale_factor < 1 or vae_scale_factor & (vae_scale_factor - 1):
        raise ValueError(f"vae_scale_factor must be a power of 2, got {vae_scale_factor}")
    if transformer.config.pooled_projection_dim % 2:
        raise ValueError(
            f"the transformer's pooled_projection_dim {transformer.config.pooled_projection_dim} is odd: "
            "the two CLIP encoders' projections add up to it"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _around(transformer, vae_scale_factor, clip_length, t5_length, corpus)


def _around(
    transformer: SD3Transformer2DModel,
    vae_scale_factor: int,
    clip_length: int,
    t5_length: int,
    corpus: Sequence[str],
) -> StableDiffusion3Pipeline:
    """The pipeline of :func:`tiny_pipeline`, its stand-ins drawn from the global RNG."""
    config = transformer.config
    clip_width, t5_feed_forward = 32, 128
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * (vae_scale_factor.bit_length()),
        up_block_types=("UpDecoderBlock2D",) * (vae_scale_factor.bit_length()),
        block_out_channels=(16,) + (32,) * (vae_scale_factor.bit_length() - 1),
        layers_per_block=1,
        latent_channels=config.in_channels,
        norm_num_groups=8,
        sample_size=config.sample_size * vae_scale_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5305,
    )
    tokenizers = [clip_tokenizer(corpus, model_max_length=clip_length) for _ in range(2)]
    clip_encoders = [
        CLIPTextModelWithProjection(
            CLIPTextConfig(
                vocab_size=len(tokenizer),
                hidden_size=clip_width,
                intermediate_size=2 * clip_width,
                projection_dim=config.pooled_projection_dim // 2,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=clip_length,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
        for tokenizer in tokenizers
    ]
    tokenizer_3 = t5_tokenizer(corpus, model_max_length=t5_length)
    text_encoder_3 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_3),
            d_model=config.joint_attention_dim,
            d_kv=16,
            d_ff=t5_feed_forward,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu",
            pad_token_id=tokenizer_3.pad_token_id,
            eos_token_id=tokenizer_3.eos_token_id,
            decoder_start_token_id=tokenizer_3.pad_token_id,
        )
    )
    pipeline = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=clip_encoders[0],
        tokenizer=tokenizers[0],
        text_encoder_2=clip_encoders[1],
        tokenizer_2=tokenizers[1],
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )
    pipeline.set_progress_bar_config(disable=True)
    for module in pipeline.components.values():
        if isinstance(module, nn.Module):
            module.eval()  # as from_pretrained leaves them (T5 has dropout)
    return pipeline


def latent_size(resolution: int, transformer_config: Mapping[str, Any], vae_scale_factor: int) -> int:
    """The side ``h`` of the latents of square ``resolution``-px images: ``resolution /
    vae_scale_factor``, which the transformer reads as ``(h / patch_size)^2`` image tokens.

    The transformer's ``sample_size`` is only the pipeline's default; what bounds the side is its
    positional embedding, ``pos_embed_max_size * patch_size`` latents (none without one).

    Args:
        resolution: the image side in pixels.
        transformer_config: the SD3 transformer's config (``patch_size``, ``pos_embed_max_size``).
        vae_scale_factor: pixels per latent a side (the pipeline's ``vae_scale_factor``,
            ``2 ** (len(vae.config.block_out_channels) - 1)``).

    Raises:
        ValueError: ``resolution`` is not a positive multiple of ``vae_scale_factor * patch_size``,
            or needs more latents than the positional embedding covers; the message names the
            valid values.
    """
    patch, largest = transformer_config["patch_size"], transformer_config.get("pos_embed_max_size")
    step = vae_scale_factor * patch
    if resolution < step or resolution % step:
        below, above = max(step, resolution // step * step), (resolution // step + 1) * step
        near = f"{below} or {above}" if below < resolution else f"{above}"
        raise ValueError(
            f"{resolution} px is not a positive multiple of {step} (the VAE's scale factor "
            f"{vae_scale_factor} x the transformer's patch_size {patch}); e.g. {near} px"
        )
    side = resolution // vae_scale_factor
    if largest is not None and side > largest * patch:
        raise ValueError(
            f"{resolution} px images are {side} x {side} latents (the VAE's scale factor "
            f"{vae_scale_factor}), more than the transformer's positional embedding covers: "
            f"pos_embed_max_size {largest} x patch_size {patch} = {largest * patch} latents, "
            f"{largest * patch * vae_scale_factor} px at most"
        )
    return side


# Prompts ------------------------------------------------------------------------------------------


def encode_prompts(
    pipeline: StableDiffusion3Pipeline, prompts: Sequence[str], max_sequence_length: int | None = None
) -> tuple[Tensor, Tensor]:
    """Text embeddings of ``prompts`` for CFG-free sampling and training (no negative prompt).

    Each distinct prompt is encoded once (a batch of G images per prompt costs one encoding per
    prompt), without gradients.

    Args:
        pipeline: an SD3 pipeline (its three tokenizers and text encoders are used).
        prompts: B prompts, repeats allowed.
        max_sequence_length: T5 tokens per prompt; ``None`` takes ``min(256, model_max_length)`` of
            the T5 tokenizer (256 for SD3 and SD3.5, as diffusers; the tiny pipelines' own length).

    Returns:
        ``(prompt_embeds [B, S, D], pooled_prompt_embeds [B, Dp])`` with ``S = L_clip + L_t5``,
        ``D = transformer.config.joint_attention_dim``, ``Dp = pooled_projection_dim``.
    """
    if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
        raise TypeError(f"prompts must be a sequence of strings, got {prompts!r}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty")
    if max_sequence_length is None:
        t5 = pipeline.tokenizer_3
        max_sequence_length = 256 if t5 is None else min(256, t5.model_max_length)
    unique = list(dict.fromkeys(prompts))
    with torch.no_grad():
        embeds, _, pooled, _ = pipeline.encode_prompt(
            prompt=unique,
            prompt_2=None,
            prompt_3=None,
            do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length,
        )
    position = {prompt: i for i, prompt in enumerate(unique)}
    index = torch.tensor([position[p] for p in prompts], device=embeds.device)
    return embeds[index], pooled[index]


# LoRA ---------------------------------------------------------------------------------------------


def _lora_layers(transformer: nn.Module) -> list[LoraLayer]:
    layers = [module for module in transformer.modules() if isinstance(module, LoraLayer)]
    if not layers:
        raise ValueError("the transformer has no LoRA layers; call add_lora first")
    return layers


def _adapter_tensors(layer: LoraLayer, name: str) -> list[nn.Parameter]:
    """The parameters of adapter ``name`` in one LoRA layer (lora_A, lora_B, ... in a fixed order)."""
    tensors: list[nn.Parameter] = []
    for attribute in layer.adapter_layer_names:
        container = getattr(layer, attribute)
        if name in container:
            part = container[name]
            tensors.extend(part.parameters() if isinstance(part, nn.Module) else [part])
    return tensors


def lora_parameters(transformer: nn.Module, name: str = TRAINED) -> list[nn.Parameter]:
    """The LoRA parameters of adapter ``name`` only (what the optimizer trains), in module order.

    Raises:
        ValueError: the transformer has no adapter ``name``.
    """
    names = list(getattr(transformer, "peft_config", {}))
    if name not in names:
        raise ValueError(f"no LoRA adapter named {name!r}; the transformer has {names}")
    return [p for layer in _lora_layers(transformer) for p in _adapter_tensors(layer, name)]


def add_lora(
    transformer: SD3Transformer2DModel,
    rank: int = 32,
    alpha: float = 64.0,
    *,
    targets: Sequence[str] = LORA_TARGETS,
    old: bool = True,
) -> LoraConfig:
    """Add the trained LoRA adapter :data:`TRAINED` and, with ``old``, the sampling adapter :data:`OLD`.

    Each target linear layer ``W`` becomes ``W x + (alpha / rank) B A x`` with ``A`` Gaussian and
    ``B = 0``: the initial delta is zero. The old adapter starts equal to the trained one. Afterwards
    the base weights and the old adapter are frozen, the trained adapter has ``requires_grad`` and is
    the active one.

    Args:
        transformer: an SD3 transformer without adapters of these names.
        rank: LoRA rank r.
        alpha: LoRA alpha (scale ``alpha / r``).
        targets: module names to adapt (suffixes, as peft's ``target_modules``).
        old: also add the old adapter.

    Returns:
        The adapters' ``LoraConfig``.
    """
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    existing = sorted({TRAINED, OLD} & set(getattr(transformer, "peft_config", {})))
    if existing:
        raise ValueError(f"the transformer already has LoRA adapters {existing}")
    config = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=list(targets))
    transformer.requires_grad_(False)
    transformer.add_adapter(config, adapter_name=TRAINED)
    if old:
        with warnings.catch_warnings():  # peft warns that a second adapter is one too many: not here
            warnings.filterwarnings("ignore", message="Already found a `peft_config`", category=UserWarning)
            transformer.add_adapter(config, adapter_name=OLD)
        ema_update(transformer, 0.0)
    transformer.set_adapter(TRAINED)
    for p in lora_parameters(transformer, TRAINED):
        p.requires_grad_(True)
    if old:
        for p in lora_parameters(transformer, OLD):
            p.requires_grad_(False)
    return config


@torch.no_grad()
def ema_update(transformer: nn.Module, decay: float, *, target: str = OLD, source: str = TRAINED) -> None:
    """``theta_target <- decay * theta_target + (1 - decay) * theta_source`` over every LoRA tensor.

    ``decay = 0`` copies the source adapter; ``decay = 1`` leaves the target unchanged.

    Raises:
        ValueError: ``decay`` outside ``[0, 1]``, a missing adapter, or adapters of different rank or
            alpha (an average of those would mean nothing).
    """
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay must be in [0, 1], got {decay}")
    for name in (target, source):
        lora_parameters(transformer, name)
    configs = [transformer.peft_config[name] for name in (target, source)]
    if len({(config.r, config.lora_alpha) for config in configs}) > 1:
        raise ValueError(
            f"adapters {target!r} and {source!r} differ in (rank, alpha): "
            f"{[(config.r, config.lora_alpha) for config in configs]}"
        )
    for layer in _lora_layers(transformer):
        for old, new in zip(_adapter_tensors(layer, target), _adapter_tensors(layer, source), strict=True):
            old.lerp_(new.to(old.dtype), 1.0 - decay)


_LAYERS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[str, ...], list[LoraLayer]]] = (
    weakref.WeakKeyDictionary()
)


def _cached_lora_layers(transformer: nn.Module) -> list[LoraLayer]:
    """:func:`_lora_layers`, remembered per transformer until its set of adapters changes.

    Walking every module costs more than a tiny model's forward; a training loop switches adapters
    several times per step.
    """
    names = tuple(getattr(transformer, "peft_config", {}))
    cached = _LAYERS.get(transformer)
    if cached is None or cached[0] != names:
        cached = _LAYERS[transformer] = (names, _lora_layers(transformer))
    return cached[1]


@contextmanager
def _selected(transformer: SD3Transformer2DModel, name: str | None) -> Iterator[SD3Transformer2DModel]:
    """Select adapter ``name`` (``None``: disable all) in every LoRA layer; restore on exit.

    The layers' selection is switched directly (:func:`mogo_diffusion.peft_adapters.selected`):
    peft's ``set_adapter`` and ``enable_adapters`` walk the model and reset ``requires_grad``,
    while what trains is the caller's choice.
    """
    layers = _cached_lora_layers(transformer)
    if name is not None and name not in transformer.peft_config:
        loaded = list(transformer.peft_config)
        raise ValueError(f"no LoRA adapter named {name!r}; the transformer has {loaded}")
    with selected(layers, name):
        yield transformer


def adapter(transformer: SD3Transformer2DModel, name: str) -> AbstractContextManager[SD3Transformer2DModel]:
    """A context in which forwards of ``transformer`` use LoRA adapter ``name`` alone.

    Switching changes which adapter computes, never which parameters train: every ``requires_grad``
    is kept. The previous selection is restored on exit, so contexts nest.

    .. code-block:: python

        with torch.no_grad(), adapter(transformer, OLD):
            v_old = transformer(x_t, embeds, pooled, timestep, return_dict=False)[0]

    Raises:
        ValueError: no adapter ``name`` (naming the loaded adapters).
    """
    return _selected(transformer, name)


def reference(transformer: SD3Transformer2DModel) -> AbstractContextManager[SD3Transformer2DModel]:
    """A context in which forwards of ``transformer`` use the base model (all adapters disabled).

    Like :func:`adapter`, it keeps every ``requires_grad`` and restores the previous selection on exit.
    """
    return _selected(transformer, None)


@contextmanager
def merged(transformer: SD3Transformer2DModel, name: str) -> Iterator[SD3Transformer2DModel]:
    """A context in which forwards without gradients compute adapter ``name`` folded into the weights.

    Each adapted linear layer computes ``(W + s B A) x`` with one matrix product instead of
    ``W x + s B (A x)`` with three: the same function up to round-off (the sum is reassociated), at the
    cost of a forward without adapters. The merged weights are formed on entry, from the adapter's
    values then, and the original weight tensors are put back on exit, unchanged bit for bit.

    Raises:
        RuntimeError: gradients are enabled (the adapter's tensors would get none).
        ValueError: no adapter ``name``.
    """
    if torch.is_grad_enabled():
        raise RuntimeError("merged() is for forwards without gradients: enter it under torch.no_grad()")
    if name not in getattr(transformer, "peft_config", {}):
        loaded = list(getattr(transformer, "peft_config", {}))
        raise ValueError(f"no LoRA adapter named {name!r}; the transformer has {loaded}")
    layers = [layer for layer in _cached_lora_layers(transformer) if name in layer.lora_A]
    weights = [layer.get_base_layer().weight for layer in layers]
    originals = [weight.data for weight in weights]
    try:
        for layer, weight, original in zip(layers, weights, originals, strict=True):
            work = torch.promote_types(original.dtype, torch.float32)  # bf16 weights: merged in float32
            weight.data = (original.to(work) + layer.get_delta_weight(name).to(work)).to(original.dtype)
        with _selected(transformer, None):
            yield transformer
    finally:
        for weight, original in zip(weights, originals, strict=True):
            weight.data = original


@contextmanager
def fused(transformer: SD3Transformer2DModel, name: str) -> Iterator[SD3Transformer2DModel]:
    """A context in which forwards with gradients compute adapter ``name`` as one product per layer.

    Each adapted linear layer computes ``(W + s B A) x``, the merged weight formed differentiably
    at every call, instead of ``W x + s B (A x)``: the same function and the same gradients of
    ``A`` and ``B`` up to round-off, for the cost of a forward and backward without adapters plus
    the products ``B A`` (``r * in * out`` multiply-adds per layer, whatever the batch). Whichever
    adapter is selected, the layers compute ``name``. :func:`merged` is its counterpart for
    forwards without gradients. The layers' own forwards are put back on exit.

    Raises:
        ValueError: no adapter ``name``, or one with dropout (a merged weight cannot drop inputs).
    """
    if name not in getattr(transformer, "peft_config", {}):
        loaded = list(getattr(transformer, "peft_config", {}))
        raise ValueError(f"no LoRA adapter named {name!r}; the transformer has {loaded}")
    layers = [layer for layer in _cached_lora_layers(transformer) if name in layer.lora_A]
    if any(not isinstance(layer.lora_dropout[name], nn.Identity) for layer in layers):
        raise ValueError(f"adapter {name!r} has dropout: fused() computes no dropout")
    try:
        for layer in layers:
            layer.forward = _fused_forward(layer, name)
        yield transformer
    finally:
        for layer in layers:
            vars(layer).pop("forward", None)


def _fused_forward(layer: LoraLayer, name: str) -> Any:
    """The forward of ``layer`` with adapter ``name`` folded into its weight (see :func:`fused`)."""
    base = layer.get_base_layer()
    down, up, scale = layer.lora_A[name].weight, layer.lora_B[name].weight, layer.scaling[name]
    work = torch.promote_types(base.weight.dtype, torch.float32)  # bf16 weights: merged in float32

    def forward(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        weight = (base.weight.to(work) + scale * (up.to(work) @ down.to(work))).to(base.weight.dtype)
        return nn.functional.linear(x.to(weight.dtype), weight, base.bias)

    return forward


def save_lora(
    transformer: SD3Transformer2DModel, directory: str | os.PathLike[str], name: str = TRAINED
) -> Path:
    """Save LoRA adapter ``name`` in the diffusers format (``pytorch_lora_weights.safetensors``).

    The file holds the adapter's config as metadata (rank, alpha, targets), so
    ``StableDiffusion3Pipeline.load_lora_weights(directory)`` rebuilds it exactly.

    Returns:
        The directory.

    Raises:
        ValueError: no adapter ``name``.
        NotADirectoryError: ``directory`` is an existing file.
    """
    lora_parameters(transformer, name)
    directory = Path(directory)
    if directory.is_file():
        raise NotADirectoryError(f"cannot save LoRA weights into {str(directory)!r}: it is a file")
    StableDiffusion3Pipeline.save_lora_weights(
        directory,
        transformer_lora_layers=get_peft_model_state_dict(transformer, adapter_name=name),
        transformer_lora_adapter_metadata=transformer.peft_config[name].to_dict(),
    )
    return directory
