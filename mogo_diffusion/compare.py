"""The paper's comparison on the shapes world: ``python -m mogo_diffusion.compare``.

Every arm trains from :func:`~mogo_diffusion.shapes.recipe.shapes_config` on all of the world's
rewards, a sample a reward does not apply to left out of that reward's loss (the settings the
study's arms were frozen with), with the same budget (:data:`EPOCHS` epochs of the same samples
per epoch, the same optimizer) and the same seeds, and
is evaluated on the same held-out prompts and noise
(:meth:`Trainer.evaluate <mogo_diffusion.train.Trainer.evaluate>`):

.. code-block:: text

    base                   the pretrained model (no training; the adapter starts at zero)
    single:<reward>        one specialist per reward
    weighted_sum           one advantage of sum_k R_k (raw rewards, weights 1)
    weighted_sum_z         one advantage of sum_k z(R_k) (each reward z-scored over the batch)
    sequential             one reward at a time, stages cycling twice through the rewards
    marble_n1              MARBLE, alpha solved at every step
    marble_n10             MARBLE amortized: alpha re-solved every 10 steps, EMA 0.9 in between,
                           estimated on the first trained timestep of each step's window
    marble_n10_window      the same, alpha estimated on the whole window (K gradient buffers)
    upgrad_n10, cagrad_n10 UPGrad and CAGrad (mogo.WEIGHTINGS) amortized as marble_n10; any
                           registered weighting runs as the arm <name>_n10
    ablations              marble_n10_neutral, marble_n10_noema, mgda_n10 (with --arms; ABLATIONS)

Each run is a ``python -m mogo_diffusion.train --config`` subprocess (``--jobs`` at a time, one
thread each) in ``OUT/runs/<arm>/seed<s>`` (:func:`run_all`). A finished run of the same config
is reused and an unfinished one resumed from its latest checkpoint (or restarted, without one), so
an interrupted comparison continues where it stopped; a run of another config (other epochs,
another ``--quick``) is refused, never deleted, and nothing is trained; a line says what is done
with each run (:func:`decide`). ``OUT`` then holds
``results.json``, ``results.md`` (per-reward held-out means with their spread over seeds, the
composite mean z-score, conflict statistics and wall-time ratios), the same tables as
``results.rst``, and the figures ``pareto.png``, ``rewards.png`` and ``alpha.png``.
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
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, NamedTuple

from tqdm.auto import tqdm

import mogo
from mogo_diffusion import run_dir
from mogo_diffusion.checkpoint import CheckpointError, latest_checkpoint
from mogo_diffusion.config import Config
from mogo_diffusion.evaluate import composite_zscores, prompts_digest, read_metrics, reward_zscores
from mogo_diffusion.prompts import load_prompt_set
from mogo_diffusion.run_dir import RunDirError
from mogo_diffusion.shapes.recipe import REWARDS, reward_specs, shapes_config
from mogo_diffusion.tables import markdown_table, rst_table

__all__ = [
    "ABLATIONS",
    "EPOCHS",
    "EVALUATIONS",
    "FINAL_EVAL",
    "QUICK",
    "WEIGHTING_ARMS",
    "Decision",
    "arm_config",
    "arms",
    "base_evaluation",
    "decide",
    "done",
    "evaluate_base",
    "final_means",
    "frozen_sections",
    "last_evaluation",
    "main",
    "report",
    "run_all",
    "summarize",
    "tables",
]

QUICK: dict[str, Any] = {
    "sampling": {"prompts_per_epoch": 4, "group_size": 4, "eval_prompts": "shapes:heldout:16"},
    "train": {"epochs": 2, "batch_size": 16},
}
"""What ``--quick`` changes: a smoke run of every arm for the test suite, not a result."""


def arms(rewards: Sequence[str] = REWARDS) -> list[str]:
    """The trained arms, in table order (``base`` is evaluated, not trained)."""
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
"""Epochs per run of the comparison and the study, the default run's (120 optimizer steps of 128 images)."""

EVALUATIONS = 3
"""Evaluations per run (the last one is the result), so that each run has a learning curve."""


FINAL_EVAL = "final_eval.json"
"""A run's final evaluation (:func:`run_all` with ``final``): its last weights on more images,
:func:`~mogo_diffusion.evaluate.evaluate_run`'s JSON."""


