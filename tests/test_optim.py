"""HarmonizedOptimizer, objective_grads, weightings, amortization and diagnostics."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import mogo
from mogo.testing import assert_min_norm_optimal


def mlp(seed: int = 0, width: int = 16, outputs: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, width), torch.nn.Tanh(), torch.nn.Linear(width, outputs))


def regression_losses(model: torch.nn.Module, seed: int, K: int = 3) -> torch.Tensor:
    """K squared-error objectives of a shared model, one per output, on a fixed batch."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 5, generator=generator)
    y = torch.randn(32, K, generator=generator) * 3
    return ((model(x) - y) ** 2).mean(0)


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()


def jacobian(model: torch.nn.Module, losses: torch.Tensor) -> torch.Tensor:
    """Independent reference: K separate backward passes, flattened to (K, P) float64."""
    rows = [torch.autograd.grad(loss, list(model.parameters()), retain_graph=True) for loss in losses]
    return torch.stack([torch.cat([g.reshape(-1) for g in row]) for row in rows]).double()


@given(st.integers(0, 10_000), st.integers(2, 6))
def test_harmonized_direction_never_opposes_an_objective(seed, K):
    model = mlp(seed, outputs=K)
    opt = mogo.HarmonizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), K)
    losses = regression_losses(model, seed, K)
    J = jacobian(model, losses)
    opt.backward(losses)
    d = flat_grad(model)
    cosines = (J @ d) / (J.norm(dim=1) * d.norm())
    assert bool((cosines >= -1e-9).all()), cosines
    torch.testing.assert_close(opt.last_report.harmonized_cosines, cosines, atol=1e-5, rtol=1e-4)


@given(st.integers(0, 10_000))
def test_unnormalized_min_norm_equals_an_independent_mgda_direction(seed):
    model = mlp(seed)
    weighting = mogo.MinNorm(normalize="none")
    opt = mogo.HarmonizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 3, weighting=weighting)
    losses = regression_losses(model, seed)
    J = jacobian(model, losses)
    opt.backward(losses)
    alpha = opt.last_report.alpha
    assert_min_norm_optimal(J @ J.T, alpha, tol=1e-7)
    torch.testing.assert_close(flat_grad(model), alpha @ J, atol=1e-5, rtol=1e-4)


@given(st.integers(0, 10_000), st.sampled_from(["l2", "none", "loss"]))
def test_backpropagating_the_amortized_weights_reproduces_the_harmonized_direction(seed, normalize):
    model = mlp(seed)
    opt = mogo.HarmonizedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), 3, weighting=mogo.MinNorm(normalize), harmonize_every=5
    )
    opt.backward(regression_losses(model, seed))
    harmonized = flat_grad(model)
    opt.zero_grad()
    weights = opt.amortizer.loss_weights().float()
    (weights * regression_losses(model, seed)).sum().backward()
    amortized = flat_grad(model)
    assert float((amortized - harmonized).norm() / harmonized.norm()) <= 1e-6


@given(st.integers(0, 10_000), st.permutations(range(4)))
def test_permuting_objectives_permutes_alpha(seed, permutation):
    model = mlp(seed, outputs=4)
    losses = regression_losses(model, seed, 4)
    opt = mogo.HarmonizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 4)
    opt.backward(losses)
    alpha, direction = opt.last_report.alpha, flat_grad(model)
    opt.zero_grad()
    opt.backward(regression_losses(model, seed, 4)[list(permutation)])
    torch.testing.assert_close(opt.last_report.alpha, alpha[list(permutation)], atol=1e-6, rtol=0)
    torch.testing.assert_close(flat_grad(model), direction, atol=1e-6, rtol=1e-5)


def test_weighted_sum_goes_through_the_same_path_as_a_plain_backward():
    model = mlp(1)
    opt = mogo.HarmonizedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), 3, weighting=mogo.WeightedSum([1, 2, 0.5])
    )
    opt.backward(regression_losses(model, 1))
    ours = flat_grad(model)
    opt.zero_grad()
    (torch.tensor([1, 2, 0.5]) * regression_losses(model, 1)).sum().backward()
    torch.testing.assert_close(ours, flat_grad(model), atol=1e-6, rtol=1e-5)


def test_when_all_gradients_agree_the_update_is_the_mean_gradient():
    model = mlp(2, outputs=1)
    opt = mogo.HarmonizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 3)
    loss = regression_losses(model, 2, 1)[0]
    opt.backward(torch.stack([loss, loss, loss]))
    harmonized = flat_grad(model)
    opt.zero_grad()
    regression_losses(model, 2, 1)[0].backward()
    torch.testing.assert_close(harmonized, flat_grad(model), atol=1e-6, rtol=1e-5)


def run(opt_factory, steps: int, seed: int = 0, start=None):
    model, opt = opt_factory() if start is None else start
    for step in range(steps):
        opt.zero_grad()
        opt.backward(regression_losses(model, seed + step))
        opt.step()
    return model, opt


