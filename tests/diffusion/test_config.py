"""Run configuration: YAML, dotted overrides, round trips, and one test per error path."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
import torch
import yaml
from hypothesis import given
from hypothesis import strategies as st

import mogo_diffusion
from mogo_diffusion import config as config_module
from mogo_diffusion.config import (
    MAX_DEPTH,
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
    typed,
)
from mogo_diffusion.strategies import make_strategy

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
        # issue 39, item 14: configs the trainer refused only after an epoch of work
        (
            ["strategy.name=min_norm", "strategy.options={scale: .inf}"],
            "strategy.options.scale: must be finite, got inf",
        ),
        (["rewards.0.options={x: [1, .nan]}"], "rewards.0.options.x.1: must be finite, got nan"),
        (
            ["rewards.0.weight=1e308", "rewards.1.weight=1"],
            "rewards.0.weight: the weights sum to 1e+308, beyond float32's largest number 3.403e+38",
        ),
        (
            ["rewards.0.weight=3e38", "rewards.1.weight=3e38"],
            "rewards.0.weight: the weights sum to 6e+38",
        ),
        (
            ["rewards.0.weight=0", "rewards.1.weight=0"],
            "rewards: every weight is 0; the marble strategy weighs",
        ),
        (
            ["strategy.name=upgrad", "rewards.0.weight=0", "rewards.1.weight=0"],
            "rewards: every weight is 0; the upgrad strategy",
        ),
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


@pytest.mark.parametrize("word", ["no", "yes", "on", "off", "No", "OFF"])
def test_yaml_1_1_booleans_stay_strings_as_yaml_1_2_reads_them(tmp_path, word):
    """``train.mixed_precision=no`` was the boolean False under YAML 1.1 and refused; a file and an
    override read it alike, and only true/false are booleans."""
    path = tmp_path / "run.yaml"
    path.write_text(f"model:\n  revision: {word}\nrewards:\n  - name: sharpness\n")
    config = load_config(path, ["train.mixed_precision=no", "train.compile=yes"])
    assert (config.model.revision, config.train.mixed_precision, config.train.compile) == (word, "no", "yes")
    with pytest.raises(ConfigError, match=r"train.compile: must be one of .* got True"):
        load_config(path, ["train.compile=true"])


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


@pytest.mark.spawns
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


# ---- issue 39, item 13: duplicate keys and deep nesting ----------------------------------------


def test_a_key_given_twice_is_an_error_naming_the_key_and_both_lines(tmp_path):
    """``lr: 1.0e-3`` then ``lr: 5.0`` trained at 5.0: YAML keeps the last value silently."""
    text = "rewards: [{name: sharpness}]\ntrain:\n  lr: 1.0e-3\n  epochs: 2\n  lr: 5.0\n"
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert str(info.value) == (
        f"{tmp_path / 'run.yaml'}: line 5: key 'lr' is given twice in one mapping (first on line 3); "
        "YAML would keep the last silently"
    )
    override = "rewards.0.options={quality: 90, quality: 50}"
    assert error([override]).startswith(f"override {override!r}: line 1: key 'quality' is given twice")
    # the same key in two mappings is no repetition, and neither is a merge key's override
    text = "rewards: [{name: sharpness, options: {a: 1}}, {name: color_match, options: {a: 2, <<: {a: 3}}}]"
    assert [spec.options for spec in load_config(write(tmp_path, text)).rewards] == [{"a": 1}, {"a": 2}]


def nested(depth: int) -> object:
    """A value ``depth`` lists deep: ``[[...[1]...]]``."""
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def test_values_nest_up_to_max_depth_keys_in_files_and_in_data_and_no_deeper(tmp_path):
    """A deeply nested value gave an uncaught RecursionError (PyYAML's composer, then saving)."""
    rewards = lambda value: {"rewards": [{"name": "sharpness", "options": {"a": value}}]}  # noqa: E731
    deepest = MAX_DEPTH - 4  # lists below the four keys rewards.0.options.a
    config = Config.from_dict(rewards(nested(deepest)))
    config.save(tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml") == config
    where = "rewards.0.options.a" + ".0" * (deepest + 1)
    with pytest.raises(ConfigError, match=rf"^{re.escape(where)}: nested deeper than {MAX_DEPTH} levels$"):
        Config.from_dict(rewards(nested(deepest + 1)))
    (tmp_path / "deep.yaml").write_text(yaml.safe_dump(rewards(nested(deepest + 1))))
    with pytest.raises(ConfigError, match=rf"deep\.yaml: line \d+: nested deeper than {MAX_DEPTH} levels"):
        load_config(tmp_path / "deep.yaml")
    text = "rewards: [{name: sharpness, options: {a: " + "[" * 5000 + "]" * 5000 + "}}]\n"
    with pytest.raises(ConfigError, match=f"nested deeper than {MAX_DEPTH} levels"):
        load_config(write(tmp_path, text))


# ---- every field is read by the code it names --------------------------------------------------


def test_sampling_steps_per_epoch_was_removed_and_names_its_replacement(tmp_path):
    """It was validated and documented but never read: ``train.steps_per_epoch`` is the field."""
    message = (
        "sampling.steps_per_epoch: this field was removed: nothing read it; train.steps_per_epoch is the "
        "field (optimizer steps per epoch)"
    )
    assert error(["sampling.steps_per_epoch=2"]) == message
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "rewards: [{name: sharpness}]\nsampling: {steps_per_epoch: 2}\n"))
    assert str(info.value) == message
    # null, which every run directory saved before the removal holds, is no setting: it loads
    saved = load_config(write(tmp_path, "rewards: [{name: sharpness}]\nsampling: {steps_per_epoch: null}\n"))
    assert "steps_per_epoch" not in saved.to_dict()["sampling"]


