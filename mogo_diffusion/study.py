"""The shapes-world study that can decide MARBLE's claims: ``python -m mogo_diffusion.study``.

Every arm of :mod:`mogo_diffusion.compare` is trained with the same budget and seeds on two reward
sets, frozen before any run:

.. code-block:: text

    prompt_following   shapes_color, shapes_shape, clipscore (global),
                       shapes_position, shapes_count (specialists, NaN elsewhere)
    with_quality       the same plus jpeg_compressibility, which pulls against all of them

The specialists (``single:<reward>``) are trained once, with every reward evaluated, and belong to
both sets; the multi-reward arms (:data:`ARMS`) and the ablations (:data:`~mogo_diffusion.compare.ABLATIONS`,
on ``prompt_following``) are trained for each set. Runs live in ``OUT/runs/<set or
specialists>/<arm>/seed<s>``; a finished run of the same config is never rerun and an unfinished
one is resumed, so the study can be stopped and continued (:func:`compare.run_all
<mogo_diffusion.compare.run_all>`, which refuses the runs of another config, never deleting them).
``--no-train`` reads the runs of the seeds that have finished, runs made before run records
(``run.json``) included, as they are.

A run is judged by its final evaluation: its last weights on
:data:`~mogo_diffusion.shapes.recipe.FINAL_EVAL` (each training caption 32 times from its own
noise, 1024 images), like the pretrained model; the evaluations during training (256 images)
draw the learning curves. For each set, arm and reward the study reports the held-out mean and,
paired by seed, the mean difference to the weighted sum with its 95 % bootstrap interval
(:mod:`mogo_diffusion.bootstrap`); the same for the composite (each run's mean z-score over the
set's rewards, standardised by the arms' seed-averaged means, the pretrained model included).
Each of the paper's claims gets "reproduced", "not reproduced" or "undecided (CI spans T)", where
T is the claim's threshold below (0, 1/2 for (c), 0.97 for (e)), with its numbers:

(a) MARBLE (``marble_n10``) improves every reward over the pretrained model: every interval of
    its difference to the pretrained model above 0;
(b) MARBLE's composite is the best of all arms: above every other arm's, paired by seed;
(c) the weighted-sum direction opposes some reward in most mini-batches while MARBLE's opposes
    none: the conflict rate's interval above 1/2, and no harmonized cosine below ``-1e-6``;
(d) alpha shifts toward the rewards that are hard to improve: the rank correlation, over the
    rewards, between MARBLE's mean alpha and its specialist's improvement over the pretrained
    model (in units of that reward's spread across arms) is below 0;
(e) amortized MARBLE trains at >= 0.97x the weighted sum's throughput: the interval of the ratio
    of median epoch times, paired by seed, above 0.97.

``OUT`` gets ``results.json``, ``results.md`` and ``results.rst`` (the same tables, for the
docs), ``composite.png`` (the composite differences with their intervals) and ``curves.png`` (each
reward's held-out mean for its specialist, and for the weighted sum and MARBLE on the widest reward
set, against epochs and against minutes of training).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import spearmanr
from tqdm.auto import tqdm

from mogo_diffusion import compare
from mogo_diffusion.bootstrap import Interval, bootstrap_interval, paired_interval
from mogo_diffusion.config import Config
from mogo_diffusion.evaluate import composite_zscores, read_metrics
from mogo_diffusion.run_dir import RunDirError
from mogo_diffusion.shapes.recipe import FINAL_EVAL, REWARDS
from mogo_diffusion.tables import markdown_table, rst_table

__all__ = [
    "ARMS",
    "MARBLE",
    "QUICK_FINAL",
    "REFERENCE",
    "REWARD_SETS",
    "SPECIALIST_FLOOR",
    "analyse",
    "claims",
    "main",
    "plan",
    "specialist_gains",
]

REWARD_SETS: dict[str, tuple[str, ...]] = {
    "prompt_following": ("shapes_color", "shapes_shape", "clipscore", "shapes_position", "shapes_count"),
    "with_quality": REWARDS,
}
"""The two reward sets, frozen before the study's runs."""