def adam_factory(harmonize_every: int = 3, alpha_ema: float = 0.5):
    def make():
        model = mlp(3)
        inner = torch.optim.Adam(model.parameters(), lr=1e-2)
        return model, mogo.HarmonizedOptimizer(
            inner, ["a", "b", "c"], harmonize_every=harmonize_every, alpha_ema=alpha_ema
        )

    return make


def test_state_dict_round_trip_continues_bit_identically():
    straight, _ = run(adam_factory(), 7)
    model, opt = run(adam_factory(), 4)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    fresh_model, fresh_opt = adam_factory()()
    fresh_model.load_state_dict(saved_model)
    fresh_opt.load_state_dict(saved_opt)
    assert fresh_opt.amortizer.step == 4
    resumed, _ = run(None, 3, seed=4, start=(fresh_model, fresh_opt))
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_load_state_dict_rejects_a_foreign_state_before_changing_anything():
    _, opt = run(adam_factory(), 2)
    before = copy.deepcopy(opt.state_dict())
    other = mogo.HarmonizedOptimizer(torch.optim.Adam(mlp(3).parameters()), ["x", "y", "z"])
    with pytest.raises(ValueError, match=r"objectives \['a', 'b', 'c'\]"):
        other.load_state_dict(before)
    with pytest.raises(ValueError, match="expected keys"):
        opt.load_state_dict(before["inner"])
    assert opt.state_dict()["mogo"]["amortizer"]["step"] == before["mogo"]["amortizer"]["step"]


def test_amortized_steps_reuse_the_ema_of_alpha_between_harmonizations():
    model, opt = adam_factory(harmonize_every=3, alpha_ema=0.5)()
    harmonized_steps = []
    for step in range(7):
        opt.zero_grad()
        before = opt.meter.steps
        opt.backward(regression_losses(model, step))
        harmonized_steps.append(opt.meter.steps > before)
        opt.step()
    assert harmonized_steps == [True, False, False, True, False, False, True]
    assert opt.meter.steps == 3


@pytest.mark.parametrize("policy", ["skip", "drop", "raise"])
def test_non_finite_losses_follow_the_policy(policy):
    model, opt = adam_factory(harmonize_every=1)()
    run(None, 2, start=(model, opt))
    params = copy.deepcopy(model.state_dict())
    inner = copy.deepcopy(opt.optimizer.state_dict())
    opt.nonfinite = policy
    losses = regression_losses(model, 9)
    # An added NaN leaves the other objectives' gradients finite (a multiplied one would not).
    losses = torch.stack([losses[0], losses[1] + float("nan"), losses[2]])
    opt.zero_grad()
    if policy == "raise":
        with pytest.raises(FloatingPointError, match=r"objective\(s\) \['b'\]"):
            opt.backward(losses)
        return
    opt.backward(losses)
    opt.step()
    if policy == "skip":
        for name, value in model.state_dict().items():
            assert torch.equal(value, params[name])
        assert str(opt.optimizer.state_dict()) == str(inner)
        assert opt.amortizer.step == 2
    else:
        assert opt.last_report.names == ("a", "c")
        assert opt.last_report.alpha.shape == (2,)
        assert any(not torch.equal(value, params[name]) for name, value in model.state_dict().items())


@pytest.mark.parametrize("harmonizing", [True, False], ids=["harmonization step", "amortized step"])
def test_drop_skips_the_step_when_the_nan_reached_every_gradient(harmonizing):
    model, opt = adam_factory(harmonize_every=1 if harmonizing else 2)()
    if not harmonizing:
        run(None, 1, start=(model, opt))
    opt.nonfinite = "drop"
    params = copy.deepcopy(model.state_dict())
    inner = copy.deepcopy(opt.optimizer.state_dict())
    losses = regression_losses(model, 0)
    opt.zero_grad()
    opt.backward(torch.stack([losses[0], losses[1] * float("nan"), losses[2]]))
    opt.step()
    for name, value in model.state_dict().items():
        assert torch.equal(value, params[name])
    assert str(opt.optimizer.state_dict()) == str(inner)


def test_harmonizing_a_parameter_subset_gives_the_rest_the_weighted_gradient():
    model = mlp(4)
    trunk = list(model[0].parameters())
    opt = mogo.HarmonizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 3, params=trunk)
    losses = regression_losses(model, 4)
    J_trunk = torch.stack(
        [
            torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, trunk, retain_graph=True)])
            for loss in losses
        ]
    ).double()
    opt.backward(losses)
    weights = opt.last_report.loss_weights
    alpha = opt.last_report.alpha
    unit = J_trunk / J_trunk.norm(dim=1, keepdim=True)
    assert_min_norm_optimal(unit @ unit.T, alpha, tol=1e-7)
    head = model[2].weight
    expected = sum(
        w * g
        for w, g in zip(
            weights.float(),
            (torch.autograd.grad(loss, head, retain_graph=True)[0] for loss in regression_losses(model, 4)),
            strict=True,
        )
    )
    torch.testing.assert_close(head.grad, expected, atol=1e-6, rtol=1e-5)


