"""Evaluation helpers: NaN-aware means, the composite z-score, run plots and sample grids."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from mogo_diffusion.evaluate import (
    composite_zscores,
    plot_run,
    read_metrics,
    reward_zscores,
    save_comparison,
    save_grid,
)


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
    path = plot_run(tmp_path)
    with Image.open(path) as image:
        assert image.width > 4 * image.height / 2  # four panels side by side
    with pytest.raises(FileNotFoundError, match="metrics"):
        read_metrics(tmp_path / "missing")


def test_save_grid_places_each_image(tmp_path):
    images = torch.zeros(5, 3, 4, 4)
    images[3, 0] = 1.0  # the fourth image is red
    path = save_grid(images, tmp_path / "grid.png", columns=2, scale=1)
    grid = np.asarray(Image.open(path))
    assert grid.shape == (3 * 5 + 1, 2 * 5 + 1, 3)
    assert grid[1 + 5 + 1, 1 + 5 + 1].tolist() == [255, 0, 0]  # row 1, column 1
    assert grid[1, 1].tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match=r"\[N, 3, H, W\]"):
        save_grid(torch.zeros(3, 4, 4), tmp_path / "bad.png")


def test_save_comparison_shows_each_prompt_with_its_two_images(tmp_path):
    base, trained = torch.zeros(5, 3, 8, 8), torch.ones(5, 3, 8, 8)
    path = save_comparison(
        base, trained, [f"prompt {i}" for i in range(5)], tmp_path / "pairs.png", columns=3
    )
    picture = np.asarray(Image.open(path).convert("L"))
    assert picture.min() == 0  # the black base images are drawn
    assert picture.shape[1] > picture.shape[0]  # two rows of three pairs, wider than tall
    with pytest.raises(ValueError, match="must be \\[N, 3, H, W\\] for the 4 prompts"):
        save_comparison(base, trained, ["a"] * 4, tmp_path / "bad.png")
