"""Does a larger budget let the shape and count specialists clear the study's bar?

The study (``python -m mogo_diffusion.study``) asks of every single-reward specialist a gain over
the pretrained model of at least ``3 max(seed std, 0.02)`` on its own reward
(:func:`mogo_diffusion.study.specialist_gains`). At the study's 60 epochs shape and count fall
short. Each variant below trains that specialist with the 60-epoch study's config
(``compare.arm_config`` with :data:`STUDY_60`, which undoes what the recipe took from this
benchmark) and one change, five seeds, and judges each run as the study does: its last weights on
``pool_final.jsonl`` (1024 images), against the pretrained model from the same noise.

    variant                      reward        change from the study's specialist
    count_prompts_only           count         every epoch samples the 8 counting captions only
                                               (64 counting images a step, not about 16)
    epochs_120                   shape, count  120 epochs (twice the images and the steps)
    batch_128                    shape, count  16 prompts x 8 images, one step of 128 an epoch
                                               (twice the images, the same 60 steps)
    batch_128_epochs_120         shape, count  both: 120 steps of 128 (four times the images)
    batch_128_kl_0.1             shape, count  batch_128 with a KL anchor to the pretrained
    batch_128_kl_0.03            shape, count  velocity, ``kl_coef * mean (v - v_ref)^2``,
    batch_128_kl_1               count         kl_coef 0.1, 0.03, 1 (the study's: 0)
    batch_128_epochs_120_kl_0.03 shape, count  120 steps of 128 with the anchor at 0.03

If a step's gradient is signal plus independent noise, the specialist's drift grows with the
number of steps and its seed spread with their square root, so ``gain / std`` grows as the square
root of the images trained on, whatever the split into steps; the table's last column is that ratio
(the bar asks for 3).

    python benchmarks/specialist_budget.py --out docs/_generated/specialist_budget --jobs 2
    python benchmarks/specialist_budget.py --out docs/_generated/specialist_budget --no-train

Finished runs are not rerun (:func:`mogo_diffusion.compare.gather`); the runs are
``OUT/runs/<variant>/<reward>/seed<s>``, kept compact in ``OUT/runs.json.xz``, from which
``--no-train`` remakes the table ``OUT/results.md`` (``.rst``) and ``OUT/results.json``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mogo_diffusion import compare
from mogo_diffusion.config import Config
from mogo_diffusion.run_dir import RunDirError
from mogo_diffusion.shapes.recipe import FINAL_EVAL, POOL
from mogo_diffusion.study import specialist_gains
from mogo_diffusion.tables import write_documents

STUDY_60: dict[str, Any] = {
    "sampling": {"prompts_per_epoch": 8}, "nft": {"kl_coef": 0.0}, "train": {"batch_size": 64},
}  # fmt: skip
"""The 60-epoch study's settings where the recipe has since moved: 8 prompts x 8 images an epoch,
one step of 64, no KL anchor. Every variant starts from them."""

STEPS_OF_128: dict[str, Any] = {"sampling": {"prompts_per_epoch": 16}, "train": {"batch_size": 128}}
"""16 prompts x 8 images an epoch, trained as one step of 128."""

VARIANTS: dict[str, dict[str, Any]] = {
    "count_prompts_only": {"rewards": ("shapes_count",), "epochs": 60, "tag": "counting"},
    "epochs_120": {"rewards": ("shapes_shape", "shapes_count"), "epochs": 120},
    "batch_128": {"rewards": ("shapes_shape", "shapes_count"), "epochs": 60, **STEPS_OF_128},
    "batch_128_epochs_120": {"rewards": ("shapes_shape", "shapes_count"), "epochs": 120, **STEPS_OF_128},
    **{
        f"batch_128_kl_{kl_coef:g}": {
            "rewards": ("shapes_shape", "shapes_count"), "epochs": 60, "nft": {"kl_coef": kl_coef},
            **STEPS_OF_128,
        }
        for kl_coef in (0.1, 0.03)
    },
    "batch_128_kl_1": {
        "rewards": ("shapes_count",), "epochs": 60, "nft": {"kl_coef": 1.0},
        **STEPS_OF_128,
    },
    "batch_128_epochs_120_kl_0.03": {
        "rewards": ("shapes_count", "shapes_shape"), "epochs": 120, "nft": {"kl_coef": 0.03},
        **STEPS_OF_128,
    },
}  # fmt: skip
"""Each variant: the specialists it trains, its epochs, and its changes to the study's config
(the fields of :data:`SECTIONS`; ``tag``: train on the pool's captions of that GenEval tag only)."""

SECTIONS = ("sampling", "nft", "train")
"""The config sections a variant may change."""


def tag_prompts(tag: str, out: Path) -> Path:
    """The captions of :data:`~mogo_diffusion.shapes.recipe.POOL` whose tag is ``tag``, written
    as GenEval JSONL to ``out/prompts/pool_<tag>.jsonl``."""
    lines = [line for line in POOL.read_text().splitlines() if json.loads(line)["tag"] == tag]
    if not lines:
        raise ValueError(f"the pool has no captions tagged {tag!r}")
    path = out / "prompts" / f"pool_{tag}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def plan(out: Path, seeds: range) -> dict[tuple[str, str, int], Config]:
    """Every run, ``(variant, reward, seed) -> config``."""
    runs = {}
    for variant, spec in VARIANTS.items():
        for reward in spec["rewards"]:
            for seed in seeds:
                run = out / "runs" / variant / reward / f"seed{seed}"
                data = compare.arm_config(f"single:{reward}", seed, run, epochs=spec["epochs"]).to_dict()
                for section in SECTIONS:
                    data[section].update({**STUDY_60.get(section, {}), **spec.get(section, {})})
                if "tag" in spec:
                    data["sampling"]["prompts"] = str(tag_prompts(spec["tag"], out))
                runs[variant, reward, seed] = Config.from_dict(data)
    return runs


def table(
    runs: Mapping[tuple[str, str, int], Config],
    results: Mapping[tuple[str, str, int], compare.RunResults],
    base: Mapping[str, float],
) -> list[dict[str, Any]]:
    """One row per variant and reward: each seed's final mean (``results``, the finished runs of
    ``runs``) and the study's bar."""
    rows = []
    for variant, spec in VARIANTS.items():
        for reward in spec["rewards"]:
            keys = [key for key in results if key[:2] == (variant, reward)]
            values = [results[key].held_out([reward])[0] for key in keys]
            summary = {"rewards": [reward], "base": [base[f"eval/{reward}"]],
                       "arms": {f"single:{reward}": {"means": {reward: values}}}}  # fmt: skip
            gain = specialist_gains(summary)[reward]
            first = runs[keys[0]]
            images = first.train.epochs * first.sampling.prompts_per_epoch * first.sampling.group_size
            ratio = gain["gain"] / gain["std"] if gain["std"] > 0 else math.inf
            rows.append({"variant": variant, "reward": reward, "images": images, "seeds": values,
                         **gain, "ratio": ratio})  # fmt: skip
    return rows


HEADER = ("variant", "reward", "images", "seeds", "mean", "gain", "seed std", "bar", "clears", "gain / std")


def cells(row: Mapping[str, Any]) -> list[str]:
    """One row of the table as text, in :data:`HEADER`'s order."""
    seeds = ", ".join(f"{v:.3f}" for v in row["seeds"])
    return [row["variant"], row["reward"], str(row["images"]), seeds, f"{row['mean']:.3f}",
            f"{row['gain']:+.3f}", f"{row['std']:.3f}", f"{row['bar']:.3f}",
            "yes" if row["clears"] else "no", f"{row['ratio']:.1f}"]  # fmt: skip


def write_table(rows: list[dict[str, Any]], out: Path) -> str:
    """Write the table to ``out/results.md`` and, as an RST list-table (the docs include it),
    ``out/results.rst``; returns the markdown."""
    return write_documents(out, "results", None, [], {None: [("", [list(HEADER), *map(cells, rows)])]})


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/specialist_budget"), help="output directory")
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 per variant (at least 2)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each")
    parser.add_argument(
        "--no-train", action="store_true", help="train nothing: the seeds whose runs have all finished"
    )
    args = parser.parse_args(argv)
    if args.seeds < 2:
        parser.error("--seeds must be at least 2: the bar needs a seed std")
    runs = plan(args.out, range(args.seeds))
    try:
        gathered = compare.gather(
            runs, args.out, final=str(FINAL_EVAL), jobs=args.jobs, train=not args.no_train
        )
    except RunDirError as error:
        parser.error(str(error))
    rows = table(runs, gathered.results, gathered.judged_base)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(write_table(rows, args.out))
    return rows


if __name__ == "__main__":
    main()
