"""Attention over chunk windows, shared by the LSH and local layers: softmax with its log-sum-exp (plain, fused
and one-pass forms), the hash rounds' weights, and seeded dropout. The windows themselves (chunking with
look-back) and their masks are LSH primitives: model/lsh/windows.py and model/lsh/masks.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

# the mask values live with the LSH primitives (model/lsh/masks.py); the decode steps read them from here too
from .lsh.masks import MASK_VALUE, SELF_MASK_VALUE, mask_value, self_mask_value

__all__ = ["MASK_VALUE", "SELF_MASK_VALUE", "OnePassAttend", "attend", "attend_masked", "can_fuse", "fusable",
           "mask_value", "one_pass_ok", "round_weights", "seeded_dropout", "self_mask_value"]


def fusable(dropout: float, fused: bool) -> bool:
    """Whether a forward may use a fused kernel on any device: asked for by the layer (`fused`, a
    constructor argument), no dropout, no autograd, no tracing. Training, dropout and tracing use the plain
    formulation in `attend`. (Chunked LSH attention picks its kernel by device: model/fused_attention.py.)"""
    return (fused and dropout == 0.0 and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and not torch.jit.is_tracing())


def can_fuse(q: Tensor, dropout: float, fused: bool) -> bool:
    """Whether `attend` may run PyTorch's fused CPU attention kernel (it returns the log-sum-exp the
    hash-round combination needs): `fusable`, on CPU, in fp32 or bf16."""
    return fusable(dropout, fused) and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)


def attend(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor, dropout: float = 0.0, generator: torch.Generator | None = None,
    *, fused: bool = False,
) -> tuple[Tensor, Tensor]:
    """Softmax attention with an additive bias; returns (output, log-sum-exp of the logits).
    q (..., Q, D), k/v (..., K, D), bias (..., Q, K). Exact for rows where the self mask value occurs at
    most once (dense attention); chunked LSH attention uses `fused_lsh_attend`."""
    if can_fuse(q, dropout, fused):
        lead = q.shape[:-2]
        qq, kk, vv = (x.reshape(-1, lead[-1], *x.shape[-2:]) if len(lead) != 2 else x for x in (q, k, v))
        full = bias.expand(*lead, q.shape[-2], k.shape[-2])
        bb = full.reshape(-1, lead[-1], *full.shape[-2:]) if len(lead) != 2 else full
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qq, kk, vv, 0.0, False, attn_mask=bb.contiguous(), scale=1.0)
        return out.reshape(*lead, *out.shape[-2:]), lse.reshape(*lead, q.shape[-2])
    if dropout <= 0.0 and one_pass_ok(q, k, v, bias):
        return OnePassAttend.apply(q, k, v, bias)
    dots = torch.matmul(q, k.transpose(-1, -2)) + bias  # (..., Q, K)
    lse = torch.logsumexp(dots, dim=-1, keepdim=True)  # (..., Q, 1)
    probs = torch.exp(dots - lse)
    if dropout > 0.0:
        probs = seeded_dropout(probs, dropout, generator)
    return torch.matmul(probs, v), lse.squeeze(-1)


def one_pass_ok(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> bool:
    """Whether `OnePassAttend` applies: training (autograd records; forwards without it keep their bits),
    q, k, v share their leading shape (no broadcasting to undo in the backward) and their dtype, no
    autocast (its casts inside the forward would leave the backward mixing dtypes), the bias is a
    constant, and no tracer is recording (ONNX export keeps plain ops)."""
    return (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
            and q.shape[:-2] == k.shape[:-2] == v.shape[:-2] and q.dtype == k.dtype == v.dtype
            and not torch.is_autocast_enabled(q.device.type) and not bias.requires_grad
            and not torch.jit.is_tracing())


class OnePassAttend(torch.autograd.Function):
    """`attend` without dropout, with one exp per score and a hand-written backward.

    Autograd over logsumexp + exp takes three exps per score (logsumexp's forward, the probabilities,
    logsumexp's backward) and keeps the scores, the probabilities and the log-sum-exp. Here the forward
    takes e = exp(s - max) once: lse = max + log(sum e) (what logsumexp computes), probabilities
    e * exp(max - lse), and keeps only the probabilities and the output. The backward is softmax's with
    the log-sum-exp's gradient added (d lse / d s = probabilities):
    ds = p * (dp - rowsum(dout * out) + dlse), dp = dout @ v^T."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
        dots = torch.matmul(q, k.transpose(-1, -2)).add_(bias)  # (..., Q, K)
        top = dots.amax(dim=-1, keepdim=True)  # (..., Q, 1)
        probs = dots.sub_(top).exp_()
        lse = top + torch.log(probs.sum(dim=-1, keepdim=True))
        # exp(s - lse) as e * exp(max - lse), not e / sum e: lse is rounded at the logits' magnitude, and
        # rows that see only masked keys or their own position twice (-1e9, -1e5) get the old rounding
        probs.mul_(torch.exp(top - lse))
        out = torch.matmul(probs, v)  # (..., Q, D)
        ctx.save_for_backward(q, k, v, probs, out)
        ctx.set_materialize_grads(False)
        return out, lse.squeeze(-1)

    @staticmethod
    def backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None
                 ) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        q, k, v, probs, out = ctx.saved_tensors
        if dout is None and dlse is None:
            return None, None, None, None
        if dout is not None:
            dv = torch.matmul(probs.transpose(-1, -2), dout)  # (..., K, D)
            # rowsum(dp * p) = rowsum(dout * out): a (Q, D) reduction instead of a (Q, K) one
            shift = (dout * out).sum(dim=-1, keepdim=True)  # (..., Q, 1)
            if dlse is not None:
                shift = shift - dlse.unsqueeze(-1)
            ds = torch.matmul(dout, v.transpose(-1, -2)).sub_(shift).mul_(probs)  # (..., Q, K)
        else:
            dv = None
            ds = probs * dlse.unsqueeze(-1)  # type: ignore[union-attr]
        dq = torch.matmul(ds, k)
        dk = torch.matmul(ds.transpose(-1, -2), q)
        return dq, dk, dv, None


