"""Chunked attention shared by the LSH and local layers.

A sequence (sorted by bucket for LSH, as-is for local) is cut into chunks of `chunk` positions; each
chunk attends to itself and its neighbouring chunks. The neighbours wrap around the concatenation of all
hash rounds, as in the reference. The reference computes that wrap on the padded batch, so a sequence's
result would depend on how much padding it was batched with; here every row wraps within its *own*
padded length (`own_chunks`), which is what the reference computes for that row alone.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Mask values replace a logit in the reference; here they are added, which gives the same softmax
# (a masked logit plus -1e9 is -1e9 to fp32 precision). They stay finite in half precision.
MASK_VALUE = {torch.float16: -1e4}
SELF_MASK_VALUE = {torch.float16: -1e3}


def mask_value(dtype: torch.dtype) -> float:
    return MASK_VALUE.get(dtype, -1e9)


def self_mask_value(dtype: torch.dtype) -> float:
    return SELF_MASK_VALUE.get(dtype, -1e5)


def window_chunk_index(
    own_chunks: Tensor, rounds: int, chunks: int, before: int, after: int
) -> Tensor:
    """Index of the chunks each chunk attends to.

    own_chunks: (B,) chunks per round holding each row's own (padded) sequence, <= `chunks`.
    Returns (B, rounds*chunks, before+1+after) indices into the flattened (round, chunk) axis.
    """
    device = own_chunks.device
    n = own_chunks.view(-1, 1, 1)  # (B, 1, 1)
    r = torch.arange(rounds, device=device).view(1, rounds, 1, 1)
    j = torch.arange(chunks, device=device).view(1, 1, chunks, 1)
    off = torch.arange(-before, after + 1, device=device).view(1, 1, 1, -1)
    n4 = n.unsqueeze(-1)  # (B, 1, 1, 1)
    # position in the row's own layout of rounds*own_chunks chunks, wrapped circularly
    t = torch.remainder(r * n4 + j + off, rounds * n4)
    idx = (t // n4) * chunks + t % n4  # (B, rounds, chunks, W)
    # chunks past a row's own length hold only padding: let them look at themselves
    own = r * chunks + j
    idx = torch.where(j < n4, idx, own.expand_as(idx))
    return idx.reshape(own_chunks.shape[0], rounds * chunks, before + 1 + after)


def gather_chunks(x: Tensor, win: Tensor) -> Tensor:
    """x: (B, H, N, C, *rest); win: (B, N, W) -> (B, H, N, W*C, *rest)."""
    b, h, n, c = x.shape[:4]
    rest = x.shape[4:]
    w = win.shape[-1]
    flat = x.transpose(1, 2).reshape(b * n, h, c, *rest)  # (B*N, H, C, *rest)
    base = torch.arange(b, device=x.device).view(b, 1, 1) * n
    picked = flat[(win + base).reshape(-1)]  # (B*N*W, H, C, *rest)
    picked = picked.view(b, n, w, h, c, *rest).permute(0, 3, 1, 2, 4, *range(5, 5 + len(rest)))
    return picked.reshape(b, h, n, w * c, *rest)  # (B, H, N, W*C, *rest)


def attention_bias(
    q_pos: Tensor, k_pos: Tensor, k_valid: Tensor | None, causal: bool, dtype: torch.dtype
) -> Tensor:
    """Additive causal/padding mask. q_pos (..., Q), k_pos (..., K), k_valid (..., K) bool -> (..., Q, K).
    (`self_mask` is applied by `attend`, which replaces rather than adds.)"""
    qp = q_pos.unsqueeze(-1)
    kp = k_pos.unsqueeze(-2)
    zero = torch.zeros((), dtype=dtype, device=q_pos.device)
    masked: Tensor | None = (kp > qp) if causal else None
    if k_valid is not None:
        pad = ~k_valid.unsqueeze(-2)
        masked = pad if masked is None else masked | pad
    if masked is None:
        bias = zero.expand(torch.broadcast_shapes(qp.shape, kp.shape))
    else:
        bias = torch.where(masked, torch.full((), mask_value(dtype), dtype=dtype, device=q_pos.device), zero)
    return bias


def self_positions(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """(..., Q, K) bool: where a query meets its own position (shared query/key attention)."""
    return k_pos.unsqueeze(-2) == q_pos.unsqueeze(-1)


def attend(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor, self_mask: Tensor | None = None, dropout: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Softmax attention with an additive bias; returns (output, log-sum-exp of the logits).
    q (..., Q, D), k/v (..., K, D), bias (..., Q, K), self_mask (..., Q, K) bool.

    A query's own position gets the logit -1e5 (replaced, not added): it then attends to itself only when
    nothing else is allowed, and its log-sum-exp is exactly -1e5 as in the reference, which matters
    when hash rounds are combined."""
    dots = torch.matmul(q, k.transpose(-1, -2)) + bias  # (..., Q, K)
    if self_mask is not None:
        dots = dots.masked_fill(self_mask, self_mask_value(dots.dtype))
    lse = torch.logsumexp(dots, dim=-1, keepdim=True)  # (..., Q, 1)
    probs = torch.exp(dots - lse)
    if dropout > 0.0:
        probs = seeded_dropout(probs, dropout, generator)
    return torch.matmul(probs, v), lse.squeeze(-1)


def seeded_dropout(x: Tensor, p: float, generator: torch.Generator | None) -> Tensor:
    """Dropout whose mask comes from an explicit generator, so a recomputation reproduces it exactly."""
    if p <= 0.0:
        return x
    keep = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32) >= p
    return x * keep.to(x.dtype) / (1.0 - p)
