"""The examples and benchmarks run, in reduced form, and say what they claim."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_conflicting_gradients_example_shows_weighted_sum_conflicts_and_min_norm_none(tmp_path):
    example = load(ROOT / "examples" / "conflicting_gradients.py")
    rates = example.main(["--trials", "20", "--out", str(tmp_path)])
    assert (tmp_path / "conflicting_gradients.png").stat().st_size > 10_000
    assert all(rate == 0 for key, rate in rates.items() if key.endswith("min_norm"))
    assert rates["conflicting/K=5/mean"] > 0.5  # the mean gradient opposes someone most of the time


@pytest.mark.spawns
@pytest.mark.parametrize(
    ("script", "option"),
    [
        ("conflicting_gradients.py", "--trials"),
        ("pareto_toy.py", "--steps"),
        ("multitask_digits.py", "--epochs"),
    ],
)
def test_examples_have_a_working_help(script, option):
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert option in result.stdout


def test_pareto_toy_weighted_sum_sacrifices_the_quiet_objective_and_min_norm_reaches_the_front(tmp_path):
    results = load(ROOT / "examples" / "pareto_toy.py").main(["--steps", "200", "--out", str(tmp_path)])
    assert (tmp_path / "pareto_toy.png").stat().st_size > 10_000
    assert min(results["weighted sum"]) > 3.5  # every start ends next to b
    assert max(results["MinNorm distance to front"]) < 0.05
    assert sum(results["MinNorm"]) < 0.5 * sum(results["weighted sum"])


def test_multitask_digits_trains_every_arm_and_reports_its_scores(tmp_path):
    """A contract, not a result: which arm wins after 4 epochs of one seed is noise (the docs
    report the example's numbers), so the test asserts what every run must give."""
    summary = load(ROOT / "examples" / "multitask_digits.py").main(
        ["--epochs", "4", "--seeds", "1", "--out", str(tmp_path)]
    )
    assert (tmp_path / "multitask_digits.png").stat().st_size > 10_000
    assert list(summary) == ["weighted sum", "MARBLE", "MARBLE N=10"]
    for scores in summary.values():
        assert set(scores) == {"digit accuracy", "even accuracy", "ink RMSE", "conflict rate"}
        assert 0 <= scores["digit accuracy"] <= 1
        assert 0 <= scores["even accuracy"] <= 1
        assert 0 <= scores["ink RMSE"] < float("inf")
        assert 0 <= scores["conflict rate"] <= 1


@pytest.mark.spawns
@pytest.mark.slow
def test_solver_benchmark_quick_run_writes_its_tables(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "solvers.py"), "--quick", "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    summary = (tmp_path / "solvers_summary.rst").read_text()
    assert "mogo exact" in summary
    assert "0/24" in summary.split("mogo exact")[1].split("* -")[0]  # no failure for mogo exact


@pytest.mark.spawns
@pytest.mark.slow
def test_train_step_benchmark_quick_run_prints_its_table():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "train_step.py"), "--quick"],
        check=True,
        capture_output=True,
        text=True,
    )
    rows = [line for line in result.stdout.splitlines() if line.startswith("| marble")]
    assert len(rows) == 3
    assert all(float(row.split("|")[3]) > 0 for row in rows)


