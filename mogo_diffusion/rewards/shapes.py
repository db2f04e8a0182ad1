"""Rewards of the shapes world, read off :func:`~mogo_diffusion.shapes.detect` and the scene metadata.

Two kinds, as in multi-reward fine-tuning of real models:

* global rewards score every sample: ``shapes_color`` (the named colours are there) and
  ``shapes_shape`` (the named shapes are there, nothing else);
* specialist rewards score only the prompts that ask for their aspect and are NaN elsewhere:
  ``shapes_position`` (position prompts) and ``shapes_count`` (counting prompts).

Every score is in ``[0, 1]``; an exact render of the prompt's scene scores 1, but for
``shapes_position``, which is above 3/4 exactly when GenEval's relation holds. Each needs the scene's
GenEval metadata (``"include"``, and ``"background"`` for the colour); a sample without metadata
raises, since a shapes reward without it would silently score nothing.

.. code-block:: text

    shapes_color     mean over [background] + one term per coloured clause c:
                         [detected background == named]   and   min(n_colour(c), count_c) / count_c
    shapes_shape     matched / max(named, detected): matched = sum_c min(n_class(c), count_c),
                         named = sum_c count_c, detected = all detected objects
    shapes_position  (1 + u . d) / 2 for the target's GenEval direction d = (dx, dy) from its
                         reference and the relation's unit vector u; 0 if either is missing
    shapes_count     max(0, 1 - |n_class - count| / count)
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from mogo_diffusion.rewards.base import check_batch
from mogo_diffusion.rewards.registry import register_reward
from mogo_diffusion.shapes.detect import Detection, detect_batch
from mogo_diffusion.shapes.scenes import relative_direction

__all__ = ["SHAPES_REWARDS", "ShapesReward", "color_score", "count_score", "position_score", "shape_score"]

_UNIT = {"left of": (-1.0, 0.0), "right of": (1.0, 0.0), "above": (0.0, -1.0), "below": (0.0, 1.0)}

Score = Callable[[Detection, Mapping[str, Any]], float]


def color_score(found: Detection, metadata: Mapping[str, Any]) -> float:
    """``shapes_color`` of one detection (see the module)."""
    terms = [float(found.background == metadata["background"])]
    for clause in metadata["include"]:
        if "color" in clause:
            terms.append(min(found.count(color=clause["color"]), clause["count"]) / clause["count"])
    return sum(terms) / len(terms)


def shape_score(found: Detection, metadata: Mapping[str, Any]) -> float:
    """``shapes_shape`` of one detection (see the module)."""
    include = metadata["include"]
    matched = sum(min(found.count(clause["class"]), clause["count"]) for clause in include)
    named = sum(clause["count"] for clause in include)
    return matched / max(named, len(found.objects))


def position_score(found: Detection, metadata: Mapping[str, Any]) -> float:
    """``shapes_position`` of one detection; NaN when no clause has a ``"position"``."""
    include = metadata["include"]
    target = next((clause for clause in include if "position" in clause), None)
    if target is None:
        return math.nan
    relation, reference = target["position"]
    targets, references = found.find(target["class"]), found.find(include[reference]["class"])
    if not targets or not references:
        return 0.0
    direction = relative_direction(targets[0].box, references[0].box)
    if direction is None:
        return 0.5
    ux, uy = _UNIT[relation]
    return (1 + ux * direction[0] + uy * direction[1]) / 2


def count_score(found: Detection, metadata: Mapping[str, Any]) -> float:
    """``shapes_count`` of one detection; NaN unless the prompt's tag is ``"counting"``."""
    if metadata.get("tag") != "counting":
        return math.nan
    (clause,) = metadata["include"]
    return max(0.0, 1 - abs(found.count(clause["class"]) - clause["count"]) / clause["count"])


class _LastDetections:
    """The detections of the last batch, kept while that tensor is alive and unmodified: the four
    shapes rewards (and the collapse guard) of one batch read it once, not once each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # rewards may score on threads (MultiReward's ``threads``)
        self._key: tuple[weakref.ref, int] | None = None
        self._found: list[Detection] = []

    def __call__(self, images: Tensor) -> list[Detection]:
        with self._lock:
            if self._key is None or self._key[0]() is not images or self._key[1] != images._version:
                self._found = detect_batch(images)
                self._key = (weakref.ref(images), images._version)
            return self._found


_detections = _LastDetections()


class ShapesReward:
    """One shapes-world reward: :func:`~mogo_diffusion.shapes.detect` each image, then
    ``score(detection, metadata) -> float`` it against the sample's metadata; ``[B]`` float32
    scores (NaN where the reward does not apply).
    """

    def __init__(self, name: str, score: Callable[..., float]) -> None:
        self.name = name
        self.score = score

    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> Tensor:
        check_batch(images, prompts, metadata)
        for i, entry in enumerate(metadata):
            if "include" not in entry or "background" not in entry:
                raise ValueError(
                    f"{self.name}: sample {i} ({prompts[i]!r}) has no shapes metadata "
                    f"('include' and 'background'); use the prompts of mogo_diffusion.prompts.shapes_prompts"
                )
        found = _detections(images)
        scores = [self.score(d, m) for d, m in zip(found, metadata, strict=True)]
        return torch.tensor(scores, dtype=torch.float32)

    def diagnostics(self, images: Tensor) -> dict[str, float]:
        """``{"distinct_scenes": n}``: how many different scenes (background and the multiset of
        shape-colour objects) the detector reads among ``images``. A collapsed model draws few,
        whatever the prompts ask, which a mean reward can hide."""
        scenes = {
            (d.background, tuple(sorted((o.shape, o.color) for o in d.objects))) for d in _detections(images)
        }
        return {"distinct_scenes": float(len(scenes))}


SHAPES_REWARDS: dict[str, Score] = {
    "shapes_color": color_score,
    "shapes_shape": shape_score,
    "shapes_position": position_score,
    "shapes_count": count_score,
}
"""The registered shapes rewards, name to per-image score."""


def _register(name: str, score: Score) -> None:
    def factory() -> ShapesReward:
        return ShapesReward(name, score)

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = f"The ``{name}`` reward: :class:`ShapesReward` with :func:`{score.__name__}`."
    register_reward(name)(factory)


for _name, _score in SHAPES_REWARDS.items():
    _register(_name, _score)
