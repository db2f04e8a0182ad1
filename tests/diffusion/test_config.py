"""Run configuration: YAML, dotted overrides, round trips, and one test per error path."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mogo_diffusion.config import (
    Config,
    ConfigError,
    HarmonizedConfig,
    MarbleConfig,
    RewardSpec,
    SingleConfig,
    StageConfig,
    WeightedSumConfig,
    add_config_arguments,
    config_from_args,
    load_config,
)

REWARDS = [
    "rewards.0.name=jpeg_compressibility",
    "rewards.1.name=sharpness",
]

YAML = """\
model:
  pretrained: org/tiny-sd3
  lora_rank: 4
sampling:
  resolution: 32
  group_size: 4
nft:
  beta: 1
  kl_coef: 1e-4
rewards:
  - name: jpeg_compressibility
    weight: 1
    options: {quality: 90}
  - name: color_match
    weight: 0.5
strategy:
  name: weighted_sum
train:
  lr: 3.0e-5
  grad_clip: null
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def error(overrides, path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, [*REWARDS, *overrides])
    return str(info.value)


def test_defaults_follow_the_published_recipe():
    config = load_config(None, REWARDS)
    assert config.model.pretrained == "stabilityai/stable-diffusion-3.5-medium"
    assert (config.model.lora_rank, config.model.lora_alpha) == (32, 64.0)
    assert (config.train.lr, config.train.weight_decay, config.train.grad_clip) == (3e-4, 1e-4, 1.0)
    assert (config.sampling.group_size, config.sampling.prompts_per_epoch) == (24, 48)
    assert (config.sampling.resolution, config.sampling.num_steps) == (512, 25)
    assert (config.nft.beta, config.nft.adv_clip, config.nft.kl_coef) == (0.1, 5.0, 1e-4)
    assert config.strategy.name == "marble"
    assert [r.name for r in config.rewards] == ["jpeg_compressibility", "sharpness"]


def test_yaml_file_and_overrides(tmp_path):
    config = load_config(
        write(tmp_path, YAML),
        [
            "train.lr=1e-4",
            "rewards.1.weight=2",
            "rewards.2.name=sharpness",
            "rewards.2.weight=0",
            "model.lora_targets=[to_q, to_k]",
            "model.revision=main",
            "train.out_dir=/tmp/run one",
        ],
    )
    assert config.model.pretrained == "org/tiny-sd3"
    assert config.model.lora_rank == 4
    assert config.model.lora_alpha == 64.0  # default kept
    assert config.nft.beta == 1.0
    assert isinstance(config.nft.beta, float)
    assert config.nft.kl_coef == 1e-4
    assert isinstance(config.nft.kl_coef, float)
    assert config.train.lr == 1e-4
    assert isinstance(config.train.lr, float)
    assert config.train.grad_clip is None
    assert config.train.out_dir == "/tmp/run one"
    assert config.model.lora_targets == ["to_q", "to_k"]
    assert config.model.revision == "main"
    assert config.rewards == [
        RewardSpec("jpeg_compressibility", 1.0, {"quality": 90}),
        RewardSpec("color_match", 2.0),
        RewardSpec("sharpness", 0.0),
    ]