def frozen_sections() -> dict[str, Any]:
    """The :func:`~mogo_diffusion.shapes.recipe.shapes_config` sections every arm starts from, the
    settings the study's arms were frozen with: all of the world's rewards, and a sample a reward
    does not apply to left out of that reward's loss."""
    return {"rewards": reward_specs(REWARDS), "nft": {"nonapplicable": "exclude"}}


def arm_config(
    arm: str,
    seed: int,
    out: Path,
    *,
    epochs: int = EPOCHS,
    quick: bool = False,
    rewards: Sequence[str] | None = None,
) -> Config:
    """The config of one arm and seed, writing to ``out``: ``epochs`` epochs, evaluated
    :data:`EVALUATIONS` times, on ``rewards`` (default: all of
    :data:`~mogo_diffusion.shapes.recipe.REWARDS`, in their order; a subset keeps theirs). A
    sample a reward does not apply to is left out of that reward's loss, as when the study's arms
    were frozen, but in ``marble_n10_neutral``."""
    data = shapes_config(**frozen_sections(), **(QUICK if quick else {})).to_dict()
    if rewards is not None:
        unknown = sorted(set(rewards) - {spec["name"] for spec in data["rewards"]})
        if unknown:
            raise ValueError(
                f"rewards {unknown} are not the shapes world's; its rewards: {', '.join(REWARDS)}"
            )
        data["rewards"] = [spec for spec in data["rewards"] if spec["name"] in rewards]
    epochs = QUICK["train"]["epochs"] if quick else epochs
    data["train"].update(
        epochs=epochs, eval_every=max(1, epochs // EVALUATIONS), checkpoint_every=epochs, seed=seed,
        out_dir=str(out),
    )  # fmt: skip
    strategy: dict[str, Any]
    if arm.startswith("single:"):
        strategy = {"name": "single", "reward": arm.removeprefix("single:")}
    elif arm in ("weighted_sum", "weighted_sum_z"):
        strategy = {"name": "weighted_sum", "reward_scale": "zscore" if arm.endswith("_z") else "raw"}
    elif arm == "sequential":
        names = [spec["name"] for spec in data["rewards"]]
        length = max(1, data["train"]["epochs"] // (2 * len(names)))
        strategy = {"name": "sequential", "stages": [{"reward": n, "epochs": length} for n in names]}
    elif arm == "marble_n1":
        strategy = {"name": "marble", "harmonize_every": 1, "alpha_ema": 0.0}
    elif arm in ("marble_n10", "marble_n10_window", "marble_n10_neutral"):
        estimate = "window" if arm.endswith("window") else "first"
        strategy = {"name": "marble", "harmonize_every": 10, "alpha_ema": 0.9, "estimate": estimate}
        if arm.endswith("neutral"):
            data["nft"]["nonapplicable"] = "neutral"
    elif arm == "marble_n10_noema":
        strategy = {"name": "marble", "harmonize_every": 10, "alpha_ema": 0.0}
    elif _weighting_arm(arm):
        strategy = {"name": arm.removesuffix("_n10"), "harmonize_every": 10, "alpha_ema": 0.9}
    else:
        raise ValueError(
            f"unknown arm {arm!r}; arms: base, {', '.join(arms())}, or <weighting>_n10 for a weighting "
            f"of mogo.WEIGHTINGS ({', '.join(sorted(set(mogo.WEIGHTINGS) - {'weighted_sum'}))})"
        )
    data["strategy"] = strategy  # each strategy's own record, its other fields at their defaults
    return Config.from_dict(data)


def _weighting_arm(arm: str) -> bool:
    """Whether ``arm`` is ``<name>_n10`` for a weighting of :data:`mogo.WEIGHTINGS`."""
    name = arm.removesuffix("_n10")
    return arm.endswith("_n10") and name in mogo.WEIGHTINGS and name != "weighted_sum"


_LEGACY = "no run record (run.json): read as it is, checked only on its epochs and final evaluation"


class Decision(NamedTuple):
    """What :func:`run_all` does with one run (:func:`decide`), and why, in words.

    ``action``: ``"reuse"`` (finished, and finally evaluated when asked), ``"evaluate"`` (finished;
    its final evaluation is missing or damaged), ``"resume"`` (unfinished: from its latest intact
    checkpoint), ``"start"`` (the directory holds no run), ``"restart"`` (unfinished, with no
    checkpoint to resume: nothing complete to lose), ``"legacy"`` (finished, but without a run
    record, so its config cannot be checked: only ``study --no-train`` reads it) or ``"refuse"``
    (another config's run, a run in use, or a damaged one: never deleted)."""

    action: str
    why: str


def decide(config: Config, final: str | None = None) -> Decision:
    """What to do with the run of ``config`` (in ``train.out_dir``), its final evaluation on the
    prompts ``final`` wanted or not.

    A run is reused only when its record holds ``config`` (but for ``train.out_dir``: the epochs,
    evaluation prompts and steps that its results depend on included), it is finished
    (:func:`~mogo_diffusion.run_dir.is_finished`) with metrics to its last epoch, and its final
    evaluation is of its final checkpoint, on ``final``'s prompts, with ``config``'s steps.
    """
    run = Path(config.train.out_dir)
    if (holder := run_dir.claimed_by(run)) is not None:
        return Decision("refuse", f"in use by another process (pid {holder})")
    try:
        record = run_dir.read_record(run)
        if record is None:
            return _legacy(run, config, final) if run_dir.holds_run(run) else Decision("start", "new")
        request = run_dir.portable(config.to_dict())
        differences = run_dir.config_differences(record["config"], request)
        if differences := [d for d in differences if d[0] != "train.out_dir"]:
            return Decision("refuse", f"holds the run of another config ({_named(differences)}); it is kept: "
                            "use another --out")  # fmt: skip
        if not run_dir.is_finished(run, config):
            return _unfinished(run)
        _check_metrics(run, config.train.epochs)
        return Decision("reuse", "finished") if final is None else _final_evaluation(run, config, final)
    except (RunDirError, CheckpointError) as error:
        return Decision("refuse", str(error))


def _unfinished(run: Path) -> Decision:
    """Resume an unfinished run from its latest intact checkpoint, or restart it without one."""
    try:
        checkpoint = latest_checkpoint(run / "checkpoints")
    except CheckpointError as error:
        return Decision("restart", f"unfinished; {error}")
    if checkpoint is None:
        return Decision("restart", "unfinished, no checkpoint to resume")
    return Decision("resume", f"unfinished, from {checkpoint.name}")


def _check_metrics(run: Path, epochs: int) -> None:
    """Check that ``run``'s metrics records end at epoch ``epochs - 1``.

    Raises:
        FileNotFoundError: there are none.
        RunDirError: they do not (the file was damaged after the run finished)."""
    records = read_metrics(run)
    last = records[-1]["epoch"] if records else None
    if last != epochs - 1:
        raise RunDirError(
            f"{str(run / run_dir.METRICS)!r} ends at epoch {last}, not {epochs - 1}: it was damaged after "
            "the run finished; move the run away to train it again"
        )


def _final_evaluation(run: Path, config: Config, final: str) -> Decision:
    """Reuse a finished run whose final evaluation matches; evaluate one without (or with a
    damaged one); refuse one evaluated on other prompts, steps or weights."""
    marker = run_dir.read_marker(run)
    path = run / FINAL_EVAL
    expected = {
        "checkpoint_sha256": marker["checkpoint_sha256"],
        "prompts_sha256": prompts_digest(load_prompt_set(final)),
        "eval_num_steps": config.sampling.eval_num_steps,
    }
    result = _read_result(path)
    if result is not None:
        differences = run_dir.config_differences({key: result.get(key) for key in expected}, expected)
        if not differences:
            return Decision("reuse", "finished and evaluated finally")
        raise RunDirError(
            f"{str(path)!r} is another evaluation ({_named(differences)}); it is kept: use another --out"
        )
    if not (run / "checkpoints" / marker["checkpoint"]).is_dir():
        raise RunDirError(
            f"{str(run)!r} is finished, but keeps neither its final checkpoint {marker['checkpoint']} nor "
            f"its {FINAL_EVAL}: nothing to evaluate; move it away to train it again"
        )
    return Decision(
        "evaluate", f"finished; its final evaluation is {'damaged' if path.is_file() else 'missing'}"
    )


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


def _legacy(run: Path, config: Config, final: str | None) -> Decision:
    """A run directory without a record (written before runs had one, or copied without it):
    ``"legacy"`` when its metrics reach the last epoch and, with ``final``, its final evaluation
    has ``final``'s number of prompts and ``config``'s steps (what such a run records); else refused."""
    unchecked = "no run record (run.json), so its config cannot be checked"
    try:
        _check_metrics(run, config.train.epochs)
    except (FileNotFoundError, RunDirError) as error:
        return Decision("refuse", f"{unchecked}, and it is unfinished or damaged ({error}); move it away")
    if final is not None:
        result = _read_result(run / FINAL_EVAL) or {}
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
    if final is not None:
        _evaluate_final(Path(config.train.out_dir), final)


def last_evaluation(history: Sequence[Mapping[str, Any]], names: Sequence[str]) -> list[float]:
    """The held-out means of ``names`` at a run's last evaluation (its metrics records ``history``)."""
    last = [record for record in history if f"eval/{names[0]}" in record][-1]
    return [float(last[f"eval/{name}"]) for name in names]


def final_means(run: Path) -> dict[str, float]:
    """The held-out means of ``run``'s final evaluation, as ``{"eval/<reward>": mean}`` (NaN where a
    reward applied to no prompt)."""
    metrics = json.loads((run / FINAL_EVAL).read_text())["metrics"]
    return {f"eval/{name}": math.nan if value is None else value for name, value in metrics.items()}


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
                "`python -m mogo_diffusion.study --no-train` reads it as it is; delete it to evaluate again"
            )
        tqdm.write(f"legacy {path}: read as it is (it does not record what it was made on)")
        return cached
    return _evaluate_pretrained(config, path, key)


def _evaluate_pretrained(config: Config, path: Path, key: dict[str, Any]) -> dict[str, float]:
    """Evaluate the pretrained model under ``config`` and cache its means at ``path`` under ``key``."""
    from mogo_diffusion.train import Trainer

    trainer = Trainer(config)
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
        "no run record (run.json), so its config cannot be checked: `python -m mogo_diffusion.study "
        "--no-train` reads such runs; to train, use another --out"
    )
    return Decision("refuse", why)


