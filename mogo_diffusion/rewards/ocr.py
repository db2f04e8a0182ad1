"""OCR reward: does the image spell the text the prompt quotes? (Flow-GRPO, DiffusionNFT, MARBLE.)

With the target ``t`` and the recognised text ``r`` (every detected text box, joined), both
normalised (lower case, spaces removed)::

    dist  = 0                                 if t is a substring of r
          = min(levenshtein(r, t), len(t))    otherwise
    score = 1 - dist / len(t)                 in [0, 1]

The target is ``metadata["text"]`` when given, else the first quoted span of the prompt: the text
between the first straight double quote ``"`` and the next one (or the end of the prompt, as in
Flow-GRPO), or between typographic quotes ``“ ”``, whichever opens first. Single quotes are not
quotes here (they are apostrophes in ``a dog's "sign"``). The score is NaN (not applicable) for a
prompt with no quoted text, or whose quoted text is only spaces, and where ``metadata["text"]`` is
None (a prompt that asks for no text: a mixed prompt pool marks its non-OCR prompts so).

Recognition runs `RapidOCR <https://github.com/RapidAI/RapidOCR>`_ (``pip install 'mogo[ocr]'``),
whose wheel ships its ONNX models: nothing is downloaded. Flow-GRPO runs PaddleOCR with the angle
classifier off and boxes recognised below confidence 0.5 dropped; RapidOCR is run the same way on
PaddleOCR's PP-OCRv4 models (its recognition model is the Chinese-English one, where PaddleOCR's
``lang="en"`` takes the English one), so scores agree up to the two engines' differences.

>>> levenshtein("kitten", "sitting")
3
>>> quoted_text('a sign that says "Open 24 Hours"')
'Open 24 Hours'
>>> ocr_score("open24hours!", "Open 24 Hours"), ocr_score("opem", "open"), ocr_score("", "open")
(1.0, 0.75, 0.0)
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from mogo._extras import require
from mogo.registry import closest
from mogo_diffusion.rewards.base import check_batch, to_uint8
from mogo_diffusion.rewards.registry import register_reward

__all__ = ["OcrReward", "levenshtein", "normalize_text", "ocr_score", "quoted_text"]

# Opening quote -> closing quote.
QUOTES: dict[str, str] = {'"': '"', "“": "”"}


def levenshtein(a: str, b: str) -> int:
    """The edit distance (insertions, deletions, substitutions, each costing 1) from ``a`` to ``b``."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def normalize_text(text: str) -> str:
    """Lower case, with the spaces (``" "``, as in Flow-GRPO; not tabs or newlines) removed."""
    return text.replace(" ", "").lower()


def quoted_text(prompt: str) -> str | None:
    """The prompt's first quoted span (see the module), or None when it quotes nothing."""
    starts = [(prompt.find(q), q) for q in QUOTES if q in prompt]
    if not starts:
        return None
    start, opening = min(starts)
    end = prompt.find(QUOTES[opening], start + 1)
    return prompt[start + 1 :] if end < 0 else prompt[start + 1 : end]


def ocr_score(recognized: str, target: str) -> float:
    """``1 - dist / len(t)`` of the module, both strings normalised here; ``ValueError`` if ``t`` is empty."""
    r, t = normalize_text(recognized), normalize_text(target)
    if not t:
        raise ValueError(f"the OCR target must have a character other than a space, got {target!r}")
    dist = 0 if t in r else min(levenshtein(r, t), len(t))
    return 1 - dist / len(t)


def _rapidocr_options() -> frozenset[str]:
    """The keyword arguments ``rapidocr_onnxruntime.RapidOCR`` takes, read from its default config
    as it maps them: global keys as they are, the detector's with a ``det_`` prefix, the angle
    classifier's and recogniser's keys that carry their ``cls_`` or ``rec_`` prefix, those it
    strips of one (``model_path``, ``use_cuda``, ``use_dml``, ``label_list``), and the two it reads
    outside the config, ``det_donot_use_dilation`` and ``rec_keys_path``.

    RapidOCR passes an unknown keyword on into a config nobody reads; this list is what lets
    :class:`OcrReward` refuse one. ``ImportError`` without RapidOCR."""
    import yaml
    from rapidocr_onnxruntime import main  # the one place that reads RapidOCR's layout

    config = yaml.safe_load(Path(main.DEFAULT_CFG_PATH).read_text())
    names = {*config["Global"], "det_donot_use_dilation", "rec_keys_path"}
    names |= {f"det_{key}" for key in config["Det"]}
    for section, prefix in (("Cls", "cls_"), ("Rec", "rec_")):
        stripped = {"model_path", "use_cuda", "use_dml", "label_list"} & set(config[section])
        names |= {key for key in config[section] if key.startswith(prefix)} | {prefix + k for k in stripped}
    return frozenset(names)


