"""The DiffusionNFT loss: hand-computed values, the affine identity, masking and gradient flow."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mogo_diffusion.nft import (
    NFTCoefficients,
    kl_loss,
    nft_coefficients,
    nft_loss,
    nft_losses,
    nft_terms,
    positive_weight,
)

NAN = float("nan")


def reference_terms(v, v_old, x_t, x0, t, beta):
    """P and N by plain loops over samples and elements (numpy arrays, ``t`` one value per sample)."""
    P, N = [], []
    for i in range(v.shape[0]):
        v_plus = beta * v[i] + (1 - beta) * v_old[i]
        v_minus = (1 + beta) * v_old[i] - beta * v[i]
        for velocity, out in ((v_plus, P), (v_minus, N)):
            diff = (x_t[i] - t[i] * velocity - x0[i]).ravel().tolist()
            squares = sum(d * d for d in diff) / len(diff)
            absolute = sum(abs(d) for d in diff) / len(diff)
            out.append(squares / max(absolute, 1e-5))
    return P, N


def reference_losses(P, N, advantages, beta, C):
    """Each reward's mean of ``C / beta * [r P + (1 - r) N]`` over the samples it applies to."""
    losses = []
    for k in range(len(advantages[0])):
        total, count = 0.0, 0
        for i, row in enumerate(advantages):
            if math.isnan(row[k]):
                continue
            r = min(max(row[k], -C), C) / (2 * C) + 0.5
            total += C / beta * (r * P[i] + (1 - r) * N[i])
            count += 1
        losses.append(total / count if count else 0.0)
    return losses


