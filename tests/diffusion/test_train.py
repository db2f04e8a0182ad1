"""The training loop end to end on a tiny SD3 saved to disk: strategies, resume, LoRA, bad input."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from accelerate.tracking import get_available_trackers
from accelerate.utils import LoggerType
from diffusers import StableDiffusion3Pipeline
from hypothesis import given
from hypothesis import strategies as st

import mogo
from mogo_diffusion import compare, figures, models
from mogo_diffusion import train as train_module
from mogo_diffusion.advantages import per_reward_advantages, weighted_sum_advantages
from mogo_diffusion.attention import Float32Attention
from mogo_diffusion.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from mogo_diffusion.checks import check_config
from mogo_diffusion.config import Config, ConfigError, load_config
from mogo_diffusion.evaluate import read_metrics
from mogo_diffusion.nft import kl_loss, nft_loss
from mogo_diffusion.prompts import PromptSet, load_prompt_pool
from mogo_diffusion.rewards import MultiReward, make_reward
from mogo_diffusion.streams import stream_seed
from mogo_diffusion.train import DEFAULT_PROMPTS, Batch, MicroBatch, Trainer, main
from tests.diffusion import train_worker
from tests.diffusion.test_checkpoint import assert_same
from tests.launch import accelerate_launch, launch

WORKER = Path(train_worker.__file__)

REWARDS = [
    {"name": "jpeg_compressibility", "weight": 1.0},
    {"name": "sharpness", "weight": 1.0},
    {"name": "color_match", "weight": 1.0},
]
STRATEGIES = {
    "marble": {"name": "marble", "harmonize_every": 2, "alpha_ema": 0.5},
    "weighted_sum": {"name": "weighted_sum"},
    "sequential": {
        "name": "sequential",
        "stages": [{"reward": "sharpness", "epochs": 1}, {"reward": "color_match", "epochs": 1}],
    },
    "single": {"name": "single", "reward": "color_match"},
}


def config(tiny_dir, out, strategy="marble", **train) -> Config:
    return Config.from_dict(
        {
            "model": {"pretrained": str(tiny_dir), "dtype": "float32", "lora_rank": 4, "lora_alpha": 8,
                      "max_sequence_length": 16},
            "sampling": {"num_steps": 3, "resolution": 32, "group_size": 2, "prompts_per_epoch": 2,
                         "batch_size": 4, "solver": "euler"},
            "rewards": REWARDS,
            "strategy": STRATEGIES[strategy],
            "train": {"epochs": 2, "batch_size": 4, "mixed_precision": "no", "out_dir": str(out),
                      "checkpoint_every": 1, "lr": 1e-2, **train},
        }
    )  # fmt: skip


def lora_vector(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainer.params])


def test_a_run_trains_logs_and_checkpoints(tiny_dir, tmp_path):
    history = Trainer.from_config(config(tiny_dir, tmp_path, "marble")).train()
    assert [m["epoch"] for m in history] == [0, 1]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    assert {"reward/jpeg_compressibility", "reward/sharpness", "reward/color_match", "kl"} <= set(lines[0])
    assert lines[0]["kl"] == 0  # the first step starts from the base model (LoRA B = 0)
    assert lines[1]["kl"] > 0  # read once per epoch from the device
    alpha = [lines[-1][f"alpha/{spec['name']}"] for spec in REWARDS]
    assert abs(sum(alpha) - 1) < 1e-6
    assert 0 <= lines[-1]["conflict_rate"] <= 1
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
    assert (tmp_path / "config.yaml").is_file()


def test_sequential_follows_its_stages(tiny_dir, tmp_path):
    trainer = Trainer.from_config(config(tiny_dir, tmp_path, "sequential"))
    assert [trainer.strategy.columns(epoch) for epoch in range(4)] == [[1], [2], [1], [2]]


def test_a_trainer_is_built_from_its_components_as_from_config_builds_them(tiny_dir, tmp_path):
    run = config(tiny_dir, tmp_path, "weighted_sum")
    built = Trainer.from_config(run)
    pipeline = models.load_pipeline(tiny_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(built.seed_of("lora_init"))
        models.add_lora(pipeline.transformer, 4, 8)
    rewards = MultiReward([make_reward(spec["name"]) for spec in REWARDS])
    prompts = load_prompt_pool(PromptSet(list(DEFAULT_PROMPTS), [{} for _ in DEFAULT_PROMPTS]))
    trainer = Trainer(run, pipeline, rewards, prompts)
    assert (trainer.pipeline, trainer.rewards, trainer.prompts) == (pipeline, rewards, prompts)
    assert trainer.eval_prompts is None
    assert torch.equal(lora_vector(trainer), lora_vector(built))
    assert torch.equal(trainer.sample(0).latents, built.sample(0).latents)
    with pytest.raises(ValueError, match=r"pipeline\.transformer has no LoRA adapters"):
        Trainer(run, models.load_pipeline(tiny_dir), rewards, prompts)
    with pytest.raises(ValueError, match=r"rewards \['sharpness'\] are not the config's rewards \['jpeg"):
        Trainer(run, pipeline, MultiReward([make_reward("sharpness")]), prompts)


@pytest.fixture(scope="module")
def planner(tiny_dir, tmp_path_factory) -> Trainer:
    return Trainer.from_config(config(tiny_dir, tmp_path_factory.mktemp("plan"), "weighted_sum"))


@given(
    rows=st.integers(1, 12),
    batch_size=st.integers(1, 5),
    steps=st.integers(1, 6),
    fraction=st.floats(0.01, 1.0),
    epoch=st.integers(0, 10**6),
)
def test_plan_splits_the_local_rows_into_micro_batches_of_distinct_timesteps(
    planner, rows, batch_size, steps, fraction, epoch
):
    run = planner.config
    planner.config = replace(run, train=replace(run.train, batch_size=batch_size, timestep_fraction=fraction))
    try:
        latents = torch.zeros(rows, 2, 3, 3)
        batch = Batch([""] * rows, [{}] * rows, slice(0, rows), latents, latents, latents,
                      torch.linspace(1, 0, steps), torch.arange(steps), latents)  # fmt: skip
        advantages = torch.arange(2.0 * rows).reshape(rows, 2)
        parts = planner.plan(batch, advantages, epoch)
        again = planner.plan(batch, advantages, epoch)
    finally:
        planner.config = run
    assert sorted(torch.cat([part.index for part in parts]).tolist()) == list(range(rows))
    sizes = [min(batch_size, rows - begin) for begin in range(0, rows, batch_size)]
    assert [len(part.index) for part in parts] == sizes
    count = max(1, int(fraction * steps))
    for part, same in zip(parts, again, strict=True):
        assert torch.equal(part.advantages, advantages[part.index])
        assert part.timesteps == sorted(set(part.timesteps))
        assert len(part.timesteps) == count
        assert set(part.timesteps) <= set(range(steps))
        assert part.noise.shape == (count, len(part.index), 2, 3, 3)
        assert torch.equal(part.index, same.index)  # drawn from the epoch's own stream
        assert torch.equal(part.noise, same.noise)


def test_end_epoch_moves_the_old_adapter_and_the_evaluation_ema_towards_the_trained_one(tiny_dir, tmp_path):
    run = config(tiny_dir, tmp_path, "weighted_sum", old_decay_rate=0.2, eval_ema_decay=0.7)
    trainer = Trainer.from_config(run)
    with torch.no_grad():
        for p in trainer.params:
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    trained = [p.detach().clone() for p in trainer.params]
    old = [p.detach().clone() for p in models.lora_parameters(trainer.transformer, models.OLD)]
    ema = [t.clone() for t in trainer.eval_ema.shadow_params]
    trainer.end_epoch(2)  # the old adapter's decay min(0.2 * 2, 0.5) = 0.4
    after = [models.lora_parameters(trainer.transformer, models.OLD), trainer.eval_ema.shadow_params]
    for moved, start, decay in zip(after, (old, ema), (0.4, 0.7), strict=True):
        for now, was, target in zip(moved, start, trained, strict=True):
            expected = decay * was.double() + (1 - decay) * target.double()
            # one float32 lerp: a few eps32 of the operands' size
            bound = 4 * torch.finfo(torch.float32).eps * float(torch.maximum(was.abs(), target.abs()).max())
            torch.testing.assert_close(now.double(), expected, rtol=0, atol=bound)
    assert all(torch.equal(p, t) for p, t in zip(trainer.params, trained, strict=True))


# ---- one step at a time ------------------------------------------------------------------------


def one_step(trainer: Trainer, steps: int = 2):
    """A scored batch, its local advantages, rows, trained timesteps and noise, as an epoch draws
    them; the trained adapter moved off zero first, so that it differs from the old and the base."""
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in trainer.params:
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    batch = trainer.score(trainer.sample(0))
    advantages = trainer.advantages(batch, 0)[batch.local]
    index = torch.tensor([2, 0, 3])
    timesteps = list(range(steps))
    noise = torch.randn((steps, *batch.latents[index].shape), generator=torch.Generator().manual_seed(5))
    return batch, advantages, index, timesteps, noise


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def forward(trainer: Trainer, batch, index, j, eps):
    """``(v, v_old, v_ref, x_t, x0, t)`` at timestep j, computed here rather than by the trainer."""
    x0 = batch.latents[index]
    t = float(batch.sigmas[j])
    x_t = (1 - t) * x0 + t * eps
    args = (x_t, batch.embeds[index], batch.pooled[index], batch.timesteps[j].expand(len(index)))
    with torch.no_grad(), models.adapter(trainer.transformer, models.OLD):
        v_old = trainer.transformer(*args, return_dict=False)[0]
    with torch.no_grad(), models.reference(trainer.transformer):
        v_ref = trainer.transformer(*args, return_dict=False)[0]
    v = trainer.transformer(*args, return_dict=False)[0]
    return v, v_old, v_ref, x_t, x0, t


def grads_of(loss: torch.Tensor, params) -> torch.Tensor:
    return flat(torch.autograd.grad(loss, params, retain_graph=True))


@pytest.mark.parametrize("strategy", ["weighted_sum", "single"])
def test_a_step_of_several_micro_batches_is_the_mean_of_their_gradients(tiny_dir, tmp_path, strategy):
    trainer = Trainer.from_config(config(tiny_dir, tmp_path, strategy))
    batch, advantages, _, timesteps, noise = one_step(trainer)
    parts = [MicroBatch(rows, advantages[rows], timesteps, noise[:, : len(rows)]) for rows in
             (torch.tensor([2, 0]), torch.tensor([3, 1]))]  # fmt: skip
    alone = []
    for part in parts:
        trainer.gradients(batch, [part])
        alone.append(flat(p.grad for p in trainer.params))
    trainer.gradients(batch, parts)
    together = flat(p.grad for p in trainer.params)
    # the same float32 terms, halved and summed in another order: a few eps32 of the largest
    scale = max(g.abs().max() for g in alone)
    torch.testing.assert_close(together, (alone[0] + alone[1]) / 2, rtol=0, atol=8 * 2**-23 * scale)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        trainer.gradients(batch, [])


def test_steps_per_epoch_accumulates_the_epochs_batches_into_that_many_steps(tiny_dir, tmp_path):
    trainer = Trainer.from_config(config(tiny_dir, tmp_path, "weighted_sum", batch_size=1, steps_per_epoch=2))
    trainer.train_epoch(0)
    steps = {int(state["step"]) for state in trainer.optimizer.state_dict()["state"].values()}
    assert steps == {2}  # 4 batches of one sample, 2 steps
    with pytest.raises(ConfigError, match=r"train\.steps_per_epoch: 5 steps, but each process trains 4"):
        Trainer.from_config(config(tiny_dir, tmp_path / "b", "weighted_sum", batch_size=1, steps_per_epoch=5))


@pytest.mark.parametrize("strategy", ["weighted_sum", "single", "sequential"])
def test_a_one_advantage_step_is_the_gradient_of_its_nft_loss_then_adamw(tiny_dir, tmp_path, strategy):
    trainer = Trainer.from_config(config(tiny_dir, tmp_path, strategy, grad_clip=0.05))
    batch, advantages, index, timesteps, noise = one_step(trainer)
    rewards, groups = batch.rewards, batch.prompts
    if strategy == "weighted_sum":
        expected_adv = weighted_sum_advantages(rewards, [1.0, 1.0, 1.0], groups)
    else:
        k = {"single": 2, "sequential": 1}[strategy]  # color_match; the first stage, sharpness
        expected_adv = per_reward_advantages(rewards[:, k : k + 1], groups)[:, 0]
    torch.testing.assert_close(advantages[:, 0], expected_adv[batch.local], rtol=0, atol=0)
    expected = 0
    for j, eps in zip(timesteps, noise, strict=True):
        v, v_old, v_ref, x_t, x0, t = forward(trainer, batch, index, j, eps)
        loss = nft_loss(v, v_old, x_t, x0, t, expected_adv[index], beta=0.1) + kl_loss(v, v_ref, kl_coef=1e-4)
        expected = expected + grads_of(loss, trainer.params)
    before = [p.detach().clone() for p in trainer.params]
    kl = trainer.gradients(batch, [MicroBatch(index, advantages[index], timesteps, noise)])
    assert kl.dtype == torch.float64
    assert kl > 0
    # float32 sums of the same terms in another order: n * eps32 of the largest, n the terms per entry
    tolerance = 64 * torch.finfo(torch.float32).eps * float(expected.abs().max())
    torch.testing.assert_close(flat(p.grad for p in trainer.params), expected, rtol=0, atol=tolerance)
    trainer.update()
    reference = [p.clone().requires_grad_() for p in before]
    for p, g in zip(reference, trainer.params, strict=True):
        p.grad = g.grad.clone()  # the trainer's gradient, clipped and stepped by a fresh AdamW
    torch.nn.utils.clip_grad_norm_(reference, 0.05)
    torch.optim.AdamW(reference, lr=1e-2, weight_decay=1e-4).step()
    assert torch.equal(flat(trainer.params), flat(reference))


def marble_gradient(trainer, batch, advantages, index, j, eps) -> torch.Tensor:
    """``sum_k w_k grad L_k + grad KL`` with MARBLE's ``w_k = mean_l ||g_l|| alpha_k / ||g_k||``
    and ``alpha`` the min-norm point of the unit gradients, computed from K separate gradients."""
    v, v_old, v_ref, x_t, x0, t = forward(trainer, batch, index, j, eps)
    g = torch.stack(
        [
            grads_of(nft_loss(v, v_old, x_t, x0, t, advantages[:, k], beta=0.1), trainer.params)
            for k in range(advantages.shape[1])
        ]
    ).double()
    norms = g.norm(dim=1)
    unit = g / norms[:, None]
    alpha = mogo.min_norm(unit @ unit.T).alpha
    weights = norms.mean() * alpha / norms
    return (weights @ g).float() + grads_of(kl_loss(v, v_ref, kl_coef=1e-4), trainer.params)


def test_the_marble_gradient_is_the_weighted_sum_of_the_per_reward_gradients(tiny_dir, tmp_path):
    trainer = Trainer.from_config(config(tiny_dir, tmp_path, "marble"))
    batch, advantages, index, timesteps, noise = one_step(trainer, steps=1)
    torch.testing.assert_close(
        advantages, per_reward_advantages(batch.rewards, batch.prompts)[batch.local], rtol=0, atol=0
    )
    expected = marble_gradient(trainer, batch, advantages[index], index, timesteps[0], noise[0])
    trainer.gradients(batch, [MicroBatch(index, advantages[index], timesteps, noise)])
    # float32 gradients summed in another order, the float64 weights rounded to float32
    tolerance = 64 * torch.finfo(torch.float32).eps * float(expected.abs().max())
    torch.testing.assert_close(flat(p.grad for p in trainer.params), expected, rtol=0, atol=tolerance)


def test_a_registered_weighting_reaches_the_trainer_by_name(tiny_dir, tmp_path):
    """A weighting registered in mogo is a strategy without editing the trainer."""
    mogo.register_weighting("test_equal_sum", lambda scale=1.0: mogo.WeightedSum([scale] * 3))
    try:
        data = config(tiny_dir, tmp_path).to_dict()
        data["strategy"] = {"name": "test_equal_sum", "harmonize_every": 1, "options": {"scale": 2.0}}
        trainer = Trainer.from_config(Config.from_dict(data))
        assert isinstance(trainer.optimizer.weighting, mogo.WeightedSum)
        batch, advantages, index, timesteps, noise = one_step(trainer, steps=1)
        v, v_old, v_ref, x_t, x0, t = forward(trainer, batch, index, 0, noise[0])
        adv = advantages[index]
        total = sum(2.0 * nft_loss(v, v_old, x_t, x0, t, adv[:, k], beta=0.1) for k in range(3))
        expected = grads_of(total + kl_loss(v, v_ref, kl_coef=1e-4), trainer.params)
        trainer.gradients(batch, [MicroBatch(index, adv, timesteps, noise)])
        tolerance = 64 * torch.finfo(torch.float32).eps * float(expected.abs().max())
        torch.testing.assert_close(flat(p.grad for p in trainer.params), expected, rtol=0, atol=tolerance)
        data["strategy"]["options"] = {"colour": 1}
        with pytest.raises(ConfigError, match=r"strategy\.options: weighting 'test_equal_sum'"):
            Trainer.from_config(Config.from_dict(data))
    finally:
        mogo.WEIGHTINGS.pop("test_equal_sum")


def test_train_py_decides_no_strategy():
    """The strategy is chosen in one place (strategies.make_strategy): train.py names none."""
    source = Path(train_module.__file__).read_text()
    for name in ("marble", "weighted_sum", "sequential", "single", "HarmonizedOptimizer"):
        assert f'"{name}"' not in source, name
        assert f"mogo.{name}" not in source, name
    assert "isinstance(self.optimizer" not in source


# ---- mixed precision: one gradient pipeline for every strategy --------------------------------


@pytest.mark.parametrize("strategy", ["marble", "weighted_sum"])
def test_a_gradient_scaler_changes_no_gradient_and_no_update(tiny_dir, tmp_path, strategy):
    """Scaling the losses by 2**12 and unscaling before clipping is exact (powers of two), for
    the harmonized arm and the plain one alike: the trainer's gradients and updates are the
    unscaled ones (accelerate's scaler used to reach clipping and AdamW scaled, marble's not)."""
    runs = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=2.0**12)):
        trainer = Trainer.from_config(config(tiny_dir, tmp_path, strategy, grad_clip=0.05), scaler=scaler)
        batch, advantages, index, timesteps, noise = one_step(trainer)
        trainer.gradients(batch, [MicroBatch(index, advantages[index], timesteps, noise)])
        grads = flat(p.grad for p in trainer.params)
        trainer.update()
        runs.append((grads, flat(trainer.params).detach()))
    assert not runs[0][1].equal(flat(Trainer.from_config(config(tiny_dir, tmp_path, strategy)).params))
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("strategy", ["marble", "weighted_sum"])
def test_an_overflowing_step_is_skipped_and_lowers_the_scale(tiny_dir, tmp_path, strategy):
    data = config(tiny_dir, tmp_path, strategy).to_dict()
    data["train"]["mixed_precision"] = "fp16"
    if strategy == "marble":
        data["strategy"]["nonfinite"] = "skip"
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    trainer = Trainer.from_config(Config.from_dict(data), scaler=scaler)
    assert trainer.scaler is scaler
    assert trainer.mixed_precision == "fp16"
    batch, advantages, index, timesteps, noise = one_step(trainer)
    before = flat(trainer.params).detach().clone()
    hook = trainer.params[0].register_hook(lambda grad: grad * float("inf"))  # an overflow, injected
    trainer.gradients(batch, [MicroBatch(index, advantages[index], timesteps, noise)])
    trainer.update()
    hook.remove()
    assert torch.equal(flat(trainer.params), before)
    assert not trainer.optimizer.state  # AdamW never stepped (its state is forwarded by mogo's)
    assert scaler.get_scale() == 2.0**9
    trainer.gradients(batch, [MicroBatch(index, advantages[index], timesteps, noise)])
    trainer.update()
    assert not torch.equal(flat(trainer.params), before)
    assert torch.isfinite(flat(trainer.params)).all()
    assert scaler.get_scale() == 2.0**9


def test_the_gradient_scalers_state_is_saved_and_resumed(tiny_dir, tmp_path):
    """An fp16 run resumed from a checkpoint continues with the scale it had (it restarted at the
    initial scale, so a resumed fp16 run was not the uninterrupted one)."""
    data = config(tiny_dir, tmp_path, "weighted_sum", epochs=1).to_dict()
    data["train"]["mixed_precision"] = "fp16"
    trainer = Trainer.from_config(
        Config.from_dict(data), scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10)
    )
    trainer.scaler.scale(torch.ones(()))  # the scale exists from the first scaled loss on
    trainer.scaler.update(2.0**7)  # a scale the run reached, not the initial one
    trainer.train()
    resumed = Trainer.from_config(
        Config.from_dict(data), scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10)
    )
    resumed.resume("latest")
    assert resumed.scaler.get_scale() == trainer.scaler.get_scale() == 2.0**7
    assert resumed.scaler.state_dict() == trainer.scaler.state_dict()


def test_bf16_autocast_trains_on_the_cpu_and_auto_means_no_there(tiny_dir, tmp_path):
    auto = Trainer.from_config(config(tiny_dir, tmp_path, "weighted_sum", mixed_precision="auto"))
    assert auto.mixed_precision == "no"
    assert not auto.scaler.is_enabled()
    trainer = Trainer.from_config(config(tiny_dir, tmp_path, "marble", mixed_precision="bf16"))
    assert not trainer.scaler.is_enabled()
    batch, advantages, index, timesteps, noise = one_step(trainer, steps=1)
    with trainer.autocast():
        v = forward(trainer, batch, index, 0, noise[0])[0]
    assert v.dtype == torch.bfloat16
    losses, _ = trainer.losses(batch, index, advantages[index], 0, noise[0])
    assert losses.dtype == torch.float32
    assert losses.shape == (3,)
    before = flat(trainer.params).detach().clone()
    trainer.gradients(batch, [MicroBatch(index, advantages[index], timesteps, noise)])
    assert all(p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in trainer.params)
    trainer.update()
    assert not torch.equal(flat(trainer.params), before)


# ---- random streams ----------------------------------------------------------------------------


def test_the_random_streams_of_a_run_are_distinct(tiny_dir, tmp_path):
    """The training draws of epoch e were the sampling draws of epoch e + 1 (the same seed)."""
    trainer = Trainer.from_config(config(tiny_dir, tmp_path, "single"))
    seeds = [
        trainer.stream(purpose, e).initial_seed() for purpose in ("sampling", "training") for e in range(4)
    ]
    assert len({*seeds, trainer.seed_of("lora_init")}) == 9
    draws = [torch.randn(64, generator=trainer.stream(p, e)) for p, e in (("training", 0), ("sampling", 1))]
    assert not torch.equal(*draws)


@given(
    seed=st.integers(0, 2**63 - 1),
    keys=st.lists(
        st.tuples(st.sampled_from(["sampling", "training", "vae"]), st.integers(0, 10**6)),
        min_size=2,
        max_size=8,
        unique=True,
    ),
)
def test_stream_seeds_differ_for_distinct_purposes_and_indices(seed, keys):
    seeds = [stream_seed(seed, purpose, index) for purpose, index in keys]
    assert len(set(seeds)) == len(seeds)  # a collision of 64-bit hashes: probability < 2**-58


def test_a_resumed_run_ends_bit_identical_to_an_uninterrupted_one(tiny_dir, tmp_path):
    whole = Trainer.from_config(config(tiny_dir, tmp_path / "whole", epochs=3))
    whole.train()
    first = Trainer.from_config(config(tiny_dir, tmp_path / "split", epochs=3))
    first.train(epochs=2)
    resumed = Trainer.from_config(config(tiny_dir, tmp_path / "split", epochs=3))
    resumed.resume("latest")
    assert resumed.epoch == 2
    resumed.train()
    assert torch.equal(lora_vector(resumed), lora_vector(whole))
    old = [models.lora_parameters(t.transformer, models.OLD) for t in (whole, resumed)]
    assert all(torch.equal(a, b) for a, b in zip(*old, strict=True))
    assert all(
        torch.equal(a, b)
        for a, b in zip(whole.eval_ema.shadow_params, resumed.eval_ema.shadow_params, strict=True)
    )
    amortizers = [t.optimizer.state_dict()["mogo"]["amortizer"] for t in (whole, resumed)]
    for key, value in amortizers[0].items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(amortizers[1][key])), key


def test_the_saved_lora_loads_into_a_fresh_pipeline_and_changes_its_output(tiny_dir, tmp_path):
    trainer = Trainer.from_config(config(tiny_dir, tmp_path, "weighted_sum"))
    trainer.train()
    lora = tmp_path / "checkpoints" / "step-000002" / "lora"

    def velocity(pipeline):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(1, 16, 8, 8, generator=generator)
        embeds, pooled = models.encode_prompts(pipeline, ["a red circle on a white background"], 16)
        with torch.no_grad():
            return pipeline.transformer(x, embeds, pooled, torch.tensor([500.0]), return_dict=False)[0]

    base = velocity(StableDiffusion3Pipeline.from_pretrained(tiny_dir))
    fresh = StableDiffusion3Pipeline.from_pretrained(tiny_dir)
    fresh.load_lora_weights(lora)
    tuned = velocity(fresh)
    with models.adapter(trainer.transformer, models.TRAINED):
        trained = velocity(trainer.pipeline)
    assert not torch.allclose(tuned, base)
    torch.testing.assert_close(tuned, trained, rtol=1e-5, atol=1e-6)


def test_bad_configs_fail_at_start_naming_the_field(tiny_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"rewards\.0\.name"):
        Trainer.from_config(Config.from_dict({"rewards": [{"name": "no_such_reward"}]}))
    data = config(tiny_dir, tmp_path, "weighted_sum").to_dict()
    data["rewards"][1]["weight"] = None
    with pytest.raises(ConfigError, match="weight"):
        Config.from_dict(data)
    data = config(tiny_dir, tmp_path).to_dict()
    data["model"]["pretrained"] = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"model\.pretrained"):
        Config.from_dict(data)


def test_a_corrupt_checkpoint_is_named_and_nothing_is_changed(tiny_dir, tmp_path):
    trainer = Trainer.from_config(config(tiny_dir, tmp_path, "marble", epochs=1))
    trainer.train()
    checkpoint = tmp_path / "checkpoints" / "step-000001"
    (checkpoint / "tensors.safetensors").write_bytes(b"not a safetensors file")
    fresh = Trainer.from_config(config(tiny_dir, tmp_path, "marble", epochs=1))
    before = lora_vector(fresh)
    with pytest.raises(CheckpointError, match=r"tensors\.safetensors"):
        fresh.resume("latest")
    assert fresh.epoch == 0
    assert torch.equal(lora_vector(fresh), before)


def test_the_command_line_has_help_and_names_a_bad_override(tiny_dir, tmp_path, capsys):
    path = tmp_path / "run.yaml"
    config(tiny_dir, tmp_path / "cli", "single").save(path)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--resume" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--config", str(path), "--set", "train.lr=-1"])
    assert "train.lr" in capsys.readouterr().err
    assert not (tmp_path / "cli").exists()


NUMBER = r"(-?\d+\.\d{4}|-)"


@pytest.mark.spawns
def test_the_command_reports_each_epoch_then_the_held_out_table_and_what_it_wrote(tiny_dir, tmp_path):
    """Issue 40: in a file or a pipe the command printed nothing but third-party warnings and
    progress bars. Now: a line per epoch, the pretrained against the trained model's held-out
    rewards (the numbers of metrics.jsonl), the paths written; nothing on stderr."""
    (tmp_path / "eval.txt").write_text("a red circle\na blue square\na green triangle\n")
    data = config(tiny_dir, tmp_path / "run", "marble", eval_every=2).to_dict()
    data["sampling"]["eval_prompts"] = str(tmp_path / "eval.txt")
    Config.from_dict(data).save(tmp_path / "run.yaml")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "mogo_diffusion.train", "--config", str(tmp_path / "run.yaml")]
    result = subprocess.run([*command, "--set", "train.epochs=2"], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr == ""  # no warning, no progress bar
    records = read_metrics(tmp_path / "run", pretrained=True)
    assert [r["epoch"] for r in records] == [-1, 0, 1]  # the pretrained model's evaluation first
    assert ["eval/sharpness" in r for r in records] == [True, False, True]  # eval_every 2, and the last
    lines = result.stdout.splitlines()
    names = [spec["name"] for spec in REWARDS]
    pretrained = " ".join(f"{n} {records[0][f'eval/{n}']:.4f}" for n in names)
    assert lines[0] == f"pretrained model: held-out {pretrained}"
    for record, line in zip(records[1:], lines[1:3], strict=True):
        epoch, rewards, *held_out = line.split(" | ")
        assert epoch == f"epoch {record['epoch'] + 1}/2: {record['images_per_second']:.1f} images/s"
        assert rewards == "reward " + " ".join(f"{n} {record[f'reward/{n}']:.4f}" for n in names)
        assert held_out == (["held-out " + " ".join(f"{n} {record[f'eval/{n}']:.4f}" for n in names)]
                            if "eval/sharpness" in record else [])  # fmt: skip
    assert lines[3].split() == ["held-out", "reward", "pretrained", "trained", "change"]
    for name, row in zip(names, lines[4:7], strict=True):
        cells = re.fullmatch(rf"{name} +{NUMBER} +{NUMBER} +\+?{NUMBER}", row).groups()
        before, after, change = (float(cell) for cell in cells)
        exact = records[0][f"eval/{name}"], records[-1][f"eval/{name}"]
        assert (before, after) == (round(exact[0], 4), round(exact[1], 4))
        assert abs(change - (exact[1] - exact[0])) <= 0.5e-4 + 1e-12
    assert lines[7:9] == ["", "wrote:"]
    written = [Path(line.split()[-1]) for line in lines[9:]]
    run = tmp_path / "run"
    assert written == [run, run / "samples.png", run / "curves.png", run / "metrics.jsonl",
                       run / "checkpoints" / "step-000002"]  # fmt: skip
    assert all(path.exists() for path in written)


def test_metrics_reach_tensorboard_through_accelerate(tiny_dir, tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    Trainer.from_config(config(tiny_dir, tmp_path, "marble", log_with=["tensorboard"])).train()
    (run,) = (tmp_path / "trackers" / "mogo_diffusion").glob("events.out.tfevents.*")
    events = event_accumulator.EventAccumulator(str(run))
    events.Reload()
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for tag in ("reward/color_match", "alpha/sharpness", "conflict_rate", "images_per_second"):
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == [0, 1]
        assert [s.value for s in scalars] == pytest.approx([m[tag] for m in logged], rel=1e-6)


def test_an_unknown_or_missing_tracker_is_named(tiny_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"train\.log_with: unknown tracker 'tensorbord'"):
        Trainer.from_config(config(tiny_dir, tmp_path, "single", log_with=["tensorbord"]))
    available = {str(kind) for kind in get_available_trackers()}
    missing = [str(kind) for kind in LoggerType if kind != LoggerType.ALL and str(kind) not in available]
    if not missing:
        pytest.skip("every accelerate tracker is installed here")
    with pytest.raises(ConfigError, match=rf"tracker '{missing[0]}' needs its package"):
        Trainer.from_config(config(tiny_dir, tmp_path, "single", log_with=missing[:1]))


@pytest.mark.spawns
def test_two_processes_sample_their_share_and_stay_identical(tiny_dir, tmp_path):
    """Under ``accelerate launch`` each process samples half of the groups: the gathered rewards
    equal one process's, and averaged gradients keep the ranks' adapters identical."""
    paths = []
    for strategy in ("marble", "weighted_sum"):  # marble: a harmonization, then an amortized step
        paths.append(tmp_path / f"{strategy}.yaml")
        config(tiny_dir, tmp_path / strategy, strategy, batch_size=2).save(paths[-1])
    command = [*accelerate_launch(), str(WORKER), str(tmp_path), *map(str, paths)]
    ranks = launch(command, tmp_path, env={"ACCELERATE_USE_CPU": "1"})  # as `accelerate launch --cpu`
    for path in paths:
        first, second = (rank[path.stem] for rank in ranks)
        assert torch.equal(first["params"], second["params"])
        single = Trainer.from_config(
            config(tiny_dir, tmp_path / "single" / path.stem, path.stem, batch_size=2, epochs=1)
        )
        assert not torch.equal(first["params"], lora_vector(single))
        (epoch0,) = single.train()
        expected = torch.tensor([epoch0[f"reward/{name}"] for name in single.names])
        torch.testing.assert_close(first["rewards"][0], expected)
        saved = load_checkpoint(tmp_path / path.stem / "checkpoints" / "step-000002")
        assert torch.equal(torch.cat([t.reshape(-1) for t in saved["trained"]]), first["params"])


def test_shapes_prompts_reach_the_rewards_and_the_evaluation_uses_the_eval_ema(tiny_dir, tmp_path):
    data = config(tiny_dir, tmp_path, "weighted_sum", eval_every=1).to_dict()
    data["sampling"].update(prompts="shapes:train:16", eval_prompts="shapes:heldout:4")
    data["rewards"] = [
        {"name": name, "weight": 1.0} for name in ("shapes_color", "shapes_count", "jpeg_compressibility")
    ]
    data["strategy"]["reward_scale"] = "zscore"
    trainer = Trainer.from_config(Config.from_dict(data))
    initial = [p.clone() for p in trainer.eval_ema.shadow_params]
    before = trainer.evaluate()  # shapes rewards raise without the prompts' metadata
    # the initial adapter is zero: the base images are the evaluation's, bit for bit in the same
    # batches; rows [3, 0] alone change only the order of float32 sums (~1e3 ulps of [0, 1] at most)
    assert torch.equal(trainer.base_samples(range(4)), trainer.eval_images)
    torch.testing.assert_close(trainer.base_samples([3, 0]), trainer.eval_images[[3, 0]], rtol=0, atol=1e-4)
    history = trainer.train()
    for record in history:
        assert 0 <= record["eval/shapes_color"] <= 1
        assert set(record) >= {"eval/shapes_count", "eval/jpeg_compressibility"}
    records = read_metrics(tmp_path, pretrained=True)
    # the held-out curves start at the pretrained model: the evaluation of the adapters at their
    # initialisation, logged before the first epoch, drawn at 0 epochs trained in curves.png
    assert json.dumps(records[0]) == json.dumps({"epoch": -1, **before})
    (held_out,) = [axis for axis in figures.run_curves(records).axes if axis.get_title() == "held-out reward"]
    (colour,) = [line for line in held_out.get_lines() if line.get_label() == "shapes_color"]
    assert colour.get_xdata().tolist() == [0, 1, 2]
    assert colour.get_ydata().tolist() == [
        before["eval/shapes_color"],
        *(r["eval/shapes_color"] for r in history),
    ]
    assert (tmp_path / "samples.png").is_file()
    assert (tmp_path / "curves.png").is_file()
    trained = lora_vector(trainer)
    trainer.eval_ema.shadow_params = initial  # the same EMA weights and fixed noise give the same evaluation
    assert json.dumps(trainer.evaluate()) == json.dumps(before)  # NaN included
    assert torch.equal(lora_vector(trainer), trained)  # and the trained adapter is left as it was


def test_a_bad_prompt_source_is_named(tiny_dir, tmp_path):
    data = config(tiny_dir, tmp_path).to_dict()
    data["sampling"]["eval_prompts"] = "shapes:validation"
    with pytest.raises(ConfigError, match=r"sampling\.eval_prompts: prompt source 'shapes:validation'"):
        Trainer.from_config(Config.from_dict(data))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rewards.0.name=sharpnes"],
            "rewards.0.name: unknown reward 'sharpnes' (did you mean 'sharpness'?)",
        ),
        (["rewards.0.name=nope"], "Known rewards: aesthetic, clipscore, color_match, geneval"),
        (
            ["rewards.0.options={qualty: 3}"],
            "rewards.0.options.qualty: 'jpeg_compressibility' has no such option (did you mean 'quality'?)",
        ),
        (["rewards.1.options={x: 3}"], "'sharpness' has no such option; it accepts none"),
        (["strategy.name=marbel"], "strategy.name: unknown strategy 'marbel' (did you mean 'marble'?)"),
        (
            ["strategy.name=marbel"],
            "strategies: marble, weighted_sum, sequential, single, normalize_then_sum, marble_released, "
            "famo, or a weighting",
        ),
        (
            ["strategy.name=min_norm", "strategy.options={normalise: l2}"],
            "strategy.options: weighting 'min_norm'",
        ),
    ],
)
def test_reward_and_strategy_names_are_checked_when_the_trainer_is_built(overrides, message):
    config = load_config(
        None, ["rewards.0.name=jpeg_compressibility", "rewards.1.name=sharpness", *overrides]
    )
    with pytest.raises(ConfigError) as info:
        check_config(config)
    assert message in str(info.value)


# ---- resuming: what a checkpoint must be, and what a resume may change (issue 21) ----------------


@pytest.fixture(scope="module")
def one_epoch_run(tiny_dir, tmp_path_factory):
    """A marble run trained for one epoch (``checkpoints/step-000001``); copy it before changing it."""
    out = tmp_path_factory.mktemp("one-epoch")
    Trainer.from_config(config(tiny_dir, out, "marble", epochs=1)).train()
    return out


def copy_run(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_a_resume_refuses_every_config_change_it_cannot_honour(tiny_dir, one_epoch_run, tmp_path, capsys):
    """D11: --set train.lr / strategy.harmonize_every were ignored (the checkpoint's values won)
    while config.yaml recorded the new ones. D12: a marble checkpoint into weighted_sum failed with
    a bare KeyError 'param_groups'. Both are refused naming the fields; nothing is written."""
    run = copy_run(one_epoch_run, tmp_path / "run")
    path = tmp_path / "run.yaml"
    config(tiny_dir, run, "marble", epochs=2).save(path)
    recorded = (run / "config.yaml").read_text()
    overrides = ["--set", "train.lr=0.5", "--set", "strategy.harmonize_every=5"]
    with pytest.raises(SystemExit) as exit_:  # the command says it in one line, no traceback
        main(["--config", str(path), *overrides, "--resume", "latest"])
    assert exit_.value.code == 2
    assert re.search(
        r"error: --resume latest: strategy\.harmonize_every, train\.lr: .*2 in the checkpoint, 5 now",
        capsys.readouterr().err,
    )
    assert (run / "config.yaml").read_text() == recorded
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000001"]
    switched = Trainer.from_config(config(tiny_dir, run, "weighted_sum", epochs=2))
    with pytest.raises(
        ConfigError,
        match=r"^strategy\.name, .*strategy\.name: 'marble' in the checkpoint, 'weighted_sum' now",
    ):
        switched.resume("latest")
    assert switched.epoch == 0
    main(["--config", str(path), "--set", "train.eval_every=1", "--resume", "latest"])  # may change
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000001", "step-000002"]


def bad_state(case: str, good: dict) -> tuple[object, str]:
    """A structurally wrong state (hashed as a good save would be) and what its error must say."""
    short = {**good, "eval_ema": good["eval_ema"][:-1]}
    return {
        "empty": ({}, r"lacks the fields epoch, trained, old, eval_ema, optimizer, scaler, config"),
        "list": ([1, 2], r"must hold an object with the fields epoch, .*, got list"),
        "epoch text": ({**good, "epoch": "abc"}, r"field 'epoch' must be a non-negative integer, got 'abc'"),
        "epoch negative": ({**good, "epoch": -5}, r"field 'epoch' must be a non-negative integer, got -5"),
        "short eval_ema": (short, r"field 'eval_ema' has \d+ tensors where this model's adapter has \d+"),
        "eval_ema dtype": (  # issue 39 item 16: it crashed in the EMA update, after a whole epoch
            {**good, "eval_ema": [t.half() for t in good["eval_ema"]]},
            r"field 'eval_ema': tensor 0 has shape \(\d+, \d+\) and dtype torch\.float16 where this "
            r"model's adapter has \(\d+, \d+\) and torch\.float32",
        ),
        "epoch beyond": (  # issue 39 item 16: it exited 0, training nothing, without a word
            {**good, "epoch": 5},
            r"field 'epoch' is 5, beyond this run's train\.epochs=2: set train\.epochs to 5 or more",
        ),
        "wrong shapes": (
            {**good, "old": [t.flatten() for t in good["old"]]},
            r"field 'old': tensor 0 has shape",
        ),
        "not tensors": (
            {**good, "trained": [1.0] * len(good["trained"])},
            r"field 'trained' must be a list of",
        ),
        "optimizer": ({**good, "optimizer": {"state": {}}}, r"field 'optimizer' does not fit this run"),
        "config": ({**good, "config": None}, r"field 'config' must be an object"),
    }[case]


BAD_STATES = ["empty", "list", "epoch text", "epoch negative", "epoch beyond", "short eval_ema",
              "eval_ema dtype", "wrong shapes", "not tensors", "optimizer", "config"]  # fmt: skip


@pytest.mark.parametrize("case", BAD_STATES)
def test_a_malformed_state_json_is_named_and_nothing_is_changed(
    tiny_dir, one_epoch_run, tmp_path, case, capsys
):
    """D13: {} gave KeyError 'trained', [1, 2] a TypeError, a shortened eval_ema a zip() error, and
    "epoch": -5 started training at epoch -5 after rewriting config.yaml."""
    run = copy_run(one_epoch_run, tmp_path / "run")
    good = load_checkpoint(run / "checkpoints" / "step-000001")
    bad, message = bad_state(case, good)
    save_checkpoint(run / "checkpoints", 1, bad)
    fresh = Trainer.from_config(config(tiny_dir, run, "marble", epochs=2))
    before, optimizer = lora_vector(fresh), copy.deepcopy(fresh.optimizer.state_dict())
    ema = [t.clone() for t in fresh.eval_ema.shadow_params]
    with pytest.raises(CheckpointError, match=r"step-000001/state\.json'.*" + message):
        fresh.resume("latest")
    assert fresh.epoch == 0
    assert torch.equal(lora_vector(fresh), before)
    assert all(torch.equal(a, b) for a, b in zip(fresh.eval_ema.shadow_params, ema, strict=True))
    assert_same(fresh.optimizer.state_dict(), optimizer)
    if case in ("epoch negative", "epoch beyond"):  # the command stops before it writes anything
        recorded = (run / "config.yaml").read_text()
        with pytest.raises(SystemExit):
            main(["--config", str(save_config(tiny_dir, run, tmp_path)), "--resume", "latest"])
        assert "error: --resume latest: " in capsys.readouterr().err
        assert (run / "config.yaml").read_text() == recorded
        assert not (run / "checkpoints" / "step-000002").exists()


def test_a_checkpoint_saved_before_a_field_was_removed_resumes(tiny_dir, one_epoch_run, tmp_path):
    """Checkpoints saved before sampling.steps_per_epoch was removed hold it as null."""
    run = copy_run(one_epoch_run, tmp_path / "run")
    state = load_checkpoint(run / "checkpoints" / "step-000001")
    state["config"]["sampling"]["steps_per_epoch"] = None
    save_checkpoint(run / "checkpoints", 1, state)
    fresh = Trainer.from_config(config(tiny_dir, run, "marble", epochs=2))
    fresh.resume("latest")
    assert fresh.epoch == 1
    state["config"]["sampling"]["steps_per_epoch"] = 2  # a value was never valid there
    save_checkpoint(run / "checkpoints", 1, state)
    with pytest.raises(
        CheckpointError, match=r"field 'config' is not a valid config: sampling\.steps_per_epoch"
    ):
        Trainer.from_config(config(tiny_dir, run, "marble", epochs=2)).resume("latest")


def save_config(tiny_dir, out, where) -> Path:
    path = where / "resume.yaml"
    config(tiny_dir, out, "marble", epochs=2).save(path)
    return path


def test_damaged_tensor_bytes_are_refused_before_anything_changes(tiny_dir, one_epoch_run, tmp_path):
    """D10: 64 bytes overwritten in the middle of tensors.safetensors resumed (rc 0) into NaN."""
    run = copy_run(one_epoch_run, tmp_path / "run")
    tensors = run / "checkpoints" / "step-000001" / "tensors.safetensors"
    data = bytearray(tensors.read_bytes())
    data[len(data) // 2 - 32 : len(data) // 2 + 32] = b"\xff" * 64
    tensors.write_bytes(bytes(data))
    fresh = Trainer.from_config(config(tiny_dir, run, "marble", epochs=2))
    before = lora_vector(fresh)
    with (
        pytest.warns(UserWarning, match="skipping a damaged checkpoint"),
        pytest.raises(CheckpointError, match=r"step-000001/tensors\.safetensors' differs from its hash"),
    ):
        fresh.resume("latest")
    with pytest.raises(CheckpointError, match=r"step-000001/tensors\.safetensors' differs from its hash"):
        fresh.resume(tensors.parent)
    assert fresh.epoch == 0
    assert torch.equal(lora_vector(fresh), before)


def test_the_lora_export_is_part_of_the_checkpoint(one_epoch_run, tmp_path):
    """D14: lora/ was written after the rename, outside any check; now it is hashed with the rest."""
    run = copy_run(one_epoch_run, tmp_path / "run")
    step = run / "checkpoints" / "step-000001"
    listed = json.loads((step / "manifest.json").read_text())["files"]
    assert "lora/pytorch_lora_weights.safetensors" in listed
    (step / "lora" / "pytorch_lora_weights.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"lora/pytorch_lora_weights\.safetensors' is missing"):
        load_checkpoint(step)


KILL_AT_SECOND_EXPORT = r"""
import os, signal, sys
from mogo_diffusion import checkpoint
from mogo_diffusion.train import main

exports = []
def boundary(name):
    exports.extend([name] if name == "extra" else [])
    if len(exports) == 2:  # step 2's lora/ is written into its staging folder, not yet published
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint._boundary = boundary
main(["--config", sys.argv[1]])
"""


@pytest.mark.spawns
def test_a_run_killed_while_saving_resumes_from_its_last_complete_checkpoint(tiny_dir, tmp_path):
    """kill -9 in the middle of a real save (step 2, the final one, after its LoRA export): the run
    is unfinished, step 1 is chosen, and the resumed run ends bit-identical to an uninterrupted one."""
    path = tmp_path / "run.yaml"
    config(tiny_dir, tmp_path / "killed", epochs=2).save(path)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    child = subprocess.run(
        [sys.executable, "-c", KILL_AT_SECOND_EXPORT, str(path)], env=env, capture_output=True
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    checkpoints = tmp_path / "killed" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000001", "step-000002.tmp"]
    # issue 39 item 5: its last epoch was logged before the save, and the comparison took it for
    # finished, then failed to evaluate it on every restart; it is unfinished, to be resumed
    killed = config(tiny_dir, tmp_path / "killed", epochs=2)
    assert [r["epoch"] for r in read_metrics(tmp_path / "killed")] == [0, 1]
    assert not compare.done(killed)
    assert compare.decide(killed) == ("resume", "unfinished, from step-000001")
    resumed = Trainer.from_config(killed)
    resumed.resume("latest")
    assert resumed.epoch == 1
    resumed.train()
    assert compare.done(killed)
    whole = Trainer.from_config(config(tiny_dir, tmp_path / "whole", epochs=2))
    whole.train()
    assert torch.equal(lora_vector(resumed), lora_vector(whole))
    assert all(
        torch.equal(a, b)
        for a, b in zip(whole.eval_ema.shadow_params, resumed.eval_ema.shadow_params, strict=True)
    )
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000001", "step-000002"]


# ---- the run directory: one run, one process, one record per epoch (issue 39) -------------------


def test_a_new_run_is_refused_in_a_directory_that_holds_one_unless_overwritten(
    tiny_dir, one_epoch_run, tmp_path, capsys
):
    """Issue 39 item 3: without --resume, a second run appended to the old metrics.jsonl, rewrote
    config.yaml and kept the old run's checkpoints, and `evaluate` then scored the old seed's
    checkpoint under the new seed's config. It is refused before anything is written, naming the
    directory and the ways on; --overwrite replaces the old run whole."""
    run = copy_run(one_epoch_run, tmp_path / "run")
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "run.lock"}
    path = tmp_path / "seed1.yaml"
    config(tiny_dir, run, "marble", epochs=1, seed=1).save(path)
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(path)])
    assert exit_.value.code == 2
    assert re.search(
        rf"'{re.escape(str(run))}' holds a run already \(finished, train\.epochs=1\): continue it with "
        r"--resume latest, .* another train\.out_dir, or pass --overwrite",
        capsys.readouterr().err,
    )
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "run.lock"} == files
    main(["--config", str(path), "--overwrite"])
    assert load_config(run / "config.yaml").train.seed == 1
    assert [r["epoch"] for r in read_metrics(run)] == [0]
    assert load_checkpoint(run / "checkpoints" / "step-000001")["config"]["train"]["seed"] == 1
    with pytest.raises(SystemExit):
        main(["--config", str(path), "--overwrite", "--resume", "latest"])
    assert "--overwrite starts a run afresh" in capsys.readouterr().err


HOLD_AFTER_FIRST_SAVE = r"""
import sys, time
from pathlib import Path
from mogo_diffusion import checkpoint
from mogo_diffusion.train import main

def boundary(name):
    if name == "rename":  # step 1 is published; the run holds its directory on, until killed
        Path(sys.argv[2]).write_text("saved")
        time.sleep(3600)
checkpoint._boundary = boundary
main(["--config", sys.argv[1]])
"""


@pytest.mark.spawns
def test_a_second_process_cannot_train_into_a_claimed_directory(tiny_dir, tmp_path, capsys):
    """Issue 39 item 4: two runs on one out_dir at once deleted each other's staging folders and
    left one run's config with the other's checkpoints and interleaved metrics. While a real
    training process holds the directory, another run is refused naming its pid, and nothing of
    the first changes; killed, it leaves no stale claim: its run resumes."""
    out, ready = tmp_path / "run", tmp_path / "ready"
    first, second = tmp_path / "seed0.yaml", tmp_path / "seed1.yaml"
    config(tiny_dir, out, "weighted_sum", epochs=2, seed=0).save(first)
    config(tiny_dir, out, "weighted_sum", epochs=2, seed=1).save(second)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    with (tmp_path / "holder.log").open("w") as log:
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLD_AFTER_FIRST_SAVE, str(first), str(ready)], env=env, stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 600  # a hang fails the test rather than stall the suite
        while not ready.exists():
            assert holder.poll() is None, (tmp_path / "holder.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the holding run never reached its first save"
            time.sleep(0.2)
        held = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        for argv in (["--config", str(second)], ["--config", str(first), "--resume", "latest"]):
            with pytest.raises(SystemExit):
                main(argv)
            assert f"run' is in use by another process (pid {holder.pid})" in capsys.readouterr().err
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == held
    finally:
        holder.kill()
        holder.wait()
    assert load_config(out / "config.yaml").train.seed == 0
    assert [r["epoch"] for r in read_metrics(out)] == [0]
    main(["--config", str(first), "--resume", "latest"])  # the kill released the claim
    assert [r["epoch"] for r in read_metrics(out)] == [0, 1]
    assert compare.done(config(tiny_dir, out, "weighted_sum", epochs=2, seed=0))


def test_a_resume_from_an_earlier_checkpoint_logs_each_epoch_once(tiny_dir, tmp_path):
    """Issue 39 item 7: a run resumed from an earlier checkpoint (or killed between its metrics
    line and its save) logged epochs again ([0, 1, 1]). The records from the resumed epoch on are
    replaced by the new attempt's."""
    Trainer.from_config(config(tiny_dir, tmp_path, "weighted_sum", epochs=2)).train()
    again = Trainer.from_config(config(tiny_dir, tmp_path, "weighted_sum", epochs=2))
    again.resume(tmp_path / "checkpoints" / "step-000001")
    (epoch1,) = again.train()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [0, 1]
    assert json.loads(lines[1]) == json.loads(json.dumps(epoch1))  # the new attempt's record


def test_a_resume_after_a_kill_in_the_middle_of_a_metrics_line_rewrites_it(tiny_dir, one_epoch_run, tmp_path):
    """Issue 39 item 6: a resumed run appended to a line cut off by a kill, and died at its end
    reading the file (plot_run); the cut-off line is left out (with a warning) and the file
    rewritten whole."""
    run = copy_run(one_epoch_run, tmp_path / "run")
    with (run / "metrics.jsonl").open("a") as file:
        file.write('{"epoch": 1, "seconds": 4.2, "reward/sharp')
    resumed = Trainer.from_config(config(tiny_dir, run, "marble", epochs=2))
    resumed.resume("latest")
    with pytest.warns(UserWarning, match=r"metrics\.jsonl': its last line is cut off"):
        resumed.train()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [0, 1]
    assert (run / "curves.png").stat().st_size > 0


# ---- sampling.resolution drives the latents (issue 38) ---------------------------------------------


def sd35m_like_pipeline() -> StableDiffusion3Pipeline:
    """The smoke transformer with SD3.5-M's ``sample_size`` 128 (a positional embedding of 64 x 2
    = 128 latents a side), in a pipeline whose VAE has SD3's scale factor 8."""
    from diffusers import SD3Transformer2DModel

    smoke = models.tiny_sd3("smoke").transformer.config
    transformer = SD3Transformer2DModel.from_config({**smoke, "sample_size": 128, "pos_embed_max_size": 64})
    return models.tiny_pipeline(transformer, vae_scale_factor=8, clip_length=16, t5_length=16)


def test_sampling_resolution_sets_the_latents_of_training_and_evaluation(tiny_dir, tmp_path):
    """The trainer sampled ``transformer.config.sample_size`` latents whatever the resolution: on
    SD3.5-M 128, i.e. 1024 px images where the configs ask for 512."""
    for resolution, side in ((512, 64), (256, 32)):
        data = config(tiny_dir, tmp_path / str(resolution), "weighted_sum").to_dict()
        data["sampling"].update(resolution=resolution, eval_prompts="shapes:heldout:2", eval_num_steps=1)
        pipeline = sd35m_like_pipeline()
        trainer = Trainer.from_config(Config.from_dict(data), pipeline=pipeline)
        assert trainer.pipeline is pipeline
        assert trainer.transformer.config.sample_size == 128
        batch = trainer.sample(0)
        assert batch.latents.shape == (4, 16, side, side)
        assert batch.images.shape == (4, 3, resolution, resolution)
        trainer.evaluate()
        assert trainer.eval_images.shape == (2, 3, resolution, resolution)


@given(
    patch=st.sampled_from([1, 2, 4]),
    levels=st.integers(0, 4),
    largest=st.none() | st.integers(1, 96),
    resolution=st.integers(1, 3000),
)
def test_latent_size_is_the_resolution_over_the_scale_factor_where_the_model_reads_it(
    patch, levels, largest, resolution
):
    """``resolution / vae_scale_factor`` latents a side when the resolution is a multiple of
    ``scale x patch`` and within the positional embedding; otherwise a ValueError whose suggested
    resolutions are valid ones."""
    scale = 2**levels
    transformer = {"patch_size": patch, "pos_embed_max_size": largest}
    fits = resolution % (scale * patch) == 0 and (largest is None or resolution <= largest * patch * scale)
    if fits:
        assert models.latent_size(resolution, transformer, scale) == resolution // scale
        return
    with pytest.raises(ValueError, match=f"^{resolution} px") as info:
        models.latent_size(resolution, transformer, scale)
    message = str(info.value)
    if resolution % (scale * patch):
        suggested = [int(n) for n in re.search(r"e\.g\. (\d+)(?: or (\d+))? px", message).groups() if n]
        assert all(n % (scale * patch) == 0 and n > 0 for n in suggested), message
        assert suggested[0] <= resolution <= suggested[-1] or suggested == [scale * patch], message
    else:
        most = int(re.search(r"(\d+) px at most", message).group(1))
        assert models.latent_size(most, transformer, scale) == largest * patch
        assert most < resolution


def test_under_bf16_every_transformer_forward_runs_in_bfloat16_and_what_they_feed_in_float32(
    tiny_dir, tmp_path
):
    """train.mixed_precision bf16 on the CPU: sampling, the old and reference velocities and the
    trained one all compute their products in bfloat16 (attention's softmax product in float32);
    latents, losses, gradients and the LoRA weights are float32."""
    trainer = Trainer.from_config(config(tiny_dir, tmp_path, "marble", mixed_precision="bf16"))
    assert {type(p) for p in trainer.transformer.attn_processors.values()} == {Float32Attention}
    seen: list[torch.dtype] = []
    layer = trainer.transformer.transformer_blocks[0].ff.net[2]  # a linear layer of every forward
    handle = layer.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    try:
        batch = trainer.score(trainer.sample(0))
        assert len(seen) == trainer.config.sampling.num_steps  # one forward per sampler step
        assert batch.latents.dtype == torch.float32
        seen.clear()
        advantages = trainer.advantages(batch, 0)[batch.local]
        losses, kl = trainer.losses(
            batch, torch.arange(2), advantages[:2], 0, torch.randn_like(batch.latents[:2])
        )
    finally:
        handle.remove()
    assert seen == [torch.bfloat16] * 3  # old, reference, trained
    assert losses.dtype == kl.dtype == torch.float32
    (losses.sum() + kl).backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trainer.params)