SCHEMA = [
    cls
    for cls in vars(config_module).values()
    if isinstance(cls, type)
    and dataclasses.is_dataclass(cls)
    and cls.__module__ == config_module.schema.__name__
]
PACKAGE = Path(mogo_diffusion.__file__).parent
CONFIG = PACKAGE / "config"


@pytest.fixture
def reads(monkeypatch):
    """The ``(record, field)`` reads of config objects by the code of ``mogo_diffusion``, outside
    the ``config`` package itself (its validation and ``to_dict`` read every field) and outside
    dataclasses' own methods."""
    found: set[tuple[str, str]] = set()
    fields = {cls: {f.name for f in dataclasses.fields(cls)} for cls in SCHEMA}

    def recording(self, name):
        caller = Path(inspect.currentframe().f_back.f_code.co_filename)
        if name in fields[type(self)] and PACKAGE in caller.parents and CONFIG not in caller.parents:
            found.add((type(self).__name__, name))
        return object.__getattribute__(self, name)

    for cls in SCHEMA:
        monkeypatch.setattr(cls, "__getattribute__", recording)
    return found


STRATEGY_RUNS = {
    "marble": {"name": "marble", "harmonize_every": 2},
    "min_norm": {"name": "min_norm", "options": {"normalize": "l2"}},
    "weighted_sum": {"name": "weighted_sum", "reward_scale": "zscore"},
    "sequential": {"name": "sequential", "stages": [{"reward": "sharpness", "epochs": 1}]},
    "single": {"name": "single", "reward": "color_match"},
    "normalize_then_sum": {"name": "normalize_then_sum", "rescale_masked": True},
    "marble_released": {"name": "marble_released", "harmonize_every": 2},
    "famo": {"name": "famo", "window": 2},
}

# The fields that a run does not read, and where each is read instead (checked below):
READ_ELSEWHERE = {
    # a strategy record's tag: the parser picks the record by it (from the raw data), --check
    # prints it; the run goes by the record's type
    ("MarbleConfig", "name"),
    ("WeightedSumConfig", "name"),
    ("SequentialConfig", "name"),
    ("SingleConfig", "name"),
    ("NormalizeThenSumConfig", "name"),
}