def test_shared_loss_is_added_unweighted():
    model = mlp(5)
    opt = mogo.HarmonizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 3)
    penalty = lambda: 0.1 * sum((p**2).sum() for p in model.parameters())  # noqa: E731
    opt.backward(regression_losses(model, 5), shared=penalty())
    with_shared = flat_grad(model)
    opt.zero_grad()
    opt.backward(regression_losses(model, 5))
    harmonized = flat_grad(model)
    opt.zero_grad()
    penalty().backward()
    torch.testing.assert_close(with_shared, harmonized + flat_grad(model), atol=1e-6, rtol=1e-5)


class TinyTransformer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.embed = torch.nn.Linear(4, 16)
        self.block = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x)).mean(1))


class TinyConv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.conv = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).mean((2, 3))


class TinyLSTM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(8)
        self.lstm = torch.nn.LSTM(4, 8, batch_first=True)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


@pytest.mark.parametrize(
    ("model", "shape"), [(TinyTransformer, (6, 5, 4)), (TinyConv, (6, 2, 8, 8)), (TinyLSTM, (6, 5, 4))]
)
def test_batched_and_sequential_gradients_agree(model, shape):
    net = model()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    params = list(net.parameters())
    with torch.no_grad():
        pass
    losses = (net(x) ** 2).mean(0) + torch.arange(3.0)
    sequential, _ = mogo.objective_grads(losses, params, mode="sequential", retain_graph=True)
    batched, mode = mogo.objective_grads(losses, params, mode="batched")
    assert mode == "batched"
    for a, b in zip(batched, sequential, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


class Cube(torch.autograd.Function):
    """x**3 with a backward that branches on its input, which vmap cannot batch."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        if bool((grad != 0).any()):
            return 3 * x**2 * grad
        return torch.zeros_like(x)


def test_auto_falls_back_to_sequential_with_a_warning_naming_the_failure():
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    cubed = Cube.apply(w)
    losses = torch.stack([cubed.sum(), (cubed * torch.tensor([1.0, -1.0])).sum()])
    with pytest.warns(RuntimeWarning, match=r"failed \(aten::is_nonzero\); falling back to 2"):
        grads, mode = mogo.objective_grads(losses, [w])
    assert mode == "sequential"
    torch.testing.assert_close(grads[0], torch.tensor([[3.0, 12.0], [3.0, -12.0]]))


@pytest.mark.parametrize("mode", ["batched", "sequential"])
def test_objective_grads_gives_none_to_unused_parameters_unless_materialized(mode):
    used, unused = torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)
    losses = torch.stack([used.sum(), 2 * used.sum()])
    grads, _ = mogo.objective_grads(losses, [used, unused], mode=mode, materialize_grads=False)
    assert grads[1] is None
    assert torch.equal(grads[0], torch.tensor([[1.0, 1.0], [2.0, 2.0]]))


def test_objective_grads_gives_zeros_to_unused_parameters_and_checks_its_input():
    used, unused = torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)
    grads, _ = mogo.objective_grads(torch.stack([used.sum(), 2 * used.sum()]), [used, unused])
    assert torch.equal(grads[1], torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"shape \(K,\)"):
        mogo.objective_grads(used.sum(), [used])
    with pytest.raises(ValueError, match="do not require grad"):
        mogo.objective_grads(torch.ones(2), [used])


def test_sequential_gradients_fill_the_given_buffers():
    model = mlp(4)
    params = list(model.parameters())
    losses = regression_losses(model, 0)
    fresh, _ = mogo.objective_grads(losses, params, mode="sequential", retain_graph=True)
    out = [torch.full((3, *p.shape), float("nan")) for p in params]
    grads, _ = mogo.objective_grads(losses, params, mode="sequential", out=out, retain_graph=True)
    assert all(g is b for g, b in zip(grads, out, strict=True))
    for g, f in zip(grads, fresh, strict=True):
        assert torch.equal(g, f)
    with pytest.raises(ValueError, match=r"one \[K, \*p\.shape\] tensor per parameter"):
        mogo.objective_grads(losses, params, mode="sequential", out=out[:-1])


def test_lr_scheduler_clipping_and_hooks_work_through_the_wrapper():
    model, opt = adam_factory(harmonize_every=2)()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    for step in range(3):
        opt.zero_grad()
        opt.backward(regression_losses(model, step))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        assert norm > 0
        assert float(flat_grad(model).norm()) <= 0.01 + 1e-6
        opt.step()
        scheduler.step()
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 / 8)
    assert calls == ["pre", "post"] * 3


def test_every_optimizer_hook_and_the_step_range_work_through_the_wrapper():
    """torch's hooks, global ones included, and the ``Optimizer.step#...`` profiler range, from
    the public ``profile_hook_step`` on ``step``; the state-dict hooks may replace the state."""
    model, opt = adam_factory(harmonize_every=1)()
    calls = []
    handles = [
        register_optimizer_step_pre_hook(lambda *_: calls.append("global pre")),
        register_optimizer_step_post_hook(lambda *_: calls.append("global post")),
        opt.register_step_pre_hook(lambda *_: calls.append("pre")),
        opt.register_step_post_hook(lambda *_: calls.append("post")),
        opt.register_state_dict_pre_hook(lambda *_: calls.append("state pre")),
        opt.register_state_dict_post_hook(lambda _, state: {**state, "note": 1}),
        opt.register_load_state_dict_pre_hook(
            lambda _, state: {k: v for k, v in state.items() if k != "note"}
        ),
        opt.register_load_state_dict_post_hook(lambda *_: calls.append("load post")),
    ]
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            opt.zero_grad()
            opt.backward(regression_losses(model, 0))
            opt.step()
        state = opt.state_dict()
        assert state["note"] == 1
        opt.load_state_dict(state)  # the pre hook takes the note off again
    finally:
        for handle in handles:
            handle.remove()
    inner = ["global pre", "global post"]  # the wrapped optimizer's own step, inside ours
    assert calls == ["global pre", "pre", *inner, "post", "global post", "state pre", "load post"]
    keys = {event.key for event in profile.key_averages()}
    assert "Optimizer.step#HarmonizedOptimizer.step" in keys
    assert {"mogo.objective_grads", "mogo.gramian", "mogo.weighting", "mogo.combine", "mogo.report"} <= keys


def test_the_policy_can_change_between_steps_and_an_unknown_one_is_refused():
    model, opt = adam_factory(harmonize_every=1)()
    opt.nonfinite = "skip"
    assert opt.nonfinite == "skip"
    params = copy.deepcopy(model.state_dict())
    opt.zero_grad()
    opt.backward(regression_losses(model, 0) * float("nan"))
    opt.step()
    assert same(copy.deepcopy(model.state_dict()), params)
    with pytest.raises(ValueError, match="nonfinite must be 'raise', 'skip' or 'drop', got 'ignore'"):
        opt.nonfinite = "ignore"
    assert opt.nonfinite == "skip"


def test_the_meter_round_trips_and_refuses_a_bad_state_before_changing():
    meter = mogo.ConflictMeter(
        steps=4, conflicts=1, worst_weighted_sum_cosine=-0.5, worst_harmonized_cosine=0.25
    )
    copied = mogo.ConflictMeter()
    copied.load_state_dict(meter.state_dict())
    assert copied == meter
    with pytest.raises(ValueError, match=r"conflicts: 9 is more than the 4 steps"):
        copied.load_state_dict({**meter.state_dict(), "conflicts": 9})
    assert copied == meter


def test_pickle_round_trip():
    _, opt = run(adam_factory(), 3)
    clone = pickle.loads(pickle.dumps(opt))
    assert clone.amortizer.step == 3
    assert clone.objectives == ("a", "b", "c")
    assert torch.equal(clone.amortizer.alpha, opt.amortizer.alpha)


def test_grad_scaler_and_bf16_autocast():
    model, opt = adam_factory(harmonize_every=1)()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    reference, ref_opt = adam_factory(harmonize_every=1)()
    for step in range(3):
        for net, optimizer, scaled in ((model, opt, True), (reference, ref_opt, False)):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses = regression_losses(net, step).float()
            if scaled:
                optimizer.backward(scaler.scale(losses))
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.backward(losses)
                optimizer.step()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_grad_scaler_overflow_is_skipped_and_lowers_the_scale():
    model, opt = adam_factory(harmonize_every=1)()
    opt.nonfinite = "skip"
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, growth_interval=1000)
    params = copy.deepcopy(model.state_dict())
    opt.zero_grad()
    opt.backward(scaler.scale(1e3 * regression_losses(model, 0)))  # overflows float32
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() < 2.0**127
    for name, value in model.state_dict().items():
        assert torch.equal(value, params[name])
    for step in range(40):  # the scale comes down until steps go through
        opt.zero_grad()
        opt.backward(scaler.scale(1e3 * regression_losses(model, step)))
        scaler.step(opt)
        scaler.update()
    assert opt.amortizer.step > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_gradient_accumulation_estimates_alpha_on_the_first_micro_batch():
    model, opt = adam_factory(harmonize_every=2, alpha_ema=0.0)()
    opt.zero_grad()
    opt.backward(regression_losses(model, 0))
    weights = opt.last_report.loss_weights.float()
    for micro in (1, 2):
        opt.backward(regression_losses(model, micro))
    accumulated = flat_grad(model)
    assert opt.meter.steps == 1  # one K-gradient solve for the whole window
    opt.zero_grad()
    for micro in range(3):
        (weights * regression_losses(model, micro)).sum().backward()
    torch.testing.assert_close(accumulated, flat_grad(model), atol=1e-5, rtol=1e-5)


def test_closure_returns_the_losses_and_steps():
    model, opt = adam_factory()()
    before = copy.deepcopy(model.state_dict())
    losses = opt.step(lambda: regression_losses(model, 0))
    assert losses.shape == (3,)
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_conflict_report_and_meter():
    J = torch.tensor([[1.0, 0.1], [0.9, 0.5], [-0.6, 0.4]], dtype=torch.float64)
    weights = mogo.MinNorm()(J @ J.T, torch.ones(3))
    report = mogo.ConflictReport.from_gram(J @ J.T, weights, ("a", "b", "c"))
    assert report.conflict  # the mean gradient opposes c
    assert float(report.weighted_sum_cosines[2]) < 0
    assert bool((report.harmonized_cosines > 0).all())
    torch.testing.assert_close(report.cosines.diagonal(), torch.ones(3, dtype=torch.float64))
    flat = report.as_dict("train/")
    assert flat["train/conflict"] == 1.0
    assert set(flat) >= {"train/alpha/a", "train/cos_harmonized/c", "train/direction_norm"}
    assert all(isinstance(v, float) for v in flat.values())
    meter = mogo.ConflictMeter()
    meter.update(report)
    meter.update(
        mogo.ConflictReport.from_gram(
            torch.eye(3, dtype=torch.float64),
            mogo.MinNorm()(torch.eye(3, dtype=torch.float64), torch.ones(3)),
            ("a", "b", "c"),
        )
    )
    assert meter.conflict_rate == 0.5
    assert meter.worst_harmonized_cosine > 0


def test_a_round_off_gradient_has_no_direction_in_the_report():
    # Seen in training: a reward no sample of the micro-batch applies to has loss 0 and a gradient of
    # round-off (1e-16), here pointing against a small real one; the weighting excludes it, and so
    # must the report, or the worst cosine and the conflict flag read noise.
    J = torch.tensor(
        [[1.0, 0.2, 0.0], [0.1, 1.0, 0.0], [0.0, 0.0, 1e-6], [0.0, 0.0, -1e-16]], dtype=torch.float64
    )
    gram = J @ J.T
    weights = mogo.MinNorm()(gram, torch.ones(4))
    assert weights.alpha[3] == 0
    report = mogo.ConflictReport.from_gram(gram, weights, ("a", "b", "c", "none"))
    assert report.harmonized_cosines[3] == 0
    assert report.weighted_sum_cosines[3] == 0
    assert not report.conflict
    assert bool((report.harmonized_cosines[:3] > 0).all())  # the tiny real gradient keeps its direction


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"objectives": []}, "positive count or distinct names"),
        ({"objectives": ["a", "a"]}, "positive count or distinct names"),
        ({"objectives": 2, "nonfinite": "ignore"}, "nonfinite must be"),
        ({"objectives": 2, "harmonize_every": 0}, "harmonize_every must be a positive integer"),
        ({"objectives": 2, "alpha_ema": 1.0}, r"alpha_ema must be in \[0, 1\)"),
        ({"objectives": 2, "params": [torch.ones(2, requires_grad=True)]}, "not trainable parameters"),
        ({"objectives": 2, "sum_weights": [1.0]}, "sum_weights has 1 entries for 2 objectives"),
    ],
)
def test_bad_configuration_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mogo.HarmonizedOptimizer(torch.optim.SGD(mlp().parameters(), lr=0.1), **kwargs)


def test_wrong_number_of_losses_names_the_objectives():
    model, opt = adam_factory()()
    with pytest.raises(ValueError, match=r"shape \(3,\) for objectives \('a', 'b', 'c'\), got \(2,\)"):
        opt.backward(regression_losses(model, 0)[:2])


def test_accelerator_prepare_keeps_the_wrapper_working():
    from accelerate import Accelerator

    plain_model, plain_opt = adam_factory(harmonize_every=2)()
    run(None, 4, start=(plain_model, plain_opt))
    model, opt = adam_factory(harmonize_every=2)()
    accelerator = Accelerator(cpu=True)
    model, prepared = accelerator.prepare(model, opt)
    assert prepared.optimizer is opt
    for step in range(4):
        prepared.zero_grad()
        opt.backward(regression_losses(model, step))
        prepared.step()
    assert opt.amortizer.step == 4
    for a, b in zip(model.parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_window_accumulation_harmonizes_the_summed_gradients_at_the_boundary():
    model = mlp(9)
    window = mogo.HarmonizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 3, accumulation="window")
    penalty = lambda: 0.01 * sum((p**2).sum() for p in model.parameters())  # noqa: E731
    for micro in range(3):
        window.backward(regression_losses(model, micro), shared=penalty())
    assert window.meter.steps == 0  # nothing solved before the boundary
    window.harmonize()
    assert window.meter.steps == 1
    windowed, alpha = flat_grad(model), window.last_report.alpha
    reference = mogo.HarmonizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 3)
    reference.zero_grad()
    summed = sum(regression_losses(model, micro) for micro in range(3))
    reference.backward(summed, shared=3 * penalty())
    torch.testing.assert_close(alpha, reference.last_report.alpha, atol=1e-6, rtol=0)
    torch.testing.assert_close(windowed, flat_grad(model), atol=1e-5, rtol=1e-5)


def test_window_accumulation_steps_through_step_and_rejects_drop():
    model = mlp(10)
    opt = mogo.HarmonizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 3, accumulation="window")
    before = copy.deepcopy(model.state_dict())
    opt.zero_grad()
    for micro in range(2):
        opt.backward(regression_losses(model, micro))
    opt.step()  # harmonizes the window, then updates
    assert opt.meter.steps == 1
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="needs accumulation='first'"):
        mogo.HarmonizedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), 3, accumulation="window", nonfinite="drop"
        )


# ---- faults: nothing silently wrong (issue 21) -------------------------------------------------


def same(a, b) -> bool:
    """Bit-identical nested states: tensors by ``torch.equal`` (dtype too), the rest by ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def sqrt_at_zero(tensor: torch.Tensor) -> torch.Tensor:
    """A loss of value 0 whose gradient is NaN: d sqrt(u)/du = inf at u = 0, times du/dw = 0."""
    return torch.sqrt(((tensor - tensor.detach()) ** 2).sum())


FAULTS = {  # (model, K finite losses) -> (losses, shared) with one fault
    "nan loss": lambda model, losses: (losses + torch.tensor([0.0, float("nan"), 0.0]), None),
    "nan shared loss": lambda model, losses: (losses, model[0].weight.sum() * float("nan")),
    "nan gradient of a finite loss": lambda model, losses: (losses + sqrt_at_zero(model[0].weight), None),
    "nan gradient of the shared loss": lambda model, losses: (losses, sqrt_at_zero(model[0].weight)),
}


def snapshot(model: torch.nn.Module, opt: mogo.HarmonizedOptimizer) -> dict:
    return {
        "params": copy.deepcopy(model.state_dict()),
        "state": copy.deepcopy(opt.state_dict()),
        "report": opt.last_report,
    }


def assert_untouched(model: torch.nn.Module, opt: mogo.HarmonizedOptimizer, before: dict) -> None:
    after = snapshot(model, opt)
    assert same(after["params"], before["params"])
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert same(after["state"], before["state"])  # the inner optimizer's and mogo's own
    assert after["report"] is before["report"]


@pytest.mark.parametrize("policy", ["raise", "skip", "drop"])
@pytest.mark.parametrize("fault", [f for f in FAULTS if f != "nan loss"])
@pytest.mark.parametrize(
    ("every", "grad_mode"),
    [(3, "auto"), (1, "sequential")],
    ids=["amortized step", "harmonization step, sequential gradients"],
)
def test_a_nan_in_the_shared_loss_or_any_gradient_never_reaches_the_parameters(
    policy, fault, every, grad_mode
):
    model = mlp(3)
    opt = mogo.HarmonizedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2), ["a", "b", "c"],
        harmonize_every=every, grad_mode=grad_mode, nonfinite=policy,
    )  # fmt: skip
    run(None, 1, start=(model, opt))
    before = snapshot(model, opt)
    opt.zero_grad()
    losses, shared = FAULTS[fault](model, regression_losses(model, 9))

    def faulty_step() -> None:
        opt.backward(losses, shared=shared)
        opt.step()

    if policy == "raise":
        with pytest.raises(FloatingPointError, match="non-finite"):
            faulty_step()
        opt.step()  # a caller who goes on past the error does not update either
    else:
        faulty_step()
    assert_untouched(model, opt, before)


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("harmonizing", [True, False], ids=["harmonization window", "amortized window"])
@pytest.mark.parametrize("accumulation", ["first", "window"])
def test_a_skipped_step_leaves_mogos_state_bit_identical(fault, harmonizing, accumulation):
    model = mlp(3)
    opt = mogo.HarmonizedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2), ["a", "b", "c"],
        harmonize_every=2, alpha_ema=0.5, nonfinite="skip", accumulation=accumulation,
    )  # fmt: skip
    run(None, 2 if harmonizing else 1, start=(model, opt))
    before = snapshot(model, opt)
    opt.zero_grad()
    opt.backward(regression_losses(model, 5))  # a good micro-batch, then a faulty one
    opt.backward(*FAULTS[fault](model, regression_losses(model, 6)))
    opt.step()
    assert_untouched(model, opt, before)
    run(None, 1, seed=7, start=(model, opt))  # and the run goes on
    assert opt.amortizer.step == before["state"]["mogo"]["amortizer"]["step"] + 1


