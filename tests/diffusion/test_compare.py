"""The comparison tool on a user's own model and rewards (a tiny SD3 saved to disk, rule-based
rewards), its arms, its compact runs, and the shapes world's default command."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

import mogo
from mogo_diffusion import compare, figures, models, run_dir
from mogo_diffusion.config import Config, load_config
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


# ---- arms: named partial configs over a base config -------------------------------------------------


def test_the_shapes_worlds_arms_differ_only_in_their_strategy(tmp_path):
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


def test_an_arm_overrides_the_base_config_and_keeps_the_rest(tmp_path):
    base = Config.from_dict({
        "rewards": [{"name": "sharpness", "weight": 1.0}, {"name": "color_match", "weight": 0.5}],
        "strategy": {"name": "marble", "harmonize_every": 3, "grad_mode": "sequential"},
        "train": {"epochs": 8, "lr": 0.01},
    })  # fmt: skip
    marble = compare.arm_config("marble", 2, tmp_path, base=base)
    assert (marble.strategy.harmonize_every, marble.strategy.grad_mode) == (3, "sequential")  # the base's
    assert (marble.train.epochs, marble.train.eval_every, marble.train.lr) == (
        8,
        8 // compare.EVALUATIONS,
        0.01,
    )
    n1 = compare.arm_config("marble_n1", 2, tmp_path, base=base).strategy
    assert (n1.harmonize_every, n1.alpha_ema, n1.grad_mode) == (1, 0.0, "sequential")  # only what it names
    front = compare.arm_config("weighted_sum@2,1", 2, tmp_path, base=base)
    assert (front.strategy.name, front.strategy.reward_scale) == ("weighted_sum", "raw")
    assert [spec.weight for spec in front.rewards] == [2.0, 1.0]
    assert [spec.weight for spec in compare.arm_config("weighted_sum", 2, tmp_path, base=base).rewards] == [
        1.0,
        0.5,
    ]
    assert compare.front_arms(2) == ["weighted_sum@1,1", "weighted_sum@2,1", "weighted_sum@1,2"]
    defined = {
        "slow": {"train": {"lr": 0.001}, "strategy": {"name": "weighted_sum", "reward_scale": "zscore"}}
    }
    slow = compare.arm_config("slow", 2, tmp_path, base=base, definitions=defined)
    assert (slow.train.lr, slow.strategy.reward_scale, slow.train.seed) == (0.001, "zscore", 2)
    specialist = compare.arm_config("single:color_match", 0, tmp_path, base=base)
    assert [spec.name for spec in specialist.rewards] == [
        "sharpness",
        "color_match",
    ]  # every reward evaluated
    with pytest.raises(ValueError, match=r"arm 'weighted_sum@1': 1 weights for the base config's 2 rewards"):
        compare.arm_config("weighted_sum@1", 0, tmp_path, base=base)
    with pytest.raises(ValueError, match=r"arm 'weighted_sum@a,b': the weights must be numbers"):
        compare.arm_config("weighted_sum@a,b", 0, tmp_path, base=base)
    with pytest.raises(
        ValueError, match=r"arm 'single:ocr': strategy.reward: 'ocr' is not a configured reward"
    ):
        compare.arm_config("single:ocr", 0, tmp_path, base=base)
    with pytest.raises(ValueError, match=r"arm 'bad': train.lr: must be > 0"):
        compare.arm_config("bad", 0, tmp_path, base=base, definitions={"bad": {"train": {"lr": -1}}})
    with pytest.raises(ValueError, match="arms 'marble' and 'again' are the same run"):
        compare.plan(
            ["marble", "again"], [0], tmp_path, base=base, definitions={"again": {"train": {"lr": 0.01}}}
        )


# ---- a comparison on a user's own model and rewards -------------------------------------------------


@pytest.fixture(scope="module")
def user_config(tmp_path_factory) -> Path:
    """A user's config: a tiny SD3 saved to disk, its own prompts and two rule-based rewards."""
    directory = tmp_path_factory.mktemp("user")
    models.tiny_sd3("smoke").save_pretrained(directory / "model")
    prompts = directory / "prompts.txt"
    prompts.write_text("a red circle on white\na blue square\na green triangle at night\na yellow sun\n")
    config = {
        "model": {"pretrained": str(directory / "model"), "dtype": "float32", "lora_rank": 4, "lora_alpha": 8,
                  "max_sequence_length": 16},
        "sampling": {"num_steps": 2, "eval_num_steps": 3, "resolution": 32, "group_size": 2,
                     "prompts_per_epoch": 2, "batch_size": 4, "solver": "euler", "prompts": str(prompts),
                     "eval_prompts": str(prompts)},
        "rewards": [{"name": "jpeg_compressibility", "weight": 1.0}, {"name": "sharpness", "weight": 1.0}],
        "strategy": {"name": "weighted_sum"},
        "train": {"epochs": 3, "batch_size": 4, "mixed_precision": "no", "lr": 3e-2, "eval_ema_decay": 0.5},
    }  # fmt: skip
    path = directory / "my_run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def quick(user_config, tmp_path_factory):
    """``compare --config <user config> --arms weighted_sum,marble --seeds 2 --quick``: its
    command line, output directory and results."""
    out = tmp_path_factory.mktemp("compare") / "out"
    argv = ["--config", str(user_config), "--arms", "weighted_sum,marble", "--seeds", "2", "--quick",
            "--out", str(out), "--jobs", "2"]  # fmt: skip
    return argv, out, compare.main(argv)


