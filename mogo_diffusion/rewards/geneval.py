"""GenEval: are the prompt's objects in the image, in the right number, colour and place?

`GenEval <https://github.com/djghosh13/geneval>`_ (Ghosh et al., 2023) detects objects, classifies
the colour of each, and checks them against the prompt's metadata (one line of its
``evaluation_metadata.jsonl``)::

    {"tag": "position", "prompt": "a photo of a cat left of a dog",
     "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["left of", 0]}]}

``include`` clauses all must hold (a ``color``, a ``position`` relative to the objects of an
earlier clause), ``exclude`` clauses (``{"class", "count"}``) forbid ``count`` or more objects.
The rules, on the detections kept by :func:`select_objects`, give three scores (:func:`evaluate`):

* ``correct``: GenEval's benchmark score. Clause i holds if the ``count`` most confident objects of
  its class exist, all have its colour, and each is at ``position`` from every object of the
  target clause (which must hold itself); no ``exclude`` clause is violated.
* ``strict``: Flow-GRPO's ``strict_accuracy``: the same with *exactly* ``count`` objects of the
  class (exclude clauses are not checked: for counting they ask the same).
* ``partial``: Flow-GRPO's training reward (also DiffusionNFT's and MARBLE's), the mean of the
  terms each clause adds, with n the number of objects of its class and c its ``count``:

  - ``1 - |c - n| / c`` for the count (negative when n > 2c: 3 cats for "a cat" add -1);
  - if n != c and the clause has a colour or a position: one 0;
  - else, with a colour: ``k / c``, k of the n objects having it;
  - then, with a position (and the colour right): 0 if the target clause failed; else 1 when
    every pair is right, and 0 *then* 1 when one is wrong (as Flow-GRPO does: a wrong relation
    on a two-object prompt scores 3/4, not 2/3).

Detection (:class:`TransformersDetector`, or any callable ``images -> list[list[Detection]]``) and
colour classification (:class:`HsvColorClassifier`, or any callable) are pluggable. GenEval's own
detector is mmdetection's Mask2Former (Swin-S, COCO) and its colour classifier CLIP ViT-L/14 on
each object's masked crop; published GenEval numbers need both. Neither is built in here: a
transformers COCO detector and a weight-free HSV colour rule stand in, and any other can be passed.

>>> cat = Detection("cat", 0.9, (0, 40, 20, 60))
>>> dog = Detection("dog", 0.8, (60, 40, 80, 60))
>>> meta = {"tag": "position", "include": [
...     {"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["left of", 0]}]}
>>> evaluate(meta, [cat, dog])
GenEvalResult(correct=True, strict=True, partial=1.0, reason='')
>>> evaluate(meta, [Detection("cat", 0.9, (60, 40, 80, 60)), Detection("dog", 0.8, (0, 40, 20, 60))]).partial
0.75
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from mogo_diffusion import hub
from mogo_diffusion.rewards.base import check_batch, to_uint8
from mogo_diffusion.rewards.registry import register_reward

__all__ = [
    "COCO_TO_GENEVAL",
    "CONFIDENCE_THRESHOLD",
    "COUNTING_THRESHOLD",
    "GENEVAL_CLASSES",
    "GENEVAL_COLORS",
    "GENEVAL_TAGS",
    "MAX_OBJECTS",
    "NMS_THRESHOLD",
    "POSITION_THRESHOLD",
    "RELATIONS",
    "ColorClassifier",
    "Detection",
    "Detector",
    "GenEvalResult",
    "GenEvalReward",
    "HsvColorClassifier",
    "TransformersDetector",
    "box_iou",
    "check_metadata",
    "evaluate",
    "relative_position",
    "select_objects",
]

CONFIDENCE_THRESHOLD = 0.3
"""A detection is kept if its score is above this (GenEval's ``threshold``)..."""
COUNTING_THRESHOLD = 0.9
"""...or above this for ``counting`` prompts (``counting_threshold``)."""
MAX_OBJECTS = 16
"""At most this many detections per class are kept, the most confident (``max_objects``)."""
NMS_THRESHOLD = 1.0
"""Per-class non-maximum suppression drops a box overlapping a kept one with IoU at or above this;
1.0, GenEval's ``max_overlap``, keeps every box."""
POSITION_THRESHOLD = 0.1
"""The margin ``c`` of :func:`relative_position`, a fraction of the two boxes' summed sizes."""

GENEVAL_TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
GENEVAL_COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
RELATIONS = ("left of", "right of", "above", "below")

# fmt: off
GENEVAL_CLASSES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat",
    "traffic light", "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog",
    "horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella",
    "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard", "sports ball", "kite",
    "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle",
    "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich", "orange",
    "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch", "potted plant",
    "bed", "dining table", "toilet", "tv", "laptop", "computer mouse", "tv remote",
    "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator",
    "book", "clock", "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)
# fmt: on
"""GenEval's 80 object names, the COCO classes, in COCO order, three renamed (see
:data:`COCO_TO_GENEVAL`)."""

COCO_TO_GENEVAL: dict[str, str] = {
    "mouse": "computer mouse",
    "remote": "tv remote",
    "keyboard": "computer keyboard",
    # Older (VOC-style) spellings some checkpoints carry.
    "motorbike": "motorcycle",
    "aeroplane": "airplane",
    "sofa": "couch",
    "tvmonitor": "tv",
    "diningtable": "dining table",
    "pottedplant": "potted plant",
    "hair dryer": "hair drier",
}
"""COCO label names (as in transformers checkpoints' ``id2label``) to GenEval's object names."""

Box = tuple[float, float, float, float]


@dataclass(frozen=True)
class Detection:
    """One detected object.

    Attributes:
        label: the class name, as in the metadata (GenEval's names: :data:`GENEVAL_CLASSES`).
        score: the detector's confidence.
        box: ``(x0, y0, x1, y1)`` in pixels, y pointing down (``x0 <= x1``, ``y0 <= y1``).
        color: a colour name of :data:`GENEVAL_COLORS`, or None when not classified.
    """

    label: str
    score: float
    box: Box
    color: str | None = None

    def __post_init__(self) -> None:
        box = tuple(float(v) for v in self.box)
        if len(box) != 4 or not all(map(math.isfinite, box)) or box[2] < box[0] or box[3] < box[1]:
            raise ValueError(
                f"a box must be finite (x0, y0, x1, y1) with x0 <= x1, y0 <= y1, got {self.box!r}"
            )
        if not math.isfinite(self.score):
            raise ValueError(f"a detection score must be finite, got {self.score!r}")
        object.__setattr__(self, "box", box)
        object.__setattr__(self, "score", float(self.score))


class GenEvalResult(NamedTuple):
    """The scores of one image (see the module): ``correct`` (GenEval), ``strict`` and ``partial``
    (Flow-GRPO), and ``reason``, one line per failed check (empty when all hold)."""

    correct: bool
    strict: bool
    partial: float
    reason: str


class Detector(Protocol):
    """``images [B, H, W, 3] uint8 RGB -> B lists of detections`` (labels as in the metadata)."""

    def __call__(self, images: np.ndarray) -> list[list[Detection]]: ...


class ColorClassifier(Protocol):
    """``(image [H, W, 3] uint8 RGB, boxes, class name) -> one colour name per box``."""

    def __call__(self, image: np.ndarray, boxes: Sequence[Box], label: str) -> list[str]: ...


# The rules -----------------------------------------------------------------------------------------


def box_iou(a: Box, b: Box) -> float:
    """Intersection over union, counting pixels inclusively (``x1 - x0 + 1`` wide) as GenEval does."""

    def area(x0: float, y0: float, x1: float, y1: float) -> float:
        return max(x1 - x0 + 1, 0) * max(y1 - y0 + 1, 0)

    inter = area(max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3]))
    union = area(*a) + area(*b) - inter
    return inter / union if union else 0.0


