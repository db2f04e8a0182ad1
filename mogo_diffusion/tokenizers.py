"""Small tokenizers built in memory, for tiny offline SD3 pipelines.

No tokenizer file is downloaded: both are built from a corpus in milliseconds, deterministically
(the same corpus gives the same vocabulary in every process), and ``save_pretrained`` like any
other tokenizer.

* :func:`clip_tokenizer`: a byte-level BPE ``CLIPTokenizer``. Its vocabulary holds the 256 byte
  symbols and their 256 end-of-word variants ``c</w>``, then the merges learned from the corpus,
  then ``<|startoftext|>`` and ``<|endoftext|>`` (the highest id, as CLIP's pooling expects). Every
  text, whatever its punctuation, digits or script, is covered by the byte symbols: it never
  yields the unknown token. Merges are learned by :func:`train_bpe`, whose ties are broken by the
  pair itself rather than by hash order (``tokenizers``' own trainer is not deterministic across
  processes and maps unseen punctuation and digits to ``<unk>``).
* :func:`t5_tokenizer`: a unigram ``T5Tokenizer`` whose pieces are the corpus words (scored by
  log frequency) and every printable ASCII character, so ASCII text never yields ``<unk>``; other
  characters do (T5's tokenizer has no byte fallback).
"""

from __future__ import annotations

import itertools
import math
import string
from collections import Counter
from collections.abc import Iterable

from tokenizers import pre_tokenizers
from transformers import CLIPTokenizer, T5Tokenizer

__all__ = ["DEFAULT_CORPUS", "clip_tokenizer", "t5_tokenizer", "train_bpe"]

_END = "</w>"
_BOS, _EOS = "<|startoftext|>", "<|endoftext|>"

DEFAULT_CORPUS: tuple[str, ...] = (
    "a photo of a red circle on a white background",
    "a green square on a black background",
    "a blue triangle on a yellow background",
    "an orange star next to a purple heart",
    "two small pink circles and one large cyan square",
    "three grey triangles above a brown line",
    "a sign that says hello world",
    'a poster with the text "open 24 hours"',
    "the number 0 1 2 3 4 5 6 7 8 9",
    "a cat, a dog and a bird in the left, right, top or bottom corner",
    "high quality, detailed, sharp, colourful image!",
)


def _byte_symbols() -> list[str]:
    """The 256 byte-level symbols of GPT-2/CLIP BPE, in code-point order."""
    return sorted(pre_tokenizers.ByteLevel.alphabet())


def _words(corpus: Iterable[str]) -> Counter[str]:
    """Corpus words as CLIP's tokenizer splits them (NFC, lower case, byte-level symbols)."""
    backend = CLIPTokenizer(vocab={_BOS: 0, _EOS: 1}, merges=[]).backend_tokenizer
    counts: Counter[str] = Counter()
    for text in corpus:
        normalized = backend.normalizer.normalize_str(text)
        counts.update(word for word, _ in backend.pre_tokenizer.pre_tokenize_str(normalized))
    return counts


def train_bpe(corpus: Iterable[str], num_merges: int, min_frequency: int = 2) -> list[tuple[str, str]]:
    """Learn byte-level BPE merges for :class:`~transformers.CLIPTokenizer`, deterministically.

    Each corpus word is a sequence of byte symbols, the last carrying the ``</w>`` suffix. Each
    round merges the adjacent pair with the highest frequency (words weighted by their counts);
    ties go to the lexicographically smallest pair. Training stops after ``num_merges`` merges or
    when no pair occurs ``min_frequency`` times.

    Returns:
        The merges ``(left, right)`` in the order learned.
    """
    if num_merges < 0:
        raise ValueError(f"num_merges must be >= 0, got {num_merges}")
    words = {(*word[:-1], word[-1] + _END): count for word, count in _words(corpus).items()}
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for symbols, count in words.items():
            for pair in itertools.pairwise(symbols):
                pairs[pair] += count
        if not pairs:
            break
        best, frequency = min(pairs.items(), key=lambda item: (-item[1], item[0]))
        if frequency < min_frequency:
            break
        merges.append(best)
        words = {_merge(symbols, best): count for symbols, count in words.items()}
    return merges


def _merge(symbols: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    merged: list[str] = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            merged.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            merged.append(symbols[i])
            i += 1
    return tuple(merged)


def clip_tokenizer(
    corpus: Iterable[str] = DEFAULT_CORPUS, num_merges: int = 256, model_max_length: int = 77
) -> CLIPTokenizer:
    """A byte-level BPE CLIP tokenizer learned from ``corpus`` (see the module docstring).

    Args:
        corpus: texts to learn merges from.
        num_merges: at most this many merges (fewer if the corpus runs out of repeated pairs).
        model_max_length: tokens per text, ``<|startoftext|>`` and ``<|endoftext|>`` included; the
            SD3 pipeline pads and truncates CLIP inputs to it.

    Returns:
        A tokenizer of ``512 + len(merges) + 2`` tokens; ``eos_token_id`` is the largest id.
    """
    if model_max_length < 2:
        raise ValueError(f"model_max_length must be >= 2 (start and end tokens), got {model_max_length}")
    merges = train_bpe(corpus, num_merges)
    symbols = _byte_symbols()
    tokens = symbols + [s + _END for s in symbols] + [left + right for left, right in merges]
    vocab: dict[str, int] = {}
    for token in [*tokens, _BOS, _EOS]:
        vocab.setdefault(token, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def t5_tokenizer(corpus: Iterable[str] = DEFAULT_CORPUS, model_max_length: int = 256) -> T5Tokenizer:
    """A unigram T5 tokenizer whose pieces are the words of ``corpus`` and the printable ASCII characters.

    Ids: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, then ``▁`` and the words ``▁word`` (score
    ``log(count / total)``, most frequent first, ties by spelling), then one piece per printable
    ASCII character (score -20, so whole words win). No sentinel tokens.

    Args:
        corpus: texts whose whitespace-separated words become pieces.
        model_max_length: the tokenizer's ``model_max_length`` (SD3's T5 length is passed separately
            as ``max_sequence_length``; :func:`mogo_diffusion.models.encode_prompts` defaults to this).
    """
    counts = Counter(word for text in corpus for word in text.split())
    total = sum(counts.values())
    words = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [("▁" + word, math.log(count / total)) for word, count in words]
    seen = {piece for piece, _ in vocab}
    vocab += [(c, -20.0) for c in string.printable if not c.isspace() and c not in seen]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=model_max_length)
