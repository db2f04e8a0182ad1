"""The shapes world: synthetic 32 px scenes of coloured shapes, their captions and GenEval metadata.

A :class:`Scene` is a background colour and one to three :class:`Object` (shape, colour, box).
:func:`render` draws it exactly (a pixel belongs to a shape when its centre does), so a detector
can invert it. Every scene has a caption in GenEval's style (without GenEval's "a photo of", so
that every caption fits the tiny pipeline's 32 tokens) and metadata in GenEval's format, plus the
background:

.. code-block:: text

    tag            caption                                                  objects
    single_object  a circle on a white background                           1, colour unnamed
    two_object     a circle and a square on a gray background               2 shapes, colours unnamed
    counting       three red triangles on a black background                2 or 3 alike
    colors         a red circle on a white background                       1
    position       a red circle left of a blue square on a white background 2 (reference, target)
    color_attr     a red circle and a blue square on a black background     2

    {"tag": "position", "prompt": ..., "background": "white", "exclude": [],
     "include": [{"class": "square", "count": 1, "color": "blue"},
                 {"class": "circle", "count": 1, "color": "red", "position": ["left of", 0]}]}

Objects of a scene are ``[reference, target]`` for ``position`` (as GenEval lists them), caption
order otherwise. Two-object scenes have two different shapes (and, where colours are named, two
different colours); objects never touch (boxes at least :data:`GAP` px apart).

Splits. The held-out colour-shape pairs :data:`HELDOUT_PAIRS` never occur in the ``"train"`` split,
neither named in a caption nor drawn. The ``"heldout"`` split is every prompt that names at least
one of them (tags ``colors``, ``counting``, ``position``, ``color_attr``), so its prompts are
combinations never seen in training; :func:`all_prompts` enumerates both.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "BACKGROUNDS",
    "COLORS",
    "GAP",
    "HELDOUT_PAIRS",
    "MAX_SEQUENCE_LENGTH",
    "OBJECT_COLORS",
    "RELATIONS",
    "SHAPES",
    "SIZE",
    "TAGS",
    "TAG_WEIGHTS",
    "Object",
    "Scene",
    "Split",
    "all_metadata",
    "all_prompts",
    "corpus",
    "relations",
    "relative_direction",
    "render",
    "render_batch",
    "sample_scenes",
    "shape_mask",
]

Split = Literal["train", "heldout"]

SIZE = 32
"""Image side in px (the tiny SD3's image size); boxes are in these pixels."""
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
"""Shape classes (the triangle is upright and isosceles, as tall as wide)."""
COLORS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
    "white": (1.0, 1.0, 1.0),
    "black": (0.0, 0.0, 0.0),
    "gray": (0.5, 0.5, 0.5),
}
"""RGB in [0, 1] of every colour of the world (the same values as ``rewards.rules.PALETTE``); any
two are at least 0.86 apart."""
OBJECT_COLORS: tuple[str, ...] = ("red", "green", "blue", "yellow")
BACKGROUNDS: tuple[str, ...] = ("white", "black", "gray")
HELDOUT_PAIRS: frozenset[tuple[str, str]] = frozenset(
    {("blue", "circle"), ("yellow", "square"), ("red", "triangle")}
)
"""The (colour, shape) pairs of the held-out split only; one per shape, three of the twelve."""
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
TAGS: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
TAG_WEIGHTS: dict[str, float] = {
    "single_object": 0.1,
    "two_object": 0.1,
    "counting": 0.15,
    "colors": 0.3,
    "position": 0.2,
    "color_attr": 0.15,
}
"""How often :func:`sample_scenes` draws each tag (renormalized over the tags a split has)."""
GAP = 3
"""Least distance in px between the boxes of two objects (so blurred objects stay apart)."""

_NUMBERS = {1: "a", 2: "two", 3: "three"}
_SIZES = {1: (12, 18), 2: (9, 13), 3: (8, 10)}  # box side (inclusive range) by number of objects
_MARGIN = 1
_POSITION_THRESHOLD = 0.1  # GenEval's


@dataclass(frozen=True)
class Object:
    """One shape of a scene.

    Attributes:
        shape: one of :data:`SHAPES`.
        color: one of :data:`OBJECT_COLORS`.
        box: ``(x0, y0, x1, y1)`` in px of the 32 px image, ends exclusive; a square of side 8 to 18.
    """

    shape: str
    color: str
    box: tuple[int, int, int, int]

    @property
    def center(self) -> tuple[float, float]:
        """``(x, y)`` of the box centre in px."""
        x0, y0, x1, y1 = self.box
        return (x0 + x1) / 2, (y0 + y1) / 2


