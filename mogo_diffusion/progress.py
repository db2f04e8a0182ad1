"""What a run tells its user: how each epoch went while it trains, and what it did at its end.

* :class:`EpochProgress`: on a terminal, a progress bar of the epochs with the rewards' batch
  means; in a file or a pipe, a line per logged epoch (its number, images per second, the rewards'
  batch means and, after an evaluation, the held-out means), each flushed as it is written.
* :func:`held_out_table`: the held-out means of the pretrained model (the record of epoch
  :data:`~mogo_diffusion.run_dir.PRETRAINED_EPOCH`) and of the trained model (the last
  evaluation), read from a run's metrics records; :func:`run_summary` adds the paths of what the
  run wrote. ``python -m mogo_diffusion.train`` prints it at the end.

>>> records = [{"epoch": -1, "eval/colour": 0.5}, {"epoch": 0, "reward/colour": 0.4},
...            {"epoch": 1, "reward/colour": 0.6, "eval/colour": 0.625}]
>>> print(held_out_table(records, ["colour"]))
held-out reward  pretrained     trained      change
colour               0.5000      0.6250     +0.1250
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from tqdm.auto import tqdm

from mogo_diffusion.run_dir import METRICS, PRETRAINED_EPOCH, read_metrics

__all__ = ["EpochProgress", "held_out_table", "run_summary"]


class EpochProgress:
    """Reports each epoch of a run to ``stream`` (default ``sys.stdout``), as a context manager.

    A terminal gets a tqdm bar of ``end`` epochs (``start`` done already) with the rewards' batch
    means and a line per evaluation above it; anything else gets a line per logged epoch, e.g.
    ``epoch 3/60: 41.2 images/s | reward colour 0.8125 | held-out colour 0.7500`` (epochs
    counted from 1, the held-out part after an evaluation). Disabled, it writes nothing (every
    process but the main one).
    """

    def __init__(self, start: int, end: int, *, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.end = end
        self.stream = sys.stdout if stream is None else stream
        self.enabled = enabled
        on_terminal = enabled and self.stream.isatty()
        self.bar = tqdm(total=end, initial=start, desc="epochs", file=self.stream) if on_terminal else None

    def __enter__(self) -> EpochProgress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self.bar is not None:
            self.bar.close()

    def evaluated(self, label: str, metrics: Mapping[str, Any]) -> None:
        """Write ``label`` and the held-out means of ``metrics`` (``eval/<reward>``), if it has any."""
        held_out = _means(metrics, "eval/")
        if self.enabled and held_out:
            self._write(f"{label}: held-out {held_out}")

    def epoch(self, metrics: Mapping[str, Any], *, logged: bool = True) -> None:
        """Report the epoch of ``metrics`` (a record of :meth:`Trainer.metrics
        <mogo_diffusion.train.Trainer.metrics>`, evaluated or not); a line only where ``logged``."""
        rewards = _means(metrics, "reward/")
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(
                {k.split("/")[-1]: f"{v:.3g}" for k, v in metrics.items() if k.startswith("reward/")}
            )
            self.evaluated(f"epoch {metrics['epoch'] + 1}", metrics)
            return
        if not (self.enabled and logged):
            return
        parts = [f"epoch {metrics['epoch'] + 1}/{self.end}: {metrics['images_per_second']:.1f} images/s"]
        parts += [f"reward {rewards}"] if rewards else []
        parts += [f"held-out {held_out}"] if (held_out := _means(metrics, "eval/")) else []
        self._write(" | ".join(parts))

    def _write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)


def _means(metrics: Mapping[str, Any], prefix: str) -> str:
    """``name value`` for each metric of ``prefix``, the prefix removed; ``-`` for NaN."""
    return " ".join(
        f"{k.removeprefix(prefix)} {_number(v)}" for k, v in metrics.items() if k.startswith(prefix)
    )


def _number(value: float | None, sign: str = "") -> str:
    """``value`` to four decimals (``sign`` ``"+"``: always signed); ``-`` for None or NaN."""
    return "-" if value is None or math.isnan(value) else f"{value:{sign}.4f}"


def held_out_table(records: Sequence[Mapping[str, Any]], names: Sequence[str]) -> str:
    """The held-out means of reward ``names`` before and after training, as an aligned text table:
    the pretrained model's (the record of epoch :data:`~mogo_diffusion.run_dir.PRETRAINED_EPOCH`),
    the trained model's (the last record with an evaluation) and their difference; ``-`` where a
    run has no such record or a reward applied to no prompt.

    Raises:
        ValueError: ``records`` hold no evaluation of the trained model.
    """
    pretrained = next((r for r in records if r["epoch"] == PRETRAINED_EPOCH), {})
    evaluated = [
        r for r in records if r["epoch"] > PRETRAINED_EPOCH and any(k.startswith("eval/") for k in r)
    ]
    if not evaluated:
        raise ValueError("the run's metrics hold no held-out evaluation of the trained model")
    trained = evaluated[-1]
    rows = [["held-out reward", "pretrained", "trained", "change"]]
    for name in names:
        before, after = pretrained.get(f"eval/{name}"), trained.get(f"eval/{name}")
        change = None if before is None or after is None else after - before
        rows.append([name, _number(before), _number(after), _number(change, "+")])
    width = max(len(row[0]) for row in rows)
    return "\n".join(f"{row[0]:<{width}}" + "".join(f"{cell:>12}" for cell in row[1:]) for row in rows)


def run_summary(out: Path, names: Sequence[str], checkpoint: Path) -> str:
    """What a finished run in ``out`` did and wrote: :func:`held_out_table` of its metrics (when it
    was evaluated), then the run directory, ``samples.png``, ``curves.png``, ``metrics.jsonl`` and
    the final ``checkpoint``, each where it exists."""
    records = read_metrics(out, pretrained=True)
    lines = []
    if any(k.startswith("eval/") for r in records for k in r):
        lines += [held_out_table(records, names), ""]
    paths = {
        "run directory": out,
        "samples": out / "samples.png",
        "curves": out / "curves.png",
        "metrics": out / METRICS,
        "final checkpoint": checkpoint,
    }
    lines.append("wrote:")
    width = max(map(len, paths))
    lines += [f"  {label:<{width}}  {path}" for label, path in paths.items() if path.exists()]
    return "\n".join(lines)
