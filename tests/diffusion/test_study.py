"""The shapes study: its plan, its verdicts on constructed results, and a quick run end to end."""

from __future__ import annotations

import importlib.util
import shutil
import statistics
from pathlib import Path

import pytest

from mogo_diffusion import compare, run_dir, study

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


def test_claim_c_is_judged_across_halves_too_by_the_cross_fitted_arm_beside_the_same_batch_rate():
    found = histories([0.56, 0.70], conflict=0.1)  # within one batch: seldom a conflict
    found[study.CROSS] = {
        s: history([0.55, 0.70], s, alpha=[0.6, 0.4], conflict=0.1 + 0.01 * s) for s in SEEDS
    }
    for s in SEEDS:  # across the halves the weighted sum opposes a reward in most batches
        found[study.CROSS][s][-1].update(
            conflict_rate_cross=0.7 + 0.01 * s, worst_cosine_weighted_sum_cross=-0.2 - 0.01 * s,
            worst_cosine_marble_cross=-0.05 * s,
        )  # fmt: skip
    claims = study.analyse(NAMES, BASE, found)["claims"]
    assert claims["c"]["verdict"] == "not reproduced"
    crossed = claims["c, across halves"]
    assert crossed["verdict"] == "reproduced"
    assert crossed["numbers"]["conflict_rate_cross"][0] == pytest.approx(0.72)
    assert crossed["numbers"]["worst_cosine_weighted_sum_cross"] == pytest.approx(-0.24)  # the lowest seed's
    assert crossed["numbers"]["worst_cosine_marble_cross"] == pytest.approx(-0.2)
    assert "c, across halves" not in study.analyse(NAMES, BASE, histories([0.56, 0.70]))["claims"]


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


def test_the_front_adds_each_sets_weight_vectors_but_the_weighted_sum_it_already_has(tmp_path):
    runs = study.plan(tmp_path, arms=("weighted_sum",), ablations=(), seeds=range(1), front=True)
    for name, rewards in study.REWARD_SETS.items():
        arms = [arm for group, arm, _ in runs if group == name]
        doubled = [
            f"weighted_sum@{','.join('2' if i == k else '1' for i in range(len(rewards)))}"
            for k in range(len(rewards))
        ]
        assert arms == ["weighted_sum", *doubled]  # the uniform point is the weighted sum's run
        for k, arm in enumerate(doubled):
            weights = [spec.weight for spec in runs[name, arm, 0].rewards]
            assert weights == [2.0 if i == k else 1.0 for i in range(len(rewards))]


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(SystemExit):
        study.main(["--out", str(tmp_path), "--sets", "colours"])
    with pytest.raises(SystemExit):
        study.main(["--out", str(tmp_path), "--arms", "marble_n10"])  # no weighted sum to pair against
    with pytest.raises(SystemExit):
        study.main(["--out", str(tmp_path), "--seeds", "1"])


ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = {  # each committed study, the program that made it and the options its docs give, but --out
    "study_120x128": ("mogo_diffusion/study.py", ["--no-train"]),
    "study": ("mogo_diffusion/study.py", ["--epochs", "60", "--no-train"]),
    "study_world1": ("mogo_diffusion/study.py", ["--epochs", "30", "--last-evaluation", "--no-train"]),
    "specialist_budget": ("benchmarks/specialist_budget.py", ["--no-train"]),
}


def not_committed(directory: str, names: list[str]) -> set[str]:
    """The names in ``directory`` a copy of a study leaves out: its figures (the command remakes
    them) and its run directories, which are not committed (``docs/_generated/.gitignore``), but
    for the pretrained model's cached evaluations."""
    return {
        name for name in names if name.endswith(".png") or (Path(directory).name == "runs" and name != "base")
    }


def remake(name: str, tmp_path: Path, monkeypatch) -> Path:
    """Run the documented command of the committed study ``name`` from the root of a copy of what
    is committed of it (its compact runs, not their directories); returns the copy."""
    out = Path("docs") / "_generated" / name
    shutil.copytree(ROOT / out, tmp_path / out, ignore=not_committed)
    monkeypatch.chdir(tmp_path)
    program, options = PUBLISHED[name]
    if program == "mogo_diffusion/study.py":
        study.main(["--out", str(out), *options])
    else:
        spec = importlib.util.spec_from_file_location("specialist_budget", ROOT / program)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.main(["--out", str(out), *options])
    return tmp_path / out


@pytest.mark.parametrize("name", PUBLISHED)
def test_no_train_remakes_each_published_table_byte_for_byte_from_the_compact_runs(
    name, tmp_path, monkeypatch
):
    """What is committed of a study is its tables, figures, the pretrained model's cached evaluations
    and its runs in compact form (runs.json.xz); its documented --no-train command remakes every
    published table from them, byte for byte."""
    copy = remake(name, tmp_path, monkeypatch)
    for table in ("results.md", "results.rst"):
        assert (copy / table).read_text() == (ROOT / "docs" / "_generated" / name / table).read_text(), table
    assert (copy / "results.json").is_file()


def test_the_committed_runs_have_no_record_and_only_no_train_reads_them(tmp_path, monkeypatch):
    """The committed studies' runs were made before runs had a record (run.json): --no-train reads
    them as they are; a study that would train refuses them (their config cannot be checked), and
    writes nothing."""
    copy = remake("study_120x128", tmp_path, monkeypatch)
    packed = run_dir.read_packed(copy / compare.RUNS_FILE)
    assert len(packed) == 105
    assert all(run["record"] is None and run["final"]["num_prompts"] == 1024 for run in packed.values())
    before = {path: path.read_bytes() for path in copy.rglob("*") if path.is_file()}
    with pytest.raises(SystemExit) as exit_:
        study.main(["--out", str(copy.relative_to(tmp_path))])
    assert exit_.value.code == 2
    assert {path: path.read_bytes() for path in copy.rglob("*") if path.is_file()} == before
