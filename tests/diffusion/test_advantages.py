"""Group-normalised advantages: a loop reference, invariances, masking and errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mogo_diffusion.advantages import (
    nan_mean,
    normalize_then_sum,
    per_reward_advantages,
    weighted_sum_advantages,
    zscore_rewards,
)

NAN = float("nan")


def reference(R, groups, *, std_scope="batch", C=5.0, eps=1e-4):
    """Advantages by loops over rewards and samples, with numpy's (population) mean and std."""
    R = np.asarray(R, dtype=np.float64)
    out = np.full(R.shape, np.nan)
    for k in range(R.shape[1]):
        valid = ~np.isnan(R[:, k])
        batch_std = np.std(R[valid, k]) if valid.any() else 0.0
        for i in np.flatnonzero(valid):
            members = [j for j in range(len(groups)) if groups[j] == groups[i] and valid[j]]
            std = batch_std if std_scope == "batch" else np.std(R[members, k])
            out[i, k] = np.clip((R[i, k] - np.mean(R[members, k])) / (std + eps), -C, C)
    return out


# Rewards on a grid of 1/8: a non-zero spread is never lost to round-off.
values = st.one_of(st.integers(-40, 40).map(lambda n: n / 8), st.just(NAN))


@st.composite
def batches(draw, min_size=1):
    B = draw(st.integers(min_size, 10))
    K = draw(st.integers(1, 3))
    rewards = draw(st.lists(st.lists(values, min_size=K, max_size=K), min_size=B, max_size=B))
    groups = draw(st.lists(st.integers(0, 3), min_size=B, max_size=B))
    return torch.tensor(rewards, dtype=torch.float64), groups


@given(batches(), st.sampled_from(["batch", "group"]))
def test_matches_the_loop_reference(batch, std_scope):
    R, groups = batch
    A = per_reward_advantages(R, groups, std_scope=std_scope)
    np.testing.assert_allclose(
        A.numpy(), reference(R.numpy(), groups, std_scope=std_scope), rtol=1e-12, atol=1e-12
    )


@given(batches(), st.floats(0.01, 100), st.floats(-100, 100), st.sampled_from(["batch", "group"]), st.data())
def test_affine_invariance_of_one_reward(batch, scale, shift, std_scope, data):
    # (s R + c - mean) / (s std + eps) = (R - mean) / (std + eps / s): exact, with eps rescaled.
    R, groups = batch
    k = data.draw(st.integers(0, R.shape[1] - 1))
    moved = R.clone()
    moved[:, k] = scale * R[:, k] + shift
    A = per_reward_advantages(moved, groups, std_scope=std_scope)
    expected = per_reward_advantages(R[:, k : k + 1], groups, std_scope=std_scope, eps=1e-4 / scale)[:, 0]
    torch.testing.assert_close(A[:, k], expected, rtol=1e-7, atol=1e-7, equal_nan=True)
    others = [j for j in range(R.shape[1]) if j != k]
    torch.testing.assert_close(
        A[:, others], per_reward_advantages(R, groups, std_scope=std_scope)[:, others], equal_nan=True
    )


@given(batches(), st.sampled_from(["batch", "group"]))
def test_zero_mean_in_every_group(batch, std_scope):
    R, groups = batch
    A = per_reward_advantages(R, groups, std_scope=std_scope, adv_clip=math.inf)
    for g in set(groups):
        rows = A[[i for i, h in enumerate(groups) if h == g]]
        sums = torch.nansum(rows, dim=0)
        torch.testing.assert_close(sums, torch.zeros_like(sums), rtol=0, atol=1e-9)


@given(batches(), st.floats(0.1, 3.0))
def test_clipping_bound(batch, C):
    R, groups = batch
    A = per_reward_advantages(R, groups, adv_clip=C)
    assert bool((A[~torch.isnan(A)].abs() <= C).all())


