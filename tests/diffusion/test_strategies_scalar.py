"""One-advantage strategies beyond the weighted sum: normalize_then_sum (GDPO) and famo, whose
weights move with the rewards' improvement rates (property tests of its math, and in the trainer)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mogo_diffusion.advantages import normalize_then_sum, weighted_sum_advantages, zscore_rewards
from mogo_diffusion.config import Config, ConfigError
from mogo_diffusion.reward_rates import ImprovementWeights, improvement_rates, logit_step
from mogo_diffusion.strategies import STATE_KEY, make_strategy
from mogo_diffusion.train import Trainer
from tests.diffusion.strategy_runs import with_strategy

WEIGHTS = (1.0, 2.0, 0.5)


# ---- normalize_then_sum ------------------------------------------------------------------------


def test_normalize_then_sum_trains_on_gdpos_advantage_with_the_rewards_weights(tiny_dir, tmp_path):
    strategy = {"name": "normalize_then_sum", "std_scope": "batch", "bessel": False, "rescale_masked": True}
    trainer = Trainer.from_config(with_strategy(tiny_dir, tmp_path, WEIGHTS, **strategy))
    batch = trainer.score(trainer.sample(0))
    expected = normalize_then_sum(
        batch.rewards, [1.0, 2.0, 0.5], batch.prompts, std_scope="batch", ddof=0, rescale_masked=True
    )
    torch.testing.assert_close(trainer.advantages(batch, 0)[:, 0], expected, rtol=0, atol=0)
    data = with_strategy(tiny_dir, tmp_path, WEIGHTS, **strategy).to_dict()
    for spec in data["rewards"]:
        spec["weight"] = None  # no weights: 1 each
    unweighted = make_strategy(Config.from_dict(data)).advantages(batch.rewards, batch.prompts, 0)
    torch.testing.assert_close(unweighted[:, 0], normalize_then_sum(batch.rewards, [1.0] * 3, batch.prompts,
                               std_scope="batch", ddof=0, rescale_masked=True))  # fmt: skip


# ---- famo: the math ----------------------------------------------------------------------------

rates = st.floats(-1, 1, allow_nan=False).map(lambda x: round(x, 3))


@st.composite
def problems(draw):
    K = draw(st.integers(1, 5))
    logits = torch.tensor(draw(st.lists(st.floats(-3, 3), min_size=K, max_size=K)), dtype=torch.float64)
    delta = torch.tensor(draw(st.lists(rates, min_size=K, max_size=K)), dtype=torch.float64)
    return logits, delta


@given(problems(), st.floats(0.01, 10))
def test_a_step_is_famos_update_through_autograd(problem, lr):
    """FAMO's code: ``w.grad = autograd.grad(softmax(w), w, grad_outputs=delta)``, then a descent step."""
    logits, delta = problem
    w = logits.clone().requires_grad_()
    (vjp,) = torch.autograd.grad(torch.softmax(w, 0), w, grad_outputs=delta)
    torch.testing.assert_close(logit_step(logits, delta, lr), logits - lr * vjp, rtol=1e-12, atol=1e-12)


@given(problems(), st.floats(0.01, 10), st.randoms(use_true_random=False))
def test_weights_stay_on_the_simplex_and_permute_with_the_rewards(problem, lr, rng):
    logits, delta = problem
    stepped = torch.softmax(logit_step(logits, delta, lr), 0)
    assert abs(float(stepped.sum()) - 1) < 1e-12
    assert bool((stepped >= 0).all())
    order = list(range(len(logits)))
    rng.shuffle(order)
    moved = torch.softmax(logit_step(logits[order], delta[order], lr), 0)
    torch.testing.assert_close(moved, stepped[order], rtol=1e-12, atol=1e-15)


@given(problems(), st.floats(-1, 1), st.floats(0.01, 10))
def test_equal_improvements_leave_the_weights_unchanged(problem, rate, lr):
    logits, _ = problem
    stepped = logit_step(logits, torch.full_like(logits, rate), lr)
    torch.testing.assert_close(torch.softmax(stepped, 0), torch.softmax(logits, 0), rtol=0, atol=1e-14)


@given(problems(), st.floats(0.01, 10))
def test_the_slowest_reward_gains_logit_and_the_fastest_loses_it(problem, lr):
    logits, delta = problem
    change = logit_step(logits, delta, lr) - logits
    round_off = 4 * lr * torch.finfo(torch.float64).eps * float(delta.abs().max())  # of <z, delta>
    assert float(change[int(delta.argmin())]) >= -round_off
    assert float(change[int(delta.argmax())]) <= round_off


