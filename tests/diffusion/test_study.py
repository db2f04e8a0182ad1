"""The shapes study: its plan, its verdicts on constructed results, and a quick run end to end."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest

from mogo_diffusion import compare, study

NAMES = ("r1", "r2")
SEEDS = range(5)
SHARED = [0.02, -0.01, 0.0, 0.015, -0.02]  # a seed effect common to every arm


def history(values, seed, *, seconds=1.0, alpha=None, conflict=None):
    """Two epochs of metrics records ending in a held-out evaluation of ``values``."""
    record = {
        "seconds": seconds,
        **{f"eval/{n}": v + SHARED[seed] for n, v in zip(NAMES, values, strict=True)},
    }
    if alpha is not None:
        record.update({f"alpha/{n}": a for n, a in zip(NAMES, alpha, strict=True)})
        record.update(conflict_rate=conflict, worst_cosine_marble=0.0)
    return [{"seconds": seconds}, record]


def histories(marble, *, marble_seconds=1.0, conflict=0.7):
    arms = {
        "single:r1": [0.52, 0.40],  # r1 is hard: its specialist gains 0.02
        "single:r2": [0.45, 0.80],  # r2 is easy: 0.30
        "weighted_sum": [0.50, 0.60],
    }
    result = {arm: {s: history(v, s) for s in SEEDS} for arm, v in arms.items()}
    result["marble_n10"] = {
        s: history(marble, s, seconds=marble_seconds, alpha=[0.7, 0.3], conflict=conflict + 0.01 * s)
        for s in SEEDS
    }
    return result


BASE = {"eval/r1": 0.50, "eval/r2": 0.50}


def test_a_marble_better_on_every_reward_reproduces_every_claim():
    summary = study.analyse(NAMES, BASE, histories([0.56, 0.70]))
    verdicts = {key: claim["verdict"] for key, claim in summary["claims"].items()}
    assert verdicts == dict.fromkeys("abcde", "reproduced")
    mean, low, high = summary["arms"]["marble_n10"]["vs_reference"]["r1"]
    assert mean == pytest.approx(0.06)
    assert low == pytest.approx(0.06)  # the seed effect is shared, so pairing removes it entirely
    assert high == pytest.approx(0.06)
    assert summary["arms"]["weighted_sum"]["vs_reference"]["composite"] == [0.0, 0.0, 0.0]
    assert summary["claims"]["d"]["numbers"]["mean_alpha"] == pytest.approx([0.7, 0.3])


def test_a_specialist_clears_its_bar_when_its_gain_is_three_seed_stds_or_three_floors():
    gains = study.analyse(NAMES, BASE, histories([0.56, 0.70]))["specialists"]
    # r1 gains 0.02 + mean(SHARED) = 0.021 with the shared seed effect's std (0.0167): bar 3 x 0.02
    assert gains["r1"]["gain"] == pytest.approx(0.021)
    assert gains["r1"]["std"] == pytest.approx(statistics.stdev(SHARED))
    assert gains["r1"]["bar"] == pytest.approx(0.06)
    assert not gains["r1"]["clears"]
    assert gains["r2"]["gain"] == pytest.approx(0.301)  # r2 gains 0.30, above 0.06
    assert gains["r2"]["clears"]


def test_what_marble_loses_is_not_reproduced_and_noise_is_undecided():
    lost = study.analyse(NAMES, BASE, histories([0.45, 0.70], marble_seconds=1.2, conflict=0.2))
    verdicts = {key: claim["verdict"] for key, claim in lost["claims"].items()}
    assert verdicts["a"] == "not reproduced"  # r1 below the pretrained model in every seed
    assert verdicts["c"] == "not reproduced"  # the weighted sum conflicted in a fifth of the steps
    assert verdicts["e"] == "not reproduced"  # 1 / 1.2 < 0.97 in every seed
    noisy = histories([0.56, 0.70])
    for s, offset in zip(SEEDS, [0.3, -0.3, 0.3, -0.3, 0.1], strict=True):
        noisy["marble_n10"][s][-1]["eval/r1"] += offset
    assert study.analyse(NAMES, BASE, noisy)["claims"]["a"]["verdict"] == "undecided (CI spans 0)"
    # a claim judged against another threshold names it: (e) asks for >= 0.97x the throughput
    straddling = histories([0.56, 0.70])
    for s, ratio in zip(SEEDS, [0.94, 1.0, 0.94, 1.0, 0.97], strict=True):
        for record in straddling["marble_n10"][s]:
            record["seconds"] = 1.0 / ratio
    verdict = study.analyse(NAMES, BASE, straddling)["claims"]["e"]["verdict"]
    assert verdict == "undecided (CI spans 0.97)"


def test_a_learning_curve_starts_at_the_pretrained_model_and_sums_the_training_seconds():
    records = [
        {"epoch": 0, "seconds": 30.0},
        {"epoch": 1, "seconds": 42.0, "eval/r1": 0.7},
        {"epoch": 2, "seconds": 18.0},
        {"epoch": 3, "seconds": 30.0, "eval/r1": 0.9},
    ]
    assert study._curve(records, "eval/r1", 0.5) == [
        {"epoch": 0, "minutes": 0.0, "value": 0.5},
        {"epoch": 2, "minutes": 1.2, "value": 0.7},
        {"epoch": 4, "minutes": 2.0, "value": 0.9},
    ]
    assert study._curve(records, "eval/r2", 0.5) == []  # a reward this run never evaluated


def test_the_plan_shares_specialists_between_the_sets_and_runs_ablations_on_the_first(tmp_path):
    runs = study.plan(tmp_path, arms=("weighted_sum", "marble_n10"), seeds=range(2))
    groups = {(group, arm) for group, arm, _ in runs}
    assert {arm for group, arm in groups if group == "specialists"} == {
        f"single:{r}" for r in compare.REWARDS
    }
    assert {arm for group, arm in groups if group == "with_quality"} == {"weighted_sum", "marble_n10"}
    first = {arm for group, arm in groups if group == "prompt_following"}
    assert first == {"weighted_sum", "marble_n10", *compare.ABLATIONS}
    config = runs["prompt_following", "marble_n10", 1]
    chosen = study.REWARD_SETS["prompt_following"]
    assert [spec.name for spec in config.rewards] == [
        r for r in compare.REWARDS if r in chosen
    ]  # their order
    assert config.train.seed == 1
    assert [spec.name for spec in runs["specialists", "single:clipscore", 0].rewards] == list(compare.REWARDS)
    with pytest.raises(ValueError, match="specialists \\['sharpness'\\] are not rewards of the sets"):
        study.plan(tmp_path, specialists=["sharpness"])


def test_the_quick_study_runs_resumes_and_writes_its_results(tmp_path):
    argv = ["--quick", "--out", str(tmp_path), "--seeds", "2", "--sets", "prompt_following", "--no-ablations",
            "--arms", "weighted_sum,marble_n10", "--specialists", "shapes_color"]  # fmt: skip
    results = study.main(argv)
    summary = results["sets"]["prompt_following"]
    assert list(summary["arms"]) == ["single:shapes_color", "weighted_sum", "marble_n10"]
    assert set(summary["claims"]) == {"a", "b", "c", "e"}  # (d) needs every reward's specialist
    undecided = {f"undecided (CI spans {threshold})" for threshold in ("0", "0.5", "0.97")}
    assert all(claim["verdict"] in {"reproduced", "not reproduced", *undecided}
               for claim in summary["claims"].values())  # fmt: skip
    assert json.loads((tmp_path / "results.json").read_text())["sets"].keys() == {"prompt_following"}
    assert "| (a) |" in (tmp_path / "results.md").read_text()
    assert ".. list-table:: The paper's claims." in (tmp_path / "results.rst").read_text()
    assert (tmp_path / "composite.png").stat().st_size > 10_000
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    run = tmp_path / "runs" / "prompt_following" / "marble_n10" / "seed1"
    final = json.loads((run / compare.FINAL_EVAL).read_text())
    assert final["num_prompts"] == 24  # judged on the final evaluation's prompts, not the 16 of training's
    mean, *_ = summary["arms"]["marble_n10"]["vs_base"]["shapes_color"]
    base_color = summary["base"][summary["rewards"].index("shapes_color")]
    assert statistics.fmean(summary["arms"]["marble_n10"]["means"]["shapes_color"]) == pytest.approx(
        base_color + mean
    )
    assert final["metrics"]["shapes_color"] in summary["arms"]["marble_n10"]["means"]["shapes_color"]
    kept = (run / "run.json", run / "finished.json", run / "metrics.jsonl", run / compare.FINAL_EVAL)
    written = [path.stat().st_mtime_ns for path in kept]
    for path in run.iterdir():  # a run kept as its record, marker, metrics and final evaluation
        if path not in kept:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    seed0 = run.parent / "seed0"  # finished with its checkpoint, but not evaluated finally
    (seed0 / compare.FINAL_EVAL).unlink()
    trained = (seed0 / "metrics.jsonl").stat().st_mtime_ns
    study.main(argv)
    assert [path.stat().st_mtime_ns for path in kept] == written  # finished runs are not rerun
    assert json.loads((seed0 / compare.FINAL_EVAL).read_text())["num_prompts"] == 24  # evaluated again,
    assert (seed0 / "metrics.jsonl").stat().st_mtime_ns == trained  # not trained again
    # A study in progress: with a third seed planned, --no-train reports the two finished ones.
    partial = study.main([*argv[:4], "3", *argv[5:], "--no-train"])
    assert partial["sets"]["prompt_following"]["seeds"] == [0, 1]
    assert not (run.parent / "seed2").exists()
    with pytest.raises(SystemExit):
        study.main([*argv[:2], str(tmp_path / "empty"), *argv[3:], "--no-train"])


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(SystemExit):
        study.main(["--out", str(tmp_path), "--sets", "colours"])
    with pytest.raises(SystemExit):
        study.main(["--out", str(tmp_path), "--arms", "marble_n10"])  # no weighted sum to pair against
    with pytest.raises(SystemExit):
        study.main(["--out", str(tmp_path), "--seeds", "1"])


def test_no_train_remakes_the_committed_study_and_only_it_reads_runs_without_records(tmp_path, monkeypatch):
    """The committed study keeps its runs as their metrics and final evaluation, written before
    runs had a record (run.json): --no-train reads them as they are, its tables byte for byte the
    committed ones; a study that would train refuses them (their config cannot be checked), and
    writes nothing."""
    committed = Path(__file__).resolve().parents[2] / "docs" / "_generated" / "study_120x128"
    out = Path("docs") / "_generated" / "study_120x128"  # the committed command, run in a copy
    shutil.copytree(committed, tmp_path / out)
    monkeypatch.chdir(tmp_path)
    study.main(["--out", str(out), "--no-train"])
    for name in ("results.md", "results.rst"):
        assert (out / name).read_text() == (committed / name).read_text(), name
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    with pytest.raises(SystemExit) as exit_:
        study.main(["--out", str(out)])
    assert exit_.value.code == 2
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before
