"""Evaluation helpers: NaN-aware means, the composite z-score; run plots and sample grids (figures)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from mogo_diffusion import figures
from mogo_diffusion.config import Config
from mogo_diffusion.evaluate import (
    composite_zscores,
    main,
    parse_metric,
    read_metrics,
    results_table,
    reward_zscores,
)
from mogo_diffusion.train import Trainer
from tests.diffusion.test_imagereward import tiny_imagereward


def test_composite_is_the_mean_z_score_and_ignores_constant_rewards():
    means = {"a": [1.0, 10.0, 5.0], "b": [3.0, 30.0, 5.0], "c": [2.0, 20.0, 5.0]}
    composite = composite_zscores(means)
    z = (1.0 - 2.0) / np.std([1.0, 3.0, 2.0])
    assert composite["a"] == pytest.approx(z)  # both informative rewards give the same z
    assert composite["b"] == pytest.approx(-z)
    assert composite["c"] == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="at least two runs"):
        composite_zscores({"a": [1.0]})


def test_zscores_against_a_reference_set_of_runs():
    reference = {"a": [1.0, 10.0, 5.0], "b": [3.0, 30.0, 5.0]}  # mean 2, 20, 5; std 1, 10, 0
    runs = {"seed0": [4.0, 10.0, 7.0], "seed1": [2.0, 25.0, 5.0]}
    assert reward_zscores(runs, reference) == {"seed0": [2.0, -1.0, 0.0], "seed1": [0.0, 0.5, 0.0]}
    composite = composite_zscores(runs, reference)  # the constant third reward is left out
    assert composite == {"seed0": pytest.approx(0.5), "seed1": pytest.approx(0.25)}
    assert reward_zscores(reference) == {"a": [-1.0, -1.0, 0.0], "b": [1.0, 1.0, 0.0]}
    with pytest.raises(ValueError, match="at least two runs"):
        reward_zscores(runs, {"a": [1.0, 2.0, 3.0]})


@given(
    st.lists(st.lists(st.floats(-100, 100), min_size=3, max_size=3), min_size=2, max_size=6),
    st.floats(0.1, 10),
    st.floats(-5, 5),
)
def test_composite_is_invariant_to_each_rewards_scale_and_offset(rows, scale, offset):
    means = {f"run{i}": row for i, row in enumerate(rows)}
    moved = {name: [scale * row[0] + offset, *row[1:]] for name, row in means.items()}
    first, second = composite_zscores(means), composite_zscores(moved)
    assert sum(first.values()) == pytest.approx(0.0, abs=1e-6)
    for name in means:
        assert second[name] == pytest.approx(first[name], abs=1e-6)


def test_plot_run_draws_every_kind_of_curve(tmp_path):
    records = [
        {"epoch": e, "reward/color": 0.1 * e, "reward/shape": 0.5, "eval/color": 0.2 * e,
         "alpha/color": 0.3, "alpha/shape": 0.7, "conflict_rate": 0.5}
        for e in range(4)
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert read_metrics(tmp_path) == records
    panels = figures.run_curves(records).axes
    assert [axis.get_title().split(" ")[0] for axis in panels] == [
        "training",
        "held-out",
        "alpha",
        "conflict",
    ]
    curves = {(axis.get_title().split(" ")[0], line.get_label()): line.get_ydata() for axis in panels
              for line in axis.get_lines()}  # fmt: skip
    assert list(curves["training", "color"]) == [0.1 * e for e in range(4)]
    assert list(curves["alpha", "shape"]) == [0.7] * 4
    assert figures.plot_run(tmp_path) == tmp_path / "curves.png"
    with Image.open(tmp_path / "curves.png") as image:
        assert image.size == (4 * 462, 374)  # four panels of 4.2 x 3.4 inches at 110 dots per inch
    with pytest.raises(FileNotFoundError, match="metrics"):
        read_metrics(tmp_path / "missing")


def test_a_cut_off_last_metrics_line_is_left_out_with_a_warning(tmp_path):
    """Issue 39 item 6: a last line cut off by a kill stopped every reader with a bare JSONDecodeError."""
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"epoch": e}) + "\n" for e in (0, 1)))
    with (tmp_path / "metrics.jsonl").open("a") as file:
        file.write('{"epoch": 2, "seconds": 1.')  # killed in the middle of the write
    with pytest.warns(UserWarning, match=r"metrics\.jsonl': its last line is cut off"):
        assert [r["epoch"] for r in read_metrics(tmp_path)] == [0, 1]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text("\n".join([lines[0], "{oops", *lines[1:]]) + "\n")
    with pytest.raises(RuntimeError, match=r"metrics\.jsonl': line 2 is not a metrics record"):
        read_metrics(tmp_path)
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        read_metrics(tmp_path / "absent")


def test_epochs_logged_again_are_read_once_the_last_attempt_winning(tmp_path):
    """Issue 39 item 7: a metrics file written before runs kept one record per epoch ([0, 1, 2, 1, 2]
    after a resume from epoch 1) counted the repeats in the study's curves, alphas and epoch times."""
    epochs, seconds = [0, 1, 2, 1, 2], [1.0, 2.0, 3.0, 20.0, 30.0]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"epoch": e, "seconds": s}) + "\n" for e, s in zip(epochs, seconds, strict=True))
    )
    with pytest.warns(UserWarning, match=r"logs epochs \[1, 2\] more than once"):
        records = read_metrics(tmp_path)
    assert [(r["epoch"], r["seconds"]) for r in records] == [(0, 1.0), (1, 20.0), (2, 30.0)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"epoch": e}) + "\n" for e in (0, 1)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean file reads without a word
        assert read_metrics(tmp_path) == [{"epoch": 0}, {"epoch": 1}]


