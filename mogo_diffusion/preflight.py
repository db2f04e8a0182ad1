"""``python -m mogo_diffusion.train --config X --check``: what a run needs, checked offline.

:func:`preflight` validates the config (:func:`mogo_diffusion.checks.check_config`), looks up every
model it names without downloading anything (local directories and files, the ``huggingface_hub``
cache), builds the transformer from its config on the ``meta`` device (no memory) to count its
parameters and the LoRA adapter's, and estimates the memory of one process. Every problem is one line
naming the field, the file or hub id, and the command that fetches it.

The memory estimate of one process (each GPU holds a whole replica; on a CPU the same terms
hold), in bytes, with ``P`` the frozen parameters and buffers of the pipeline (transformer, text
encoders, VAE), ``L`` the trained LoRA parameters, ``K`` the rewards and ``d`` the bytes of the
model dtype::

    weights         d * P
    LoRA            (5 * 4 + d) * L   trained, its gradient, AdamW's two moments, eval EMA (float32);
                                      the old adapter in the model dtype
    K buffers       4 * L * (K + 1)   MARBLE's per-reward gradients and the KL term's (without KL,
                                      K; harmonizing strategies only)
    merged adapter  d * M             W + s B A of the M weights of the adapted layers: formed at
                                      once for sampling and the old policy's forward
                                      (:func:`~mogo_diffusion.models.merged`), kept one by one for
                                      the trained forward's backward (:func:`~mogo_diffusion.models.fused`)
    activations     b * D * a * (c * n * S + c2 * n2 * I)

where the activations are those autograd keeps for one training forward: ``n`` blocks of width
``D``, ``n2`` of them with dual attention, ``b = train.batch_size`` samples of ``S`` tokens: ``I``
image tokens (:func:`image_tokens`, from ``sampling.resolution``: what the trainer samples) plus
``77 + max_sequence_length`` text tokens; ``a`` bytes per value (2 under autocast, else ``d``).
``c = 18`` values per token and block are counted from a joint block's saved tensors (q, k, v and
the attention output, 4; q and k before their RMS norm, kept in float32, 4; the projections'
inputs, 2; the norms' outputs, 2; the MLP's hidden before and after GELU, 4 + 4) and ``c2 = 11``
per image token for a dual block's second attention (its q, k, v and output, 4; q and k before
the norm in float32, 4; its input, norm and gate, 3). Measured with ``saved_tensors_hooks`` on
SD3.5-M at 512 px (torch 2.13, bfloat16 autocast, the CPU): a joint block keeps 18.1 values per
token beside its 8 merged weights, and the whole forward 2.09 GB of activations (the formula:
2.08 GB) plus 1.10 GB of merged weights. Attention matrices are not kept, on a GPU nor on a CPU:
scaled-dot-product attention saves q, k, v, the output and the log-sum-exp (torch's flash kernel
for the CPU too), so the estimate is the same for both. ``benchmarks/real_size.py`` measures it
against a real-size run on a CPU (docs/benchmarks.rst, "SD3.5-M's size on a CPU"): weights, LoRA
and buffers within 7 %, the amortized step's merged adapter and activations 3.32 GB against 3.23
when glibc returns freed blocks to the system (``MALLOC_MMAP_THRESHOLD_=1048576``); with its
defaults the step's resident memory rises 4.46 GB, freed blocks below 32 MB staying in its heap.

Not counted: the reward models, and the batched backward that ``strategy.grad_mode: auto`` tries
first for MARBLE's K + 1 gradients: it keeps K + 1 rows of the backward's intermediates, which took
a real-size CPU run past 16 GB where ``sequential`` peaked at 12 GB. The report names both.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mogo_diffusion.config import Config, ConfigError, MarbleConfig
from mogo_diffusion.hub import CONFIG_FILES, HUB_ID, download_command

__all__ = [
    "ACTIVATION_VALUES",
    "DUAL_ATTENTION_VALUES",
    "SD35M",
    "SD35M_TRANSFORMER",
    "MemoryEstimate",
    "Report",
    "estimate_memory",
    "image_tokens",
    "preflight",
    "run",
]

SD35M = "stabilityai/stable-diffusion-3.5-medium"
"""The hub id of Stable Diffusion 3.5 Medium."""

SD35M_TRANSFORMER: dict[str, Any] = {
    "_class_name": "SD3Transformer2DModel",
    "attention_head_dim": 64,
    "caption_projection_dim": 1536,
    "dual_attention_layers": list(range(13)),
    "in_channels": 16,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 24,
    "out_channels": 16,
    "patch_size": 2,
    "pooled_projection_dim": 2048,
    "pos_embed_max_size": 384,
    "qk_norm": "rms_norm",
    "sample_size": 128,
}
"""``transformer/config.json`` of :data:`SD35M`, so that its parameters can be counted offline."""

_SD35M_OTHERS = {
    "text_encoder": 124_000_000,
    "text_encoder_2": 695_000_000,
    "text_encoder_3": 4_760_000_000,
    "vae": 84_000_000,
}
# The published sizes (rounded) of SD3.5-M's CLIP-L and OpenCLIP bigG text encoders, T5-XXL
# encoder and VAE: used only when their configs are not available offline.

ACTIVATION_VALUES = 18
"""``c``: values autograd keeps per token and transformer block in a training forward (counted
and measured, see the module)."""

DUAL_ATTENTION_VALUES = 11
"""``c2``: values autograd keeps per image token for a dual-attention block's second attention
(see the module)."""

_DATASET_HINT = (  # where the shipped configs' prompt files come from
    " (DiffusionNFT's prompt sets: git clone https://github.com/NVlabs/DiffusionNFT"
    " && ln -s DiffusionNFT/dataset .)"
)
_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_TEXT_TOKENS_CLIP = 77
_MODEL_COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")

# For each reward, the options that name weights, and what they name: a model directory
# ("model"), a tokenizer and image processor's small files ("processor"), the HPS checkpoint
# ("hps") or a file ("file"). The defaults are the factories' own.
_REWARD_FILES: dict[str, dict[str, str]] = {
    "pickscore": {"model": "model", "processor": "processor"},
    "clipscore": {"model": "model"},
    "hpsv21": {"model": "hps", "base": "processor"},
    "aesthetic": {"predictor": "file", "model": "model"},
    "geneval": {"detector": "model"},
    "imagereward": {"model": "imagereward", "tokenizer": "tokenizer"},
}
_EXTRA_OF_REWARD = {"ocr": "ocr"}
_SUGGESTED = {("geneval", "detector"): "facebook/detr-resnet-50"}  # an option without a default


@dataclass(frozen=True)
class MemoryEstimate:
    """The estimate of one process's peak memory, in bytes, term by term (see the module), and
    how each term is counted (``counted``, by term name)."""

    weights: int
    lora: int
    buffers: int
    merged: int
    activations: int
    counted: dict[str, str] = field(default_factory=dict, compare=False)

    TERMS = ("weights", "lora", "buffers", "merged", "activations")

    @property
    def total(self) -> int:
        return sum(getattr(self, term) for term in self.TERMS)


@dataclass
class Report:
    """What :func:`preflight` found.

    Attributes:
        lines: what was checked and counted, to print. problems: one line each, naming the field
            and, for missing weights, the command that fetches them.
        transformer_parameters, lora_parameters: the counts (None when not computed).
        image_tokens: the image tokens of one sample at ``sampling.resolution`` (the trainer's).
        memory: the estimate of one process's peak memory (see the module).
    """

    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    transformer_parameters: int | None = None
    lora_parameters: int | None = None
    image_tokens: int | None = None
    memory: MemoryEstimate | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def _is_local(reference: str) -> bool:
    return os.path.exists(os.path.expanduser(reference)) or not HUB_ID.fullmatch(reference)


def _cached(repo: str, filename: str, revision: str | None = None) -> Path | None:
    """The file ``filename`` of hub repository ``repo`` in the local cache, or None."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, filename, revision=revision)
    return Path(found) if isinstance(found, str) else None


def _has_weights(folder: Path, variant: str | None = None) -> bool:
    """``folder`` holds safetensors (or torch ``.bin``) weights, every shard of an index present."""
    suffix = f".{variant}" if variant else ""
    for index in folder.glob(f"*{suffix}.safetensors.index.json"):
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        return all((folder / shard).is_file() for shard in shards)
    return any(folder.glob(f"*{suffix}.safetensors")) or any(folder.glob(f"*{suffix}.bin"))


def _check_pipeline(config: Config, report: Report) -> Path | None:
    """The pipeline's folder (local or the cached snapshot) if every component is there, else
    None; a problem per missing piece."""
    model = config.model
    ref, variant = model.pretrained, model.variant
    if _is_local(ref):
        folder = Path(ref).expanduser()
        fetch = f"for SD3.5-M: {download_command(SD35M, local_dir=ref)}"
        if not (folder / "model_index.json").is_file():
            where = str(folder / "model_index.json")
            report.problems.append(f"model.pretrained: {where!r} not found: not a saved pipeline ({fetch})")
            return None
    else:
        index = _cached(ref, "model_index.json", model.revision)
        fetch = download_command(ref, revision=model.revision)
        if index is None:
            report.problems.append(f"model.pretrained: {ref!r} is not in the hub cache: {fetch}")
            return None
        folder = index.parent
    components = json.loads((folder / "model_index.json").read_text())
    missing = []
    for name in _MODEL_COMPONENTS:
        if components.get(name, [None, None])[0] is None:
            continue
        part = folder / name
        if not (part / "config.json").is_file() or not _has_weights(part, variant):
            missing.append(name)
    if missing:
        report.problems.append(
            f"model.pretrained: {ref!r} lacks the weights of {', '.join(missing)} "
            f"(in {str(folder)!r}): {fetch.removeprefix('for SD3.5-M: ')}"
        )
        return None
    return folder


def _check_reference(where: str, kind: str, ref: str, default: Any, suggested: str | None) -> str | None:
    """A problem line if the weights ``ref`` (an option of kind ``kind``) are not available; the
    command fetches ``default`` (a hub id) or, as an example, ``suggested``."""
    from mogo_diffusion.rewards.hps import HPS_FILE
    from mogo_diffusion.rewards.imagereward import IMAGEREWARD_FILE

    checkpoints = {"hps": HPS_FILE, "imagereward": IMAGEREWARD_FILE}  # one file of a hub repository
    source = default if isinstance(default, str) and HUB_ID.fullmatch(default) else None
    files = (checkpoints[kind],) if kind in checkpoints else ()
    include = CONFIG_FILES if kind in ("processor", "tokenizer") else ()
    if _is_local(ref):
        path = Path(ref).expanduser()
        converted = kind == "imagereward" and (path / "config.json").is_file() and _has_weights(path)
        if (
            kind in checkpoints
            and not converted
            and (path.is_dir() or path.suffix not in (".pt", ".safetensors"))
        ):
            path = path / checkpoints[kind]  # a directory (to be) holding the checkpoint
        if kind == "model" or converted:
            present = (path / "config.json").is_file() and _has_weights(path)
        elif kind == "processor":
            present = path.is_dir() and any(path.glob("*.json"))
        elif kind == "tokenizer":
            present = (path / "tokenizer_config.json").is_file()
        else:
            present = path.is_file()
        if present:
            return None
        local = str(path.parent if kind in checkpoints else path)
        how = f": {download_command(source, *files, include=include, local_dir=local)}" if source else ""
        if suggested and not how:
            example = download_command(suggested, *files, include=include, local_dir=local)
            how = f": a transformers model, e.g. {example}"
        if kind == "file" and not how:
            how = f" (see docs/rewards.rst for where {path.name} is published)"
        return f"{where}: {str(path)!r} not found{how}"
    probes = {
        "model": "config.json",
        "processor": "preprocessor_config.json",
        "tokenizer": "tokenizer_config.json",
    }
    probe = {**probes, **checkpoints}.get(kind)
    if probe is None:
        return f"{where}: {ref!r} must be a local file"
    cached = _cached(ref, probe)
    if cached is not None and (kind != "model" or _has_weights(cached.parent)):
        return None
    return f"{where}: {ref!r} is not in the hub cache: {download_command(ref, *files, include=include)}"


def _check_rewards(config: Config, report: Report) -> None:
    from mogo._extras import MissingExtraError, require
    from mogo_diffusion.rewards import reward_factory

    for i, spec in enumerate(config.rewards):
        if spec.name in _EXTRA_OF_REWARD:
            try:
                require(f"rewards.{i}: the {spec.name!r} reward", _EXTRA_OF_REWARD[spec.name])
            except MissingExtraError as error:
                report.problems.append(str(error))
        parameters = inspect.signature(reward_factory(spec.name)).parameters
        for option, kind in _REWARD_FILES.get(spec.name, {}).items():
            default = parameters[option].default
            ref = spec.options.get(option, default)
            if ref is inspect.Parameter.empty:
                continue  # a required option: check_config has said so
            if isinstance(ref, str | os.PathLike):
                where, suggested = f"rewards.{i}.options.{option}", _SUGGESTED.get((spec.name, option))
                problem = _check_reference(where, kind, os.fspath(ref), default, suggested)
                if problem:
                    report.problems.append(problem)


def _is_file_source(source: str) -> bool:
    kind, sep, _ = source.partition(":")
    return not (sep and kind in ("shapes", "ocr", "geneval"))


def _check_prompts(config: Config, report: Report) -> None:
    """Every prompt source: a missing file is named (with where DiffusionNFT's come from); the
    others are read, as the trainer will read them, and their errors reported."""
    from mogo_diffusion.prompts import load_prompt_pool

    for name in ("prompts", "eval_prompts"):
        value = getattr(config.sampling, name)
        entries = [(f"sampling.{name}", value)] if isinstance(value, str) else []
        if isinstance(value, list):
            entries = [(f"sampling.{name}.{i}.source", entry.source) for i, entry in enumerate(value)]
        missing = False
        for where, source in entries:
            if _is_file_source(source) and not Path(source).expanduser().is_file():
                hint = _DATASET_HINT if Path(source).parts[:1] == ("dataset",) else ""
                report.problems.append(f"{where}: prompt file {source!r} not found{hint}")
                missing = True
        if value is None or missing:
            continue
        try:
            pool = load_prompt_pool(value)
        except (OSError, ValueError) as error:
            report.problems.append(f"sampling.{name}: {error}")
            continue
        if isinstance(value, list):
            shares = "; ".join(
                f"{entry.source}: {len(prompts.prompts):,} {reward} prompts, weight {entry.weight:g}"
                for entry, prompts, reward in zip(value, pool.sets, pool.rewards, strict=True)
            )
            report.lines.append(f"sampling.{name}: a pool of {len(value)} sources: {shares}")


def _read_config(folder: Path | None, component: str) -> dict[str, Any] | None:
    path = None if folder is None else folder / component / "config.json"
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def _meta_transformer(transformer_config: dict[str, Any]) -> torch.nn.Module:
    from diffusers import SD3Transformer2DModel

    with torch.device("meta"):
        return SD3Transformer2DModel.from_config(transformer_config)


def _count_component(folder: Path, component: str) -> int | None:
    """The parameters of a pipeline component, built from its config on the meta device."""
    import diffusers
    import transformers

    library, class_name = json.loads((folder / "model_index.json").read_text())[component]
    module = {"diffusers": diffusers, "transformers": transformers}.get(library)
    cls = getattr(module, class_name, None) if module else None
    if cls is None:
        return None
    path = folder / component
    with torch.device("meta"):
        if module is diffusers:
            model = cls.from_config(cls.load_config(path))
        else:
            model = cls._from_config(transformers.AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters())


def _gb(n: float) -> str:
    """Bytes in GB, MB or kB (decimal), three significant digits or more."""
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _vae_scale_factor(folder: Path | None) -> int:
    """Pixels per latent a side, as the pipeline computes it from its VAE's config (8, SD3's, when
    the config is not available offline)."""
    vae = _read_config(folder, "vae")
    return 2 ** (len(vae["block_out_channels"]) - 1) if vae else 8


def image_tokens(config: Config, transformer_config: Any, vae_scale_factor: int) -> int:
    """The image tokens of one sample: ``(h / patch_size)^2`` for the latents of side ``h`` that the
    trainer samples (:func:`mogo_diffusion.models.latent_size` of ``sampling.resolution``).

    Raises:
        ValueError: the resolution does not fit the model (see ``latent_size``).
    """
    from mogo_diffusion import models

    side = models.latent_size(config.sampling.resolution, transformer_config, vae_scale_factor)
    return (side // transformer_config["patch_size"]) ** 2


def estimate_memory(
    config: Config, transformer: torch.nn.Module, frozen_values: int, vae_scale_factor: int
) -> MemoryEstimate:
    """The peak memory of one process training ``config`` (see the module for each term).

    Args:
        config: the run (its resolution valid for this model: :func:`image_tokens`).
        transformer: its SD3 transformer with the trained LoRA adapter, on any device (``meta``
            allocates nothing).
        frozen_values: the frozen parameters and buffers of the whole pipeline.
        vae_scale_factor: the pipeline's pixels per latent a side.
    """
    from peft.tuners.lora import LoraLayer

    from mogo_diffusion import models

    t, dtype, batch = transformer.config, config.model.dtype, config.train.batch_size
    d = _BYTES[dtype]
    a = d if config.train.mixed_precision == "no" else 2  # autocast computes in 16 bits
    L = sum(p.numel() for p in models.lora_parameters(transformer))
    K = len(config.rewards)
    kl = config.nft.kl_coef > 0  # the KL term is one more row of the buffers
    harmonized = isinstance(config.strategy, MarbleConfig)  # HarmonizedConfig is one too
    adapted = sum(m.in_features * m.out_features for m in transformer.modules() if isinstance(m, LoraLayer))
    image = image_tokens(config, t, vae_scale_factor)
    tokens = image + _TEXT_TOKENS_CLIP + config.model.max_sequence_length
    width, blocks = t.num_attention_heads * t.attention_head_dim, t.num_layers
    dual = len(t.dual_attention_layers)
    values = ACTIVATION_VALUES * blocks * tokens + DUAL_ATTENTION_VALUES * dual * image
    return MemoryEstimate(
        weights=d * frozen_values,
        lora=(5 * 4 + d) * L,
        buffers=4 * L * (K + kl) if harmonized else 0,
        merged=d * adapted,
        activations=batch * width * a * values,
        counted={
            "weights": f"{dtype}, {frozen_values:,} values",
            "lora": f"(5 x 4 B + {d} B) x {L:,}: trained, gradient, 2 moments, eval EMA; old in {dtype}",
            "buffers": f"(K {K}{' + 1 KL' if kl else ''}) x {L:,} x 4 B"
            if harmonized
            else f"none (strategy {config.strategy.name!r} does not harmonize)",
            "merged": f"{dtype} W + s B A of each adapted layer, {adapted:,} values",
            "activations": f"batch {batch} x width {width} x {a} B x ({ACTIVATION_VALUES} x {blocks} "
            f"blocks x {tokens} tokens + {DUAL_ATTENTION_VALUES} x {dual} dual blocks x {image} image "
            "tokens)",
        },
    )


_LABELS = {
    "weights": "weights",
    "lora": "LoRA and AdamW",
    "buffers": "gradient buffers",
    "merged": "merged adapter",
    "activations": "activations",
}


def _sizes(config: Config, folder: Path | None, report: Report) -> None:
    from mogo_diffusion import models
    from mogo_diffusion.checks import check_model

    transformer_config = _read_config(folder, "transformer")
    origin = f"{str(folder)!r}" if transformer_config else None
    if transformer_config is None and config.model.pretrained == SD35M:
        transformer_config, origin = SD35M_TRANSFORMER, "mogo_diffusion.preflight.SD35M_TRANSFORMER"
    if transformer_config is None:  # the pipeline's problem is reported: here only what it costs
        report.lines.append(
            f"sizes: not computed (no transformer config of {config.model.pretrained!r} offline)"
        )
        return
    transformer = _meta_transformer(transformer_config)
    scale = _vae_scale_factor(folder)
    try:
        check_model(config, transformer, scale)  # as the trainer does once it has loaded the model
    except ConfigError as error:
        report.problems.append(str(error))
        return
    P = sum(p.numel() for p in transformer.parameters())
    B = sum(b.numel() for b in transformer.buffers())  # the positional embedding table
    with torch.device("meta"):  # the adapter's tensors too: nothing is allocated
        m = config.model
        models.add_lora(transformer, m.lora_rank, m.lora_alpha, targets=m.lora_targets, old=False)
    L = sum(p.numel() for p in models.lora_parameters(transformer))
    others, estimated = 0, []  # the other components' parameters
    index = json.loads((folder / "model_index.json").read_text()) if folder is not None else {}
    for component in _MODEL_COMPONENTS[1:]:
        if folder is not None and index.get(component, [None])[0]:
            others += _count_component(folder, component) or 0
        elif folder is None and config.model.pretrained == SD35M:
            others += _SD35M_OTHERS[component]
            estimated.append(component)
    memory = estimate_memory(config, transformer, P + B + others, scale)
    report.transformer_parameters, report.lora_parameters, report.memory = P, L, memory
    report.image_tokens = image_tokens(config, transformer.config, scale)
    note = f"; {', '.join(estimated)}: published sizes" if estimated else ""
    report.lines += [
        f"transformer ({origin}): {P:,} parameters and {B:,} buffer values, {P + B:,} in all",
        f"LoRA r {m.lora_rank} on {', '.join(m.lora_targets)}: {L:,} trained parameters "
        f"({100 * L / P:.2f} %)",
        f"image tokens per sample: {report.image_tokens:,} (sampling.resolution "
        f"{config.sampling.resolution} px)",
        f"gradient buffers: {memory.counted['buffers']}"
        + (f" = {_gb(memory.buffers)}" if memory.buffers else ""),
        f"peak memory per process (estimate): {_gb(memory.total)}",
        *(
            f"  {_LABELS[term]:<16} {_gb(getattr(memory, term)):>9}  {memory.counted[term]}"
            + (note if term == "weights" else "")
            for term in MemoryEstimate.TERMS
        ),
        f"  not counted: {'; '.join(_uncounted(config))}",
    ]


def _uncounted(config: Config) -> list[str]:
    """What the estimate leaves out, for this config."""
    uncounted = ["the reward models"]
    grad_mode = getattr(config.strategy, "grad_mode", "sequential")
    if grad_mode != "sequential":
        uncounted.append(
            f"the batched backward of strategy.grad_mode {grad_mode!r} (it keeps K + 1 rows of the "
            "backward's intermediates; 'sequential' one)"
        )
    return uncounted


def preflight(config: Config) -> Report:
    """Check ``config`` offline (see the module): the config, the pipeline's and the rewards'
    weights and the prompt files, then the sizes. Nothing is downloaded or allocated.

    Returns:
        A :class:`Report`; ``report.problems`` is empty when the run can start.
    """
    from mogo_diffusion.checks import check_config

    report = Report()
    try:
        check_config(config)
    except ConfigError as error:
        report.problems.append(str(error))
        return report
    names = ", ".join(spec.name for spec in config.rewards)
    report.lines.append(
        f"config: valid (strategy {config.strategy.name!r}, {len(config.rewards)} rewards: {names})"
    )
    folder = _check_pipeline(config, report)
    _check_rewards(config, report)
    _check_prompts(config, report)
    _sizes(config, folder, report)
    return report


def run(config: Config, echo: Callable[[str], Any] = print) -> int:
    """:func:`preflight`, printed: the report's lines, then one line per problem; the exit status
    (0 when there is none, 1 otherwise)."""
    report = preflight(config)
    for line in report.lines:
        echo(line)
    for problem in report.problems:
        echo(f"problem: {problem}")
    echo("ready" if report.ok else f"{len(report.problems)} problem(s)")
    return 0 if report.ok else 1
