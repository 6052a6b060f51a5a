"""The model's LSH and local attention as the exported graph computes them: the same math as
model/attention.py (same hashing, sort, own-length window wrap, masks, log-sum-exp round weights), laid
out for onnxruntime, where the profile of the straightforward graph was dominated by the mask `Where`s
and `ReduceLogSumExp` over the chunked score blocks:

- input is right-padded (attention_mask is 1s then 0s), so a key is padding exactly when its position is
  at or past the row's real length; for a causal model that is already implied by the causal mask for
  every real query, so one comparison `key_pos > min(query_pos, real_length - 1)` replaces three masks;
- the local layers' mask depends only on positions and lengths, so it is built once per forward and
  shared by every local layer and head; causal local layers take their neighbour chunks by shifting
  (no gather), and LSH windows are gathered along the chunk axis of one head (no transposes);
- softmax and its log-sum-exp share one exp pass: e = exp(s - max), lse = max + log(sum e), and the
  output is (e @ v) * exp(max - lse), which normalises the small (C, D) output instead of the (C, W*C)
  probabilities and keeps eager's rounding for rows that see only themselves.

The masks become one additive bias as in eager (-1e9 for future or padding keys, -1e5 at an LSH query's
own position), built with casts and multiplies, which onnxruntime runs about 10% faster overall than
the same masks as `Where`s. Export verification compares the result with the eager model on every real
token."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from model.attention import LocalSelfAttention, LSHSelfAttention, length_normalize, split_heads
from model.chunking import gather_chunks, mask_value, self_mask_value, window_chunk_index


@dataclass
class GraphBatch:
    """Per-forward tensors every attention layer needs."""

    real_length: Tensor  # (B,) real tokens per row (right padding)
    own_length: Tensor  # (B,) each row's length as eager pads it alone
    causal: bool


def masked_positions(q_pos: Tensor, k_pos: Tensor, batch: GraphBatch) -> Tensor:
    """(..., Q), (..., K) positions of a (B, ...) layout -> (..., Q, K) bool: future or padding keys."""
    shape = (-1,) + (1,) * (q_pos.dim() - 1)
    real = batch.real_length.view(shape)
    if batch.causal:
        # padding keys sit after every real query, so the causal test covers them for real queries
        limit = torch.minimum(q_pos, real - 1)
        return k_pos.unsqueeze(-2) > limit.unsqueeze(-1)
    return (k_pos >= real).unsqueeze(-2).expand(*q_pos.shape, k_pos.shape[-1])


def attend(q: Tensor, k: Tensor, v: Tensor, masked: Tensor, self_hit: Tensor | None) -> tuple[Tensor, Tensor]:
    """(out (..., Q, D), lse (..., Q)) of softmax(q k^T with masks) v."""
    dots = torch.matmul(q, k.transpose(-1, -2))  # (..., Q, K)
    bias = masked.to(dots.dtype) * mask_value(dots.dtype)
    if self_hit is not None:
        bias = bias + self_hit.to(dots.dtype) * self_mask_value(dots.dtype)
    dots = dots + bias
    top = dots.amax(dim=-1, keepdim=True)  # (..., Q, 1)
    e = torch.exp(dots - top)
    lse = top + torch.log(e.sum(dim=-1, keepdim=True))
    out = torch.matmul(e, v) * torch.exp(top - lse)
    return out, lse.squeeze(-1)


def windows(x: Tensor, win: Tensor) -> Tensor:
    """x (B, M, C, *rest), win (B, M, W) chunk indices -> (B, M, W*C, *rest): every chunk's window, built
    by one gather along the chunk axis (no head axis to move, so no transposes in the graph)."""
    b, m, c = x.shape[:3]
    rest = x.shape[3:]
    base = torch.arange(b, device=x.device).view(b, 1, 1) * m
    picked = x.reshape(b * m, c, *rest)[(win + base).reshape(-1)]  # (B*M*W, C, *rest)
    return picked.view(b, m, win.shape[-1] * c, *rest)


def shifted_windows(x: Tensor, before: int, dim: int) -> Tensor:
    """Chunk axis `dim`, chunk positions on `dim + 1`: each chunk after the `before` chunks ahead of it,
    wrapping around the batch's chunk axis -> the chunk-position axis grows to (before+1)*C. For a causal
    layer this equals eager's per-row wrap: a wrapped chunk lies after every query of the chunk that sees
    it, so the causal mask removes it either way."""
    parts = [torch.roll(x, shifts=s, dims=dim) for s in range(before, 0, -1)] + [x]
    return torch.cat(parts, dim=dim + 1)


def local_mask(chunk: int, before: int, after: int, t: int, batch: GraphBatch) -> tuple[Tensor | None, Tensor, Tensor]:
    """(window chunk index (B, N, W) or None for shifted windows, chunked mask (B, 1, N, C, W*C), dense
    first-chunk mask (B, 1, C, C)): positions only, so one mask serves every local layer and head."""
    b = batch.own_length.shape[0]
    n = t // chunk
    pos = torch.arange(t, device=batch.own_length.device)
    qp = pos.view(1, 1, n, chunk).expand(b, 1, n, chunk)  # (B, 1, N, C)
    win = None
    if batch.causal and after == 0:
        kp = shifted_windows(qp, before, dim=2)  # (B, 1, N, W*C)
    else:
        own_chunks = torch.clamp((batch.own_length + chunk - 1) // chunk, min=1)
        win = window_chunk_index(own_chunks, 1, n, before, after)
        kp = gather_chunks(qp.unsqueeze(-1), win).squeeze(-1)
    first = pos[:chunk].view(1, 1, chunk).expand(b, 1, chunk)
    return win, masked_positions(qp, kp, batch), masked_positions(first, first, batch)


def local_attention(att: LocalSelfAttention, h: Tensor, batch: GraphBatch,
                    masks: tuple[Tensor | None, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """h (B, L, hidden) -> (chunked (B, H, L, D), dense over the first chunk (B, H, C, D))."""
    win, masked, masked_first = masks
    b, t, _ = h.shape
    c, d = att.chunk, att.head_size
    q = split_heads(att.query(h), att.heads, d)  # (B, H, L, D)
    k = split_heads(att.key(h), att.heads, d) / math.sqrt(d)
    v = split_heads(att.value(h), att.heads, d)
    n = t // c
    k_c, v_c = k.view(b, att.heads, n, c, d), v.view(b, att.heads, n, c, d)
    if win is None:
        k_w, v_w = shifted_windows(k_c, att.before, dim=2), shifted_windows(v_c, att.before, dim=2)
    else:
        k_w, v_w = gather_chunks(k_c, win), gather_chunks(v_c, win)  # (B, H, N, W*C, D)
    out, _ = attend(q.view(b, att.heads, n, c, d), k_w, v_w, masked, None)
    dense, _ = attend(q[:, :, :c], k[:, :, :c], v[:, :, :c], masked_first, None)
    return out.reshape(b, att.heads, t, d), dense


def lsh_attention(att: LSHSelfAttention, h: Tensor, valid: Tensor, batch: GraphBatch) -> tuple[Tensor, Tensor]:
    """h (B, L, hidden) -> (chunked (B, H, L, D), dense over the first chunk (B, H, C, D))."""
    b, t, _ = h.shape
    r, c, d = att.rounds, att.chunk, att.head_size
    n = t // c
    qk = split_heads(att.query_key(h), att.heads, d)  # (B, H, L, D)
    v = split_heads(att.value(h), att.heads, d)
    num_buckets = att.config.num_buckets
    assert num_buckets is not None
    buckets = att.hash(qk, num_buckets, valid)  # (B, H, R, L), padding in the extra bucket
    pos = torch.arange(t, device=h.device)
    # sort each round by (bucket, position): unique keys, so the sort is stable
    order = torch.argsort(buckets * t + pos, dim=-1)  # (B, H, R, L)
    sorted_pos = order.reshape(b, att.heads, r * t)
    own_chunks = torch.clamp((batch.own_length + c - 1) // c, min=1)
    win = window_chunk_index(own_chunks, r, n, att.before, att.after)  # (B, R*N, W)
    k = length_normalize(qk) / math.sqrt(d)
    heads = []
    for i in range(att.heads):  # one head at a time: peak memory is one head's score blocks
        sp = sorted_pos[:, i]  # (B, R*L)
        idx = sp.unsqueeze(-1).expand(-1, -1, d)
        q_c = torch.gather(qk[:, i], 1, idx).view(b, r * n, c, d)  # (B, R*N, C, D)
        k_c = torch.gather(k[:, i], 1, idx).view(b, r * n, c, d)
        v_c = torch.gather(v[:, i], 1, idx).view(b, r * n, c, d)
        qp = sp.view(b, r * n, c)  # (B, R*N, C)
        kp = windows(qp.unsqueeze(-1), win).squeeze(-1)  # (B, R*N, W*C)
        self_hit = kp.unsqueeze(-2) == qp.unsqueeze(-1)
        o, lse = attend(q_c, windows(k_c, win), windows(v_c, win), masked_positions(qp, kp, batch),
                        self_hit)  # (B, R*N, C, D), (B, R*N, C)
        # undo the sort, then weigh every round by its share of the probability mass
        undo = order[:, i]  # (B, R, L)
        o = torch.empty_like(o.view(b, r, t, d)).scatter(2, undo.unsqueeze(-1).expand(-1, -1, -1, d),
                                                         o.view(b, r, t, d))
        lse = torch.empty_like(lse.view(b, r, t)).scatter(2, undo, lse.view(b, r, t))
        weights = torch.exp(lse - torch.logsumexp(lse, dim=1, keepdim=True)).unsqueeze(-1)
        heads.append((o * weights).sum(dim=1))  # (B, L, D)
    first = pos[:c].view(1, 1, c).expand(b, 1, c)
    self_first = (first.unsqueeze(-1) == first.unsqueeze(-2))
    dense, _ = attend(qk[:, :, :c], k[:, :, :c], v[:, :, :c], masked_positions(first, first, batch), self_first)
    return torch.stack(heads, dim=1), dense