@pytest.mark.parametrize(  # "drop" needs accumulation="first"
    ("policy", "accumulation"),
    [("raise", "first"), ("raise", "window"), ("skip", "first"), ("skip", "window"), ("drop", "first")],
)
@pytest.mark.parametrize("zero", ["losses * 0", "constant losses"])
def test_all_zero_gradients_take_a_reported_no_op_step_like_a_plain_optimizer(policy, zero, accumulation):

    def zero_losses(model):
        losses = regression_losses(model, 0)
        return losses * 0 if zero == "losses * 0" else losses * 0 + torch.tensor([1.0, 2.0, 3.0])

    model, plain_model = mlp(3), mlp(3)
    opt = mogo.HarmonizedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), ["a", "b", "c"],
        nonfinite=policy, accumulation=accumulation,
    )  # fmt: skip
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2, weight_decay=0.1)
    opt.zero_grad()
    opt.backward(zero_losses(model))
    opt.step()
    plain.zero_grad()
    zero_losses(plain_model).sum().backward()
    plain.step()
    for ours, theirs in zip(model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)
        assert torch.equal(ours, theirs)
    report = opt.last_report
    assert report is not None
    assert report.names == ("a", "b", "c")
    assert torch.equal(report.norms, torch.zeros(3, dtype=torch.float64))
    assert torch.equal(report.loss_weights, torch.zeros(3, dtype=torch.float64))
    assert report.direction_norm == 0.0
    assert opt.meter.steps == 0  # no harmonization took place: nothing to count
    assert opt.amortizer.due  # and the next step harmonizes
    run(None, 1, start=(model, opt))
    assert opt.meter.steps == 1


