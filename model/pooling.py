"""Pooling final hidden states into one vector per row: used by ReformerLM.embed and by every serving
backend (torch and onnxruntime), so both pool alike under any supported padding.

Mean-pooled vectors can also be standardised per dimension, (v - mean) / std, with a mean and std estimated
on training passages (a diagonal form of BERT-whitening, Su et al. 2021): raw mean-pooled states share a
large common component and a few high-variance dimensions that dominate cosine similarity; removing them
lifted nearest-neighbour book identification from 0.863 to 0.905 on the default model
(bench/embed_quality.py). The artifact ships the statistics (embedding_stats.safetensors)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

POOLINGS = ("mean", "last")
STANDARDIZED_POOLINGS = ("mean",)  # "last" stays raw: the statistics are of mean-pooled vectors only
STD_FLOOR = 1e-6  # a dimension that never varies on the training passages is only centred, not blown up


@dataclass(frozen=True)
class EmbeddingStats:
    """Per-dimension mean and std (each (D,), float32) of mean-pooled vectors of training passages."""

    mean: Tensor
    std: Tensor

    @classmethod
    def from_vectors(cls, vectors: Tensor) -> EmbeddingStats:
        """(N, D) pooled vectors -> their per-dimension mean and (population) std, the std floored."""
        v = vectors.detach().float().cpu()
        if v.ndim != 2 or v.shape[0] < 2:
            raise ValueError(f"need at least two pooled vectors (N, D) to estimate statistics, got {tuple(v.shape)}")
        return cls(mean=v.mean(dim=0), std=v.std(dim=0, unbiased=False).clamp(min=STD_FLOOR))


def standardize(vec: Tensor, stats: EmbeddingStats) -> Tensor:
    """(B, D) -> (B, D): each dimension centred on the training mean and divided by the training std (in
    float32, whatever the vector's dtype, so bf16 models standardise as precisely as float32 ones)."""
    mean = stats.mean.to(device=vec.device, dtype=torch.float32)
    std = stats.std.to(device=vec.device, dtype=torch.float32)
    return (vec.float() - mean) / std


def standardize_pooled(vec: Tensor, pooling: str, stats: EmbeddingStats | None) -> Tensor:
    """`standardize` for the poolings the statistics describe ("mean"); other poolings and no stats: unchanged."""
    if stats is None or pooling not in STANDARDIZED_POOLINGS:
        return vec
    return standardize(vec, stats)


def pool_hidden(h: Tensor, attention_mask: Tensor | None, pooling: str = "mean", normalize: bool = False,
                stats: EmbeddingStats | None = None) -> Tensor:
    """h (B, L, D) in the caller's layout, mask (B, L) -> (B, D): the mean over real tokens, or the last real
    token's state (the highest position whose mask is set, so left and right padding pool alike). With
    `stats`, a mean-pooled vector is standardised before the optional L2 normalisation."""
    b, t, _ = h.shape
    mask = (torch.ones(b, t, device=h.device, dtype=h.dtype) if attention_mask is None
            else (attention_mask != 0).to(h.dtype))  # (B, L)
    if pooling == "mean":
        vec = (h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
    elif pooling == "last":
        pos = torch.arange(t, device=h.device)
        last = torch.where(mask > 0, pos, torch.zeros_like(pos)).amax(dim=1)  # (B,)
        vec = h[torch.arange(b, device=h.device), last]
    else:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    vec = standardize_pooled(vec, pooling, stats)
    return F.normalize(vec, dim=-1) if normalize else vec
