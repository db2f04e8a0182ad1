"""The shipped configs, and ``python -m mogo_diffusion.train --check`` (mogo_diffusion.preflight)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import yaml
from diffusers import SD3Transformer2DModel
from torch import nn

from mogo_diffusion import models
from mogo_diffusion.checks import check_config
from mogo_diffusion.config import LORA_TARGETS, Config, ConfigError, HarmonizedConfig, load_config
from mogo_diffusion.preflight import SD35M, SD35M_TRANSFORMER, _meta_transformer, preflight
from mogo_diffusion.train import Trainer, main

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


# ---- --check runs the trainer's start-up checks (issue 39, item 14) ------------------------------


def zero_weights(config: Config, tmp_path: Path) -> None:
    for spec in config.rewards:
        spec.weight = 0.0


def huge_weights(config: Config, tmp_path: Path) -> None:
    for spec in config.rewards:
        spec.weight = 1e308


def out_dir_a_file(config: Config, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    config.train.out_dir = str(tmp_path / "a-file")


REFUSED = {  # each: how a valid config is changed, and what the check and the trainer say
    "every weight 0 under marble": (zero_weights, "rewards: every weight is 0; the marble strategy"),
    "weights of 1e308": (huge_weights, "rewards.0.weight: the weights sum to inf, beyond float32's"),
    "scale inf": (
        lambda c, _: setattr(c, "strategy", HarmonizedConfig("min_norm", options={"scale": float("inf")})),
        "strategy.options.scale: must be finite, got inf",
    ),
    "steps_per_epoch above the batches": (
        lambda c, _: setattr(c.train, "steps_per_epoch", 2),
        "train.steps_per_epoch: 2 steps, but each process trains 1 batch(es) of train.batch_size=4",
    ),
    "out_dir a file": (out_dir_a_file, "is a file, not a directory"),
    "an unknown tracker": (lambda c, _: setattr(c.train, "log_with", ["nope"]), "train.log_with: unknown"),
    "no LoRA target matches": (  # --check crashed with peft's NoMatchingPeftModuleError
        lambda c, _: setattr(c.model, "lora_targets", ["to_qq"]),
        "model.lora_targets.0: 'to_qq' names no linear layer of the transformer (did you mean 'to_q'?)",
    ),
    "one LoRA target matches nothing": (  # peft dropped it silently: only to_q trained
        lambda c, _: setattr(c.model, "lora_targets", ["to_q", "add_q"]),
        "model.lora_targets.1: 'add_q' names no linear layer of the transformer (did you mean",
    ),
    "a resolution beyond the positional embedding": (  # the trainer sampled sample_size instead
        lambda c, _: setattr(c.sampling, "resolution", 128),
        "sampling.resolution: 128 px images are 32 x 32 latents (the VAE's scale factor 4), more than "
        "the transformer's positional embedding covers: pos_embed_max_size 8 x patch_size 2 = 16 "
        "latents, 64 px at most",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_the_check_and_the_trainer_refuse_alike_before_any_work(tiny_dir, tmp_path, capsys, case):
    """``--check`` said "ready" for configs the trainer rejects (some after an epoch) or crashed;
    both now run the same checks: the check names the problem and exits non-zero, the trainer
    refuses when it is built."""
    change, message = REFUSED[case]
    config = load_config(tiny_config(tmp_path, tiny_dir))
    check_config(config)  # valid before the change
    change(config, tmp_path)
    config.save(tmp_path / "changed.yaml")
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(tmp_path / "changed.yaml"), "--check"])
    printed = capsys.readouterr()
    assert exit_.value.code != 0
    assert message in printed.out + printed.err
    with pytest.raises(ConfigError, match=re.escape(message)):
        Trainer.from_config(config)
    assert not (tmp_path / "run").exists()  # nothing written


# ---- sampling.resolution: one count of image tokens (issue 38) -------------------------------------


def sd35m_geometry(path: Path) -> Path:
    """A tiny pipeline (smoke transformer, tiny encoders) with SD3.5-M's image geometry: sample_size
    128, patch 2, pos_embed_max_size 384, a VAE of scale factor 8, saved at ``path``."""
    geometry = {key: SD35M_TRANSFORMER[key] for key in ("sample_size", "patch_size", "pos_embed_max_size")}
    smoke = models.tiny_sd3("smoke").transformer.config
    transformer = SD3Transformer2DModel.from_config({**smoke, **geometry})
    models.tiny_pipeline(transformer, vae_scale_factor=8, clip_length=16, t5_length=16).save_pretrained(path)
    return path


def test_the_check_and_the_trainer_count_the_same_image_tokens_for_the_marble_config(tmp_path):
    """512 px are 1024 image tokens of SD3.5-M; the trainer sampled its sample_size, 128 latents a
    side: 4096 tokens, four times what the configs ask and the check sized memory for."""
    marble = ROOT / "configs" / "sd35m_marble.yaml"
    assert preflight(load_config(marble)).image_tokens == 1024  # SD35M_TRANSFORMER, no download
    tiny = {"model.pretrained": str(sd35m_geometry(tmp_path / "sd35m-geometry")), "model.dtype": "float32",
            "model.lora_rank": 2, "model.lora_alpha": 4, "model.max_sequence_length": 16,
            "rewards": "[{name: sharpness}, {name: color_match}]", "sampling.prompts": "shapes:train:4",
            "sampling.eval_prompts": "null", "sampling.group_size": 2, "sampling.prompts_per_epoch": 1,
            "sampling.num_steps": 1, "sampling.batch_size": 2, "train.batch_size": 2,
            "train.mixed_precision": "'no'", "train.out_dir": str(tmp_path / "run")}  # fmt: skip
    config = load_config(marble, [f"{key}={value}" for key, value in tiny.items()])
    assert config.sampling.resolution == 512  # the shipped config's
    report = preflight(config)
    assert report.ok, report.problems
    trainer = Trainer.from_config(config)
    assert trainer.transformer.config.sample_size == 128
    batch = trainer.sample(0)
    side = batch.latents.shape[-1]
    assert batch.latents.shape[-2:] == (64, 64)
    assert batch.images.shape[-2:] == (512, 512)
    assert (side // trainer.transformer.config.patch_size) ** 2 == report.image_tokens == 1024


def test_a_training_forward_keeps_no_attention_matrix_on_the_cpu(tiny_dir):
    """The estimate counts no attention matrices: scaled-dot-product attention keeps q, k, v, the
    output and the log-sum-exp, on the CPU too. A torch that kept the ``[b, heads, S, S]`` scores
    would make the activation term wrong on CPUs."""
    pipeline = models.load_pipeline(tiny_dir)
    transformer = pipeline.transformer
    models.add_lora(transformer, 2, 4.0)
    c = transformer.config
    x = torch.randn(2, c.in_channels, c.sample_size, c.sample_size)
    embeds, pooled = models.encode_prompts(pipeline, ["a red circle", "a blue square"], 16)
    tokens = (c.sample_size // c.patch_size) ** 2 + embeds.shape[1]
    shapes = []
    keep = torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t)
    with keep, models.fused(transformer, models.TRAINED):
        v = transformer(x, embeds, pooled, torch.tensor([500.0, 500.0]), return_dict=False)[0]
    v.sum().backward()
    assert any(shape[-2:] == (tokens, c.attention_head_dim) for shape in shapes)  # q, k, v were saved
    assert not any(shape[-2:] == (tokens, tokens) for shape in shapes)