ARMS = ("weighted_sum", "sequential", "marble_n1", "marble_n10", "upgrad_n10", "cagrad_n10")
"""The multi-reward arms trained on each reward set."""

MARBLE = "marble_n10"
"""The arm whose claims are judged, MARBLE amortized as the paper runs it."""

REFERENCE = "weighted_sum"
"""The arm every difference is paired against, the weighted sum of the rewards."""

SPECIALIST_FLOOR = 0.02
"""The smallest seed std a specialist's gain is judged against (the issue's bar is 3 x max(std, 0.02))."""

QUICK_FINAL = "shapes:heldout:24"
"""The final evaluation's prompts of a ``--quick`` smoke study."""

HARMONIZED_TOLERANCE = 1e-6
"""A harmonized direction opposes a reward when its cosine is below this (round-off of the Gram)."""


def plan(
    out: Path,
    *,
    sets: Sequence[str] = tuple(REWARD_SETS),
    arms: Sequence[str] = ARMS,
    ablations: Sequence[str] = compare.ABLATIONS,
    specialists: Sequence[str] | None = None,
    seeds: Sequence[int] = range(5),
    epochs: int = compare.EPOCHS,
    quick: bool = False,
) -> dict[tuple[str, str, int], Config]:
    """Every run of the study, ``(group, arm, seed) -> config``, where ``group`` is a reward set
    or ``"specialists"`` (trained once on every reward; by default one for each reward of the
    sets). Ablations run on the first set."""
    runs: dict[tuple[str, str, int], Config] = {}
    rewards = sorted({r for name in sets for r in REWARD_SETS[name]}, key=REWARDS.index)
    if specialists is not None:
        if unknown := sorted(set(specialists) - set(rewards)):
            raise ValueError(f"specialists {unknown} are not rewards of the sets {list(sets)}")
        rewards = [r for r in rewards if r in specialists]

    def add(group: str, arm: str, seed: int, names: Sequence[str] | None) -> None:
        path = out / "runs" / group / arm.replace(":", "-") / f"seed{seed}"
        runs[group, arm, seed] = compare.arm_config(
            arm, seed, path, epochs=epochs, quick=quick, rewards=names
        )

    for seed in seeds:
        for reward in rewards:
            add("specialists", f"single:{reward}", seed, None)
        for index, name in enumerate(sets):
            for arm in (*arms, *(ablations if index == 0 else ())):
                add(name, arm, seed, REWARD_SETS[name])
    return runs


