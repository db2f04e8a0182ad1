"""Prompt sets: plain text and GenEval JSONL files, and generated OCR, GenEval and shapes prompts.

Every loader and generator returns a :class:`PromptSet`: the prompts and one metadata dict per
prompt, which rewards read (:class:`~mogo_diffusion.rewards.ocr.OcrReward` the ``"text"``,
:class:`~mogo_diffusion.rewards.geneval.GenEvalReward` the ``"tag"``, ``"include"``, ``"exclude"``).
Generators are deterministic: the same ``n`` and ``seed`` give the same set in every process.
:func:`load_prompt_set` reads any of them from one string, as ``sampling.prompts`` gives it;
:func:`load_prompt_pool` mixes several in given proportions (a :class:`PromptPool`), each prompt's
metadata marking which specialist reward it is for.

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
import math
import os
import random
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from mogo_diffusion.rewards.geneval import (
    GENEVAL_CLASSES,
    GENEVAL_COLORS,
    GENEVAL_TAGS,
    RELATIONS,
    check_metadata,
)
from mogo_diffusion.rewards.ocr import quoted_text

if TYPE_CHECKING:
    from mogo_diffusion.config import PromptSource

__all__ = [
    "OCR_TEMPLATES",
    "OCR_WORDS",
    "PromptPool",
    "PromptSet",
    "geneval_prompts",
    "load_geneval_metadata",
    "load_prompt_pool",
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
    """The lines of a UTF-8 text file; a byte-order mark is not part of the first line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} file {str(path)!r} does not exist")
    try:
        return path.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError as error:
        byte = error.object[error.start]
        raise ValueError(
            f"{what} file {str(path)!r} is not UTF-8 text: byte {error.start} ({byte:#04x}): {error.reason}"
        ) from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's ``object_pairs_hook``: a key given twice is an error, not the last value."""
    entry: dict[str, Any] = {}
    for key, value in pairs:
        if key in entry:
            raise ValueError(f"key {key!r} appears twice ({entry[key]!r} and {value!r})")
        entry[key] = value
    return entry


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
    whole line, ``"prompt"`` included, as GenEval keeps it. Blank lines are skipped; a key given
    twice in a line is an error.

    Raises:
        FileNotFoundError: no such file. ValueError: a bad line (``path:line: why``), or no line.
    """
    prompts, metadata = [], []
    for number, line in enumerate(_read_lines(path, "GenEval metadata"), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line, object_pairs_hook=_unique_keys)
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
    * ``"ocr:N"``, ``"geneval:N"``: :func:`ocr_prompts`, :func:`geneval_prompts` (``N`` of them, seed 0);
    * a path ending in ``.jsonl`` (any case): :func:`load_geneval_metadata`;
    * any other path: :func:`load_prompts`.

    Raises:
        FileNotFoundError: no such file. ValueError: a malformed generated source or file.
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
    kind, sep, count = text.partition(":")
    if sep and kind in ("ocr", "geneval"):
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"prompt source {text!r}: expected '{kind}:N' with N a positive integer")
        return (ocr_prompts if kind == "ocr" else geneval_prompts)(int(count))
    if text.lower().endswith(".jsonl"):
        return load_geneval_metadata(text)
    return load_prompts(text)


# Mixed pools ---------------------------------------------------------------------------------------


def _mark(prompts: PromptSet, source: str, reward: str | None) -> tuple[PromptSet, str]:
    """``prompts`` of a pool's ``source`` with metadata that make ``ocr`` and ``geneval`` apply
    exactly where ``reward`` says: ``"source"`` names the source; ``"text"`` is the text to render
    on OCR prompts (the metadata's or the prompt's quoted span) and None elsewhere; GenEval
    metadata (``"include"``) only on GenEval prompts. ``reward`` None: inferred."""
    has_text = ["text" in m for m in prompts.metadata]
    has_geneval = ["include" in m for m in prompts.metadata]
    if reward is None:
        if all(has_geneval):
            reward = "geneval"
        elif all(has_text):
            reward = "ocr"
        elif not any(has_text) and not any(has_geneval):
            reward = "general"
        else:
            raise ValueError(
                "some prompts carry OCR or GenEval metadata and some do not; say which prompts "
                "these are with reward: ocr, geneval or general"
            )
    if reward not in ("ocr", "geneval", "general"):
        raise ValueError(f"reward must be 'ocr', 'geneval', 'general' or None, got {reward!r}")
    metadata = []
    for number, (prompt, meta) in enumerate(zip(*prompts, strict=True), start=1):
        where = f"prompt {number} ({prompt!r})"
        if reward != "geneval" and "include" in meta:
            raise ValueError(f"{where} carries GenEval metadata, but its source is for reward {reward!r}")
        if reward == "geneval":
            try:
                check_metadata(meta)
            except ValueError as err:
                raise ValueError(f"{where}: not a GenEval prompt: {err}") from None
        text = meta.get("text", quoted_text(prompt)) if reward == "ocr" else None
        if reward == "ocr" and (not isinstance(text, str) or not text.strip()):
            raise ValueError(f"{where} has no text to render (no quoted text, no metadata 'text')")
        metadata.append({**meta, "source": source, "text": text})
    return PromptSet(list(prompts.prompts), metadata), reward


class PromptPool:
    """Prompts from several :class:`PromptSet` sources, each epoch's draw split by weight.

    Args:
        sets: the sources' prompts (non-empty).
        weights: one per source, positive: source ``j``'s expected share of a draw is
            ``w_j / sum(w)``.
        rewards: per source, the specialist reward its prompts are marked for (``"ocr"``,
            ``"geneval"``, ``"general"``), or None (unmarked: its metadata as loaded).

    Attributes:
        sets, weights, rewards: as given. prompts, metadata: every source's, concatenated (what
            :meth:`draw`'s indices index).

    >>> pool = PromptPool([ocr_prompts(3), geneval_prompts(2)], [1.0, 1.0])
    >>> rows = pool.draw(4, torch.Generator().manual_seed(0))
    >>> sorted("text" in pool.metadata[i] for i in rows.tolist())  # two from each source
    [False, False, True, True]

    Raises:
        ValueError: no source, an empty source, or weights that are not one positive finite
            number per source.
    """

    def __init__(
        self, sets: Sequence[PromptSet], weights: Sequence[float], rewards: Sequence[str | None] | None = None
    ) -> None:
        sets, weights = list(sets), list(weights)
        rewards = [None] * len(sets) if rewards is None else list(rewards)
        if not sets or len(weights) != len(sets) or len(rewards) != len(sets):
            raise ValueError(
                f"a pool needs a source and one weight and reward per source, got {len(sets)} sources, "
                f"weights {weights}, rewards {rewards}"
            )
        for j, (prompts, weight) in enumerate(zip(sets, weights, strict=True)):
            if not prompts.prompts:
                raise ValueError(f"pool source {j} has no prompts")
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < math.inf:
                raise ValueError(f"pool source {j}: weight must be a positive finite number, got {weight!r}")
        self.sets, self.weights, self.rewards = sets, weights, rewards
        self.prompts = [p for s in sets for p in s.prompts]
        self.metadata = [m for s in sets for m in s.metadata]
        self._offsets = [0]
        for s in sets:
            self._offsets.append(self._offsets[-1] + len(s.prompts))

    def counts(self, n: int, generator: torch.Generator) -> list[int]:
        """How many of ``n`` prompts each source gives: ``floor(q_j)`` or ``ceil(q_j)`` with
        ``q_j = n w_j / sum(w)``, summing to ``n``, and ``E[count_j] = q_j`` exactly.

        The ``r = n - sum floor(q_j)`` extra prompts go to distinct sources by systematic sampling
        (one uniform ``u``, points ``u, u + 1, ..., u + r - 1`` over the fractional parts laid end
        to end), so source ``j`` gets one with probability ``q_j - floor(q_j)``. The quotas are
        exact rationals; ``generator`` is used only when some ``q_j`` is not an integer.
        """
        total = sum(Fraction(w) for w in self.weights)
        quotas = [n * Fraction(w) / total for w in self.weights]
        counts = [math.floor(q) for q in quotas]
        extra = n - sum(counts)
        if extra:
            u = Fraction(torch.rand((), generator=generator, dtype=torch.float64).item())
            edge = Fraction(0)
            for j, q in enumerate(quotas):
                start, edge = edge, edge + q - counts[j]
                counts[j] += math.ceil(edge - u) - math.ceil(start - u)  # points u + m in [start, edge)
        return counts

    def draw(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``n`` indices into ``prompts`` (int64): :meth:`counts` from each source, uniform
        with replacement within it, in random order. One source: exactly
        ``torch.randint(len(prompts), (n,), generator=generator)``."""
        parts = [
            torch.randint(len(s.prompts), (count,), generator=generator) + start
            for s, count, start in zip(self.sets, self.counts(n, generator), self._offsets[:-1], strict=True)
        ]
        rows = torch.cat(parts)
        return rows if len(self.sets) == 1 else rows[torch.randperm(n, generator=generator)]


