"""The shipped configs, and ``python -m mogo_diffusion.train --check`` (mogo_diffusion.preflight)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from torch import nn

from mogo_diffusion import models
from mogo_diffusion.config import LORA_TARGETS, load_config
from mogo_diffusion.preflight import SD35M, SD35M_TRANSFORMER, _meta_transformer, preflight
from mogo_diffusion.train import check_config, main

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("sd35m_*.yaml"))
FIVE = ["pickscore", "hpsv21", "clipscore", "ocr", "geneval"]


def test_the_paper_s_configs_are_all_shipped():
    names = {path.stem for path in CONFIGS}
    expected = {"sd35m_marble", "sd35m_weighted_sum", "sd35m_sequential"} | {
        f"sd35m_single_{r}" for r in FIVE
    }
    assert names == expected


@pytest.mark.parametrize("path", CONFIGS, ids=[path.stem for path in CONFIGS])
def test_every_shipped_config_parses_and_passes_check_config(path):
    config = load_config(path)
    check_config(config)  # reward names and options, the strategy; no model is loaded
    assert config.model.pretrained == SD35M
    assert (config.model.lora_rank, config.model.lora_alpha, config.model.dtype) == (32, 64.0, "bfloat16")
    assert (config.sampling.group_size, config.sampling.prompts_per_epoch % 8) == (24, 0)  # 8 GPUs
    names = [spec.name for spec in config.rewards]
    if path.stem.startswith("sd35m_single_"):
        assert names == [path.stem.removeprefix("sd35m_single_")] == [config.strategy.reward]
    else:
        assert names == FIVE
        assert config.sampling.num_steps == 25
        assert config.nft.beta == 0.1


def test_the_marble_config_is_amortized_marble():
    strategy = load_config(ROOT / "configs" / "sd35m_marble.yaml").strategy
    assert (strategy.name, strategy.harmonize_every, strategy.alpha_ema) == ("marble", 10, 0.9)


def test_the_accelerate_config_is_eight_gpus_in_bf16():
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DistributedType

    cluster = ClusterConfig.from_yaml_file(ROOT / "configs" / "accelerate_8gpu.yaml")
    assert cluster.num_processes == 8
    assert cluster.mixed_precision == "bf16"
    assert cluster.distributed_type == DistributedType.MULTI_GPU


def test_every_config_value_is_documented_in_the_readme():
    readme = (ROOT / "configs" / "README.md").read_text()
    for path in CONFIGS:
        for section, values in yaml.safe_load(path.read_text()).items():
            if isinstance(values, dict):
                for key in values:
                    assert f"`{section}.{key}`" in readme, (
                        f"{path.name}: {section}.{key} is not in the README"
                    )


def test_the_sd35m_transformer_is_counted_on_the_meta_device():
    transformer = _meta_transformer(SD35M_TRANSFORMER)
    assert all(p.is_meta for p in transformer.parameters())
    assert all(b.is_meta for b in transformer.buffers())
    report = preflight(load_config(ROOT / "configs" / "sd35m_marble.yaml"))
    P, L = report.transformer_parameters, report.lora_parameters
    buffers = sum(b.numel() for b in transformer.buffers())
    assert 2.2e9 < P < 2.3e9
    assert 2.45e9 < P + buffers < 2.5e9
    # LoRA: r (in + out) per adapted linear layer, counted here from the layers' shapes, not by peft
    targets = tuple(f".{t}" for t in LORA_TARGETS)
    linears = [m for n, m in transformer.named_modules() if n.endswith(targets) and isinstance(m, nn.Linear)]
    assert sum(32 * (m.in_features + m.out_features) for m in linears) == L
    assert report.memory.buffers == (5 + 1) * L * 4  # K = 5 gradients and the KL term's, float32
    assert report.memory.merged == 2 * sum(m.in_features * m.out_features for m in linears)  # bfloat16


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-sd3")
    models.tiny_sd3("smoke").save_pretrained(path)
    return path


def tiny_config(tmp_path, pretrained, **sections):
    data = {
        "model": {"pretrained": str(pretrained), "dtype": "float32", "lora_rank": 4, "lora_alpha": 8,
                  "max_sequence_length": 16},
        "sampling": {"resolution": 32, "group_size": 2, "prompts_per_epoch": 2, "prompts": "shapes:train"},
        "rewards": [{"name": "color_match"}, {"name": "sharpness"}],
        "train": {"batch_size": 4, "mixed_precision": "no", "out_dir": str(tmp_path / "run")},
        **sections,
    }  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_check_passes_on_the_tiny_model_and_counts_what_the_trainer_trains(tiny_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(tiny_config(tmp_path, tiny_dir)), "--check"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0, out
    assert out.splitlines()[-1] == "ready"
    assert "problem" not in out

    report = preflight(load_config(tiny_config(tmp_path, tiny_dir)))
    pipeline = models.load_pipeline(tiny_dir)
    transformer = pipeline.transformer
    assert report.transformer_parameters == sum(p.numel() for p in transformer.parameters())
    components = (pipeline.vae, pipeline.text_encoder, pipeline.text_encoder_2, pipeline.text_encoder_3)
    frozen = sum(p.numel() for c in (*components, transformer) for p in c.parameters())
    frozen += sum(b.numel() for b in transformer.buffers())
    (weights,) = [line for line in report.lines if line.startswith("  weights")]
    assert weights.endswith(f"float32, {frozen:,} values")  # every component's, counted on meta
    models.add_lora(transformer, 4, 8.0)
    L = sum(p.numel() for p in models.lora_parameters(transformer))
    assert report.lora_parameters == L
    assert report.memory.buffers == (2 + 1) * L * 4  # K = 2 and the KL term (nft.kl_coef > 0)


def test_check_names_every_missing_file_and_its_download_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))  # nothing is cached there
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    models_dir = tmp_path / "models"
    rewards = [
        {"name": "pickscore", "options": {"model": str(models_dir / "PickScore_v1")}},
        {
            "name": "hpsv21",
            "options": {"model": str(models_dir / "HPSv2"), "base": str(models_dir / "CLIP-H")},
        },
        {"name": "clipscore"},
        {"name": "imagereward", "options": {"model": str(models_dir / "ImageReward")}},
    ]
    (tmp_path / "sd35m").mkdir()  # empty: the config refuses a local directory that does not exist
    config = tiny_config(tmp_path, tmp_path / "sd35m", rewards=rewards)
    config.write_text(config.read_text().replace("shapes:train", str(tmp_path / "prompts.txt")))
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(config), "--check"])
    problems = [line for line in capsys.readouterr().out.splitlines() if line.startswith("problem: ")]
    assert exit_.value.code == 1
    m = models_dir
    assert problems == [
        f"problem: model.pretrained: '{tmp_path}/sd35m/model_index.json' not found: not a saved pipeline "
        f"(for SD3.5-M: hf download {SD35M} --local-dir {tmp_path}/sd35m)",
        "problem: rewards.0.options.model: "
        f"'{m}/PickScore_v1' not found: hf download yuvalkirstain/PickScore_v1 --local-dir {m}/PickScore_v1",
        "problem: rewards.0.options.processor: 'laion/CLIP-ViT-H-14-laion2B-s32B-b79K' is not in the hub "
        'cache: hf download laion/CLIP-ViT-H-14-laion2B-s32B-b79K --include "*.json" "*.txt"',
        f"problem: rewards.1.options.model: '{m}/HPSv2/HPS_v2.1_compressed.pt' not found: "
        f"hf download xswu/HPSv2 HPS_v2.1_compressed.pt --local-dir {m}/HPSv2",
        f"problem: rewards.1.options.base: '{m}/CLIP-H' not found: "
        'hf download laion/CLIP-ViT-H-14-laion2B-s32B-b79K --include "*.json" "*.txt" '
        f"--local-dir {m}/CLIP-H",
        "problem: rewards.2.options.model: 'openai/clip-vit-large-patch14' is not in the hub cache: "
        "hf download openai/clip-vit-large-patch14",
        f"problem: rewards.3.options.model: '{m}/ImageReward/ImageReward.pt' not found: "
        f"hf download THUDM/ImageReward ImageReward.pt --local-dir {m}/ImageReward",
        "problem: rewards.3.options.tokenizer: 'google-bert/bert-base-uncased' is not in the hub cache: "
        'hf download google-bert/bert-base-uncased --include "*.json" "*.txt"',
        f"problem: sampling.prompts: prompt file '{tmp_path}/prompts.txt' not found",
    ]


def test_a_pipeline_in_the_hub_cache_passes_and_one_missing_a_component_is_named(
    tiny_dir, tmp_path, monkeypatch
):
    """The hub cache's layout: ``models--org--name/refs/main`` names the snapshot folder."""
    import shutil

    import huggingface_hub.constants

    cache = tmp_path / "cache"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    repo = cache / "models--org--tiny"
    shutil.copytree(tiny_dir, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    config = load_config(tiny_config(tmp_path, "org/tiny"))
    assert preflight(config).problems == []
    for weights in (repo / "snapshots" / "abc123" / "vae").glob("*.safetensors"):
        weights.unlink()
    assert preflight(config).problems == [
        f"model.pretrained: 'org/tiny' lacks the weights of vae (in '{repo}/snapshots/abc123'): "
        "hf download org/tiny"
    ]


@pytest.mark.parametrize("path", CONFIGS, ids=[path.stem for path in CONFIGS])
def test_every_shipped_config_passes_the_check_up_to_missing_weights_and_prompts(path):
    """Here nothing is downloaded: each problem is a missing file with the command that fetches it."""
    report = preflight(load_config(path))
    assert report.transformer_parameters is not None
    assert report.memory is not None
    for problem in report.problems:
        assert "hf download " in problem or "git clone https://github.com/NVlabs/DiffusionNFT" in problem, (
            problem
        )


def test_the_check_names_the_ocr_extra_when_rapidocr_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "rapidocr_onnxruntime", None)  # Python's own way to block an import
    report = preflight(load_config(ROOT / "configs" / "sd35m_single_ocr.yaml"))
    assert (
        "rewards.0: the 'ocr' reward needs the ocr extra (missing: rapidocr_onnxruntime): "
        "pip install 'mogo[ocr]'" in report.problems
    )