def analyse(
    names: Sequence[str],
    base: Mapping[str, float],
    histories: Mapping[str, Mapping[int, Sequence[Mapping[str, Any]]]],
    finals: Mapping[str, Mapping[int, Mapping[str, float]]] | None = None,
) -> dict[str, Any]:
    """The numbers of one reward set.

    Args:
        names: the set's rewards.
        base: the pretrained model's held-out means (``eval/<name>``).
        histories: arm to seed to its run's metrics records (the last evaluation counts).
        finals: arm to seed to its run's final evaluation (``eval/<name>``,
            :func:`~mogo_diffusion.compare.final_means`), which then counts instead; ``base``
            must then be the pretrained model's on the same prompts.

    Returns:
        A dict of ``rewards``, ``seeds``, ``base`` (the pretrained model's means), ``arms`` (for
        each arm its per-seed ``means`` per reward and ``composite``, and its ``vs_reference`` and
        ``vs_base`` intervals per reward and for the composite, each ``[mean, low, high]``) and
        ``claims`` (:func:`claims`).
    """
    seeds = sorted(histories[REFERENCE])

    def held_out(arm: str, seed: int) -> list[float]:
        if finals is None:
            return compare.last_evaluation(histories[arm][seed], names)
        return [float(finals[arm][seed][f"eval/{name}"]) for name in names]

    means = {arm: {s: held_out(arm, s) for s in seeds} for arm in histories}
    base_means = [float(base[f"eval/{name}"]) for name in names]
    averaged = {arm: np.mean([means[arm][s] for s in seeds], axis=0).tolist() for arm in means}
    averaged["base"] = base_means
    composite = {
        arm: [composite_zscores({"run": means[arm][s]}, reference=averaged)["run"] for s in seeds]
        for arm in means
    }
    base_composite = composite_zscores({"base": base_means}, reference=averaged)["base"]
    rows: dict[str, Any] = {}
    for arm in means:
        per_reward = {k: [means[arm][s][i] for s in seeds] for i, k in enumerate(names)}
        reference = {k: [means[REFERENCE][s][i] for s in seeds] for i, k in enumerate(names)}
        rows[arm] = {
            "means": per_reward,
            "composite": composite[arm],
            "vs_reference": {
                **{k: _interval(per_reward[k], reference[k], arm) for k in names},
                "composite": _interval(composite[arm], composite[REFERENCE], arm),
            },
            "vs_base": {
                **{k: _interval(per_reward[k], base_means[i], None) for i, k in enumerate(names)},
                "composite": _interval(composite[arm], base_composite, None),
            },
        }
    summary = {"rewards": list(names), "seeds": seeds, "base": base_means, "arms": rows}
    summary["specialists"] = specialist_gains(summary)
    summary["claims"] = claims(summary, histories)
    return summary


