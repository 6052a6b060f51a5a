"""Chunked attention shared by the LSH and local layers.

A sequence (sorted by bucket for LSH, as-is for local) is cut into chunks of `chunk` positions; each
chunk attends to itself and its neighbouring chunks. The neighbours wrap around the concatenation of all
hash rounds, as in the reference. The reference computes that wrap on the padded batch, so a sequence's
result would depend on how much padding it was batched with; here every row wraps within its *own*
padded length (`own_chunks`), which is what the reference computes for that row alone.
"""

from __future__ import annotations

import math
from typing import Any

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


def look_adjacent(x: Tensor, before: int, after: int) -> Tensor:
    """Each chunk with its neighbours, circular over the chunk axis (every row has the batch's length).
    x (B, H, N, C, *rest) -> (B, H, N, (before+1+after)*C, *rest), previous chunks first."""
    b, h, n, c = x.shape[:4]
    rest = x.shape[4:]
    w = before + 1 + after
    out = x.new_empty(b, h, n, w, c, *rest)
    for slot, off in enumerate(range(-before, after + 1)):
        # slot `slot` of chunk j holds chunk (j + off) mod N
        s = off % n
        if s == 0:
            out[:, :, :, slot] = x
        else:
            out[:, :, : n - s, slot] = x[:, :, s:]
            out[:, :, n - s :, slot] = x[:, :, :s]
    return out.view(b, h, n, w * c, *rest)


def strided_windows(x: Tensor, chunk: int, before: int, after: int) -> Tensor:
    """Like `look_adjacent`, for a sequence whose chunks are contiguous: each window is a view into the
    sequence extended by the wrapped chunks, so no window is copied. (Read-only: windows overlap.)
    x (B, H, N*C, *rest) -> (B, H, N, (before+1+after)*C, *rest)."""
    parts = ([x[:, :, x.shape[2] - before * chunk:]] if before else []) + [x] + \
        ([x[:, :, : after * chunk]] if after else [])
    ext = torch.cat(parts, dim=2) if len(parts) > 1 else x.contiguous()
    n = x.shape[2] // chunk
    row = math.prod(x.shape[3:])
    size = (x.shape[0], x.shape[1], n, (before + 1 + after) * chunk, *x.shape[3:])
    stride = (ext.stride(0), ext.stride(1), chunk * row, *ext.stride()[2:])
    return ext.as_strided(size, stride)


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
