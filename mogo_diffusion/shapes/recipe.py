"""The embedded default run: MARBLE on the shapes world, with the shipped pipeline and tiny CLIP.

:func:`shapes_config` is what ``python -m mogo_diffusion.train`` runs without ``--config``, and
the base of every arm of ``python -m mogo_diffusion.compare``. Its rewards, frozen before any
comparison was run:

.. code-block:: text

    reward            kind        applies to        pulls towards
    shapes_color      global      every prompt      the named background and object colours
    shapes_shape      global      every prompt      the named shapes, nothing more
    shapes_position   specialist  position prompts  the named relation (NaN elsewhere)
    shapes_count      specialist  counting prompts  the named number (NaN elsewhere)
    jpeg_compressibility  global  every prompt      flat images: against drawing objects at all
    clipscore         global      every prompt      the tiny CLIP's reading of the caption

Training prompts are 1024 sampled training-split captions (``shapes:train:1024``); evaluation uses
128 captions of the held-out split (``shapes:heldout:128``), colour-shape pairs never trained on.
"""

from __future__ import annotations

from typing import Any

from mogo_diffusion.config import Config
from mogo_diffusion.shapes import shapes_clip_path, shapes_pipeline_path

__all__ = ["REWARDS", "shapes_config"]

REWARDS: tuple[str, ...] = (
    "shapes_color",
    "shapes_shape",
    "shapes_position",
    "shapes_count",
    "jpeg_compressibility",
    "clipscore",
)
"""The rewards of :func:`shapes_config`, in column order."""


def shapes_config(**sections: dict[str, Any]) -> Config:
    """The shapes run's config; ``sections`` update it section by section, e.g.
    ``shapes_config(strategy={"name": "weighted_sum"}, train={"seed": 1})`` (a section with another
    ``name``, a strategy, replaces the section).

    Raises:
        FileNotFoundError: the shapes pipeline is not installed (the message says how to build it).
        ConfigError: an invalid update.
    """
    clip = str(shapes_clip_path())
    data: dict[str, Any] = {
        "model": {
            "pretrained": str(shapes_pipeline_path()),
            "dtype": "float32",
            "lora_rank": 8,
            "lora_alpha": 16.0,
            "max_sequence_length": 32,
        },
        "sampling": {
            "num_steps": 10,
            "eval_num_steps": 10,
            "solver": "euler",
            "resolution": 32,
            "group_size": 8,
            "prompts_per_epoch": 8,
            "prompts": "shapes:train:1024",
            "eval_prompts": "shapes:heldout:128",
            "batch_size": 64,
        },
        "nft": {"beta": 0.1, "kl_coef": 0.0},
        "rewards": [
            {"name": name, "weight": 1.0, "options": {"model": clip} if name == "clipscore" else {}}
            for name in REWARDS
        ],
        "strategy": {"name": "marble", "harmonize_every": 10, "alpha_ema": 0.9},
        "train": {
            "lr": 3e-3,
            "grad_clip": 1.0,
            "epochs": 60,
            "batch_size": 16,
            "timestep_fraction": 0.3,
            "old_decay_rate": 0.01,
            "old_decay_max": 0.5,
            "eval_ema_decay": 0.7,
            "mixed_precision": "no",
            "seed": 0,
            "out_dir": "runs/shapes-marble",
            "eval_every": 10,
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
