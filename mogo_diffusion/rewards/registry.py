"""Rewards by name: ``@register_reward("name")`` on a factory, ``make_reward("name", **options)``.

:data:`REWARDS` is a :class:`mogo.Registry`, the class that holds mogo's weightings; the
functions below are its methods under the names this package has always had.

>>> make_reward("jpeg_compressibility", quality=90).name
'jpeg_compressibility'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from mogo.registry import Registry
from mogo_diffusion.rewards.base import Reward

__all__ = ["REWARDS", "available_rewards", "make_reward", "register_reward", "reward_factory"]

F = TypeVar("F", bound=Callable[..., Reward])

REWARDS = Registry("reward")
"""Every registered reward: name (a lower-case identifier) to factory."""


def register_reward(name: str) -> Callable[[F], F]:
    """A decorator that registers a factory (a class or function returning a :class:`Reward`)
    under ``name``; ``ValueError`` for a name that is not a lower-case identifier or is taken."""
    return REWARDS.register(name)


def available_rewards() -> tuple[str, ...]:
    """The registered names, sorted."""
    return REWARDS.names()


def reward_factory(name: str) -> Callable[..., Reward]:
    """The factory registered under ``name``; ``ValueError`` suggesting the closest name and
    listing the known ones otherwise."""
    return REWARDS.factory(name)


def make_reward(name: str, **options: Any) -> Reward:
    """Build the reward registered under ``name`` with its ``options``; ``ValueError`` for an
    unknown name, the factory's own ``TypeError`` for an option it does not take."""
    return REWARDS.make(name, **options)