def relative_position(a: Box, b: Box, margin: float = POSITION_THRESHOLD) -> frozenset[str]:
    """Where box ``a`` is relative to box ``b``: a subset of :data:`RELATIONS`.

    With ``o = center_a - center_b`` and ``(w, h)`` the sizes, the offset beyond the margin is
    ``r = sign(o) * max(|o| - c (size_a + size_b), 0)`` per axis; ``a`` is ``"left of"`` ``b`` when
    ``r_x / ||o|| < -1/2``, ``"right of"`` when ``> 1/2``, ``"above"`` when ``r_y / ||o|| < -1/2``,
    ``"below"`` when ``> 1/2``: none when ``|r| < 1e-3`` on both axes, two on a clear diagonal.

    >>> sorted(relative_position((0, 0, 10, 10), (20, 20, 30, 30)))
    ['above', 'left of']
    """
    o = np.array([(a[0] + a[2] - b[0] - b[2]) / 2, (a[1] + a[3] - b[1] - b[3]) / 2])
    size = np.abs([a[2] - a[0], a[3] - a[1]]) + np.abs([b[2] - b[0], b[3] - b[1]])
    r = np.maximum(np.abs(o) - margin * size, 0) * np.sign(o)
    if np.all(np.abs(r) < 1e-3):
        return frozenset()
    dx, dy = r / np.linalg.norm(o)
    found = {"left of": dx < -0.5, "right of": dx > 0.5, "above": dy < -0.5, "below": dy > 0.5}
    return frozenset(name for name, holds in found.items() if holds)


