"""The embedded default run: MARBLE on the shapes world, with the shipped pipeline and tiny CLIP.

:func:`shapes_config` is what ``python -m mogo_diffusion.train`` runs without ``--config``, and
(on all of :data:`REWARDS`) the base of every arm of ``python -m mogo_diffusion.compare``. The
world's rewards, frozen before any comparison was run:

.. code-block:: text

    reward            kind        applies to        pulls towards
    shapes_color      global      every prompt      the named background and object colours
    shapes_shape      global      every prompt      the named shapes, nothing more
    shapes_position   specialist  position prompts  the named relation (NaN elsewhere)
    shapes_count      specialist  counting prompts  the named number (NaN elsewhere)
    jpeg_compressibility  global  every prompt      flat images: against drawing objects at all
    clipscore         global      every prompt      the tiny CLIP's reading of the caption

The default run trains on :data:`DEFAULT_REWARDS`, all but compressibility, and leaves a sample
a specialist reward does not apply to out of that reward's loss (``nft.nonapplicable="exclude"``).
Both are what the study at this budget measured best for MARBLE (five seeds, ``docs/shapes.rst``):
against the weighted sum, -0.17 on the composite with these rewards and -0.78 with
compressibility; counting the non-applicable samples with a neutral advantage, as DiffusionNFT's
code masks, put it a further 0.38 below. The amortization (re-solved every 10 steps) is kept
because the study's MARBLE variants are level with each other within their intervals, and
amortized is the method.

The recipe is the one the search in the docs found to learn: a rank-32 LoRA on every linear
layer of the transformer (attention, MLPs, adaLN and the output), beta 1, AdamW at 3e-3, 120
epochs of 16 prompts x 8 images, each epoch one optimizer step of its 128 images on half of their
timesteps, with DiffusionNFT's KL anchor to the pretrained velocity at ``kl_coef`` 0.03. The
budget and the anchor are the smallest measured under which every single-reward specialist clears
the study's bar (``benchmarks/specialist_budget.py``): with fewer images the shape and count
specialists' gains drown in their seed spread, and without the anchor count's seeds find reward
hacks (many small blobs) that spread them further. Its
prompts are :data:`POOL`, a fixed pool of 32 training-split captions that every epoch samples
from again (:func:`pool`: 8 position, 8 counting and 4 of each other tag); it is evaluated on the
same captions, 8 images each, from noise no training epoch uses (``pool_eval.jsonl``). On
captions it never trained on, and on the held-out split's unseen colour-shape pairs, this scale
of RL was measured to learn nothing (the docs' search), so the pool is what the world's RL can
be judged on.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mogo_diffusion.config import Config
from mogo_diffusion.prompts import shapes_prompts
from mogo_diffusion.shapes import shapes_clip_path, shapes_pipeline_path
from mogo_diffusion.shapes.scenes import MAX_SEQUENCE_LENGTH

__all__ = [
    "DEFAULT_REWARDS",
    "EVAL_REPEATS",
    "FINAL_EVAL",
    "FINAL_REPEATS",
    "LORA_TARGETS",
    "POOL",
    "POOL_COUNTS",
    "REWARDS",
    "pool",
    "reward_specs",
    "shapes_config",
    "write_pool",
]

REWARDS: tuple[str, ...] = (
    "shapes_color",
    "shapes_shape",
    "shapes_position",
    "shapes_count",
    "jpeg_compressibility",
    "clipscore",
)
"""Every reward of the shapes world, in column order."""

DEFAULT_REWARDS: tuple[str, ...] = tuple(name for name in REWARDS if name != "jpeg_compressibility")
"""The rewards of :func:`shapes_config`: the study's prompt-following set, in column order."""

LORA_TARGETS: tuple[str, ...] = (
    "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "norm1.linear", "proj_out",
)  # fmt: skip
"""Every linear layer of the shapes transformer but the embedders (attention, MLPs, adaLN, output)."""

POOL_COUNTS: dict[str, int] = {
    "position": 8, "counting": 8, "colors": 4, "color_attr": 4, "two_object": 4, "single_object": 4,
}  # fmt: skip
"""Captions per GenEval tag in :data:`POOL`: enough for each specialist reward to apply each epoch."""

EVAL_REPEATS = 8
"""Images per caption of :data:`POOL` in the evaluation (each from its own noise)."""