def test_save_grid_places_each_image(tmp_path):
    images = torch.zeros(5, 3, 4, 4)
    images[3, 0] = 1.0  # the fourth image is red
    path = figures.save_grid(images, tmp_path / "grid.png", columns=2, scale=1)
    grid = np.asarray(Image.open(path))
    assert grid.shape == (3 * 5 + 1, 2 * 5 + 1, 3)
    assert grid[1 + 5 + 1, 1 + 5 + 1].tolist() == [255, 0, 0]  # row 1, column 1
    assert grid[1, 1].tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match=r"\[N, 3, H, W\]"):
        figures.save_grid(torch.zeros(3, 4, 4), tmp_path / "bad.png")


def test_save_comparison_shows_each_prompt_with_its_two_images(tmp_path):
    base, trained = torch.zeros(5, 3, 8, 8), torch.ones(5, 3, 8, 8)
    path = figures.save_comparison(
        base, trained, [f"prompt {i}" for i in range(5)], tmp_path / "pairs.png", columns=3
    )
    picture = np.asarray(Image.open(path).convert("L"))
    assert picture.min() == 0  # the black base images are drawn
    assert picture.shape[1] > picture.shape[0]  # two rows of three pairs, wider than tall
    with pytest.raises(ValueError, match="must be \\[N, 3, H, W\\] for the 4 prompts"):
        figures.save_comparison(base, trained, ["a"] * 4, tmp_path / "bad.png")


# ---- python -m mogo_diffusion.evaluate on tiny runs ---------------------------------------------


def _run_config(tiny_dir, out, strategy: dict, **train) -> Config:
    return Config.from_dict(
        {
            "model": {"pretrained": str(tiny_dir), "dtype": "float32", "lora_rank": 4, "lora_alpha": 8,
                      "max_sequence_length": 16},
            "sampling": {"num_steps": 2, "eval_num_steps": 3, "resolution": 32, "group_size": 2,
                         "prompts_per_epoch": 2, "batch_size": 4, "solver": "euler",
                         "eval_prompts": "shapes:heldout:5"},
            "rewards": [{"name": "jpeg_compressibility", "weight": 1.0},
                        {"name": "sharpness", "weight": 1.0}],
            "strategy": strategy,
            "train": {"epochs": 2, "batch_size": 4, "mixed_precision": "no", "out_dir": str(out),
                      "checkpoint_every": 1, "eval_every": 1, "lr": 3e-2, "eval_ema_decay": 0.5, **train},
        }
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_dir):
    """Two tiny runs of two epochs (MARBLE and the weighted sum), evaluated and saved every epoch."""
    tiny = tiny_dir
    root = tmp_path_factory.mktemp("runs")
    strategies = {"marble": {"name": "marble", "harmonize_every": 1}, "sum": {"name": "weighted_sum"}}
    for name, strategy in strategies.items():
        Trainer.from_config(_run_config(tiny, root / name, strategy)).train()
    return tiny, root


