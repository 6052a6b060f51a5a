"""Successor-value heads: in heads 0..k-1 of an LSH layer, key s contributes the value of position s+1.

A shared query/key hop lands on the position aligned with the query in an earlier occurrence; a causal value
there holds only what came before it. Reading the next position's value instead lets one hop fetch what
followed the match (copying). The contract every path keeps (forward, sliced prefill, decode step, C, ONNX):
- the value of key s is v[s+1] where position s+1 is real, else 0 (the last position's is always 0);
- a query t attends keys s < t only (its own position is excluded outright, so s+1 <= t: no leak);
- a query that can attend nothing but itself outputs exactly 0 in those heads.
Plain heads (k..H-1) are unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .masks import mask_value


def successor_values(v: Tensor, heads: int, valid: Tensor | None) -> Tensor:
    """v (B, H, L, D) -> (B, H, L, D) with heads 0..heads-1 holding v[s+1] (0 at the last position and where
    position s+1 is padding); valid (B, L) bool, False at padding, or None (no padding)."""
    if heads == 0:
        return v
    b, _, t, d = v.shape
    ahead = torch.cat([v[:, :heads, 1:], v.new_zeros(b, heads, 1, d)], dim=2)  # (B, k, L, D)
    if valid is not None:
        next_real = torch.cat([valid[:, 1:], valid.new_zeros(b, 1)], dim=1)  # (B, L): position s+1 is real
        ahead = torch.where(next_real[:, None, :, None], ahead, torch.zeros((), dtype=v.dtype, device=v.device))
    return torch.cat([ahead, v[:, heads:]], dim=1)


def no_key_threshold(dtype: torch.dtype) -> float:
    """A log-sum-exp below this means the softmax saw only masked keys: half the mask value, far below any
    real score and below the self-mask value a plain head's self-only row gets (model/chunking.py)."""
    return 0.5 * mask_value(dtype)


def zero_rows_without_keys(out: Tensor, lse: Tensor, heads: int) -> Tensor:
    """out (B, H, L, D), lse (B, H, L) or (B, H, R, L) (per hash round, position order) -> out with the rows
    of heads 0..heads-1 that attended no key (in any round) set to exactly 0."""
    if heads == 0:
        return out
    seen = lse[:, :heads] >= no_key_threshold(out.dtype)
    if seen.dim() == 4:
        seen = seen.any(dim=2)  # (B, k, L): some round saw a key
    zero = torch.zeros((), dtype=out.dtype, device=out.device)
    return torch.cat([torch.where(seen.unsqueeze(-1), out[:, :heads], zero), out[:, heads:]], dim=1)