def specialist_gains(summary: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Whether RL works, reward by reward: each trained specialist's own held-out reward against the
    pretrained model's, ``gain = mean_s m_s - base``, and the bar it must clear,
    ``3 max(std_s m_s, SPECIALIST_FLOOR)`` (sample std over seeds)."""
    gains = {}
    for i, name in enumerate(summary["rewards"]):
        row = summary["arms"].get(f"single:{name}")
        if row is None:
            continue
        values = row["means"][name]
        std = statistics.stdev(values) if len(values) > 1 else math.nan
        gain, bar = statistics.fmean(values) - summary["base"][i], 3 * max(std, SPECIALIST_FLOOR)
        gains[name] = {"base": summary["base"][i], "mean": statistics.fmean(values), "std": std,
                       "gain": gain, "bar": bar, "clears": bool(gain >= bar)}  # fmt: skip
    return gains


def _interval(values: Sequence[float], reference: Sequence[float] | float, arm: str | None) -> list[float]:
    return [0.0, 0.0, 0.0] if arm == REFERENCE else _as_list(paired_interval(values, reference))


def _verdict(intervals: Sequence[Sequence[float]], *, threshold: float = 0.0) -> str:
    """ "reproduced" if every interval lies above ``threshold``, "not reproduced" if one lies below
    it, else "undecided (CI spans <threshold>)"."""
    if all(low > threshold for _, low, _ in intervals):
        return "reproduced"
    if any(high < threshold for _, _, high in intervals):
        return "not reproduced"
    return f"undecided (CI spans {threshold:g})"


def _as_list(interval: Interval) -> list[float]:
    return [interval.mean, interval.low, interval.high]


def claims(summary: Mapping[str, Any], histories: Mapping[str, Mapping[int, Sequence[Mapping]]]) -> dict:
    """Claims (a)-(e) of the module docstring, each ``{"verdict", "numbers"}``; a claim whose arms
    were not run is left out."""
    rows, names, seeds = summary["arms"], summary["rewards"], summary["seeds"]
    result: dict[str, Any] = {}
    if MARBLE not in rows:
        return result
    marble = rows[MARBLE]
    a = {name: marble["vs_base"][name] for name in names}
    result["a"] = {"verdict": _verdict(list(a.values())), "numbers": a}
    others = {arm: row for arm, row in rows.items() if arm != MARBLE}
    b = {arm: _as_list(paired_interval(marble["composite"], row["composite"])) for arm, row in others.items()}
    b["base"] = marble["vs_base"]["composite"]
    result["b"] = {"verdict": _verdict(list(b.values())), "numbers": b}
    finals = [histories[MARBLE][s][-1] for s in seeds]
    if all("conflict_rate" in f for f in finals):
        rate = bootstrap_interval([f["conflict_rate"] for f in finals])
        worst = min(f["worst_cosine_marble"] for f in finals)
        verdict = _verdict([_as_list(rate)], threshold=0.5)
        if worst < -HARMONIZED_TOLERANCE:
            verdict = "not reproduced"
        numbers = {"conflict_rate": _as_list(rate), "worst_cosine_marble": worst}
        result["c"] = {"verdict": verdict, "numbers": numbers}
    specialists = [f"single:{name}" for name in names]
    if all(arm in rows for arm in specialists) and all(f"alpha/{n}" in finals[0] for n in names):
        spreads = _reward_spreads(rows, names)
        improvement = [
            rows[f"single:{n}"]["vs_base"][n][0] / max(spread, 1e-12)
            for n, spread in zip(names, spreads, strict=True)
        ]
        alphas = [[_mean_alpha(histories[MARBLE][s], n) for n in names] for s in seeds]
        d = bootstrap_interval([_spearman(alpha, improvement) for alpha in alphas])
        result["d"] = {  # reproduced when the correlation is below 0: -rho above 0
            "verdict": _verdict([[-d.mean, -d.high, -d.low]]),
            "numbers": {
                "rank_correlation": _as_list(d),
                "mean_alpha": np.mean(alphas, axis=0).tolist(),
                "specialist_improvement_z": improvement,
            },
        }
    if REFERENCE in histories:
        ratios = [
            statistics.median(r["seconds"] for r in histories[REFERENCE][s])
            / statistics.median(r["seconds"] for r in histories[MARBLE][s])
            for s in seeds
        ]
        e = bootstrap_interval(ratios)
        result["e"] = {"verdict": _verdict([_as_list(e)], threshold=0.97), "numbers": _as_list(e)}
    return result


def _mean_alpha(history: Sequence[Mapping[str, Any]], name: str) -> float:
    """A run's alpha of reward ``name``, averaged over the epochs that logged it."""
    return statistics.fmean(r[f"alpha/{name}"] for r in history if f"alpha/{name}" in r)


def _reward_spreads(rows: Mapping[str, Any], names: Sequence[str]) -> list[float]:
    """Each reward's std over the arms' seed-averaged held-out means."""
    return [float(np.std([statistics.fmean(row["means"][n]) for row in rows.values()])) for n in names]


def _spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (ties at their average rank); 0 when either side is constant."""
    if len(set(x)) < 2 or len(set(y)) < 2:
        return 0.0
    return float(spearmanr(x, y).statistic)


def _tables(summary: Mapping[str, Any]) -> list[tuple[str, list[list[str]]]]:
    """One reward set's tables, each ``(caption, rows)`` with the header row first: every arm's
    held-out means with the paired difference to :data:`REFERENCE`, the specialists' gains against
    their bar, the claims."""
    names = summary["rewards"]
    arms = [["arm", *names, "composite"], ["base", *(f"{v:.3f}" for v in summary["base"]), ""]]
    for arm, row in summary["arms"].items():
        cells = [
            f"{statistics.fmean(row['means'][n]):.3f} ({_signed(row['vs_reference'][n])})" for n in names
        ]
        composite = f"{statistics.fmean(row['composite']):+.2f} ({_signed(row['vs_reference']['composite'])})"
        arms.append([arm, *cells, composite])
    tables = [(f"Seeds {summary['seeds']}: the mean over seeds, then the mean difference to {REFERENCE} "
               "paired by seed with its 95 % bootstrap interval.", arms)]  # fmt: skip
    if summary["specialists"]:
        gains = [["reward", "base", "specialist", "seed std", "gain", "bar", "clears"]]
        for reward, g in summary["specialists"].items():
            numbers = (g["base"], g["mean"], g["std"])
            cells = [*(f"{v:.3f}" for v in numbers), f"{g['gain']:+.3f}", f"{g['bar']:.3f}"]
            gains.append([reward, *cells, "yes" if g["clears"] else "no"])
        caption = (
            "Each specialist's own reward: its gain over the pretrained model against "
            f"3 x max(seed std, {SPECIALIST_FLOOR})."
        )
        tables.append((caption, gains))
    claimed = [["claim", "verdict", "numbers"]]
    claimed += [
        [f"({key})", claim["verdict"], _numbers(claim["numbers"])] for key, claim in summary["claims"].items()
    ]
    tables.append(("The paper's claims.", claimed))
    return tables


def _markdown(results: Mapping[str, Any]) -> str:
    """The study's tables (:func:`_tables` of every set) as markdown."""
    lines = [f"Command: `{results['command']}`", "", _judged(results), ""]
    for name, summary in results["sets"].items():
        lines += [f"## {name}", ""]
        for caption, rows in _tables(summary):
            lines += [caption, "", markdown_table(rows), ""]
    return "\n".join(lines)


def _rst(results: Mapping[str, Any]) -> str:
    """The study's tables as reStructuredText list-tables, for the docs."""
    blocks = [f"Command: ``{results['command']}``", _judged(results)]
    for name, summary in results["sets"].items():
        blocks.append(f"**{name}**")
        blocks += [rst_table(rows, caption) for caption, rows in _tables(summary)]
    return "\n\n".join(blocks) + "\n"


def _judged(results: Mapping[str, Any]) -> str:
    return (f"Held-out means: each run's last weights and the pretrained model on "
            f"{Path(results['final_evaluation']).name}, from the same noise.")  # fmt: skip


def _signed(interval: Sequence[float]) -> str:
    mean, low, high = interval
    return f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]"


