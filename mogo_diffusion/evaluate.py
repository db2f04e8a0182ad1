"""Multi-reward evaluation: held-out scores and the composite z-score.

* :func:`reward_zscores`: each reward standardised over the compared runs,
  ``z_rk = (m_rk - mean_r' m_r'k) / std_r' m_r'k``; :func:`composite_zscores` averages them over
  the rewards, so rewards on different scales count alike.
* :func:`evaluate_run` and ``python -m mogo_diffusion.evaluate RUN``: a checkpoint's evaluation EMA
  (or the pretrained model, ``--base``) sampled on an evaluation prompt set from the training run's
  own evaluation noise and scored by every reward of the run and any further ``--metric``, through
  :meth:`Trainer.evaluate <mogo_diffusion.train.Trainer.evaluate>`: the numbers are the run's own
  held-out ``eval/{name}`` for the same weights, prompts and noise.
  :func:`results_table` and ``--combine a.json b.json ...``: the per-metric table of several runs
  (markdown) with each run's composite z-score, of results evaluated on the same prompts and steps.

A run's figures (``curves.png``, ``samples.png``) are :mod:`mogo_diffusion.figures`'.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import Tensor

from mogo_diffusion.prompts import PromptSet
from mogo_diffusion.run_dir import read_metrics
from mogo_diffusion.tables import markdown_table

if TYPE_CHECKING:
    from mogo_diffusion.train import Trainer

__all__ = [
    "composite_zscores",
    "evaluate_run",
    "evaluated_on",
    "main",
    "parse_metric",
    "prompts_digest",
    "read_metrics",
    "results_table",
    "reward_zscores",
]


def _standardized(
    means: Mapping[str, Sequence[float]], reference: Mapping[str, Sequence[float]] | None
) -> tuple[np.ndarray, np.ndarray]:
    """``[R, K]`` z-scores of ``means`` by the mean and std over the runs of ``reference`` (0 for a
    reward on which they all agree), and the ``[K]`` mask of the rewards where they do not."""
    basis = np.asarray(list((means if reference is None else reference).values()), dtype=np.float64)
    if basis.ndim != 2 or len(basis) < 2:
        raise ValueError(f"need the K means of at least two runs, got an array of shape {basis.shape}")
    table = np.asarray(list(means.values()), dtype=np.float64).reshape(-1, basis.shape[1])
    spread = basis.std(axis=0)
    informative = spread > 1e-12
    z = np.zeros_like(table)
    z[:, informative] = (table[:, informative] - basis[:, informative].mean(axis=0)) / spread[informative]
    return z, informative


def reward_zscores(
    means: Mapping[str, Sequence[float]], reference: Mapping[str, Sequence[float]] | None = None
) -> dict[str, list[float]]:
    """Each run's per-reward means z-scored across the runs of ``reference`` (default: ``means``).

    Args:
        means: run name to its K per-reward means (the same K rewards, in the same order).
        reference: the runs whose mean and std standardise each reward (at least two).

    Returns:
        Run name to its K z-scores; 0 for a reward on which every reference run scores the same.
    """
    z, _ = _standardized(means, reference)
    return {name: row.tolist() for name, row in zip(means, z, strict=True)}


def composite_zscores(
    means: Mapping[str, Sequence[float]], reference: Mapping[str, Sequence[float]] | None = None
) -> dict[str, float]:
    """The composite score of each run: its :func:`reward_zscores`, averaged over the rewards.

    Args:
        means, reference: as in :func:`reward_zscores`.

    Returns:
        Run name to composite. A reward on which every reference run scores the same carries no
        information and is left out (its std is 0); with none left, every composite is 0.
    """
    z, informative = _standardized(means, reference)
    composite = z[:, informative].mean(axis=1) if informative.any() else np.zeros(len(z))
    return {name: float(value) for name, value in zip(means, composite, strict=True)}


# ---- evaluating a run: python -m mogo_diffusion.evaluate ----------------------------------------


def parse_metric(text: str) -> tuple[str, dict[str, Any]]:
    """``"NAME"`` or ``"NAME:KEY=VALUE,KEY=VALUE"`` as a reward name and its options (each value
    read as YAML, as ``--set`` reads it).

    >>> parse_metric("imagereward:model=/models/imagereward,batch_size=8")
    ('imagereward', {'model': '/models/imagereward', 'batch_size': 8})
    """
    import yaml

    name, _, rest = text.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"metric {text!r}: expected NAME or NAME:KEY=VALUE,..., got the option {item!r}")
        try:
            options[key] = yaml.safe_load(value)
        except yaml.YAMLError as error:
            raise ValueError(f"metric {text!r}: option {key}: {error}") from None
    if not name:
        raise ValueError(f"metric {text!r}: no reward name before ':'")
    return name, options


def prompts_digest(prompts: PromptSet) -> str:
    """The SHA-256 (hex) of a prompt set's prompts and metadata: what an evaluation was made on,
    whatever file or source name it came from.

    >>> a = PromptSet(["a red circle"], [{}])
    >>> prompts_digest(a) == prompts_digest(PromptSet(["a red circle"], [{}]))
    True
    >>> prompts_digest(a) == prompts_digest(PromptSet(["a red circle"], [{"tag": "colour"}]))
    False
    """
    text = json.dumps([prompts.prompts, prompts.metadata], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _run_config(source: Path, base: bool) -> tuple[dict[str, Any], Path | None]:
    """The config (as ``Config.to_dict()``) and the checkpoint of a command's ``source``: a
    checkpoint directory, a run directory (its ``config.yaml``, its latest intact checkpoint) or,
    with ``base``, a config file."""
    from mogo_diffusion.checkpoint import CheckpointError, latest_checkpoint, verify_checkpoint
    from mogo_diffusion.config import load_config

    kinds = "a checkpoint directory, a run directory" + (" or a config file" if base else "")
    if not source.exists():
        raise FileNotFoundError(f"{str(source)!r} does not exist; expected {kinds}")
    if source.is_file():
        if not base:
            raise FileNotFoundError(
                f"{str(source)!r} is a file: a config holds no weights; pass a checkpoint or run "
                "directory, or --base to evaluate the pretrained model"
            )
        return load_config(source).to_dict(), None
    is_run = (source / "checkpoints").is_dir() or (source / "config.yaml").is_file()
    if is_run and base:
        return load_config(source / "config.yaml").to_dict(), None
    checkpoint = source
    if is_run:
        found = latest_checkpoint(source / "checkpoints")
        if found is None:
            raise FileNotFoundError(f"run directory {str(source)!r} has no checkpoint (in checkpoints/)")
        checkpoint = found
    verify_checkpoint(checkpoint)
    where = checkpoint / "state.json"
    try:
        config = json.loads(where.read_text())["config"]
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{str(where)!r} holds no run config: {error!r}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{str(where)!r}: field 'config' must be an object")
    return config, checkpoint


@contextmanager
def _sampling_progress(trainer: Trainer, count: int) -> Iterator[None]:
    """A tqdm bar of the sampler's image-steps: ``count`` images of ``sampling.eval_num_steps``
    transformer evaluations each, advanced by a forward hook on the transformer."""
    from tqdm.auto import tqdm

    steps = trainer.config.sampling.eval_num_steps
    bar = tqdm(total=count * steps, desc=f"sampling {count} images x {steps} steps", unit="step")

    def advance(module: Any, inputs: Any, output: Any) -> None:  # returns None: the output stays
        bar.update(len(output[0]))

    hook = trainer.transformer.register_forward_hook(advance)
    try:
        yield
    finally:
        hook.remove()
        bar.close()


def _means(values: Tensor, names: Sequence[str]) -> dict[str, float | None]:
    """Column means of ``[N, K]`` scores over their applicable rows; None for a column of NaN."""
    from mogo_diffusion.advantages import nan_mean

    means = nan_mean(values).tolist()
    return {name: None if math.isnan(m) else m for name, m in zip(names, means, strict=True)}


def evaluate_run(
    source: str | os.PathLike[str],
    *,
    base: bool = False,
    prompts: str | None = None,
    metrics: Sequence[tuple[str, Mapping[str, Any]]] = (),
    name: str | None = None,
) -> dict[str, Any]:
    """Sample and score a run's weights on its evaluation prompts, as its training evaluates them.

    The run's :class:`~mogo_diffusion.train.Trainer` is rebuilt from the checkpoint's own config
    (``source`` a checkpoint directory, or a run directory: its latest intact checkpoint), resumed
    from the checkpoint, and its :meth:`~mogo_diffusion.train.Trainer.evaluate` run: the
    checkpoint's evaluation EMA samples the prompts from the noise of
    :data:`~mogo_diffusion.train.EVAL_SEED`, and every reward of the run scores the images.
    With ``base`` the adapters are disabled (the pretrained model, from the same noise;
    ``source`` may then also be a config file).

    Args:
        source: checkpoint directory, run directory, or (``base``) config file.
        base: evaluate the pretrained model instead of the checkpoint's adapter.
        prompts: a :func:`~mogo_diffusion.prompts.load_prompt_set` source in place of the run's
            ``sampling.eval_prompts``.
        metrics: further rewards to score the same images with, ``(name, options)`` (see
            :func:`parse_metric`).
        name: the run's name in :func:`results_table` (default: the source and what was evaluated).

    Returns:
        ``{"name", "source", "run_dir", "evaluated" (the checkpoint's name, or "base"),
        "checkpoint", "checkpoint_sha256" (its :func:`~mogo_diffusion.checkpoint.checkpoint_digest`;
        None for the base), "epoch", "base", "prompts", "prompts_sha256" (:func:`prompts_digest`),
        "num_prompts", "eval_num_steps", "metrics": {reward: mean}, "diagnostics": {...}}``; a mean
        is None where the reward applies to no prompt.

    Raises:
        FileNotFoundError: ``source`` is missing, or a run directory without checkpoints.
        CheckpointError: the checkpoint is damaged or does not fit its config (names the file).
        ConfigError: the config has no evaluation prompts and ``prompts`` is None, or is invalid.
        ValueError: an unknown metric, one the run scores already, or options its reward does not take.
    """
    from mogo_diffusion.checkpoint import checkpoint_digest
    from mogo_diffusion.config import Config, ConfigError
    from mogo_diffusion.rewards import MultiReward, make_reward
    from mogo_diffusion.train import Trainer

    source = Path(source)
    data, checkpoint = _run_config(source, base)
    data["train"]["log_with"] = []  # nothing is logged
    if prompts is not None:
        data["sampling"]["eval_prompts"] = str(prompts)
    if data["sampling"]["eval_prompts"] is None:
        raise ConfigError(
            f"sampling.eval_prompts: the run of {str(source)!r} has no evaluation prompts; pass --prompts"
        )
    extra = []
    for metric, options in metrics:
        try:
            extra.append(make_reward(metric, **dict(options)))
        except TypeError as error:  # an option the reward's factory does not take
            raise ValueError(f"metric {metric!r}: {error}") from None
    config = Config.from_dict(data)
    scored = [spec.name for spec in config.rewards]
    if twice := [reward.name for reward in extra if reward.name in scored]:
        raise ValueError(f"metric {twice[0]!r} is one of the run's rewards, which are scored already")
    trainer = Trainer.from_config(config)
    if checkpoint is not None and not base:
        trainer.resume(checkpoint)
    eval_prompts = trainer.eval_prompts
    assert eval_prompts is not None  # set above
    with _sampling_progress(trainer, len(eval_prompts.prompts)):
        if base:
            images = trainer.base_samples(range(len(eval_prompts.prompts)))
            scores = _means(trainer.rewards(images, *eval_prompts).values, trainer.names)
            diagnostics = trainer.rewards.diagnostics(images)
        else:
            found = trainer.evaluate()
            images = trainer.eval_images
            scores = {
                k.removeprefix("eval/"): None if math.isnan(v) else v
                for k, v in found.items()
                if k.startswith("eval/")
            }
            diagnostics = {
                k.removeprefix("diagnostic/"): v for k, v in found.items() if k.startswith("diagnostic/")
            }
    if extra:
        more = MultiReward(extra).to(trainer.device)
        scores.update(_means(more(images, *eval_prompts).values, more.names))
    if source.is_file():  # a config (--base)
        run_dir, label = source.parent, source.stem
    elif checkpoint == source:
        run_dir = source.parent.parent if source.parent.name == "checkpoints" else source.parent
        label = run_dir.name
    else:
        run_dir, label = source, source.name
    weights = None if base else checkpoint
    evaluated = "base" if weights is None else weights.name
    return {
        "name": name or f"{label}/{evaluated}",
        "source": str(source),
        "run_dir": str(run_dir),
        "evaluated": evaluated,
        "checkpoint": None if weights is None else str(weights),
        "checkpoint_sha256": None if weights is None else checkpoint_digest(weights),
        "epoch": None if base else trainer.epoch,
        "base": base,
        "prompts": data["sampling"]["eval_prompts"],
        "prompts_sha256": prompts_digest(eval_prompts),
        "num_prompts": len(eval_prompts.prompts),
        "eval_num_steps": trainer.config.sampling.eval_num_steps,
        "metrics": scores,
        "diagnostics": diagnostics,
    }


def results_table(results: Sequence[Mapping[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The per-metric table of several :func:`evaluate_run` results and their composite z-scores.

    The composite (:func:`composite_zscores`, standardised over these runs) averages the metrics
    that every run has a mean of; the others are shown and left out of it.

    Returns:
        ``(markdown, summary)``: a markdown table, one row per run (a column per metric, then the
        composite), and ``{"metrics": {run: {metric: mean}}, "composite_metrics": [...],
        "zscores": {run: {metric: z}}, "composite": {run: c}}``.

    Raises:
        ValueError: fewer than two runs, two runs of the same name, runs evaluated on different
            prompts or with different sampler steps (:func:`evaluated_on`; the message names both),
            or no metric that every run has.

    >>> table, summary = results_table([
    ...     {"name": "a", "metrics": {"sharpness": 0.2, "ocr": None}},
    ...     {"name": "b", "metrics": {"sharpness": 0.4, "ocr": 0.5}},
    ... ])
    >>> print(table)
    | run | sharpness | ocr | composite |
    |---|---:|---:|---:|
    | a | 0.2 | - | -1 |
    | b | 0.4 | 0.5 | 1 |
    <BLANKLINE>
    composite: mean z-score over sharpness across the 2 runs (ocr left out: not every run has it).
    """
    names = [str(result["name"]) for result in results]
    if len(names) < 2:
        raise ValueError(f"need the results of at least two runs to compare, got {len(names)}")
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"runs must have distinct names, got {twice} more than once (set one with --name)")
    first = results[0]
    for result in results[1:]:
        if evaluated_on(result) != evaluated_on(first):
            raise ValueError(
                f"{first['name']!r} was evaluated on {_describe(first)}, {result['name']!r} on "
                f"{_describe(result)}: a table compares results of the same prompts and steps"
            )
    table = {name: dict(result["metrics"]) for name, result in zip(names, results, strict=True)}
    columns = list(dict.fromkeys(metric for row in table.values() for metric in row))
    common = [m for m in columns if all(row.get(m) is not None for row in table.values())]
    if not common:
        raise ValueError(f"no metric has a mean in every run: {', '.join(columns) or 'none'}")
    means = {name: [row[m] for m in common] for name, row in table.items()}
    composite = composite_zscores(means)
    zscores = {name: dict(zip(common, z, strict=True)) for name, z in reward_zscores(means).items()}

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.4g}"

    rows = [["run", *columns, "composite"]]
    rows += [
        [name, *(cell(row.get(m)) for m in columns), cell(composite[name])] for name, row in table.items()
    ]
    left_out = [m for m in columns if m not in common]
    note = f" ({', '.join(left_out)} left out: not every run has it)" if left_out else ""
    lines = [markdown_table(rows, numeric=True), ""]
    lines.append(f"composite: mean z-score over {', '.join(common)} across the {len(names)} runs{note}.")
    summary = {"metrics": table, "composite_metrics": common, "zscores": zscores, "composite": composite}
    return "\n".join(lines), summary