def run_all(
    configs: Mapping[tuple, Config], base: Path, *, jobs: int, final: str | None = None
) -> dict[str, float]:
    """Bring every run of ``configs`` (key to config) to an end, ``jobs`` at a time, each a
    ``python -m mogo_diffusion.train`` subprocess with one thread, as :func:`decide` says: reuse a
    finished run, resume or restart an unfinished one of the same config, start a new one; returns
    the pretrained model's held-out means, evaluated once and cached at ``base``
    (:func:`evaluate_base`). A line says what is done with each run (:func:`report`).

    With ``final`` (a prompt source), each run's last weights are then evaluated on it once
    (:data:`FINAL_EVAL` in the run, read by :func:`final_means`).

    Raises:
        RunDirError: a run is refused (another config's, a legacy or damaged one, one in use), or
            the base cache is another request's; nothing is trained, and nothing deleted.
    """
    decisions = {key: _to_train(decide(c, final)) for key, c in configs.items()}
    report(decisions, configs)
    refused = [f"{configs[k].train.out_dir}: {d.why}" for k, d in decisions.items() if d.action == "refuse"]
    if refused:
        raise RunDirError(f"{len(refused)} run(s) refused, nothing trained:\n" + "\n".join(refused))
    means = evaluate_base(next(iter(configs.values())), base)
    todo = {key: c for key, c in configs.items() if decisions[key].action != "reuse"}
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


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.pstdev(values) if len(values) > 1 else 0.0


