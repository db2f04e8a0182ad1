"""The CLIP-family rewards (PickScore, CLIPScore, Aesthetic, HPSv2.1) on tiny random models of their
architecture, saved to disk and loaded back through the public loaders."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from safetensors.torch import save_file

from mogo_diffusion.checks import check_config
from mogo_diffusion.config import Config
from mogo_diffusion.rewards import MultiReward, Reward, available_rewards, make_reward
from mogo_diffusion.rewards.clip import AestheticPredictor, ClipScore, ImageTransform, PickScore
from mogo_diffusion.rewards.hps import HPS_FILE, HPSv21, convert_open_clip
from mogo_diffusion.tokenizers import clip_tokenizer

ROOT = Path(__file__).resolve().parents[2]
CONTEXT, WIDTH, LAYERS, HEADS, PATCH, SIZE, DIM = 16, 32, 2, 2, 8, 32, 16
PROMPTS = ["a red circle", "a green square on a black background", "a sign that says hello", "x"]
LOGIT_SCALE = math.log(50.0)  # not CLIP's initial value, so that the formula must read it
CLIP_NAMES = ("pickscore", "clipscore", "aesthetic", "hpsv21")


def rand_images(B=4, height=40, width=48, seed=0):
    return torch.rand(B, 3, height, width, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def tokenizer():
    return clip_tokenizer(num_merges=64, model_max_length=CONTEXT)


@pytest.fixture(scope="module")
def clip_config(tokenizer):
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": WIDTH,
        "intermediate_size": 4 * WIDTH,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "max_position_embeddings": CONTEXT,
        "hidden_act": "gelu",
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    vision = {
        "hidden_size": WIDTH,
        "intermediate_size": 4 * WIDTH,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "image_size": SIZE,
        "patch_size": PATCH,
        "hidden_act": "gelu",
    }
    return transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=DIM)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory, tokenizer, clip_config):
    """A tiny random CLIPModel with its tokenizer and image processor, as on the hub."""
    torch.manual_seed(0)
    model = transformers.CLIPModel(clip_config)
    with torch.no_grad():
        model.logit_scale.fill_(LOGIT_SCALE)
    path = tmp_path_factory.mktemp("clip")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE}
    )
    processor.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def clip_model(clip_dir):
    return transformers.CLIPModel.from_pretrained(clip_dir).eval()


@pytest.fixture(scope="module")
def predictor_file(tmp_path_factory):
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("aesthetic") / "predictor.pth"
    torch.save(AestheticPredictor(DIM).state_dict(), path)
    return path


@pytest.fixture(scope="module")
def open_clip_state(tokenizer):
    """A tiny random state dict in open_clip's ``CLIP`` layout (ViT image tower), matching clip_config."""
    g = torch.Generator().manual_seed(2)

    def rand(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    def tower(prefix):
        blocks = {}
        for i in range(LAYERS):
            p = f"{prefix}transformer.resblocks.{i}."
            blocks |= {
                p + "ln_1.weight": 1 + rand(WIDTH),
                p + "ln_1.bias": rand(WIDTH),
                p + "attn.in_proj_weight": rand(3 * WIDTH, WIDTH, scale=0.2),
                p + "attn.in_proj_bias": rand(3 * WIDTH),
                p + "attn.out_proj.weight": rand(WIDTH, WIDTH, scale=0.2),
                p + "attn.out_proj.bias": rand(WIDTH),
                p + "ln_2.weight": 1 + rand(WIDTH),
                p + "ln_2.bias": rand(WIDTH),
                p + "mlp.c_fc.weight": rand(4 * WIDTH, WIDTH, scale=0.2),
                p + "mlp.c_fc.bias": rand(4 * WIDTH),
                p + "mlp.c_proj.weight": rand(WIDTH, 4 * WIDTH, scale=0.2),
                p + "mlp.c_proj.bias": rand(WIDTH),
            }
        return blocks

    grid = SIZE // PATCH
    return {
        "visual.class_embedding": rand(WIDTH),
        "visual.positional_embedding": rand(grid * grid + 1, WIDTH),
        "visual.conv1.weight": rand(WIDTH, 3, PATCH, PATCH),
        "visual.ln_pre.weight": 1 + rand(WIDTH),
        "visual.ln_pre.bias": rand(WIDTH),
        **tower("visual."),
        "visual.ln_post.weight": 1 + rand(WIDTH),
        "visual.ln_post.bias": rand(WIDTH),
        "visual.proj": rand(WIDTH, DIM, scale=0.3),
        "token_embedding.weight": rand(len(tokenizer), WIDTH, scale=0.5),
        "positional_embedding": rand(CONTEXT, WIDTH),
        **tower(""),
        "ln_final.weight": 1 + rand(WIDTH),
        "ln_final.bias": rand(WIDTH),
        "text_projection": rand(WIDTH, DIM, scale=0.3),
        "logit_scale": torch.tensor(math.log(100.0)),
    }


@pytest.fixture(scope="module")
def hps_file(tmp_path_factory, open_clip_state):
    path = tmp_path_factory.mktemp("hps") / HPS_FILE
    torch.save({"state_dict": open_clip_state}, path)
    return path


@pytest.fixture(scope="module")
def options(clip_dir, predictor_file, hps_file):
    """Each reward's options for the tiny models (paths as ``Path`` or ``str``, as configs give them)."""
    return {
        "pickscore": {"model": clip_dir, "processor": clip_dir},
        "clipscore": {"model": str(clip_dir)},
        "aesthetic": {"predictor": predictor_file, "model": clip_dir},
        "hpsv21": {"model": hps_file, "base": str(clip_dir)},
    }


@pytest.fixture(scope="module")
def rewards(options):
    """Each reward, built by name."""
    return {name: make_reward(name, **options[name]) for name in CLIP_NAMES}


# Every reward ------------------------------------------------------------------------------------


def test_the_rewards_are_registered():
    assert set(CLIP_NAMES) <= set(available_rewards())


@pytest.mark.parametrize("name", CLIP_NAMES)
def test_scores_shape_range_and_determinism(rewards, name):
    reward = rewards[name]
    assert isinstance(reward, Reward)
    assert reward.name == name
    images = rand_images()
    scores = reward(images, PROMPTS, [{} for _ in PROMPTS])
    assert scores.shape == (4,)
    assert scores.dtype == torch.float32
    assert bool(torch.isfinite(scores).all())
    if name in ("clipscore", "hpsv21"):
        assert bool((scores.abs() <= 1 + 1e-6).all())
    assert torch.equal(reward(images, PROMPTS), scores)  # metadata is optional
    assert reward.to("cpu") is reward


@pytest.mark.parametrize("name", CLIP_NAMES)
def test_batching_equals_one_by_one(rewards, options, name):
    images = rand_images(B=5, seed=3)
    prompts = [*PROMPTS, "a blue triangle"]
    one_by_one = make_reward(name, batch_size=1, **options[name])(images, prompts)
    batched = make_reward(name, batch_size=4, **options[name])(images, prompts)  # 4 + 1
    torch.testing.assert_close(batched, one_by_one, atol=1e-5, rtol=0)
    singles = torch.cat([rewards[name](images[i : i + 1], prompts[i : i + 1]) for i in range(5)])
    torch.testing.assert_close(rewards[name](images, prompts), singles, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", CLIP_NAMES)
def test_other_dtypes_agree(rewards, options, name):
    images = rand_images()
    reference = rewards[name](images, PROMPTS)
    double = make_reward(name, dtype=torch.float64, **options[name])(images, PROMPTS)
    assert double.dtype == torch.float32
    torch.testing.assert_close(double, reference, atol=1e-5, rtol=1e-5)
    bf16 = make_reward(name, dtype="bfloat16", **options[name])(images, PROMPTS)
    assert bf16.dtype == torch.float32
    torch.testing.assert_close(bf16, reference, atol=0.02, rtol=0.02)


def test_several_rewards_in_one_matrix(rewards):
    multi = MultiReward([rewards[name] for name in CLIP_NAMES])
    scores = multi(rand_images(), PROMPTS)
    assert scores.names == CLIP_NAMES
    assert scores.values.shape == (4, 4)
    torch.testing.assert_close(scores.values[:, 1], rewards["clipscore"](rand_images(), PROMPTS))


@pytest.mark.parametrize("name", CLIP_NAMES)
def test_bad_batches_are_refused(rewards, name):
    with pytest.raises(ValueError, match="prompts must be a list of 4 strings"):
        rewards[name](rand_images(), PROMPTS[:3])
    with pytest.raises(ValueError, match=r"values in \[0, 1\]"):
        rewards[name](rand_images() * 2, PROMPTS)


# The formulas, by hand ---------------------------------------------------------------------------


def hand_clip(model, tokenizer, pixels, prompts):
    """transformers' own CLIP forward (``logits_per_image = exp(logit_scale) * cos``), with tokens
    padded to the full context, as DiffusionNFT's CLIPScore does."""
    tokens = tokenizer(
        prompts, padding="max_length", max_length=CONTEXT, truncation=True, return_tensors="pt"
    )
    with torch.no_grad():
        out = model(pixel_values=pixels, **tokens)
    return out.logits_per_image.diagonal(), out.image_embeds


def test_pickscore_formula(rewards, clip_model, tokenizer):
    images = rand_images()
    pixels = ImageTransform(SIZE)(images)
    logits, _ = hand_clip(clip_model, tokenizer, pixels, PROMPTS)
    torch.testing.assert_close(rewards["pickscore"](images, PROMPTS), logits / 26, atol=1e-5, rtol=1e-5)
    assert isinstance(rewards["pickscore"], PickScore)


def test_clipscore_formula(rewards, clip_model, tokenizer):
    images = rand_images()
    pixels = ImageTransform(SIZE, interpolation="bilinear")(images)
    logits, _ = hand_clip(clip_model, tokenizer, pixels, PROMPTS)
    cosine = logits / math.exp(LOGIT_SCALE)
    torch.testing.assert_close(rewards["clipscore"](images, PROMPTS), cosine, atol=1e-5, rtol=1e-5)
    assert isinstance(rewards["clipscore"], ClipScore)


def test_aesthetic_formula(rewards, clip_model, tokenizer, predictor_file):
    images = rand_images()
    _, u = hand_clip(clip_model, tokenizer, ImageTransform(SIZE)(images), PROMPTS)
    state = torch.load(predictor_file, weights_only=True)
    x = u
    for i in (0, 2, 4, 6, 7):  # linear layers only: dropout is off in evaluation
        x = x @ state[f"layers.{i}.weight"].T + state[f"layers.{i}.bias"]
    torch.testing.assert_close(rewards["aesthetic"](images, PROMPTS), x[:, 0], atol=1e-5, rtol=1e-5)
    # the prompts are not used
    torch.testing.assert_close(rewards["aesthetic"](images, ["z"] * 4), x[:, 0], atol=1e-5, rtol=1e-5)


def layer_norm(x, state, name):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], state[name + ".weight"], state[name + ".bias"])