def evaluated_on(result: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """What an :func:`evaluate_run` result was made on, equal for results that compare: the
    prompts (their digest; the source's name in a result written before digests were recorded),
    their number and the sampler's steps (None for what a result does not say)."""
    prompts = result.get("prompts_sha256") or result.get("prompts")
    return prompts, result.get("num_prompts"), result.get("eval_num_steps")


def _describe(result: Mapping[str, Any]) -> str:
    """The prompts and steps of a result, in words."""
    return (f"{result.get('prompts')} ({result.get('num_prompts')} prompts, digest "
            f"{str(result.get('prompts_sha256'))[:12]}) in {result.get('eval_num_steps')} steps")  # fmt: skip


def _default_out(result: Mapping[str, Any], prompts: str | None) -> Path:
    """Where a result goes without ``--out``: ``eval-<what>.json`` in its run directory, the
    ``--prompts`` source's name appended when given (``eval-step-000040-heldout.json``)."""
    tag = "" if prompts is None else "-" + re.sub(r"[^\w.-]+", "-", Path(prompts).stem).strip("-")
    return Path(result["run_dir"]) / f"eval-{result['evaluated']}{tag}.json"


def _check_replaceable(out: Path, result: Mapping[str, Any]) -> None:
    """Raise unless ``out`` is absent or holds an evaluation of the same prompts and steps."""
    if not out.is_file():
        return
    try:
        existing = json.loads(out.read_text())
    except ValueError:
        return  # a damaged result holds nothing to keep
    if isinstance(existing, dict) and evaluated_on(existing) != evaluated_on(result):
        raise FileExistsError(
            f"{str(out)!r} holds an evaluation on {_describe(existing)}, not {_describe(result)}: "
            "pass --out to keep both"
        )


def main(argv: Sequence[str] | None = None) -> None:
    """The command: evaluate one run (``SOURCE``), or combine results (``--combine``)."""
    from mogo_diffusion.checkpoint import CheckpointError
    from mogo_diffusion.config import ConfigError

    parser = argparse.ArgumentParser(
        prog="python -m mogo_diffusion.evaluate",
        description="Sample a run's checkpoint (or the pretrained model) on evaluation prompts from the "
        "training run's evaluation noise and score every reward of the run, writing a JSON of the "
        "means; or combine such JSONs into the per-metric table and composite z-score.",
    )
    parser.add_argument(
        "source", nargs="?", type=Path, help="a checkpoint directory, a run directory (its latest "
        "checkpoint), or with --base also a config file",
    )  # fmt: skip
    parser.add_argument("--base", action="store_true", help="evaluate the pretrained model (no adapter)")
    parser.add_argument(
        "--prompts", default=None, help="prompt source in place of the run's sampling.eval_prompts "
        "(a text or GenEval .jsonl file, or shapes:SPLIT[:N])",
    )  # fmt: skip
    parser.add_argument(
        "--metric", dest="metrics", action="append", default=[], metavar="NAME[:KEY=VALUE,...]",
        help="a further reward to score, e.g. imagereward:model=DIR (repeatable)",
    )  # fmt: skip
    parser.add_argument("--name", default=None, help="the run's name in a combined table")
    parser.add_argument(
        "--combine", nargs="+", type=Path, default=None, metavar="RESULT.json",
        help="combine the results of several runs into the per-metric table and composite z-score",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=None, help="where to write: the result JSON (default: "
        "eval-<checkpoint>[-<prompts>].json in the run directory, never replacing an evaluation on other "
        "prompts); with --combine the markdown table (the summary JSON beside it; default: print only)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if (args.source is None) == (args.combine is None):
        parser.error("give either a SOURCE to evaluate or --combine RESULT.json ...")
    if args.combine is not None:
        try:
            results = [json.loads(path.read_text()) for path in args.combine]
            markdown, summary = results_table(results)
        except FileNotFoundError as error:
            parser.error(f"--combine: {error.filename!r} does not exist")
        except (ValueError, KeyError, TypeError) as error:
            parser.error(f"--combine: {error}")
        print(markdown)
        if args.out is not None:
            args.out.write_text(markdown + "\n")
            args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
        return
    try:
        metrics = [parse_metric(text) for text in args.metrics]
        result = evaluate_run(
            args.source, base=args.base, prompts=args.prompts, metrics=metrics, name=args.name
        )
    except (OSError, CheckpointError, ConfigError, ValueError) as error:
        parser.error(str(error))
    out = args.out
    if out is None:
        out = _default_out(result, args.prompts)
        try:
            _check_replaceable(out, result)
        except FileExistsError as error:
            parser.error(str(error))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["metrics"]), file=sys.stdout)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