FINAL_REPEATS = 32
"""Images per caption of :data:`POOL` in the study's final evaluation of each run (:data:`FINAL_EVAL`)."""

POOL = Path(__file__).resolve().parent / "pool.jsonl"
"""The training prompts, :func:`pool` as GenEval JSONL; ``pool_eval.jsonl`` beside it repeats each
line :data:`EVAL_REPEATS` times."""

FINAL_EVAL = POOL.with_name("pool_final.jsonl")
""":data:`POOL` with each line :data:`FINAL_REPEATS` times: the study judges a run's last weights on
these 1024 images, where the 256 of the evaluations during training leave a specialist reward
(64 images) a sampling error of about 0.05."""


def pool(seed: int = 0) -> list[dict[str, Any]]:
    """The metadata of :data:`POOL`: :data:`POOL_COUNTS` distinct training-split captions per tag,
    drawn with ``random.Random(seed)`` from every caption of the split, in tag order."""
    rng = random.Random(seed)
    captions = shapes_prompts("train").metadata
    chosen: list[dict[str, Any]] = []
    for tag, count in POOL_COUNTS.items():
        chosen += rng.sample([m for m in captions if m["tag"] == tag], count)
    return chosen


def write_pool(directory: Path = POOL.parent) -> None:
    """Write ``pool.jsonl``, ``pool_eval.jsonl`` and ``pool_final.jsonl`` of :func:`pool` into
    ``directory``."""
    lines = [json.dumps(m, sort_keys=True) for m in pool()]
    (directory / "pool.jsonl").write_text("\n".join(lines) + "\n")
    for name, repeats in (("pool_eval.jsonl", EVAL_REPEATS), (FINAL_EVAL.name, FINAL_REPEATS)):
        (directory / name).write_text("".join(line + "\n" for line in lines for _ in range(repeats)))


def reward_specs(names: Sequence[str] = DEFAULT_REWARDS) -> list[dict[str, Any]]:
    """The config records of the shapes rewards ``names``, weight 1 each (CLIPScore reads the
    shipped tiny CLIP)."""
    clip = {"model": str(shapes_clip_path())}
    return [{"name": name, "weight": 1.0, "options": clip if name == "clipscore" else {}} for name in names]


def shapes_config(**sections: dict[str, Any]) -> Config:
    """The shapes run's config; ``sections`` update it section by section, e.g.
    ``shapes_config(strategy={"name": "weighted_sum"}, train={"seed": 1})`` (a section with another
    ``name``, a strategy, replaces the section).

    Raises:
        FileNotFoundError: the shapes pipeline is not installed (the message says how to build it).
        ConfigError: an invalid update.
    """
    data: dict[str, Any] = {
        "model": {
            "pretrained": str(shapes_pipeline_path()),
            "dtype": "float32",
            "lora_rank": 32,
            "lora_alpha": 64.0,
            "lora_targets": list(LORA_TARGETS),
            "max_sequence_length": MAX_SEQUENCE_LENGTH,
        },
        "sampling": {
            "num_steps": 10,
            "eval_num_steps": 10,
            "solver": "euler",
            "resolution": 32,
            "group_size": 8,
            "prompts_per_epoch": 16,
            "prompts": str(POOL),
            "eval_prompts": str(POOL.with_name("pool_eval.jsonl")),
            "batch_size": 64,
        },
        "nft": {"beta": 1.0, "kl_coef": 0.03, "nonapplicable": "exclude"},
        "rewards": reward_specs(),
        "strategy": {"name": "marble", "harmonize_every": 10, "alpha_ema": 0.9},
        "train": {
            "lr": 3e-3,
            "grad_clip": 1.0,
            "epochs": 120,
            "batch_size": 128,
            "timestep_fraction": 0.5,
            "old_decay_rate": 0.01,
            "old_decay_max": 0.5,
            "eval_ema_decay": 0.7,
            "mixed_precision": "no",
            "seed": 0,
            "out_dir": "runs/shapes-marble",
            "eval_every": 20,
            "checkpoint_every": 20,
        },
    }
    for section, values in sections.items():
        if section not in data:
            raise ValueError(f"unknown config section {section!r}; sections: {', '.join(data)}")
        base = data[section]
        replaced = isinstance(values, list) or values.get("name", base.get("name")) != base.get("name")
        data[section] = values if replaced else {**base, **values}  # a new strategy: its own fields
    return Config.from_dict(data)