@pytest.mark.parametrize("every", [1, 2], ids=["harmonization steps", "amortized steps"])
@pytest.mark.parametrize("grad_mode", ["batched", "sequential"])
def test_a_parameter_no_loss_depends_on_keeps_no_gradient(every, grad_mode):
    model = mlp(3)
    idle = torch.nn.Parameter(torch.ones(4))
    inner = torch.optim.AdamW([*model.parameters(), idle], lr=1e-2, weight_decay=0.1)
    opt = mogo.HarmonizedOptimizer(inner, 3, harmonize_every=every, grad_mode=grad_mode)
    for step in range(4):
        opt.zero_grad()
        opt.backward(regression_losses(model, step), shared=model[0].bias.sum() * 0.01)
        assert idle.grad is None
        assert all(p.grad is not None for p in model.parameters())
        opt.step()
    assert torch.equal(idle.detach(), torch.ones(4))  # AdamW decays only what has a gradient
    assert idle not in inner.state


BAD_STATES = {  # name -> (change to a saved state_dict, a field the error must name)
    "extra meter key": (lambda s: s["mogo"]["meter"].update(extra=1), "mogo.meter"),
    "harmonize_every 0": (lambda s: s["mogo"]["amortizer"].update(harmonize_every=0), "harmonize_every"),
    "alpha_ema 5": (lambda s: s["mogo"]["amortizer"].update(alpha_ema=5.0), "alpha_ema"),
    "negative step": (lambda s: s["mogo"]["amortizer"].update(step=-1), "step"),
    "alpha of 2 objectives": (lambda s: s["mogo"]["amortizer"].update(alpha=torch.ones(2)), "alpha"),
    "NaN divisor": (
        lambda s: s["mogo"]["amortizer"].update(divisor=torch.full((3,), float("nan"), dtype=torch.float64)),
        "divisor",
    ),
    "scale missing": (lambda s: s["mogo"]["amortizer"].pop("scale"), "scale"),
    "unknown grad_mode": (lambda s: s["mogo"].update(grad_mode="fast"), "grad_mode"),
    "meter steps text": (lambda s: s["mogo"]["meter"].update(steps="3"), "mogo.meter.steps"),
    "more conflicts than steps": (lambda s: s["mogo"]["meter"].update(conflicts=99), "conflicts"),
    "inner without param_groups": (lambda s: s["inner"].pop("param_groups"), "inner"),
    "mogo not a dict": (lambda s: s.update(mogo=[1, 2]), "mogo"),
    "objectives as a string": (lambda s: s["mogo"].update(objectives="abc"), "mogo.objectives"),
    "meter missing": (lambda s: s["mogo"].pop("meter"), "mogo.meter: missing"),
}