def test_step_benchmark_breakdown_times_every_mogo_range():
    step = load(ROOT / "benchmarks" / "step.py")
    model = torch.nn.Sequential(torch.nn.Linear(512, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    x, y = step.inputs((256, 512), 2, 64)
    assert x.shape == (64, 512)
    assert y.shape == (64, 2)
    table = step.breakdown(step.strategies(model, x, y, 2), count=2)
    for label in ("mogo full, batched", "mogo full, sequential"):
        assert set(table[label]) == set(step.RANGES)
        assert all(milliseconds > 0 for milliseconds in table[label].values())


def test_gradient_agreement_measures_cosines_between_independent_batch_gradients(tmp_path):
    benchmark = load(ROOT / "benchmarks" / "gradient_agreement.py")
    same = benchmark.agreement(torch.tensor([[1.0, 2.0], [2.0, 4.0], [3.0, 6.0]]).numpy())
    assert same["mean_cosine"] == pytest.approx(1.0)
    assert same["std_cosine"] == pytest.approx(0.0, abs=1e-12)
    crossed = benchmark.agreement(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]).numpy())
    assert (crossed["min_cosine"], crossed["max_cosine"]) == pytest.approx((-1.0, 0.0))
    out = tmp_path / "agreement.json"
    options = {"--reward": "jpeg_compressibility", "--prompts": "1", "--group": "2", "--batches": "2"}
    result = benchmark.main(
        [*(x for pair in options.items() for x in pair), "--timesteps", "1", "--out", str(out)]
    )
    assert out.is_file()
    assert result["images_per_batch"] == 2
    assert all(norm > 0 for norm in result["gradient_norms"])  # the zero adapter's NFT gradient is not 0
    assert -1 <= result["mean_cosine"] <= 1
    assert 1 <= result["distinct_per_group"] <= 2
    assert 0 <= result["tied_groups"] <= 1
    nan = float("nan")
    scores = torch.tensor([1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 3.0, 3.0, nan, nan, nan, 4.0]).numpy()
    assert benchmark.ties(scores, 4) == {
        "distinct_per_group": 1.5,
        "tied_groups": 0.5,
    }  # the last group: one score


def test_specialist_budget_changes_only_its_variants_fields_and_judges_by_the_studys_bar(tmp_path):
    benchmark = load(ROOT / "benchmarks" / "specialist_budget.py")
    from mogo_diffusion import compare

    runs = benchmark.plan(tmp_path, range(2))
    assert len(runs) == 2 * sum(len(spec["rewards"]) for spec in benchmark.VARIANTS.values())
    for (variant, reward, seed), config in runs.items():
        spec = benchmark.VARIANTS[variant]
        study = compare.arm_config(
            f"single:{reward}", seed, Path(config.train.out_dir), epochs=spec["epochs"]
        ).to_dict()
        for section, values in benchmark.STUDY_60.items():  # the 60-epoch study the variants left
            study[section].update(values)
        data = config.to_dict()
        changed = {
            (section, key)
            for section in data
            if isinstance(data[section], dict)
            for key in data[section]
            if data[section][key] != study[section].get(key)
        }
        expected = {(s, k) for s in benchmark.SECTIONS for k in spec.get(s, {})}
        assert changed == expected | ({("sampling", "prompts")} if "tag" in spec else set())
    for (variant, reward, seed), config in runs.items():  # the variant the recipe took: the study's runs
        if variant == "batch_128_epochs_120_kl_0.03":
            study = compare.arm_config(f"single:{reward}", seed, Path(config.train.out_dir))
            assert config.to_dict() == study.to_dict()
    prompts = Path(runs["count_prompts_only", "shapes_count", 0].sampling.prompts).read_text().splitlines()
    assert len(prompts) == 8
    assert {json.loads(line)["tag"] for line in prompts} == {"counting"}

    step = {"shapes_shape": 0.1, "shapes_count": 0.02}  # seeds 0 and 1: shape 0.40/0.50, count 0.30/0.32
    results = {
        (variant, reward, seed): compare.RunResults(
            [], {f"eval/{reward}": {"shapes_shape": 0.40, "shapes_count": 0.30}[reward] + seed * step[reward]}
        )
        for variant, reward, seed in runs
    }
    rows = benchmark.table(runs, results, {"eval/shapes_shape": 0.38, "eval/shapes_count": 0.14})
    shape = next(r for r in rows if r["variant"] == "epochs_120" and r["reward"] == "shapes_shape")
    assert shape["images"] == 120 * 64
    assert shape["gain"] == pytest.approx(0.45 - 0.38)
    assert shape["bar"] == pytest.approx(3 * 0.1 / 2**0.5)  # sample std of two seeds 0.1 apart
    assert not shape["clears"]
    count = next(r for r in rows if r["variant"] == "count_prompts_only")
    assert count["bar"] == pytest.approx(0.06)  # the floor: 3 x 0.02
    assert count["clears"]
    assert count["ratio"] == pytest.approx(0.17 / (0.02 / 2**0.5))
    markdown = benchmark.write_table(rows, tmp_path)
    assert (tmp_path / "results.md").read_text() == markdown
    assert "| batch_128 | shapes_count | 7680 |" in markdown
    assert "   * - batch_128\n     - shapes_count\n     - 7680\n" in (tmp_path / "results.rst").read_text()
