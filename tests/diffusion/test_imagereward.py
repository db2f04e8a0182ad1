"""ImageReward on a tiny random BLIP: the published layout converted, against an independent forward."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional
from transformers import BertTokenizer, BlipTextConfig, BlipVisionConfig

from mogo_diffusion.rewards import make_reward
from mogo_diffusion.rewards.imagereward import (
    IMAGEREWARD_MEAN,
    IMAGEREWARD_STD,
    ImageReward,
    ImageRewardModel,
    convert_original,
)

WORDS = ["a", "red", "blue", "cat", "dog", "on", "the", "photo", "of"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *LETTERS, *("##" + c for c in LETTERS)]
HEADS = 4  # both towers; the published model has 16 (ViT) and 12 (BERT)
SIZE, PATCH = 32, 8
EMPTY_TESTED = {"imagereward"}  # the registered names whose empty batch is tested here
PROMPTS = ["a red cat", "a photo of the blue dog on a dog", "dog", "the cat"]

_VIT_NAMES = {  # ours -> the original BLIP code's, for building a state dict of the published layout
    "embeddings.class_embedding": "cls_token",
    "embeddings.position_embedding": "pos_embed",
    "embeddings.patch_embedding.weight": "patch_embed.proj.weight",
    "embeddings.patch_embedding.bias": "patch_embed.proj.bias",
    "post_layernorm.weight": "norm.weight",
    "post_layernorm.bias": "norm.bias",
}
_VIT_BLOCK_NAMES = {
    "layer_norm1": "norm1",
    "layer_norm2": "norm2",
    "self_attn.qkv": "attn.qkv",
    "self_attn.projection": "attn.proj",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}


def published_name(key: str) -> str:
    if key.startswith("head."):
        return "mlp." + key.removeprefix("head.")
    if key.startswith("text_encoder."):
        return "blip." + key
    key = key.removeprefix("vision_model.")
    if key in _VIT_NAMES:
        return "blip.visual_encoder." + _VIT_NAMES[key]
    _, _, layer, rest = key.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blip.visual_encoder.blocks.{layer}.{_VIT_BLOCK_NAMES[module]}.{kind}"


def published_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A random state dict with the key names and shapes of ``ImageReward.pt`` (tiny sizes), the
    unused projections and BERT's position ids included, as the published file holds them."""
    vision = BlipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                              num_attention_heads=HEADS, image_size=SIZE, patch_size=PATCH)  # fmt: skip
    text = BlipTextConfig(vocab_size=len(VOCAB), hidden_size=24, encoder_hidden_size=32, intermediate_size=40,
                          num_hidden_layers=2, num_attention_heads=HEADS, max_position_embeddings=40,
                          is_decoder=True, bos_token_id=None, sep_token_id=None)  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for key, value in ImageRewardModel(vision, text).state_dict().items():
        noise = torch.randn(value.shape, generator=generator)
        if "norm" in key.lower() and key.endswith("weight"):
            value = 1 + 0.2 * noise
        elif value.ndim == 1:
            value = 0.2 * noise
        else:
            value = noise / math.sqrt(value[0].numel())
        state[published_name(key)] = value
    state["blip.text_encoder.embeddings.position_ids"] = torch.arange(40)[None]
    state["blip.vision_proj.weight"], state["blip.vision_proj.bias"] = torch.zeros(8, 32), torch.zeros(8)
    state["blip.text_proj.weight"], state["blip.text_proj.bias"] = torch.zeros(8, 24), torch.zeros(8)
    return state


def tokenizer_dir(path):
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    BertTokenizer(str(path / "vocab.txt")).save_pretrained(path)
    return path


def tiny_imagereward(directory) -> ImageReward:
    """The published-layout tiny model written as ``ImageReward.pt``, loaded (converted) through the
    reward, and saved as a converted directory at ``directory``; returns the loaded reward."""
    original = directory.parent / f"{directory.name}-original"
    original.mkdir(parents=True)
    torch.save(published_state(), original / "ImageReward.pt")
    reward = ImageReward(
        original, tokenizer=tokenizer_dir(original / "bert"), vision_heads=HEADS, text_heads=HEADS
    )
    reward.save_pretrained(directory)
    return reward


# An independent forward of the original code (BLIP's ViT, BERT with cross-attention, the MLP), on
# the published names: what the conversion must reproduce.