@given(batches(), st.sampled_from(["batch", "group"]))
def test_masked_samples_take_no_part(batch, std_scope):
    R, groups = batch
    A = per_reward_advantages(R, groups, std_scope=std_scope)
    assert torch.equal(torch.isnan(A), torch.isnan(R))
    for k in range(R.shape[1]):
        valid = (~torch.isnan(R[:, k])).nonzero().flatten().tolist()
        if valid:
            alone = per_reward_advantages(
                R[valid, k : k + 1], [groups[i] for i in valid], std_scope=std_scope
            )
            torch.testing.assert_close(A[valid, k], alone[:, 0], rtol=1e-12, atol=1e-12)


@given(batches(), st.randoms(use_true_random=False), st.sampled_from(["batch", "group"]))
def test_permutation_equivariance(batch, rng, std_scope):
    R, groups = batch
    A = per_reward_advantages(R, groups, std_scope=std_scope)
    order = list(range(len(groups)))
    rng.shuffle(order)
    permuted = per_reward_advantages(R[order], [groups[i] for i in order], std_scope=std_scope)
    torch.testing.assert_close(permuted, A[order], rtol=1e-12, atol=1e-12, equal_nan=True)
    labels = list(range(4))
    rng.shuffle(labels)
    relabelled = per_reward_advantages(R, [f"prompt {labels[g]}" for g in groups], std_scope=std_scope)
    torch.testing.assert_close(relabelled, A, rtol=0, atol=0, equal_nan=True)
    as_tensor = per_reward_advantages(
        R, torch.tensor([10 * labels[g] - 7 for g in groups]), std_scope=std_scope
    )
    torch.testing.assert_close(as_tensor, A, rtol=0, atol=0, equal_nan=True)


def test_edge_cases_give_no_spurious_nan():
    R = torch.tensor([[1.0, NAN, 2.0], [3.0, NAN, 2.0], [5.0, NAN, 2.0]])
    A = per_reward_advantages(R, [0, 0, 1])
    assert torch.isnan(A[:, 1]).all()
    assert A[2, 0].item() == 0.0  # alone in its group
    assert torch.equal(A[:, 2], torch.zeros(3))  # constant reward
    torch.testing.assert_close(A[:, 0], per_reward_advantages(R[:, :1], [0, 0, 1])[:, 0])
    for scope in ("batch", "group"):
        assert per_reward_advantages(torch.tensor([[7.0]]), [0], std_scope=scope).item() == 0.0
        assert per_reward_advantages(torch.zeros(0, 2), [], std_scope=scope).shape == (0, 2)


def test_float64_statistics_for_float32_rewards():
    R = (10_000 + torch.tensor([[0.0], [0.01], [0.03], [0.02]])).to(torch.float32)
    A = per_reward_advantages(R, [0, 0, 1, 1])
    assert A.dtype == torch.float32
    np.testing.assert_allclose(A.numpy(), reference(R.double().numpy(), [0, 0, 1, 1]), rtol=1e-6)


def test_bad_inputs():
    R = torch.zeros(3, 2)
    with pytest.raises(ValueError, match=r"rewards must be a floating \[B, K\]"):
        per_reward_advantages(torch.zeros(3), [0, 0, 0])
    with pytest.raises(ValueError, match=r"rewards must be a floating \[B, K\]"):
        per_reward_advantages(torch.zeros(3, 2, dtype=torch.long), [0, 0, 0])
    with pytest.raises(ValueError, match="group_ids has 2 entries for a batch of 3"):
        per_reward_advantages(R, [0, 0])
    with pytest.raises(ValueError, match="group_ids must be an integer tensor"):
        per_reward_advantages(R, torch.zeros(3))
    with pytest.raises(ValueError, match="std_scope"):
        per_reward_advantages(R, [0, 0, 0], std_scope="prompt")
    with pytest.raises(ValueError, match="adv_clip"):
        per_reward_advantages(R, [0, 0, 0], adv_clip=0)
    with pytest.raises(ValueError, match="eps"):
        per_reward_advantages(R, [0, 0, 0], eps=0)
    with pytest.raises(ValueError, match="names has 1 entries"):
        per_reward_advantages(R, [0, 0, 0], names=["ocr"])
    with pytest.raises(ValueError, match="reward 'ocr' has infinite values"):
        per_reward_advantages(torch.tensor([[0.0, 1.0], [0.0, math.inf]]), [0, 0], names=["pick", "ocr"])


