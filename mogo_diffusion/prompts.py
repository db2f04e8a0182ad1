"""Prompt sets: plain text and GenEval JSONL files, and generated OCR, GenEval and shapes prompts.

Every loader and generator returns a :class:`PromptSet`: the prompts and one metadata dict per
prompt, which rewards read (:class:`~mogo_diffusion.rewards.ocr.OcrReward` the ``"text"``,
:class:`~mogo_diffusion.rewards.geneval.GenEvalReward` the ``"tag"``, ``"include"``, ``"exclude"``).
Generators are deterministic: the same ``n`` and ``seed`` give the same set in every process.
:func:`load_prompt_set` reads any of them from one string, as ``sampling.prompts`` gives it.

>>> ocr_prompts(2, seed=0)  # doctest: +NORMALIZE_WHITESPACE
PromptSet(prompts=['a poster with "library" in bold letters', 'a neon sign reading "home"'],
          metadata=[{'text': 'library'}, {'text': 'home'}])
>>> geneval_prompts(1, seed=0, tags=["position"]).metadata  # doctest: +NORMALIZE_WHITESPACE
[{'tag': 'position',
  'include': [{'class': 'pizza', 'count': 1}, {'class': 'orange', 'count': 1, 'position': ['left of', 0]}],
  'prompt': 'a photo of an orange left of a pizza'}]
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from mogo_diffusion.rewards.geneval import (
    GENEVAL_CLASSES,
    GENEVAL_COLORS,
    GENEVAL_TAGS,
    RELATIONS,
    check_metadata,
)

__all__ = [
    "OCR_TEMPLATES",
    "OCR_WORDS",
    "PromptSet",
    "geneval_prompts",
    "load_geneval_metadata",
    "load_prompt_set",
    "load_prompts",
    "ocr_prompts",
    "shapes_prompts",
]


class PromptSet(NamedTuple):
    """``prompts[i]`` with its ``metadata[i]`` (a dict, empty when there is nothing to add)."""

    prompts: list[str]
    metadata: list[dict[str, Any]]


def _read_lines(path: str | os.PathLike[str], what: str) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} file {str(path)!r} does not exist")
    return path.read_text(encoding="utf-8").splitlines()


def load_prompts(path: str | os.PathLike[str]) -> PromptSet:
    """Prompts from a text file, one per line (stripped); blank lines and lines starting with ``#``
    are skipped (a ``#`` later in a line is part of the prompt). Metadata are empty dicts.

    Raises:
        FileNotFoundError: no such file. ValueError: the file has no prompt.
    """
    prompts = [s for line in _read_lines(path, "prompt") if (s := line.strip()) and not s.startswith("#")]
    if not prompts:
        raise ValueError(f"prompt file {str(path)!r} has no prompts")
    return PromptSet(prompts, [{} for _ in prompts])


def load_geneval_metadata(path: str | os.PathLike[str]) -> PromptSet:
    """Prompts and metadata from GenEval's ``evaluation_metadata.jsonl`` format: one JSON object a
    line with a ``"prompt"`` and GenEval metadata (``"tag"``, ``"include"``, optionally
    ``"exclude"``; :func:`~mogo_diffusion.rewards.geneval.check_metadata`). Each metadata dict is the
    whole line, ``"prompt"`` included, as GenEval keeps it. Blank lines are skipped.

    Raises:
        FileNotFoundError: no such file. ValueError: a bad line (``path:line: why``), or no line.
    """
    prompts, metadata = [], []
    for number, line in enumerate(_read_lines(path, "GenEval metadata"), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str) or not entry["prompt"]:
                raise ValueError("expected a JSON object with a non-empty 'prompt'")
            check_metadata(entry)
        except ValueError as err:  # json.JSONDecodeError is a ValueError
            raise ValueError(f"{path}:{number}: {err}") from None
        prompts.append(entry["prompt"])
        metadata.append(entry)
    if not prompts:
        raise ValueError(f"GenEval metadata file {str(path)!r} has no prompts")
    return PromptSet(prompts, metadata)


def _check_count(n: int, seed: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")


# OCR -----------------------------------------------------------------------------------------------

OCR_TEMPLATES = (
    'a sign that says "{}"',
    'a storefront with the word "{}" above the door',
    'a poster with "{}" in bold letters',
    'a neon sign reading "{}"',
    'a t-shirt printed with "{}"',
    'a chalkboard with "{}" written on it',
    'a book cover titled "{}"',
    'a coffee mug with the text "{}"',
)
"""Templates of :func:`ocr_prompts`; ``{}`` is the text."""

# fmt: off
OCR_WORDS = (
    "hello", "open", "closed", "welcome", "coffee", "bakery", "pizza", "books", "music", "sale",
    "exit", "stop", "hotel", "cinema", "garden", "market", "library", "museum", "ocean", "river",
    "forest", "summer", "winter", "sunset", "dream", "peace", "love", "magic", "happy", "smile",
    "thanks", "friends", "family", "home", "school", "science", "future", "robot", "rocket", "planet",
    "galaxy", "dragon", "tiger", "panda", "lemon", "apple", "bread", "cheese", "honey", "tea",
    "open 24 hours", "no parking", "fresh bread", "good morning", "hello world", "best coffee",
    "keep calm", "thank you", "game over", "live music",
)
# fmt: on
"""Words and short phrases of :func:`ocr_prompts`."""


def _draws(rng: random.Random, items: Sequence[Any], n: int) -> list[Any]:
    """``n`` items: shuffled passes over ``items``, so none repeats before all have been drawn."""
    out: list[Any] = []
    while len(out) < n:
        batch = list(items)
        rng.shuffle(batch)
        out += batch[: n - len(out)]
    return out


def ocr_prompts(n: int, seed: int = 0) -> PromptSet:
    """``n`` prompts asking for text, from :data:`OCR_TEMPLATES` x :data:`OCR_WORDS` (every pair
    before any repeats), with metadata ``{"text": word}``."""
    _check_count(n, seed)
    rng = random.Random(seed)
    pairs = [(t, w) for t in OCR_TEMPLATES for w in OCR_WORDS]
    chosen = _draws(rng, pairs, n)
    return PromptSet([t.format(w) for t, w in chosen], [{"text": w} for _, w in chosen])


# GenEval -------------------------------------------------------------------------------------------

_NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
_COLORABLE = tuple(c for c in GENEVAL_CLASSES if c != "person")  # GenEval asks no "[colour] person"


def _a(name: str) -> str:
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _plural(name: str) -> str:
    return f"{name}es" if name.endswith("s") else f"{name}s"  # GenEval's rule ("skises", "knifes")


def _single_object(rng: random.Random) -> dict[str, Any]:
    name = rng.choice(GENEVAL_CLASSES)
    return {
        "tag": "single_object",
        "include": [{"class": name, "count": 1}],
        "prompt": f"a photo of {_a(name)}",
    }


def _two_object(rng: random.Random) -> dict[str, Any]:
    a, b = rng.sample(GENEVAL_CLASSES, 2)
    include = [{"class": a, "count": 1}, {"class": b, "count": 1}]
    return {"tag": "two_object", "include": include, "prompt": f"a photo of {_a(a)} and {_a(b)}"}


def _counting(rng: random.Random) -> dict[str, Any]:
    name, count = rng.choice(GENEVAL_CLASSES), rng.randint(2, 4)
    return {
        "tag": "counting",
        "include": [{"class": name, "count": count}],
        "exclude": [{"class": name, "count": count + 1}],
        "prompt": f"a photo of {_NUMBERS[count]} {_plural(name)}",
    }


def _colors(rng: random.Random) -> dict[str, Any]:
    name, color = rng.choice(_COLORABLE), rng.choice(GENEVAL_COLORS)
    include = [{"class": name, "count": 1, "color": color}]
    return {"tag": "colors", "include": include, "prompt": f"a photo of {_a(color)} {name}"}


def _position(rng: random.Random) -> dict[str, Any]:
    a, b = rng.sample(GENEVAL_CLASSES, 2)
    relation = rng.choice(RELATIONS)
    include = [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [relation, 0]}]
    return {"tag": "position", "include": include, "prompt": f"a photo of {_a(a)} {relation} {_a(b)}"}


def _color_attr(rng: random.Random) -> dict[str, Any]:
    a, b = rng.sample(_COLORABLE, 2)
    color_a, color_b = rng.sample(GENEVAL_COLORS, 2)
    include = [{"class": a, "count": 1, "color": color_a}, {"class": b, "count": 1, "color": color_b}]
    prompt = f"a photo of {_a(color_a)} {a} and {_a(color_b)} {b}"
    return {"tag": "color_attr", "include": include, "prompt": prompt}


_GENERATORS: dict[str, Callable[[random.Random], dict[str, Any]]] = {
    "single_object": _single_object,
    "two_object": _two_object,
    "counting": _counting,
    "colors": _colors,
    "position": _position,
    "color_attr": _color_attr,
}


def geneval_prompts(n: int, seed: int = 0, tags: Sequence[str] = GENEVAL_TAGS) -> PromptSet:
    """``n`` GenEval-style prompts over the 80 COCO classes, the ``tags`` taking turns.

    Prompts and metadata follow GenEval's ``create_prompts.py``: ``"a photo of a cat"``, ``"a photo
    of a cat and a dog"``, ``"a photo of three dogs"`` (2 to 4; ``exclude`` one more), ``"a photo
    of a red car"`` (never a coloured person), ``"a photo of a cat left of a dog"`` (the dog is
    clause 0, the cat at ``["left of", 0]`` from it), ``"a photo of a red car and a blue bench"``
    (two colours). Each metadata dict holds ``tag``, ``include``, ``exclude`` where used, and
    ``prompt``, as a line of GenEval's ``evaluation_metadata.jsonl`` does.
    """
    _check_count(n, seed)
    tags = list(tags)
    unknown = [t for t in tags if t not in _GENERATORS]
    if not tags or unknown:
        raise ValueError(f"tags must be a non-empty list of {list(GENEVAL_TAGS)}, got {tags!r}")
    rng = random.Random(seed)
    metadata = [_GENERATORS[tags[i % len(tags)]](rng) for i in range(n)]
    return PromptSet([m["prompt"] for m in metadata], metadata)


# Shapes --------------------------------------------------------------------------------------------


def shapes_prompts(split: str = "train", n: int | None = None, seed: int = 0) -> PromptSet:
    """Captions of the shapes world (:mod:`mogo_diffusion.shapes`) with their GenEval metadata.

    With ``n``, the captions of ``n`` sampled scenes of ``split`` (tags drawn by
    :data:`~mogo_diffusion.shapes.scenes.TAG_WEIGHTS`, so captions may repeat); without, every
    distinct caption of ``split`` once.
    """
    from mogo_diffusion.shapes.scenes import all_metadata, sample_scenes

    if n is None:
        metadata = all_metadata(split)
    else:
        _check_count(n, seed)
        metadata = [scene.metadata for scene in sample_scenes(n, seed, split)]
    return PromptSet([m["prompt"] for m in metadata], metadata)


def load_prompt_set(source: str | os.PathLike[str]) -> PromptSet:
    """The prompt set named by ``source``:

    * ``"shapes:SPLIT"`` or ``"shapes:SPLIT:N"``: :func:`shapes_prompts` of ``SPLIT`` (``train`` or
      ``heldout``), every caption or ``N`` sampled ones (seed 0);
    * a path ending in ``.jsonl``: :func:`load_geneval_metadata`;
    * any other path: :func:`load_prompts`.

    Raises:
        FileNotFoundError: no such file. ValueError: a malformed ``shapes:`` source or file.
    """
    text = os.fspath(source)
    if text.startswith("shapes:"):
        parts = text.split(":")
        if len(parts) not in (2, 3) or parts[1] not in ("train", "heldout") or not all(parts[1:]):
            raise ValueError(
                f"prompt source {text!r}: expected 'shapes:train', 'shapes:heldout' or 'shapes:SPLIT:N'"
            )
        if len(parts) == 3 and not parts[2].isdigit():
            raise ValueError(f"prompt source {text!r}: N must be a positive integer, got {parts[2]!r}")
        return shapes_prompts(parts[1], int(parts[2]) if len(parts) == 3 else None)
    if text.endswith(".jsonl"):
        return load_geneval_metadata(text)
    return load_prompts(text)
