"""Rewarded soups: specialists' LoRA adapters merged by weights, ``python -m mogo_diffusion.soups``.

Rewarded soups (Ramé, Couairon, Shukor, Dancette, Gaya, Soulier & Cord 2023, "Rewarded soups:
towards Pareto-optimal alignment by interpolating weights fine-tuned on diverse rewards",
NeurIPS) trains one specialist per reward from the same pretrained model and interpolates their
fine-tuned weights, ``theta(lambda) = sum_k lambda_k theta_k`` with ``lambda`` on the simplex:
sweeping ``lambda`` traces a front of trade-offs at no further training, beside joint training
on all rewards. As in the paper's LoRA runs, what is interpolated are the adapters' own tensors
(every layer's A and B; :func:`merge_tensors`): the merge is linear in them, and ``lambda = e_k``
gives specialist k's adapter exactly. The specialists must share the adapter's shape, and should
share its initialisation (the same ``train.seed``), for the interpolation to stay between them.

A soup is written as a run directory (:func:`write_soup`): ``checkpoints/step-N/`` whose trained,
old and evaluation-EMA adapters are the merges of the specialists' final checkpoints' (``N`` the
first's epoch), with a ``lora/`` export that merges theirs (the diffusers format:
``pipe.load_lora_weights(dir)``), an empty optimizer state (a soup was never trained), the first
specialist's config (``train.out_dir`` the soup's), ``config.yaml``, and ``soup.json`` (the
specialists and ``lambda``). :func:`mogo_diffusion.evaluate.evaluate_run` (and
``python -m mogo_diffusion.evaluate SOUP``) reads it as any run; this command evaluates each soup
that way, on ``--prompts`` (e.g. the study's final evaluation prompts), and tables them.

.. code-block:: bash

    python -m mogo_diffusion.soups runs/single-shapes_color runs/single-shapes_shape --sweep 4 \\
        --out runs/soups --prompts mogo_diffusion/shapes/pool_final.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mogo_diffusion.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from mogo_diffusion.config import Config, ConfigError

__all__ = ["LORA_FILE", "main", "merge_lora_file", "merge_tensors", "simplex_grid", "soup_name", "write_soup"]

LORA_FILE = "pytorch_lora_weights.safetensors"
"""The diffusers-format LoRA file of a checkpoint's ``lora/`` export."""

MERGED = ("trained", "old", "eval_ema")
"""The adapters of a checkpoint's state that a soup merges."""


def merge_tensors(tensors: Sequence[torch.Tensor], lambdas: Sequence[float]) -> torch.Tensor:
    """``sum_k lambda_k t_k`` in float64, returned in the tensors' dtype (``lambda = e_k`` gives
    ``t_k`` exactly). The tensors must share shape and dtype."""
    first = tensors[0]
    total = torch.zeros(first.shape, dtype=torch.float64)
    for tensor, weight in zip(tensors, lambdas, strict=True):
        total += weight * tensor.detach().to(torch.float64).cpu()
    return total.to(first.dtype)


def _check_lambdas(lambdas: Sequence[float], count: int) -> list[float]:
    values = [float(x) for x in lambdas]
    if len(values) != count:
        raise ValueError(f"lambda has {len(values)} weights for {count} specialists")
    if not all(math.isfinite(x) and x >= 0 for x in values) or abs(sum(values) - 1) > 1e-9:
        raise ValueError(f"lambda must be non-negative weights that sum to 1 (the simplex), got {values}")
    return values


def simplex_grid(count: int, steps: int) -> list[list[float]]:
    """Every ``lambda`` on the simplex of ``count`` weights with entries in multiples of
    ``1 / steps``, the vertices first.

    >>> simplex_grid(2, 2)
    [[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]
    """
    points = [
        [n / steps for n in parts]
        for parts in itertools.product(range(steps + 1), repeat=count)
        if sum(parts) == steps
    ]
    return sorted(points, key=lambda p: (-max(p), [-x for x in p]))


def soup_name(lambdas: Sequence[float]) -> str:
    """The directory name of a soup: ``soup-0.25-0.75``."""
    return "soup-" + "-".join(f"{x:.4g}" for x in lambdas)


def merge_lora_file(sources: Sequence[Path], lambdas: Sequence[float], out: Path) -> Path:
    """Merge the specialists' diffusers-format LoRA files ``source/``:data:`LORA_FILE` into
    ``out/``:data:`LORA_FILE`, tensor by tensor, keeping the first file's metadata (the adapter's
    config, which ``load_lora_weights`` reads).

    Raises:
        ValueError: the files hold different tensors (names or shapes; names the file).
    """
    files = [Path(source) / LORA_FILE for source in sources]
    loaded = [load_file(file) for file in files]
    with safe_open(files[0], framework="pt") as handle:
        metadata = handle.metadata()
    reference = {name: tuple(t.shape) for name, t in loaded[0].items()}
    for file, tensors in zip(files[1:], loaded[1:], strict=True):
        shapes = {name: tuple(t.shape) for name, t in tensors.items()}
        if shapes != reference:
            differ = sorted(set(shapes.items()) ^ set(reference.items()))[:3]
            raise ValueError(f"{str(file)!r} holds other LoRA tensors than {str(files[0])!r}: {differ}")
    merged = {name: merge_tensors([tensors[name] for tensors in loaded], lambdas) for name in reference}
    out.mkdir(parents=True, exist_ok=True)
    save_file(merged, out / LORA_FILE, metadata=metadata)
    return out