def open_clip_block(x, state, prefix, causal):
    """One open_clip ResidualAttentionBlock: packed-qkv attention and a GELU MLP, pre-norm."""
    B, L, W = x.shape
    h = layer_norm(x, state, prefix + "ln_1")
    q, k, v = (h @ state[prefix + "attn.in_proj_weight"].T + state[prefix + "attn.in_proj_bias"]).chunk(3, -1)
    q, k, v = (t.reshape(B, L, HEADS, W // HEADS).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(W // HEADS)
    if causal:
        scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), -math.inf)
    attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, L, W)
    x = x + attended @ state[prefix + "attn.out_proj.weight"].T + state[prefix + "attn.out_proj.bias"]
    h = layer_norm(x, state, prefix + "ln_2")
    h = torch.nn.functional.gelu(h @ state[prefix + "mlp.c_fc.weight"].T + state[prefix + "mlp.c_fc.bias"])
    return x + h @ state[prefix + "mlp.c_proj.weight"].T + state[prefix + "mlp.c_proj.bias"]


def open_clip_features(state, pixels, input_ids):
    """open_clip's ``encode_image`` and ``encode_text``, written from the state dict alone."""
    x = (
        torch.nn.functional.conv2d(pixels, state["visual.conv1.weight"], stride=PATCH)
        .flatten(2)
        .transpose(1, 2)
    )
    cls = state["visual.class_embedding"].expand(x.shape[0], 1, WIDTH)
    x = layer_norm(torch.cat([cls, x], 1) + state["visual.positional_embedding"], state, "visual.ln_pre")
    for i in range(LAYERS):
        x = open_clip_block(x, state, f"visual.transformer.resblocks.{i}.", causal=False)
    image = layer_norm(x[:, 0], state, "visual.ln_post") @ state["visual.proj"]
    x = state["token_embedding.weight"][input_ids] + state["positional_embedding"]
    for i in range(LAYERS):
        x = open_clip_block(x, state, f"transformer.resblocks.{i}.", causal=True)
    x = layer_norm(x, state, "ln_final")
    text = x[torch.arange(len(x)), input_ids.argmax(-1)] @ state["text_projection"]  # the end token
    return image, text