def flow_grpo_reference(R, weights, prompts):
    """Flow-GRPO's PerPromptStatTracker with global std on the weighted-sum reward."""
    total = np.nan_to_num(np.asarray(R, dtype=np.float64)) @ np.asarray(weights, dtype=np.float64)
    prompts = np.array(prompts)
    out = np.empty_like(total)
    for prompt in np.unique(prompts):
        mask = prompts == prompt
        out[mask] = (total[mask] - np.mean(total[mask])) / (np.std(total) + 1e-4)
    return np.clip(out, -5, 5)


@given(batches(), st.data())
def test_weighted_sum_is_the_flow_grpo_advantage(batch, data):
    R, groups = batch
    weights = data.draw(st.lists(st.floats(0, 2), min_size=R.shape[1], max_size=R.shape[1]))
    prompts = [f"prompt {g}" for g in groups]
    A = weighted_sum_advantages(R, weights, prompts)
    assert A.shape == (R.shape[0],)
    np.testing.assert_allclose(
        A.numpy(), flow_grpo_reference(R.numpy(), weights, prompts), rtol=1e-9, atol=1e-9
    )
    summed = torch.nan_to_num(R) @ torch.tensor(weights, dtype=torch.float64)
    torch.testing.assert_close(A, per_reward_advantages(summed[:, None], groups)[:, 0])


def test_weighted_sum_nan_policy():
    R = torch.tensor([[1.0, 0.5], [2.0, NAN], [0.0, 0.1]])
    with pytest.raises(ValueError, match=r"reward 'ocr' is NaN \(not applicable\) for samples \[1\]"):
        weighted_sum_advantages(R, [1.0, 1.0], [0, 0, 0], nan="raise", names=["pick", "ocr"])
    zero = weighted_sum_advantages(R, [1.0, 1.0], [0, 0, 0])
    torch.testing.assert_close(zero, weighted_sum_advantages(torch.nan_to_num(R), [1.0, 1.0], [0, 0, 0]))
    assert not torch.isnan(weighted_sum_advantages(R.nan_to_num(), [1.0, 1.0], [0, 0, 0], nan="raise")).any()
    with pytest.raises(ValueError, match="weights must be 2 finite numbers"):
        weighted_sum_advantages(R, [1.0], [0, 0, 0])
    with pytest.raises(ValueError, match="weights must be 2 finite numbers"):
        weighted_sum_advantages(R, [1.0, NAN], [0, 0, 0])
    with pytest.raises(ValueError, match="nan must be"):
        weighted_sum_advantages(R, [1.0, 1.0], [0, 0, 0], nan="skip")


@given(batches(), st.floats(0.01, 100), st.floats(-100, 100))
def test_zscores_standardise_each_reward_and_forget_its_scale(batch, scale, shift):
    R, _ = batch
    Z = zscore_rewards(R, eps=1e-12)
    assert torch.equal(torch.isnan(Z), torch.isnan(R))
    for k in range(R.shape[1]):
        valid = ~torch.isnan(R[:, k])
        column = R[valid, k].numpy()
        expected = (column - column.mean()) / (column.std() + 1e-12) if len(column) else column
        np.testing.assert_allclose(Z[valid, k].numpy(), expected, rtol=1e-9, atol=1e-9)
        if len(column) and column.std() > 0:  # affine invariance: the weighted sum sees no scale
            moved = zscore_rewards(scale * R + shift, eps=1e-12)[valid, k]
            np.testing.assert_allclose(moved.numpy(), Z[valid, k].numpy(), rtol=1e-6, atol=1e-6)


def test_nan_mean_skips_samples_a_reward_does_not_apply_to():
    values = torch.tensor([[1.0, math.nan, math.nan], [3.0, 4.0, math.nan]])
    means = nan_mean(values)
    assert means[:2].tolist() == [2.0, 4.0]
    assert math.isnan(means[2])


