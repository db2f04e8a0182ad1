"""HarmonizedOptimizer, objective_grads, weightings, amortization and diagnostics."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

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
