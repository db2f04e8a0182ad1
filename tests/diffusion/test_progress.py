"""What a run tells its user: a line per epoch in a pipe, a bar on a terminal, the final table."""

from __future__ import annotations

import io
import math
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mogo_diffusion.progress import EpochProgress, held_out_table, run_summary

RECORDS = [
    {"epoch": 0, "images_per_second": 12.345, "reward/colour": 0.5, "reward/count": math.nan},
    {"epoch": 1, "images_per_second": 20.0, "reward/colour": 0.75, "reward/count": 0.25, "eval/colour": 0.625,
     "eval/count": math.nan},
]  # fmt: skip


def test_in_a_pipe_each_logged_epoch_is_one_line():
    stream = io.StringIO()
    with EpochProgress(0, 2, stream=stream) as progress:
        progress.evaluated("pretrained model", {"epoch": -1, "eval/colour": 0.5, "diagnostic/scenes": 3})
        progress.evaluated("nothing held out", {"epoch": 0, "reward/colour": 0.5})
        progress.epoch(RECORDS[0], logged=False)
        progress.epoch(RECORDS[1])
    assert stream.getvalue().splitlines() == [
        "pretrained model: held-out colour 0.5000",
        "epoch 2/2: 20.0 images/s | reward colour 0.7500 count 0.2500 | held-out colour 0.6250 count -",
    ]
    quiet = io.StringIO()
    with EpochProgress(0, 2, stream=quiet, enabled=False) as progress:  # a process but the main one
        progress.evaluated("pretrained model", {"eval/colour": 0.5})
        progress.epoch(RECORDS[0])
    assert quiet.getvalue() == ""


def test_on_a_terminal_a_bar_shows_the_rewards_and_the_evaluations_above_it():
    leader, follower = os.openpty()  # a real terminal: isatty() is true
    with os.fdopen(follower, "w") as terminal:
        with EpochProgress(1, 3, stream=terminal) as progress:
            assert progress.bar is not None
            progress.epoch(RECORDS[1])
        terminal.flush()
    os.set_blocking(leader, False)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except (BlockingIOError, OSError):  # all read (Linux says EIO once the terminal is closed)
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    shown = shown.decode()
    assert "epochs" in shown
    assert "2/3" in shown  # one epoch done before, one now
    assert "colour=0.75" in shown
    assert "epoch 2: held-out colour 0.6250 count -" in shown


def test_the_final_table_holds_the_first_and_the_last_evaluation():
    records = [{"epoch": -1, "eval/colour": 0.5, "eval/count": math.nan}, *RECORDS]
    assert held_out_table(records, ["colour", "count"]).splitlines() == [
        "held-out reward  pretrained     trained      change",
        "colour               0.5000      0.6250     +0.1250",
        "count                     -           -           -",
    ]
    assert held_out_table(RECORDS, ["colour"]).splitlines()[1].split() == ["colour", "-", "0.6250", "-"]


@given(before=st.floats(-1e3, 1e3), after=st.floats(-1e3, 1e3))
def test_the_final_table_shows_each_mean_and_their_difference_to_four_decimals(before, after):
    records = [{"epoch": -1, "eval/r": before}, {"epoch": 0, "eval/r": after}]
    cells = held_out_table(records, ["r"]).splitlines()[1].split()[1:]
    assert [float(cell) for cell in cells[:2]] == [round(before, 4), round(after, 4)]
    assert cells[2][0] in "+-"
    assert abs(float(cells[2]) - (after - before)) <= 0.5e-4 + 1e-9


def test_a_run_without_an_evaluation_has_no_table_and_names_what_it_wrote(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 0, "reward/colour": 0.5}\n')
    (tmp_path / "curves.png").write_bytes(b"")
    summary = run_summary(tmp_path, ["colour"], tmp_path / "checkpoints" / "step-000001")
    assert summary.splitlines() == [
        "wrote:",
        f"  run directory     {tmp_path}",
        f"  curves            {tmp_path / 'curves.png'}",
        f"  metrics           {tmp_path / 'metrics.jsonl'}",
    ]  # no samples.png, no checkpoint: what is missing is not listed
    with pytest.raises(ValueError, match="no held-out evaluation of the trained model"):
        held_out_table([{"epoch": -1, "eval/colour": 0.5}], ["colour"])
