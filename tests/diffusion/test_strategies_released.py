"""MARBLE as released: its schedule, its solve, and its steps on a tiny SD3 against the release's
formulas written out here from the notes on aim-uofa/MARBLE (independently of the strategy)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy.optimize import minimize

import mogo
from mogo_diffusion.checkpoint import load_checkpoint
from mogo_diffusion.config import Config, ConfigError
from mogo_diffusion.released_marble import (
    NORM_FLOOR,
    ReleasedSchedule,
    combined_advantage,
    released_direction,
    slsqp_alpha,
)
from mogo_diffusion.strategies import STATE_KEY
from mogo_diffusion.train import MicroBatch, Trainer
from tests.diffusion.strategy_runs import with_strategy
from tests.diffusion.test_train import WORKER, config, flat, forward, one_step
from tests.launch import accelerate_launch, launch

NAN = math.nan
EPS32 = torch.finfo(torch.float32).eps


def released_config(tiny_dir, out, **strategy) -> Config:
    return with_strategy(tiny_dir, out, name="marble_released", **strategy)


# ---- the schedule -----------------------------------------------------------------------------


def test_the_release_recipe_solves_all_of_step_0_then_the_first_micro_step_of_every_tenth():
    schedule = ReleasedSchedule(5, every=10, warmup=1, ema=0.7)
    solved = []
    for _ in range(31):
        step = []
        for _ in range(4):  # micro-steps
            step.append(schedule.solving())
            if step[-1]:
                schedule.blend(torch.full((5,), 0.2))
        solved.append(step)
        schedule.step += 1
    for step, pattern in enumerate(solved):
        expected = [True] * 4 if step == 0 else [True, False, False, False] if step % 10 == 0 else [False] * 4
        assert pattern == expected, step
    assert schedule.solves == 4 + 3


@given(
    st.lists(
        st.lists(st.floats(0, 1), min_size=3, max_size=3).filter(lambda a: sum(a) > 0), min_size=1, max_size=6
    )
)
def test_the_cached_alpha_is_the_ema_of_the_solves_and_stays_on_the_simplex(solves):
    schedule = ReleasedSchedule(3, every=10, warmup=1, ema=0.7)
    fresh = [torch.tensor(a, dtype=torch.float64) / sum(a) for a in solves]
    for alpha in fresh:
        schedule.blend(alpha)
    expected = fresh[0]
    for alpha in fresh[1:]:
        expected = 0.7 * expected + 0.3 * alpha
    torch.testing.assert_close(schedule.cached, expected, rtol=0, atol=1e-15)
    assert abs(float(schedule.cached.sum()) - 1) < 1e-12
    assert bool((schedule.cached >= 0).all())


def test_fixed_alphas_never_solve_and_the_state_round_trips():
    fixed = ReleasedSchedule(3, every=10, warmup=1, ema=0.7, fixed=[1 / 3] * 3)
    assert not fixed.solving()
    assert fixed.cached.tolist() == [1 / 3] * 3
    schedule = ReleasedSchedule(2, every=10, warmup=1, ema=0.7)
    schedule.blend(torch.tensor([0.25, 0.75]))
    schedule.step = 7
    copy = ReleasedSchedule(2, every=10, warmup=1, ema=0.7)
    copy.load_state_dict(schedule.state_dict())
    assert (
        copy.state_dict()
        == schedule.state_dict()
        == {"step": 7, "last_solve": 0, "solves": 1, "cached": [0.25, 0.75]}
    )
    with pytest.raises(ValueError, match=r"step: must be a non-negative integer.*cached: must be None or 2"):
        copy.load_state_dict({"step": -1, "last_solve": 0, "solves": 1, "cached": [0.5]})
    assert copy.state_dict()["step"] == 7  # nothing changed
    with pytest.raises(ValueError, match="fixed alphas must be 2 finite non-negative"):
        ReleasedSchedule(2, every=10, warmup=1, ema=0.7, fixed=[1.0, -0.5])


# ---- one solve ---------------------------------------------------------------------------------


@st.composite
def gradients(draw):
    K, P = draw(st.integers(2, 5)), draw(st.integers(2, 6))
    entries = st.floats(-4, 4, allow_nan=False).map(lambda x: round(x, 2))
    rows = draw(st.lists(st.lists(entries, min_size=P, max_size=P), min_size=K, max_size=K))
    scales = draw(st.lists(st.sampled_from([1e-3, 1.0, 1e3]), min_size=K, max_size=K))
    return torch.tensor(rows, dtype=torch.float64) * torch.tensor(scales, dtype=torch.float64)[:, None]


@given(gradients())
def test_slsqp_reaches_the_min_norm_point_within_its_tolerance(grads):
    norms = grads.norm(dim=1)
    if not bool((norms > NORM_FLOOR).all()):
        return
    unit = grads / norms[:, None]
    gram = (unit @ unit.T).numpy()
    alpha = slsqp_alpha(gram)
    assert abs(alpha.sum() - 1) < 1e-12
    assert (alpha >= 0).all()
    best = mogo.min_norm(torch.from_numpy(gram))
    # SLSQP stops when the objective changes by less than ftol = 1e-8; unit gradients: G_kk = 1
    assert 0.5 * alpha @ gram @ alpha <= 0.5 * float(best.value) + 1e-6


@given(gradients(), st.sampled_from(["slsqp", "exact"]))
def test_a_solve_is_the_mean_norm_times_the_combination_of_unit_gradients(grads, solver):
    alpha, direction = released_direction(grads, solver)
    norms = grads.norm(dim=1)
    kept = norms > NORM_FLOOR
    assert bool((alpha[~kept] == 0).all())
    if int(kept.sum()) >= 2:
        unit = grads[kept] / norms[kept, None]
        expected = norms[kept].mean() * (alpha[kept] @ unit)
        torch.testing.assert_close(direction, expected, rtol=1e-12, atol=1e-12 * float(norms.max()))
        assert abs(float(alpha.sum()) - 1) < 1e-12
        # alpha near the min-norm point: the direction opposes no unit gradient beyond the
        # solver's tolerance (KKT: <d, u_k> >= ||d||^2 at the optimum)
        assert float((unit @ direction).min()) >= -1e-3 * float(norms[kept].mean())


def test_dropped_gradients_non_finite_entries_and_the_single_gradient_case():
    g = torch.tensor([[3.0, 4.0], [0.0, 0.0], [NAN, 1.0]])
    alpha, direction = released_direction(g)  # row 2 counts as (0, 1) once its NaN is 0
    assert alpha[1] == 0
    assert alpha[0] > 0
    assert alpha[2] > 0
    alpha, direction = released_direction(torch.tensor([[3.0, 4.0], [0.0, 1e-13]]))
    assert alpha.tolist() == [1.0, 0.0]
    assert direction.tolist() == [3.0, 4.0]
    alpha, direction = released_direction(torch.zeros(2, 3))
    assert alpha.tolist() == [0.0, 0.0]
    assert direction.tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="solver must be one of slsqp, exact"):
        released_direction(g, "qp")


def test_the_combined_advantage_counts_a_non_applicable_reward_as_zero():
    A = torch.tensor([[1.0, NAN], [-2.0, 4.0]])
    assert combined_advantage(A, torch.tensor([0.25, 0.75])).tolist() == [0.25, 2.5]


# ---- the release's formulas on a tiny SD3 ----------------------------------------------------

C, BETA, KL = 5.0, 0.1, 1e-4  # adv_clip, nft.beta and kl_coef of the test config


def release_policy_loss(v, v_old, x_t, x0, t, A):
    """The release's per-sample NFT loss ``l = C (r P + (1 - r) N) / b`` (``[b]``) for advantages
    ``A [b]``, written from its formulas: ``v+ = b v + (1 - b) v_old``, ``v- = (1 + b) v_old - b v``,
    errors self-normalised by ``max(mean |x0_hat - x0|, 1e-5)`` with no gradient, and
    ``r = clamp(clip(A, C) / (2C) + 1/2, 0, 1)``."""
    t = torch.as_tensor(t)
    errors = []
    for velocity in (BETA * v + (1 - BETA) * v_old, (1 + BETA) * v_old - BETA * v):
        diff = x_t - t * velocity - x0
        scale = diff.detach().abs().mean(dim=(1, 2, 3)).clamp_min(1e-5)
        errors.append(diff.square().mean(dim=(1, 2, 3)) / scale)
    P, N = errors
    r = (A.clamp(-C, C) / (2 * C) + 0.5).clamp(0, 1).to(P)
    return C * (r * P + (1 - r) * N) / BETA


def kl_term(v, v_ref):
    return KL * (v - v_ref).square().mean()


def grad(loss, params):
    return flat(torch.autograd.grad(loss, params, retain_graph=True))


def with_a_masked_reward(advantages: torch.Tensor) -> torch.Tensor:
    """The step's advantages with reward 1 not applying to two of its rows (NaN), as OCR on prompts
    without text; the rest unclipped, as the release's advantages are."""
    advantages = advantages.clone()
    advantages[[0, 2], 1] = NAN
    return advantages