def test_hps_formula_against_open_clip(rewards, open_clip_state, tokenizer):
    images = rand_images()  # 40 x 48: resized to 27 x 32, padded with black rows
    pixels = ImageTransform(SIZE, fit="pad")(images)
    ids = tokenizer(PROMPTS, padding="max_length", max_length=CONTEXT, truncation=True, return_tensors="pt")
    image, text = open_clip_features(open_clip_state, pixels, ids["input_ids"])
    cosine = torch.nn.functional.cosine_similarity(image, text, dim=-1)
    torch.testing.assert_close(rewards["hpsv21"](images, PROMPTS), cosine, atol=1e-5, rtol=1e-5)
    model = rewards["hpsv21"].encoder.model
    assert model.logit_scale.item() == pytest.approx(math.log(100.0))


def test_hps_checkpoint_forms(rewards, open_clip_state, hps_file, clip_dir, tmp_path):
    images = rand_images()
    expected = rewards["hpsv21"](images, PROMPTS)
    save_file(
        {f"module.{k}": v.contiguous() for k, v in open_clip_state.items()}, tmp_path / "hps.safetensors"
    )
    for model in (tmp_path / "hps.safetensors", hps_file.parent, str(hps_file)):
        torch.testing.assert_close(HPSv21(model, base=clip_dir)(images, PROMPTS), expected, atol=0, rtol=0)


