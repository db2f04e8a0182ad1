"""Does training in bfloat16 change the results? The recipe's specialists and the demo's MARBLE
run, in float32 and in bfloat16, paired by seed.

Every run is the shapes world's recipe (:func:`mogo_diffusion.compare.default_base`, 120 epochs)
trained by :func:`mogo_diffusion.compare.gather`, once with ``train.mixed_precision: "no"`` and once
with ``"bf16"`` (every transformer forward under a bfloat16 autocast, the attention's softmax
product in float32): the six single-reward specialists (judged on their own reward) and MARBLE
amortized on the prompt-following rewards (the demo's run, judged on each of its rewards). Each run
is judged by its final evaluation (:data:`~mogo_diffusion.shapes.recipe.FINAL_EVAL`, 1024 images).
The table gives each gain over the pretrained model in both precisions (mean over seeds and its
95 % bootstrap interval) and the paired difference bf16 - float32 with its interval, and the
images per second of training in each. Runs live in ``OUT/runs``; an interrupted run of this
command continues where it stopped.

    python benchmarks/precision.py --out runs/precision               # 42 runs, hours on 2 cores
    python benchmarks/precision.py --out runs/precision --no-train    # the table of what finished
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.machine import describe
from mogo_diffusion import compare, tables
from mogo_diffusion.bootstrap import bootstrap_interval, paired_interval
from mogo_diffusion.config import Config
from mogo_diffusion.shapes.recipe import DEFAULT_REWARDS, FINAL_EVAL, REWARDS

PRECISIONS = ("no", "bf16")


def plan(out: Path, seeds: list[int], quick: bool) -> dict[tuple[str, int], Config]:
    """Every run: ``(arm, seed) -> config``, arms ``<specialist reward>@<precision>`` on all the
    world's rewards and ``marble@<precision>`` on the prompt-following ones."""
    base = compare.default_base(quick)
    definitions = {
        f"{reward}@{precision}": {
            "strategy": {"name": "single", "reward": reward},
            "train": {"mixed_precision": precision},
        }
        for reward in REWARDS
        for precision in PRECISIONS
    }
    definitions |= {
        f"marble@{precision}": {**compare.ARMS["marble_n10"], "train": {"mixed_precision": precision}}
        for precision in PRECISIONS
    }
    specialists = [name for name in definitions if not name.startswith("marble")]
    marble = [name for name in definitions if name.startswith("marble")]
    options = {"base": base, "quick": quick, "definitions": definitions}
    runs = compare.plan(specialists, seeds, out, **options)
    runs |= compare.plan(marble, seeds, out, group="prompt_following", rewards=DEFAULT_REWARDS, **options)
    return runs


def table(gathered: compare.Gathered) -> list[list[str]]:
    """One row per (arm, reward judged): each precision's gain over the pretrained model, the paired
    difference, and each precision's training images per second."""
    seeds, base = gathered.seeds, gathered.judged_base
    rows = [
        ["run", "reward", "gain float32", "gain bf16", "bf16 - float32", "images/s float32", "images/s bf16"]
    ]
    judged = [(f"{reward} specialist", reward, reward) for reward in REWARDS]
    judged += [("MARBLE (demo)", "marble", reward) for reward in DEFAULT_REWARDS]
    for label, arm, reward in judged:
        gains, speeds = {}, {}
        for precision in PRECISIONS:
            results = [gathered.results[(f"{arm}@{precision}", seed)] for seed in seeds]
            gains[precision] = [r.final[f"eval/{reward}"] - base[f"eval/{reward}"] for r in results]
            speeds[precision] = statistics.median(
                statistics.median(m["images_per_second"] for m in r.metrics) for r in results
            )
        cells = [str(bootstrap_interval(gains[p])) for p in PRECISIONS]
        cells.append(str(paired_interval(gains["bf16"], gains["no"])))
        rows.append([label, reward, *cells, *(f"{speeds[p]:.1f}" for p in PRECISIONS)])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/precision"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each")
    parser.add_argument("--quick", action="store_true", help="a smoke run of the command, not a result")
    parser.add_argument("--no-train", action="store_true", help="the table of the seeds that finished")
    args = parser.parse_args()
    runs = plan(args.out, list(range(args.seeds)), args.quick)
    final = "shapes:heldout:16" if args.quick else str(FINAL_EVAL)
    gathered = compare.gather(runs, args.out, final=final, jobs=args.jobs, train=not args.no_train)
    text = f"{describe()}\nseeds {gathered.seeds}\n\n" + tables.markdown_table(table(gathered))
    (args.out / "precision.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