def summarize(
    base: dict[str, float], records: dict[str, dict[int, list[dict]]], names: Sequence[str]
) -> dict:
    """The comparison's numbers from the base means and each arm's per-seed metrics records.

    Per reward ``r``: the held-out mean of each arm and seed (its last evaluation). The composite of
    a run is ``mean_r (m_r - mu_r) / sigma_r`` with ``mu_r, sigma_r`` the mean and std over the arms'
    seed-averaged means (base included); its spread is over seeds. The wall-time ratio is the
    median epoch time of ``weighted_sum`` over the arm's.
    """
    table: dict[str, dict[int, list[float]]] = {"base": {0: [base[f"eval/{n}"] for n in names]}}
    for arm, seeds in records.items():
        table[arm] = {}
        for seed, history in seeds.items():
            table[arm][seed] = last_evaluation(history, names)
    averaged = {
        arm: [statistics.fmean(v[k] for v in runs.values()) for k in range(len(names))]
        for arm, runs in table.items()
    }
    epoch_seconds = {
        arm: statistics.median(r["seconds"] for history in seeds.values() for r in history)
        for arm, seeds in records.items()
    }
    reference = epoch_seconds.get("weighted_sum")
    rows = {}
    for arm, runs in table.items():
        row: dict[str, Any] = {"seeds": sorted(runs)}
        for k, name in enumerate(names):
            row[name] = _mean_std([v[k] for v in runs.values()])
        composites = composite_zscores({str(seed): v for seed, v in runs.items()}, reference=averaged)
        row["composite"] = _mean_std(list(composites.values()))
        if arm in records:
            row["epoch_seconds"] = epoch_seconds[arm]
            row["throughput_vs_weighted_sum"] = reference / epoch_seconds[arm] if reference else math.nan
            finals = [history[-1] for history in records[arm].values()]
            for key in ("conflict_rate", "worst_cosine_weighted_sum", "worst_cosine_marble"):
                if key in finals[0]:
                    row[key] = _mean_std([f[key] for f in finals])
        rows[arm] = row
    return {"rewards": list(names), "arms": rows}


