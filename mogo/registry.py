"""Weightings by name, for configs and command lines: ``make_weighting("min_norm", normalize="l2")``.

Every :class:`~mogo.Weighting` that mogo ships is registered here under a lower-case name;
:func:`register_weighting` adds one of your own, which then reaches every tool that chooses a
weighting by name (``mogo_diffusion``'s ``strategy.name``, for one) without editing it.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from mogo.aligned_mtl import AlignedMTL
from mogo.cagrad import CAGrad
from mogo.imtl_g import IMTLG
from mogo.nash_mtl import NashMTL
from mogo.pcgrad import PCGrad
from mogo.upgrad import UPGrad
from mogo.weighting import MinNorm, WeightedSum, Weighting

__all__ = ["WEIGHTINGS", "make_weighting", "register_weighting"]


def mgda(**options: Any) -> MinNorm:
    """Plain MGDA: ``MinNorm(normalize="none", **options)``, the min-norm point of the raw gradients."""
    return MinNorm(normalize="none", **options)


WEIGHTINGS: dict[str, Callable[..., Weighting]] = {
    "min_norm": MinNorm,
    "weighted_sum": WeightedSum,
    "mgda": mgda,
    "upgrad": UPGrad,
    "cagrad": CAGrad,
    "nash_mtl": NashMTL,
    "imtl_g": IMTLG,
    "aligned_mtl": AlignedMTL,
    "pcgrad": PCGrad,
}
"""Name to factory: the factory is called with the weighting's options as keyword arguments."""


def register_weighting(name: str, factory: Callable[..., Weighting]) -> None:
    """Register ``factory`` under ``name`` (lower case, letters, digits and ``_``).

    Raises:
        ValueError: the name is malformed or already taken.
    """
    if not (name.isidentifier() and name == name.lower()):
        raise ValueError(f"a weighting name must be a lower-case identifier, got {name!r}")
    if name in WEIGHTINGS:
        raise ValueError(f"a weighting named {name!r} is already registered: {WEIGHTINGS[name]!r}")
    WEIGHTINGS[name] = factory


def make_weighting(name: str, **options: Any) -> Weighting:
    """The weighting registered as ``name``, built with ``options``.

    Raises:
        ValueError: no weighting of that name (the message lists the closest names), or the
            factory rejects the options.

    Example:
        >>> import mogo
        >>> mogo.make_weighting("min_norm", normalize="none")
        MinNorm(normalize='none', method='auto', scale='unit')
    """
    if name not in WEIGHTINGS:
        close = difflib.get_close_matches(name, WEIGHTINGS, n=3)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"unknown weighting {name!r}{hint} (known: {', '.join(sorted(WEIGHTINGS))})")
    try:
        return WEIGHTINGS[name](**options)
    except TypeError as error:
        raise ValueError(f"weighting {name!r}: {error}") from None