def test_an_amortized_micro_step_is_the_releases_formula(tiny_dir, tmp_path):
    trainer = Trainer.from_config(released_config(tiny_dir, tmp_path))
    schedule = trainer.strategy.schedule
    schedule.blend(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64))  # a solve of step 0
    schedule.step = 3  # within N steps of it: amortized
    batch, advantages, index, timesteps, noise = one_step(trainer)
    adv = with_a_masked_reward(advantages[index])
    combined = sum(alpha * adv[:, k].nan_to_num(0.0) for k, alpha in enumerate([0.5, 0.3, 0.2]))
    expected_grad, expected_losses = 0, []
    for j, eps in zip(timesteps, noise, strict=True):
        v, v_old, v_ref, x_t, x0, t = forward(trainer, batch, index, j, eps)
        policy = release_policy_loss(v, v_old, x_t, x0, t, combined).mean()  # every sample, no mask
        expected_losses.append(policy.detach())
        expected_grad = expected_grad + grad(policy + kl_term(v, v_ref), trainer.params)
    for j, eps, loss in zip(timesteps, noise, expected_losses, strict=True):
        losses, _ = trainer.losses(batch, index, adv, j, eps)
        assert losses.shape == (1,)
        # float32 means of 3 x 4 x 4 x 16 values, in another order
        torch.testing.assert_close(losses[0], loss, rtol=64 * EPS32, atol=0)
    trainer.gradients(batch, [MicroBatch(index, adv, timesteps, noise)])
    tolerance = 64 * EPS32 * float(expected_grad.abs().max())
    torch.testing.assert_close(flat(p.grad for p in trainer.params), expected_grad, rtol=0, atol=tolerance)
    assert schedule.solves == 1
    assert schedule.cached.tolist() == pytest.approx([0.5, 0.3, 0.2], abs=1e-15)


