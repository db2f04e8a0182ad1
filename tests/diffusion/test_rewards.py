"""Rewards: the registry, the rule-based rewards, and MultiReward."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from mogo_diffusion.rewards import (
    ColorMatch,
    JpegCompressibility,
    MultiReward,
    Reward,
    Sharpness,
    available_rewards,
    check_batch,
    make_reward,
    register_reward,
    registry,
)

RULES = ("jpeg_compressibility", "sharpness", "color_match")
PROMPTS = ["a red square", "a blue circle", "a shape", "GREEN triangle"]


def batch(B=4, size=16, seed=0):
    images = torch.rand(B, 3, size, size, generator=torch.Generator().manual_seed(seed))
    return images, PROMPTS[:B], [{} for _ in range(B)]


def flat(B=1, size=16, value=0.5):
    return torch.full((B, 3, size, size), value)


@pytest.fixture
def scratch_registry(monkeypatch):
    monkeypatch.setattr(registry, "REWARDS", registry.REWARDS.copy())


def test_registry_knows_the_rules():
    assert set(RULES) <= set(available_rewards())
    for name in RULES:
        reward = make_reward(name)
        assert isinstance(reward, Reward)
        assert reward.name == name
    assert make_reward("jpeg_compressibility", quality=80).quality == 80


def test_unknown_reward_lists_the_known_names():
    with pytest.raises(
        ValueError, match=r"unknown reward 'jpeg_compresibility' \(did you mean 'jpeg_compressibility'\?\)"
    ):
        make_reward("jpeg_compresibility")
    with pytest.raises(ValueError, match=r"Known rewards: .*color_match.*sharpness") as info:
        make_reward("zzz")
    assert "did you mean" not in str(info.value)


def test_register_reward(scratch_registry):
    @register_reward("constant")
    class Constant:
        name = "constant"

        def __init__(self, value: float = 1.0) -> None:
            self.value = value

        def __call__(self, images, prompts, metadata):
            return torch.full((images.shape[0],), self.value)

    assert "constant" in available_rewards()
    assert make_reward("constant", value=2.0)(*batch(2)).tolist() == [2.0, 2.0]
    with pytest.raises(ValueError, match="'constant' is already registered"):
        register_reward("constant")(Constant)
    with pytest.raises(ValueError, match="non-empty string"):
        register_reward("")


@pytest.mark.parametrize("name", RULES)
def test_shapes_ranges_determinism_and_batching(name):
    reward = make_reward(name)
    images, prompts, metadata = batch()
    scores = reward(images, prompts, metadata)
    assert scores.shape == (4,)
    assert scores.dtype == torch.float32
    torch.testing.assert_close(
        scores, reward(images.clone(), prompts, metadata), rtol=0, atol=0, equal_nan=True
    )
    one_by_one = torch.cat(
        [reward(images[i : i + 1], prompts[i : i + 1], metadata[i : i + 1]) for i in range(4)]
    )
    torch.testing.assert_close(scores, one_by_one, rtol=0, atol=0, equal_nan=True)
    known = scores[~torch.isnan(scores)]
    low, high = {
        "jpeg_compressibility": (-math.inf, 0.0),
        "sharpness": (0.0, 2.0),
        "color_match": (0.0, 1.0),
    }[name]
    assert bool(((known >= low) & (known <= high)).all())


def test_jpeg_ranks_flat_above_smooth_above_noise():
    reward = JpegCompressibility()
    ramp = torch.linspace(0, 1, 32).expand(1, 3, 32, 32).clone()
    noise = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    images = torch.cat([flat(size=32), ramp, noise])
    flat_score, ramp_score, noise_score = reward(images, ["x"] * 3, [{}] * 3).tolist()
    assert flat_score > ramp_score > noise_score
    assert -2.0 < flat_score < 0.0  # a flat 32 x 32 image is well under 2 kB
    assert reward(noise, ["x"], [{}]).item() < JpegCompressibility(quality=50)(noise, ["x"], [{}]).item()
    with pytest.raises(ValueError, match="quality must be an integer in"):
        JpegCompressibility(quality=0)


def test_sharpness_values():
    reward = Sharpness()
    checker = ((torch.arange(8)[:, None] + torch.arange(8)[None, :]) % 2).float().expand(1, 3, 8, 8)
    smooth = torch.linspace(0, 1, 8).expand(1, 3, 8, 8)
    scores = reward(torch.cat([flat(size=8), checker, smooth]), ["x"] * 3, [{}] * 3)
    assert scores[0].item() == 0.0
    assert scores[1].item() == pytest.approx(2.0)
    assert scores[2].item() == pytest.approx((1 / 7) ** 2, rel=1e-6)  # dx = 1/7 everywhere, dy = 0
    with pytest.raises(ValueError, match="at least 2 x 2"):
        reward(torch.zeros(1, 3, 1, 8), ["x"], [{}])


def test_color_match():
    reward = ColorMatch()
    red, blue = torch.zeros(1, 3, 4, 4), torch.zeros(1, 3, 4, 4)
    red[:, 0], blue[:, 2] = 1.0, 1.0
    images = torch.cat([red, red, blue, red, red, blue])
    prompts = ["a red square", "a RED square", "a red square", "a reddish square", "a square", "a square"]
    metadata = [{}, {}, {}, {}, {"color": "red"}, {"color": [0.0, 0.0, 1.0]}]
    scores = reward(images, prompts, metadata).tolist()
    assert scores[0] == pytest.approx(1.0)
    assert scores[1] == pytest.approx(1.0)
    assert scores[2] == pytest.approx(1 - math.sqrt(2) / math.sqrt(3))
    assert math.isnan(scores[3])  # whole words only
    assert scores[4] == pytest.approx(1.0)
    assert scores[5] == pytest.approx(1.0)
    assert reward(red, ["blue or red"], [{}]).item() == pytest.approx(
        1 - math.sqrt(2) / math.sqrt(3)
    )  # first word
    assert ColorMatch(palette={"teal": (0, 0.5, 0.5)})(red, ["teal"], [{}]).item() < 0.5
    with pytest.raises(ValueError, match="metadata color 'mauve' is not in the palette"):
        reward(red, ["x"], [{"color": "mauve"}])
    with pytest.raises(ValueError, match=r"palette\['bad'\] must be an RGB triple"):
        ColorMatch(palette={"bad": (2.0, 0, 0)})


def test_bad_batches():
    images, prompts, metadata = batch(2)
    with pytest.raises(ValueError, match=r"images must be a \[B, 3, H, W\] tensor"):
        check_batch(images[:, :1], prompts, metadata)
    with pytest.raises(ValueError, match="images must be floating"):
        check_batch((images * 255).to(torch.uint8), prompts, metadata)
    with pytest.raises(ValueError, match=r"values in \[0, 1\], got"):
        check_batch(images * 2, prompts, metadata)
    with pytest.raises(ValueError, match="prompts must be a list of 2 strings, got 1 prompts"):
        check_batch(images, prompts[:1], metadata)
    with pytest.raises(ValueError, match="got a str"):
        check_batch(images, "ab", metadata)
    with pytest.raises(ValueError, match="metadata must have 2 entries"):
        check_batch(images, prompts, [{}])


class Slow:
    """A reward that sleeps, then returns the image means (for ordering and timing tests)."""

    def __init__(self, name, seconds=0.0, scale=1.0, barrier=None):
        self.name, self.seconds, self.scale, self.barrier = name, seconds, scale, barrier
        self.device = None

    def __call__(self, images, prompts, metadata):
        if self.barrier is not None:
            self.barrier.wait()
        time.sleep(self.seconds)
        return self.scale * images.mean(dim=(1, 2, 3))

    def to(self, device):
        self.device = device
        return self


def test_multi_reward_order_and_timing():
    images, prompts, metadata = batch()
    rewards = [make_reward(name) for name in RULES] + [Slow("slow", seconds=0.05)]
    scores = MultiReward(rewards)(images, prompts, metadata)
    assert scores.names == (*RULES, "slow")
    assert scores.values.shape == (4, 4)
    assert scores.values.dtype == torch.float32
    for k, reward in enumerate(rewards):
        torch.testing.assert_close(scores.values[:, k], reward(images, prompts, metadata), equal_nan=True)
    assert len(scores.seconds) == 4
    assert all(s >= 0 for s in scores.seconds)
    assert scores.seconds[3] >= 0.05
    assert torch.isnan(MultiReward(rewards[2:3])(images, prompts).values[2, 0])  # default metadata


def test_thread_pool_runs_rewards_together_with_identical_results():
    images, prompts, metadata = batch()
    rules = [make_reward(name) for name in RULES]
    sequential = MultiReward(rules)(images, prompts, metadata)
    pooled = MultiReward(rules, threads=3)(images, prompts, metadata)
    torch.testing.assert_close(pooled.values, sequential.values, rtol=0, atol=0, equal_nan=True)
    assert pooled.names == sequential.names
    # Each reward waits for the other: only concurrent scoring gets past the barrier.
    barrier = threading.Barrier(2, timeout=10)
    together = MultiReward([Slow("a", barrier=barrier), Slow("b", scale=2.0, barrier=barrier)], threads=2)
    values = together(images, prompts, metadata).values
    torch.testing.assert_close(values[:, 1], 2 * values[:, 0])


def test_multi_reward_errors_and_to():
    images, prompts, metadata = batch(2)
    with pytest.raises(ValueError, match="distinct"):
        MultiReward([Slow("a"), Slow("a")])
    with pytest.raises(ValueError, match="at least one reward"):
        MultiReward([])
    with pytest.raises(TypeError, match=r"rewards\[1\] is not a Reward"):
        MultiReward([Slow("a"), lambda images, prompts, metadata: images])
    with pytest.raises(ValueError, match="threads must be a positive integer"):
        MultiReward([Slow("a")], threads=0)

    class Bad(Slow):
        def __call__(self, images, prompts, metadata):
            return self.scale * torch.ones(images.shape[0], 1)

    with pytest.raises(ValueError, match=r"reward 'bad' must return a floating \[2\] tensor"):
        MultiReward([Bad("bad")])(images, prompts, metadata)
    with pytest.raises(ValueError, match="reward 'inf' returned infinite scores"):
        MultiReward([Slow("inf", scale=math.inf)])(images, prompts, metadata)
    slow = Slow("a")
    multi = MultiReward([slow, make_reward("sharpness")])
    assert multi.to("cpu") is multi
    assert slow.device == "cpu"


EMPTY = torch.zeros(0, 3, 16, 16)


@pytest.mark.parametrize("name", RULES)
def test_an_empty_batch_scores_empty_and_a_zero_size_image_is_refused(name):
    """D18: color_match raised IndexError on an empty batch, and scored a 0 x 0 image NaN."""
    scores = make_reward(name)(EMPTY, [], [])
    assert scores.shape == (0,)
    assert scores.dtype == torch.float32
    for shape in ((1, 3, 0, 0), (2, 3, 0, 5), (0, 3, 4, 0)):
        with pytest.raises(ValueError, match=r"images must have at least 1 x 1 pixels, got \("):
            make_reward(name)(torch.zeros(shape), [""] * shape[0], [{}] * shape[0])
    assert MultiReward([make_reward(n) for n in RULES])(EMPTY, []).values.shape == (0, len(RULES))


def test_every_registered_reward_is_tested_on_an_empty_batch():
    from tests.diffusion import test_imagereward, test_ocr_geneval, test_reward_models, test_shapes_rewards

    tested = {
        *RULES,
        *test_reward_models.CLIP_NAMES,
        *test_shapes_rewards.NAMES,
        *test_ocr_geneval.EMPTY_TESTED,
        *test_imagereward.EMPTY_TESTED,
    }
    assert tested == set(available_rewards())
