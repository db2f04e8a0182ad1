"""Independent random streams from one seed: one ``numpy.random.SeedSequence`` per (purpose, index).

A run draws from several streams (the adapter's initialisation, each epoch's sampling, each
epoch's training draws). Seeding them by arithmetic on the seed (``seed + 1``,
``seed * M + epoch``) makes different streams collide: the one of (epoch e, training) was the one
of (epoch e + 1, sampling). Here each stream is the child of ``SeedSequence(seed)`` with spawn
key ``(purpose, *index)``, the purpose a name; SeedSequence hashes the entropy and the key
together, so distinct keys give statistically independent streams for any seeds.

>>> a = generator(0, "sampling", 1).initial_seed()
>>> b = generator(0, "training", 0).initial_seed()
>>> a != b and a == generator(0, "sampling", 1).initial_seed()
True
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["generator", "stream_seed"]


def stream_seed(seed: int, purpose: str, *index: int) -> int:
    """A 64-bit seed for the stream ``(purpose, *index)`` of ``seed``.

    Args:
        seed: the run's seed, a non-negative integer.
        purpose: what the stream is for (``"sampling"``, ``"training"``, ...).
        index: non-negative integers that tell streams of one purpose apart (e.g. the epoch).

    Raises:
        ValueError: a negative seed or index.
    """
    if seed < 0 or any(i < 0 for i in index):
        raise ValueError(f"seed and indices must be non-negative, got seed {seed}, index {index}")
    key = (int.from_bytes(purpose.encode(), "little"), *index)
    (state,) = np.random.SeedSequence(seed, spawn_key=key).generate_state(1, dtype=np.uint64)
    return int(state)


def generator(seed: int, purpose: str, *index: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with :func:`stream_seed`."""
    return torch.Generator().manual_seed(stream_seed(seed, purpose, *index))
