"""The shapes-world study that can decide MARBLE's claims: ``python -m mogo_diffusion.study``.

The study is :mod:`mogo_diffusion.compare` configured for the shapes world (its plan, runs,
statistics, tables and figures are compare's): every arm is trained with the same budget and
seeds on two reward sets, frozen before any run:

.. code-block:: text

    prompt_following   shapes_color, shapes_shape, clipscore (global),
                       shapes_position, shapes_count (specialists, NaN elsewhere)
    with_quality       the same plus jpeg_compressibility, which pulls against all of them

The specialists (``single:<reward>``) are trained once, with every reward evaluated, and belong to
both sets; the multi-reward arms (:data:`ARMS`) and the ablations (:data:`~mogo_diffusion.compare.ABLATIONS`,
on ``prompt_following``) are trained for each set, and with ``--front`` each set's weighted-sum
front (its K + 1 weight vectors). Runs live in ``OUT/runs/<set or
specialists>/<arm>/seed<s>``; a finished run of the same config is never rerun and an unfinished
one is resumed, so the study can be stopped and continued (:func:`compare.gather
<mogo_diffusion.compare.gather>`, which refuses the runs of another config, never deleting them).
``--no-train`` reads the runs of the seeds that have finished, from their directories or their
compact form in ``OUT/runs.json.xz``, runs made before run records (``run.json``) included, as
they are; ``--last-evaluation`` judges each run by its last evaluation during training, as the
first study did.

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
    (c, across halves) the same rate measured free of a gradient's own noise, by :data:`CROSS`'s
    runs: each half's weighted-sum direction against the other half's reward gradients (its
    harmonized cosines are reported, not judged: across halves the min-norm point's guarantee
    does not hold);
(d) alpha shifts toward the rewards that are hard to improve: the rank correlation, over the
    rewards, between MARBLE's mean alpha and its specialist's improvement over the pretrained
    model (in units of that reward's spread across arms) is below 0;
(e) amortized MARBLE trains at >= 0.97x the weighted sum's throughput: the interval of the ratio
    of median epoch times, paired by seed, above 0.97.

``OUT`` gets ``results.json``, ``results.md`` and ``results.rst`` (the same tables, for the
docs), ``judged.md`` and ``.rst`` (each set judged as :func:`~mogo_diffusion.analysis.judge`
judges, the weighted sum its own front), ``composite.png`` (the composite differences with their
intervals), ``front.png`` (every arm's gains on the widest set) and ``curves.png`` (each reward's
held-out mean for its specialist, and for the weighted sum and MARBLE on the widest reward set,
against the images trained on and the CPU minutes of training), and ``runs.json.xz``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import spearmanr

from mogo_diffusion import analysis, compare, tables
from mogo_diffusion.bootstrap import bootstrap_interval, paired_interval
from mogo_diffusion.config import Config
from mogo_diffusion.run_dir import RunDirError
from mogo_diffusion.shapes.recipe import FINAL_EVAL, REWARDS

__all__ = [
    "ARMS",
    "CROSS",
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
CROSS = "marble_n10_cross"
""":data:`MARBLE` on the cross-fitted Gram matrix, whose runs log the conflict statistics across
the micro-batch's halves that claim (c) is judged on a second time."""

REFERENCE = "weighted_sum"
"""The arm every difference is paired against, the weighted sum of the rewards."""

SPECIALIST_FLOOR = 0.02
"""The smallest seed std a specialist's gain is judged against (the issue's bar is 3 x max(std, 0.02))."""

QUICK_FINAL = "shapes:heldout:24"
"""The final evaluation's prompts of a ``--quick`` smoke study."""

HARMONIZED_TOLERANCE = 1e-6
"""A harmonized direction opposes a reward when its cosine is below this (round-off of the Gram)."""