def random_inputs(B, shape=(2, 3, 3), seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x0, eps = (
        torch.randn(B, *shape, generator=g, dtype=dtype),
        torch.randn(B, *shape, generator=g, dtype=dtype),
    )
    t = torch.rand(B, generator=g, dtype=dtype) * 0.9 + 0.05
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
    v_old = eps - x0 + 0.3 * torch.randn(B, *shape, generator=g, dtype=dtype)
    v = (v_old + 0.3 * torch.randn(B, *shape, generator=g, dtype=dtype)).requires_grad_()
    return v, v_old, x_t, x0, t


def test_hand_computed_example():
    # Sample 0: x0_plus - x0 = [-1, 0] -> P = 0.5 / 0.5 = 1; x0_minus = x0 -> N = 0 / 1e-5 = 0.
    # Sample 1: x0_plus - x0 = [-2, 1] -> P = 2.5 / 1.5 = 5/3; x0_minus - x0 = [0, 1] -> N = 1.
    v = torch.tensor([[4.0, 2.0], [3.0, -1.0]], requires_grad=True)
    v_old = torch.tensor([[2.0, 2.0], [1.0, -1.0]])
    x_t = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    x0 = torch.tensor([[0.5, 0.0], [0.0, 0.0]])
    t = torch.tensor([0.5, 1.0])
    P, N = nft_terms(v, v_old, x_t, x0, t, beta=0.5)
    assert P.tolist() == pytest.approx([1.0, 5 / 3])
    assert N.tolist() == pytest.approx([0.0, 1.0])
    # C / beta = 10. Reward 0: r = [1, 0] -> 10 * (1 * 1 + 1 * 1) / 2 = 10. Reward 1 applies to sample 1
    # only: r = 1/2 -> 10 * (5/6 + 1/2) = 40/3. Reward 2 applies to none: 0.
    advantages = torch.tensor([[5.0, NAN, NAN], [-7.0, 0.0, NAN]])
    losses = nft_losses((P, N), nft_coefficients(advantages, beta=0.5, adv_clip=5.0))
    assert losses.tolist() == pytest.approx([10.0, 40 / 3, 0.0])


def test_random_example_matches_loops():
    v, v_old, x_t, x0, t = random_inputs(5, seed=1)
    advantages = torch.tensor(
        [[0.3, NAN, 9.0], [-1.2, 2.0, NAN], [4.0, -6.0, 1.0], [NAN, 0.5, -0.1], [2.5, NAN, 3.0]],
        dtype=torch.float64,
    )
    beta, C = 0.3, 4.0
    terms = nft_terms(v, v_old, x_t, x0, t, beta=beta)
    P, N = reference_terms(*(x.detach().numpy() for x in (v, v_old, x_t, x0, t)), beta)
    np.testing.assert_allclose(terms.positive.detach().numpy(), P, rtol=1e-12)
    np.testing.assert_allclose(terms.negative.detach().numpy(), N, rtol=1e-12)
    losses = nft_losses(terms, nft_coefficients(advantages, beta=beta, adv_clip=C))
    expected = reference_losses(P, N, advantages.tolist(), beta, C)
    np.testing.assert_allclose(losses.detach().numpy(), expected, rtol=1e-12)


def test_scalar_time_and_float32_dtype():
    v, v_old, x_t, x0, _ = random_inputs(3, seed=2, dtype=torch.float32)
    terms = nft_terms(v, v_old, x_t, x0, 0.4, beta=0.2)
    P, N = reference_terms(
        *(x.detach().numpy().astype(np.float64) for x in (v, v_old, x_t, x0)), [0.4] * 3, 0.2
    )
    assert terms.positive.dtype == torch.float32
    np.testing.assert_allclose(terms.positive.detach().numpy(), P, rtol=1e-5)
    np.testing.assert_allclose(terms.negative.detach().numpy(), N, rtol=1e-5)


def test_half_precision_inputs_give_float32_terms():
    v, v_old, x_t, x0, t = (x.detach().to(torch.bfloat16) for x in random_inputs(2, seed=3))
    terms = nft_terms(v, v_old, x_t, x0, t, beta=0.1)
    assert terms.positive.dtype == terms.negative.dtype == torch.float32


def test_single_reward_is_the_diffusion_nft_loss():
    v, v_old, x_t, x0, t = random_inputs(4, seed=4)
    advantages = torch.tensor([1.0, -2.0, 7.0, 0.0], dtype=torch.float64)
    beta, C = 0.1, 5.0
    loss = nft_loss(v, v_old, x_t, x0, t, advantages, beta=beta, adv_clip=C)
    P, N = reference_terms(*(x.detach().numpy() for x in (v, v_old, x_t, x0, t)), beta)
    r = [min(max(a, -C), C) / (2 * C) + 0.5 for a in advantages.tolist()]
    expected = C / beta * sum(ri * p + (1 - ri) * n for ri, p, n in zip(r, P, N, strict=True)) / 4
    assert loss.shape == ()
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_positive_weight():
    A = torch.tensor([-10.0, -5.0, 0.0, 2.5, 5.0, 10.0, NAN])
    r = positive_weight(A, adv_clip=5.0)
    assert r[:6].tolist() == [0.0, 0.0, 0.5, 0.75, 1.0, 1.0]
    assert math.isnan(r[6].item())


@st.composite
def mixing_problems(draw):
    K = draw(st.integers(1, 4))
    B = draw(st.integers(1, 6))
    value = st.one_of(st.floats(-8, 8), st.just(NAN))
    advantages = draw(st.lists(st.lists(value, min_size=K, max_size=K), min_size=B, max_size=B))
    weights = draw(st.lists(st.floats(0, 1), min_size=K, max_size=K).filter(lambda w: sum(w) > 1e-3))
    beta = draw(st.floats(0.05, 1.0))
    return advantages, [w / sum(weights) for w in weights], beta, draw(st.integers(0, 2**16))


@given(mixing_problems())
def test_convex_mix_of_losses_is_the_loss_of_mixed_coefficients(problem):
    advantages, weights, beta, seed = problem
    B = len(advantages)
    v, v_old, x_t, x0, t = random_inputs(B, shape=(1, 2, 2), seed=seed)
    A = torch.tensor(advantages, dtype=torch.float64)
    w = torch.tensor(weights, dtype=torch.float64)
    terms = nft_terms(v, v_old, x_t, x0, t, beta=beta)
    coefficients = nft_coefficients(A, beta=beta)
    mixed = w @ nft_losses(terms, coefficients)
    a_mix, b_mix = (w @ coefficients.a)[None], (w @ coefficients.b)[None]
    direct = nft_losses(terms, NFTCoefficients(a_mix, b_mix, coefficients.applicable.any(0, keepdim=True)))[0]
    torch.testing.assert_close(mixed, direct, rtol=1e-12, atol=1e-12)
    (grad_mixed,) = torch.autograd.grad(mixed, v, retain_graph=True)
    (grad_direct,) = torch.autograd.grad(direct, v, retain_graph=True)
    torch.testing.assert_close(grad_mixed, grad_direct, rtol=1e-10, atol=1e-12)
    if not torch.isnan(A).any():
        # With every reward applying everywhere the mix is again an NFT loss, with r_mix = w @ r.
        r_mix = w @ positive_weight(A.T)
        P, N = terms
        nft = 5.0 / beta * (r_mix * P + (1 - r_mix) * N).mean()
        torch.testing.assert_close(mixed, nft, rtol=1e-12, atol=1e-12)


def test_reward_applying_to_no_sample_contributes_nothing():
    v, v_old, x_t, x0, t = random_inputs(4, seed=5)
    terms = nft_terms(v, v_old, x_t, x0, t, beta=0.1)
    A = torch.tensor([[1.0, NAN], [-1.0, NAN], [3.0, NAN], [0.2, NAN]], dtype=torch.float64)
    losses = nft_losses(terms, nft_coefficients(A, beta=0.1))
    assert losses[1].item() == 0.0
    (grad,) = torch.autograd.grad(losses[1], v, retain_graph=True)
    assert torch.count_nonzero(grad) == 0
    alone = nft_losses(terms, nft_coefficients(A[:, :1], beta=0.1))
    assert losses[0].item() == alone[0].item()


def test_gradient_is_the_closed_form_with_stop_gradient_normalisers():
    beta = 0.4
    v, v_old, x_t, x0, t = random_inputs(3, seed=6)
    v_old, x_t, x0, t = (x.clone().requires_grad_() for x in (v_old, x_t, x0, t))
    A = torch.tensor([[1.0], [-3.0], [0.5]], dtype=torch.float64)
    coefficients = nft_coefficients(A, beta=beta)
    loss = nft_losses(nft_terms(v, v_old, x_t, x0, t, beta=beta), coefficients)[0]
    grads = torch.autograd.grad(loss, [v, v_old, x_t, x0, t], allow_unused=True)
    assert all(g is None for g in grads[1:]), "gradient must flow through v only"
    tt = t.detach().view(-1, 1, 1, 1)
    M = v[0].numel()
    d_plus = x_t - tt * (beta * v + (1 - beta) * v_old) - x0
    d_minus = x_t - tt * ((1 + beta) * v_old - beta * v) - x0
    s_plus = d_plus.abs().mean((1, 2, 3)).clamp_min(1e-5).view(-1, 1, 1, 1)
    s_minus = d_minus.abs().mean((1, 2, 3)).clamp_min(1e-5).view(-1, 1, 1, 1)
    a, b = (c[0].view(-1, 1, 1, 1) for c in coefficients[:2])
    expected = a * 2 * d_plus * (-tt * beta) / (M * s_plus) + b * 2 * d_minus * (tt * beta) / (M * s_minus)
    torch.testing.assert_close(grads[0], expected.detach(), rtol=1e-10, atol=1e-12)


def test_kl_loss():
    v, v_ref = random_inputs(2, seed=7)[:2]
    v_ref = v_ref.clone().requires_grad_()
    loss = kl_loss(v, v_ref, kl_coef=1e-4)
    expected = 1e-4 * float(np.mean((v.detach().numpy() - v_ref.detach().numpy()) ** 2))
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    grad_v, grad_ref = torch.autograd.grad(loss, [v, v_ref], allow_unused=True)
    assert grad_ref is None
    torch.testing.assert_close(grad_v, 2e-4 * (v - v_ref).detach() / v.numel())


def test_bad_inputs_name_the_argument():
    v, v_old, x_t, x0, t = random_inputs(3, seed=8)
    with pytest.raises(ValueError, match="v_old has shape"):
        nft_terms(v, v_old[:2], x_t, x0, t, beta=0.1)
    with pytest.raises(ValueError, match="x_t has shape"):
        nft_terms(v, v_old, x_t[..., :2], x0, t, beta=0.1)
    with pytest.raises(ValueError, match="x0 has shape"):
        nft_terms(v, v_old, x_t, x0[None], t, beta=0.1)
    with pytest.raises(ValueError, match="t must be a scalar"):
        nft_terms(v, v_old, x_t, x0, t[:2], beta=0.1)
    with pytest.raises(ValueError, match="v must have shape"):
        nft_terms(v[0, 0, 0], v_old[0, 0, 0], x_t[0, 0, 0], x0[0, 0, 0], 0.5, beta=0.1)
    with pytest.raises(TypeError, match="x0 must be a tensor"):
        nft_terms(v, v_old, x_t, x0.tolist(), t, beta=0.1)
    for beta in (0.0, -0.1, float("inf")):
        with pytest.raises(ValueError, match="beta"):
            nft_terms(v, v_old, x_t, x0, t, beta=beta)
    with pytest.raises(ValueError, match="adv_clip"):
        nft_coefficients(torch.zeros(3, 2), beta=0.1, adv_clip=0.0)
    with pytest.raises(ValueError, match=r"advantages must be a floating \[B, K\]"):
        nft_coefficients(torch.zeros(3), beta=0.1)
    terms = nft_terms(v, v_old, x_t, x0, t, beta=0.1)
    with pytest.raises(ValueError, match=r"expected \[K, 3\]"):
        nft_losses(terms, nft_coefficients(torch.zeros(4, 2), beta=0.1))
    with pytest.raises(ValueError, match=r"advantages must be a \[B\] tensor"):
        nft_loss(v, v_old, x_t, x0, t, torch.zeros(3, 1), beta=0.1)
    with pytest.raises(ValueError, match="advantages has 2 entries"):
        nft_loss(v, v_old, x_t, x0, t, torch.zeros(2), beta=0.1)
    with pytest.raises(ValueError, match="kl_coef"):
        kl_loss(v, v_old, kl_coef=-1.0)
    with pytest.raises(ValueError, match="v_ref has shape"):
        kl_loss(v, v_old[:1], kl_coef=1.0)


@given(
    st.integers(1, 8),
    st.integers(1, 4),
    st.integers(0, 2**31 - 1),
    st.floats(0.0, 1.0),
)
def test_a_neutral_nonapplicable_sample_counts_as_advantage_zero(batch, rewards, seed, share):
    generator = torch.Generator().manual_seed(seed)
    A = 3 * torch.randn(batch, rewards, generator=generator, dtype=torch.float64)
    A[torch.rand(batch, rewards, generator=generator) < share] = math.nan
    neutral = nft_coefficients(A, beta=0.3, nonapplicable="neutral")
    as_zero = nft_coefficients(A.nan_to_num(0.0), beta=0.3)  # no NaN: every sample counts
    assert torch.equal(neutral.a, as_zero.a)
    assert torch.equal(neutral.b, as_zero.b)
    if not torch.isnan(A).any():  # the two policies differ only where a reward does not apply
        excluded = nft_coefficients(A, beta=0.3)
        assert torch.equal(excluded.a, neutral.a)


def test_a_neutral_sample_holds_the_model_at_the_old_policy():
    """Its loss (P + N) / 2 has zero gradient at v = v_old and pulls v back towards it elsewhere."""
    x0, x_t, v_old = torch.randn(3, 1, 4, 2, 2, dtype=torch.float64)
    A = torch.tensor([[math.nan]])
    coefficients = nft_coefficients(A, beta=0.5, nonapplicable="neutral")
    for offset, moves_back in ((0.0, False), (0.3, True)):
        v = (v_old + offset).requires_grad_()
        loss = nft_losses(nft_terms(v, v_old, x_t, x0, 0.7, beta=0.5), coefficients)[0]
        (grad,) = torch.autograd.grad(loss, v)
        if moves_back:
            assert float((grad * (v - v_old)).sum()) > 0  # descent moves v towards v_old
        else:
            # P and N differ only by the rounding of v_plus and v_minus: float64 round-off of O(1)
            assert torch.allclose(grad, torch.zeros_like(grad), atol=1e-12)
    excluded = nft_coefficients(A, beta=0.5)
    assert not excluded.a.any()  # left out: no gradient at all
    assert not excluded.b.any()
    with pytest.raises(ValueError, match="nonapplicable must be 'exclude' or 'neutral'"):
        nft_coefficients(A, beta=0.5, nonapplicable="zero")
