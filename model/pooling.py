"""Pooling final hidden states into one vector per row: used by ReformerLM.embed and by every serving
backend (torch and onnxruntime), so both pool alike under any supported padding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

POOLINGS = ("mean", "last")


def pool_hidden(h: Tensor, attention_mask: Tensor | None, pooling: str = "mean", normalize: bool = False) -> Tensor:
    """h (B, L, D) in the caller's layout, mask (B, L) -> (B, D): the mean over real tokens, or the last real
    token's state (the highest position whose mask is set, so left and right padding pool alike)."""
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
    return F.normalize(vec, dim=-1) if normalize else vec
