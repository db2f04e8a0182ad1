"""Rewards: the protocol, a registry, rule-based rewards and :class:`MultiReward`.

Registered names: ``jpeg_compressibility``, ``sharpness``, ``color_match`` (rule-based),
``pickscore``, ``clipscore``, ``aesthetic`` (:mod:`~mogo_diffusion.rewards.clip`), ``hpsv21``
(:mod:`~mogo_diffusion.rewards.hps`), ``imagereward`` (:mod:`~mogo_diffusion.rewards.imagereward`),
``ocr`` (:mod:`~mogo_diffusion.rewards.ocr`), ``geneval`` (:mod:`~mogo_diffusion.rewards.geneval`),
and the shapes world's ``shapes_color``, ``shapes_shape``, ``shapes_position``, ``shapes_count``
(:mod:`~mogo_diffusion.rewards.shapes`).
"""

from mogo_diffusion.rewards import clip, geneval, hps, imagereward, ocr, shapes  # noqa: F401  (they register)
from mogo_diffusion.rewards.base import (
    Reward,
    check_batch,
    check_batch_size,
    check_scores,
    floating_dtype,
    to_uint8,
)
from mogo_diffusion.rewards.multi import MultiReward, RewardScores
from mogo_diffusion.rewards.registry import available_rewards, make_reward, register_reward, reward_factory
from mogo_diffusion.rewards.rules import PALETTE, ColorMatch, JpegCompressibility, Sharpness

__all__ = [
    "PALETTE",
    "ColorMatch",
    "JpegCompressibility",
    "MultiReward",
    "Reward",
    "RewardScores",
    "Sharpness",
    "available_rewards",
    "check_batch",
    "check_batch_size",
    "check_scores",
    "floating_dtype",
    "make_reward",
    "register_reward",
    "reward_factory",
    "to_uint8",
]
