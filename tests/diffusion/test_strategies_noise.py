"""The noise-aware arms in the trainer: the cross-fitted halves of a micro-batch, gradient tracking,
weight smoothing and the gated projection, reached from the config, and their metrics."""

from __future__ import annotations

import pytest
import torch

from mogo_diffusion import compare
from mogo_diffusion.config import Config, ConfigError
from mogo_diffusion.nft import kl_loss, nft_loss
from mogo_diffusion.strategies import make_strategy
from mogo_diffusion.train import MicroBatch, Trainer
from tests.diffusion.strategy_runs import with_strategy
from tests.diffusion.test_train import flat, forward, grads_of, one_step

EPS32 = torch.finfo(torch.float32).eps


def test_a_cross_fitted_micro_batch_gives_its_halves_losses_and_the_batchs_update(tiny_dir, tmp_path):
    cross = {"name": "marble", "harmonize_every": 1, "alpha_ema": 0.0, "gram": "cross_fitted"}
    trainer = Trainer.from_config(with_strategy(tiny_dir, tmp_path, **cross))
    batch, advantages, index, timesteps, noise = one_step(trainer, steps=1)  # three rows: 1 + 2
    adv = advantages[index]
    losses, _ = trainer.losses(batch, index, adv, timesteps[0], noise[0])
    assert losses.shape == (2, 3)
    v, v_old, v_ref, x_t, x0, t = forward(trainer, batch, index, timesteps[0], noise[0])
    expected = torch.stack(
        [
            torch.stack([nft_loss(v[h], v_old[h], x_t[h], x0[h], t, adv[h, k], beta=0.1) for k in range(3)])
            for h in (slice(0, 1), slice(1, 3))
        ]
    )
    torch.testing.assert_close(losses, expected, rtol=16 * EPS32, atol=0)
    trainer.gradients(batch, [MicroBatch(index, adv, timesteps, noise)])
    report = trainer.optimizer.last_report
    assert report.cross_batch_weighted_sum_cosines is not None  # measured across the halves
    # the update: the weights applied to the gradients of the halves' mean losses, plus the KL term
    weights = report.loss_weights.float()
    update = grads_of(weights @ expected.mean(0) + kl_loss(v, v_ref, kl_coef=1e-4), trainer.params)
    tolerance = 64 * EPS32 * float(update.abs().max())
    torch.testing.assert_close(flat(p.grad for p in trainer.params), update, rtol=0, atol=tolerance)
    trainer.update()
    metrics = trainer.strategy.metrics()
    for key in ("conflict_rate_cross", "worst_cosine_weighted_sum_cross", "worst_cosine_marble_cross"):
        assert key in metrics
    assert metrics["conflict_rate_cross"] == float(report.cross_batch_conflict)
    assert metrics["worst_cosine_weighted_sum_cross"] == pytest.approx(
        float(report.cross_batch_weighted_sum_cosines.min()), abs=1e-12
    )


def test_the_noise_options_reach_the_optimizer(tiny_dir, tmp_path):
    options = {"gram": "cross_fitted", "grad_ema": 0.5, "smooth_harmonized": True}
    optimizer = Trainer.from_config(with_strategy(tiny_dir, tmp_path, name="upgrad", **options)).optimizer
    assert (optimizer.gram, optimizer.tracker.decay, optimizer.amortizer.smooth_harmonized) == (
        "cross_fitted",
        0.5,
        True,
    )
    plain = Trainer.from_config(with_strategy(tiny_dir, tmp_path / "b", name="marble")).optimizer
    assert (plain.gram, plain.tracker.decay, plain.amortizer.smooth_harmonized) == ("same_batch", 0.0, False)
    assert (
        "conflict_rate_cross"
        not in Trainer.from_config(with_strategy(tiny_dir, tmp_path / "c", name="marble")).strategy.metrics()
    )


def test_the_gated_projection_starts_from_the_rewards_weights_unless_its_options_set_them(tiny_dir, tmp_path):
    gated = Trainer.from_config(
        with_strategy(tiny_dir, tmp_path, (1.0, 2.0, 1.0), name="gated_projection")
    ).optimizer
    assert gated.weighting.prior.weights.tolist() == [1.0, 2.0, 1.0]
    assert gated.sum_weights.tolist() == [1.0, 2.0, 1.0]  # the diagnostics' baseline too
    options = {"weights": [1.0, 0.0, 0.0], "margin": 3.0}
    chosen = Trainer.from_config(
        with_strategy(tiny_dir, tmp_path / "b", name="gated_projection", options=options)
    )
    assert chosen.optimizer.weighting.prior.weights.tolist() == [1.0, 0.0, 0.0]
    assert chosen.optimizer.weighting.margin == 3.0


def test_halves_need_two_rows_in_every_micro_batch(tiny_dir, tmp_path):
    data = with_strategy(tiny_dir, tmp_path, name="marble", gram="cross_fitted").to_dict()
    data["train"]["batch_size"] = 3  # 4 images a process: micro-batches of 3 and 1
    with pytest.raises(ConfigError, match=r"strategy\.gram: 'cross_fitted' splits .* one has 1 row"):
        make_strategy(Config.from_dict(data))
    data["train"]["batch_size"] = 2
    make_strategy(Config.from_dict(data))


NEW_ARMS = [
    "normalize_then_sum",
    "normalize_then_sum_rescaled",
    "famo",
    "marble_released",
    "marble_released_equal_alpha",
    "marble_n10_cross",
    "marble_n1_moco",
    "marble_n1_smooth",
    "gated_n1_cross",
    "sdmgrad_n1_cross",
]


def test_every_new_arm_is_a_valid_strategy_of_the_shapes_world(tmp_path):
    for arm in NEW_ARMS:
        config = compare.arm_config(arm, 0, tmp_path / arm)
        strategy = make_strategy(config)
        data = config.to_dict()["strategy"]
        assert {key: data[key] for key in compare.ARMS[arm]["strategy"]} == compare.ARMS[arm]["strategy"]
        assert type(strategy).__name__ in {
            "NormalizeThenSum",
            "Famo",
            "MarbleReleased",
            "Marble",
            "Harmonized",
        }