@given(st.lists(st.lists(values, min_size=3, max_size=3), min_size=1, max_size=10))
def test_nan_mean_is_numpys_nanmean(rows):
    R = np.asarray(rows, dtype=np.float64)
    expected = [np.mean(R[~np.isnan(R[:, k]), k]) if (~np.isnan(R[:, k])).any() else np.nan for k in range(3)]
    np.testing.assert_allclose(nan_mean(torch.tensor(R)).numpy(), expected, rtol=1e-15)


# ---- normalize_then_sum (GDPO, TRL's multi_objective_aggregation="normalize_then_sum") ----------


def trl_nanstd(tensor, dim=None, keepdim=False):
    """TRL's ``nanstd`` (trl/trainer/utils.py at f2cd577): Bessel-corrected, NaN for one value."""
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)
    nan = torch.full_like(count, math.nan, dtype=tensor.dtype)
    correction = torch.where(count > 1, count / (count - 1), nan)
    variance = variance * correction
    if not keepdim:
        variance = variance.squeeze(dim) if dim is not None else variance.reshape(())
    return torch.sqrt(variance)


def trl_normalize_then_sum(rewards_per_func, reward_weights, num_generations):
    """TRL's GRPOTrainer branch ``multi_objective_aggregation == "normalize_then_sum"`` (f2cd577),
    transcribed: groups are consecutive runs of ``num_generations`` rows."""
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = trl_nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[1])
    rewards = (reward_k * reward_weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    std_rewards = trl_nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    advantages = (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@st.composite
def grouped_batches(draw):
    """Rewards in ``count`` consecutive groups of ``size`` rows, TRL's layout, and weights."""
    size, count, K = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 3))
    B = size * count
    rows = draw(st.lists(st.lists(values, min_size=K, max_size=K), min_size=B, max_size=B))
    weights = draw(st.lists(st.integers(0, 16).map(lambda n: n / 8), min_size=K, max_size=K))
    return torch.tensor(rows, dtype=torch.float64), size, weights


@given(grouped_batches())
def test_normalize_then_sum_is_trls_formula(batch):
    R, size, weights = batch
    groups = [i // size for i in range(len(R))]
    ours = normalize_then_sum(R, weights, groups, adv_clip=math.inf)  # TRL's defaults, unclipped
    theirs = trl_normalize_then_sum(R, torch.tensor(weights, dtype=torch.float64), size)
    # TRL's Bessel factor count / (count - 1) is a float32 division (int64 tensors): each of the two
    # stds is off by up to 2^-25 relative, so the advantages by up to ~2^-23 of their size
    tolerance = 2**-22
    torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance)
    clipped = normalize_then_sum(R, weights, groups)
    torch.testing.assert_close(clipped, theirs.clamp(-5, 5), rtol=tolerance, atol=tolerance)


@given(batches(), st.randoms(use_true_random=False), st.sampled_from(["batch", "group"]), st.booleans())
def test_normalize_then_sum_is_equivariant_in_samples_and_invariant_in_reward_order(
    batch, rng, scope, rescale
):
    R, groups = batch
    weights = [rng.randint(0, 8) / 4 for _ in range(R.shape[1])]
    options = {"std_scope": scope, "rescale_masked": rescale}
    A = normalize_then_sum(R, weights, groups, **options)
    order = list(range(len(groups)))
    rng.shuffle(order)
    permuted = normalize_then_sum(R[order], weights, [groups[i] for i in order], **options)
    torch.testing.assert_close(permuted, A[order], rtol=1e-12, atol=1e-12)
    columns = list(range(R.shape[1]))
    rng.shuffle(columns)
    swapped = normalize_then_sum(R[:, columns], [weights[k] for k in columns], groups, **options)
    torch.testing.assert_close(swapped, A, rtol=1e-12, atol=1e-12)  # the sum, in another order


