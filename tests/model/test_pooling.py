"""Standardisation and whitening of pooled embeddings: the math, which poolings it touches, and its order with L2."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.pooling import STD_FLOOR, EmbeddingStats, pool_hidden, standardize, standardize_pooled, whitening_matrix


def _stats(dim: int, seed: int = 0) -> EmbeddingStats:
    g = torch.Generator().manual_seed(seed)
    return EmbeddingStats(mean=torch.randn(dim, generator=g), std=torch.rand(dim, generator=g) + 0.5)


def test_standardize_is_per_dimension_centring_and_scaling() -> None:
    stats = EmbeddingStats(mean=torch.tensor([1.0, -2.0, 0.0]), std=torch.tensor([2.0, 0.5, 4.0]))
    v = torch.tensor([[3.0, -1.0, 8.0], [1.0, -2.0, -4.0]])
    assert torch.equal(standardize(v, stats), torch.tensor([[1.0, 2.0, 2.0], [0.0, 0.0, -1.0]]))


def test_from_vectors_gives_population_mean_and_std_with_a_floor() -> None:
    v = torch.tensor([[0.0, 5.0, 1.0], [2.0, 5.0, 3.0], [4.0, 5.0, 5.0]])
    stats = EmbeddingStats.from_vectors(v)
    assert torch.allclose(stats.mean, torch.tensor([2.0, 5.0, 3.0]))
    assert torch.allclose(stats.std, torch.tensor([(8 / 3) ** 0.5, STD_FLOOR, (8 / 3) ** 0.5]))
    z = standardize(v, stats)  # the estimation vectors come out with mean 0 and std 1 (0 where constant)
    assert torch.allclose(z.mean(0), torch.zeros(3), atol=1e-6)
    assert torch.allclose(z.std(0, unbiased=False), torch.tensor([1.0, 0.0, 1.0]), atol=1e-6)
    with pytest.raises(ValueError, match="at least two"):
        EmbeddingStats.from_vectors(v[:1])


def test_pool_hidden_standardises_mean_before_normalising_and_leaves_last_raw() -> None:
    torch.manual_seed(0)
    h = torch.randn(2, 5, 6)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    stats = _stats(6)
    raw_mean = pool_hidden(h, mask, "mean")
    expected = F.normalize((raw_mean - stats.mean) / stats.std, dim=-1)
    assert torch.allclose(pool_hidden(h, mask, "mean", normalize=True, stats=stats), expected, atol=1e-6)
    assert not torch.allclose(pool_hidden(h, mask, "mean", normalize=True), expected, atol=1e-3)
    assert torch.equal(pool_hidden(h, mask, "last", stats=stats), pool_hidden(h, mask, "last"))
    assert torch.equal(standardize_pooled(raw_mean, "mean", None), raw_mean)


def test_low_precision_vectors_are_standardised_in_float32() -> None:
    stats = _stats(4)
    v = torch.randn(3, 4).to(torch.bfloat16)
    out = standardize(v, stats)
    assert out.dtype == torch.float32
    assert torch.allclose(out, (v.float() - stats.mean) / stats.std)


def _correlated(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    """n vectors with a shared offset and strongly correlated, unequal-variance dimensions."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=g) * torch.linspace(0.1, 3.0, dim)
    return torch.randn(n, dim, generator=g) @ mix + 5.0


def test_whitening_without_shrinkage_gives_identity_covariance() -> None:
    v = _correlated(200, 8)
    stats = EmbeddingStats.from_vectors(v, shrinkage=0.0)
    assert stats.whitening is not None and stats.whitening.shape == (8, 8) and stats.whitening.dtype == torch.float32
    assert stats.method == "whitening"
    z = standardize(v, stats)
    assert torch.allclose(z.mean(0), torch.zeros(8), atol=1e-4)
    assert torch.allclose(torch.cov(z.double().T), torch.eye(8, dtype=torch.float64), atol=1e-4)


def test_shrinkage_whitens_the_shrunk_covariance_and_stays_full_rank_with_few_vectors() -> None:
    v = _correlated(200, 8)
    s = 0.1
    c = torch.cov(v.double().T)
    shrunk = (1 - s) * c + s * c.diagonal().mean() * torch.eye(8, dtype=torch.float64)
    w = whitening_matrix(v, s).double()
    # W^T C_s W = I and W W^T = C_s^-1 (the latter is unique: it does not depend on eigenvector signs)
    assert torch.allclose(w.T @ shrunk @ w, torch.eye(8, dtype=torch.float64), atol=1e-4)
    assert torch.allclose(w @ w.T, torch.linalg.inv(shrunk), rtol=1e-4, atol=1e-6)
    # the training vectors come out with covariance (I - s mean(diag C) diag(1/e)) / (1 - s): every
    # eigenvalue below 1 / (1 - s), none far below the unshrunk 1 on the high-variance directions
    e = torch.linalg.eigvalsh(torch.cov(standardize(v, EmbeddingStats.from_vectors(v, s)).double().T))
    assert float(e.max()) <= 1 / (1 - s) + 1e-4 and float(e.min()) > 0
    few = _correlated(3, 8)  # N << D: singular covariance, yet full rank once shrunk
    assert torch.isfinite(whitening_matrix(few, s)).all()
    with pytest.raises(ValueError, match="singular"):
        whitening_matrix(few, 0.0)
    with pytest.raises(ValueError, match="singular"):
        whitening_matrix(torch.ones(4, 8), s)  # vectors that never vary
    with pytest.raises(ValueError, match="shrinkage must be in"):
        whitening_matrix(v, 1.5)
    with pytest.raises(ValueError, match="at least two"):
        EmbeddingStats.from_vectors(v[:1], shrinkage=s)


def test_standardize_with_a_whitening_matrix_centres_then_multiplies() -> None:
    w = torch.tensor([[1.0, 2.0], [0.0, -1.0]])
    stats = EmbeddingStats(mean=torch.tensor([1.0, -1.0]), std=torch.tensor([100.0, 100.0]), whitening=w)
    v = torch.tensor([[2.0, 1.0], [1.0, -1.0]])
    # (v - mean) = [[1, 2], [0, 0]]; @ W = [[1, 0], [0, 0]]: the std plays no part once W is there
    assert torch.equal(standardize(v, stats), torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    assert torch.equal(standardize(v.to(torch.bfloat16), stats), standardize(v, stats))
    per_dim = EmbeddingStats(mean=stats.mean, std=torch.tensor([2.0, 4.0]))
    assert per_dim.method == "per-dimension" and per_dim.whitening is None
    assert torch.equal(standardize(v, per_dim), torch.tensor([[0.5, 0.5], [0.0, 0.0]]))
    # pool_hidden applies the whitening to means only
    h = torch.randn(2, 3, 2)
    assert torch.allclose(pool_hidden(h, None, "mean", stats=stats), (h.mean(1) - stats.mean) @ w, atol=1e-6)
    assert torch.equal(pool_hidden(h, None, "last", stats=stats), h[:, -1])
