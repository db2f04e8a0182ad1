"""Which way of combining rewards works on a model: ``python -m mogo_diffusion.compare``.

Before a long run on your own model and rewards, train every way of combining them (an *arm*) on
a small budget with a few seeds, and judge them paired by seed against the weighted sum and the
front it traces:

.. code-block:: bash

    python -m mogo_diffusion.compare --config my_run.yaml --arms weighted_sum,marble --front \\
        --specialists all --seeds 3 --epochs 40 --out runs/my_compare

The base config (``--config``, any config ``python -m mogo_diffusion.train`` takes, ``--set``
overrides on top; default: the shapes world on all its rewards, :func:`default_base`) is what
every arm starts from. An arm is a named partial config over it (:data:`ARMS`; more in a YAML
file, ``--arm-file``, mapping names to partial configs):

.. code-block:: text

    base                   the pretrained model (evaluated, not trained)
    single:<reward>        the specialist of one reward (--specialists all: one per reward)
    weighted_sum           one advantage of sum_k w_k R_k, the base config's weights
    weighted_sum@w1,..,wK  the same at the weights w (--front: the K + 1 weight vectors
                           (1, .., 1) and each reward's weight doubled, the weighted-sum front)
    weighted_sum_z         one advantage of sum_k z(R_k) (each reward z-scored over the batch)
    sequential             one reward at a time, stages cycling twice through the rewards
    marble                 MARBLE as the base config sets it (else at its defaults: alpha
                           re-solved every 10 steps, EMA 0.9 in between)
    marble_n1              MARBLE, alpha solved at every step
    marble_n10             MARBLE amortized: every 10 steps, EMA 0.9, estimated on the first
                           trained timestep of each step's window (the study's arm)
    marble_n10_window      the same, alpha estimated on the whole window (K gradient buffers)
    upgrad_n10, cagrad_n10 UPGrad and CAGrad (mogo.WEIGHTINGS) amortized as marble_n10; any
                           registered weighting runs as the arm <name>_n10
    ablations              marble_n10_neutral, marble_n10_noema, mgda_n10 (ABLATIONS)
    normalize_then_sum     GDPO / TRL's normalize_then_sum (one advantage, each reward normalised
                           in its group first); _rescaled: a masked reward by its share
    famo                   the weighted sum, weights moved by the rewards' improvement rates
    marble_released        MARBLE as its released code trains; _equal_alpha: its ablation
    marble_n10_cross       marble_n10 on the cross-fitted Gram of each micro-batch's halves
    marble_n1_moco         MARBLE every step on an EMA (0.9) of each reward's gradient (MoCo)
    marble_n1_smooth       MARBLE every step applying the EMA (0.9) of alpha (CR-MOGM)
    gated_n1_cross         the weighted sum, projected where the halves show a conflict
    sdmgrad_n1_cross       SDMGrad every step on the cross-fitted Gram

Every arm trains ``--epochs`` epochs (the base's by default) with the same seeds, evaluated
:data:`EVALUATIONS` times; each run is a ``python -m mogo_diffusion.train --config`` subprocess
(``--jobs`` at a time, one thread each) in ``OUT/runs/<arm>/seed<s>`` (:func:`run_all`). A
finished run of the same config is reused and an unfinished one resumed from its latest
checkpoint (or restarted, without one), so an interrupted comparison continues where it
stopped; a run of another config is refused, never deleted, and nothing is trained; a line says
what is done with each run (:func:`decide`). ``--final PROMPTS`` judges each run by one more
evaluation of its last weights on those prompts (:data:`FINAL_EVAL` in the run), else by its last
evaluation during training.

The judgement (:func:`~mogo_diffusion.analysis.summarize`, :func:`~mogo_diffusion.analysis.judge`),
each number paired by seed against ``--reference`` (the weighted sum) with its 95 % bootstrap
interval: per reward the held-out mean and the gain over the pretrained model in units of that
reward's specialist, their mean and worst over the rewards, how often a point of the weighted-sum
front dominates the arm, the hypervolume over the pretrained model's point and what the arm adds
to the front's, and the composite (mean z-score). ``OUT`` gets ``results.md``/``.rst``/``.json``
(the means, the costs: epoch times, throughput, conflict statistics), ``judged.md``/``.rst``,
the figures ``front.png`` (every arm on the front), ``composite.png`` (the judged differences with
their intervals), ``curves.png`` (the held-out means against images and CPU minutes, ``--curves``)
and ``alpha.png`` (the harmonized arms' weights), and ``runs.json.xz``: every finished run in
compact form (:func:`~mogo_diffusion.run_dir.compact`), from which ``--no-train`` remakes every
table and figure once the run directories are gone: commit ``OUT`` without ``runs/``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from tqdm.auto import tqdm

import mogo
from mogo_diffusion import analysis, run_dir, tables
from mogo_diffusion.bootstrap import bootstrap_interval
from mogo_diffusion.checkpoint import CheckpointError, latest_checkpoint
from mogo_diffusion.config import Config, ConfigError, load_config
from mogo_diffusion.evaluate import prompts_digest
from mogo_diffusion.prompts import load_prompt_set
from mogo_diffusion.run_dir import RunDirError
from mogo_diffusion.shapes.recipe import REWARDS, reward_specs, shapes_config

__all__ = [
    "ABLATIONS",
    "ARMS",
    "EPOCHS",
    "EVALUATIONS",
    "FINAL_EVAL",
    "QUICK",
    "RUNS_FILE",
    "WEIGHTING_ARMS",
    "Decision",
    "Gathered",
    "RunResults",
    "add_run_arguments",
    "arm_config",
    "arm_overrides",
    "arms",
    "base_evaluation",
    "choose_arms",
    "command_line",
    "costs",
    "decide",
    "default_base",
    "done",
    "evaluate_base",
    "final_means",
    "front_arms",
    "front_of",
    "front_points",
    "frozen_sections",
    "gather",
    "judged_on",
    "last_evaluation",
    "main",
    "plan",
    "report",
    "run_all",
    "run_directory",
]

# ---- the arms -------------------------------------------------------------------------------------

_AMORTIZED = {"harmonize_every": 10, "alpha_ema": 0.9}
"""The paper's amortization: alpha re-solved every 10 steps, its EMA (0.9) reused in between."""

_EVERY_STEP = {"harmonize_every": 1, "alpha_ema": 0.0}
"""Weights solved at every step and applied as they are."""