def _cell(pair: Any, digits: int = 3) -> str:
    mean, std = pair
    return "n/a" if math.isnan(mean) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def tables(summary: dict) -> list[list[list[str]]]:
    """The comparison as two tables of cells, each a header row then one row per arm: the rewards
    (held-out mean ± std over seeds, the composite, the throughput ratio), and the conflict
    statistics of the MARBLE arms."""
    names = summary["rewards"]
    rewards = [["arm", *names, "composite", "throughput vs weighted sum"]]
    for arm, row in summary["arms"].items():
        ratio = row.get("throughput_vs_weighted_sum")
        ratio_text = "" if ratio is None or math.isnan(ratio) else f"{ratio:.3f}"
        rewards.append([arm, *(_cell(row[n]) for n in names), _cell(row["composite"], 2), ratio_text])
    conflicts = [
        [
            "harmonized arm",
            "conflict rate of the weighted-sum direction",
            "worst cosine, weighted sum",
            "worst cosine, the arm's direction",
        ]
    ]
    for arm, row in summary["arms"].items():
        if "conflict_rate" in row:
            conflicts.append(
                [
                    arm,
                    _cell(row["conflict_rate"], 2),
                    _cell(row["worst_cosine_weighted_sum"]),
                    _cell(row["worst_cosine_marble"]),
                ]
            )
    return [rewards, conflicts] if len(conflicts) > 1 else [rewards]


def _markdown(summary: dict) -> str:
    return "\n\n".join(map(markdown_table, tables(summary))) + "\n"


def _rst(summary: dict) -> str:
    """The tables as reStructuredText list-tables (for the docs)."""
    return "\n\n".join(map(rst_table, tables(summary))) + "\n"


