"""The masks of chunked attention: the mask values and the additive bias built from query and key positions
(future keys, padding, a query's own position). One definition for the forward, the sliced prefill and the
ONNX graph; the decode steps and C kernels take the same values (`mask_value`, `self_mask_value`) as arguments."""

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


def attention_bias(
    q_pos: Tensor, k_pos: Tensor, k_valid: Tensor | None, causal: bool, self_mask: bool, dtype: torch.dtype,
    *, strict: bool = False,
) -> Tensor:
    """Additive mask. q_pos (..., Q), k_pos (..., K), k_valid (..., K) bool -> (..., Q, K).

    Keys in the future or in padding get -1e9; with `self_mask` a query's own position gets -1e5, so a
    token attends to itself only when nothing else is allowed. The reference replaces logits by these
    values instead of adding them: the softmax is the same, and a row that sees only itself gets a
    log-sum-exp of -1e5 + q.k instead of -1e5, which rounds to the same hash-round weights.
    `strict` (successor-value heads, model/lsh/successor.py): only earlier keys are allowed; the query's own
    position gets -1e9 too."""
    qp = q_pos.unsqueeze(-1)
    kp = k_pos.unsqueeze(-2)
    device = q_pos.device
    zero = torch.zeros((), dtype=dtype, device=device)
    neg = torch.full((), mask_value(dtype), dtype=dtype, device=device)
    bias = torch.where(kp == qp, torch.full((), self_mask_value(dtype), dtype=dtype, device=device), zero) \
        if self_mask else zero
    if strict:
        bias = torch.where(kp >= qp, neg, bias)
    elif causal:
        bias = torch.where(kp > qp, neg, bias)
    if k_valid is not None:
        bias = torch.where(k_valid.unsqueeze(-2), bias, neg)
    return bias.expand(torch.broadcast_shapes(bias.shape, qp.shape, kp.shape))
