"""The shapes world: 32 px scenes of coloured shapes, an exact detector, and a pretrained tiny SD3.

* :mod:`~mogo_diffusion.shapes.scenes`: scenes, rendering, GenEval-style captions and metadata,
  train and held-out splits;
* :mod:`~mogo_diffusion.shapes.detect`: a rule-based detector of rendered or generated images, and
  GenEval-style checks of a detection against metadata;
* :mod:`~mogo_diffusion.shapes.pretrain`: ``python -m mogo_diffusion.shapes.pretrain --out DIR``
  trains the tiny pipeline (VAE, then the transformer) and a tiny CLIP on the world.

:func:`shapes_pipeline_path` is the pipeline shipped with the package (trained by that command),
which :func:`mogo_diffusion.models.load_pipeline` loads; :func:`shapes_clip_path` is its CLIP.
Importing this package imports neither diffusers nor transformers.
"""

from __future__ import annotations

from pathlib import Path

from mogo_diffusion.shapes.detect import PROTOTYPES, Checks, Detected, Detection, check, detect, detect_batch
from mogo_diffusion.shapes.scenes import (
    BACKGROUNDS,
    COLORS,
    HELDOUT_PAIRS,
    OBJECT_COLORS,
    RELATIONS,
    SHAPES,
    SIZE,
    TAGS,
    Object,
    Scene,
    all_prompts,
    relations,
    render,
    render_batch,
    sample_scenes,
)

__all__ = [
    "BACKGROUNDS",
    "COLORS",
    "HELDOUT_PAIRS",
    "OBJECT_COLORS",
    "PROTOTYPES",
    "RELATIONS",
    "SHAPES",
    "SIZE",
    "TAGS",
    "Checks",
    "Detected",
    "Detection",
    "Object",
    "Scene",
    "all_prompts",
    "check",
    "detect",
    "detect_batch",
    "relations",
    "render",
    "render_batch",
    "sample_scenes",
    "shapes_clip_path",
    "shapes_pipeline_path",
]

_SHIPPED = Path(__file__).resolve().parent / "pipeline"


def _shipped(path: Path, what: str) -> Path:
    if not (path / ("model_index.json" if what == "pipeline" else "config.json")).is_file():
        raise FileNotFoundError(
            f"the shapes {what} is not installed at {str(path)!r}; build it with "
            f"`python -m mogo_diffusion.shapes.pretrain --out {_SHIPPED}`"
        )
    return path


def shapes_pipeline_path() -> Path:
    """The directory of the shipped shapes pipeline (``mogo_diffusion/shapes/pipeline``).

    Raises:
        FileNotFoundError: it is missing (the message gives the command that builds it).
    """
    return _shipped(_SHIPPED, "pipeline")


def shapes_clip_path() -> Path:
    """The directory of the shipped tiny CLIP (``mogo_diffusion/shapes/pipeline/clip``), for
    ``CLIPModel.from_pretrained`` and ``CLIPProcessor.from_pretrained``.

    Raises:
        FileNotFoundError: it is missing.
    """
    return _shipped(_SHIPPED / "clip", "CLIP")
