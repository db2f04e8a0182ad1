"""The embedded default run and the comparison, on the shipped shapes pipeline, in reduced form."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

import mogo
from mogo_diffusion import compare
from mogo_diffusion.config import Config
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


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """A quick comparison of three arms, one seed each: its output directory and summary."""
    out = tmp_path_factory.mktemp("quick")
    arms = "weighted_sum,marble_n10,single:shapes_count"
    return out, compare.main(["--quick", "--out", str(out), "--arms", arms])


def copy_out(quick, tmp_path: Path) -> Path:
    return Path(shutil.copytree(quick[0], tmp_path / "out"))


def files(directory: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in directory.rglob("*") if path.is_file()}


def test_quick_comparison_writes_the_table_and_figures(quick, tmp_path):
    out, summary = copy_out(quick, tmp_path), quick[1]
    rows = summary["arms"]
    assert list(rows) == ["base", "weighted_sum", "marble_n10", "single:shapes_count"]
    assert rows["weighted_sum"]["throughput_vs_weighted_sum"] == 1.0
    assert 0 <= rows["marble_n10"]["conflict_rate"][0] <= 1
    assert rows["marble_n10"]["worst_cosine_marble"][0] >= -1e-6
    assert not math.isnan(rows["base"]["composite"][0])
    table = (out / "results.md").read_text()
    assert all(f"| {arm} |" in table for arm in rows)
    assert json.loads((out / "results.json").read_text())["arms"].keys() == rows.keys()
    assert (out / "results.rst").read_text().count(".. list-table::") == 2
    for figure in ("pareto.png", "rewards.png", "alpha.png"):
        assert (out / figure).stat().st_size > 10_000
    run = out / "runs" / "weighted_sum" / "seed0"
    trained = files(run)
    again = compare.main(["--quick", "--out", str(out), "--arms", "weighted_sum"])
    assert files(run) == trained  # a finished run is not rerun
    assert again["arms"]["weighted_sum"]["shapes_color"] == rows["weighted_sum"]["shapes_color"]


def test_a_comparison_of_another_config_refuses_the_runs_it_finds(quick, tmp_path, capsys):
    """Issue 39 item 1: `--quick`, then `--epochs 2 --seeds 1` into the same --out returned the quick
    runs' table in seconds, labelled with the second command: a run counted as finished when its
    last logged epoch was the one asked for. Each run is refused, naming the fields that differ,
    and nothing is trained or written."""
    out = copy_out(quick, tmp_path)
    before = files(out)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        compare.main(
            ["--epochs", "2", "--seeds", "1", "--arms", "weighted_sum", "--out", str(out), "--jobs", "1"]
        )
    assert exit_.value.code == 2
    said = capsys.readouterr()
    assert f"refuse {out / 'runs' / 'weighted_sum' / 'seed0'}: holds the run of another config (" in said.out
    assert "sampling.prompts_per_epoch: 4 there, 16 requested" in said.err
    assert files(out) == before


def test_a_run_of_other_epochs_is_refused_not_deleted(quick, tmp_path):
    """Issue 39 item 2: a finished run whose last epoch was not the one asked for (`--epochs 60`
    after `--epochs 120`) was deleted, checkpoints and all, and trained again. It is refused."""
    out = copy_out(quick, tmp_path)
    run = out / "runs" / "weighted_sum" / "seed0"
    data = compare.arm_config("weighted_sum", 0, run, quick=True).to_dict()
    data["train"]["epochs"] = 3
    before = files(run)
    with pytest.raises(RuntimeError, match=r"train\.epochs: 2 there, 3 requested"):
        compare.run_all(
            {("weighted_sum", 0): Config.from_dict(data)}, out / "runs" / "base" / "eval.json", jobs=1
        )
    assert files(run) == before


def test_damaged_json_does_not_stop_a_comparison(quick, tmp_path):
    """Issue 39 item 6: a metrics line cut off by a kill, or a damaged base/eval.json, stopped the
    comparison with a bare JSONDecodeError on every restart. The unfinished run starts over (it has
    no checkpoint yet) and the damaged cache is made again, with a warning."""
    out = copy_out(quick, tmp_path)
    run = out / "runs" / "weighted_sum" / "seed0"
    config = compare.arm_config("weighted_sum", 0, run, quick=True)
    # what a kill while the last epoch's line is written leaves: no final checkpoint, no marker, no figures
    for name in ("finished.json", "samples.png", "curves.png"):
        (run / name).unlink(missing_ok=True)
    shutil.rmtree(run / "checkpoints" / "step-000002")
    text = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(text[: len(text) - len(text.splitlines()[-1]) // 2])
    base = out / "runs" / "base" / "eval.json"
    means = compare.evaluate_base(config, base)  # as cached
    base.write_text(base.read_text()[:40])
    assert not compare.done(config)
    assert compare.decide(config) == ("restart", "unfinished, no checkpoint to resume")
    with pytest.warns(UserWarning, match=r"eval\.json' is damaged .*: it is made again"):
        again = compare.run_all({("weighted_sum", 0): config}, base, jobs=1)
    held_out = {key: value for key, value in means.items() if key.startswith("eval/")}
    assert {key: again[key] for key in held_out} == held_out  # the same model, prompts and noise
    assert [r["epoch"] for r in read_metrics(run)] == [0, 1]
    assert compare.done(config)


def test_final_and_base_evaluations_are_reused_for_their_own_prompts_only(quick, tmp_path):
    """Issue 39 items 1 and 6: any final_eval.json counted as done, and the base cache was returned
    whatever the prompts. Each is reused for its own prompts and weights only: another request is
    refused, the file kept; a damaged one is made again."""
    out = copy_out(quick, tmp_path)
    run = out / "runs" / "weighted_sum" / "seed0"
    config = compare.arm_config("weighted_sum", 0, run, quick=True)
    configs, base = {("weighted_sum", 0): config}, out / "runs" / "base" / "eval.json"
    compare.run_all(configs, base, jobs=1, final="shapes:heldout:4")
    assert compare.done(config, "shapes:heldout:4")
    assert not compare.done(config, "shapes:heldout:5")
    from mogo_diffusion.checkpoint import checkpoint_digest  # (after the checks the old code fails)

    final = json.loads((run / compare.FINAL_EVAL).read_text())
    assert final["num_prompts"] == 4
    assert final["checkpoint_sha256"] == checkpoint_digest(run / "checkpoints" / "step-000002")
    kept = (run / compare.FINAL_EVAL).read_bytes()
    with pytest.raises(RuntimeError, match=r"final_eval\.json' is another evaluation \(prompts_sha256: "):
        compare.run_all(configs, base, jobs=1, final="shapes:heldout:5")
    assert (run / compare.FINAL_EVAL).read_bytes() == kept
    (run / compare.FINAL_EVAL).write_bytes(kept[:100])
    with pytest.warns(UserWarning, match=r"final_eval\.json' is damaged"):
        assert compare.decide(config, "shapes:heldout:4") == (
            "evaluate",
            "finished; its final evaluation is damaged",
        )
    cached = base.read_bytes()
    with pytest.raises(
        RuntimeError, match=r"eval\.json' evaluates another request \(.*num_prompts: 16 there, 8 requ"
    ):
        compare.evaluate_base(config, base, prompts="shapes:heldout:8")
    assert base.read_bytes() == cached