@pytest.mark.parametrize("bad", list(BAD_STATES))
def test_load_state_dict_validates_the_whole_state_before_changing_anything(bad):
    _, opt = run(adam_factory(), 2)
    _, other = run(adam_factory(), 4, seed=3)
    saved = copy.deepcopy(other.state_dict())
    change, field = BAD_STATES[bad]
    change(saved)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=field):
        opt.load_state_dict(saved)
    assert same(opt.state_dict(), before)


def test_load_state_dict_names_every_bad_field_at_once():
    _, opt = run(adam_factory(), 2)
    saved = copy.deepcopy(opt.state_dict())
    saved["mogo"]["amortizer"].update(harmonize_every=0, alpha_ema=5.0)
    saved["mogo"]["meter"]["extra"] = 1
    with pytest.raises(ValueError, match="harmonize_every") as error:
        opt.load_state_dict(saved)
    assert "alpha_ema" in str(error.value)
    assert "extra" in str(error.value)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"objectives": "abc"}, TypeError, "objectives must be a count or a sequence of names, got 'abc'"),
        ({"objectives": [1, 2]}, TypeError, "names must be strings"),
        ({"objectives": True}, TypeError, "objectives must be a count"),
        ({"objectives": 2.0}, TypeError, "objectives must be a count"),
        ({"objectives": 3, "sum_weights": [1, float("nan"), -2]}, ValueError, "sum_weights"),
        ({"objectives": 2, "sum_weights": [0, 0]}, ValueError, "sum_weights"),
        ({"objectives": 2, "weighting": "minnorm"}, TypeError, "weighting must be callable"),
        ({"objectives": 2, "distributed": True}, TypeError, "distributed must be"),
        (
            {"objectives": 2, "harmonize_every": None},
            ValueError,
            "harmonize_every must be a positive integer",
        ),
    ],
)
def test_bad_arguments_raise_a_clear_error(kwargs, error, match):
    with pytest.raises(error, match=match):
        mogo.HarmonizedOptimizer(torch.optim.SGD(mlp().parameters(), lr=0.1), **kwargs)