def test_a_solving_micro_step_is_the_releases_formula_and_blends_alpha(tiny_dir, tmp_path):
    trainer = Trainer.from_config(released_config(tiny_dir, tmp_path))
    batch, advantages, index, timesteps, noise = one_step(trainer)  # step 0: both micro-steps solve
    adv = with_a_masked_reward(advantages[index])
    expected_grad, fresh = 0, []
    for j, eps in zip(timesteps, noise, strict=True):
        v, v_old, v_ref, x_t, x0, t = forward(trainer, batch, index, j, eps)
        rows = []
        for k in range(3):  # each reward's masked mean: sum(mask * l) / max(sum(mask), 1), NaN as 0
            mask = ~torch.isnan(adv[:, k])
            losses = release_policy_loss(v, v_old, x_t, x0, t, adv[:, k].nan_to_num(0.0))
            rows.append(grad((mask * losses).sum() / max(int(mask.sum()), 1), trainer.params).double())
        g = torch.stack(rows)
        norms = g.norm(dim=1)
        unit = g / norms[:, None]
        G = (unit @ unit.T).numpy()
        solved = minimize(
            lambda a, G=G: 0.5 * a @ G @ a, np.full(3, 1 / 3), jac=lambda a, G=G: G @ a, method="SLSQP",
            bounds=[(0, 1)] * 3, constraints=[{"type": "eq", "fun": lambda a: a.sum() - 1}],
            options={"ftol": 1e-8, "maxiter": 500},
        )  # fmt: skip
        assert solved.success
        alpha = np.clip(solved.x, 0, None) / np.clip(solved.x, 0, None).sum()
        fresh.append(torch.from_numpy(alpha))
        direction = norms.mean() * (torch.from_numpy(alpha) @ unit)
        expected_grad = expected_grad + direction.float() + grad(kl_term(v, v_ref), trainer.params)
    assert trainer.strategy.traverses_twice()  # K gradients through one graph: run eagerly
    trainer.gradients(batch, [MicroBatch(index, adv, timesteps, noise)])
    # SLSQP's iterates depend on the float32 gradients' round-off: alpha agrees to its tolerance
    schedule = trainer.strategy.schedule
    torch.testing.assert_close(schedule.cached, 0.7 * fresh[0] + 0.3 * fresh[1], rtol=0, atol=1e-5)
    tolerance = 1e-5 * float(expected_grad.abs().max())
    torch.testing.assert_close(flat(p.grad for p in trainer.params), expected_grad, rtol=0, atol=tolerance)
    assert schedule.solves == 2
    assert schedule.last_solve == 0
    trainer.update()
    assert schedule.step == 1
    assert not schedule.solving()  # step 1 reuses the cached alpha
    assert not trainer.strategy.traverses_twice()