ARMS: dict[str, dict[str, Any]] = {
    "weighted_sum": {"strategy": {"name": "weighted_sum", "reward_scale": "raw"}},
    "weighted_sum_z": {"strategy": {"name": "weighted_sum", "reward_scale": "zscore"}},
    "marble": {"strategy": {"name": "marble"}},
    "marble_n1": {"strategy": {"name": "marble", "harmonize_every": 1, "alpha_ema": 0.0}},
    "marble_n10": {"strategy": {"name": "marble", **_AMORTIZED, "estimate": "first"}},
    "marble_n10_window": {"strategy": {"name": "marble", **_AMORTIZED, "estimate": "window"}},
    "marble_n10_neutral": {
        "strategy": {"name": "marble", **_AMORTIZED, "estimate": "first"},
        "nft": {"nonapplicable": "neutral"},
    },
    "marble_n10_noema": {"strategy": {"name": "marble", "harmonize_every": 10, "alpha_ema": 0.0}},
    # the field's other ways (docs/methods.rst), run by name with --arms
    "normalize_then_sum": {"strategy": {"name": "normalize_then_sum"}},
    "normalize_then_sum_rescaled": {"strategy": {"name": "normalize_then_sum", "rescale_masked": True}},
    "famo": {"strategy": {"name": "famo"}},
    "marble_released": {"strategy": {"name": "marble_released"}},
    "marble_released_equal_alpha": {"strategy": {"name": "marble_released", "alpha": "equal"}},
    "marble_n10_cross": {"strategy": {"name": "marble", **_AMORTIZED, "gram": "cross_fitted"}},
    "marble_n1_moco": {"strategy": {"name": "marble", **_EVERY_STEP, "grad_ema": 0.9}},
    "marble_n1_smooth": {
        "strategy": {"name": "marble", "harmonize_every": 1, "alpha_ema": 0.9, "smooth_harmonized": True}
    },
    "gated_n1_cross": {"strategy": {"name": "gated_projection", **_EVERY_STEP, "gram": "cross_fitted"}},
    "sdmgrad_n1_cross": {"strategy": {"name": "sdmgrad", **_EVERY_STEP, "gram": "cross_fitted"}},
}
"""The named arms, each a partial config over the base config (the families ``single:<reward>``,
``weighted_sum@w1,...,wK``, ``sequential`` and ``<weighting>_n10`` depend on the base:
:func:`arm_overrides`)."""

ABLATIONS = ("marble_n10_neutral", "marble_n10_noema", "mgda_n10")
"""Arms that explain MARBLE's result rather than compete (run with ``--arms``): a sample a reward
does not apply to counts with advantage 0 (``nft.nonapplicable="neutral"``, DiffusionNFT's
masking) instead of being left out; no EMA of alpha (``alpha_ema=0``); gradients not normalised
(``mgda``: the min-norm point of the raw gradients). ``marble_n1`` against ``marble_n10`` is the
amortization's."""

WEIGHTING_ARMS = ("upgrad", "cagrad")
"""The other conflict-aware weightings in the default arms, amortized as ``marble_n10`` is
(``<name>_n10``: re-solved every 10 steps, EMA 0.9); any registered weighting runs as an arm by name."""

EPOCHS = 120
"""Epochs per run of the shapes world's comparison and study, its default run's (120 optimizer
steps of 128 images)."""

EVALUATIONS = 3
"""Evaluations per run (the last one is the result without ``--final``), so that each run has a
learning curve."""

QUICK: dict[str, dict[str, int]] = {
    "sampling": {"prompts_per_epoch": 4, "group_size": 4},
    "train": {"epochs": 2, "batch_size": 16},
}
"""What ``--quick`` lowers in the base config (a value already lower stays): a smoke run of every
arm, not a result. On the shapes world it also evaluates on 16 held-out prompts (:func:`default_base`)."""

FINAL_EVAL = "final_eval.json"
"""A run's final evaluation (:func:`run_all` with ``final``): its last weights on more images,
:func:`~mogo_diffusion.evaluate.evaluate_run`'s JSON."""

RUNS_FILE = "runs.json.xz"
"""The comparison's finished runs in compact form (:func:`~mogo_diffusion.run_dir.write_packed`),
keyed by their directory under ``OUT/runs``."""


def frozen_sections() -> dict[str, Any]:
    """The :func:`~mogo_diffusion.shapes.recipe.shapes_config` sections every arm of the shapes
    world starts from, the settings the study's arms were frozen with: all of the world's rewards,
    and a sample a reward does not apply to left out of that reward's loss."""
    return {"rewards": reward_specs(REWARDS), "nft": {"nonapplicable": "exclude"}}


def default_base(quick: bool = False) -> Config:
    """The base config without ``--config``: the shapes world on all of its rewards
    (:func:`frozen_sections`); with ``quick``, evaluated on 16 held-out prompts instead of the
    pool's 256 images."""
    sampling = {"sampling": {"eval_prompts": "shapes:heldout:16"}} if quick else {}
    return shapes_config(**frozen_sections(), **sampling)


def arms(rewards: Sequence[str] = REWARDS) -> list[str]:
    """The default arms (``--arms all``) on ``rewards``, in table order (``base`` is evaluated,
    not trained)."""
    return [
        *(f"single:{r}" for r in rewards),
        "weighted_sum",
        "weighted_sum_z",
        "sequential",
        "marble_n1",
        "marble_n10",
        "marble_n10_window",
        *(f"{name}_n10" for name in WEIGHTING_ARMS if name in mogo.WEIGHTINGS),
    ]


def front_arms(count: int) -> list[str]:
    """The weighted-sum front of ``--front`` for ``count`` rewards: the uniform weights and each
    reward's weight doubled, ``weighted_sum@1,1,...`` and ``weighted_sum@2,1,...``, ...

    >>> front_arms(2)
    ['weighted_sum@1,1', 'weighted_sum@2,1', 'weighted_sum@1,2']
    """
    vectors = [[1] * count] + [[2 if i == k else 1 for i in range(count)] for k in range(count)]
    return ["weighted_sum@" + ",".join(map(str, weights)) for weights in vectors]


def _weighting_arm(arm: str) -> bool:
    """Whether ``arm`` is ``<name>_n10`` for a weighting of :data:`mogo.WEIGHTINGS`."""
    name = arm.removesuffix("_n10")
    return arm.endswith("_n10") and name in mogo.WEIGHTINGS and name != "weighted_sum"


