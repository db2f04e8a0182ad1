"""The tiny run of ``test_train`` with another strategy and reward weights, for the strategy tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mogo_diffusion.config import Config
from tests.diffusion.test_train import config


def with_strategy(tiny_dir: Path, out: Path, weights: Sequence[float] | None = None, **strategy) -> Config:
    """``test_train``'s tiny config writing to ``out``, with ``strategy`` as its strategy record
    and ``weights`` (one per reward) as the rewards' weights, when given."""
    data = config(tiny_dir, out).to_dict()
    data["strategy"] = strategy
    for spec, weight in zip(
        data["rewards"], weights or [spec["weight"] for spec in data["rewards"]], strict=True
    ):
        spec["weight"] = weight
    return Config.from_dict(data)
