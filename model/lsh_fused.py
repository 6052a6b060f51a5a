"""The eval-time inner loop of chunked LSH attention on CPU, built around PyTorch's fused attention
kernel. The training path (model/chunking.py `attend`) is the plain formulation; both match the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .chunking import mask_value, self_mask_value


def fused_lsh_attend(q: Tensor, k: Tensor, v: Tensor, v_own: Tensor, q_pos: Tensor, k_pos: Tensor,
                     k_valid: Tensor | None, causal: bool) -> tuple[Tensor, Tensor]:
    """q, v_own (B, H, N, C, D); k, v (B, H, N, W*C, D); q_pos (B, H, N, C); k_pos, k_valid (B, H, N, W*C).
    v_own holds each query's own value.
    Returns (output (B, H, N, C, D), log-sum-exp (B, H, N, C)) as the reference computes them.

    A query's own position is masked outright here. In the reference it gets the logit -1e5 instead,
    which contributes nothing (exp(-1e5) = 0) unless the query sees nothing else. Those rows (the first
    token, or a token alone with later tokens in its window) come out of the kernel fully masked and are
    rebuilt below exactly as the reference computes them."""
    qp = q_pos.unsqueeze(-1)
    kp = k_pos.unsqueeze(-2)
    dtype = q.dtype
    zero = torch.zeros((), dtype=dtype)
    neg = torch.full((), mask_value(dtype), dtype=dtype)
    allowed = (kp < qp) if causal else (kp != qp)  # (B, H, N, C, W*C)
    bias = torch.where(allowed, zero, neg)
    if k_valid is not None:
        bias = torch.where(k_valid.unsqueeze(-2), bias, neg)
    b, h, n, c, d = q.shape
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.reshape(b * h, n, c, d), _merge_batch_heads(k), _merge_batch_heads(v), 0.0, False,
        attn_mask=bias.view(b * h, n, c, -1), scale=1.0)
    out = out.view(b, h, n, c, d)
    lse = lse.view(b, h, n, c)
    alone = lse < 0.5 * mask_value(dtype)
    if bool(alone.any()):
        _attend_to_self(out, lse, alone, q_pos, k_pos, v_own)
    return out, lse


def _merge_batch_heads(x: Tensor) -> Tensor:
    """(B, H, N, K, D) -> (B*H, N, K, D), as a view when H == 1 (x may be overlapping strided windows)."""
    if x.shape[1] == 1:
        return x.select(1, 0)
    return x.reshape(-1, *x.shape[2:])


def _attend_to_self(out: Tensor, lse: Tensor, alone: Tensor, q_pos: Tensor, k_pos: Tensor, v_own: Tensor
                    ) -> None:
    """Rows that may only see their own position, which the window can hold several times (once per hash
    round it wraps into). The reference gives each copy the logit -1e5 and normalises by an fp32
    log-sum-exp, so the row's output is count*exp(-1e5 - lse)*v_self with lse = -1e5 + log(count)."""
    bi, hi, ni, ci = alone.nonzero(as_tuple=True)
    own = q_pos[bi, hi, ni, ci]  # (M,)
    count = (k_pos[bi, hi, ni] == own.unsqueeze(-1)).sum(-1).clamp(min=1).to(lse.dtype)  # (M,)
    self_value = self_mask_value(lse.dtype)
    row_lse = torch.log(count) + self_value
    v_self = v_own[bi, hi, ni, ci]  # (M, D)
    out[bi, hi, ni, ci] = (count * torch.exp(self_value - row_lse)).unsqueeze(-1) * v_self
    lse[bi, hi, ni, ci] = row_lse