def test_the_exact_solver_gives_the_min_norm_point_of_the_unit_gradients(tiny_dir, tmp_path):
    trainer = Trainer.from_config(released_config(tiny_dir, tmp_path, solver="exact"))
    batch, advantages, index, timesteps, noise = one_step(trainer, steps=1)
    trainer.gradients(batch, [MicroBatch(index, advantages[index], timesteps, noise)])
    alpha = trainer.strategy.schedule.cached
    assert abs(float(alpha.sum()) - 1) < 1e-12
    assert bool((alpha >= 0).all())


def test_the_schedule_resumes_from_the_optimizer_state_and_a_bad_one_changes_nothing(tiny_dir, tmp_path):
    trainer = Trainer.from_config(released_config(tiny_dir, tmp_path, harmonize_every=3))
    trainer.train_epoch(0)
    trainer.train_epoch(1)
    saved = trainer.optimizer.state_dict()
    assert saved[STATE_KEY] == trainer.strategy.schedule.state_dict()
    assert saved[STATE_KEY]["step"] == 2
    assert saved[STATE_KEY]["solves"] == 2
    other = Trainer.from_config(released_config(tiny_dir, tmp_path / "b", harmonize_every=3))
    other.optimizer.load_state_dict(saved)
    assert other.strategy.schedule.state_dict() == saved[STATE_KEY]
    bad = {**saved, STATE_KEY: {**saved[STATE_KEY], "cached": [1.0]}}
    with pytest.raises(ValueError, match="cached: must be None or 3 finite numbers"):
        other.optimizer.load_state_dict(bad)
    assert other.strategy.schedule.state_dict() == saved[STATE_KEY]
    with pytest.raises(ValueError, match="holds no 'strategy' entry of the marble_released strategy"):
        other.optimizer.load_state_dict({k: v for k, v in saved.items() if k != STATE_KEY})


def test_equal_alpha_never_solves_and_trains_on_the_mean_advantage(tiny_dir, tmp_path):
    trainer = Trainer.from_config(released_config(tiny_dir, tmp_path, alpha="equal"))
    trainer.train_epoch(0)
    metrics = trainer.strategy.metrics()
    assert metrics["solves"] == 0
    assert [metrics[f"alpha/{n}"] for n in trainer.names] == [1 / 3] * 3


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"nft": {"std_scope": "group"}}, r"nft\.std_scope: the marble_released strategy normalises"),
        ({"nft": {"nonapplicable": "neutral"}}, r"nft\.nonapplicable: the marble_released strategy"),
        ({"strategy": {"alpha": [0.5, 0.5]}}, r"strategy\.alpha: fixed alphas must be 3 finite"),
        ({"strategy": {"alpha": "equl"}}, r"strategy\.alpha: must be one of 'solved', 'equal', got 'equl'"),
        ({"strategy": {"solver": "cvx"}}, r"strategy\.solver: must be one of 'slsqp', 'exact'"),
    ],
)
def test_bad_settings_are_named(tiny_dir, tmp_path, change, message):
    from mogo_diffusion.strategies import make_strategy

    data = released_config(tiny_dir, tmp_path).to_dict()
    for section, values in change.items():
        data[section].update(values)
    with pytest.raises(ConfigError, match=message):
        make_strategy(Config.from_dict(data))


def test_under_two_processes_the_released_solve_and_famo_keep_the_ranks_identical(tiny_dir, tmp_path):
    """Each reward's gradient is averaged over the processes before the solve (one all-reduce,
    real gloo), and famo's weights come from the gathered rewards: the ranks stay identical."""
    paths = []
    for name, strategy in (
        ("released", {"name": "marble_released", "harmonize_every": 2}),
        ("famo", {"name": "famo", "window": 2}),
    ):
        data = config(tiny_dir, tmp_path / name, batch_size=2).to_dict()
        data["strategy"] = strategy
        paths.append(tmp_path / f"{name}.yaml")
        Config.from_dict(data).save(paths[-1])
    command = [*accelerate_launch(), str(WORKER), str(tmp_path), *map(str, paths)]
    ranks = launch(command, tmp_path, env={"ACCELERATE_USE_CPU": "1"})
    for path in paths:
        first, second = (rank[path.stem] for rank in ranks)
        assert torch.equal(first["params"], second["params"])
    saved = load_checkpoint(tmp_path / "released" / "checkpoints" / "step-000002")
    assert saved["optimizer"][STATE_KEY]["solves"] == 2  # step 0: one micro-batch of 2 timesteps