def tiny_run(tiny_dir: Path, out: Path, strategy: dict) -> Config:
    return Config.from_dict(
        {
            "model": {"pretrained": str(tiny_dir), "dtype": "float32", "lora_rank": 2, "lora_alpha": 4,
                      "max_sequence_length": 16},
            "sampling": {"num_steps": 2, "eval_num_steps": 1, "resolution": 32, "group_size": 2,
                         "prompts_per_epoch": 2, "batch_size": 4, "solver": "euler",
                         "prompts": [{"source": "shapes:train:8", "weight": 1.0, "reward": "geneval"}],
                         "eval_prompts": "shapes:heldout:2"},
            "rewards": [{"name": "sharpness", "weight": 1.0, "options": {}},
                        {"name": "color_match", "weight": 1.0}],
            "strategy": strategy,
            "train": {"epochs": 1, "batch_size": 2, "steps_per_epoch": 2, "mixed_precision": "no",
                      "out_dir": str(out), "log_with": []},
        }
    )  # fmt: skip


def test_every_config_field_is_read_by_a_run_or_where_the_list_says(tiny_dir, tmp_path, reads):
    """Walks the schema: a real tiny run of each kind of strategy record (construct, one epoch,
    evaluate, save) reads every field but those of ``READ_ELSEWHERE``, which are read there."""
    from mogo_diffusion.preflight import preflight
    from mogo_diffusion.train import Trainer

    schema = {(cls.__name__, f.name) for cls in SCHEMA for f in dataclasses.fields(cls)}
    for name, strategy in STRATEGY_RUNS.items():
        Trainer.from_config(tiny_run(tiny_dir, tmp_path / name, strategy)).train()
    assert (tmp_path / "marble" / "checkpoints" / "step-000001").is_dir()  # the run saved
    assert schema - reads == READ_ELSEWHERE
    reads.clear()
    for name, strategy in STRATEGY_RUNS.items():
        report = preflight(tiny_run(tiny_dir, tmp_path / name, strategy))
        assert report.lines[0].startswith(f"config: valid (strategy {name!r}")
    assert reads >= READ_ELSEWHERE


ACCEPTED_WEIGHT = 3.4028234663852886e38 / 6  # six weights below float32's largest number in sum


@given(
    weights=st.lists(st.floats(0, ACCEPTED_WEIGHT), min_size=2, max_size=6).filter(any),
    scale=st.floats(-1e3, 1e3),
)
def test_accepted_weights_give_finite_weighted_sum_advantages(weights, scale):
    """The weights' bound: a config the check accepts has finite advantages for finite rewards."""
    rewards = [{"name": f"reward{k}", "weight": w} for k, w in enumerate(weights)]
    config = Config.from_dict({"rewards": rewards, "strategy": {"name": "weighted_sum"}})
    scores = scale * torch.linspace(-1, 1, 4 * len(weights)).reshape(4, len(weights))
    advantages = make_strategy(config).advantages(scores, ["a", "a", "b", "b"], 0)
    assert torch.isfinite(advantages).all()


@dataclasses.dataclass
class Adam:  # a schema of the engine's own tests: a closed tagged union of optimizers
    name: Literal["adam"] = "adam"
    beta: float = 0.9


@dataclasses.dataclass
class Sgd:
    name: Literal["sgd", "sgd_nesterov"] = "sgd"
    momentum: float = 0.0


@dataclasses.dataclass
class Run:
    optimizer: Adam | Sgd = dataclasses.field(default_factory=Adam)


def test_the_engine_reads_any_schema_s_tagged_unions_from_their_name_annotations():
    assert typed.build(Run, {}, "") == Run(Adam())
    assert typed.build(Run, {"optimizer": {"beta": 1}}, "") == Run(Adam(beta=1.0))  # no name: the first
    assert typed.build(Run, {"optimizer": {"name": "sgd_nesterov"}}, "").optimizer == Sgd("sgd_nesterov")
    with pytest.raises(ConfigError) as info:  # a closed union: no open member takes other names
        typed.build(Run, {"optimizer": {"name": "lion"}}, "")
    assert str(info.value) == "optimizer.name: must be one of 'adam', 'sgd', 'sgd_nesterov', got 'lion'"
    with pytest.raises(ConfigError) as info:  # an unknown key names the member by its tag
        typed.build(Run, {"optimizer": {"name": "sgd", "beta": 0.5}}, "")
    assert str(info.value) == "optimizer.beta: unknown key; optimizer 'sgd' has name, momentum"