def copy_out(quick, tmp_path: Path) -> tuple[list[str], Path]:
    """The quick comparison's command line and a copy of its output directory."""
    argv, out, _ = quick
    copy = Path(shutil.copytree(out, tmp_path / "out"))
    return [*argv[: argv.index("--out") + 1], str(copy), *argv[argv.index("--out") + 2 :]], copy


def files(directory: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in directory.rglob("*") if path.is_file()}


@pytest.mark.spawns
def test_a_quick_comparison_runs_on_a_users_own_model_and_rewards(quick):
    _, out, results = quick
    assert results["rewards"] == ["jpeg_compressibility", "sharpness"]
    assert results["seeds"] == [0, 1]
    assert list(results["arms"]) == list(results["judged"]["arms"]) == ["weighted_sum", "marble"]
    for arm in ("weighted_sum", "marble"):
        for seed in (0, 1):
            run = compare.run_directory(out, arm, seed)
            config = run_dir.read_record(run)["config"]
            assert (config["train"]["epochs"], config["train"]["seed"]) == (2, seed)  # --quick: two epochs
            assert config["strategy"]["name"] == arm
            # each run is judged by its last evaluation: the table's means are the runs' own
            last = read_metrics(run)[-1]
            assert results["arms"][arm]["means"]["sharpness"][seed] == last["eval/sharpness"]
    marble = results["costs"]["marble"]
    assert 0 <= marble["conflict_rate"][0] <= 1
    assert marble["worst_cosine_marble"] >= -1e-6  # by the KKT conditions the min-norm point opposes none
    assert results["costs"]["weighted_sum"]["throughput"] == [1.0, 1.0, 1.0]
    assert results["judged"]["front"] == ["weighted_sum"]
    assert results["judged"]["normalised"] == [False, False]  # no specialists: raw gains
    table = (out / "results.md").read_text()
    assert all(f"| {arm} |" in table for arm in ("base", "weighted_sum", "marble"))
    assert "| marble |" in (out / "judged.md").read_text()
    assert json.loads((out / "results.json").read_text())["arms"].keys() == results["arms"].keys()
    for figure in ("front.png", "composite.png", "curves.png", "alpha.png"):
        assert (out / figure).is_file()
    packed = run_dir.read_packed(out / compare.RUNS_FILE)
    assert sorted(packed) == ["marble/seed0", "marble/seed1", "weighted_sum/seed0", "weighted_sum/seed1"]
    assert packed["marble/seed1"]["record"] == run_dir.read_record(compare.run_directory(out, "marble", 1))
    kept = set(packed["marble/seed1"]["metrics"][-1])
    assert {"epoch", "seconds", "images_per_second", "conflict_rate", "alpha/sharpness"} <= kept
    assert not any(key.startswith(("reward/", "diagnostic/")) for key in kept)


@pytest.mark.spawns
def test_the_front_figure_places_each_arm_at_its_gains(quick):
    _, _, results = quick
    (axis,) = figures.front(results["judged"]).axes
    for arm, row in results["judged"]["arms"].items():
        (collection,) = [c for c in axis.collections if c.get_label() == arm]
        expected = [row["gain/jpeg_compressibility"]["mean"], row["gain/sharpness"]["mean"]]
        assert collection.get_offsets().tolist() == [pytest.approx(expected)]