@given(problems(), st.data())
def test_a_reward_without_a_rate_keeps_its_logit(problem, data):
    logits, delta = problem
    k = data.draw(st.integers(0, len(logits) - 1))
    delta[k] = math.nan
    stepped = logit_step(logits, delta, 1.0)
    assert float(stepped[k]) == pytest.approx(float(logits[k]), abs=1e-12)
    assert bool(torch.isfinite(stepped).all())


@given(
    st.lists(st.lists(st.floats(-2, 2), min_size=2, max_size=2), min_size=2, max_size=6), st.floats(0.1, 2)
)
def test_an_improvement_rate_is_the_least_squares_slope_in_units_of_the_spread(means, spread):
    means_t = torch.tensor(means, dtype=torch.float64)
    epochs = list(range(3, 3 + len(means)))
    found = improvement_rates(epochs, means_t, torch.full_like(means_t, spread))
    for k in range(2):
        slope = np.polyfit(epochs, means_t[:, k].numpy(), 1)[0]
        assert float(found[k]) == pytest.approx(slope / spread, rel=1e-9, abs=1e-9)
    no_spread = improvement_rates(epochs, means_t, torch.zeros_like(means_t))
    assert bool(torch.isnan(no_spread).all())


def test_weights_move_once_the_window_is_full_and_an_epoch_counts_once():
    weights = ImprovementWeights([1.0, 3.0], window=3, lr=5.0)
    assert weights.weights.tolist() == pytest.approx([0.25, 0.75])
    ones = torch.ones(2)
    for epoch, mean in enumerate([0.0, 0.1]):
        weights.observe(epoch, torch.tensor([mean, 0.0]), ones)
    assert weights.weights.tolist() == pytest.approx([0.25, 0.75])  # two of three epochs: no step
    weights.observe(2, torch.tensor([0.2, 0.0]), ones)
    after = weights.weights.tolist()
    assert after[0] < 0.25  # reward 0 improved by 0.1 std an epoch, reward 1 did not
    weights.observe(2, torch.tensor([0.9, 0.0]), ones)  # the same epoch again: no new evidence
    assert weights.weights.tolist() == after
    with pytest.raises(ValueError, match="epoch 1 is before the last observed epoch 2"):
        weights.observe(1, torch.zeros(2), ones)
    copy = ImprovementWeights([1.0, 3.0], window=3, lr=5.0)
    copy.load_state_dict(weights.state_dict())
    assert copy.state_dict() == weights.state_dict()
    with pytest.raises(ValueError, match=r"logits: must be 2 finite numbers.*means: must be one row"):
        copy.load_state_dict({**weights.state_dict(), "logits": [0.0], "means": [[0.0]]})
    assert copy.state_dict() == weights.state_dict()  # nothing changed
    with pytest.raises(ValueError, match="prior must be positive"):
        ImprovementWeights([1.0, 0.0], window=3, lr=1.0)
    with pytest.raises(ValueError, match="window must be an integer >= 2"):
        ImprovementWeights([1.0], window=1, lr=1.0)


# ---- famo in the trainer -----------------------------------------------------------------------


def test_famo_weighs_each_epochs_sum_by_its_weights_and_resumes_them(tiny_dir, tmp_path):
    trainer = Trainer.from_config(with_strategy(tiny_dir, tmp_path, WEIGHTS, name="famo", window=2, lr=50.0))
    strategy = trainer.strategy
    assert strategy.weights() == pytest.approx([1 / 3.5, 2 / 3.5, 0.5 / 3.5])
    for epoch in range(3):
        trainer.train_epoch(epoch)
    weights = strategy.weights()
    assert weights != pytest.approx([1 / 3.5, 2 / 3.5, 0.5 / 3.5])  # moved after epochs 1 and 2
    assert sum(weights) == pytest.approx(1, abs=1e-12)
    assert trainer.strategy.metrics() == {
        f"weight/{n}": w for n, w in zip(trainer.names, weights, strict=True)
    }
    batch = trainer.score(trainer.sample(3))
    rewards = batch.rewards
    advantages = trainer.advantages(batch, 3)[:, 0]  # epoch 3's rewards move the weights first
    expected = weighted_sum_advantages(zscore_rewards(rewards), strategy.weights(), batch.prompts)
    torch.testing.assert_close(advantages, expected, rtol=0, atol=0)
    saved = trainer.optimizer.state_dict()
    assert saved[STATE_KEY] == strategy.rates.state_dict()
    other = Trainer.from_config(
        with_strategy(tiny_dir, tmp_path / "b", WEIGHTS, name="famo", window=2, lr=50.0)
    )
    other.optimizer.load_state_dict(saved)
    assert other.strategy.weights() == strategy.weights()


def test_famo_needs_positive_starting_weights(tiny_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"rewards\.1\.weight: the famo strategy's weights start there"):
        make_strategy(with_strategy(tiny_dir, tmp_path, (1.0, 0.0, 1.0), name="famo"))