@dataclass(frozen=True)
class Scene:
    """A background and its objects, with the tag that decides what the caption names.

    Attributes:
        tag: one of :data:`TAGS`.
        background: one of :data:`BACKGROUNDS`.
        objects: the objects; ``(reference, target)`` for ``position``.
        relation: for ``position``, where the target lies relative to the reference (one of
            :data:`RELATIONS`; :func:`relations` of their boxes is exactly ``{relation}``); else None.
    """

    tag: str
    background: str
    objects: tuple[Object, ...]
    relation: str | None = None

    def __post_init__(self) -> None:
        if self.tag not in TAGS:
            raise ValueError(f"unknown tag {self.tag!r}; expected one of {TAGS}")
        if self.background not in COLORS:
            raise ValueError(f"unknown background colour {self.background!r}; expected one of {list(COLORS)}")
        for obj in self.objects:
            if obj.shape not in SHAPES or obj.color not in COLORS:
                raise ValueError(f"unknown shape or colour in {obj}; shapes {SHAPES}, colours {list(COLORS)}")
        if (self.relation is None) != (self.tag != "position"):
            raise ValueError(f"relation must be given for tag 'position' only, got {self.relation!r}")
        if self.relation is not None and self.relation not in RELATIONS:
            raise ValueError(f"unknown relation {self.relation!r}; expected one of {RELATIONS}")
        expected = {"single_object": (1,), "colors": (1,), "counting": (2, 3)}.get(self.tag, (2,))
        if len(self.objects) not in expected:
            raise ValueError(f"tag {self.tag!r} needs {expected} objects, got {len(self.objects)}")

    @property
    def _named(self) -> tuple[tuple[str, str | None], ...]:
        colored = self.tag not in ("single_object", "two_object")
        return tuple((obj.shape, obj.color if colored else None) for obj in self.objects)

    @property
    def prompt(self) -> str:
        """The caption, e.g. ``"a red circle left of a blue square on a white background"``."""
        return _caption(self.tag, self.background, self._named, self.relation)

    @property
    def metadata(self) -> dict[str, Any]:
        """GenEval metadata (a new dict each time) with ``"background"`` added; see the module doc."""
        return _metadata(self.tag, self.background, self._named, self.relation)


def _noun(shape: str, color: str | None, count: int) -> str:
    words = [_NUMBERS[count], *([color] if color else []), shape + ("s" if count > 1 else "")]
    return " ".join(words)


def _caption(tag: str, background: str, named: Sequence[tuple[str, str | None]], relation: str | None) -> str:
    if tag == "counting":
        body = _noun(*named[0], len(named))
    elif tag == "position":
        (ref_shape, ref_color), (shape, color) = named
        body = f"{_noun(shape, color, 1)} {relation} {_noun(ref_shape, ref_color, 1)}"
    else:
        body = " and ".join(_noun(shape, color, 1) for shape, color in named)
    return f"{body} on a {background} background"


def _metadata(
    tag: str, background: str, named: Sequence[tuple[str, str | None]], relation: str | None
) -> dict[str, Any]:
    def entry(shape: str, color: str | None, count: int = 1) -> dict[str, Any]:
        return {"class": shape, "count": count, **({"color": color} if color else {})}

    exclude: list[dict[str, Any]] = []
    if tag == "counting":
        include = [entry(*named[0], len(named))]
        exclude = [{"class": named[0][0], "count": len(named) + 1}]
    else:
        include = [entry(*item) for item in named]
        if tag == "position":
            include[1]["position"] = [relation, 0]
    return {
        "tag": tag,
        "prompt": _caption(tag, background, named, relation),
        "include": include,
        "exclude": exclude,
        "background": background,
    }


# Geometry -----------------------------------------------------------------------------------------