def _figures(summary: dict, records: dict[str, dict[int, list[dict]]], out: Path, tradeoff: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, rows = summary["rewards"], summary["arms"]
    means = {arm: [row[n][0] for n in names] for arm, row in rows.items()}
    z = reward_zscores(means)
    colors = {
        arm: "tab:red"
        if arm.startswith("marble") or _weighting_arm(arm)
        else "tab:gray"
        if arm == "base"
        else "tab:blue"
        for arm in rows
    }

    # Pareto: the pulling reward against the mean z-score of the others.
    k = names.index(tradeoff)
    figure, axis = plt.subplots(figsize=(5.6, 4.2))
    for arm in rows:
        others = statistics.fmean(v for j, v in enumerate(z[arm]) if j != k)
        axis.scatter(means[arm][k], others, color=colors[arm])
        axis.annotate(arm, (means[arm][k], others), fontsize=7, xytext=(3, 3), textcoords="offset points")
    axis.set_xlabel(f"{tradeoff} (held-out mean)")
    axis.set_ylabel("mean z-score of the other rewards")
    axis.set_title("trade-off on held-out prompts (up and right is better)", fontsize=9)
    figure.tight_layout()
    figure.savefig(out / "pareto.png", dpi=120)
    plt.close(figure)

    # Per-reward z-scores, one group of bars per reward.
    figure, axis = plt.subplots(figsize=(1.6 * len(names) + 3, 4))
    width = 0.8 / len(rows)
    for i, arm in enumerate(rows):
        axis.bar(
            [j + i * width for j in range(len(names))], z[arm], width, label=arm, color=plt.cm.tab20(i % 20)
        )
    axis.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, fontsize=8)
    axis.axhline(0, color="black", linewidth=0.5)
    axis.set_ylabel("held-out mean, z-scored across arms")
    axis.legend(fontsize=6, ncol=2)
    figure.tight_layout()
    figure.savefig(out / "rewards.png", dpi=120)
    plt.close(figure)

    # Alpha trajectories of the MARBLE arms (first seed).
    marble = [arm for arm in records if arm.startswith("marble") or _weighting_arm(arm)]
    if marble:
        figure, axes = plt.subplots(1, len(marble), figsize=(4.6 * len(marble), 3.4), squeeze=False)
        for axis, arm in zip(axes[0], marble, strict=True):
            history = records[arm][min(records[arm])]
            for name in names:
                axis.plot([r["epoch"] for r in history], [r[f"alpha/{name}"] for r in history], label=name)
            axis.set_title(f"alpha, {arm} (seed {min(records[arm])})", fontsize=9)
            axis.set_xlabel("epoch")
        axes[0][0].legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(out / "alpha.png", dpi=120)
        plt.close(figure)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mogo_diffusion.compare",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("runs/compare"), help="output directory")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per arm")
    parser.add_argument("--seed", type=int, default=None, help="run this one seed only (overrides --seeds)")
    parser.add_argument("--epochs", type=int, default=EPOCHS, help="epochs per run (not with --quick)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each")
    parser.add_argument("--arms", default="all", help="comma-separated subset of the arms, or all")
    parser.add_argument(
        "--quick", action="store_true", help="a few minutes: tiny budget, one seed, not a result"
    )
    parser.add_argument("--tradeoff", default="jpeg_compressibility", help="the x axis of pareto.png")
    return parser


def main(argv: list[str] | None = None) -> dict:
    """Run the comparison; returns the summary (also ``OUT/results.json``)."""
    parser = _parser()
    args = parser.parse_args(argv)
    chosen = arms() if args.arms == "all" else [a for a in args.arms.split(",") if a]
    unknown = [a for a in chosen if a not in (*arms(), *ABLATIONS) and not _weighting_arm(a)]
    if unknown:
        parser.error(f"unknown arms {unknown}; arms: {', '.join(arms())}")
    if args.tradeoff not in REWARDS:
        parser.error(f"--tradeoff must be one of {', '.join(REWARDS)}, got {args.tradeoff!r}")
    for name in ("seeds", "jobs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    seeds = [args.seed] if args.seed is not None else [0] if args.quick else list(range(args.seeds))
    out: Path = args.out
    try:
        configs = {
            (arm, seed): arm_config(
                arm, seed, out / "runs" / arm / f"seed{seed}", epochs=args.epochs, quick=args.quick
            )
            for arm in chosen
            for seed in seeds
        }
    except FileNotFoundError as error:
        parser.error(str(error))
    started = time.perf_counter()
    try:
        base = run_all(configs, out / "runs" / "base" / "eval.json", jobs=args.jobs)
    except RunDirError as error:
        parser.error(str(error))
    records = {
        arm: {seed: read_metrics(configs[arm, seed].train.out_dir) for seed in seeds} for arm in chosen
    }
    summary = summarize(base, records, list(REWARDS))
    summary["command"] = "python -m mogo_diffusion.compare " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    summary["seconds"] = time.perf_counter() - started
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "results.md").write_text(_markdown(summary))
    (out / "results.rst").write_text(_rst(summary))
    _figures(summary, records, out, args.tradeoff)
    tqdm.write(_markdown(summary))
    return summary


if __name__ == "__main__":
    main()