@pytest.mark.spawns
def test_a_finished_comparison_is_reused_and_remade_from_its_compact_runs(quick, tmp_path):
    argv, out = copy_out(quick, tmp_path)
    trained = files(out / "runs")
    compare.main(argv)
    assert files(out / "runs") == trained  # nothing rerun
    tables = {name: (out / name).read_text() for name in ("results.md", "judged.md", "results.rst")}
    for group in ("weighted_sum", "marble"):  # what a commit keeps: the compact runs and the base caches
        shutil.rmtree(out / "runs" / group)
    compare.main([*argv, "--no-train"])
    for name, text in tables.items():
        assert (out / name).read_text().replace(" --no-train", "") == text, name
    compare.main(argv)  # to train, a compact run of the same config is finished: nothing is trained
    assert not (out / "runs" / "marble").exists()
    assert (out / "results.md").read_text() == tables["results.md"]


@pytest.mark.spawns
def test_reading_packs_every_finished_run_a_seed_left_out_included(quick, tmp_path):
    argv, out = copy_out(quick, tmp_path)
    (out / compare.RUNS_FILE).unlink()
    (compare.run_directory(out, "marble", 1) / run_dir.FINISHED).unlink()  # an unfinished run
    results = compare.main([*argv, "--no-train"])
    assert results["seeds"] == [0]  # the tables leave seed 1 out
    packed = run_dir.read_packed(out / compare.RUNS_FILE)
    assert sorted(packed) == ["marble/seed0", "weighted_sum/seed0", "weighted_sum/seed1"]
    assert packed["weighted_sum/seed1"] == run_dir.compact(compare.run_directory(out, "weighted_sum", 1))


@pytest.mark.spawns
def test_a_final_evaluation_judges_each_run_and_the_pretrained_model_on_its_prompts(quick, tmp_path):
    argv, out = copy_out(quick, tmp_path)
    results = compare.main([*argv, "--seed", "1", "--final", "shapes:heldout:4"])  # trained: evaluated only
    assert results["seeds"] == [1]
    for arm in ("weighted_sum", "marble"):
        final = json.loads((compare.run_directory(out, arm, 1) / compare.FINAL_EVAL).read_text())
        assert final["num_prompts"] == 4
        assert [results["arms"][arm]["means"][name][0] for name in results["rewards"]] == [
            final["metrics"][name] for name in results["rewards"]
        ]
    base = json.loads((out / "runs" / "base" / "final_eval.json").read_text())
    assert base["evaluation"]["num_prompts"] == 4
    assert results["base"] == [base["means"][f"eval/{name}"] for name in results["rewards"]]
    assert (
        "Held-out means: each run's last weights and the pretrained model on shapes:heldout:4"
        in (out / "results.md").read_text()
    )
    packed = run_dir.read_packed(out / compare.RUNS_FILE)
    assert packed["marble/seed1"]["final"]["metrics"] == final["metrics"]
    assert packed["marble/seed0"]["final"] is None  # not asked for a final evaluation


@pytest.mark.spawns
def test_a_compact_run_of_another_config_or_without_a_record_is_refused(quick, tmp_path, capsys):
    argv, out = copy_out(quick, tmp_path)
    for group in ("weighted_sum", "marble"):
        shutil.rmtree(out / "runs" / group)
    packed = out / compare.RUNS_FILE
    runs = run_dir.read_packed(packed)
    capsys.readouterr()
    with pytest.raises(SystemExit):  # another learning rate than the packed runs'
        compare.main([*argv, "--set", "train.lr=0.5", "--no-train"])
    assert "train.lr: 0.03 there, 0.5 requested" in capsys.readouterr().err
    legacy = {name: {**run, "record": None, "marker": None} for name, run in runs.items()}
    run_dir.write_packed(packed, legacy)
    with pytest.raises(SystemExit):
        compare.main(argv)  # a tool that trains cannot check a run without its record
    assert "--no-train reads such runs" in capsys.readouterr().err
    results = compare.main([*argv, "--no-train"])  # read as it is
    assert results["seeds"] == [0, 1]
    packed.write_bytes(packed.read_bytes()[:100])
    with pytest.raises(SystemExit):
        compare.main([*argv, "--no-train"])
    assert "runs.json.xz', a packed file of runs, is damaged" in capsys.readouterr().err