def _specialist(run: Path) -> tuple[Path, dict[str, Any]]:
    """A specialist's final checkpoint and its state."""
    checkpoint = latest_checkpoint(Path(run) / "checkpoints")
    if checkpoint is None:
        raise FileNotFoundError(f"run directory {str(run)!r} has no checkpoint (in checkpoints/)")
    return checkpoint, load_checkpoint(checkpoint)


def _check_compatible(runs: Sequence[Path], states: Sequence[dict[str, Any]]) -> None:
    """The specialists' adapters merge: the same model and adapter (``model``), the same rewards
    scored, and tensors of the same shapes."""
    first = states[0]
    for run, state in zip(runs[1:], states[1:], strict=True):
        for section in ("model", "rewards"):
            if state["config"][section] != first["config"][section]:
                raise ValueError(
                    f"{str(run)!r}: its config's {section!r} differs from {str(runs[0])!r}'s; a soup merges "
                    "adapters of one model scored by the same rewards"
                )
        for key in MERGED:
            shapes = [tuple(t.shape) for t in state[key]]
            if shapes != [tuple(t.shape) for t in first[key]]:
                raise ValueError(
                    f"{str(run)!r}: its {key!r} adapter's tensors differ in shape from {str(runs[0])!r}'s"
                )


def write_soup(runs: Sequence[str | Path], lambdas: Sequence[float], out: str | Path) -> Path:
    """Merge the specialists of run directories ``runs`` (their latest checkpoints) with weights
    ``lambdas`` into the run directory ``out`` (the module docstring); returns it.

    Raises:
        ValueError: ``lambdas`` is not on the simplex or not one per run, or the runs do not merge
            (another model, adapter or reward set).
        FileNotFoundError, CheckpointError: a run without an intact checkpoint.
    """
    runs = [Path(run) for run in runs]
    lambdas = _check_lambdas(lambdas, len(runs))
    out = Path(out)
    checkpoints, states = zip(*(_specialist(run) for run in runs), strict=True)
    _check_compatible(runs, states)
    first = states[0]
    config = Config.from_dict(first["config"]).to_dict()
    config["train"]["out_dir"] = str(out)
    optimizer = first["optimizer"]
    state = {
        **{
            key: [merge_tensors(ts, lambdas) for ts in zip(*(s[key] for s in states), strict=True)]
            for key in MERGED
        },
        "epoch": first["epoch"],
        "optimizer": {**optimizer, "state": {}} if {"state", "param_groups"} <= set(optimizer) else optimizer,
        "scaler": first["scaler"],
        "config": config,
    }
    save_checkpoint(
        out / "checkpoints",
        first["epoch"],
        state,
        write_extra=lambda staging: merge_lora_file(
            [c / "lora" for c in checkpoints], lambdas, staging / "lora"
        ),
    )
    Config.from_dict(config).save(out / "config.yaml")
    record = {
        "specialists": [str(run) for run in runs],
        "checkpoints": [str(c) for c in checkpoints],
        "lambda": lambdas,
    }
    (out / "soup.json").write_text(json.dumps(record, indent=1) + "\n")
    return out


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The command: write each soup under ``--out``, evaluate it (unless ``--no-eval``), and
    write ``soups.json`` (each soup's :func:`~mogo_diffusion.evaluate.evaluate_run` result and
    lambda) and ``soups.md`` (:func:`~mogo_diffusion.evaluate.results_table`)."""
    from mogo_diffusion.evaluate import evaluate_run, results_table

    parser = argparse.ArgumentParser(
        prog="python -m mogo_diffusion.soups", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "runs", nargs="+", type=Path, help="the specialists' run directories, in lambda's order"
    )
    chosen = parser.add_mutually_exclusive_group(required=True)
    chosen.add_argument(
        "--lambdas", action="append", metavar="L1,...,LK", help="one soup's weights (repeatable)"
    )
    chosen.add_argument("--sweep", type=int, metavar="N", help="every lambda on the simplex in steps of 1/N")
    parser.add_argument("--out", type=Path, required=True, help="the directory of the soups")
    parser.add_argument("--prompts", default=None, help="evaluation prompts in place of the runs' own")
    parser.add_argument("--no-eval", action="store_true", help="write the soups only")
    args = parser.parse_args(argv)
    if args.sweep is not None and args.sweep < 1:
        parser.error("--sweep must be at least 1")
    try:
        grid = (
            simplex_grid(len(args.runs), args.sweep)
            if args.sweep is not None
            else [[float(x) for x in text.split(",")] for text in args.lambdas]
        )
        soups = [write_soup(args.runs, lambdas, args.out / soup_name(lambdas)) for lambdas in grid]
    except (OSError, CheckpointError, ConfigError, ValueError) as error:
        parser.error(str(error))
    for soup in soups:
        print(f"wrote {soup}", file=sys.stderr)
    if args.no_eval:
        return []
    results = []
    for soup, lambdas in zip(soups, grid, strict=True):
        result = evaluate_run(soup, prompts=args.prompts, name=soup.name)
        results.append({**result, "lambda": lambdas})
        print(soup.name, json.dumps(result["metrics"]), flush=True)
    (args.out / "soups.json").write_text(json.dumps(results, indent=1) + "\n")
    if len(results) > 1:
        markdown, _ = results_table(results)
        (args.out / "soups.md").write_text(markdown + "\n")
        print(markdown)
    return results


if __name__ == "__main__":
    main()
