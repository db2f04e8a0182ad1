"""Does a change leave training bit for bit as it was? The same short run on two checkouts, compared.

Each checkout (a directory holding the package, e.g. a ``git worktree`` of the old commit) trains
``python -m mogo_diffusion.train`` (its embedded shapes world unless ``--config``) with the same
``--set`` overrides, for each strategy of ``--strategies``, in a process of its own
(``PYTHONPATH`` = the checkout, one thread). Then every record of ``metrics.jsonl`` that both runs
wrote is compared field by field (timings excepted), and every tensor of the last checkpoint (the
adapter, the optimizer's state, the EMAs, the RNG states) with ``torch.equal``. It prints one
line per strategy and exits non-zero when anything differs.

    git worktree add /tmp/old <commit>
    python benchmarks/same_run.py --old /tmp/old --new . --out /tmp/same_run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

TIMINGS = ("seconds", "images_per_second")  # the fields a record may differ in between two runs
STRATEGIES = ("marble", "weighted_sum")
DEFAULTS = ("train.epochs=4", "train.eval_every=2", "train.checkpoint_every=2")


def train(checkout: Path, out: Path, strategy: str, config: Path | None, overrides: list[str]) -> None:
    """One run of ``checkout``'s trainer into ``out``."""
    command = [sys.executable, "-m", "mogo_diffusion.train", "--overwrite"]
    command += ["--config", str(config)] if config else []
    for override in [*overrides, f"strategy.name={strategy}", f"train.out_dir={out}"]:
        command += ["--set", override]
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    log = out.with_suffix(".log")
    with log.open("w") as stream:
        if subprocess.run(command, cwd=checkout, env=env, stdout=stream, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"{checkout}: the run failed; its output is in {log}")


def records(run: Path) -> dict[int, list[dict]]:
    """The run's metrics records by epoch, without their timings."""
    found: dict[int, list[dict]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        kept = {key: value for key, value in record.items() if not key.endswith(TIMINGS)}
        found.setdefault(record["epoch"], []).append(kept)
    return found


def last_checkpoint(run: Path) -> dict[str, torch.Tensor]:
    return load_file(sorted((run / "checkpoints").glob("step-*"))[-1] / "tensors.safetensors")


def compare(old: Path, new: Path) -> list[str]:
    """What differs between the runs ``old`` and ``new``: records both wrote, and checkpoints."""
    differences = []
    old_records, new_records = records(old), records(new)
    common = sorted(set(old_records) & set(new_records))
    if not common:
        differences.append("no epoch has records in both runs")
    for epoch in common:
        for before in old_records[epoch]:
            if before not in new_records[epoch]:
                differences.append(f"epoch {epoch}: a record differs ({sorted(before)[:4]}...)")
    before, after = last_checkpoint(old), last_checkpoint(new)
    if set(before) != set(after):
        differences.append(f"checkpoint tensors differ in names: {sorted(set(before) ^ set(after))[:5]}")
    unequal = [name for name in set(before) & set(after) if not torch.equal(before[name], after[name])]
    if unequal:
        differences.append(f"{len(unequal)} checkpoint tensors differ, e.g. {sorted(unequal)[:3]}")
    return differences


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True, help="the checkout before the change")
    parser.add_argument("--new", type=Path, default=Path("."), help="the checkout after it")
    parser.add_argument("--out", type=Path, required=True, help="where the runs go")
    parser.add_argument("--config", type=Path, default=None, help="the run's config (none: the shapes world)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=list(DEFAULTS), metavar="KEY=VALUE"
    )
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated strategy names")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    failed = False
    for strategy in args.strategies.split(","):
        runs = {name: args.out / f"{strategy}-{name}" for name in ("old", "new")}
        for name, checkout in (("old", args.old), ("new", args.new)):
            train(checkout.resolve(), runs[name].resolve(), strategy, args.config, args.overrides)
        differences = compare(runs["old"], runs["new"])
        epochs = sorted(set(records(runs["old"])) & set(records(runs["new"])))
        verdict = "; ".join(differences) or "bit for bit the same"
        print(f"{strategy}: epochs {epochs}, records and last checkpoint: {verdict}")
        failed |= bool(differences)
    return int(failed)


if __name__ == "__main__":
    raise SystemExit(main())
