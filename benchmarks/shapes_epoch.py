"""Where a shapes-world epoch spends its time, and images per second of two checkouts in one run.

Each measurement is a fresh process (``PYTHONPATH`` = the checkout) that builds the
``mogo_diffusion.train.Trainer`` of the shapes world's config with the given ``--set`` overrides,
runs one untimed warm-up epoch, then ``--epochs`` epochs and one held-out evaluation, and times
the trainer's steps: ``sample`` (the sampling forwards and the VAE decode), ``score`` (the
rewards), ``train`` (advantages, gradients and updates) and ``evaluate``. Rounds alternate the
checkouts, so drift in the machine's speed affects them alike; the table gives medians over the
rounds and each checkout's images per second relative to the first's.

    python benchmarks/shapes_epoch.py --checkout old=/path/to/old --checkout new=. --rounds 3 \\
        --set train.batch_size=64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = r"""
import json, statistics, sys, time, torch
torch.set_num_threads(1)
from mogo_diffusion.config import load_config
from mogo_diffusion.shapes.recipe import shapes_config
from mogo_diffusion.train import Trainer

out, epochs, overrides = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
trainer = Trainer.from_config(load_config(None, [*overrides, f"train.out_dir={out}"], shapes_config()))
phases = {"sample": 0.0, "score": 0.0}
for name in phases:
    method = getattr(trainer, name)
    def timed(*args, _method=method, _name=name):
        start = time.perf_counter()
        result = _method(*args)
        phases[_name] += time.perf_counter() - start
        return result
    setattr(trainer, name, timed)
trainer.train_epoch(0)
epoch_seconds, images = [], 0
for name in phases:
    phases[name] = 0.0
for epoch in range(1, epochs + 1):
    metrics = trainer.train_epoch(epoch)
    epoch_seconds.append(metrics["seconds"])
    images += round(metrics["images_per_second"] * metrics["seconds"])
start = time.perf_counter()
trainer.evaluate()
evaluate = time.perf_counter() - start
total = sum(epoch_seconds)
print(json.dumps({
    "images_per_second": images / total, "epoch_seconds": statistics.median(epoch_seconds),
    "sample": phases["sample"] / epochs, "score": phases["score"] / epochs,
    "train": (total - phases["sample"] - phases["score"]) / epochs, "evaluate": evaluate,
}))
"""
COLUMNS = ("images_per_second", "epoch_seconds", "sample", "score", "train", "evaluate")


def measure(checkout: Path, epochs: int, overrides: list[str]) -> dict[str, float]:
    """One fresh process's timings of ``checkout``."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as out:
        run = subprocess.run(
            [sys.executable, "-c", WORKER, out, str(epochs), json.dumps(overrides)],
            env=env, cwd=checkout, capture_output=True, text=True, check=False,
        )  # fmt: skip  # cwd: ``python -c`` puts it before PYTHONPATH on sys.path
    if run.returncode:
        raise RuntimeError(f"{checkout}: the worker failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def table(results: dict[str, list[dict[str, float]]]) -> str:
    """The markdown table of the medians over rounds, images per second relative to the first row."""
    medians = {
        name: {c: statistics.median(r[c] for r in runs) for c in COLUMNS} for name, runs in results.items()
    }
    first = next(iter(medians.values()))["images_per_second"]
    lines = [
        "| checkout | images/s | relative | epoch s | sample s | score s | train s | evaluate s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in medians.items():
        lines.append(
            f"| {name} | {m['images_per_second']:.2f} | {m['images_per_second'] / first:.2f} | "
            f"{m['epoch_seconds']:.2f} | {m['sample']:.2f} | {m['score']:.2f} | {m['train']:.2f} | "
            f"{m['evaluate']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkout", action="append", metavar="NAME=PATH",
        help="a checkout to measure (repeatable; default: this one as 'here')",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per measurement")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--json", type=Path, help="also write every measurement here")
    args = parser.parse_args(argv)
    checkouts = dict(
        entry.split("=", 1) for entry in (args.checkout or [f"here={Path(__file__).resolve().parents[1]}"])
    )
    results: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
    for round_ in range(args.rounds):
        for name, path in checkouts.items():
            results[name].append(measure(Path(path).resolve(), args.epochs, args.overrides))
            print(f"round {round_ + 1}/{args.rounds} {name}: {results[name][-1]}", file=sys.stderr)
    print(table(results))
    if args.json is not None:
        args.json.write_text(json.dumps({"overrides": args.overrides, "results": results}, indent=1))


if __name__ == "__main__":
    main()
