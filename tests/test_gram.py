"""mogo.gramian and mogo.normalize_gram."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mogo


def product_error_bound(flat: torch.Tensor, width: int, u: float = 2.0**-24) -> torch.Tensor:
    """gramian's worst-case error on any BLAS (its docstring): ``B + ||B||_F`` with
    ``B = (gamma_w + m 2**-53) ||g_k|| ||g_l||`` for products of ``width``-column blocks in a
    dtype of unit round-off ``u`` over the ``m`` blocks of ``flat`` (``[K, n]`` float64), and
    ``||B||_F`` for the clipping of negative eigenvalues."""
    blocks = -(-flat.shape[1] // width)
    gamma = width * u / (1 - width * u) + blocks * 2.0**-53
    norms = flat.norm(dim=1)
    bound = gamma * torch.outer(norms, norms)
    return bound + bound.norm()


def assert_within(G: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> None:
    worst = float(((G - exact).abs() / bound).max())
    assert worst <= 1, f"error {worst:.3g} times the bound"


@given(
    st.integers(1, 8),
    st.lists(st.lists(st.integers(1, 5), min_size=0, max_size=3), min_size=1, max_size=5),
    st.integers(1, 7),
    st.integers(0, 2**31 - 1),
)
def test_gramian_equals_the_gram_of_concatenated_gradients(K, shapes, chunk_size, seed):
    generator = torch.Generator().manual_seed(seed)
    grads = [torch.randn(K, *shape, generator=generator, dtype=torch.float32) for shape in shapes]
    flat = torch.cat([g.reshape(K, -1).double() for g in grads], dim=1)
    G = mogo.gramian(grads, chunk_size=chunk_size, dtype=torch.float64)
    assert G.dtype == torch.float64
    torch.testing.assert_close(G, flat @ flat.T, rtol=1e-12, atol=1e-12)
    assert_within(
        mogo.gramian(grads, chunk_size=chunk_size), flat @ flat.T, product_error_bound(flat, chunk_size)
    )


def test_gramian_of_several_batched_products_and_a_narrow_last_block():
    # 2 x (2**18 + 5) columns in blocks of 2**17: two batched products of one block each (the
    # product's entry budget is 2**18), then a last block of 5 columns. Entries in {-1, 0, 1}
    # make every partial sum an integer below 2**24, exact in float32 on any BLAS: a block
    # dropped or counted twice shows as an exact difference.
    generator = torch.Generator().manual_seed(1)
    signs = [torch.randint(-1, 2, (2, 2**18 + 5), generator=generator).float()]
    exact = signs[0].double() @ signs[0].double().T
    assert torch.equal(mogo.gramian(signs, chunk_size=2**17), exact)
    assert torch.equal(mogo.gramian(signs, chunk_size=2**17, dtype=torch.float64), exact)
    # Random entries: within the bound that 2**17-term float32 products guarantee. Issue 18: a
    # 1e-6 bound from one CPU failed at 1.04e-6 on another.
    grads = [torch.randn(2, 2**18 + 5, generator=generator)]
    flat = grads[0].double()
    exact = flat @ flat.T
    torch.testing.assert_close(mogo.gramian(grads, chunk_size=2**17, dtype=torch.float64), exact)
    assert_within(mogo.gramian(grads, chunk_size=2**17), exact, product_error_bound(flat, 2**17))


def test_gramian_accumulates_float32_gradients_in_float64():
    # In float32, 1 + 1e-8 rounds to 1; in float64 the sum of squares keeps the small entries.
    big = torch.ones(1, 1, dtype=torch.float32)
    small = torch.full((1, 1000), 1e-4, dtype=torch.float32)
    G = mogo.gramian([big, small], dtype=torch.float64)
    expected = 1.0 + 1000 * float(torch.tensor(1e-4, dtype=torch.float32).double() ** 2)
    assert abs(float(G) - expected) < 1e-15


def test_gramian_sums_chunks_of_float32_products_in_float64():
    # 4096 chunks of 1e-8 each: a float32 running total would stall at 1 + 2**-23 and lose them.
    grads = [torch.ones(1, 1), torch.full((1, 4096), 1e-4)]
    G = mogo.gramian(grads, chunk_size=1)
    assert abs(float(G) - (1.0 + 4096 * float(torch.tensor(1e-4) ** 2))) < 1e-12


def test_half_precision_gradients_are_multiplied_in_float32():
    grads = [torch.full((1, 4096), 0.01, dtype=torch.bfloat16)]
    flat = grads[0].double()
    # bfloat16 products (u = 2**-8) of 1024 terms could err by up to 100%; float32 ones by 6e-5.
    assert_within(mogo.gramian(grads), flat @ flat.T, product_error_bound(flat, 1024))


@pytest.mark.parametrize(
    ("grads", "match"),
    [
        ([], "empty"),
        ([torch.ones(2, 3), torch.ones(3, 3)], "stacked gradient 1 has 3 objectives, the first had 2"),
        ([torch.tensor(1.0)], "stacked gradient 0 is a scalar"),
    ],
)
def test_gramian_rejects_mismatched_inputs(grads, match):
    with pytest.raises(ValueError, match=match):
        mogo.gramian(grads)


def test_l2_normalisation_gives_unit_diagonal_and_cosines():
    J = torch.tensor([[3.0, 4.0], [0.0, 2.0], [-1.0, 0.0]], dtype=torch.float64)
    normalized = mogo.normalize_gram(J @ J.T, "l2")
    torch.testing.assert_close(normalized.scale, torch.tensor([5.0, 2.0, 1.0], dtype=torch.float64))
    unit = J / J.norm(dim=1, keepdim=True)
    torch.testing.assert_close(normalized.gram, unit @ unit.T)
    assert normalized.excluded == []


def test_zero_gradients_are_excluded_and_reported_never_divided_by():
    J = torch.tensor([[3.0, 4.0], [0.0, 0.0], [1e-14, 0.0], [0.0, 1.0]], dtype=torch.float64)
    normalized = mogo.normalize_gram(J @ J.T, "l2")
    assert normalized.excluded == [1, 2]
    assert normalized.gram.shape == (2, 2)
    assert torch.isfinite(normalized.gram).all()
    alpha = mogo.min_norm(normalized.gram).alpha
    full = normalized.expand(alpha)
    assert full.shape == (4,)
    assert full[1] == 0
    assert full[2] == 0
    torch.testing.assert_close(full[[0, 3]], alpha)


def test_loss_normalisation_divides_by_the_losses():
    J = torch.tensor([[2.0, 0.0], [0.0, 3.0]], dtype=torch.float64)
    losses = torch.tensor([2.0, 0.5])
    normalized = mogo.normalize_gram(J @ J.T, "loss", losses=losses)
    torch.testing.assert_close(normalized.gram, torch.diag(torch.tensor([1.0, 36.0], dtype=torch.float64)))


def test_none_normalisation_keeps_zero_gradients_in_the_hull():
    J = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    normalized = mogo.normalize_gram(J @ J.T, "none")
    assert normalized.excluded == []
    torch.testing.assert_close(
        mogo.min_norm(normalized.gram).alpha, torch.tensor([0.0, 1.0], dtype=torch.float64)
    )


@pytest.mark.parametrize(
    ("mode", "losses", "G", "match"),
    [
        ("l2", None, torch.zeros(2, 2), "every one of the 2 gradients is zero"),
        ("loss", None, torch.eye(2), "needs the loss values"),
        ("loss", torch.tensor([1.0, -1.0]), torch.eye(2), "objective 1 has -1.0"),
        ("loss", torch.tensor([1.0, float("nan")]), torch.eye(2), "objective 1 has nan"),
        ("loss", torch.tensor([1.0, 2.0, 3.0]), torch.eye(2), r"losses must have shape \(2,\)"),
        ("cosine", None, torch.eye(2), "unknown normalization 'cosine'"),
        ("l2", None, torch.ones(2, 3), r"shape \(K, K\)"),
    ],
)
def test_normalisation_errors_name_the_problem(mode, losses, G, match):
    with pytest.raises(ValueError, match=match):
        mogo.normalize_gram(G, mode, losses=losses)


def test_products_beyond_float32_range_are_recomputed_in_float64():
    grads = [torch.tensor([[1e30, 0.0], [1e30, 1e30]])]  # finite, but 1e60 overflows float32
    G = mogo.gramian(grads)
    torch.testing.assert_close(G, torch.tensor([[1e60, 1e60], [1e60, 2e60]], dtype=torch.float64))


def test_gramian_is_exactly_symmetric():
    grads = [torch.randn(3, 64, generator=torch.Generator().manual_seed(0))]  # b @ b.T is not, here
    G = mogo.gramian(grads)
    assert torch.equal(G, G.T)


def test_float32_products_of_nearly_dependent_gradients_stay_positive_semidefinite():
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(1, 200_000, generator=generator)
    grads = [torch.cat([base, base + 1e-4 * torch.randn(2, 200_000, generator=generator)])]
    G = mogo.gramian(grads)
    assert float(torch.linalg.eigvalsh(G).min()) >= -1e-15 * float(G.diagonal().max())
    exact = mogo.gramian(grads, dtype=torch.float64)
    flat = grads[0].double()
    assert_within(G, exact, product_error_bound(flat, 1024))
    mogo.min_norm(mogo.normalize_gram(G, "l2").gram)  # accepted by the solver's PSD check