@pytest.mark.parametrize("shared", [1.0, "kl", torch.ones(2)], ids=["float", "str", "two entries"])
def test_a_shared_loss_that_is_not_a_scalar_tensor_raises_a_clear_error(shared):
    model, opt = adam_factory()()
    error = ValueError if isinstance(shared, torch.Tensor) else TypeError
    with pytest.raises(error, match="shared must be a scalar tensor"):
        opt.backward(regression_losses(model, 0), shared=shared)


def test_finite_float16_gradients_whose_sum_overflows_are_not_taken_for_non_finite():
    w = torch.nn.Parameter(torch.zeros(256, dtype=torch.float16))
    opt = mogo.HarmonizedOptimizer(torch.optim.SGD([w], lr=1e-6), 2, harmonize_every=2)
    for _ in range(2):  # a harmonization step, then an amortized one
        opt.zero_grad()
        opt.backward(torch.stack([(w * 1000).sum(), (w * 500).sum()]).float())
        assert float(w.grad.float().sum()) > torch.finfo(torch.float16).max  # its float16 sum is inf
        opt.step()
    assert opt.amortizer.step == 2
    assert bool(torch.isfinite(w).all())


def test_under_a_grad_scaler_harmonize_first_and_an_overflow_leaves_mogos_state_as_it_was():
    model, opt = adam_factory(harmonize_every=2)()
    opt.nonfinite = "skip"
    run(None, 2, start=(model, opt))  # the next step harmonizes
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    before = snapshot(model, opt)
    opt.zero_grad()
    opt.backward(scaler.scale(regression_losses(model, 3)))  # harmonizes
    assert opt.meter.steps == before["state"]["mogo"]["meter"]["steps"] + 1
    opt.backward(scaler.scale(regression_losses(model, 4) + sqrt_at_zero(model[0].weight)))
    opt.harmonize()  # finds the NaN before the scaler does, which then skips step()
    scaler.step(opt)
    scaler.update()
    assert_untouched(model, opt, before)
    assert scaler.get_scale() < 2.0**8


