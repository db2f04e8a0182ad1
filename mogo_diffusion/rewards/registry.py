"""Rewards by name: ``@register_reward("name")`` on a factory, ``make_reward("name", **options)``.

>>> make_reward("jpeg_compressibility", quality=90).name
'jpeg_compressibility'
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any, TypeVar

from mogo_diffusion.rewards.base import Reward

__all__ = ["available_rewards", "make_reward", "register_reward", "reward_factory"]

F = TypeVar("F", bound=Callable[..., Reward])

_REGISTRY: dict[str, Callable[..., Reward]] = {}


def register_reward(name: str) -> Callable[[F], F]:
    """Register a factory (a class or function returning a :class:`Reward`) under ``name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a reward name must be a non-empty string, got {name!r}")

    def decorate(factory: F) -> F:
        if name in _REGISTRY:
            raise ValueError(f"reward {name!r} is already registered (by {_REGISTRY[name]!r})")
        _REGISTRY[name] = factory
        return factory

    return decorate


def available_rewards() -> tuple[str, ...]:
    """The registered names, sorted."""
    return tuple(sorted(_REGISTRY))


def reward_factory(name: str) -> Callable[..., Reward]:
    """The factory registered under ``name``; ``ValueError`` listing the known names otherwise."""
    if name not in _REGISTRY:
        close = difflib.get_close_matches(str(name), _REGISTRY, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown reward {name!r}{hint}. Known rewards: {', '.join(available_rewards())}")
    return _REGISTRY[name]


def make_reward(name: str, **options: Any) -> Reward:
    """Build the reward registered under ``name`` with its ``options``."""
    return reward_factory(name)(**options)