def test_convert_open_clip_names_every_key(open_clip_state, clip_model):
    converted = convert_open_clip(open_clip_state)
    assert set(converted) == set(clip_model.state_dict())
    torch.testing.assert_close(converted["visual_projection.weight"], open_clip_state["visual.proj"].T)
    q, k, v = (converted[f"text_model.encoder.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    torch.testing.assert_close(
        torch.cat([q, k, v]), open_clip_state["transformer.resblocks.1.attn.in_proj_weight"]
    )
    with pytest.raises(ValueError, match=r"unexpected keys \['visual.attn_pool.weight'\]"):
        convert_open_clip({**open_clip_state, "visual.attn_pool.weight": torch.zeros(1)})


# Preprocessing -----------------------------------------------------------------------------------


def test_transform_matches_the_clip_processor(clip_dir):
    """Against transformers' (PIL) CLIP processor on 8-bit images: resize the shorter side, centre crop."""
    processor = transformers.CLIPImageProcessor.from_pretrained(clip_dir)
    config, _ = transformers.CLIPImageProcessor.get_image_processor_dict(clip_dir)
    transform = ImageTransform.from_processor(config)
    assert (transform.size, transform.resize) == (SIZE, SIZE)
    for height, width in ((72, 96), (96, 64), (16, 24)):  # down, down, up
        images = (rand_images(2, height, width, seed=height) * 255).round() / 255
        pixels = [(image.permute(1, 2, 0) * 255).to(torch.uint8).numpy() for image in images]
        expected = processor(images=pixels, return_tensors="pt")["pixel_values"]
        got = transform(images)
        assert got.shape == expected.shape == (2, 3, SIZE, SIZE)
        assert (got - expected).abs().mean() < 0.01  # PIL rounds to 8 bits after resizing


def test_transform_pads_to_a_square():
    transform = ImageTransform(SIZE, fit="pad")
    out = transform(torch.ones(1, 3, 16, 32))  # longer side 32: no resize, 8 black rows above and below
    black = (-torch.tensor(transform.mean) / torch.tensor(transform.std))[:, None, None]
    white = ((1 - torch.tensor(transform.mean)) / torch.tensor(transform.std))[:, None, None]
    assert out.shape == (1, 3, SIZE, SIZE)
    torch.testing.assert_close(out[0, :, :8], black.expand(3, 8, SIZE))
    torch.testing.assert_close(out[0, :, 8:24], white.expand(3, 16, SIZE))
    torch.testing.assert_close(out[0, :, 24:], black.expand(3, 8, SIZE))
    assert transform(torch.rand(2, 3, 64, 40)).shape == (2, 3, SIZE, SIZE)


def test_transform_rejects_bad_sizes():
    with pytest.raises(ValueError, match="size <= resize"):
        ImageTransform(32, resize=16)
    with pytest.raises(ValueError, match="square crop_size"):
        ImageTransform.from_processor(
            {"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 16}}
        )
    with pytest.raises(ValueError, match="interpolation must be 'bicubic' or 'bilinear'"):
        ImageTransform(32, interpolation="nearest")
    assert ImageTransform.from_processor({"size": 224, "crop_size": 224}).size == 224  # old configs


# Errors ------------------------------------------------------------------------------------------


def test_missing_paths_name_the_path(tmp_path, clip_dir):
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match=r"PickScore model .*missing.* does not exist"):
        PickScore(missing, processor=clip_dir)
    with pytest.raises(FileNotFoundError, match=r"processor .*missing.* does not exist"):
        PickScore(clip_dir, processor=str(missing))
    with pytest.raises(FileNotFoundError, match=r"aesthetic predictor weights .*missing.*improved-aesthetic"):
        make_reward("aesthetic", predictor=missing, model=clip_dir)
    with pytest.raises(FileNotFoundError, match=r"HPS checkpoint .*missing.*hf download xswu/HPSv2"):
        HPSv21(missing, base=clip_dir)
    with pytest.raises(FileNotFoundError, match=rf"HPS checkpoint .*{HPS_FILE}.* not found"):
        HPSv21(tmp_path, base=clip_dir)  # a directory without the checkpoint
    with pytest.raises(OSError, match=r"could not load CLIPScore model from .*"):
        ClipScore(tmp_path)  # an empty directory
    with pytest.raises(FileNotFoundError, match="nor is it a hub id"):
        ClipScore("not a model")


def test_hub_ids_offline_name_the_id(clip_dir, predictor_file):
    offline = {"local_files_only": True}
    with pytest.raises(
        OSError,
        match=r"PickScore model 'mogo-test/no-such-model' from the local hub cache.*"
        r"hf download mogo-test/no-such-model",
    ):
        PickScore("mogo-test/no-such-model", processor=clip_dir, **offline)
    with pytest.raises(OSError, match=r"'mogo-test/no-clip' from the local hub cache.*--include"):
        PickScore(clip_dir, processor="mogo-test/no-clip", **offline)
    with pytest.raises(
        OSError, match=r"aesthetic CLIP model 'mogo-test/no-clip' .*hf download mogo-test/no-clip"
    ):
        make_reward("aesthetic", predictor=predictor_file, model="mogo-test/no-clip", **offline)
    with pytest.raises(
        OSError, match=rf"HPS checkpoint {re.escape(HPS_FILE)} of 'mogo-test/no-hps' .*local hub"
    ):
        HPSv21("mogo-test/no-hps", base=clip_dir, **offline)


def test_bad_checkpoints_name_the_file(tmp_path, clip_dir, open_clip_state):
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"could not read the state dict .*garbage\.pth"):
        make_reward("aesthetic", predictor=garbage, model=clip_dir)
    with pytest.raises(ValueError, match=r"could not read the state dict .*garbage\.pth"):
        HPSv21(garbage, base=clip_dir)
    garbage = garbage.rename(tmp_path / "garbage.safetensors")
    with pytest.raises(ValueError, match=r"could not read the state dict .*garbage\.safetensors"):
        HPSv21(garbage, base=clip_dir)
    wide = tmp_path / "wide.pth"
    torch.save(AestheticPredictor(DIM + 1).state_dict(), wide)
    with pytest.raises(ValueError, match=r"takes 17-d embeddings; the CLIP model .* gives 16-d"):
        make_reward("aesthetic", predictor=wide, model=clip_dir)
    torch.save({"layers.0.weight": torch.zeros(4, DIM)}, wide)
    with pytest.raises(ValueError, match=r"wide\.pth.* does not match the aesthetic predictor"):
        AestheticPredictor.from_file(wide)
    odd = tmp_path / "odd.pt"
    torch.save({**open_clip_state, "visual.proj": torch.zeros(WIDTH, DIM + 1)}, odd)
    with pytest.raises(ValueError, match=r"odd\.pt.* does not match the CLIP architecture"):
        HPSv21(odd, base=clip_dir)
    torch.save({"state_dict": {"something.else": torch.zeros(1)}}, odd)
    with pytest.raises(ValueError, match=r"odd\.pt.*unexpected keys \['something.else'\]"):
        HPSv21(odd, base=clip_dir)


def test_bad_options(clip_dir):
    with pytest.raises(ValueError, match="dtype must be a floating torch dtype"):
        ClipScore(clip_dir, dtype="int8")
    with pytest.raises(ValueError, match="dtype must be a floating torch dtype"):
        ClipScore(clip_dir, dtype="float31")
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        ClipScore(clip_dir, batch_size=0)


# The docs ----------------------------------------------------------------------------------------


def test_the_documented_config_is_valid():
    text = (ROOT / "docs" / "rewards.rst").read_text()
    blocks = re.findall(r"\.\. code-block:: yaml\n\n((?:    .*\n|\n)+)", text)
    assert blocks
    for block in blocks:
        config = Config.from_dict(yaml.safe_load(block))
        check_config(config)  # reward names and options
        assert config.rewards


@pytest.mark.parametrize("name", CLIP_NAMES)
def test_an_empty_batch_scores_empty(rewards, name):
    """D18: clipscore (and every encoder reward) failed on an empty batch in torch.cat()."""
    scores = rewards[name](rand_images(B=0), [])
    assert scores.shape == (0,)
    assert scores.dtype == torch.float32