def _evaluate(capsys, *argv) -> dict:
    main([str(a) for a in argv])
    out = Path(capsys.readouterr().err.strip().split("wrote ")[-1])
    return json.loads(out.read_text())


def test_evaluate_reproduces_each_runs_own_heldout_evaluation_and_combines_them(runs, capsys, tmp_path):
    _, root = runs
    results = []
    for run in ("marble", "sum"):
        logged = {record["epoch"]: record for record in read_metrics(root / run)}
        for epoch, source in ((1, root / run / "checkpoints" / "step-000001"), (2, root / run)):
            result = _evaluate(capsys, source)  # a run directory: its latest checkpoint
            assert (result["epoch"], result["num_prompts"]) == (epoch, 5)
            # the same weights (the evaluation EMA), prompts and noise as in training: the same numbers
            expected = {
                k.removeprefix("eval/"): v for k, v in logged[epoch - 1].items() if k.startswith("eval/")
            }
            assert result["metrics"] == expected
        assert result["name"] == f"{run}/step-000002"
        assert Path(result["checkpoint"]).name == "step-000002"
        assert (root / run / "eval-step-000002.json").is_file()
        results.append(root / run / "eval-step-000002.json")
    assert logged[0]["eval/sharpness"] != logged[1]["eval/sharpness"]  # the weights did move
    main(["--combine", *map(str, results), "--out", str(tmp_path / "table.md")])
    table = capsys.readouterr().out
    assert table == (tmp_path / "table.md").read_text()
    assert table.splitlines()[0] == "| run | jpeg_compressibility | sharpness | composite |"
    summary = json.loads((tmp_path / "table.json").read_text())
    means = {name: list(row.values()) for name, row in summary["metrics"].items()}
    assert summary["composite"] == composite_zscores(means)
    assert set(summary["composite"]) == {"marble/step-000002", "sum/step-000002"}
    for name, value in summary["composite"].items():
        assert f"| {name} |" in table
        assert f"{value:.4g} |" in table


def test_base_is_the_pretrained_model_from_the_same_noise(runs, capsys, tmp_path):
    tiny, root = runs
    # A checkpoint saved before training: its adapter's B is 0, so it samples as the pretrained model.
    untrained = Trainer.from_config(_run_config(tiny, tmp_path / "untrained", {"name": "weighted_sum"}))
    untrained.save()
    tiny_imagereward(tmp_path / "imagereward")
    metrics = ["--metric", "color_match", "--metric", f"imagereward:model={tmp_path / 'imagereward'}"]
    zero = _evaluate(capsys, tmp_path / "untrained" / "checkpoints" / "step-000000", *metrics)
    base = _evaluate(capsys, root / "marble", "--base", *metrics, "--out", tmp_path / "b.json")
    assert (base["base"], base["epoch"], base["checkpoint"]) == (True, None, None)
    assert base["name"] == "marble/base"
    from_checkpoint = _evaluate(capsys, root / "marble" / "checkpoints" / "step-000001", "--base")
    assert from_checkpoint["name"] == "marble/base"
    assert (root / "marble" / "eval-base.json").is_file()  # in the run directory
    assert from_checkpoint["metrics"] == {k: base["metrics"][k] for k in from_checkpoint["metrics"]}
    assert base["metrics"] == zero["metrics"]
    # the run's first record, its evaluation before training (B = 0), is the pretrained model's
    pretrained = read_metrics(root / "marble", pretrained=True)[0]
    assert pretrained["epoch"] == -1
    assert {k.removeprefix("eval/"): v for k, v in pretrained.items() if k.startswith("eval/")} == {
        k: base["metrics"][k] for k in ("jpeg_compressibility", "sharpness")
    }
    assert list(base["metrics"]) == ["jpeg_compressibility", "sharpness", "color_match", "imagereward"]
    assert all(math.isfinite(value) for value in base["metrics"].values())
    trained = json.loads((root / "marble" / "eval-step-000002.json").read_text())
    assert trained["metrics"]["sharpness"] != base["metrics"]["sharpness"]
    config = tmp_path / "run.yaml"
    _run_config(tiny, tmp_path / "other", {"name": "weighted_sum"}).save(config)
    other = _evaluate(capsys, config, "--base", "--prompts", "shapes:heldout:3", "--out", tmp_path / "c.json")
    assert (other["num_prompts"], other["prompts"]) == (3, "shapes:heldout:3")
    assert other["metrics"] != {k: base["metrics"][k] for k in other["metrics"]}  # 3 of the 5 prompts