def _heads(t: torch.Tensor) -> torch.Tensor:
    batch, length, width = t.shape
    return t.reshape(batch, length, HEADS, width // HEADS).transpose(1, 2)


def _attention(q, k, v, mask=None) -> torch.Tensor:
    """Multi-head attention of ``[B, L, D]`` queries over ``[B, M, D]`` keys and values."""
    batch, length, width = q.shape
    scores = _heads(q) @ _heads(k).transpose(-1, -2) / math.sqrt(width // HEADS)
    if mask is not None:
        scores = scores + (1.0 - mask[:, None, None, :]) * -10000.0  # BERT's extended mask
    return (scores.softmax(-1) @ _heads(v)).transpose(1, 2).reshape(batch, length, width)


def reference_scores(state, pixels, input_ids, mask) -> torch.Tensor:
    def linear(name, t):
        return functional.linear(t, state[name + ".weight"], state[name + ".bias"])

    def norm(name, t, eps):
        return functional.layer_norm(t, t.shape[-1:], state[name + ".weight"], state[name + ".bias"], eps)

    vit = "blip.visual_encoder."
    weight, bias = state[vit + "patch_embed.proj.weight"], state[vit + "patch_embed.proj.bias"]
    x = functional.conv2d(pixels, weight, bias, stride=PATCH).flatten(2).transpose(1, 2)
    x = torch.cat([state[vit + "cls_token"].expand(len(x), -1, -1), x], dim=1) + state[vit + "pos_embed"]
    for i in range(2):
        block = f"{vit}blocks.{i}."
        h = norm(block + "norm1", x, 1e-6)
        q, k, v = linear(block + "attn.qkv", h).chunk(3, dim=-1)
        x = x + linear(block + "attn.proj", _attention(q, k, v))
        h = norm(block + "norm2", x, 1e-6)
        x = x + linear(block + "mlp.fc2", functional.gelu(linear(block + "mlp.fc1", h)))
    image = norm(vit + "norm", x, 1e-6)
    bert = "blip.text_encoder."
    t = state[bert + "embeddings.word_embeddings.weight"][input_ids]
    t = t + state[bert + "embeddings.position_embeddings.weight"][: input_ids.shape[1]]
    t = norm(bert + "embeddings.LayerNorm", t, 1e-12)
    for i in range(2):
        layer = f"{bert}encoder.layer.{i}."
        for part, context, m in (("attention", None, mask.float()), ("crossattention", image, None)):
            s = f"{layer}{part}."
            keys = t if context is None else context
            out = _attention(
                linear(s + "self.query", t), linear(s + "self.key", keys), linear(s + "self.value", keys), m
            )
            t = norm(s + "output.LayerNorm", linear(s + "output.dense", out) + t, 1e-12)
        hidden = functional.gelu(linear(layer + "intermediate.dense", t))
        t = norm(layer + "output.LayerNorm", linear(layer + "output.dense", hidden) + t, 1e-12)
    r = t[:, 0]
    for i in (0, 2, 4, 6, 7):
        r = linear(f"mlp.layers.{i}", r)
    return (r.squeeze(-1) - IMAGEREWARD_MEAN) / IMAGEREWARD_STD


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("imagereward") / "converted"
    tiny_imagereward(directory)
    return directory


def images(n: int, seed: int = 0, size: int = SIZE) -> torch.Tensor:
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def test_the_converted_published_layout_scores_as_the_original_forward(converted):
    reward = make_reward("imagereward", model=str(converted))
    batch = images(4)
    scores = reward(batch, PROMPTS)
    state = published_state()
    tokenizer = BertTokenizer(vocab={word: i for i, word in enumerate(VOCAB)})
    tokens = tokenizer(PROMPTS, padding="max_length", max_length=35, truncation=True, return_tensors="pt")
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073])[:, None, None]
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711])[:, None, None]
    expected = reference_scores(state, (batch - mean) / std, tokens["input_ids"], tokens["attention_mask"])
    # float32 through two blocks per tower and a 1024-wide head: sums of at most ~1e3 terms of
    # size O(1) err by ~sqrt(1e3) * 2^-24 each; 1e-5 on O(1) scores leaves a wide margin
    assert scores.dtype == torch.float32
    assert scores.shape == (4,)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
    assert scores.std() > 1e-3  # not a constant


def test_scores_are_finite_deterministic_batched_and_follow_the_prompt(converted):
    reward = ImageReward(converted, batch_size=3)
    batch = images(5, seed=1, size=48)  # resized to 32 and centre-cropped
    scores = reward(batch, [*PROMPTS, "a dog"])
    assert scores.shape == (5,)
    assert bool(torch.isfinite(scores).all())
    assert torch.equal(reward(batch, [*PROMPTS, "a dog"]), scores)
    one_at_a_time = torch.cat([reward(batch[i : i + 1], [p]) for i, p in enumerate([*PROMPTS, "a dog"])])
    torch.testing.assert_close(one_at_a_time, scores, rtol=1e-5, atol=1e-5)  # padding is masked
    other = reward(batch, ["the blue dog"] * 5)
    assert bool((other != scores).all())
    assert reward(torch.zeros(0, 3, SIZE, SIZE), []).shape == (0,)


def test_loading_errors_name_the_problem(converted, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ImageReward(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match=r"ImageReward checkpoint .*ImageReward\.pt' not found"):
        ImageReward(tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    torch.save({**published_state(), "blip.itm_head.weight": torch.zeros(2, 2)}, bad / "ImageReward.pt")
    with pytest.raises(ValueError, match=r"ImageReward.pt'.*unexpected keys \['blip.itm_head.weight'\]"):
        ImageReward(bad, tokenizer=converted)
    with pytest.raises(ValueError, match="unexpected keys"):
        convert_original({"visual.proj": torch.zeros(1)})
    with pytest.raises(OSError, match="hf download THUDM/ImageReward"):
        ImageReward("THUDM/ImageReward", local_files_only=True)