def load_prompt_pool(source: str | os.PathLike[str] | PromptSet | Sequence[PromptSource]) -> PromptPool:
    """The :class:`PromptPool` of ``sampling.prompts``.

    A single source (a :func:`load_prompt_set` string, or a :class:`PromptSet`) is a pool of one,
    its metadata as loaded. A list of :class:`~mogo_diffusion.config.PromptSource` mixes its
    sources by ``weight``; each prompt's metadata then names its ``"source"`` and marks what the
    specialists score: ``"text"`` (OCR's target) only on the prompts of ``reward: ocr`` sources
    (None elsewhere, where OCR is NaN even for a quoted word) and GenEval metadata only on those of
    ``reward: geneval`` sources (elsewhere an error), so ``ocr`` and ``geneval`` are NaN exactly
    outside their own prompts. ``reward`` None infers it from the metadata (GenEval ``.jsonl``,
    ``shapes:`` and ``geneval:N`` are GenEval's; ``ocr:N`` is OCR's; a text file is general).

    Raises:
        FileNotFoundError, ValueError: a source that cannot be read or does not fit its
            ``reward``, naming the entry (``entry 1 ('ocr.txt'): ...``); an empty list.
    """
    if isinstance(source, PromptSet):
        return PromptPool([source], [1.0])
    if isinstance(source, str | os.PathLike):
        return PromptPool([load_prompt_set(source)], [1.0])
    entries = list(source)
    if not entries:
        raise ValueError("a prompt pool needs at least one source")
    marked = []
    for i, entry in enumerate(entries):
        try:
            marked.append(_mark(load_prompt_set(entry.source), entry.source, entry.reward))
        except (OSError, ValueError) as err:
            raise type(err)(f"entry {i} ({entry.source!r}): {err}") from None
    sets, rewards = zip(*marked, strict=True)
    return PromptPool(sets, [entry.weight for entry in entries], rewards)
