"""Harmonization across two real gloo processes, launched by torchrun and by accelerate launch.

Each launch runs every case of ``tests/distributed_worker.py`` once; the tests read what the
ranks saved and compare them with each other and with one process on the full batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mogo
from tests import distributed_worker as worker
from tests.launch import accelerate_launch as launch_accelerate
from tests.launch import launch
from tests.launch import torchrun as launch_torchrun

WORKER = str(Path(worker.__file__))


@pytest.fixture(scope="module")
def torchrun(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("torchrun")
    return launch([*launch_torchrun(), WORKER, str(out)], out)


@pytest.fixture(scope="module")
def accelerate_launch(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("accelerate")
    return launch([*launch_accelerate(), WORKER, str(out), "--accelerate"], out)


def assert_matches_one_process(
    run: dict, every: int, clip: float | None = None, gram: str = "same_batch"
) -> None:
    reference = worker.train_single(every, clip, gram)
    assert len(run["params"]) == len(reference["params"]) == worker.STEPS
    for ours, theirs in zip(run["alphas"], reference["alphas"], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    for ours, theirs in zip(run["params"], reference["params"], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


@pytest.mark.spawns
@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize("layout", ["ddp", "unwrapped"])
def test_two_ranks_on_half_batches_match_one_process_on_the_full_batch(torchrun, layout, every):
    for rank in torchrun:
        assert_matches_one_process(rank[f"{layout}_every{every}"], every)


@pytest.mark.spawns
@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize("layout", ["ddp", "unwrapped"])
def test_clipping_between_harmonize_and_step_sees_the_averaged_gradients(torchrun, layout, every):
    for rank in torchrun:
        assert_matches_one_process(rank[f"{layout}_clip_every{every}"], every, worker.CLIP)


@pytest.mark.spawns
@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize("layout", ["ddp", "unwrapped"])
def test_cross_fitted_halves_averaged_over_two_ranks_match_one_process(torchrun, layout, every):
    for rank in torchrun:
        assert_matches_one_process(rank[f"{layout}_cross_fitted_every{every}"], every, gram="cross_fitted")


@pytest.mark.spawns
@pytest.mark.parametrize("every", [1, 3])
def test_accelerate_launch_matches_one_process(accelerate_launch, every):
    for rank in accelerate_launch:
        assert_matches_one_process(rank[f"accelerate_every{every}"], every)


def same_finite_steps(first: dict, second: dict) -> None:
    assert first["raised"] is None
    assert second["raised"] is None
    assert len(first["params"]) == len(second["params"]) == worker.STEPS
    for a, b in zip(first["params"], second["params"], strict=True):
        assert torch.equal(a, b)
        assert bool(torch.isfinite(a).all())


@pytest.mark.spawns
@pytest.mark.parametrize("nan_at", [1, 2], ids=["amortized step", "harmonization step"])
@pytest.mark.parametrize("policy", ["raise", "skip", "drop"])
def test_a_nan_on_one_rank_leads_both_ranks_to_the_same_outcome(torchrun, policy, nan_at):
    first, second = (rank[f"nan_{policy}_{nan_at}"] for rank in torchrun)
    if policy == "raise":
        for run in (first, second):  # both raise, naming the objective, though only rank 1 saw it
            assert "objective_1" in run["raised"]
            assert len(run["params"]) == nan_at
        return
    same_finite_steps(first, second)
    changed = not torch.equal(first["params"][nan_at], first["params"][nan_at - 1])
    assert changed == (policy == "drop")  # "skip" leaves the parameters as they were


@pytest.mark.spawns
@pytest.mark.parametrize("nan_at", [1, 2], ids=["amortized step", "harmonization step"])
def test_a_nan_that_spread_into_every_gradient_skips_the_step_on_both_ranks(torchrun, nan_at):
    first, second = (rank[f"nan_spread_{nan_at}"] for rank in torchrun)
    same_finite_steps(first, second)
    assert torch.equal(first["params"][nan_at], first["params"][nan_at - 1])


@pytest.mark.spawns
@pytest.mark.parametrize("layout", ["ddp", "unwrapped"])
@pytest.mark.parametrize("policy", ["raise", "skip", "drop"])
def test_a_nan_gradient_on_one_rank_between_harmonizations_stops_both_ranks(torchrun, policy, layout):
    first, second = (rank[f"nan_gradient_{policy}_{layout}"] for rank in torchrun)
    if policy == "raise":
        for run in (first, second):  # both raise, though only rank 1's loss had a NaN gradient
            assert "non-finite gradient" in run["raised"]
            assert len(run["params"]) == 1
        return
    same_finite_steps(first, second)
    assert torch.equal(first["params"][1], first["params"][0])  # skipped on both


@pytest.mark.spawns
def test_a_parameter_no_rank_uses_keeps_no_gradient_and_a_partly_used_one_the_mean(torchrun):
    first, second = (rank["unused_parameters"] for rank in torchrun)
    assert first["idle"] is None
    assert second["idle"] is None
    torch.testing.assert_close(first["partial"], second["partial"], rtol=0, atol=0)
    assert bool((first["partial"] != 0).all())
    torch.testing.assert_close(first["first"], second["first"], rtol=0, atol=0)


@pytest.mark.spawns
def test_sharded_gramian_equals_the_unsharded_one(torchrun):
    for rank in torchrun:
        torch.testing.assert_close(rank["sharded_gram"], rank["full_gram"], rtol=0, atol=1e-12)


@pytest.mark.spawns
def test_tensor_parallel_harmonization_matches_the_unsharded_model(torchrun):
    reference = worker.train_tensor_parallel()
    shards = [rank["tensor_parallel"] for rank in torchrun]
    for rank in shards:
        for ours, theirs in zip(rank["alphas"], reference["alphas"], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    uniform = torch.full((worker.K,), 1 / worker.K, dtype=torch.float64)
    assert not torch.allclose(reference["alphas"][-1], uniform)  # the objectives do conflict
    torch.testing.assert_close(torch.cat([rank["w"] for rank in shards]), reference["w"], rtol=0, atol=1e-12)


@pytest.mark.spawns
def test_dtensor_parameters_harmonize_shard_wise_like_the_unsharded_model(torchrun):
    reference = worker.train_tensor_parallel()
    for rank in torchrun:
        run = rank["dtensor"]
        assert run["grad_type"] == "DTensor"
        for ours, theirs in zip(run["alphas"], reference["alphas"], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
        torch.testing.assert_close(run["w"], reference["w"], rtol=0, atol=1e-12)


def test_the_layouts_need_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        mogo.DataParallel()
    with pytest.raises(RuntimeError, match="init_process_group"):
        mogo.ShardedParameters()
