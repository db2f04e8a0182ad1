"""The noise measurement: its statistics recover a known signal share and a planted conflict on
synthetic gradients, its half-gradients are the halves' NFT gradients, and the command writes
its table."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mogo.testing import STUDY_BATCH, noise_study, planted_conflict
from mogo_diffusion.config import Config
from mogo_diffusion.nft import nft_loss
from mogo_diffusion.noise import NoiseMeter, batch_halves, main
from mogo_diffusion.shapes.recipe import REWARDS
from mogo_diffusion.train import Trainer
from tests.diffusion.test_train import config, flat, forward


def test_the_noise_shares_recover_the_planted_signal_fraction():
    problem = noise_study()  # 5 % of a batch's squared norm is signal, batches of STUDY_BATCH
    rng = np.random.default_rng(0)
    meter = NoiseMeter(["a", "b", "c"])
    for _ in range(64):
        meter.add(*problem.halves(rng, STUDY_BATCH))
    summary = meter.summary()
    for values in summary["rewards"].values():
        # 64 batches in 1000 dimensions: each estimate's standard error is about 0.008 (the noise's
        # cross terms, ~38 ||mu||^2 / sqrt(1000) a batch, against ~20 ||mu||^2 of squared norm)
        assert values["noise_share_halves"] == pytest.approx(0.95, abs=0.03)
        assert values["noise_share_batches"] == pytest.approx(0.95, abs=0.03)
        assert values["cosine_between_batches"] == pytest.approx(0.05, abs=0.03)
        assert values["pairs"] == 63


@pytest.mark.parametrize("planted", [True, False])
def test_the_cross_batch_rate_sees_a_planted_conflict_that_one_batch_misses(planted):
    problem = planted_conflict(conflict=planted)
    rng = np.random.default_rng(1)
    meter = NoiseMeter(["a", "b", "c"], {"all": ["a", "b", "c"], "pair": ["a", "b"]})
    for _ in range(200):
        meter.add(*problem.halves(rng, STUDY_BATCH))
    rates = {name: summary["conflict_rate"] for name, summary in meter.summary()["sets"].items()}
    assert rates["all"]["same_batch"] < 0.05  # a batch's own noise hides it (docs: never in 2048)
    if planted:
        assert rates["all"]["cross_batch"] > 0.5  # docs: 72 % of batches
    else:
        assert rates["all"]["cross_batch"] < 0.3  # docs: 14 %, by chance
    assert rates["pair"]["cross_batch"] < 0.3  # the first two agree


def test_a_reward_that_applies_nowhere_is_left_out_of_the_cosines():
    rng = np.random.default_rng(2)
    meter = NoiseMeter(["a", "b"])
    for _ in range(3):
        first, second = rng.normal(size=(2, 50)), rng.normal(size=(2, 50))
        first[1] = second[1] = 0.0
        meter.add(first, second)
    summary = meter.summary()
    assert summary["rewards"]["b"] == {
        "pairs": 0, "cosine_between_batches": None, "cosine_spread": None, "noise_share_halves": None,
        "noise_share_batches": None,
    }  # fmt: skip
    assert summary["rewards"]["a"]["pairs"] == 2


def test_the_half_gradients_are_the_halves_nft_gradients(tiny_dir, tmp_path):
    data = config(tiny_dir, tmp_path).to_dict()
    data["strategy"] = {"name": "marble", "gram": "cross_fitted"}
    data["nft"]["kl_coef"] = 0.0
    trainer = Trainer.from_config(Config.from_dict(data))
    first, second = batch_halves(trainer, 7)
    # the same draws, computed here: the rows' order, the timesteps and the noise of stream "noise"
    batch = trainer.score(trainer.sample(7))
    advantages = trainer.advantages(batch, 7)
    generator = trainer.stream("noise", 7)
    index = torch.randperm(4, generator=generator)
    chosen = torch.randperm(3, generator=generator)[:2].sort().values.tolist()
    noise = torch.randn((2, *batch.latents.shape), generator=generator)
    expected = torch.zeros(2, 3, first.shape[1], dtype=torch.float64)
    for j, eps in zip(chosen, noise, strict=True):
        v, v_old, _, x_t, x0, t = forward(trainer, batch, index, j, eps[index])
        for h, rows in enumerate((slice(0, 2), slice(2, 4))):
            for k in range(3):
                loss = nft_loss(
                    v[rows], v_old[rows], x_t[rows], x0[rows], t, advantages[index][rows, k], beta=0.1
                )
                expected[h, k] += flat(torch.autograd.grad(loss, trainer.params, retain_graph=True)).double()
    for found, want in ((first, expected[0]), (second, expected[1])):
        scale = float(want.abs().max())
        np.testing.assert_allclose(
            found, want.numpy(), rtol=0, atol=64 * torch.finfo(torch.float32).eps * scale
        )


def test_the_command_writes_the_table_of_both_reward_sets(tmp_path):
    out = tmp_path / "noise"
    results = main(["--quick", "--batches", "2", "--out", str(out)])
    assert set(results["sets"]) == {"prompt_following", "with_quality"}
    assert list(results["rewards"]) == list(REWARDS)  # one pass measures every reward of the world
    assert json.loads(out.with_suffix(".json").read_text())["rewards"] == json.loads(
        json.dumps(results["rewards"])
    )
    table = out.with_suffix(".rst").read_text()
    assert table.count(".. list-table::") == 2
    assert all(name in table for name in (*REWARDS, "prompt_following", "with_quality"))