def select_objects(
    detections: Sequence[Detection],
    tag: str,
    *,
    max_objects: int = MAX_OBJECTS,
    nms_threshold: float = NMS_THRESHOLD,
) -> dict[str, list[Detection]]:
    """The detections GenEval's rules see, by class, most confident first.

    Keeps scores above :data:`CONFIDENCE_THRESHOLD` (:data:`COUNTING_THRESHOLD` for ``tag ==
    "counting"``), the ``max_objects`` best per class, then greedy per-class NMS at
    ``nms_threshold`` (:func:`box_iou`; 1.0 keeps all). Selecting twice gives the same result.
    """
    threshold = COUNTING_THRESHOLD if tag == "counting" else CONFIDENCE_THRESHOLD
    by_class: dict[str, list[Detection]] = {}
    for d in sorted(detections, key=lambda d: -d.score):
        if d.score > threshold:
            by_class.setdefault(d.label, []).append(d)
    selected = {}
    for label, ranked in by_class.items():
        ranked, kept = ranked[:max_objects], []
        while ranked:
            best = ranked.pop(0)
            kept.append(best)
            if nms_threshold < 1:
                ranked = [d for d in ranked if box_iou(best.box, d.box) < nms_threshold]
        selected[label] = kept
    return selected


def _count(clause: Mapping[str, Any], where: str) -> int:
    count = clause.get("count")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"{where}.count must be a positive integer, got {count!r}")
    return count