def test_bad_arguments_are_named_before_anything_runs(user_config, tmp_path, capsys):
    base = ["--config", str(user_config), "--out", str(tmp_path / "out")]
    arm_file = tmp_path / "arms.yaml"
    arm_file.write_text("- not a mapping\n")
    cases = [
        (["--arms", "weighted_sum,best"], "unknown arm 'best'"),
        (["--arms", "weighted_sum,weighted_sum@1"], "1 weights for the base config's 2 rewards"),
        (["--arms", "marble"], "--reference 'weighted_sum' is not one of the arms: marble"),
        (["--arms", "weighted_sum", "--specialists", "ocr"], "--specialists ['ocr'] are not rewards"),
        (["--arms", "weighted_sum", "--arm-file", str(arm_file)], "expected a mapping of arm names"),
        (["--arms", "weighted_sum", "--curves", "marble"], "--curves: ['marble'] are not arms"),
        (["--arms", "weighted_sum", "--seeds", "0"], "--seeds must be >= 1"),
        (["--arms", "weighted_sum", "--no-train"], "no seed whose runs have all finished"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_:
            compare.main([*base, *argv])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err, argv
    assert not (tmp_path / "out" / "runs" / "weighted_sum").exists()


def test_the_front_and_the_specialists_are_arms_of_their_own(user_config, tmp_path):
    """``--front`` adds the K + 1 weighted sums that are not an arm already, ``--specialists`` one
    specialist per reward; the front is judged from the raw weighted sums."""
    base = load_config(user_config)
    arms = compare.choose_arms(base, "weighted_sum,marble", specialists="all", front=True)
    # weighted_sum@1,1 is weighted_sum: the user's weights are 1 and 1
    assert arms == ["single:jpeg_compressibility", "single:sharpness", "weighted_sum", "marble",
                    "weighted_sum@2,1", "weighted_sum@1,2"]  # fmt: skip
    configs = compare.plan([*arms, "weighted_sum_z"], [0, 1], tmp_path, base=base)
    assert compare.front_of([*arms, "weighted_sum_z"], configs) == ["weighted_sum", "weighted_sum@2,1",
                                                                    "weighted_sum@1,2"]  # fmt: skip
    assert compare.choose_arms(base, "marble", specialists="sharpness") == ["single:sharpness", "marble"]


# ---- runs of another config, damaged files, final evaluations (issue 39) ---------------------------


@pytest.mark.spawns
def test_a_comparison_of_another_config_refuses_the_runs_it_finds(quick, tmp_path, capsys):
    """Issue 39 item 1: `--quick`, then `--epochs 2 --seeds 1` into the same --out returned the quick
    runs' table in seconds, labelled with the second command: a run counted as finished when its
    last logged epoch was the one asked for. Each run is refused, naming the fields that differ,
    and nothing is trained or written."""
    argv, out = copy_out(quick, tmp_path)
    before = files(out)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        compare.main([a for a in argv if a != "--quick"] + ["--epochs", "3", "--seeds", "1"])
    assert exit_.value.code == 2
    said = capsys.readouterr()
    assert (
        f"refuse {compare.run_directory(out, 'weighted_sum', 0)}: holds the run of another config ("
        in said.out
    )
    assert "train.epochs: 2 there, 3 requested" in said.err
    assert files(out) == before


@pytest.mark.spawns
def test_a_run_of_other_epochs_is_refused_not_deleted(quick, tmp_path, user_config):
    """Issue 39 item 2: a finished run whose last epoch was not the one asked for (`--epochs 60`
    after `--epochs 120`) was deleted, checkpoints and all, and trained again. It is refused."""
    _, out = copy_out(quick, tmp_path)
    run = compare.run_directory(out, "weighted_sum", 0)
    config = compare.arm_config("weighted_sum", 0, run, base=load_config(user_config), quick=True).to_dict()
    config["train"]["epochs"] = 3
    before = files(run)
    with pytest.raises(RuntimeError, match=r"train\.epochs: 2 there, 3 requested"):
        compare.run_all(
            {("weighted_sum", 0): Config.from_dict(config)}, out / "runs" / "base" / "eval.json", jobs=1
        )
    assert files(run) == before


@pytest.mark.spawns
def test_damaged_json_does_not_stop_a_comparison(quick, tmp_path, user_config):
    """Issue 39 item 6: a metrics line cut off by a kill, or a damaged base/eval.json, stopped the
    comparison with a bare JSONDecodeError on every restart. The unfinished run starts over (it has
    no checkpoint yet) and the damaged cache is made again, with a warning."""
    _, out = copy_out(quick, tmp_path)
    run = compare.run_directory(out, "weighted_sum", 0)
    config = compare.arm_config("weighted_sum", 0, run, base=load_config(user_config), quick=True)
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


@pytest.mark.spawns
def test_final_and_base_evaluations_are_reused_for_their_own_prompts_only(quick, tmp_path, user_config):
    """Issue 39 items 1 and 6: any final_eval.json counted as done, and the base cache was returned
    whatever the prompts. Each is reused for its own prompts and weights only: another request is
    refused, the file kept; a damaged one is made again."""
    _, out = copy_out(quick, tmp_path)
    run = compare.run_directory(out, "weighted_sum", 0)
    config = compare.arm_config("weighted_sum", 0, run, base=load_config(user_config), quick=True)
    configs, base = {("weighted_sum", 0): config}, out / "runs" / "base" / "eval.json"
    four, five = "shapes:heldout:4", "shapes:heldout:5"
    compare.run_all(configs, base, jobs=1, final=four)
    assert compare.done(config, four)
    assert not compare.done(config, five)
    from mogo_diffusion.checkpoint import checkpoint_digest  # (after the checks the old code fails)

    final = json.loads((run / compare.FINAL_EVAL).read_text())
    assert final["num_prompts"] == 4
    assert final["checkpoint_sha256"] == checkpoint_digest(run / "checkpoints" / "step-000002")
    kept = (run / compare.FINAL_EVAL).read_bytes()
    with pytest.raises(RuntimeError, match=r"final evaluation of .* is another one \(prompts_sha256: "):
        compare.run_all(configs, base, jobs=1, final=five)
    assert (run / compare.FINAL_EVAL).read_bytes() == kept
    (run / compare.FINAL_EVAL).write_bytes(kept[:100])
    with pytest.warns(UserWarning, match=r"final_eval\.json' is damaged"):
        assert compare.decide(config, four) == ("evaluate", "finished; its final evaluation is damaged")
    cached = base.read_bytes()
    with pytest.raises(
        RuntimeError, match=r"eval\.json' evaluates another request \(.*num_prompts: 4 there, 8 requ"
    ):
        compare.evaluate_base(config, base, prompts="shapes:heldout:8")
    assert base.read_bytes() == cached


def test_costs_keep_the_conflicts_across_halves_of_a_cross_fitted_arm_and_the_table_shows_them():
    def runs(seconds, **last):
        return {
            s: [{"seconds": seconds}, {"seconds": seconds, **{k: v[s] for k, v in last.items()}}]
            for s in (0, 1)
        }

    same = {
        "conflict_rate": [0.1, 0.2],
        "worst_cosine_weighted_sum": [-0.1, 0.0],
        "worst_cosine_marble": [0.0, 0.0],
    }
    cross = {
        "conflict_rate_cross": [0.7, 0.9],
        "worst_cosine_weighted_sum_cross": [-0.3, -0.2],
        "worst_cosine_marble_cross": [-0.1, 0.05],
    }
    histories = {
        "weighted_sum": runs(1.0),
        "marble": runs(1.0, **same),
        "marble_cross": runs(2.0, **same, **cross),
    }
    rows = compare.costs(histories, "weighted_sum")
    assert rows["marble_cross"]["conflict_rate_cross"][0] == pytest.approx(0.8)
    assert rows["marble_cross"]["worst_cosine_weighted_sum_cross"] == -0.3  # the lowest over seeds
    assert rows["marble_cross"]["throughput"][0] == pytest.approx(0.5)
    assert not any(key.endswith("_cross") for key in rows["marble"])
    _, table = compare._costs_table(rows, "weighted_sum")
    header, marble_cross = table[0], table[-1]
    assert len(header) == len(marble_cross) == 9
    assert marble_cross[6:] == ["0.80 [0.70, 0.90]", "-0.300", "-0.100"]
    _, without = compare._costs_table({arm: rows[arm] for arm in ("weighted_sum", "marble")}, "weighted_sum")
    assert len(without[0]) == 6  # no cross-fitted arm: the table of the committed studies, unchanged


def test_runs_start_seed_by_seed_so_that_a_stopped_comparison_has_whole_seeds(
    user_config, tmp_path, monkeypatch
):
    configs = compare.plan(
        ["weighted_sum", "marble"], [0, 1], tmp_path, base=load_config(user_config), quick=True
    )
    started = []  # what run_all starts, in order (jobs=1), instead of training it
    monkeypatch.setattr(
        compare, "_train", lambda config, action: started.append((config.strategy.name, config.train.seed))
    )
    compare.run_all(configs, tmp_path / "runs" / "base" / "eval.json", jobs=1)
    assert started == [("weighted_sum", 0), ("marble", 0), ("weighted_sum", 1), ("marble", 1)]