SPECIALISTS = "specialists"
"""The group of the specialists' runs, shared by the reward sets."""


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
    front: bool = False,
) -> dict[tuple[str, str, int], Config]:
    """Every run of the study, ``(group, arm, seed) -> config``, where ``group`` is a reward set
    or ``"specialists"`` (trained once on every reward; by default one for each reward of the
    sets), each :func:`compare.plan <mogo_diffusion.compare.plan>`'s on the shapes world
    (:func:`~mogo_diffusion.compare.default_base`). Ablations run on the first set; with
    ``front``, each set adds the weighted-sum front of its K rewards
    (:func:`~mogo_diffusion.compare.front_arms`), but for a point that is already an arm."""
    rewards = sorted({r for name in sets for r in REWARD_SETS[name]}, key=REWARDS.index)
    if specialists is not None:
        if unknown := sorted(set(specialists) - set(rewards)):
            raise ValueError(f"specialists {unknown} are not rewards of the sets {list(sets)}")
        rewards = [r for r in rewards if r in specialists]
    options = {"base": compare.default_base(quick), "epochs": epochs, "quick": quick}
    groups = {SPECIALISTS: ([f"single:{r}" for r in rewards], None)}
    for index, name in enumerate(sets):
        chosen = [*arms, *(ablations if index == 0 else ())]
        if front:
            chosen += compare.front_points(chosen, options["base"], rewards=REWARD_SETS[name])
        groups[name] = (chosen, REWARD_SETS[name])
    return {
        (group, arm, seed): config
        for group, (chosen, names) in groups.items()
        for (arm, seed), config in compare.plan(
            chosen, seeds, out, group=group, rewards=names, **options
        ).items()
    }


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
        :func:`~mogo_diffusion.analysis.summarize`'s summary against :data:`REFERENCE` (per arm
        its per-seed ``means`` per reward and ``composite``, and its ``vs_reference`` and
        ``vs_base`` intervals), with ``specialists`` (:func:`specialist_gains`), ``claims``
        (:func:`claims`) and ``judged`` (:func:`~mogo_diffusion.analysis.judge` against the
        weighted-sum front: the arms ``weighted_sum@w`` of ``--front`` and the weighted sum).
    """
    seeds = sorted(histories[REFERENCE])

    def held_out(arm: str, seed: int) -> list[float]:
        final = None if finals is None else finals[arm][seed]
        return compare.RunResults(histories[arm][seed], final).held_out(names)

    means = {arm: {s: held_out(arm, s) for s in seeds} for arm in histories}
    summary = analysis.summarize(names, [base[f"eval/{name}"] for name in names], means, REFERENCE)
    summary["specialists"] = specialist_gains(summary)
    summary["claims"] = claims(summary, histories)
    front = [arm for arm in histories if arm == REFERENCE or arm.startswith(f"{REFERENCE}@")]
    summary["judged"] = analysis.judge(summary, reference=REFERENCE, front=front)
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


def _verdict(intervals: Sequence[Sequence[float]], *, threshold: float = 0.0) -> str:
    """ "reproduced" if every interval lies above ``threshold``, "not reproduced" if one lies below
    it, else "undecided (CI spans <threshold>)"."""
    if all(low > threshold for _, low, _ in intervals):
        return "reproduced"
    if any(high < threshold for _, _, high in intervals):
        return "not reproduced"
    return f"undecided (CI spans {threshold:g})"


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
    b = {
        arm: analysis.as_list(paired_interval(marble["composite"], row["composite"]))
        for arm, row in others.items()
    }
    b["base"] = marble["vs_base"]["composite"]
    result["b"] = {"verdict": _verdict(list(b.values())), "numbers": b}
    cost = compare.costs({arm: histories[arm] for arm in (REFERENCE, MARBLE)}, REFERENCE)[MARBLE]
    if "conflict_rate" in cost:
        verdict = _verdict([cost["conflict_rate"]], threshold=0.5)
        if cost["worst_cosine_marble"] < -HARMONIZED_TOLERANCE:
            verdict = "not reproduced"
        numbers = {"conflict_rate": cost["conflict_rate"], "worst_cosine_marble": cost["worst_cosine_marble"]}
        result["c"] = {"verdict": verdict, "numbers": numbers}
    if CROSS in histories:
        crossed = compare.costs({arm: histories[arm] for arm in (REFERENCE, CROSS)}, REFERENCE)[CROSS]
        if "conflict_rate_cross" in crossed:
            keys = ("conflict_rate_cross", "worst_cosine_weighted_sum_cross", "worst_cosine_marble_cross")
            verdict = _verdict([crossed["conflict_rate_cross"]], threshold=0.5)
            result["c, across halves"] = {"verdict": verdict, "numbers": {k: crossed[k] for k in keys}}
    specialists = [f"single:{name}" for name in names]
    last = histories[MARBLE][seeds[0]][-1]
    if all(arm in rows for arm in specialists) and all(f"alpha/{n}" in last for n in names):
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
                "rank_correlation": analysis.as_list(d),
                "mean_alpha": np.mean(alphas, axis=0).tolist(),
                "specialist_improvement_z": improvement,
            },
        }
    result["e"] = {"verdict": _verdict([cost["throughput"]], threshold=0.97), "numbers": cost["throughput"]}
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


def _tables(summary: Mapping[str, Any]) -> list[tables.Table]:
    """One reward set's tables: every arm's held-out means with the paired difference to
    :data:`REFERENCE` (:func:`~mogo_diffusion.tables.arms_table`), the specialists' gains against
    their bar, the claims."""
    result = [tables.arms_table(summary, REFERENCE)]
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
        result.append((caption, gains))
    claimed = [["claim", "verdict", "numbers"]]
    claimed += [
        [f"({key})", claim["verdict"], _numbers(claim["numbers"])] for key, claim in summary["claims"].items()
    ]
    result.append(("The paper's claims.", claimed))
    return result


def _numbers(numbers: Any) -> str:
    if isinstance(numbers, Mapping):
        return "; ".join(f"{k}: {_numbers(v)}" for k, v in numbers.items())
    if isinstance(numbers, Sequence) and len(numbers) == 3 and all(isinstance(v, float) for v in numbers):
        return tables.signed(numbers)
    if isinstance(numbers, Sequence):
        return "[" + ", ".join(f"{v:+.2f}" for v in numbers) + "]"
    return f"{numbers:.3g}"


def _write(out: Path, results: Mapping[str, Any], gathered: compare.Gathered) -> None:
    """The study's tables (``results``, ``judged``), ``results.json`` and figures into ``out``."""
    from mogo_diffusion import figures

    sets = results["sets"]
    note = compare.judged_on(results["final_evaluation"])
    results_tables = {name: _tables(summary) for name, summary in sets.items()}
    tables.write_documents(out, "results", results["command"], [note], results_tables)
    judged = {name: tables.judged_tables(summary["judged"], REFERENCE) for name, summary in sets.items()}
    tables.write_documents(out, "judged", results["command"], [note], judged)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    composite = {
        name: {arm: row["vs_reference"]["composite"] for arm, row in s["arms"].items()}
        for name, s in sets.items()
    }
    xlabel = f"composite minus {REFERENCE}'s\n(95 % paired bootstrap interval)"
    figures.save(figures.intervals(composite, xlabel), out / "composite.png")
    widest = max(sets, key=lambda name: len(REWARD_SETS[name]))
    figures.save(figures.front(sets[widest]["judged"]), out / "front.png")
    names = REWARD_SETS[widest]

    def seeds_of(arm: str) -> list[list[dict]]:
        group = SPECIALISTS if arm.startswith("single:") else widest
        return [
            gathered.results[key].metrics
            for s in gathered.seeds
            if (key := (group, arm, s)) in gathered.results
        ]

    lines = {
        "specialist": {name: seeds_of(f"single:{name}") for name in names},
        REFERENCE: dict.fromkeys(names, seeds_of(REFERENCE)),
        MARBLE: dict.fromkeys(names, seeds_of(MARBLE)),
    }
    title = f"{widest}: each specialist on its own reward, {REFERENCE} and {MARBLE} on all of them"
    figures.save(figures.curves(names, gathered.base, lines, title), out / "curves.png")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mogo_diffusion.study",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--sets", default=",".join(REWARD_SETS), help="comma-separated reward sets")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated multi-reward arms")
    parser.add_argument("--no-ablations", action="store_true", help="leave the ablation arms out")
    parser.add_argument(
        "--front", action="store_true", help="add each set's weighted-sum front (K + 1 weight vectors)"
    )
    parser.add_argument(
        "--last-evaluation", action="store_true",
        help="judge each run by its last evaluation in training (as the first study did), not a final one",
    )  # fmt: skip
    compare.add_run_arguments(parser, out="runs/study", seeds=5)
    parser.set_defaults(specialists="all")
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
            seeds=range(args.seeds), epochs=args.epochs or compare.EPOCHS, quick=args.quick,
            front=args.front,
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    final = None if args.last_evaluation else QUICK_FINAL if args.quick else str(FINAL_EVAL)
    started = time.perf_counter()
    try:
        gathered = compare.gather(runs, args.out, final=final, jobs=args.jobs, train=not args.no_train)
    except RunDirError as error:
        parser.error(str(error))
    if len(gathered.seeds) < 2:
        parser.error(f"--no-train needs two seeds whose runs have all finished in {args.out}; "
                     f"finished: {gathered.seeds}")  # fmt: skip
    results: dict[str, Any] = {"sets": {}}
    for name in sets:
        trained = {arm for group, arm, _ in runs if group == SPECIALISTS}
        order = [
            *(f"single:{r}" for r in REWARD_SETS[name] if f"single:{r}" in trained),
            *dict.fromkeys(arm for group, arm, _ in runs if group == name),
        ]
        found = {
            arm: {
                s: gathered.results[SPECIALISTS if arm.startswith("single:") else name, arm, s]
                for s in gathered.seeds
            }
            for arm in order
        }
        histories = {arm: {s: r.metrics for s, r in seeds.items()} for arm, seeds in found.items()}
        finals = {arm: {s: r.final for s, r in seeds.items()} for arm, seeds in found.items()}
        judged = analyse(
            REWARD_SETS[name], gathered.judged_base, histories, None if final is None else finals
        )
        results["sets"][name] = judged
    results["command"] = compare.command_line("mogo_diffusion.study", argv)
    results["final_evaluation"] = final
    results["seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    _write(args.out, results, gathered)
    print((args.out / "results.md").read_text())
    return results


if __name__ == "__main__":
    main()