def arm_overrides(
    arm: str, base: Config, definitions: Mapping[str, Mapping[str, Any]] | None = None
) -> dict[str, Any]:
    """The partial config of ``arm`` over ``base``: its entry in ``definitions`` (an arm file) or
    :data:`ARMS`, or one of the families that depend on the base's rewards and epochs.

    Raises:
        ValueError: an unknown arm, or weights of another length than the base's rewards.
    """
    names = [spec.name for spec in base.rewards]
    if definitions is not None and arm in definitions:
        return dict(definitions[arm])
    if arm in ARMS:
        return ARMS[arm]
    if arm.startswith("single:"):
        return {"strategy": {"name": "single", "reward": arm.removeprefix("single:")}}
    if arm.startswith("weighted_sum@"):
        weights = _weights(arm, len(names))
        return {**ARMS["weighted_sum"], "rewards": {str(i): {"weight": w} for i, w in enumerate(weights)}}
    if arm == "sequential":
        length = max(1, base.train.epochs // (2 * len(names)))
        return {
            "strategy": {"name": "sequential", "stages": [{"reward": n, "epochs": length} for n in names]}
        }
    if _weighting_arm(arm):
        return {"strategy": {"name": arm.removesuffix("_n10"), **_AMORTIZED}}
    raise ValueError(
        f"unknown arm {arm!r}; arms: base, {', '.join(arms(names))}, {', '.join(ABLATIONS)}, "
        "weighted_sum@w1,...,wK, <weighting>_n10 for a weighting of mogo.WEIGHTINGS "
        f"({', '.join(sorted(set(mogo.WEIGHTINGS) - {'weighted_sum'}))}), or one of --arm-file"
    )


def _weights(arm: str, count: int) -> list[float]:
    """The weights of the arm ``weighted_sum@w1,...,wK``, one per reward."""
    try:
        weights = [float(text) for text in arm.removeprefix("weighted_sum@").split(",")]
    except ValueError:
        raise ValueError(f"arm {arm!r}: the weights must be numbers, weighted_sum@w1,...,wK") from None
    if len(weights) != count:
        raise ValueError(f"arm {arm!r}: {len(weights)} weights for the base config's {count} rewards")
    return weights


def _dotted(partial: Mapping[Any, Any], prefix: str = "") -> list[str]:
    """A partial config as ``--set`` overrides, ``KEY=VALUE`` (values as JSON, which YAML reads);
    a section's ``name`` first, since a strategy of another name starts from its defaults."""
    overrides = []
    for key, value in sorted(partial.items(), key=lambda item: item[0] != "name"):
        field = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            overrides += _dotted(value, f"{field}.")
        else:
            overrides.append(f"{field}={json.dumps(value)}")
    return overrides


def arm_config(
    arm: str,
    seed: int,
    out: Path,
    *,
    base: Config | None = None,
    epochs: int | None = None,
    quick: bool = False,
    rewards: Sequence[str] | None = None,
    definitions: Mapping[str, Mapping[str, Any]] | None = None,
) -> Config:
    """The config of one arm and seed, writing to ``out``: ``base`` (default: :func:`default_base`)
    on ``rewards`` (a subset of its rewards, in its order; default all), ``epochs`` epochs (default
    the base's; :data:`QUICK`'s with ``quick``) evaluated :data:`EVALUATIONS` times, then the arm's
    partial config (:func:`arm_overrides`).

    Raises:
        ValueError: an unknown arm or reward, or an arm that makes an invalid config (names both).
    """
    data = (default_base(quick) if base is None else base).to_dict()
    if rewards is not None:
        known = [spec["name"] for spec in data["rewards"]]
        if unknown := sorted(set(rewards) - set(known)):
            raise ValueError(f"rewards {unknown} are not the base config's; its rewards: {', '.join(known)}")
        data["rewards"] = [spec for spec in data["rewards"] if spec["name"] in rewards]
    if quick:
        for section, values in QUICK.items():
            data[section].update({key: min(value, data[section][key]) for key, value in values.items()})
    epochs = data["train"]["epochs"] if quick or epochs is None else epochs
    data["train"].update(
        epochs=epochs, eval_every=max(1, epochs // EVALUATIONS), checkpoint_every=epochs, seed=seed,
        out_dir=str(out),
    )  # fmt: skip
    trained = Config.from_dict(data)
    try:
        return load_config(None, _dotted(arm_overrides(arm, trained, definitions)), defaults=trained)
    except ConfigError as error:
        raise ValueError(f"arm {arm!r}: {error}") from None


def run_directory(out: Path, arm: str, seed: int, group: str | None = None) -> Path:
    """Where the run of ``arm`` and ``seed`` lives: ``out/runs/[group/]<arm>/seed<seed>`` (a ``:``
    in the arm's name written ``-``)."""
    runs = out / "runs" / group if group else out / "runs"
    return runs / arm.replace(":", "-") / f"seed{seed}"


def plan(
    arms: Sequence[str], seeds: Sequence[int], out: Path, *, group: str | None = None, **options: Any
) -> dict[tuple[str, int], Config]:
    """Every run of ``arms`` x ``seeds``, ``(arm, seed) -> config``, in :func:`run_directory`
    (``options``: those of :func:`arm_config`).

    Raises:
        ValueError: an arm is unknown or invalid, or two arms are the same run (names them).
    """
    runs = {
        (arm, seed): arm_config(arm, seed, run_directory(out, arm, seed, group), **options)
        for arm in arms
        for seed in seeds
    }
    first: dict[str, str] = {}
    for (arm, _), config in runs.items():
        other = first.setdefault(run_dir.fingerprint(config), arm)
        if other != arm:
            raise ValueError(f"arms {other!r} and {arm!r} are the same run (the same config): leave one out")
    return runs


# ---- what to do with each run ---------------------------------------------------------------------

_LEGACY = "no run record (run.json): read as it is, checked only on its epochs and final evaluation"


class Decision(NamedTuple):
    """What :func:`run_all` does with one run (:func:`decide`), and why, in words.

    ``action``: ``"reuse"`` (finished, and finally evaluated when asked), ``"evaluate"`` (finished;
    its final evaluation is missing or damaged), ``"resume"`` (unfinished: from its latest intact
    checkpoint), ``"start"`` (the directory holds no run), ``"restart"`` (unfinished, with no
    checkpoint to resume: nothing complete to lose), ``"legacy"`` (finished, but without a run
    record, so its config cannot be checked: only ``--no-train`` reads it), ``"skip"`` (with
    ``--no-train``: a run that would be trained or evaluated, its seed left out) or
    ``"refuse"`` (another config's run, a run in use, or a damaged one: never deleted)."""

    action: str
    why: str


class _Stored(NamedTuple):
    """A run as stored: in its directory, or compact in the packed file (its metrics and final
    evaluation read when asked for; ``weights``: the directory whose checkpoints can be resumed or
    evaluated, None for a compact run)."""

    where: str
    record: dict | None
    marker: dict | None
    metrics: Callable[[], list[dict]]
    final: Callable[[], dict | None]
    weights: Path | None


def _from_directory(run: Path) -> _Stored:
    record, marker = run_dir.read_record(run), run_dir.read_marker(run)
    return _Stored(
        str(run),
        record,
        marker,
        lambda: run_dir.read_metrics(run),
        lambda: _read_result(run / FINAL_EVAL),
        run,
    )


def _from_packed(run: Path, entry: Mapping[str, Any]) -> _Stored:
    where = f"{run} (compact, in {RUNS_FILE})"
    return _Stored(
        where, entry["record"], entry["marker"], lambda: entry["metrics"], lambda: entry["final"], None
    )


def decide(config: Config, final: str | None = None, packed: Mapping[str, Any] | None = None) -> Decision:
    """What to do with the run of ``config`` (in ``train.out_dir``, or compact: ``packed``, its
    :func:`~mogo_diffusion.run_dir.compact` form, read when the directory holds no run), its final
    evaluation on the prompts ``final`` wanted or not.

    A run is reused only when its record holds ``config`` (but for ``train.out_dir``: the epochs,
    evaluation prompts and steps that its results depend on included), it is finished
    (:func:`~mogo_diffusion.run_dir.is_finished`) with metrics to its last epoch, and its final
    evaluation is of its final checkpoint, on ``final``'s prompts, with ``config``'s steps.
    """
    run = Path(config.train.out_dir)
    if (holder := run_dir.claimed_by(run)) is not None:
        return Decision("refuse", f"in use by another process (pid {holder})")
    try:
        if run_dir.holds_run(run):
            stored = _from_directory(run)
        elif packed is not None:
            stored = _from_packed(run, packed)
        else:
            return Decision("start", "new")
        if stored.record is None:
            return _legacy(stored, config, final)
        request = run_dir.portable(config.to_dict())
        differences = run_dir.config_differences(stored.record["config"], request)
        if differences := [d for d in differences if d[0] != "train.out_dir"]:
            return Decision("refuse", f"holds the run of another config ({_named(differences)}); it is kept: "
                            "use another --out")  # fmt: skip
        if not run_dir.finishes(stored.marker, config):
            return _unfinished(stored)
        _check_metrics(stored.metrics(), config.train.epochs, stored.where)
        return Decision("reuse", "finished") if final is None else _final_evaluation(stored, config, final)
    except (RunDirError, CheckpointError) as error:
        return Decision("refuse", str(error))


def _unfinished(stored: _Stored) -> Decision:
    """Resume an unfinished run from its latest intact checkpoint, or restart it without one."""
    if stored.weights is None:
        return Decision("refuse", f"{stored.where} is unfinished and keeps no checkpoint; move it away")
    try:
        checkpoint = latest_checkpoint(stored.weights / "checkpoints")
    except CheckpointError as error:
        return Decision("restart", f"unfinished; {error}")
    if checkpoint is None:
        return Decision("restart", "unfinished, no checkpoint to resume")
    return Decision("resume", f"unfinished, from {checkpoint.name}")


def _check_metrics(records: Sequence[Mapping[str, Any]], epochs: int, where: str) -> None:
    """Check that a run's metrics ``records`` end at epoch ``epochs - 1``.

    Raises:
        RunDirError: they do not (the file was damaged after the run finished)."""
    last = records[-1]["epoch"] if records else None
    if last != epochs - 1:
        raise RunDirError(
            f"the metrics of {where!r} end at epoch {last}, not {epochs - 1}: they were damaged after "
            "the run finished; move the run away to train it again"
        )


def _final_evaluation(stored: _Stored, config: Config, final: str) -> Decision:
    """Reuse a finished run whose final evaluation matches; evaluate one without (or with a
    damaged one) if its weights are kept; refuse one evaluated on other prompts, steps or weights."""
    expected = {
        "checkpoint_sha256": stored.marker["checkpoint_sha256"],
        "prompts_sha256": prompts_digest(load_prompt_set(final)),
        "eval_num_steps": config.sampling.eval_num_steps,
    }
    if (result := stored.final()) is not None:
        differences = run_dir.config_differences({key: result.get(key) for key in expected}, expected)
        if not differences:
            return Decision("reuse", "finished and evaluated finally")
        raise RunDirError(
            f"the final evaluation of {stored.where!r} is another one ({_named(differences)}); it is kept: "
            "use another --out"
        )
    checkpoint = stored.marker["checkpoint"]
    if stored.weights is None or not (stored.weights / "checkpoints" / checkpoint).is_dir():
        raise RunDirError(
            f"{stored.where!r} is finished, but keeps neither its final checkpoint {checkpoint} nor "
            f"its {FINAL_EVAL}: nothing to evaluate; move it away to train it again"
        )
    damaged = (stored.weights / FINAL_EVAL).is_file()
    return Decision("evaluate", f"finished; its final evaluation is {'damaged' if damaged else 'missing'}")


def _read_result(path: Path) -> dict | None:
    """The JSON object in ``path``; None, with a warning, when it is damaged or absent."""
    if not path.is_file():
        return None
    try:
        result = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        warnings.warn(f"{str(path)!r} is damaged ({error}): it is made again", stacklevel=3)
        return None
    return result if isinstance(result, dict) else None


def _legacy(stored: _Stored, config: Config, final: str | None) -> Decision:
    """A run without a record (written before runs had one, or copied without it): ``"legacy"``
    when its metrics reach the last epoch and, with ``final``, its final evaluation has
    ``final``'s number of prompts and ``config``'s steps (what such a run records); else refused."""
    unchecked = "no run record (run.json), so its config cannot be checked"
    try:
        _check_metrics(stored.metrics(), config.train.epochs, stored.where)
    except (FileNotFoundError, RunDirError) as error:
        return Decision("refuse", f"{unchecked}, and it is unfinished or damaged ({error}); move it away")
    if final is not None:
        result = stored.final() or {}
        wanted = (len(load_prompt_set(final).prompts), config.sampling.eval_num_steps)
        if (result.get("num_prompts"), result.get("eval_num_steps")) != wanted:
            return Decision("refuse", f"{unchecked}, and it has no final evaluation of {final}; move it away")
    return Decision("legacy", _LEGACY)


def done(config: Config, final: str | None = None) -> bool:
    """Whether ``config``'s run is reused as it is (:func:`decide`): finished and, with ``final``,
    evaluated finally on those prompts."""
    return decide(config, final).action == "reuse"


def report(decisions: Mapping[tuple, Decision], configs: Mapping[tuple, Config]) -> None:
    """Print a line for each run that is not simply reused or read as legacy, then the count of
    each action (and what legacy means, if any is)."""
    for key, decision in decisions.items():
        if decision.action not in ("reuse", "legacy"):
            tqdm.write(f"{decision.action} {configs[key].train.out_dir}: {decision.why}")
    counts = Counter(decision.action for decision in decisions.values())
    summary = ", ".join(f"{count} {action}" for action, count in counts.items())
    tqdm.write(f"runs: {summary}" + (f" (legacy: {_LEGACY})" if "legacy" in counts else ""))


def _named(differences: Sequence[tuple[str, Any, Any]]) -> str:
    """Differing fields, each with the value found and the one requested."""
    return "; ".join(f"{field}: {there!r} there, {now!r} requested" for field, there, now in differences)


# ---- training and evaluating ---------------------------------------------------------------------


def _train(config: Config, action: str) -> None:
    """Start, resume or restart ``config``'s run as a subprocess (one thread), its output in
    ``run/log.txt``."""
    run = Path(config.train.out_dir)
    run.mkdir(parents=True, exist_ok=True)
    config.save(run / "compare_config.yaml")
    command = [sys.executable, "-m", "mogo_diffusion.train", "--config", str(run / "compare_config.yaml")]
    command += {"start": [], "resume": ["--resume", "latest"], "restart": ["--overwrite"]}[action]
    _subprocess(command, run)


def _evaluate_final(run: Path, prompts: str) -> None:
    """``python -m mogo_diffusion.evaluate`` of ``run``'s final checkpoint (its finished marker's) on
    ``prompts`` (one thread), written to ``run/FINAL_EVAL`` once complete, the run claimed meanwhile."""
    with run_dir.claim(run):
        checkpoint = run / "checkpoints" / run_dir.read_marker(run)["checkpoint"]
        partial = run / f"{FINAL_EVAL}.partial"
        _subprocess([sys.executable, "-m", "mogo_diffusion.evaluate", str(checkpoint), "--prompts", prompts,
                     "--out", str(partial)], run)  # fmt: skip
        partial.replace(run / FINAL_EVAL)


def _subprocess(command: list[str], run: Path) -> None:
    """Run ``command`` with one thread, appending its output to ``run/log.txt``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    with (run / "log.txt").open("a") as log:
        completed = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
    if completed.returncode:
        tail = (run / "log.txt").read_text().splitlines()[-15:]
        raise RuntimeError(f"run {str(run)!r} failed (exit {completed.returncode}):\n" + "\n".join(tail))


def _complete(config: Config, decision: Decision, final: str | None) -> None:
    """Do what ``decision`` says to ``config``'s run: train it (unless finished), then with
    ``final`` evaluate it finally."""
    if decision.action in ("start", "resume", "restart"):
        _train(config, decision.action)
    if final is not None and decision.action != "reuse":
        _evaluate_final(Path(config.train.out_dir), final)


def base_evaluation(config: Config) -> dict[str, Any]:
    """What the pretrained model's evaluation under ``config`` depends on, the key of its cache
    (:func:`evaluate_base`): the model, the rewards that score it, the sampler (solver, resolution,
    ``eval_num_steps``) and the evaluation prompts' content
    (:func:`~mogo_diffusion.evaluate.prompts_digest`)."""
    data = run_dir.portable(config.to_dict())
    sampling = data["sampling"]
    prompts = load_prompt_set(config.sampling.eval_prompts)
    return {
        "model": data["model"],
        "rewards": data["rewards"],
        **{key: sampling[key] for key in ("solver", "resolution", "eval_num_steps")},
        "prompts_sha256": prompts_digest(prompts),
        "num_prompts": len(prompts.prompts),
    }


def evaluate_base(
    config: Config, path: Path, *, prompts: str | None = None, legacy: bool = False
) -> dict[str, float]:
    """The pretrained model's held-out means (its zero adapter is the base model) on ``config``'s
    evaluation prompts or ``prompts``, ``{"eval/<reward>": mean, ...}``, cached at ``path`` with
    what they depend on (:func:`base_evaluation`). A damaged cache is made again, with a warning.

    Args:
        legacy: read a cache written before caches recorded what they depend on as it is (a line
            says so); else such a cache is refused.

    Raises:
        RunDirError: ``path`` holds the evaluation of another model, rewards, sampler or prompts
            (or, without ``legacy``, an unkeyed one); it is kept.
    """
    if prompts is not None:
        data = config.to_dict()
        data["sampling"]["eval_prompts"] = prompts
        config = Config.from_dict(data)
    key = base_evaluation(config)
    cached = _read_result(path)
    if cached is not None and set(cached) == {"evaluation", "means"}:
        if differences := run_dir.config_differences(cached["evaluation"], key):
            raise RunDirError(
                f"{str(path)!r} evaluates another request ({_named(differences)}); it is kept: "
                "use another --out"
            )
        return cached["means"]
    if cached is not None:
        if not legacy:
            raise RunDirError(
                f"{str(path)!r} was written before cached evaluations recorded what they were made on: "
                "--no-train reads it as it is; delete it to evaluate again"
            )
        tqdm.write(f"legacy {path}: read as it is (it does not record what it was made on)")
        return cached
    return _evaluate_pretrained(config, path, key)


def _evaluate_pretrained(config: Config, path: Path, key: dict[str, Any]) -> dict[str, float]:
    """Evaluate the pretrained model under ``config`` and cache its means at ``path`` under ``key``."""
    from mogo_diffusion.train import Trainer

    trainer = Trainer.from_config(config)
    started = time.perf_counter()
    means = trainer.evaluate()
    means["seconds"] = time.perf_counter() - started
    path.parent.mkdir(parents=True, exist_ok=True)
    run_dir.write_json(path, {"evaluation": key, "means": means})
    return means


def _to_train(decision: Decision) -> Decision:
    """``decision`` for a tool that trains: a legacy run, whose config cannot be checked, is refused."""
    if decision.action != "legacy":
        return decision
    why = (
        "no run record (run.json), so its config cannot be checked: --no-train reads such runs; to "
        "train, use another --out"
    )
    return Decision("refuse", why)


def _read_only(decision: Decision) -> Decision:
    """``decision`` for ``--no-train``: a run that would be trained or evaluated is skipped."""
    if decision.action in ("reuse", "legacy", "refuse"):
        return decision
    return Decision("skip", f"{decision.why}: its seed is left out")


def _refused(decisions: Mapping[tuple, Decision], configs: Mapping[tuple, Config], doing: str) -> None:
    """Raise if any run is refused, naming each, with what is not done."""
    refused = [f"{configs[k].train.out_dir}: {d.why}" for k, d in decisions.items() if d.action == "refuse"]
    if refused:
        raise RunDirError(f"{len(refused)} run(s) refused, {doing}:\n" + "\n".join(refused))


def run_all(
    configs: Mapping[tuple, Config],
    base: Path,
    *,
    jobs: int,
    final: str | None = None,
    packed: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, float]:
    """Bring every run of ``configs`` (key to config) to an end, ``jobs`` at a time, each a
    ``python -m mogo_diffusion.train`` subprocess with one thread, as :func:`decide` says: reuse a
    finished run (in its directory, or in ``packed``, the compact runs by their directory under
    ``base.parent.parent``), resume or restart an unfinished one of the same config, start a new
    one; returns the pretrained model's held-out means, evaluated once and cached at ``base``
    (:func:`evaluate_base`). A line says what is done with each run (:func:`report`). Runs start
    seed by seed (every arm's seed 0, then seed 1, ...), so that a comparison stopped part-way has
    whole seeds to judge.

    With ``final`` (a prompt source), each run's last weights are then evaluated on it once
    (:data:`FINAL_EVAL` in the run, read by :func:`final_means`).

    Raises:
        RunDirError: a run is refused (another config's, a legacy or damaged one, one in use), or
            the base cache is another request's; nothing is trained, and nothing deleted.
    """
    entries = _entries(configs, base.parent.parent, packed or {})
    decisions = {key: _to_train(decide(c, final, entries[key])) for key, c in configs.items()}
    report(decisions, configs)
    _refused(decisions, configs, "nothing trained")
    means = evaluate_base(next(iter(configs.values())), base)
    todo = {key: c for key, c in configs.items() if decisions[key].action != "reuse"}
    todo = dict(sorted(todo.items(), key=lambda item: item[1].train.seed))  # stable: arms in order
    with (
        ThreadPoolExecutor(max_workers=jobs) as pool,
        tqdm(total=len(configs), initial=len(configs) - len(todo), desc="runs") as bar,
    ):
        futures = {pool.submit(_complete, c, decisions[key], final): key for key, c in todo.items()}
        for future in as_completed(futures):
            future.result()
            bar.update()
            bar.set_postfix_str("/".join(map(str, futures[future])))
    return means


def _entries(
    configs: Mapping[tuple, Config], runs: Path, packed: Mapping[str, Mapping[str, Any]]
) -> dict[tuple, Mapping[str, Any] | None]:
    """Each run's compact form in ``packed`` (by its directory relative to ``runs``), or None."""
    return {key: packed.get(_name(config, runs)) for key, config in configs.items()}


def _name(config: Config, runs: Path) -> str:
    """A run's name in the packed file: its directory relative to the comparison's ``runs/``."""
    return Path(config.train.out_dir).relative_to(runs).as_posix()


# ---- the results of the runs ---------------------------------------------------------------------


def last_evaluation(history: Sequence[Mapping[str, Any]], names: Sequence[str]) -> list[float]:
    """The held-out means of ``names`` at a run's last evaluation (its metrics records ``history``)."""
    last = [record for record in history if f"eval/{names[0]}" in record][-1]
    return [float(last[f"eval/{name}"]) for name in names]


def final_means(result: Mapping[str, Any]) -> dict[str, float]:
    """The held-out means of a final evaluation ``result`` (its :data:`FINAL_EVAL` JSON or compact
    form), as ``{"eval/<reward>": mean}`` (NaN where a reward applied to no prompt)."""
    return {f"eval/{name}": math.nan if value is None else value for name, value in result["metrics"].items()}


class RunResults(NamedTuple):
    """What a finished run gives a comparison: its metrics records (one per epoch, at least the
    fields of :data:`~mogo_diffusion.run_dir.KEPT_METRICS`) and its final evaluation's means
    (:func:`final_means`; None when it is judged by its last evaluation)."""

    metrics: list[dict[str, Any]]
    final: dict[str, float] | None

    def held_out(self, names: Sequence[str]) -> list[float]:
        """The means it is judged by: its final evaluation's, else its last evaluation's."""
        if self.final is None:
            return last_evaluation(self.metrics, names)
        return [float(self.final[f"eval/{name}"]) for name in names]


class Gathered(NamedTuple):
    """The finished runs of a comparison (:func:`gather`): the ``seeds`` all of whose runs have
    finished, the pretrained model's means on the evaluation prompts (``base``) and on those that
    judge (``judged_base``: the final evaluation's, else ``base``), and each run's results."""

    seeds: list[int]
    base: dict[str, float]
    judged_base: dict[str, float]
    results: dict[tuple, RunResults]


def gather(
    configs: Mapping[tuple, Config], out: Path, *, final: str | None, jobs: int, train: bool = True
) -> Gathered:
    """Train what is missing of the runs ``configs`` (:func:`run_all`), or with ``train`` False
    read what has finished (a run that would be trained or evaluated leaves its seed out; a run
    without a record is read as it is), then read every run: from its directory under
    ``out/runs``, else from ``out/RUNS_FILE``. Every finished run, of a seed left out too, is then
    written to ``out/RUNS_FILE`` in compact form (the packed runs of other configs kept): a long
    comparison's finished part can be committed and its run directories lost.

    Raises:
        RunDirError: a run is refused (another config's, a damaged one, one in use; and to train,
            one without a record) or a cache is another request's; nothing is trained or deleted.
    """
    runs, packed = out / "runs", run_dir.read_packed(out / RUNS_FILE)
    first = next(iter(configs.values()))
    if train:
        base = run_all(configs, runs / "base" / "eval.json", jobs=jobs, final=final, packed=packed)
        kept = configs
    else:
        entries = _entries(configs, runs, packed)
        decisions = {key: _read_only(decide(c, final, entries[key])) for key, c in configs.items()}
        report(decisions, configs)
        _refused(decisions, configs, "nothing read")
        skipped = {configs[key].train.seed for key, d in decisions.items() if d.action == "skip"}
        kept = {key: c for key, c in configs.items() if c.train.seed not in skipped}
        finished = {key: c for key, c in configs.items() if decisions[key].action == "reuse"}
        base = evaluate_base(first, runs / "base" / "eval.json", legacy=True)
    judged_base = base
    if final is not None:
        cache = runs / "base" / "final_eval.json"
        judged_base = evaluate_base(first, cache, prompts=final, legacy=not train)
    results = {key: _results(c, runs, packed, final is not None) for key, c in kept.items()}
    _pack(out, configs if train else finished, packed)  # a seed left out keeps its finished runs
    seeds = sorted({c.train.seed for c in kept.values()})
    return Gathered(seeds, base, judged_base, results)


def _results(config: Config, runs: Path, packed: Mapping[str, Mapping[str, Any]], final: bool) -> RunResults:
    """A finished run's results, from its directory or, without one, its compact form."""
    directory = Path(config.train.out_dir)
    if run_dir.holds_run(directory):
        result = _read_result(directory / FINAL_EVAL) if final else None
        return RunResults(run_dir.read_metrics(directory), None if result is None else final_means(result))
    entry = packed[_name(config, runs)]
    return RunResults(entry["metrics"], final_means(entry["final"]) if final else None)


def _pack(out: Path, configs: Mapping[tuple, Config], packed: Mapping[str, Mapping[str, Any]]) -> None:
    """Write the runs of ``configs`` that have a directory, in compact form, into ``out/RUNS_FILE``
    beside the packed runs it holds already (a run's directory replaces its packed form)."""
    runs = out / "runs"
    fresh = {
        _name(config, runs): run_dir.compact(directory, _read_result(directory / FINAL_EVAL))
        for config in configs.values()
        if run_dir.holds_run(directory := Path(config.train.out_dir))
    }
    if fresh:
        run_dir.write_packed(out / RUNS_FILE, {**packed, **fresh})


# ---- judging and writing ---------------------------------------------------------------------------


_CONFLICTS = run_dir.CONFLICT_METRICS
_CROSS_CONFLICTS = tuple(f"{key}_cross" for key in _CONFLICTS)


def costs(
    histories: Mapping[str, Mapping[int, Sequence[Mapping[str, Any]]]], reference: str
) -> dict[str, dict[str, Any]]:
    """Per arm (``histories``: arm to seed to its metrics records) its median epoch time (seconds,
    the mean over seeds of each run's median), its throughput against ``reference`` (per seed the
    reference's median epoch time over the arm's, with its bootstrap interval over seeds,
    ``[mean, low, high]``), and for a harmonized arm its last epoch's conflict statistics: the
    conflict rate of the weighted-sum direction (``[mean, low, high]``) and the worst cosine of a
    reward's gradient with the weighted-sum and with the arm's direction (the lowest over seeds),
    within the micro-batch and, for a cross-fitted arm, across its halves (``_cross``)."""
    medians = {arm: {s: statistics.median(r["seconds"] for r in h) for s, h in runs.items()}
               for arm, runs in histories.items()}  # fmt: skip
    rows: dict[str, dict[str, Any]] = {}
    for arm, runs in histories.items():
        ratios = [medians[reference][s] / medians[arm][s] for s in sorted(runs)]
        row = {"epoch_seconds": statistics.fmean(medians[arm].values()),
               "throughput": analysis.as_list(bootstrap_interval(ratios))}  # fmt: skip
        last = [runs[s][-1] for s in sorted(runs)]
        for key in (*_CONFLICTS, *_CROSS_CONFLICTS):
            if all(key in record for record in last):  # logged by the harmonized arms
                values = [record[key] for record in last]
                rate = key.startswith("conflict_rate")
                row[key] = analysis.as_list(bootstrap_interval(values)) if rate else min(values)
        rows[arm] = row
    return rows


def _costs_table(rows: Mapping[str, Mapping[str, Any]], reference: str) -> tables.Table:
    header = ["arm", "median epoch (s)", f"throughput vs {reference}", "conflict rate of the weighted sum",
              "worst cosine, weighted sum", "worst cosine, the arm's direction"]  # fmt: skip
    body = []
    crossed = any(_CROSS_CONFLICTS[0] in row for row in rows.values())
    if crossed:
        header += ["the same across the batch's halves", "worst cosine across halves, weighted sum",
                   "worst cosine across halves, the arm's direction"]  # fmt: skip
    for arm, row in rows.items():
        mean, low, high = row["throughput"]
        cells = [f"{row['epoch_seconds']:.2f}", f"{mean:.3f} [{low:.3f}, {high:.3f}]"]
        for group in (_CONFLICTS, _CROSS_CONFLICTS) if crossed else (_CONFLICTS,):
            if group[0] in row:
                rate, low, high = row[group[0]]
                cells.append(f"{rate:.2f} [{low:.2f}, {high:.2f}]")
            else:
                cells.append("")
            cells += [f"{row[key]:+.3f}" if key in row else "" for key in group[1:]]
        body.append([arm, *cells])
    caption = (
        "Costs: each run's median epoch time, the throughput against "
        f"{reference}'s paired by seed, and for harmonized arms the last epoch's conflict statistics "
        "(the worst cosines are the lowest over seeds)."
    )
    return caption, [header, *body]


def command_line(prog: str, argv: Sequence[str] | None) -> str:
    """The command line that made a result, for its tables."""
    return f"python -m {prog} " + " ".join(argv if argv is not None else sys.argv[1:])


def add_run_arguments(parser: argparse.ArgumentParser, *, out: str, seeds: int) -> None:
    """Add the options of every comparison driver to ``parser``: ``--out`` (default ``out``),
    ``--seeds`` (``seeds``), ``--epochs``, ``--jobs``, ``--specialists``, ``--quick`` and ``--no-train``."""
    parser.add_argument("--out", type=Path, default=Path(out), help="output directory")
    parser.add_argument("--seeds", type=int, default=seeds, help="seeds 0..N-1 per arm")
    parser.add_argument("--epochs", type=int, default=None, help="epochs per run (none: the base config's)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each")
    parser.add_argument(
        "--specialists",
        default="",
        help="comma-separated rewards to train a specialist (single:<reward>) of, or all",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny budget (QUICK), not a result")
    parser.add_argument(
        "--no-train", action="store_true", help="train nothing: the seeds whose runs have all finished"
    )


def _specialists(text: str, rewards: Sequence[str]) -> list[str]:
    """The rewards of a ``--specialists`` value (``all``, none when empty), in ``rewards``' order.

    Raises:
        ValueError: a reward that is not one of ``rewards``."""
    chosen = list(rewards) if text == "all" else [name for name in text.split(",") if name]
    if unknown := sorted(set(chosen) - set(rewards)):
        raise ValueError(f"--specialists {unknown} are not rewards of the comparison: {', '.join(rewards)}")
    return [name for name in rewards if name in chosen]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mogo_diffusion.compare",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--config", type=Path, default=None, help="the base config (none: the shapes world)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field of the base config (repeatable)")  # fmt: skip
    parser.add_argument("--arms", default="all", help="comma-separated arms, or all")
    parser.add_argument("--arm-file", type=Path, default=None,
                        help="a YAML file of more arms: name -> partial config over the base")  # fmt: skip
    parser.add_argument(
        "--front", action="store_true", help="add the weighted-sum front (K + 1 weight vectors)"
    )
    parser.add_argument(
        "--reference", default="weighted_sum", help="the arm every difference is paired against"
    )
    parser.add_argument(
        "--curves", default=None, help="comma-separated arms of curves.png (none: all but the front)"
    )
    parser.add_argument("--seed", type=int, default=None, help="run this one seed only (overrides --seeds)")
    parser.add_argument(
        "--final", default=None, help="judge each run by an evaluation of its last weights on these prompts"
    )
    add_run_arguments(parser, out="runs/compare", seeds=3)
    return parser


def _arm_file(path: Path | None) -> dict[str, dict[str, Any]]:
    """The arms of an ``--arm-file``: a YAML mapping of names to partial configs.

    Raises:
        ValueError: the file is not such a mapping (names it)."""
    if path is None:
        return {}
    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"--arm-file {str(path)!r}: {error}") from None
    if not isinstance(loaded, dict) or not all(isinstance(v, dict) for v in loaded.values()):
        raise ValueError(f"--arm-file {str(path)!r}: expected a mapping of arm names to partial configs")
    return {str(name): value for name, value in loaded.items()}


def choose_arms(
    base: Config,
    arms_text: str,
    *,
    specialists: str = "",
    front: bool = False,
    definitions: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[str]:
    """The arms of a command line, in order, each once: the specialists of ``specialists`` (rewards
    of ``base``, comma-separated, or ``all``), the arms of ``arms_text`` (comma-separated, or
    ``all``: :func:`arms`), then with ``front`` the weighted-sum front (:func:`front_arms`) but
    for a point whose config is already an arm's (that arm is the point).

    Raises:
        ValueError: an unknown or invalid arm, or an unknown specialist."""
    names = [spec.name for spec in base.rewards]
    chosen = arms(names) if arms_text == "all" else [a for a in arms_text.split(",") if a]
    chosen = list(dict.fromkeys([*(f"single:{n}" for n in _specialists(specialists, names)), *chosen]))
    return chosen + (front_points(chosen, base, definitions=definitions) if front else [])


def front_points(
    chosen: Sequence[str],
    base: Config,
    *,
    rewards: Sequence[str] | None = None,
    definitions: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[str]:
    """The weighted-sum front (:func:`front_arms`) of ``base`` on ``rewards`` (default all its
    rewards), but for a point whose config is already one of the arms ``chosen``' (that arm is
    the point)."""
    count = len(rewards) if rewards is not None else len(base.rewards)

    def fingerprint(arm: str) -> str:
        config = arm_config(arm, 0, Path("."), base=base, rewards=rewards, definitions=definitions)
        return run_dir.fingerprint(config)

    taken = {fingerprint(arm) for arm in chosen}
    return [arm for arm in front_arms(count) if fingerprint(arm) not in taken]


def front_of(chosen: Sequence[str], configs: Mapping[tuple[str, int], Config]) -> list[str]:
    """The arms of ``chosen`` that trace the weighted-sum front: those of the raw weighted sum
    (``configs``: :func:`plan`'s)."""
    strategies = {arm: config.strategy for (arm, _), config in configs.items()}
    return [
        arm
        for arm in chosen
        if strategies[arm].name == "weighted_sum" and strategies[arm].reward_scale == "raw"
    ]


def main(argv: list[str] | None = None) -> dict:
    """Run the comparison; returns its results (also ``OUT/results.json``)."""
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("seeds", "jobs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    try:
        base = load_config(
            args.config, args.overrides, defaults=None if args.config else default_base(args.quick)
        )
        definitions = _arm_file(args.arm_file)
        chosen = choose_arms(base, args.arms, specialists=args.specialists, front=args.front,
                             definitions=definitions)  # fmt: skip
        seeds = [args.seed] if args.seed is not None else list(range(args.seeds))
        configs = plan(chosen, seeds, args.out, base=base, epochs=args.epochs, quick=args.quick,
                       definitions=definitions)  # fmt: skip
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    if args.reference not in chosen:
        parser.error(f"--reference {args.reference!r} is not one of the arms: {', '.join(chosen)}")
    curves = chosen if args.curves is None else [a for a in args.curves.split(",") if a]
    if unknown := [arm for arm in curves if arm not in chosen]:
        parser.error(f"--curves: {unknown} are not arms of the comparison")
    started = time.perf_counter()
    try:
        gathered = gather(configs, args.out, final=args.final, jobs=args.jobs, train=not args.no_train)
    except RunDirError as error:
        parser.error(str(error))
    if not gathered.seeds:
        parser.error(f"--no-train: no seed whose runs have all finished in {args.out}")
    names = [spec.name for spec in base.rewards]
    front = front_of(chosen, configs)
    results = _judge(names, gathered, chosen, reference=args.reference, front=front or [args.reference])
    results.update(command=command_line("mogo_diffusion.compare", argv), final_evaluation=args.final,
                   seconds=time.perf_counter() - started)  # fmt: skip
    _write_results(args.out, results, gathered, curves=[a for a in curves if args.curves or a not in front])
    return results


def _judge(
    names: Sequence[str], gathered: Gathered, order: Sequence[str], *, reference: str, front: Sequence[str]
) -> dict[str, Any]:
    """The results of a comparison: :func:`~mogo_diffusion.analysis.summarize` of the arms in
    ``order`` (``gathered.results`` keyed ``(arm, seed)``), :func:`~mogo_diffusion.analysis.judge`
    against ``front`` and :func:`costs`."""
    base = [gathered.judged_base[f"eval/{name}"] for name in names]
    means = {arm: {s: gathered.results[arm, s].held_out(names) for s in gathered.seeds} for arm in order}
    summary = analysis.summarize(names, base, means, reference)
    histories = {arm: {s: gathered.results[arm, s].metrics for s in gathered.seeds} for arm in order}
    return {
        **summary,
        "reference": reference,
        "judged": analysis.judge(summary, reference=reference, front=front),
        "costs": costs(histories, reference),
    }


def _write_results(
    out: Path, results: Mapping[str, Any], gathered: Gathered, *, curves: Sequence[str]
) -> None:
    """Write a comparison's ``results`` (:func:`_judge`) into ``out``: the tables, the figures
    (``curves``: the arms of ``curves.png``) and ``results.json``."""
    from mogo_diffusion import figures

    reference, judged = results["reference"], results["judged"]
    note = judged_on(results["final_evaluation"])
    sections = {None: [tables.arms_table(results, reference), _costs_table(results["costs"], reference)]}
    tables.write_documents(out, "results", results["command"], [note], sections)
    judged_tables = {None: tables.judged_tables(judged, reference)}
    tables.write_documents(out, "judged", results["command"], [note], judged_tables)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    names, base = results["rewards"], gathered.base
    histories = {arm: [gathered.results[arm, s].metrics for s in gathered.seeds] for arm in curves}
    figures.save(figures.front(judged), out / "front.png")
    keys = {
        "composite": "composite",
        "mean_gain": "mean gain",
        "worst_gain": "worst gain",
    }
    panels = {
        title: {arm: row[key]["vs_reference"] for arm, row in judged["arms"].items()}
        for key, title in keys.items()
    }
    figures.save(figures.intervals(panels, f"minus {reference}'s (95 % paired bootstrap interval)"),
                 out / "composite.png")  # fmt: skip
    lines = {arm: dict.fromkeys(names, runs) for arm, runs in histories.items()}
    title = "held-out means, each seed thin, against images and CPU minutes of training"
    figures.save(figures.curves(names, base, lines, title), out / "curves.png")
    first = gathered.seeds[0]
    weights = figures.alphas({arm: gathered.results[arm, first].metrics for arm in results["arms"]}, names)
    if weights is not None:
        figures.save(weights, out / "alpha.png")
    tqdm.write((out / "judged.md").read_text())


def judged_on(final: str | None) -> str:
    """What the held-out means of a comparison judged by the final evaluation on ``final`` (None: by
    each run's last evaluation) are, a note for its tables."""
    if final is None:
        return "Held-out means: each run's last evaluation during training and the pretrained model's."
    return (
        f"Held-out means: each run's last weights and the pretrained model on {Path(final).name}, from "
        "the same noise."
    )


if __name__ == "__main__":
    main()