def test_round_trip(tmp_path):
    config = load_config(
        write(tmp_path, YAML),
        ["strategy.name=sequential", "strategy.stages=[{reward: color_match, epochs: 3}]", "train.lr=1e-7"],
    )
    assert config.strategy.stages == [StageConfig("color_match", 3)]
    assert Config.from_dict(config.to_dict()) == config
    config.save(tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml") == config


def test_command_line():
    parser = add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--set", REWARDS[0], "--set", "train.epochs=3", "--set", "train.seed=7"])
    config = config_from_args(args)
    assert (config.train.epochs, config.train.seed) == (3, 7)


def test_programmatic_config_is_validated():
    config = Config(rewards=[RewardSpec("sharpness")])
    config.validate()
    config.nft.beta = 2.0
    with pytest.raises(ConfigError, match=re.escape("nft.beta: must be in (0, 1], got 2.0")):
        config.validate()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.lrr=1"], "train.lrr: unknown key (did you mean 'lr'?)"),
        (["modle.lora_rank=1"], "modle: unknown key (did you mean 'model'?)"),
        (["rewards.0.wieght=1"], "rewards.0.wieght: unknown key (did you mean 'weight'?)"),
        (["train.epochs=ten"], "train.epochs: expected int, got str 'ten'"),
        (["train.epochs=1.5"], "train.epochs: expected int, got float 1.5"),
        (["train.epochs=true"], "train.epochs: expected int, got bool True"),
        (["train.lr=fast"], "train.lr: expected float, got str 'fast'"),
        (["train.lr=.nan"], "train.lr: must be finite, got nan"),
        (["model.revision=3"], "model.revision: expected str, got int 3"),
        (["model.lora_targets=to_q"], "model.lora_targets: expected a list, got str 'to_q'"),
        (["model.lora_targets=[to_q, 1]"], "model.lora_targets.1: expected str, got int 1"),
        (["rewards.0.options=[1]"], "rewards.0.options: expected a mapping with string keys"),
        (["sampling=3"], "sampling: expected a mapping, got int 3"),
        (["nft.beta=0"], "nft.beta: must be in (0, 1], got 0.0"),
        (["nft.beta=1.5"], "nft.beta: must be in (0, 1], got 1.5"),
        (["nft.kl_coef=-1e-4"], "nft.kl_coef: must be >= 0, got -0.0001"),
        (["train.lr=-1"], "train.lr: must be > 0, got -1.0"),
        (["strategy.alpha_ema=1"], "strategy.alpha_ema: must be in [0, 1), got 1.0"),
        (["sampling.resolution=500"], "sampling.resolution: must be a positive multiple of 16, got 500"),
        (["sampling.group_size=1"], "sampling.group_size: must be >= 2, got 1"),
        (["model.lora_targets=[]"], "model.lora_targets: must be non-empty, got []"),
        (["rewards.0.weight=-1"], "rewards.0.weight: must be >= 0, got -1.0"),
        (
            ["rewards.1.name=jpeg_compressibility"],
            "rewards.1.name: 'jpeg_compressibility' is already rewards.0",
        ),
        (["rewards.2.name="], "rewards.2.name: expected str, got NoneType None"),
        (["rewards.2.weight=1"], "rewards.2.name: required"),
        (
            ["strategy.name=weighted_sum", "rewards.0.weight=1"],
            "rewards.1.weight: the weighted_sum strategy needs",
        ),
        (
            ["strategy.name=weighted_sum", "rewards.0.weight=0", "rewards.1.weight=0"],
            "rewards: the weighted_sum strategy needs a positive weight",
        ),
        (
            ["rewards.1.weight=1"],
            "rewards.0.weight: give a weight for every reward or for none (rewards.1 has one)",
        ),
        (["strategy.name=sequential"], "strategy.stages: must be non-empty, got []"),
        (
            ["strategy.name=sequential", "strategy.stages.0.reward=ocr", "strategy.stages.0.epochs=2"],
            "strategy.stages.0.reward: 'ocr' is not a configured reward",
        ),
        (
            ["strategy.name=sequential", "strategy.stages.0.reward=sharpnes", "strategy.stages.0.epochs=2"],
            "(did you mean 'sharpness'?)",
        ),
        (
            ["strategy.name=sequential", "strategy.stages.0.reward=sharpness"],
            "strategy.stages.0.epochs: required",
        ),
        (
            ["strategy.name=sequential", "strategy.stages.0.reward=sharpness", "strategy.stages.0.epochs=0"],
            "strategy.stages.0.epochs: must be > 0, got 0",
        ),
        (
            ["strategy.stages=[{reward: sharpness, epochs: 1}]"],
            "strategy.stages: unknown key; strategy 'marble' has name, harmonize_every",
        ),
        (
            ["strategy.harmonize_evry=2"],
            "strategy.harmonize_evry: unknown key (did you mean 'harmonize_every",
        ),
        (
            ["strategy.name=single", "strategy.alpha_ema=0.5"],
            "strategy.alpha_ema: unknown key; strategy 'sing",
        ),
        (["strategy.name="], "strategy.name: expected a strategy name, got None"),
        (["strategy.name=single"], "strategy.reward: the single strategy needs the name of its reward"),
        (
            ["strategy.name=single", "strategy.reward=ocr"],
            "strategy.reward: 'ocr' is not a configured reward",
        ),
        (["strategy.reward=sharpness"], "strategy.reward: unknown key; strategy 'marble' has"),
        (["train.seed=-1"], "train.seed: must be >= 0, got -1"),
        (["train.seed=99999999999999999999"], "train.seed: must fit a 64-bit integer"),
        (["train.epochs=-99999999999999999999"], "train.epochs: must fit a 64-bit integer"),
        (
            ["train.mixed_precision=fp16"],
            "strategy.nonfinite: train.mixed_precision 'fp16' needs 'skip'",
        ),
        (["model.pretrained=sd3-medium"], "'sd3-medium' is neither an existing directory nor a hub id"),
        (
            ["model.pretrained=./models/tiny"],
            "model.pretrained: local directory './models/tiny' does not exist",
        ),
        (
            ["model.pretrained=/no/such/dir"],
            "model.pretrained: local directory '/no/such/dir' does not exist",
        ),
        (["model.pretrained=~/no-such-dir"], "local directory '~/no-such-dir' does not exist"),
        (["model.pretrained=runs/a/model"], "local directory 'runs/a/model' does not exist"),
        (["model.pretrained=not a hub id"], "'not a hub id' is neither an existing directory nor a hub id"),
        (["train.lr"], "override 'train.lr': expected KEY=VALUE"),
        (["=1"], "override '=1': expected KEY=VALUE"),
        (["train..lr=1"], "override 'train..lr=1': expected KEY=VALUE"),
        (["rewards.5.name=x"], "rewards.5: no entry '5' in a list of 2"),
        (["train.lr.x=1"], "train.lr: expected float, got dict"),
        (["train.lr=[1"], "override 'train.lr=[1': not valid YAML"),
    ],
)
def test_errors_name_the_field(overrides, message):
    assert message in error(overrides)