def _numbers(numbers: Any) -> str:
    if isinstance(numbers, Mapping):
        return "; ".join(f"{k}: {_numbers(v)}" for k, v in numbers.items())
    if isinstance(numbers, Sequence) and len(numbers) == 3 and all(isinstance(v, float) for v in numbers):
        return _signed(numbers)
    if isinstance(numbers, Sequence):
        return "[" + ", ".join(f"{v:+.2f}" for v in numbers) + "]"
    return f"{numbers:.3g}"


def _figure(results: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = results["sets"]
    figure, axes = plt.subplots(1, len(sets), figsize=(5.2 * len(sets), 4.2), squeeze=False)
    for axis, (name, summary) in zip(axes[0], sets.items(), strict=True):
        arms = list(summary["arms"])
        intervals = np.array([summary["arms"][arm]["vs_reference"]["composite"] for arm in arms])
        y = np.arange(len(arms))
        axis.errorbar(
            intervals[:, 0], y, xerr=[intervals[:, 0] - intervals[:, 1], intervals[:, 2] - intervals[:, 0]],
            fmt="o", color="tab:red", ecolor="gray", capsize=3,
        )  # fmt: skip
        axis.axvline(0, color="black", linewidth=0.5)
        axis.set_yticks(y, arms, fontsize=7)
        axis.set_xlabel(f"composite minus {REFERENCE}'s\n(95 % paired bootstrap interval)")
        axis.set_title(name, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


_CURVE_AXES = (("epoch", "epoch"), ("minutes", "minutes of training (one thread)"))
"""The rows of ``curves.png``: each a key of :func:`_curve`'s points and its axis label."""


def _curves(
    names: Sequence[str],
    base: Mapping[str, float],
    histories: Mapping[str, Mapping[int, Sequence[Mapping[str, Any]]]],
    path: Path,
    title: str,
) -> None:
    """One column per reward: its held-out mean at every evaluation, for each seed of its
    specialist (thin) and averaged over seeds for the specialist, :data:`REFERENCE` and
    :data:`MARBLE`, with the pretrained model's value dashed; against epochs in the top row (the
    recipe's epoch is one optimizer step), against the minutes of training (the epochs' summed
    ``seconds`` of one thread, evaluation excluded) in the bottom row; ``title`` above."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, len(names), figsize=(3.1 * len(names), 5.6), squeeze=False)
    styles = {"specialist": "tab:blue", REFERENCE: "tab:gray", MARBLE: "tab:red"}
    for column, name in enumerate(names):
        key = f"eval/{name}"
        for label, arm in (("specialist", f"single:{name}"), (REFERENCE, REFERENCE), (MARBLE, MARBLE)):
            curves = [c for c in (_curve(h, key, base[key]) for h in histories.get(arm, {}).values()) if c]
            if not curves:
                continue
            length = min(len(c) for c in curves)
            for row, (x, _) in enumerate(_CURVE_AXES):
                axis = axes[row][column]
                if label == "specialist":
                    for curve in curves:
                        xs, ys = [p[x] for p in curve], [p["value"] for p in curve]
                        axis.plot(xs, ys, color=styles[label], alpha=0.25, linewidth=0.8)
                xs = [statistics.fmean(c[i][x] for c in curves) for i in range(length)]
                ys = [statistics.fmean(c[i]["value"] for c in curves) for i in range(length)]
                axis.plot(xs, ys, color=styles[label], marker="o", markersize=3, label=label)
        for axis, (_, xlabel) in zip(axes[:, column], _CURVE_AXES, strict=True):
            axis.axhline(base[key], color="black", linestyle="--", linewidth=0.8, label="pretrained")
            axis.set_xlabel(xlabel, fontsize=8)
        axes[0][column].set_title(name, fontsize=9)
    for row in axes:
        row[0].set_ylabel("held-out mean", fontsize=8)
    axes[0][-1].legend(fontsize=7)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _curve(history: Sequence[Mapping[str, Any]], key: str, start: float) -> list[dict[str, float]]:
    """A run's evaluations of ``key``: the epochs done, the minutes of training until then and the
    value, after the pretrained model's value ``start`` at 0; empty if the run logged none."""
    points, seconds = [{"epoch": 0, "minutes": 0.0, "value": start}], 0.0
    for record in history:
        seconds += record.get("seconds", 0.0)
        if key in record:
            points.append({"epoch": record["epoch"] + 1, "minutes": seconds / 60, "value": record[key]})
    return points if len(points) > 1 else []


def _unfinished_seeds(runs: Mapping[tuple[str, str, int], Config], final: str) -> set[int]:
    """The seeds of ``runs`` with a run that has not finished with its final evaluation (one
    written before run records counts as finished, read as it is: :func:`compare.decide`).

    Raises:
        RunDirError: a run is refused (another config's, in use, or damaged)."""
    decisions = {key: _read_only(compare.decide(config, final)) for key, config in runs.items()}
    compare.report(decisions, runs)
    refused = [f"{runs[key].train.out_dir}: {d.why}" for key, d in decisions.items() if d.action == "refuse"]
    if refused:
        raise RunDirError(f"{len(refused)} run(s) refused:\n" + "\n".join(refused))
    return {seed for (_, _, seed), d in decisions.items() if d.action == "skip"}


def _read_only(decision: compare.Decision) -> compare.Decision:
    """``decision`` for ``--no-train``: a run that would be trained or evaluated is skipped."""
    if decision.action in ("reuse", "legacy", "refuse"):
        return decision
    return compare.Decision("skip", f"{decision.why}: its seed is left out")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mogo_diffusion.study",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("runs/study"), help="output directory")
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 per arm (at least 2)")
    parser.add_argument("--epochs", type=int, default=compare.EPOCHS, help="epochs per run")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each")
    parser.add_argument("--sets", default=",".join(REWARD_SETS), help="comma-separated reward sets")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated multi-reward arms")
    parser.add_argument("--no-ablations", action="store_true", help="leave the ablation arms out")
    parser.add_argument(
        "--specialists", default="all", help="comma-separated rewards to train specialists for, or all"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny budget, not a result")
    parser.add_argument(
        "--no-train", action="store_true",
        help="train nothing: the results of the seeds whose runs have all finished (a study in progress)",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> dict:
    """Run (or continue) the study; returns its results (also ``OUT/results.json``)."""
    parser = _parser()
    args = parser.parse_args(argv)
    sets = [name for name in args.sets.split(",") if name]
    if unknown := [name for name in sets if name not in REWARD_SETS]:
        parser.error(f"unknown reward sets {unknown}; sets: {', '.join(REWARD_SETS)}")
    arms = [arm for arm in args.arms.split(",") if arm]
    if REFERENCE not in arms:
        parser.error(f"--arms must include {REFERENCE!r}, the arm every difference is paired against")
    if args.seeds < 2:
        parser.error("--seeds must be at least 2: a paired interval needs more than one seed")
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    try:
        runs = plan(
            args.out, sets=sets, arms=arms, ablations=() if args.no_ablations else compare.ABLATIONS,
            specialists=None if args.specialists == "all" else args.specialists.split(","),
            seeds=range(args.seeds), epochs=args.epochs, quick=args.quick,
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    seeds = list(range(args.seeds))
    final = QUICK_FINAL if args.quick else str(FINAL_EVAL)
    started = time.perf_counter()
    try:
        if args.no_train:
            unfinished = _unfinished_seeds(runs, final)
            seeds = [s for s in seeds if s not in unfinished]
            if len(seeds) < 2:
                parser.error(f"--no-train needs two seeds whose runs have all finished in {args.out}; "
                             f"finished: {seeds}")  # fmt: skip
            runs = {key: c for key, c in runs.items() if key[2] in seeds}
            base = compare.evaluate_base(next(iter(runs.values())), args.out / "runs" / "base" / "eval.json",
                                         legacy=True)  # fmt: skip
        else:
            base = compare.run_all(runs, args.out / "runs" / "base" / "eval.json", jobs=args.jobs,
                                   final=final)  # fmt: skip
        base_final = compare.evaluate_base(
            next(iter(runs.values())), args.out / "runs" / "base" / "final_eval.json", prompts=final,
            legacy=args.no_train,
        )  # fmt: skip
    except RunDirError as error:
        parser.error(str(error))
    results: dict[str, Any] = {"sets": {}}
    curves: dict[str, Any] = {}
    for name in sets:
        trained = {arm for group, arm, _ in runs if group == "specialists"}
        order = [
            *(f"single:{r}" for r in REWARD_SETS[name] if f"single:{r}" in trained),
            *dict.fromkeys(arm for group, arm, _ in runs if group == name),
        ]
        runs_of = {
            arm: {s: Path(runs["specialists" if arm.startswith("single:") else name, arm, s].train.out_dir)
                  for s in seeds}
            for arm in order
        }  # fmt: skip
        histories = {arm: {s: read_metrics(d) for s, d in dirs.items()} for arm, dirs in runs_of.items()}
        finals = {arm: {s: compare.final_means(d) for s, d in dirs.items()} for arm, dirs in runs_of.items()}
        results["sets"][name] = analyse(REWARD_SETS[name], base_final, histories, finals)
        curves[name] = histories
    results["command"] = "python -m mogo_diffusion.study " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    results["final_evaluation"] = final
    results["seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "results.md").write_text(_markdown(results))
    (args.out / "results.rst").write_text(_rst(results))
    _figure(results, args.out / "composite.png")
    widest = max(sets, key=lambda name: len(REWARD_SETS[name]))
    title = f"{widest}: each specialist on its own reward, {REFERENCE} and {MARBLE} on all of them"
    _curves(REWARD_SETS[widest], base, curves[widest], args.out / "curves.png", title)
    tqdm.write(_markdown(results))
    return results


if __name__ == "__main__":
    main()