@given(batches(), st.sampled_from(["batch", "group"]), st.floats(0.125, 8))
def test_normalize_then_sum_of_one_reward_is_its_weighted_sum_advantage(batch, scope, weight):
    R, groups = batch
    R = R[:, :1]
    one = normalize_then_sum(R, [weight], groups, std_scope=scope, ddof=0, batch_norm=False)
    expected = weight * per_reward_advantages(R, groups, std_scope=scope, adv_clip=math.inf)[:, 0]
    torch.testing.assert_close(one, expected.nan_to_num(0.0).clamp(-5, 5), rtol=0, atol=0)
    scored = ~torch.isnan(R[:, 0])  # the weighted sum of one reward: the same advantage, exactly
    kept = [g for g, s in zip(groups, scored.tolist(), strict=True) if s]
    ws = weighted_sum_advantages(R[scored], [1.0], kept, std_scope=scope)
    unit = normalize_then_sum(R[scored], [1.0], kept, std_scope=scope, ddof=0, batch_norm=False)
    torch.testing.assert_close(unit, ws, rtol=0, atol=0)


@given(batches(min_size=2), st.sampled_from(["batch", "group"]), st.sampled_from([0, 1]))
def test_batch_renormalisation_gives_mean_zero_and_std_one(batch, scope, ddof):
    R, groups = batch
    weights = [1.0] * R.shape[1]
    options = {"std_scope": scope, "ddof": ddof, "adv_clip": math.inf, "eps": 1e-12}
    summed = normalize_then_sum(R, weights, groups, batch_norm=False, **options)
    A = normalize_then_sum(R, weights, groups, **options)
    scored = ~torch.isnan(R).all(dim=1)
    assert torch.equal(A[~scored], torch.zeros_like(A[~scored]))  # no reward applies: 0, as TRL
    kept = A[scored]
    if len(kept) <= ddof or float(summed[scored].std(correction=ddof)) < 1e-6:
        return  # no spread to normalise
    assert abs(float(kept.mean())) < 1e-12 * len(kept)
    assert abs(float(kept.std(correction=ddof)) - 1) < 1e-9


@given(batches(), st.sampled_from(["batch", "group"]), st.data())
def test_rescaling_a_masked_reward_is_weighting_it_by_its_inverse_share(batch, scope, data):
    R, groups = batch
    weights = data.draw(st.lists(st.floats(0, 2), min_size=R.shape[1], max_size=R.shape[1]))
    share = (~torch.isnan(R)).sum(0).clamp_min(1).double() / len(R)
    rescaled = normalize_then_sum(R, weights, groups, std_scope=scope, rescale_masked=True)
    scaled = torch.tensor(weights, dtype=torch.float64) / share
    reweighted = normalize_then_sum(R, scaled, groups, std_scope=scope)
    torch.testing.assert_close(rescaled, reweighted, rtol=1e-9, atol=1e-9)
    full = R.nan_to_num(0.0)  # every reward applies: nothing to rescale
    unmasked = normalize_then_sum(full, weights, groups)
    torch.testing.assert_close(normalize_then_sum(full, weights, groups, rescale_masked=True), unmasked)


def test_normalize_then_sum_bad_inputs():
    R = torch.tensor([[1.0, 0.5], [2.0, NAN], [0.0, 0.1]])
    with pytest.raises(ValueError, match="weights must be 2 finite numbers"):
        normalize_then_sum(R, [1.0], [0, 0, 0])
    with pytest.raises(ValueError, match="ddof must be 0"):
        normalize_then_sum(R, [1.0, 1.0], [0, 0, 0], ddof=2)
    with pytest.raises(ValueError, match="adv_clip"):
        normalize_then_sum(R, [1.0, 1.0], [0, 0, 0], adv_clip=0)
    with pytest.raises(ValueError, match="std_scope"):
        normalize_then_sum(R, [1.0, 1.0], [0, 0, 0], std_scope="prompt")
    with pytest.raises(ValueError, match="reward 'ocr' has infinite values"):
        normalize_then_sum(torch.tensor([[0.0, math.inf]]), [1.0, 1.0], [0], names=["pick", "ocr"])
