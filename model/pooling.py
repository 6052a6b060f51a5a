"""Pooling final hidden states into one vector per row: used by ReformerLM.embed and by every serving
backend (torch and onnxruntime), so both pool alike under any supported padding.

Mean-pooled vectors can also be transformed with statistics estimated on training passages (the artifact
ships them, embedding_stats.safetensors). Raw mean-pooled states share a large common component and a few
high-variance, correlated directions that dominate cosine similarity; removing them is BERT-whitening (Su
et al. 2021). Two forms:
  * whitening (when the statistics hold the matrix): (v - mean) @ W, with W = V diag(e)^-1/2 from the
    eigendecomposition V diag(e) V^T of the shrunk covariance (1 - s) C + s mean(diag C) I;
  * per-dimension standardisation (older artifacts, without the matrix): (v - mean) / std.
On the default model, statistics from the same 2,055 training passages, nearest-neighbour book
identification of validation passages is 0.884 raw, 0.916 standardised and 0.990 whitened with s = 0.3
(chosen on training passages: export/embedding_stats.py; bench/results/embed_quality.json)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

POOLINGS = ("mean", "last")
STANDARDIZED_POOLINGS = ("mean",)  # "last" stays raw: the statistics are of mean-pooled vectors only
STD_FLOOR = 1e-6  # a dimension that never varies on the training passages is only centred, not blown up
# an eigenvalue below this fraction of the largest makes W blow one direction up by > 1e6: refuse instead
EIGEN_FLOOR = 1e-12


def whitening_matrix(vectors: Tensor, shrinkage: float) -> Tensor:
    """(N, D) vectors -> (D, D) float32 W such that (x - mean) @ W is white under the shrunk covariance.

    In float64: C = torch.cov (unbiased, N - 1), C_s = (1 - shrinkage) C + shrinkage mean(diag C) I,
    C_s = V diag(e) V^T (eigh), W = V / sqrt(e) (column j of V divided by sqrt(e_j)), so W^T C_s W = I and
    W W^T = C_s^-1. Full rank: with shrinkage > 0 any N >= 2 vectors that vary at all will do; with
    shrinkage 0 the vectors must span every dimension (N > D), else ValueError."""
    if not 0.0 <= shrinkage <= 1.0:
        raise ValueError(f"shrinkage must be in [0, 1], got {shrinkage}")
    v = vectors.detach().to(device="cpu", dtype=torch.float64)
    if v.ndim != 2 or v.shape[0] < 2:
        raise ValueError(f"need at least two vectors (N, D) to estimate a covariance, got {tuple(v.shape)}")
    c = torch.cov(v.T).reshape(v.shape[1], v.shape[1])  # reshape: torch.cov of one variable is a scalar
    shrunk = (1.0 - shrinkage) * c + shrinkage * c.diagonal().mean() * torch.eye(c.shape[0], dtype=torch.float64)
    e, vecs = torch.linalg.eigh(shrunk)
    if not bool(torch.isfinite(e).all()) or float(e.max()) <= 0 or float(e.min()) <= EIGEN_FLOOR * float(e.max()):
        raise ValueError(f"the shrunk covariance of {tuple(v.shape)} vectors is singular (smallest eigenvalue "
                         f"{float(e.min()):.3g}, largest {float(e.max()):.3g}): give shrinkage > 0 or more vectors "
                         "than dimensions, that vary")
    return (vecs / e.sqrt()).float().contiguous()


@dataclass(frozen=True)
class EmbeddingStats:
    """Statistics of mean-pooled vectors of training passages: per-dimension mean and std (each (D,),
    float32) and, optionally, the (D, D) float32 whitening matrix W (`whitening_matrix`). With W,
    `standardize` whitens; without it (artifacts written before W existed), it standardises per dimension."""

    mean: Tensor
    std: Tensor
    whitening: Tensor | None = None

    @property
    def method(self) -> str:
        """What `standardize` computes with these statistics: "whitening" or "per-dimension"."""
        return "whitening" if self.whitening is not None else "per-dimension"

    @classmethod
    def from_vectors(cls, vectors: Tensor, shrinkage: float | None = None) -> EmbeddingStats:
        """(N, D) pooled vectors -> their per-dimension mean and (population) std, the std floored, and with a
        `shrinkage` (in [0, 1]) the whitening matrix of their shrunk covariance; None: no matrix."""
        v = vectors.detach().float().cpu()
        if v.ndim != 2 or v.shape[0] < 2:
            raise ValueError(f"need at least two pooled vectors (N, D) to estimate statistics, got {tuple(v.shape)}")
        whitening = whitening_matrix(vectors, shrinkage) if shrinkage is not None else None
        return cls(mean=v.mean(dim=0), std=v.std(dim=0, unbiased=False).clamp(min=STD_FLOOR), whitening=whitening)


def standardize(vec: Tensor, stats: EmbeddingStats) -> Tensor:
    """(B, D) -> (B, D), in float32 whatever the vector's dtype (so bf16 models get the same precision):
    with a whitening matrix, (vec - mean) @ whitening; without one, (vec - mean) / std, per dimension."""
    mean = stats.mean.to(device=vec.device, dtype=torch.float32)
    if stats.whitening is not None:
        return (vec.float() - mean) @ stats.whitening.to(device=vec.device, dtype=torch.float32)
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
    `stats`, a mean-pooled vector goes through `standardize` (whitened, or per dimension for statistics
    without a matrix) before the optional L2 normalisation."""
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
