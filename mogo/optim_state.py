"""The checkpoint of a :class:`~mogo.HarmonizedOptimizer`, and its check before anything loads.

::

    {"inner": the wrapped optimizer's state_dict,
     "mogo": {"objectives": [the K names],
              "amortizer": AmortizedWeights.state_dict(),
              "grad_mode": "auto" | "batched" | "sequential",
              "meter": ConflictMeter.state_dict(),
              "weighting": the weighting's state_dict,    # a weighting with state of its own only
              "tracker": GradientTracker.state_dict()}}   # with grad_ema > 0 only

:func:`check_state_dict` names every bad field of a state at once, by its dotted name
(``mogo.amortizer.alpha_ema: ...; mogo.meter.extra: unexpected``), so that a checkpoint either
loads whole or changes nothing.
"""

from __future__ import annotations

from typing import Any, get_args

from mogo.amortize import AmortizedWeights
from mogo.diagnostics import ConflictMeter
from mogo.jacobian import GradMode
from mogo.tracking import GradientTracker
from mogo.weighting import Weighting

__all__ = ["check_state_dict", "has_state"]


def has_state(weighting: Weighting) -> bool:
    """Whether a weighting has state of its own to checkpoint (``state_dict``, ``load_state_dict``
    and a ``state_problems`` check, as :class:`mogo.PCGrad`'s generator)."""
    return all(hasattr(weighting, name) for name in ("state_dict", "load_state_dict", "state_problems"))


def check_state_dict(
    state_dict: Any,
    objectives: tuple[str, ...],
    weighting: Weighting,
    tracker: GradientTracker,
    parameters: int,
) -> None:
    """Check a state for an optimizer of ``objectives``, ``weighting`` and ``tracker``, with
    ``parameters`` trainable parameters.

    Raises:
        ValueError: it is not a dict of ``inner`` and ``mogo``, or it has bad fields (all of
            them named).
    """
    if not isinstance(state_dict, dict) or set(state_dict) != {"inner", "mogo"}:
        keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(f"not a HarmonizedOptimizer state_dict: expected keys ['inner', 'mogo'], got {keys}")
    problems = _inner_problems(state_dict["inner"]) + _mogo_problems(
        state_dict["mogo"], objectives, weighting, tracker, parameters
    )
    if problems:
        raise ValueError(f"invalid HarmonizedOptimizer state_dict: {'; '.join(problems)}")


def _inner_problems(inner: Any) -> list[str]:
    """What is wrong with the wrapped optimizer's part, as far as it can be told without it
    (its ``load_state_dict`` checks the parameter groups)."""
    if isinstance(inner, dict) and {"state", "param_groups"} <= set(inner):
        return []
    got = sorted(map(str, inner)) if isinstance(inner, dict) else type(inner).__name__
    return [f"inner: not an optimizer state_dict (keys 'state', 'param_groups'), got {got}"]


def _mogo_problems(
    mine: Any, objectives: tuple[str, ...], weighting: Weighting, tracker: GradientTracker, parameters: int
) -> list[str]:
    """Every bad field of mogo's part, as ``"mogo.field: problem"``."""
    if not isinstance(mine, dict):
        return [f"mogo: must be a dict, got {type(mine).__name__}"]
    fields = (
        "objectives",
        "amortizer",
        "grad_mode",
        "meter",
        *(("weighting",) if has_state(weighting) else ()),
        *(("tracker",) if tracker.tracking else ()),
    )
    problems = [f"{field}: missing" for field in fields if field not in mine]
    problems += [f"{field}: unexpected" for field in sorted(map(str, set(mine) - set(fields)))]
    saved = mine.get("objectives", list(objectives))
    if not isinstance(saved, list | tuple) or tuple(saved) != objectives:
        problems.append(
            f"objectives: state_dict is for objectives {saved!r}, this optimizer has {list(objectives)}"
        )
    if mine.get("grad_mode", "auto") not in get_args(GradMode):
        problems.append(f"grad_mode: must be 'auto', 'batched' or 'sequential', got {mine['grad_mode']!r}")
    if "amortizer" in mine:
        problems += [
            f"amortizer.{p}" for p in AmortizedWeights.state_problems(mine["amortizer"], len(objectives))
        ]
    if "meter" in mine:
        problems += [f"meter.{p}" for p in ConflictMeter.state_problems(mine["meter"])]
    if has_state(weighting) and "weighting" in mine:
        problems += [f"weighting.{p}" for p in weighting.state_problems(mine["weighting"])]
    if tracker.tracking and "tracker" in mine:
        problems += [f"tracker.{p}" for p in GradientTracker.state_problems(mine["tracker"], parameters)]
    return [f"mogo.{problem}" for problem in problems]