def relative_direction(box: Sequence[float], reference: Sequence[float]) -> tuple[float, float] | None:
    """GenEval's ``(dx, dy) = r / ||o||`` of ``box`` relative to ``reference`` (see :func:`relations`),
    each in ``[-1, 1]``; None when the revised offset ``r`` vanishes (overlapping boxes)."""
    a, b = np.asarray(box, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    offset = (a[:2] + a[2:]) / 2 - (b[:2] + b[2:]) / 2
    dims = np.abs(a[2:] - a[:2]) + np.abs(b[2:] - b[:2])
    revised = np.maximum(np.abs(offset) - _POSITION_THRESHOLD * dims, 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return None
    dx, dy = revised / np.linalg.norm(offset)
    return float(dx), float(dy)


def relations(box: Sequence[float], reference: Sequence[float]) -> set[str]:
    """Where ``box`` lies relative to ``reference``, by GenEval's rule (image y points down).

    With centre offset ``o = c - c_ref`` and box sizes ``d``, ``d_ref``, the revised offset
    ``r = sign(o) max(|o| - 0.1 (d + d_ref), 0)``; with ``(dx, dy) = r / ||o||``, the relations
    are "left of" (dx < -0.5), "right of" (dx > 0.5), "above" (dy < -0.5), "below" (dy > 0.5).
    Boxes are ``(x0, y0, x1, y1)``; the result may be empty (overlapping boxes) or hold two.
    """
    direction = relative_direction(box, reference)
    if direction is None:
        return set()
    dx, dy = direction
    found = set()
    if dx < -0.5:
        found.add("left of")
    if dx > 0.5:
        found.add("right of")
    if dy < -0.5:
        found.add("above")
    if dy > 0.5:
        found.add("below")
    return found


def shape_mask(shape: str, box: Sequence[float], size: int = SIZE) -> np.ndarray:
    """``[size, size]`` bool mask of a shape in ``box`` (32 px units), sampled at pixel centres.

    The circle is inscribed in the box; the square fills it; the triangle has its apex at the top
    middle and its base on the bottom edge. ``size`` other than 32 scales the scene.
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")
    x0, y0, x1, y1 = (float(v) for v in box)
    centres = (np.arange(size) + 0.5) * (SIZE / size)
    x, y = centres[None, :], centres[:, None]
    inside = (x >= x0) & (x < x1) & (y >= y0) & (y < y1)
    if shape == "square":
        return inside
    cx, w, h = (x0 + x1) / 2, x1 - x0, y1 - y0
    if shape == "circle":
        cy = (y0 + y1) / 2
        return ((x - cx) / (w / 2)) ** 2 + ((y - cy) / (h / 2)) ** 2 <= 1
    return inside & (np.abs(x - cx) <= (w / 2) * (y - y0) / h)


def render(scene: Scene, size: int = SIZE) -> Tensor:
    """``[3, size, size]`` float32 image in [0, 1]: the background, then the objects in order."""
    canvas = np.empty((size, size, 3), dtype=np.float32)
    canvas[:] = COLORS[scene.background]
    for obj in scene.objects:
        canvas[shape_mask(obj.shape, obj.box, size)] = COLORS[obj.color]
    return torch.from_numpy(canvas).permute(2, 0, 1).contiguous()


def render_batch(scenes: Sequence[Scene], size: int = SIZE) -> Tensor:
    """``[B, 3, size, size]`` float32 images of ``scenes`` (see :func:`render`)."""
    if len(scenes) == 0:
        return torch.empty(0, 3, size, size)
    return torch.stack([render(scene, size) for scene in scenes])


# Prompts and sampling -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    """What a caption names: its tag, background, (shape, colour or None) items and relation."""

    tag: str
    background: str
    named: tuple[tuple[str, str | None], ...]
    relation: str | None = None

    @property
    def prompt(self) -> str:
        return _caption(self.tag, self.background, self.named, self.relation)

    @property
    def heldout(self) -> bool:
        return any(pair[::-1] in HELDOUT_PAIRS for pair in self.named)


def _specs(tag: str) -> list[_Spec]:
    """Every spec of ``tag``, both splits, in a fixed order."""
    out: list[_Spec] = []
    for background in BACKGROUNDS:
        if tag == "single_object":
            out += [_Spec(tag, background, ((s, None),)) for s in SHAPES]
        elif tag == "two_object":
            out += [
                _Spec(tag, background, ((a, None), (b, None))) for a, b in itertools.permutations(SHAPES, 2)
            ]
        elif tag == "colors":
            out += [_Spec(tag, background, ((s, c),)) for s in SHAPES for c in OBJECT_COLORS]
        elif tag == "counting":
            out += [
                _Spec(tag, background, ((s, c),) * n) for n in (2, 3) for s in SHAPES for c in OBJECT_COLORS
            ]
        else:
            pairs = [
                ((a, ca), (b, cb))
                for a, b in itertools.permutations(SHAPES, 2)
                for ca, cb in itertools.permutations(OBJECT_COLORS, 2)
            ]
            relations_ = RELATIONS if tag == "position" else (None,)
            out += [_Spec(tag, background, pair, r) for pair in pairs for r in relations_]
    return out


_SPECS: dict[str, list[_Spec]] = {tag: _specs(tag) for tag in TAGS}


def _split_specs(split: str) -> dict[str, list[_Spec]]:
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    chosen = {tag: [s for s in specs if s.heldout == (split == "heldout")] for tag, specs in _SPECS.items()}
    return {tag: specs for tag, specs in chosen.items() if specs}


def all_prompts(split: Split = "train") -> list[str]:
    """Every distinct caption of ``split``, in a fixed order (tag by tag, as :data:`TAGS`)."""
    return [spec.prompt for specs in _split_specs(split).values() for spec in specs]


def corpus() -> list[str]:
    """Every caption of both splits: the texts the world's tokenizers are learned from, so that
    each of its words is one token."""
    return [*all_prompts("train"), *all_prompts("heldout")]


MAX_SEQUENCE_LENGTH = 14
"""Tokens per caption of the world's tokenizers (the pipeline's CLIPs and T5, the reward CLIP):
the longest caption's 12 words and CLIP's start and end tokens, with tokenizers learned from
:func:`corpus`."""


def all_metadata(split: Split = "train") -> list[dict[str, Any]]:
    """The metadata (as :attr:`Scene.metadata`) of every caption of :func:`all_prompts`, in its order."""
    return [
        _metadata(spec.tag, spec.background, spec.named, spec.relation)
        for specs in _split_specs(split).values()
        for spec in specs
    ]


def _place(rng: np.random.Generator, sizes: Sequence[int], relation: str | None) -> list[tuple[int, ...]]:
    """Boxes of the given sides, inside the image and :data:`GAP` apart; ``relation`` of box 1 to box 0."""
    for _ in range(10_000):
        boxes: list[tuple[int, ...]] = []
        for side in sizes:
            x0, y0 = (int(v) for v in rng.integers(_MARGIN, SIZE - _MARGIN - side + 1, size=2))
            box = (x0, y0, x0 + side, y0 + side)
            if all(_apart(box, other) for other in boxes):
                boxes.append(box)
            else:
                break
        if len(boxes) == len(sizes) and (relation is None or relations(boxes[1], boxes[0]) == {relation}):
            return boxes
    raise RuntimeError(f"could not place boxes of sides {list(sizes)} with relation {relation!r}")


def _apart(a: Sequence[int], b: Sequence[int]) -> bool:
    return a[0] >= b[2] + GAP or b[0] >= a[2] + GAP or a[1] >= b[3] + GAP or b[1] >= a[3] + GAP


def _scene(rng: np.random.Generator, spec: _Spec) -> Scene:
    low, high = _SIZES[len(spec.named)]
    sizes = (
        [int(rng.integers(low, high + 1))] * len(spec.named)
        if spec.tag == "counting"
        else [int(rng.integers(low, high + 1)) for _ in spec.named]
    )
    boxes = _place(rng, sizes, spec.relation)
    objects = []
    for (shape, color), box in zip(spec.named, boxes, strict=True):
        if color is None:  # unnamed: any colour the training split may show with this shape
            allowed = [c for c in OBJECT_COLORS if (c, shape) not in HELDOUT_PAIRS]
            color = allowed[int(rng.integers(len(allowed)))]
        objects.append(Object(shape, color, tuple(int(v) for v in box)))
    return Scene(spec.tag, spec.background, tuple(objects), spec.relation)


def sample_scenes(
    n: int, seed: int = 0, split: Split = "train", tag_weights: Mapping[str, float] | None = None
) -> list[Scene]:
    """``n`` random scenes of ``split``, the same for the same arguments in every process.

    Each scene draws a tag (by ``tag_weights``, default :data:`TAG_WEIGHTS`, over the tags the split
    has), a caption of that tag uniformly, sizes and positions, and any colour the caption leaves
    unnamed. Scene ``i`` depends on ``(seed, split, i)`` only, so a longer list extends a shorter one.

    Raises:
        ValueError: negative ``n``, an unknown split, unknown tags or weights that are negative or
            sum to zero over the split's tags.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    specs = _split_specs(split)
    weights = dict(TAG_WEIGHTS if tag_weights is None else tag_weights)
    unknown = sorted(set(weights) - set(TAGS))
    if unknown:
        raise ValueError(f"unknown tags {unknown} in tag_weights; expected some of {TAGS}")
    p = np.array([float(weights.get(tag, 0.0)) for tag in specs])
    if (p < 0).any() or not math.isfinite(p.sum()) or p.sum() <= 0:
        raise ValueError(f"tag_weights must be >= 0 with a positive sum over {list(specs)}, got {weights}")
    p = p / p.sum()
    tags = list(specs)
    split_code = 0 if split == "train" else 1
    scenes = []
    for i in range(n):
        rng = np.random.default_rng([seed, split_code, i])
        tag = tags[int(rng.choice(len(tags), p=p))]
        spec = specs[tag][int(rng.integers(len(specs[tag])))]
        scenes.append(_scene(rng, spec))
    return scenes
