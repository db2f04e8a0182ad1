"""Several rewards scored into one ``[B, K]`` matrix, in a fixed order, with per-reward timing."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch
from torch import Tensor

from mogo_diffusion.rewards.base import Reward, check_batch, check_scores

__all__ = ["MultiReward", "RewardScores"]


class RewardScores(NamedTuple):
    """The scores of one batch.

    Attributes:
        values: ``[B, K]`` float32 on the CPU, NaN where a reward does not apply.
        names: the K reward names, in column order.
        seconds: the K rewards' wall-clock times for this batch, each including the copy of its
            scores to the CPU (which waits for a GPU reward to finish).
    """

    values: Tensor
    names: tuple[str, ...]
    seconds: tuple[float, ...]


class MultiReward:
    """Score a batch with K rewards.

    Args:
        rewards: the rewards, in column order; their names must be distinct.
        threads: how many rewards run at once in a thread pool (1: one after another in the
            calling thread). Threads help rewards that release the GIL (torch ops, ONNX, PIL).

    >>> from mogo_diffusion.rewards import make_reward
    >>> multi = MultiReward([make_reward("sharpness"), make_reward("color_match")])
    >>> scores = multi(torch.zeros(2, 3, 8, 8), ["a red square", "a square"])
    >>> scores.names, scores.values.shape, scores.values[1, 1].isnan().item()
    (('sharpness', 'color_match'), torch.Size([2, 2]), True)
    """

    def __init__(self, rewards: Sequence[Reward], *, threads: int = 1) -> None:
        rewards = list(rewards)
        if not rewards:
            raise ValueError("MultiReward needs at least one reward")
        for i, reward in enumerate(rewards):
            if not isinstance(reward, Reward):
                raise TypeError(f"rewards[{i}] is not a Reward (a callable with a name): {reward!r}")
        names = tuple(reward.name for reward in rewards)
        if len(set(names)) != len(names):
            raise ValueError(f"reward names must be distinct, got {list(names)}")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        self.rewards = rewards
        self.names = names
        self.threads = threads

    def to(self, device: torch.device | str) -> MultiReward:
        """Move every reward that has a ``to`` method; returns ``self``."""
        for reward in self.rewards:
            if hasattr(reward, "to"):
                reward.to(device)
        return self

    def __call__(
        self,
        images: Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> RewardScores:
        """Score ``images`` (``[B, 3, H, W]`` in ``[0, 1]``); ``metadata`` defaults to empty dicts."""
        metadata = [{} for _ in prompts] if metadata is None else metadata
        check_batch(images, prompts, metadata)

        def score(reward: Reward) -> tuple[Tensor, float]:
            start = time.perf_counter()
            values = check_scores(reward.name, reward(images, prompts, metadata), images.shape[0])
            values = values.detach().to(device="cpu", dtype=torch.float32)
            return values, time.perf_counter() - start

        if self.threads == 1:
            results = [score(reward) for reward in self.rewards]
        else:
            with ThreadPoolExecutor(max_workers=min(self.threads, len(self.rewards))) as pool:
                results = list(pool.map(score, self.rewards))
        values = torch.stack([r[0] for r in results], dim=1)
        return RewardScores(values, self.names, tuple(r[1] for r in results))

    def diagnostics(self, images: Tensor) -> dict[str, float]:
        """Batch-level numbers of the rewards that define ``diagnostics(images) -> dict`` (e.g. the
        shapes world's ``distinct_scenes``), each kind of reward asked once."""
        found: dict[str, float] = {}
        asked: set[type] = set()
        for reward in self.rewards:
            if hasattr(reward, "diagnostics") and type(reward) not in asked:
                asked.add(type(reward))
                found.update(reward.diagnostics(images))
        return found
