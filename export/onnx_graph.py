"""The model's forward with static shapes, as the exported (ONNX) graph computes it: the same math as the
eager layers (model/attention.py: same hashing, sort, own-length window wrap, masks, log-sum-exp round
weights) and the same batch preparation (model/batch.py, in its `static` form), in one code path valid
for every shape and laid out for onnxruntime, where the profile of the straightforward graph was
dominated by the mask `Where`s and `ReduceLogSumExp` over the chunked score blocks:

- the prepared batch is right-padded (each row's real tokens first), so a key is padding exactly when its
  position is at or past the row's real length; for a causal model that is already implied by the
  causal mask for every real query, so one comparison `key_pos > min(query_pos, real_length - 1)`
  replaces three masks;
- the local layers' mask depends only on positions and lengths, so it is built once per forward and
  shared by every local layer and head; causal local layers take their neighbour chunks by shifting
  (no gather), and LSH windows are gathered along the chunk axis of one head (no transposes);
- softmax and its log-sum-exp share one exp pass (chunking.attend_masked);
- every row gets chunked attention wrapping within its own padded length, and rows whose own length
  fits one chunk select, with `where`, the dense attention eager gives such a row.

Export verification compares the result with the eager model on every real token."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from model.attention import LocalSelfAttention, LSHSelfAttention, length_normalize, merge_heads, split_heads
from model.batch import prepare_batch
from model.chunking import attend_masked, round_weights
from model.lsh.order import bucket_order
from model.lsh.successor import successor_values, zero_rows_without_keys
from model.lsh.windows import gather_chunks, window_chunk_index
from model.reversible import ReformerLayer

if TYPE_CHECKING:
    from model.reformer import ReformerLM


@dataclass
class GraphBatch:
    """Per-forward tensors every attention layer needs."""

    real_length: Tensor  # (B,) real tokens per row (the prepared batch is right-padded)
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
    out, _ = attend_masked(q.view(b, att.heads, n, c, d), k_w, v_w, masked, None)
    dense, _ = attend_masked(q[:, :, :c], k[:, :, :c], v[:, :, :c], masked_first, None)
    return out.reshape(b, att.heads, t, d), dense


def lsh_attention(att: LSHSelfAttention, h: Tensor, valid: Tensor, batch: GraphBatch) -> tuple[Tensor, Tensor]:
    """h (B, L, hidden) -> (chunked (B, H, L, D), dense over the first chunk (B, H, C, D)).

    Every head is a row of a (B*H) batch, so the graph holds one copy of the sorted attention, not one per
    head. Unrolled per head, google/reformer-enwik8's 8 heads made the LSH layers most of a 12-layer export's
    time (bench/import_hf/import_hf_enwik8.py): a one-layer LSH model of its shape at hidden 64 exported in 65.5 s to
    2,334 ONNX nodes, folded in 26.7 s to 729 (scratch script, two cores shared with a training run). The
    price is onnxruntime's peak memory on long inputs: every head's score blocks at once, as eager holds
    them in training (outside training it goes one head at a time)."""
    b, t, _ = h.shape
    heads, r, c, d = att.heads, att.rounds, att.chunk, att.head_size
    n = t // c
    s = att.successor_heads  # heads 0..s-1: successor values, earlier keys only (model/lsh/successor.py)
    qk = split_heads(att.query_key(h), heads, d)  # (B, H, L, D)
    v = successor_values(split_heads(att.value(h), heads, d), s, valid)  # (B, H, L, D)
    num_buckets = att.config.num_buckets
    assert num_buckets is not None
    buckets = att.hash(qk, num_buckets, valid)  # (B, H, R, L), padding in the extra bucket
    pos = torch.arange(t, device=h.device)
    order = bucket_order(buckets)  # (B, H, R, L): each round sorted by (bucket, position)
    bh = b * heads
    per_head = GraphBatch(real_length=batch.real_length.repeat_interleave(heads),
                          own_length=batch.own_length.repeat_interleave(heads), causal=batch.causal)
    sp = order.reshape(bh, r * t)  # (B*H, R*L): row b*H + i is head i of row b
    own_chunks = torch.clamp((per_head.own_length + c - 1) // c, min=1)
    win = window_chunk_index(own_chunks, r, n, att.before, att.after)  # (B*H, R*N, W)
    k = length_normalize(qk) / math.sqrt(d)
    idx = sp.unsqueeze(-1).expand(-1, -1, d)  # (B*H, R*L, D)
    q_c = torch.gather(qk.reshape(bh, t, d), 1, idx).view(bh, r * n, c, d)  # (B*H, R*N, C, D)
    k_c = torch.gather(k.reshape(bh, t, d), 1, idx).view(bh, r * n, c, d)
    v_c = torch.gather(v.reshape(bh, t, d), 1, idx).view(bh, r * n, c, d)
    qp = sp.view(bh, r * n, c)  # (B*H, R*N, C)
    kp = windows(qp.unsqueeze(-1), win).squeeze(-1)  # (B*H, R*N, W*C)
    self_hit = kp.unsqueeze(-2) == qp.unsqueeze(-1)
    masked = masked_positions(qp, kp, per_head)  # (B*H, R*N, C, W*C)
    if s:
        rows = (torch.arange(bh, device=h.device) % heads < s).view(bh, 1, 1, 1)  # row b*H + i is head i
        masked, self_hit = _successor_masks(masked, self_hit, qp, kp, rows)
    o, lse = attend_masked(q_c, windows(k_c, win), windows(v_c, win), masked, self_hit)  # (B*H,R*N,C,D), (B*H,R*N,C)
    # undo the sort, then weigh every round by its share of the probability mass
    undo = order.reshape(bh, r, t)  # (B*H, R, L)
    o = torch.empty_like(o.view(bh, r, t, d)).scatter(2, undo.unsqueeze(-1).expand(-1, -1, -1, d),
                                                      o.view(bh, r, t, d))
    lse = torch.empty_like(lse.view(bh, r, t)).scatter(2, undo, lse.view(bh, r, t))
    weights = round_weights(lse, dim=1).unsqueeze(-1)  # (B*H, R, L, 1)
    chunked = (o * weights).sum(dim=1).view(b, heads, t, d)  # (B, H, L, D)
    first = pos[:c].view(1, 1, c).expand(b, 1, c)
    self_first = (first.unsqueeze(-1) == first.unsqueeze(-2))  # (B, 1, C, C)
    masked_first = masked_positions(first, first, batch)
    if s:
        succ_heads = (torch.arange(heads, device=h.device) < s).view(1, heads, 1, 1)
        masked_first, self_first = _successor_masks(masked_first, self_first, first, first, succ_heads)
        chunked = zero_rows_without_keys(chunked, lse.view(b, heads, r, t), s)
    dense, dense_lse = attend_masked(qk[:, :, :c], k[:, :, :c], v[:, :, :c], masked_first, self_first)
    return chunked, zero_rows_without_keys(dense, dense_lse, s)


def _successor_masks(masked: Tensor, self_hit: Tensor, q_pos: Tensor, k_pos: Tensor, successor_rows: Tensor
                     ) -> tuple[Tensor, Tensor]:
    """The masks of successor-value heads (`successor_rows`, broadcast against masked and self_hit (..., Q, K)
    as attend_masked takes them): only earlier keys allowed, the own position masked outright rather than
    given the self-mask value."""
    later = k_pos.unsqueeze(-2) >= q_pos.unsqueeze(-1)  # (..., Q, K)
    return masked | (later & successor_rows), self_hit & ~successor_rows


def static_forward(lm: ReformerLM, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(input_ids, attention_mask) (B, L) -> (logits (B, L, vocab), hidden_states (B, L, 2*hidden)) in the
    caller's layout, every real token as eager computes its row alone. No data-dependent Python branch,
    so it traces to one graph for every shape. The mask is not checked here (a graph cannot raise):
    callers check it with model.batch.check_attention_mask."""
    cfg = lm.config
    prepared = prepare_batch(input_ids, attention_mask, cfg, static=True)
    assert prepared.valid is not None  # the static form always builds the mask
    batch = GraphBatch(real_length=prepared.length, own_length=prepared.own_length, causal=cfg.is_decoder)
    padded = prepared.input_ids.shape[1]
    x1 = x2 = lm.embeddings(prepared.input_ids)  # (B, L', hidden)
    local_masks = None  # every local layer has the same chunking: one mask for all of them
    for layer in lm.layers:
        assert isinstance(layer, ReformerLayer)
        block = layer.attention
        att = block.self_attention
        h = block.layer_norm(x2)
        if isinstance(att, LSHSelfAttention):
            chunked, dense = lsh_attention(att, h, prepared.valid, batch)
        elif isinstance(att, LocalSelfAttention):
            if local_masks is None:
                local_masks = local_mask(att.chunk, att.before, att.after, padded, batch)
            chunked, dense = local_attention(att, h, batch, local_masks)
        else:
            raise TypeError(f"unknown attention layer {type(att).__name__}")
        # rows whose own length fits one chunk get dense attention, as eager gives them
        short = (batch.own_length <= att.chunk).view(-1, 1, 1, 1)
        dense = F.pad(dense, (0, 0, 0, padded - att.chunk))
        x1 = x1 + block.output(merge_heads(torch.where(short, dense, chunked)))
        # one feed-forward pass over the whole length: eager's length-dependent chunking is a Python branch
        x2 = x2 + layer.feed_forward._forward_chunk(x1, None)
    h = prepared.restore(lm.final_layer_norm(torch.cat([x1, x2], dim=-1)))  # (B, L, 2*hidden)
    return lm.lm_head(h), h