@given(
    st.integers(0, 10_000),
    st.integers(1, 3),
    st.integers(0, 3),
    st.integers(1, 4),
    st.sampled_from(list(FAULTS)),
    st.sampled_from(["first", "window"]),
    st.data(),
)
def test_any_skipped_step_returns_to_the_state_before_it(
    seed, every, steps_before, micro, fault, accumulation, data
):
    """Whatever the schedule, the number of micro-batches and which of them is faulty, a skipped
    step leaves parameters, inner state and mogo's state as they were, and the run goes on."""
    model = mlp(seed % 7)
    opt = mogo.HarmonizedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2), ["a", "b", "c"],
        harmonize_every=every, alpha_ema=0.5, nonfinite="skip", accumulation=accumulation,
    )  # fmt: skip
    run(None, steps_before, seed=seed, start=(model, opt))
    before = snapshot(model, opt)
    faulty = data.draw(st.integers(0, micro - 1), label="faulty micro-batch")
    opt.zero_grad()
    for index in range(micro):
        losses = regression_losses(model, seed + 10 + index)
        opt.backward(*FAULTS[fault](model, losses)) if index == faulty else opt.backward(losses)
    opt.step()
    assert_untouched(model, opt, before)
    run(None, 1, seed=seed, start=(model, opt))
    assert opt.amortizer.step == steps_before + 1