@register_reward("ocr")
class OcrReward:
    """How well each image spells its prompt's quoted text, in ``[0, 1]``; NaN without one.

    Args:
        min_size: upscale an image whose shorter side is below ``min_size`` pixels (bicubic, aspect
            kept) so that it is ``min_size``; 0 (the default) never resizes. RapidOCR already
            enlarges its detector's input to 736 pixels on the shorter side, but reads each text
            box at the image's own resolution: upscaling can help very small images (32 to 64
            px). Clean renders of 8 to 12 px text on 32 to 64 px images read correctly without it.
        options: keyword arguments for ``rapidocr_onnxruntime.RapidOCR``, over the defaults
            ``{"use_cls": False}`` (no angle classifier, as in Flow-GRPO); e.g. ``text_score`` (drop
            boxes recognised below this confidence, 0.5), ``det_limit_side_len`` (736; a smaller
            side is faster on small images) or ``intra_op_num_threads``.

    Raises:
        ImportError: RapidOCR is not installed.
        ValueError: ``options`` names an option RapidOCR does not have (it would ignore it).

    Calls are serialised by a lock, so one instance may be shared by threads; an image takes
    0.1 to 1 s on one CPU core. Prompts without a target are not read at all.
    """

    name = "ocr"

    def __init__(self, *, min_size: int = 0, options: Mapping[str, Any] | None = None) -> None:
        if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
            raise ValueError(f"min_size must be a non-negative integer, got {min_size!r}")
        require("the 'ocr' reward", "ocr")
        from rapidocr_onnxruntime import RapidOCR

        self.min_size = min_size
        self.options = {"use_cls": False, **(options or {})}
        known = _rapidocr_options()
        for option in self.options:
            if option not in known:
                hint = closest(option, known)
                raise ValueError(
                    f"options: RapidOCR has no option {option!r}{hint}; it has {', '.join(sorted(known))}"
                )
        self.engine = RapidOCR(**self.options)
        self._lock = threading.Lock()

    def target(self, prompt: str, metadata: Mapping[str, Any]) -> str | None:
        """The text sample's image should show, or None when there is none (see the module)."""
        if "text" in metadata:
            text = metadata["text"]
            if text is None:
                return None
            if not isinstance(text, str) or not normalize_text(text):
                raise ValueError(
                    f"metadata['text'] must be a string with a non-space character, got {text!r}"
                )
            return text
        text = quoted_text(prompt)
        return text if text is not None and normalize_text(text) else None

    def recognize(self, pixels: np.ndarray) -> str:
        """The text read in one ``[H, W, 3]`` uint8 RGB image: every box's text, joined in reading order."""
        height, width = pixels.shape[:2]
        if 0 < min(height, width) < self.min_size:
            scale = self.min_size / min(height, width)
            size = (max(self.min_size, round(width * scale)), max(self.min_size, round(height * scale)))
            pixels = np.asarray(Image.fromarray(pixels).resize(size, Image.Resampling.BICUBIC))
        bgr = np.ascontiguousarray(pixels[:, :, ::-1])  # RapidOCR takes arrays as OpenCV's BGR
        with self._lock:
            boxes, _ = self.engine(bgr)
        return "".join(str(box[1]) for box in boxes or ())

    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> Tensor:
        check_batch(images, prompts, metadata)
        targets = [self.target(p, m) for p, m in zip(prompts, metadata, strict=True)]
        scores = [math.nan] * len(targets)
        wanted = [i for i, t in enumerate(targets) if t is not None]
        if wanted:
            pixels = to_uint8(images[wanted])
            for i, image in zip(wanted, pixels, strict=True):
                scores[i] = ocr_score(self.recognize(image), targets[i])
        return torch.tensor(scores, dtype=torch.float32)
