"""Tiny offline SD3 pipelines, loading, tokenizers, prompt encoding and LoRA adapters."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
from peft import LoraConfig

from mogo_diffusion.config import ConfigError, load_config
from mogo_diffusion.models import (
    LORA_TARGETS,
    OLD,
    TRAINED,
    adapter,
    add_lora,
    ema_update,
    encode_prompts,
    fused,
    load_component,
    load_pipeline,
    lora_parameters,
    merged,
    reference,
    save_lora,
    tiny_sd3,
)
from mogo_diffusion.sampling import sample
from mogo_diffusion.tokenizers import DEFAULT_CORPUS, clip_tokenizer, t5_tokenizer, train_bpe

PROMPTS = ["a red circle", 'a sign that says "Open 24/7!"', "a red circle"]


@pytest.fixture(scope="module")
def pipeline() -> StableDiffusion3Pipeline:
    return tiny_sd3("smoke", seed=0)


@pytest.fixture(scope="module")
def saved(pipeline, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-sd3")
    pipeline.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def embeds(pipeline):
    return encode_prompts(pipeline, PROMPTS)


@pytest.fixture(scope="module")
def noise() -> torch.Tensor:
    return torch.randn(3, 16, 8, 8, generator=torch.Generator().manual_seed(0))


def _states_equal(first: torch.nn.Module, second: torch.nn.Module) -> bool:
    a, b = first.state_dict(), second.state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _velocity(transformer, embeds, noise, t: float = 700.0) -> torch.Tensor:
    prompt_embeds, pooled = embeds
    with torch.no_grad():
        return transformer(
            hidden_states=noise,
            timestep=torch.full((noise.shape[0],), t),
            encoder_hidden_states=prompt_embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0]


# Builder ------------------------------------------------------------------------------------------


def test_the_same_seed_builds_the_same_weights_and_keeps_the_global_rng(pipeline):
    state = torch.random.get_rng_state()
    again = tiny_sd3("smoke", seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        assert _states_equal(getattr(pipeline, name), getattr(again, name)), name
    assert not _states_equal(pipeline.transformer, tiny_sd3("smoke", seed=1).transformer)
    # two CLIP encoders, not one twice
    assert not _states_equal(pipeline.text_encoder, pipeline.text_encoder_2)


@pytest.mark.parametrize(
    ("preset", "layers", "width", "low", "high"),
    [("smoke", 2, 64, 0.3e6, 0.35e6), ("small", 4, 128, 2.3e6, 2.5e6)],
)
def test_presets_have_the_stated_sizes_and_make_8x8x16_latents_of_32px(preset, layers, width, low, high):
    tiny = tiny_sd3(preset)
    transformer, vae = tiny.transformer, tiny.vae
    assert transformer.config.num_layers == layers
    assert transformer.config.num_attention_heads * transformer.config.attention_head_dim == width
    assert low < sum(p.numel() for p in transformer.parameters()) < high
    assert tiny.vae_scale_factor == 4
    assert vae.config.latent_channels == 16
    assert 0.2e6 < sum(p.numel() for p in vae.parameters()) < 0.3e6
    with torch.no_grad():
        latents = vae.encode(torch.zeros(1, 3, 32, 32)).latent_dist.mode()
    assert latents.shape == (1, 16, 8, 8)
    assert tiny.default_sample_size * tiny.vae_scale_factor == 32


def test_the_builder_refuses_bad_arguments():
    with pytest.raises(ValueError, match="'huge'"):
        tiny_sd3("huge")
    with pytest.raises(ValueError, match="max_sequence_length"):
        tiny_sd3(max_sequence_length=1)


def test_torch_dtype_applies_to_all_weights():
    half = tiny_sd3(torch_dtype=torch.bfloat16)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        assert {p.dtype for p in getattr(half, name).parameters()} == {torch.bfloat16}, name


# Loading ------------------------------------------------------------------------------------------


def test_a_saved_pipeline_loads_back_through_the_loader(pipeline, saved, embeds):
    loaded = load_pipeline(saved)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        assert _states_equal(getattr(pipeline, name), getattr(loaded, name)), name
    for name in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        assert getattr(loaded, name)(PROMPTS).input_ids == getattr(pipeline, name)(PROMPTS).input_ids
    assert loaded.scheduler.config.shift == 3.0
    for ours, theirs in zip(encode_prompts(loaded, PROMPTS), embeds, strict=True):
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
    assert load_pipeline(str(saved), torch_dtype=torch.bfloat16).transformer.dtype == torch.bfloat16


def test_single_components_load_from_their_subfolders(pipeline, saved):
    transformer = load_component(saved, "transformer")
    assert isinstance(transformer, SD3Transformer2DModel)
    assert _states_equal(transformer, pipeline.transformer)
    assert load_component(saved, "scheduler").config.shift == 3.0
    assert load_component(saved, "tokenizer_3")(PROMPTS).input_ids == pipeline.tokenizer_3(PROMPTS).input_ids
    with pytest.raises(ValueError, match="'unet'"):
        load_component(saved, "unet")


def test_missing_or_wrong_paths_give_errors_that_name_them(saved, tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_pipeline(missing)
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_pipeline(f"./{missing.name}")
    with pytest.raises(FileNotFoundError, match=r"model_index\.json"):
        load_pipeline(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(NotADirectoryError, match=r"weights\.bin"):
        load_pipeline(tmp_path / "weights.bin")
    with pytest.raises(FileNotFoundError, match="transformer"):
        load_component(tmp_path, "transformer")
    with pytest.raises(ValueError, match="revision"):
        load_pipeline(saved, revision="main")


def test_an_uncached_hub_id_fails_offline_with_its_name():
    with pytest.raises(OSError, match="mogo-tests/no-such-model"):
        load_pipeline("mogo-tests/no-such-model", local_files_only=True)


@pytest.mark.parametrize("model", ["sd3-medium", "org/name", "org/name.v2", "a b/c", "-org/name", "org/"])
def test_the_config_and_the_loader_agree_on_what_a_hub_id_is(model):
    """One pattern: ``sd3-medium`` passed the config and then failed in the loader."""
    try:
        load_config(None, ["rewards.0.name=sharpness", f"model.pretrained={model}"])
        config_accepts = True
    except ConfigError:
        config_accepts = False
    with pytest.raises(OSError, match=re.escape(model)) as info:
        load_pipeline(model, local_files_only=True)
    loader_treats_as_hub_id = type(info.value) is OSError  # not "directory does not exist"
    assert config_accepts == loader_treats_as_hub_id


# Tokenizers ---------------------------------------------------------------------------------------

ODD_TEXT = "Digits 0123456789, punctuation !?.;:'\"()[]{}<>@#$%^&*-_+=/\\|~`"


def test_the_clip_tokenizer_never_yields_unknown_tokens():
    tokenizer = clip_tokenizer()
    for text in (ODD_TEXT, "ünïcödé 日本語 🙂", "zzqx"):
        ids = tokenizer(text).input_ids
        # the unknown token of CLIP is <|endoftext|>: it may only close the text
        assert ids.count(tokenizer.unk_token_id) == 1
        assert ids[0] == tokenizer.bos_token_id
        assert ids[-1] == tokenizer.eos_token_id
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        assert decoded.replace(" ", "") == text.lower().replace(" ", "")
    assert tokenizer.eos_token_id == len(tokenizer) - 1
    assert tokenizer.eos_token_id != 2


def test_the_t5_tokenizer_covers_printable_ascii():
    tokenizer = t5_tokenizer()
    ids = tokenizer(ODD_TEXT).input_ids
    assert tokenizer.unk_token_id not in ids
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == ODD_TEXT
    assert tokenizer.convert_ids_to_tokens(tokenizer("a red circle").input_ids) == [
        "▁a",
        "▁red",
        "▁circle",
        "</s>",
    ]


def test_bpe_merges_follow_frequency_then_spelling():
    # pairs of "hello" x2: (e,l) (h,e) (l,l) (l,o</w>) tie at 2; "world"'s pairs occur once
    assert train_bpe(["hello hello world"], 50) == [
        ("e", "l"),
        ("el", "l"),
        ("ell", "o</w>"),
        ("h", "ello</w>"),
    ]
    assert train_bpe(["hello hello world"], 2) == [("e", "l"), ("el", "l")]


@pytest.mark.spawns
def test_tokenizers_are_deterministic_across_corpus_order_and_processes():
    merges = train_bpe(DEFAULT_CORPUS, 256)
    assert train_bpe(reversed(DEFAULT_CORPUS), 256) == merges
    assert clip_tokenizer().get_vocab() == clip_tokenizer(tuple(reversed(DEFAULT_CORPUS))).get_vocab()
    code = (
        "from mogo_diffusion.tokenizers import DEFAULT_CORPUS, train_bpe\n"
        "print(train_bpe(DEFAULT_CORPUS, 256))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(merges)


# Prompts ------------------------------------------------------------------------------------------


def test_prompts_are_encoded_once_each_and_match_the_pipeline(pipeline, embeds, monkeypatch):
    prompt_embeds, pooled = embeds
    assert prompt_embeds.shape == (3, 32, 64)  # 16 CLIP + 16 T5 tokens, joint_attention_dim 64
    assert pooled.shape == (3, 64)
    torch.testing.assert_close(prompt_embeds[0], prompt_embeds[2], atol=0, rtol=0)
    with torch.no_grad():
        expected, _, expected_pooled, _ = pipeline.encode_prompt(
            PROMPTS, None, None, do_classifier_free_guidance=False, max_sequence_length=16
        )
    torch.testing.assert_close(prompt_embeds, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(pooled, expected_pooled, atol=1e-6, rtol=0)
    seen: list[list[str]] = []
    original = pipeline.encode_prompt

    def recording(prompt, *args, **kwargs):
        seen.append(list(prompt))
        return original(prompt, *args, **kwargs)

    monkeypatch.setattr(pipeline, "encode_prompt", recording)
    encode_prompts(pipeline, ["b", "a", "b", "b"])
    assert seen == [["b", "a"]]
    longer, _ = encode_prompts(pipeline, ["b"], max_sequence_length=24)
    assert longer.shape == (1, 16 + 24, 64)


def test_prompt_encoding_refuses_a_bare_string_and_an_empty_list(pipeline):
    with pytest.raises(TypeError, match="sequence of strings"):
        encode_prompts(pipeline, "a red circle")
    with pytest.raises(ValueError, match="empty"):
        encode_prompts(pipeline, [])


# LoRA ---------------------------------------------------------------------------------------------


@pytest.fixture
def lora_pipeline() -> StableDiffusion3Pipeline:
    tiny = tiny_sd3("smoke", seed=0)
    add_lora(tiny.transformer, rank=4, alpha=8.0)
    return tiny


def _perturb(transformer, name: str, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(transformer, name):
            p.add_(0.3 * torch.randn(p.shape, generator=generator))


def test_lora_starts_with_a_zero_delta_and_trains_only_the_trained_adapter(
    pipeline, lora_pipeline, embeds, noise
):
    transformer = lora_pipeline.transformer
    base = _velocity(pipeline.transformer, embeds, noise)
    torch.testing.assert_close(_velocity(transformer, embeds, noise), base, atol=0, rtol=0)
    trained, old = lora_parameters(transformer, TRAINED), lora_parameters(transformer, OLD)
    adapted = {
        name.split(".lora_A.")[0] for name, _ in transformer.named_parameters() if ".lora_A.default." in name
    }
    assert {re.sub(r"^.*\.attn2?\.", "", name) for name in adapted} == set(LORA_TARGETS)
    assert len(trained) == len(old) == 2 * len(adapted)
    assert {id(p) for p in transformer.parameters() if p.requires_grad} == {id(p) for p in trained}
    for layer_a, layer_b in zip(trained[::2], trained[1::2], strict=True):
        assert layer_a.abs().sum() > 0
        assert layer_b.abs().sum() == 0  # Gaussian init: B = 0
    for mine, theirs in zip(trained, old, strict=True):
        assert torch.equal(mine, theirs)
        assert mine.data_ptr() != theirs.data_ptr()


def test_ema_update_moves_old_towards_trained(lora_pipeline):
    transformer = lora_pipeline.transformer
    _perturb(transformer, TRAINED, seed=1)
    _perturb(transformer, OLD, seed=2)
    trained = [p.clone() for p in lora_parameters(transformer, TRAINED)]
    old = [p.clone() for p in lora_parameters(transformer, OLD)]
    ema_update(transformer, 0.9)
    for new, before, source in zip(lora_parameters(transformer, OLD), old, trained, strict=True):
        torch.testing.assert_close(new, 0.9 * before + 0.1 * source)
    for now, before in zip(lora_parameters(transformer, TRAINED), trained, strict=True):
        assert torch.equal(now, before)
    ema_update(transformer, 1.0)
    ema_update(transformer, 0.0)
    for new, source in zip(lora_parameters(transformer, OLD), trained, strict=True):
        assert torch.equal(new, source)
    with pytest.raises(ValueError, match="decay"):
        ema_update(transformer, 1.5)
    with pytest.raises(ValueError, match="'ema'"):
        ema_update(transformer, 0.5, target="ema")


def test_adapter_and_reference_select_what_a_forward_uses(pipeline, lora_pipeline, embeds, noise):
    transformer = lora_pipeline.transformer
    _perturb(transformer, TRAINED, seed=3)  # the old adapter keeps its zero delta
    flags = [p.requires_grad for p in transformer.parameters()]
    base = _velocity(pipeline.transformer, embeds, noise)
    trained = _velocity(transformer, embeds, noise)
    assert (trained - base).abs().max() > 1e-3
    with adapter(transformer, OLD) as selected:
        assert selected is transformer
        torch.testing.assert_close(_velocity(transformer, embeds, noise), base, atol=1e-6, rtol=0)
        assert [p.requires_grad for p in transformer.parameters()] == flags
        with reference(transformer):
            torch.testing.assert_close(_velocity(transformer, embeds, noise), base, atol=0, rtol=0)
            with adapter(transformer, TRAINED):
                torch.testing.assert_close(_velocity(transformer, embeds, noise), trained, atol=0, rtol=0)
            torch.testing.assert_close(_velocity(transformer, embeds, noise), base, atol=0, rtol=0)
            assert [p.requires_grad for p in transformer.parameters()] == flags
    torch.testing.assert_close(_velocity(transformer, embeds, noise), trained, atol=0, rtol=0)
    assert [p.requires_grad for p in transformer.parameters()] == flags
    with pytest.raises(RuntimeError, match="inside"), reference(transformer):
        raise RuntimeError("inside")
    torch.testing.assert_close(_velocity(transformer, embeds, noise), trained, atol=0, rtol=0)
    with pytest.raises(ValueError, match="ema"), adapter(transformer, "ema"):
        pass
    torch.testing.assert_close(_velocity(transformer, embeds, noise), trained, atol=0, rtol=0)


def test_fused_computes_the_adapter_and_its_gradients_and_restores_the_layers(embeds, noise):
    tiny = tiny_sd3("smoke", seed=0)
    transformer = tiny.transformer.double()  # float64: the two association orders agree to ~eps64
    add_lora(transformer, rank=4, alpha=8.0)
    for p in (*lora_parameters(transformer, TRAINED), *lora_parameters(transformer, OLD)):
        p.data = p.data.double()
    _perturb(transformer, TRAINED, seed=4)
    _perturb(transformer, OLD, seed=5)
    embeds = tuple(e.double() for e in embeds)
    noise = noise.double()
    params = lora_parameters(transformer, TRAINED)

    def velocity_and_grads():
        prompt_embeds, pooled = embeds
        v = transformer(
            hidden_states=noise, timestep=torch.full((noise.shape[0],), 700.0),
            encoder_hidden_states=prompt_embeds, pooled_projections=pooled, return_dict=False,
        )[0]  # fmt: skip
        return v.detach(), torch.autograd.grad(v.square().sum(), params)

    expected, expected_grads = velocity_and_grads()
    with adapter(transformer, OLD), fused(transformer, TRAINED) as same:  # fused names its adapter
        assert same is transformer
        v, grads = velocity_and_grads()
    # sums of at most a few hundred terms through two blocks and back: a few hundred eps64 relative
    # to the largest entry, far below 1e4 eps64
    eps = torch.finfo(torch.float64).eps
    torch.testing.assert_close(v, expected, rtol=0, atol=1e4 * eps * expected.abs().max().item())
    for grad, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, want, rtol=0, atol=1e4 * eps * want.abs().max().item())
    assert all("forward" not in vars(module) for module in transformer.modules())  # layers restored
    assert torch.equal(velocity_and_grads()[0], expected)
    with pytest.raises(RuntimeError, match="inside"), fused(transformer, TRAINED):
        raise RuntimeError("inside")
    assert all("forward" not in vars(module) for module in transformer.modules())
    with pytest.raises(ValueError, match="'ema'"), fused(transformer, "ema"):
        pass
    transformer.add_adapter(LoraConfig(r=2, lora_dropout=0.1, target_modules=["to_q"]), adapter_name="drop")
    with pytest.raises(ValueError, match="'drop' has dropout"), fused(transformer, "drop"):
        pass


def test_merged_computes_the_adapter_folded_into_the_weights_and_restores_them(embeds, noise):
    tiny = tiny_sd3("smoke", seed=0)
    transformer = tiny.transformer.double()  # float64: the two association orders agree to ~eps64
    add_lora(transformer, rank=4, alpha=8.0)
    for p in (*lora_parameters(transformer, TRAINED), *lora_parameters(transformer, OLD)):
        p.data = p.data.double()  # peft keeps adapters in float32
    _perturb(transformer, TRAINED, seed=4)
    _perturb(transformer, OLD, seed=5)
    embeds = tuple(e.double() for e in embeds)
    noise = noise.double()
    state = {name: value.clone() for name, value in transformer.state_dict().items()}
    pointers = {name: value.data_ptr() for name, value in transformer.state_dict().items()}
    for name in (TRAINED, OLD):
        with torch.no_grad(), adapter(transformer, name):
            expected = _velocity(transformer, embeds, noise)
        with torch.no_grad(), merged(transformer, name):
            folded = _velocity(transformer, embeds, noise)
        # dot products of at most a few hundred terms through two blocks: errors of a few
        # hundred eps64 relative to the largest output, far below 1e4 eps64
        scale = expected.abs().max().item()
        atol = 1e4 * torch.finfo(torch.float64).eps * scale
        torch.testing.assert_close(folded, expected, rtol=0, atol=atol)
    trained = _velocity(transformer, embeds, noise)
    with torch.no_grad(), adapter(transformer, OLD):
        assert not torch.equal(trained, _velocity(transformer, embeds, noise))
    for name, value in transformer.state_dict().items():  # the weights are back, bit for bit
        assert torch.equal(value, state[name]), name
        assert value.data_ptr() == pointers[name], name
    assert torch.equal(_velocity(transformer, embeds, noise), trained)  # the selection is back
    with pytest.raises(RuntimeError, match="inside"), torch.no_grad(), merged(transformer, OLD):
        raise RuntimeError("inside")
    assert all(torch.equal(value, state[name]) for name, value in transformer.state_dict().items())
    with pytest.raises(RuntimeError, match="no_grad"), merged(transformer, OLD):
        pass
    with pytest.raises(ValueError, match="'ema'"), torch.no_grad(), merged(transformer, "ema"):
        pass


def test_gradients_reach_only_the_trained_adapter_even_while_old_samples(lora_pipeline, embeds, noise):
    transformer = lora_pipeline.transformer
    _perturb(transformer, TRAINED, seed=4)
    prompt_embeds, pooled = embeds
    kwargs = {
        "hidden_states": noise,
        "timestep": torch.full((3,), 500.0),
        "encoder_hidden_states": prompt_embeds,
        "pooled_projections": pooled,
        "return_dict": False,
    }
    with adapter(transformer, OLD):
        assert not transformer(**kwargs)[0].requires_grad  # old is frozen even with grad enabled
    transformer(**kwargs)[0].square().mean().backward()
    assert all(p.grad is not None for p in lora_parameters(transformer, TRAINED))
    assert all(p.grad is None for p in lora_parameters(transformer, OLD))


def test_a_saved_lora_reproduces_the_trained_model_in_a_fresh_pipeline(
    lora_pipeline, saved, embeds, noise, tmp_path
):
    transformer = lora_pipeline.transformer
    _perturb(transformer, TRAINED, seed=5)
    directory = save_lora(transformer, tmp_path / "lora")
    assert (directory / "pytorch_lora_weights.safetensors").is_file()
    fresh = load_pipeline(saved)
    before = sample(fresh.transformer, fresh.scheduler, *embeds, 3, latents=noise).latents
    fresh.load_lora_weights(directory)
    after = sample(fresh.transformer, fresh.scheduler, *embeds, 3, latents=noise).latents
    expected = sample(transformer, lora_pipeline.scheduler, *embeds, 3, latents=noise).latents
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, expected, atol=1e-6, rtol=0)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(NotADirectoryError, match=r"weights\.bin"):
        save_lora(transformer, tmp_path / "weights.bin")


@pytest.mark.filterwarnings("ignore:Already found a `peft_config`:UserWarning")  # the "other" adapter
def test_lora_helpers_refuse_bad_adapters(pipeline, tmp_path):
    with pytest.raises(ValueError, match="no LoRA adapter named 'default'"):
        lora_parameters(pipeline.transformer)
    with pytest.raises(ValueError, match="add_lora"), reference(pipeline.transformer):
        pass
    transformer = tiny_sd3().transformer
    with pytest.raises(ValueError, match="rank"):
        add_lora(transformer, rank=0)
    with pytest.raises(ValueError, match="alpha"):
        add_lora(transformer, alpha=0.0)
    add_lora(transformer, rank=2, alpha=2.0, old=False)
    assert list(transformer.peft_config) == [TRAINED]
    with pytest.raises(ValueError, match=r"already has LoRA adapters \['default'\]"):
        add_lora(transformer)
    transformer.add_adapter(LoraConfig(r=3, lora_alpha=3.0, target_modules=["to_q"]), adapter_name="other")
    with pytest.raises(ValueError, match=r"differ in \(rank, alpha\)"):
        ema_update(transformer, 0.5, target="other")


@pytest.mark.filterwarnings("ignore:Already found a `peft_config`:UserWarning")  # the "late" adapter
def test_adapter_switching_agrees_with_peft_and_sees_adapters_added_later(embeds, noise):
    transformer = tiny_sd3().transformer
    add_lora(transformer, rank=2, alpha=2.0)
    _perturb(transformer, TRAINED, seed=6)
    with adapter(transformer, OLD):
        assert transformer.active_adapters() == [OLD]  # diffusers reads the layers' own selection
        switched = _velocity(transformer, embeds, noise)
    transformer.set_adapter(OLD)  # the same selection through peft
    torch.testing.assert_close(_velocity(transformer, embeds, noise), switched, atol=0, rtol=0)
    transformer.set_adapter(TRAINED)
    config = LoraConfig(r=2, lora_alpha=2.0, init_lora_weights="gaussian", target_modules=["to_q"])
    transformer.add_adapter(config, adapter_name="late")  # after the layers were first looked up
    _perturb(transformer, "late", seed=7)
    with adapter(transformer, "late"):
        late = _velocity(transformer, embeds, noise)
    transformer.set_adapter("late")
    torch.testing.assert_close(_velocity(transformer, embeds, noise), late, atol=0, rtol=0)
    assert (late - switched).abs().max() > 1e-3
