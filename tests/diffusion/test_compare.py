"""The embedded default run and the comparison, on the shipped shapes pipeline, in reduced form."""

from __future__ import annotations

import json
import math

import pytest

import mogo
from mogo_diffusion import compare
from mogo_diffusion.evaluate import read_metrics
from mogo_diffusion.shapes.recipe import DEFAULT_REWARDS, REWARDS, shapes_config
from mogo_diffusion.train import main


def test_the_default_command_trains_the_shapes_world(tmp_path):
    out = tmp_path / "run"
    main(["--set", "train.epochs=2", "--set", f"train.out_dir={out}", "--set", "sampling.prompts_per_epoch=2",
          "--set", "sampling.eval_prompts=shapes:heldout:8"])  # fmt: skip
    records = read_metrics(out)
    assert [r["epoch"] for r in records] == [0, 1]
    assert {f"eval/{name}" for name in DEFAULT_REWARDS} <= set(records[-1])
    assert "eval/jpeg_compressibility" not in records[-1]
    assert 0 <= records[-1]["eval/shapes_color"] <= 1
    assert -1 <= records[-1]["eval/clipscore"] <= 1  # the tiny CLIP through the CLIPScore wrapper
    assert records[-1]["worst_cosine_marble"] >= -1e-6  # the harmonized direction opposes no reward
    assert 1 <= records[-1]["diagnostic/distinct_scenes"] <= 8  # the collapse guard, of 8 held-out images
    for name in ("samples.png", "curves.png", "config.yaml"):
        assert (out / name).stat().st_size > 0


def test_arms_differ_only_in_their_strategy(tmp_path):
    configs = {arm: compare.arm_config(arm, 1, tmp_path / arm) for arm in compare.arms()}
    assert len(configs) == len(REWARDS) + 8
    assert (configs["upgrad_n10"].strategy.name, configs["cagrad_n10"].strategy.name) == ("upgrad", "cagrad")
    base = shapes_config().to_dict()
    for arm, config in configs.items():
        data = config.to_dict()
        assert data["train"]["seed"] == 1
        assert [spec["name"] for spec in data["rewards"]] == list(REWARDS), arm  # every reward of the world
        assert data["nft"] == {**base["nft"], "nonapplicable": "exclude"}, arm  # as the study was frozen
        assert {k: v for k, v in data.items() if k not in ("strategy", "train", "rewards", "nft")} == {
            k: v for k, v in base.items() if k not in ("strategy", "train", "rewards", "nft")
        }, arm
    assert configs["sequential"].strategy.stages[0].reward == REWARDS[0]
    assert configs["weighted_sum_z"].strategy.reward_scale == "zscore"
    assert configs["marble_n10_window"].strategy.estimate == "window"
    assert configs["marble_n10"].strategy.estimate == "first"
    ablations = {arm: compare.arm_config(arm, 1, tmp_path / arm) for arm in compare.ABLATIONS}
    assert ablations["marble_n10_neutral"].nft.nonapplicable == "neutral"
    assert configs["marble_n10"].nft.nonapplicable == "exclude"
    assert ablations["marble_n10_noema"].strategy.alpha_ema == 0.0
    # the default run is the study's amortized MARBLE arm on the prompt-following rewards, seed 0
    demo = compare.arm_config("marble_n10", 0, tmp_path, rewards=DEFAULT_REWARDS).to_dict()
    differ = {k for k in base["train"] if demo["train"][k] != base["train"][k]}
    assert {k: v for k, v in demo.items() if k != "train"} == {k: v for k, v in base.items() if k != "train"}
    assert differ == {"out_dir", "checkpoint_every", "eval_every"}  # the demo evaluates more often
    assert ablations["mgda_n10"].strategy.name == "mgda"
    assert mogo.make_weighting("mgda").normalize == "none"
    any_weighting = compare.arm_config("min_norm_n10", 0, tmp_path).strategy  # by its registry name
    assert (any_weighting.name, any_weighting.harmonize_every, any_weighting.alpha_ema) == (
        "min_norm",
        10,
        0.9,
    )
    with pytest.raises(ValueError, match="unknown arm 'best'"):
        compare.arm_config("best", 0, tmp_path)
    with pytest.raises(ValueError, match="unknown arm 'weighted_sum_n10'"):  # the trainer's own baseline
        compare.arm_config("weighted_sum_n10", 0, tmp_path)


def test_quick_comparison_writes_the_table_and_figures(tmp_path):
    summary = compare.main(
        ["--quick", "--out", str(tmp_path), "--arms", "weighted_sum,marble_n10,single:shapes_count"]
    )
    rows = summary["arms"]
    assert list(rows) == ["base", "weighted_sum", "marble_n10", "single:shapes_count"]
    assert rows["weighted_sum"]["throughput_vs_weighted_sum"] == 1.0
    assert 0 <= rows["marble_n10"]["conflict_rate"][0] <= 1
    assert rows["marble_n10"]["worst_cosine_marble"][0] >= -1e-6
    assert not math.isnan(rows["base"]["composite"][0])
    table = (tmp_path / "results.md").read_text()
    assert all(f"| {arm} |" in table for arm in rows)
    assert json.loads((tmp_path / "results.json").read_text())["arms"].keys() == rows.keys()
    assert (tmp_path / "results.rst").read_text().count(".. list-table::") == 2
    for figure in ("pareto.png", "rewards.png", "alpha.png"):
        assert (tmp_path / figure).stat().st_size > 10_000
    metrics = tmp_path / "runs" / "weighted_sum" / "seed0" / "metrics.jsonl"
    written = metrics.stat().st_mtime_ns
    again = compare.main(["--quick", "--out", str(tmp_path), "--arms", "weighted_sum"])
    assert metrics.stat().st_mtime_ns == written  # a finished run is not rerun
    assert again["arms"]["weighted_sum"]["shapes_color"] == rows["weighted_sum"]["shapes_color"]