def attend_masked(q: Tensor, k: Tensor, v: Tensor, masked: Tensor, self_hit: Tensor | None) -> tuple[Tensor, Tensor]:
    """`attend` for static graphs (ONNX): boolean masks instead of a bias, and softmax and its log-sum-exp
    from one exp pass: e = exp(s - max), lse = max + log(sum e), output (e @ v) * exp(max - lse), which
    normalises the small (Q, D) output instead of the (Q, K) probabilities and keeps `attend`'s rounding
    for rows that see only themselves. masked (..., Q, K) True at future/padding keys; self_hit
    (..., Q, K) True at a query's own position (LSH) -> (out (..., Q, D), lse (..., Q))."""
    dots = torch.matmul(q, k.transpose(-1, -2))  # (..., Q, K)
    # casts and multiplies rather than `Where`s: onnxruntime runs them about 10% faster overall
    bias = masked.to(dots.dtype) * mask_value(dots.dtype)
    if self_hit is not None:
        bias = bias + self_hit.to(dots.dtype) * self_mask_value(dots.dtype)
    dots = dots + bias
    top = dots.amax(dim=-1, keepdim=True)  # (..., Q, 1)
    e = torch.exp(dots - top)
    lse = top + torch.log(e.sum(dim=-1, keepdim=True))
    out = torch.matmul(e, v) * torch.exp(top - lse)
    return out, lse.squeeze(-1)


def round_weights(lse: Tensor, dim: int) -> Tensor:
    """Each hash round's share of the probability mass, from the rounds' log-sum-exps along `dim`, computed
    as the reference does (not as a softmax, which rounds differently for rows that see only themselves).
    Used by the eager LSH layer, the static graph and cached decoding."""
    return torch.exp(lse - torch.logsumexp(lse, dim=dim, keepdim=True))


def seeded_dropout(x: Tensor, p: float, generator: torch.Generator | None) -> Tensor:
    """Dropout whose mask comes from an explicit generator, so a recomputation reproduces it exactly."""
    if p <= 0.0:
        return x
    keep = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32) >= p
    return x * keep.to(x.dtype) / (1.0 - p)
