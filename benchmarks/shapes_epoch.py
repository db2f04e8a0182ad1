"""Where a shapes-world epoch spends its time, and images per second of two checkouts in one run.

Each measurement is a fresh process (``PYTHONPATH`` = the checkout) that builds the
``mogo_diffusion.train.Trainer`` of the shapes world's config with the given ``--set`` overrides
(and the checkout's own, ``--set-in``), runs one epoch that is timed apart (it pays for
compilation, if any), then ``--epochs`` epochs and one held-out evaluation, and times the
trainer's steps: ``sample`` (the sampling forwards and the VAE decode), ``score`` (the rewards),
``train`` (advantages, gradients and updates) and ``evaluate``. Rounds alternate the checkouts,
so drift in the machine's speed affects them alike. Each checkout has its own compilation cache
(``TORCHINDUCTOR_CACHE_DIR``), empty before the first round: the first round's first epoch is the
cold start, the later rounds' the warm one. The table gives medians over the warm rounds and each
checkout's images per second relative to the first's; ``--demo`` adds the wall time of the demo's
command (``python -m mogo_diffusion.train`` on its embedded default, two threads) with an empty
cache and again with the one it filled.

    python benchmarks/shapes_epoch.py --checkout old=/path/to/old --checkout new=. --rounds 4 \\
        --set-in new train.mixed_precision=bf16 --demo
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.machine import describe

WORKER = r"""
import json, statistics, sys, time
start = time.perf_counter()
import torch
torch.set_num_threads(1)
from mogo_diffusion.config import load_config
from mogo_diffusion.shapes.recipe import shapes_config
from mogo_diffusion.train import Trainer

out, epochs, overrides = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
config = load_config(None, [*overrides, f"train.out_dir={out}"], shapes_config())
trainer = getattr(Trainer, "from_config", Trainer)(config)  # the constructor of either version
build = time.perf_counter() - start
phases = {"sample": 0.0, "score": 0.0}
for name in phases:
    method = getattr(trainer, name)
    def timed(*args, _method=method, _name=name):
        begin = time.perf_counter()
        result = _method(*args)
        phases[_name] += time.perf_counter() - begin
        return result
    setattr(trainer, name, timed)
begin = time.perf_counter()
trainer.train_epoch(0)
first = time.perf_counter() - begin
epoch_seconds, images = [], 0
for name in phases:
    phases[name] = 0.0
for epoch in range(1, epochs + 1):
    metrics = trainer.train_epoch(epoch)
    epoch_seconds.append(metrics["seconds"])
    images += round(metrics["images_per_second"] * metrics["seconds"])
begin = time.perf_counter()
trainer.evaluate()
evaluate = time.perf_counter() - begin
total = sum(epoch_seconds)
print(json.dumps({
    "images_per_second": images / total, "epoch_seconds": statistics.median(epoch_seconds),
    "sample": phases["sample"] / total, "score": phases["score"] / total,
    "train": 1 - (phases["sample"] + phases["score"]) / total, "evaluate": evaluate,
    "build": build, "first_epoch": first,
}))
"""


def _environment(checkout: Path, cache: Path, threads: int) -> dict[str, str]:
    return {
        **os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(cache),
    }  # fmt: skip


def measure(checkout: Path, cache: Path, epochs: int, overrides: list[str]) -> dict[str, float]:
    """One fresh process's timings of ``checkout`` with the compilation cache ``cache``."""
    with tempfile.TemporaryDirectory() as out:
        run = subprocess.run(
            [sys.executable, "-c", WORKER, out, str(epochs), json.dumps(overrides)],
            env=_environment(checkout, cache, 1), cwd=checkout, capture_output=True, text=True, check=False,
        )  # fmt: skip  # cwd: ``python -c`` puts it before PYTHONPATH on sys.path
    if run.returncode:
        raise RuntimeError(f"{checkout}: the worker failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def demo_seconds(checkout: Path, cache: Path, overrides: list[str]) -> float:
    """Wall seconds of the demo's command in ``checkout`` (two threads, its output discarded)."""
    with tempfile.TemporaryDirectory() as out:
        sets = [arg for o in [*overrides, f"train.out_dir={out}"] for arg in ("--set", o)]
        start = time.perf_counter()
        run = subprocess.run(
            [sys.executable, "-m", "mogo_diffusion.train", *sets],
            env=_environment(checkout, cache, 2), cwd=checkout, capture_output=True, text=True, check=False,
        )  # fmt: skip
        seconds = time.perf_counter() - start
    if run.returncode:
        raise RuntimeError(f"{checkout}: the demo failed:\n{run.stderr[-3000:]}")
    return seconds


def table(results: dict[str, list[dict[str, float]]], demos: dict[str, list[float]]) -> str:
    """The markdown table: medians over the warm rounds (all but the first), the first round's
    first epoch as the cold start, images per second relative to the first checkout."""
    warm = {name: runs[1:] or runs for name, runs in results.items()}
    medians = {n: {c: statistics.median(r[c] for r in runs) for c in runs[0]} for n, runs in warm.items()}
    first = next(iter(medians.values()))["images_per_second"]
    header = (
        "| checkout | images/s | relative | epoch s | sample | score | train | evaluate s "
        "| first epoch s, cold / warm | start s |" + (" demo s, cold / warm |" if demos else "")
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for name, m in medians.items():
        cells = [
            name, f"{m['images_per_second']:.2f}", f"{m['images_per_second'] / first:.2f}",
            f"{m['epoch_seconds']:.2f}", f"{m['sample']:.0%}", f"{m['score']:.0%}", f"{m['train']:.0%}",
            f"{m['evaluate']:.2f}", f"{results[name][0]['first_epoch']:.1f} / {m['first_epoch']:.1f}",
            f"{m['build']:.1f}",
        ]  # fmt: skip
        if demos:
            cells.append(f"{demos[name][0]:.0f} / {demos[name][1]:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkout", action="append", metavar="NAME=PATH",
        help="a checkout to measure (repeatable; default: this one as 'here')",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the first is the cold start")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per measurement")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument(
        "--set-in", nargs=2, action="append", default=[], metavar=("NAME", "FIELD=VALUE"),
        help="an override for one checkout only",
    )  # fmt: skip
    parser.add_argument("--demo", action="store_true", help="also time the demo's command, cold and warm")
    parser.add_argument("--json", type=Path, help="also write every measurement here")
    args = parser.parse_args(argv)
    checkouts = dict(
        entry.split("=", 1) for entry in (args.checkout or [f"here={Path(__file__).resolve().parents[1]}"])
    )
    if unknown := {name for name, _ in args.set_in} - checkouts.keys():
        parser.error(f"--set-in names no --checkout: {', '.join(sorted(unknown))}")
    overrides = {name: [*args.overrides, *(o for n, o in args.set_in if n == name)] for name in checkouts}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
    demos: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as caches:
        cache = {name: Path(caches) / name for name in checkouts}
        for round_ in range(args.rounds):
            for name, path in checkouts.items():
                results[name].append(measure(Path(path).resolve(), cache[name], args.epochs, overrides[name]))
                print(f"round {round_ + 1}/{args.rounds} {name}: {results[name][-1]}", file=sys.stderr)
        if args.demo:
            for name, path in checkouts.items():
                fresh = Path(caches) / f"{name}-demo"
                demos[name] = [demo_seconds(Path(path).resolve(), fresh, overrides[name]) for _ in range(2)]
                print(f"demo {name}: {demos[name]}", file=sys.stderr)
    print(describe())
    print(table(results, demos))
    if args.json is not None:
        record = {"machine": describe(), "overrides": overrides, "results": results, "demos": demos}
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