def test_evaluate_errors_are_one_line(runs, capsys, tmp_path):
    _, root = runs
    checkpoint = root / "sum" / "checkpoints" / "step-000001"
    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoint, damaged)
    with (damaged / "tensors.safetensors").open("r+b") as file:
        file.seek(-1, 2)
        file.write(b"\x00" if file.read(1) != b"\x00" else b"\x01")
    cases = [
        ([tmp_path / "missing"], "does not exist"),
        ([damaged], "tensors.safetensors' differs from its hash"),
        ([checkpoint, "--metric", "imagerewrd"], "unknown reward 'imagerewrd'"),
        ([checkpoint, "--metric", "sharpness"], "one of the run's rewards"),
        ([checkpoint, "--metric", "color_match:size=3"], "metric 'color_match': ColorMatch"),
        ([tmp_path], "no manifest.json"),
        ([], "either a SOURCE"),
        (["--combine", root / "sum" / "eval-step-000002.json"], "at least two runs"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main([str(a) for a in argv])
        assert exit_info.value.code == 2
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert message in error, error


def test_results_on_other_prompts_are_neither_combined_nor_written_over(runs, capsys):
    """Issue 39 item 15: --combine put results of different prompt sets side by side (composites
    -1 and +1 for one checkpoint), and an evaluation on other prompts replaced the default
    eval-step-N.json. Other prompts get their own file, and combining them is refused naming both."""
    _, root = runs
    own = _evaluate(capsys, root / "sum")
    written = root / "sum" / "eval-step-000002.json"
    kept = written.read_bytes()
    other = _evaluate(capsys, root / "sum", "--prompts", "shapes:heldout:3", "--name", "sum-3")
    assert written.read_bytes() == kept
    assert (other["num_prompts"], own["num_prompts"]) == (3, 5)
    assert other["prompts_sha256"] != own["prompts_sha256"]
    assert json.loads((root / "sum" / "eval-step-000002-shapes-heldout-3.json").read_text()) == other
    with pytest.raises(SystemExit):
        main(["--combine", str(written), str(root / "sum" / "eval-step-000002-shapes-heldout-3.json")])
    error = capsys.readouterr().err
    assert "'sum/step-000002' was evaluated on shapes:heldout:5 (5 prompts" in error
    assert "'sum-3' on shapes:heldout:3 (3 prompts" in error
    moved = {**json.loads(kept), "prompts_sha256": "0" * 64}  # made on other prompts, of the same name
    written.write_text(json.dumps(moved))
    with pytest.raises(SystemExit):
        main([str(root / "sum")])
    assert "eval-step-000002.json' holds an evaluation on shapes:heldout:5" in capsys.readouterr().err
    assert json.loads(written.read_text()) == moved


def test_results_table_needs_distinct_names_and_a_common_metric():
    with pytest.raises(ValueError, match=r"distinct names, got \['a'\]"):
        results_table([{"name": "a", "metrics": {"x": 1.0}}] * 2)
    with pytest.raises(ValueError, match="no metric has a mean in every run: x, y"):
        results_table([{"name": "a", "metrics": {"x": 1.0}}, {"name": "b", "metrics": {"y": 1.0}}])
    with pytest.raises(ValueError, match="got the option 'size'"):
        parse_metric("color_match:size")


@pytest.mark.spawns
def test_the_command_has_help():
    done = subprocess.run(
        [sys.executable, "-m", "mogo_diffusion.evaluate", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--combine" in done.stdout
    assert "--base" in done.stdout