def test_the_multi_reward_configs_train_on_the_mixed_pool():
    for name in ("marble", "weighted_sum", "sequential"):
        prompts = load_config(ROOT / "configs" / f"sd35m_{name}.yaml").sampling.prompts
        assert [(p.source, p.reward) for p in prompts] == [
            ("dataset/pickscore/train.txt", None),
            ("dataset/ocr/train.txt", "ocr"),
            ("dataset/geneval/train_metadata.jsonl", "geneval"),
        ]


def test_check_names_each_missing_pool_file_and_reads_the_others(tiny_dir, tmp_path, capsys):
    general = tmp_path / "general.txt"
    general.write_text("a cat on a sofa\n")
    pool = [{"source": str(general), "weight": 2.0}, {"source": "ocr:3", "reward": "ocr"},
            {"source": "dataset/geneval/train_metadata.jsonl"}]  # fmt: skip
    config = load_config(tiny_config(tmp_path, tiny_dir), [f"sampling.prompts={pool}"])
    assert preflight(config).problems == [
        "sampling.prompts.2.source: prompt file 'dataset/geneval/train_metadata.jsonl' not found "
        "(DiffusionNFT's prompt sets: git clone https://github.com/NVlabs/DiffusionNFT "
        "&& ln -s DiffusionNFT/dataset .)"
    ]
    config = load_config(tiny_config(tmp_path, tiny_dir), [f"sampling.prompts={pool[:2]}"])
    report = preflight(config)
    assert report.ok, report.problems
    assert f"sampling.prompts: a pool of 2 sources: {general}: 1 general prompts, weight 2; ocr:3: 3 ocr " \
        "prompts, weight 1" in report.lines  # fmt: skip
    pool[0]["reward"] = "ocr"  # the file exists but its prompt has no text to render
    report = preflight(load_config(tiny_config(tmp_path, tiny_dir), [f"sampling.prompts={pool[:2]}"]))
    assert report.problems == [
        f"sampling.prompts: entry 0 ('{general}'): prompt 1 ('a cat on a sofa') has no text to render "
        "(no quoted text, no metadata 'text')"
    ]


def test_check_accepts_a_converted_imagereward_directory_and_its_tokenizer(tiny_dir, tmp_path, capsys):
    from tests.diffusion.test_imagereward import tiny_imagereward

    converted = tmp_path / "imagereward"
    tiny_imagereward(converted)
    tokenizer = tmp_path / "imagereward-original" / "bert"
    rewards = [{"name": "imagereward", "options": {"model": str(converted), "tokenizer": str(tokenizer)}}]
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(tiny_config(tmp_path, tiny_dir, rewards=rewards)), "--check"])
    assert exit_.value.code == 0
    assert "problem" not in capsys.readouterr().out