def check_metadata(metadata: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the field unless ``metadata`` is GenEval metadata (see the module)."""
    if not isinstance(metadata, Mapping):
        raise ValueError(f"GenEval metadata must be a dict, got {type(metadata).__name__}")
    if metadata.get("tag") not in GENEVAL_TAGS:
        raise ValueError(f"metadata tag must be one of {list(GENEVAL_TAGS)}, got {metadata.get('tag')!r}")
    include = metadata.get("include")
    if not isinstance(include, Sequence) or isinstance(include, str) or not include:
        raise ValueError(f"metadata include must be a non-empty list of objects, got {include!r}")
    for i, clause in enumerate(include):
        where = f"include[{i}]"
        if not isinstance(clause, Mapping) or not isinstance(clause.get("class"), str) or not clause["class"]:
            raise ValueError(f"{where} must be a dict with a 'class' name, got {clause!r}")
        _count(clause, where)
        if "color" in clause and clause["color"] not in GENEVAL_COLORS:
            raise ValueError(f"{where}.color must be one of {list(GENEVAL_COLORS)}, got {clause['color']!r}")
        if "position" in clause:
            position = clause["position"]
            if (
                isinstance(position, str)
                or not isinstance(position, Sequence)
                or len(position) != 2
                or position[0] not in RELATIONS
                or isinstance(position[1], bool)
                or not isinstance(position[1], int)
                or not 0 <= position[1] < i
            ):
                raise ValueError(
                    f"{where}.position must be [relation, index] with a relation of {list(RELATIONS)} "
                    f"and the index of an earlier clause (0 to {i - 1}), got {position!r}"
                )
    exclude = metadata.get("exclude", [])
    if not isinstance(exclude, Sequence) or isinstance(exclude, str):
        raise ValueError(f"metadata exclude must be a list of objects, got {exclude!r}")
    for i, clause in enumerate(exclude):
        if not isinstance(clause, Mapping) or not isinstance(clause.get("class"), str):
            raise ValueError(f"exclude[{i}] must be a dict with a 'class' name, got {clause!r}")
        _count(clause, f"exclude[{i}]")


def _colors(objects: Sequence[Detection], label: str) -> list[str]:
    colors = [d.color for d in objects]
    if None in colors:
        raise ValueError(
            f"a {label!r} detection has no colour, but the prompt asks for one: classify it first"
        )
    return colors  # type: ignore[return-value]


def _tally(colors: Sequence[str]) -> str:
    return ", ".join(f"{colors.count(c)} {c}" for c in GENEVAL_COLORS if c in colors)


def _misplaced(
    objects: Sequence[Detection], targets: Sequence[Detection], relation: str, label: str
) -> str | None:
    """The reason ``objects`` are not all at ``relation`` from all ``targets``, or None."""
    for obj in objects:
        for target in targets:
            found = relative_position(obj.box, target.box)
            if relation not in found:
                relations = " and ".join(sorted(found)) or "no relation"
                return f"expected {label} {relation} target, found {relations}"
    return None


def _geneval_correct(metadata: Mapping[str, Any], objects: Mapping[str, list[Detection]]) -> list[str]:
    """GenEval's ``evaluate``: the reasons the image is not correct (none when it is)."""
    reasons: list[str] = []
    groups: list[list[Detection] | None] = []
    for clause in metadata["include"]:
        label, count = clause["class"], clause["count"]
        found = objects.get(label, [])[:count]
        matched = len(found) >= count
        if not matched:
            reasons.append(f"expected {label} >= {count}, found {len(found)}")
        else:
            if "color" in clause:
                colors = _colors(found, label)
                if colors.count(clause["color"]) < count:
                    matched = False
                    reasons.append(f"expected {clause['color']} {label} >= {count}, found {_tally(colors)}")
            if "position" in clause and matched:
                relation, target = clause["position"]
                if groups[target] is None:
                    matched = False
                    reasons.append(f"no target for {label} to be {relation}")
                elif (why := _misplaced(found, groups[target], relation, label)) is not None:
                    matched = False
                    reasons.append(why)
        groups.append(found if matched else None)
    for clause in metadata.get("exclude", []):
        n = len(objects.get(clause["class"], []))
        if n >= clause["count"]:
            reasons.append(f"expected {clause['class']} < {clause['count']}, found {n}")
    return reasons


def _flow_grpo_partial(
    metadata: Mapping[str, Any], objects: Mapping[str, list[Detection]]
) -> tuple[float, list[str]]:
    """Flow-GRPO's ``evaluate_reward``: the partial score and the reasons it is not strictly correct."""
    terms: list[float] = []
    reasons: list[str] = []
    groups: list[list[Detection] | None] = []
    for clause in metadata["include"]:
        label, count = clause["class"], clause["count"]
        found = objects.get(label, [])
        terms.append(1 - abs(count - len(found)) / count)
        matched = len(found) == count
        if not matched:
            reasons.append(f"expected {label} == {count}, found {len(found)}")
            if "color" in clause or "position" in clause:
                terms.append(0.0)
        else:
            if "color" in clause:
                colors = _colors(found, label)
                right = colors.count(clause["color"])
                terms.append(1 - abs(count - right) / count)
                if right != count:
                    matched = False
                    reasons.append(f"expected {clause['color']} {label} == {count}, found {_tally(colors)}")
            if "position" in clause and matched:
                relation, target = clause["position"]
                if groups[target] is None:
                    matched = False
                    reasons.append(f"no target for {label} to be {relation}")
                    terms.append(0.0)
                else:
                    why = _misplaced(found, groups[target], relation, label)
                    if why is not None:
                        matched = False
                        reasons.append(why)
                        terms.append(0.0)
                    terms.append(1.0)  # also after a wrong relation, as in Flow-GRPO
        groups.append(found if matched else None)
    return sum(terms) / len(terms), reasons


def evaluate(metadata: Mapping[str, Any], detections: Sequence[Detection]) -> GenEvalResult:
    """Score one image's ``detections`` (all of them: :func:`select_objects` is applied here) against
    its GenEval ``metadata``.

    Detections of a class whose clause has a ``color`` must carry one. Raises ``ValueError`` for
    invalid metadata (:func:`check_metadata`) or a missing colour.
    """
    check_metadata(metadata)
    objects = select_objects(detections, metadata["tag"])
    wrong = _geneval_correct(metadata, objects)
    partial, not_strict = _flow_grpo_partial(metadata, objects)
    reason = "\n".join(dict.fromkeys(wrong + not_strict))
    return GenEvalResult(not wrong, not not_strict, partial, reason)


# Colours -------------------------------------------------------------------------------------------

# Hue bins in degrees, [start, end): the colour of a saturated, bright pixel.
_HUES = (
    (10, "orange"),
    (45, "yellow"),
    (70, "green"),
    (165, "blue"),
    (255, "purple"),
    (290, "pink"),
    (345, "red"),
)


class HsvColorClassifier:
    """The colour of each box: the most frequent colour name among the pixels of its centre.

    Needs no weights. The centre is the middle ``center`` fraction of the box on each axis (to
    leave out most background). Each pixel, in HSV (``s, v`` in ``[0, 1]``, hue in degrees), is:

    * ``black`` if ``v < 0.25``; achromatic (``s < 0.15``): ``white`` if ``v >= 0.6``, else ``black``;
    * by hue: red [345, 10), orange [10, 45), yellow [45, 70), green [70, 165), blue [165, 255),
      purple [255, 290), pink [290, 345); then ``brown`` for orange when ``v < 0.6``, ``pink`` for
      red when ``s < 0.6`` and ``v >= 0.7``, ``purple`` for pink when ``v < 0.7``.

    GenEval classifies with CLIP (ViT-L/14, zero-shot "a photo of a {color} {object}") on the
    object's segmentation mask over grey; this rule reads plain, evenly coloured objects correctly
    but not shading, texture or lighting. Ties go to the earlier name of :data:`GENEVAL_COLORS`.

    >>> image = np.zeros((8, 8, 3), np.uint8); image[:, :4] = (200, 30, 30); image[:, 4:] = (139, 69, 19)
    >>> HsvColorClassifier()(image, [(0, 0, 4, 8), (4, 0, 8, 8)], "car")
    ['red', 'brown']
    """

    def __init__(self, center: float = 0.5) -> None:
        if not 0 < center <= 1:
            raise ValueError(f"center must be in (0, 1], got {center!r}")
        self.center = center

    @staticmethod
    def pixel_colors(pixels: np.ndarray) -> np.ndarray:
        """``[..., 3]`` uint8 RGB to ``[...]`` indices into :data:`GENEVAL_COLORS` (the rule above)."""
        hsv = np.asarray(Image.fromarray(pixels.reshape(-1, 1, 3)).convert("HSV"), dtype=np.float64)
        h, s, v = hsv[:, 0, 0] * 360 / 255, hsv[:, 0, 1] / 255, hsv[:, 0, 2] / 255
        code = {name: i for i, name in enumerate(GENEVAL_COLORS)}
        colors = np.full(h.shape, code["red"], dtype=np.int64)
        for start, name in _HUES:
            colors[h >= start] = code[name]
        colors[(colors == code["orange"]) & (v < 0.6)] = code["brown"]
        colors[(colors == code["red"]) & (s < 0.6) & (v >= 0.7)] = code["pink"]
        colors[(colors == code["pink"]) & (h >= 290) & (h < 345) & (v < 0.7)] = code["purple"]
        colors[s < 0.15] = code["white"]
        colors[((s < 0.15) & (v < 0.6)) | (v < 0.25)] = code["black"]
        return colors.reshape(pixels.shape[:-1])

    def __call__(self, image: np.ndarray, boxes: Sequence[Box], label: str) -> list[str]:
        height, width = image.shape[:2]
        colors = []
        for x0, y0, x1, y1 in boxes:
            inset_x, inset_y = (x1 - x0) * (1 - self.center) / 2, (y1 - y0) * (1 - self.center) / 2
            left = min(max(math.floor(x0 + inset_x), 0), width - 1)
            top = min(max(math.floor(y0 + inset_y), 0), height - 1)
            right = max(min(math.ceil(x1 - inset_x), width), left + 1)
            bottom = max(min(math.ceil(y1 - inset_y), height), top + 1)
            counts = np.bincount(self.pixel_colors(image[top:bottom, left:right]).ravel(), minlength=10)
            colors.append(GENEVAL_COLORS[int(counts.argmax())])
        return colors


# The detector --------------------------------------------------------------------------------------


class TransformersDetector:
    """A transformers object-detection model (DETR, Conditional DETR, YOLOS, RT-DETR, ...) as a
    :class:`Detector`.

    Each call runs the image processor and the model on the batch, then
    ``post_process_object_detection`` at ``threshold`` with the images' own sizes, so boxes are
    in input pixels. Labels are the model's ``config.id2label`` names, renamed by ``label_map``.

    Args:
        model: an ``AutoModelForObjectDetection`` model.
        processor: its image processor.
        threshold: keep detections scoring above this (:data:`CONFIDENCE_THRESHOLD` by default,
            the lowest threshold the rules use).
        label_map: label renames, :data:`COCO_TO_GENEVAL` by default.
    """

    def __init__(
        self,
        model: Any,
        processor: Any,
        *,
        threshold: float = CONFIDENCE_THRESHOLD,
        label_map: Mapping[str, str] | None = None,
    ) -> None:
        if not 0 <= threshold < 1:
            raise ValueError(f"threshold must be in [0, 1), got {threshold!r}")
        self.model = model.eval()
        self.processor = processor
        self.threshold = float(threshold)
        label_map = COCO_TO_GENEVAL if label_map is None else label_map
        self.id2label = {int(i): label_map.get(name, name) for i, name in model.config.id2label.items()}
        self.labels = frozenset(self.id2label.values())

    @classmethod
    def from_pretrained(
        cls,
        model: str | os.PathLike[str],
        *,
        revision: str | None = None,
        local_files_only: bool | None = None,
        device: torch.device | str | None = None,
        threshold: float = CONFIDENCE_THRESHOLD,
        label_map: Mapping[str, str] | None = None,
    ) -> TransformersDetector:
        """Load model and processor from a hub id ``"org/name"`` or a local directory.

        ``local_files_only=None`` follows ``HF_HUB_OFFLINE``; remote code is never run.

        Raises:
            FileNotFoundError: ``model`` is neither an existing directory nor a hub id.
            NotADirectoryError: ``model`` is a file.
            ValueError: a ``revision`` for a local directory.
            OSError: the model cannot be loaded (from the hub, or its cache when offline).
        """
        from transformers import AutoImageProcessor, AutoModelForObjectDetection

        source = hub.resolve(model, "detector", directory=True, revision=revision)
        offline = hub.offline(local_files_only)
        kwargs = {"revision": revision, "local_files_only": offline}
        with hub.loading("detector", source, offline):
            loaded = AutoModelForObjectDetection.from_pretrained(source.location, **kwargs)
            processor = AutoImageProcessor.from_pretrained(source.location, **kwargs)
        detector = cls(loaded, processor, threshold=threshold, label_map=label_map)
        return detector.to(device) if device is not None else detector

    def to(self, device: torch.device | str) -> TransformersDetector:
        """Move the model; returns ``self``."""
        self.model.to(device)
        return self

    @torch.no_grad()
    def __call__(self, images: np.ndarray) -> list[list[Detection]]:
        """``[B, H, W, 3]`` uint8 RGB to B lists of detections."""
        if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
            raise ValueError(f"images must be a [B, H, W, 3] uint8 array, got {images.dtype} {images.shape}")
        weight = next(self.model.parameters())
        inputs = self.processor(images=list(images), return_tensors="pt").to(
            device=weight.device, dtype=weight.dtype
        )
        outputs = self.model(**inputs)
        sizes = [tuple(images.shape[1:3])] * len(images)
        results = self.processor.post_process_object_detection(
            outputs, threshold=self.threshold, target_sizes=sizes
        )
        return [
            [
                Detection(self.id2label[int(label)], float(score), tuple(box.tolist()))
                for score, label, box in zip(
                    r["scores"].cpu(), r["labels"].cpu(), r["boxes"].cpu(), strict=True
                )
            ]
            for r in results
        ]


# The reward ----------------------------------------------------------------------------------------


@register_reward("geneval")
class GenEvalReward:
    """GenEval's rules on detected objects: the ``partial`` score by default (see the module).

    NaN for a sample whose metadata has no ``include`` (not a GenEval prompt; as in MARBLE).

    Args:
        detector: a hub id or local directory of a transformers object-detection model (loaded by
            :meth:`TransformersDetector.from_pretrained`), or any :class:`Detector`.
        score: ``"partial"`` (Flow-GRPO's training reward), ``"strict"`` or ``"correct"`` (1 or 0).
        color_classifier: a :class:`ColorClassifier`; :class:`HsvColorClassifier` by default.
        device, revision, local_files_only: for loading ``detector`` by name.

    Raises:
        ValueError: invalid metadata (naming the sample), a class the detector does not know
            (for a detector with a ``labels`` set), or loading options with a detector object.

    The reward holds no state between calls: threads may share it if its detector allows.
    """

    name = "geneval"

    def __init__(
        self,
        detector: str | os.PathLike[str] | Detector,
        *,
        score: Literal["partial", "strict", "correct"] = "partial",
        color_classifier: ColorClassifier | None = None,
        device: torch.device | str | None = None,
        revision: str | None = None,
        local_files_only: bool | None = None,
    ) -> None:
        if score not in ("partial", "strict", "correct"):
            raise ValueError(f"score must be 'partial', 'strict' or 'correct', got {score!r}")
        if isinstance(detector, (str, os.PathLike)):
            detector = TransformersDetector.from_pretrained(
                detector, revision=revision, local_files_only=local_files_only, device=device
            )
        elif not callable(detector):
            raise TypeError(f"detector must be a model name or directory, or a callable, got {detector!r}")
        else:
            loading = {"device": device, "revision": revision, "local_files_only": local_files_only}
            given = sorted(k for k, v in loading.items() if v is not None)
            if given:
                raise ValueError(
                    f"{', '.join(given)} apply to a detector loaded by name, not to {detector!r}"
                )
        self.detector: Detector = detector
        self.score = score
        self.color_classifier: ColorClassifier = color_classifier or HsvColorClassifier()

    def to(self, device: torch.device | str) -> GenEvalReward:
        """Move the detector and the colour classifier, where they have a ``to``; returns ``self``."""
        for part in (self.detector, self.color_classifier):
            if hasattr(part, "to"):
                part.to(device)
        return self

    def results(
        self, images: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> list[GenEvalResult | None]:
        """The full :class:`GenEvalResult` of each sample, None where it has no GenEval metadata."""
        check_batch(images, prompts, metadata)
        wanted = [i for i, m in enumerate(metadata) if isinstance(m, Mapping) and "include" in m]
        labels = getattr(self.detector, "labels", None)
        for i in wanted:
            try:
                check_metadata(metadata[i])
            except ValueError as err:
                raise ValueError(f"metadata[{i}]: {err}") from None
            for clause in (*metadata[i]["include"], *metadata[i].get("exclude", [])):
                if labels is not None and clause["class"] not in labels:
                    raise ValueError(
                        f"metadata[{i}]: class {clause['class']!r} is not a label of the detector"
                    )
        results: list[GenEvalResult | None] = [None] * len(metadata)
        if not wanted:
            return results
        pixels = to_uint8(images[wanted])
        detections = self.detector(pixels)
        if len(detections) != len(wanted):
            raise ValueError(f"the detector returned {len(detections)} results for {len(wanted)} images")
        for i, image, found in zip(wanted, pixels, detections, strict=True):
            results[i] = evaluate(metadata[i], self._with_colors(image, found, metadata[i]))
        return results

    def _with_colors(
        self, image: np.ndarray, detections: Sequence[Detection], metadata: Mapping[str, Any]
    ) -> list[Detection]:
        """``detections`` with a colour on the selected objects of every class the prompt colours."""
        colored = {clause["class"] for clause in metadata["include"] if "color" in clause}
        selected = select_objects(detections, metadata["tag"])
        out = [d for label, objects in selected.items() if label not in colored for d in objects]
        for label in colored & selected.keys():
            objects = selected[label]
            colors = self.color_classifier(image, [d.box for d in objects], label)
            if len(colors) != len(objects):
                raise ValueError(
                    f"the colour classifier returned {len(colors)} colours for {len(objects)} boxes"
                )
            out += [Detection(d.label, d.score, d.box, c) for d, c in zip(objects, colors, strict=True)]
        return out

    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> Tensor:
        values = [
            math.nan if r is None else float(getattr(r, self.score))
            for r in self.results(images, prompts, metadata)
        ]
        return torch.tensor(values, dtype=torch.float32)