def test_no_rewards():
    with pytest.raises(ConfigError, match="rewards: at least one reward is needed"):
        load_config()


def test_local_model_directory(tmp_path):
    config = load_config(None, [*REWARDS, f"model.pretrained={tmp_path}"])
    assert config.model.pretrained == str(tmp_path)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*missing.yaml' does not exist"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "model: [\n"))
    with pytest.raises(ConfigError, match="expected a mapping at the top level, got list"):
        load_config(write(tmp_path, "- 1\n"))
    with pytest.raises(ConfigError, match="could not determine a constructor"):
        load_config(write(tmp_path, "train: !!python/object/apply:os.system [echo]\n"))


def test_a_binary_file_a_directory_and_a_missing_file_are_named(tmp_path):
    """D16: a binary file gave a raw UnicodeDecodeError, a directory "does not exist"."""
    binary = tmp_path / "model.safetensors"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x00")
    with pytest.raises(ConfigError, match=r"model\.safetensors' is not UTF-8 text \(byte 0"):
        load_config(binary)
    with pytest.raises(ConfigError, match="is a directory, not a YAML file"):
        load_config(tmp_path)


def test_yaml_aliases_are_refused_before_they_expand(tmp_path):
    """D17: nine levels of aliases in reward options (429 bytes) expanded to 128 MB when saved."""
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, 9)]
    text = "rewards:\n  - name: sharpness\n    options:\n" + "".join(f"      {line}\n" for line in levels)
    with pytest.raises(ConfigError, match=r"run\.yaml: line 5: YAML aliases \(\*a0\) are not allowed"):
        load_config(write(tmp_path, text))
    with pytest.raises(ConfigError, match="aliases"):
        load_config(None, [*REWARDS, "rewards.0.options={a: &x 1, b: *x}"])
    anchored = load_config(write(tmp_path, "rewards:\n  - &first {name: sharpness}\n"))  # an anchor alone
    assert anchored.rewards == [RewardSpec("sharpness")]


def test_strategies_are_a_union_tagged_by_name(tmp_path):
    path = write(tmp_path, "rewards: [{name: sharpness}]\nstrategy: {name: marble, harmonize_every: 3}\n")
    assert load_config(path).strategy == MarbleConfig(harmonize_every=3)
    single = load_config(path, ["strategy.name=single", "strategy.reward=sharpness"])
    assert single.strategy == SingleConfig(reward="sharpness")  # marble's fields are gone
    weights = ["rewards.0.weight=1", "rewards.1.weight=2"]
    ws = load_config(None, [*REWARDS, "strategy.name=weighted_sum", *weights])
    assert ws.strategy == WeightedSumConfig()
    other = load_config(None, [*REWARDS, "strategy.name=my_weighting", "strategy.options={c: 0.5}"])
    assert other.strategy == HarmonizedConfig(name="my_weighting", options={"c": 0.5})
    merged = load_config(path, ["strategy.alpha_ema=0.5"]).strategy
    assert merged == MarbleConfig(harmonize_every=3, alpha_ema=0.5)
    assert Config.from_dict(other.to_dict()) == other


def test_parsing_a_config_imports_neither_torch_nor_the_rewards():
    code = (
        "import sys; from mogo_diffusion.config import load_config; "
        "load_config(None, ['rewards.0.name=sharpness']); "
        "print(sorted(m for m in ('torch', 'scipy', 'mogo_diffusion.rewards') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_documented_strategies_are_valid():
    text = (Path(__file__).resolve().parents[2] / "docs" / "diffusion.rst").read_text()
    lines = re.findall(r"^    (strategy: .*?)(?:\s+#.*)?$", text, flags=re.M)
    assert len(lines) == 5
    rewards = [{"name": "ocr", "weight": 1.0}, {"name": "pickscore", "weight": 1.0}]
    for line in lines:
        config = Config.from_dict({"rewards": rewards, **yaml.safe_load(line)})
        assert config.strategy.name == yaml.safe_load(line)["strategy"]["name"]
