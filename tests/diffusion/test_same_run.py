"""``benchmarks/same_run.py``: two runs are the same when every shared record (timings aside) and
every tensor of the last checkpoint are equal, and the smallest difference in either is reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.test_examples import load

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def same_run():
    return load(ROOT / "benchmarks" / "same_run.py")


def write_run(run: Path, records: list[dict], tensors: dict[str, torch.Tensor]) -> Path:
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    for step, scale in (("step-000002", 0.5), ("step-000004", 1.0)):  # the last one is compared
        (run / "checkpoints" / step).mkdir(parents=True)
        save_file(
            {k: v * scale for k, v in tensors.items()}, run / "checkpoints" / step / "tensors.safetensors"
        )
    return run


RECORDS = [
    {"epoch": 0, "kl": 0.25, "reward/a": 0.5, "seconds": 3.0, "images_per_second": 40.0},
    {"epoch": 1, "kl": 0.125, "reward/a": 0.75, "seconds": 2.5, "images_per_second": 48.0},
]
TENSORS = {"lora.A": torch.linspace(-1, 1, 12).reshape(3, 4), "adam.exp_avg": torch.ones(5)}


def test_runs_that_differ_only_in_timings_and_in_epochs_one_side_lacks_are_the_same(same_run, tmp_path):
    old = write_run(tmp_path / "old", RECORDS, TENSORS)
    faster = [
        {**r, "seconds": r["seconds"] / 2, "images_per_second": 2 * r["images_per_second"]} for r in RECORDS
    ]
    pretrained = {"epoch": -1, "eval/a": 0.1}  # a record only the newer trainer writes
    new = write_run(tmp_path / "new", [pretrained, *faster], TENSORS)
    assert same_run.compare(old, new) == []


def test_a_changed_record_value_is_reported(same_run, tmp_path):
    old = write_run(tmp_path / "old", RECORDS, TENSORS)
    changed = [RECORDS[0], {**RECORDS[1], "kl": 0.125000001}]
    new = write_run(tmp_path / "new", changed, TENSORS)
    assert same_run.compare(old, new) == ["epoch 1: a record differs (['epoch', 'kl', 'reward/a']...)"]


def test_a_tensor_one_rounding_apart_is_reported(same_run, tmp_path):
    old = write_run(tmp_path / "old", RECORDS, TENSORS)
    nudged = dict(TENSORS, **{"lora.A": torch.nextafter(TENSORS["lora.A"], torch.tensor(2.0))})
    new = write_run(tmp_path / "new", RECORDS, nudged)
    assert same_run.compare(old, new) == ["1 checkpoint tensors differ, e.g. ['lora.A']"]


def test_runs_with_no_common_epoch_are_not_called_the_same(same_run, tmp_path):
    old = write_run(tmp_path / "old", RECORDS[:1], TENSORS)
    new = write_run(tmp_path / "new", RECORDS[1:], TENSORS)
    assert same_run.compare(old, new) == ["no epoch has records in both runs"]
