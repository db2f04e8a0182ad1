"""Factories by name, for configs and command lines: ``make_weighting("min_norm", normalize="l2")``.

A :class:`Registry` maps lower-case names to factories and builds one by name; an unknown name
raises an error that suggests the closest known one (:func:`closest`, the one "did you mean"
of mogo and ``mogo_diffusion``). :data:`WEIGHTINGS` registers every :class:`~mogo.Weighting`
that mogo ships; :func:`register_weighting` adds one of your own, which then reaches every tool
that chooses a weighting by name (``mogo_diffusion``'s ``strategy.name``, for one) without
editing it. ``mogo_diffusion``'s rewards are a :class:`Registry` too.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from mogo.aligned_mtl import AlignedMTL
from mogo.cagrad import CAGrad
from mogo.gated import GatedProjection
from mogo.imtl_g import IMTLG
from mogo.modo import MoDo
from mogo.nash_mtl import NashMTL
from mogo.pcgrad import PCGrad
from mogo.sdmgrad import SDMGrad
from mogo.upgrad import UPGrad
from mogo.weighting import MinNorm, WeightedSum, Weighting

__all__ = ["WEIGHTINGS", "Registry", "closest", "make_weighting", "register_weighting"]


def closest(word: object, choices: Iterable[str]) -> str:
    """The hint ``" (did you mean 'choice'?)"`` naming the choice closest to ``word``, or ``""``
    when none is close (``difflib``'s similarity ratio below 0.6). ``word`` may be any value: a
    bad config entry is shown as its ``str``.

    >>> "unknown key" + closest("lrr", ["lr", "seed"])
    "unknown key (did you mean 'lr'?)"
    >>> closest("zzz", ["lr", "seed"])
    ''
    """
    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


class Registry(Mapping[str, Callable[..., Any]]):
    """Factories by name: register them, then build one by name with its options.

    A read-only mapping of name to factory (``name in registry``, ``registry[name]``, iteration
    in the order of registration); names are lower-case identifiers, so that they read the same
    in a YAML file and on a command line.

    Args:
        kind: what the factories build, as the errors name it (``"weighting"``, ``"reward"``).
        factories: name to factory, registered in their order.

    Example:
        >>> shapes = Registry("shape", {"square": lambda side=1.0: side**2})
        >>> @shapes.register("circle")
        ... def circle(radius: float = 1.0) -> float:
        ...     return 3.14159 * radius**2
        >>> shapes.names(), shapes.make("square", side=3.0)
        (('circle', 'square'), 9.0)
        >>> shapes.make("cirle")
        Traceback (most recent call last):
            ...
        ValueError: unknown shape 'cirle' (did you mean 'circle'?). Known shapes: circle, square
    """

    def __init__(self, kind: str, factories: Mapping[str, Callable[..., Any]] | None = None) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., Any]] = {}
        for name, factory in (factories or {}).items():
            self.register(name, factory)

    def register(self, name: str, factory: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """Register ``factory`` (a class or a function) under ``name``, and return it; without a
        factory, a decorator that registers the class or function it decorates.

        Raises:
            ValueError: ``name`` is not a lower-case identifier, or is already registered (when
                the factory is registered: at once, or when the decorator is applied).
        """
        if not (isinstance(name, str) and name.isidentifier() and name == name.lower()):
            raise ValueError(
                f"a {self.kind} name must be a non-empty string of lower-case letters, digits and '_' "
                f"(an identifier), got {name!r}"
            )
        if factory is None:
            return lambda factory: self.register(name, factory)
        if name in self._factories:
            raise ValueError(f"{self.kind} {name!r} is already registered (by {self._factories[name]!r})")
        self._factories[name] = factory
        return factory

    def factory(self, name: str) -> Callable[..., Any]:
        """The factory registered under ``name``.

        Raises:
            ValueError: no factory has that name; the message suggests the closest name and
                lists the known ones.
        """
        if name not in self._factories:
            raise ValueError(
                f"unknown {self.kind} {name!r}{closest(name, self._factories)}. "
                f"Known {self.kind}s: {', '.join(self.names())}"
            )
        return self._factories[name]

    def make(self, name: str, **options: Any) -> Any:
        """Build what is registered under ``name``, with ``options`` as keyword arguments.

        Raises:
            ValueError: no factory has that name (as :meth:`factory`). What the factory raises
                passes as it is (a ``TypeError`` for an option it does not take).
        """
        return self.factory(name)(**options)

    def names(self) -> tuple[str, ...]:
        """The registered names, sorted."""
        return tuple(sorted(self._factories))

    def pop(self, name: str) -> Callable[..., Any]:
        """Remove the factory registered under ``name`` and return it (``ValueError`` as
        :meth:`factory` when there is none)."""
        factory = self.factory(name)
        del self._factories[name]
        return factory

    def copy(self) -> Registry:
        """A registry of the same kind with the same factories, which registers apart from this one."""
        return Registry(self.kind, self._factories)

    def __getitem__(self, name: str) -> Callable[..., Any]:
        return self._factories[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._factories)

    def __len__(self) -> int:
        return len(self._factories)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={list(self.names())})"


def mgda(**options: Any) -> MinNorm:
    """Plain MGDA: ``MinNorm(normalize="none", **options)``, the min-norm point of the raw gradients."""
    return MinNorm(normalize="none", **options)


WEIGHTINGS = Registry(
    "weighting",
    {
        "min_norm": MinNorm,
        "weighted_sum": WeightedSum,
        "mgda": mgda,
        "upgrad": UPGrad,
        "cagrad": CAGrad,
        "nash_mtl": NashMTL,
        "imtl_g": IMTLG,
        "aligned_mtl": AlignedMTL,
        "pcgrad": PCGrad,
        "modo": MoDo,
        "sdmgrad": SDMGrad,
        "gated_projection": GatedProjection,
    },
)
"""Every registered weighting: the factory is called with the weighting's options as keyword arguments."""


def register_weighting(name: str, factory: Callable[..., Weighting]) -> None:
    """Register ``factory`` under ``name`` (lower case, letters, digits and ``_``):
    :meth:`mogo.WEIGHTINGS.register <mogo.Registry.register>`.

    Raises:
        ValueError: the name is malformed or already taken.
    """
    WEIGHTINGS.register(name, factory)


def make_weighting(name: str, **options: Any) -> Weighting:
    """The weighting registered as ``name``, built with ``options``:
    :meth:`mogo.WEIGHTINGS.make <mogo.Registry.make>`.

    Raises:
        ValueError: no weighting of that name (the message suggests the closest name), or the
            factory rejects the options (its ``TypeError``, naming the weighting).

    Example:
        >>> import mogo
        >>> mogo.make_weighting("min_norm", normalize="none")
        MinNorm(normalize='none', method='auto', scale='unit')
    """
    try:
        return WEIGHTINGS.make(name, **options)
    except TypeError as error:
        raise ValueError(f"weighting {name!r}: {error}") from None
