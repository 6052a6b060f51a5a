"""Standardisation of pooled embeddings: the math, which poolings it touches, and its order with L2."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.pooling import STD_FLOOR, EmbeddingStats, pool_hidden, standardize, standardize_pooled


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
