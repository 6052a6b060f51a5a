"""Self-attention layers: LSH attention (shared query/key, hashed, sorted, chunked) and local
(chunked) attention, with the reference's semantics."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .chunking import attend, fusable, round_weights
from .config import ReformerConfig
from .fused_attention import fused_lsh_attend, local_window_attend, native_kernels, window_kernel_for
from .lsh.hashing import auto_num_buckets, hash_buckets, hash_rotations, rotation_size
from .lsh.masks import attention_bias
from .lsh.order import bucket_order
from .lsh.successor import successor_values, zero_rows_without_keys
from .lsh.windows import gather_chunks, look_adjacent, strided_windows, window_chunk_index
from .ngram_keys import CausalDepthwiseConv

__all__ = ["KEY_NORM_EPS", "AttentionContext", "LSHSelfAttention", "LocalSelfAttention", "auto_num_buckets",
           "hash_rotations", "length_normalize", "make_attention", "merge_heads", "split_heads"]


@dataclass
class AttentionContext:
    """What every attention layer needs to know about the batch besides the hidden states."""

    valid: Tensor | None  # (B, L) bool, False at padding (None: no padding anywhere)
    own_length: Tensor  # (B,) each row's own padded length, as the reference would pad it alone
    generator: torch.Generator | None = None  # dropout randomness of the current layer (training only)


# the epsilon of a key's length normalisation (the reference's); the C kernels' KEY_NORM_EPS is the same
# (tests/model/kernels/test_abi.py)
KEY_NORM_EPS = 1e-6


def length_normalize(x: Tensor, eps: float = KEY_NORM_EPS) -> Tensor:
    """x scaled to unit root mean square over the last axis. In half precision the mean square is taken in
    fp32: x*x overflows fp16 from |x| = 256 on."""
    if x.dtype in (torch.float16, torch.bfloat16):
        x32 = x.float()
        return (x32 * torch.rsqrt(torch.mean(x32 * x32, dim=-1, keepdim=True) + eps)).to(x.dtype)
    return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps)


def split_heads(x: Tensor, heads: int, head_size: int) -> Tensor:
    b, t, _ = x.shape
    return x.view(b, t, heads, head_size).transpose(1, 2)  # (B, H, L, D)


def merge_heads(x: Tensor) -> Tensor:
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)  # (B, L, H*D)


class LSHSelfAttention(nn.Module):
    def __init__(self, config: ReformerConfig, *, layer_index: int, fused: bool = True) -> None:
        """`layer_index`: this layer's index among all attention layers (its successor-value head count,
        `ReformerConfig.successor_heads`)."""
        super().__init__()
        self.config = config
        # heads 0..successor_heads-1 read the next position's value (model/lsh/successor.py)
        self.successor_heads = config.successor_heads(layer_index)
        # eval forwards on CPU may use PyTorch's fused attention kernel (chunking.can_fuse)
        self.fused = fused
        # a float32 eval forward on CPU attends its chunk windows through the C kernel where it builds
        # (model/fused_attention.py; `use_c_kernels` turns it off for a model)
        self.c_kernel = True
        self.heads = config.num_attention_heads
        self.head_size = config.attention_head_size
        self.chunk = config.lsh_attn_chunk_length
        self.rounds = config.num_hashes
        self.before = config.lsh_num_chunks_before
        self.after = config.lsh_num_chunks_after
        self.dropout = config.lsh_attention_probs_dropout_prob
        self.causal = config.is_decoder
        # n-gram keys (an experiment, model/ngram_keys.py): query/key read a causal mix of the last few inputs
        width = config.lsh_key_conv_width
        self.key_conv = CausalDepthwiseConv(config.hidden_size, width) if width else None
        self.query_key = nn.Linear(config.hidden_size, config.all_head_size, bias=False)
        self.value = nn.Linear(config.hidden_size, config.all_head_size, bias=False)
        self._rotation_cache: dict[tuple[int, str], Tensor] = {}  # (rotation size, device) -> fp32 rotations
        if config.num_buckets is not None:
            # a fixed bucket count makes the rotations a constant of the model (and of its ONNX graph)
            size = rotation_size(config.num_buckets)
            rot = hash_rotations(config.hash_seed, self.heads, self.head_size, self.rounds, size)
            self.register_buffer("rotations", rot, persistent=False)
        else:
            self.rotations = None

    def num_buckets_for(self, own_length: int) -> int | list[int]:
        nb = self.config.num_buckets
        if nb is None:
            return auto_num_buckets(own_length, self.chunk, self.config.max_position_embeddings)
        return nb

    # ----------------------------------------------------------------------------------------------
    def hash(self, qk: Tensor, num_buckets: int | list[int], valid: Tensor | None) -> Tensor:
        """qk (B, H, L, D) -> buckets (B, H, R, L); padding gets the extra bucket `num_buckets`
        (model/lsh/hashing.py). Hashing runs in fp32 whatever the model's dtype (an fp32 copy of qk, the
        rotations as drawn), so a half-precision model buckets its projections as the fp32 model buckets the
        same values."""
        x = qk.detach() if qk.dtype == torch.float32 else qk.detach().float()  # (B, H, L, D)
        if self.rotations is not None and (torch.jit.is_tracing() or torch.compiler.is_compiling()):
            rot = self.rotations.float()  # the exported graph's constant
        else:
            # the rotations as drawn, not the buffer: casting the model (lm.to(torch.bfloat16), and back)
            # rounds buffers
            size = rotation_size(num_buckets)
            key = (size, str(x.device))
            if key not in self._rotation_cache:
                self._rotation_cache[key] = hash_rotations(self.config.hash_seed, self.heads, self.head_size,
                                                           self.rounds, size).to(x.device)
            rot = self._rotation_cache[key]  # (H, D, R, rot/2)
        # the C kernel makes the same bucket choice in one pass over the rows (model/kernels/bindings.py)
        native = native_kernels(x) if self.c_kernel else None
        return hash_buckets(x, rot, num_buckets, valid, native)

    def forward(
        self, x: Tensor, ctx: AttentionContext, buckets: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, L, hidden) -> (B, L, H*D), and the buckets used (for the reversible backward)."""
        b, t, _ = x.shape
        qk_in = x if self.key_conv is None else self.key_conv(x)
        qk = split_heads(self.query_key(qk_in), self.heads, self.head_size)  # (B, H, L, D)
        v = successor_values(split_heads(self.value(x), self.heads, self.head_size), self.successor_heads,
                             ctx.valid)  # (B, H, L, D)
        if t <= self.chunk:
            return merge_heads(self._dense(qk, v, ctx)), None
        if buckets is None:
            buckets = self._hash_rows(qk, ctx)

        def dense(rows: Tensor, sub: AttentionContext) -> Tensor:
            return self._dense(qk[rows, :, : self.chunk], v[rows, :, : self.chunk], sub)

        def chunked(rows: Tensor | None, sub: AttentionContext) -> Tensor:
            if rows is None:
                return self._chunked(qk, v, buckets, sub)
            return self._chunked(qk[rows], v[rows], buckets[rows], sub)

        return merge_heads(split_short_rows(v, ctx, self.chunk, dense, chunked)), buckets

    def _hash_rows(self, qk: Tensor, ctx: AttentionContext) -> Tensor:
        if self.config.num_buckets is not None:
            return self.hash(qk, self.config.num_buckets, ctx.valid)
        # automatic bucket counts depend on each row's own length; rows sharing a count hash together
        lengths = [int(n) for n in ctx.own_length.tolist()]
        counts = [self.num_buckets_for(n) for n in lengths]
        out = torch.empty(qk.shape[0], self.heads, self.rounds, qk.shape[2], dtype=torch.long, device=qk.device)
        for nb in {str(c): c for c in counts}.values():
            rows = torch.tensor([i for i, c in enumerate(counts) if c == nb], device=qk.device)
            valid = None if ctx.valid is None else ctx.valid[rows]
            out[rows] = self.hash(qk[rows], nb, valid)
        return out

    def _dense(self, qk: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        k = length_normalize(qk) / math.sqrt(self.head_size)
        pos = torch.arange(qk.shape[2], device=qk.device)
        kv = None if ctx.valid is None else ctx.valid[:, None, :]  # (B, 1, L)
        bias = attention_bias(pos, pos, kv, self.causal, True, qk.dtype)  # (B, 1, L, L), or (L, L) if kv is None
        s, h = self.successor_heads, qk.shape[1]
        if s:
            strict = attention_bias(pos, pos, kv, True, False, qk.dtype, strict=True)  # as bias
            lead = kv.shape[0] if kv is not None else 1
            bias = torch.cat([strict.expand(lead, s, *strict.shape[-2:]), bias.expand(lead, h - s, *bias.shape[-2:])],
                             dim=1)  # (B|1, H, L, L)
        out, lse = attend(qk, k, v, bias, self.dropout if self.training else 0.0, ctx.generator, fused=self.fused)
        return zero_rows_without_keys(out, lse, s)

    def _chunked(self, qk: Tensor, v: Tensor, buckets: Tensor, ctx: AttentionContext) -> Tensor:
        b, h, t, d = qk.shape
        r, c = self.rounds, self.chunk
        n = t // c
        device = qk.device
        order = bucket_order(buckets)  # (B, H, R, L): each round sorted by (bucket, position)
        sorted_pos = order.reshape(b, h, r * t)  # (B, H, R*L)
        own_chunks = torch.clamp((ctx.own_length + c - 1) // c, min=1)
        win = window_chunk_index(own_chunks, r, n, self.before, self.after)  # (B, R*N, W)
        # one circular window layout for the whole batch when no row is shorter than the batch
        uniform = not torch.jit.is_tracing() and bool((own_chunks == n).all())
        # the fused kernel for qk's device and dtype (CPU flash, CUDA memory-efficient), or None
        kernel = window_kernel_for(qk, fusable(self.dropout if self.training else 0.0, self.fused))
        fused = kernel is not None
        k = length_normalize(qk) / math.sqrt(self.head_size)  # (B, H, L, D)
        qkv = torch.cat([qk, k, v], dim=-1)  # (B, H, L, 3D): one row gather per head sorts all three
        valid = ctx.valid
        dropout = self.dropout if self.training else 0.0
        out = torch.zeros_like(qk)  # (B, H, L, D)
        rows = torch.arange(b, device=device).view(b, 1, 1) * t
        # heads one at a time outside training: peak memory is one head's score blocks. (Training keeps one
        # layout so the reversible backward's recomputation draws the same dropout masks as the forward.)
        # Successor-value heads (0..s-1) form their own group: they mask differently.
        s = self.successor_heads
        head_groups = [g for g in (slice(0, s), slice(s, h)) if g.stop > g.start] if self.training \
            else [slice(i, i + 1) for i in range(h)]
        for hs in head_groups:
            successor = hs.start < s  # the group is all successor heads or all plain heads
            sp = sorted_pos[:, hs]  # (B, h', R*L)
            hh = sp.shape[1]
            if hh == 1:
                flat = qkv[:, hs].reshape(b * t, 3 * d)  # (B*L, 3D)
                picked = flat.index_select(0, (sp[:, 0] + rows[:, 0]).reshape(-1)).view(b, 1, r * t, 3 * d)
            else:
                picked = torch.gather(qkv[:, hs], 2, sp.unsqueeze(-1).expand(-1, -1, -1, 3 * d))
            q_c, k_c, v_c = (x.reshape(b, hh, r * n, c, d) for x in picked.split(d, dim=-1))  # (B,h',R*N,C,D)
            qp = sp.view(b, hh, r * n, c)  # (B, h', R*N, C)
            if uniform and fused:
                # overlapping views instead of copies: the fused kernel only reads them
                k_w = strided_windows(k_c.reshape(b, hh, r * t, d), c, self.before, self.after)
                v_w = strided_windows(v_c.reshape(b, hh, r * t, d), c, self.before, self.after)
                kp = strided_windows(sp, c, self.before, self.after)  # (B, h', R*N, W*C)
            elif uniform:
                k_w = look_adjacent(k_c, self.before, self.after)  # (B, h', R*N, W*C, D)
                v_w = look_adjacent(v_c, self.before, self.after)
                kp = look_adjacent(qp.unsqueeze(-1), self.before, self.after).squeeze(-1)  # (B, h', R*N, W*C)
            else:
                k_w = gather_chunks(k_c, win)
                v_w = gather_chunks(v_c, win)
                kp = gather_chunks(qp.unsqueeze(-1), win).squeeze(-1)
            kv = None if valid is None else valid[torch.arange(b, device=device).view(b, 1, 1, 1), kp]
            if kernel is not None:
                o, lse = fused_lsh_attend(q_c, k_w, v_w, v_c, qp, kp, kv, self.causal, kernel, self.c_kernel,
                                          successor=successor)
            else:
                bias = attention_bias(qp, kp, kv, self.causal, not successor, qk.dtype,
                                      strict=successor)  # (B, h', R*N, C, W*C)
                o, lse = attend(q_c, k_w, v_w, bias, dropout, ctx.generator)  # (B,h',R*N,C,D), (B,h',R*N,C)
            lse = lse.reshape(b, hh, r, t)  # (B, h', R, L) in sorted order
            combined = self._combine_rounds(o.reshape(b, hh, r, t, d), lse, order[:, hs])  # (B, h', L, D)
            if successor:
                lse_u = torch.empty_like(lse).scatter_(3, order[:, hs], lse)  # (B, h', R, L) in position order
                combined = zero_rows_without_keys(combined, lse_u, hh)
            out[:, hs] = combined
        return out  # (B, H, L, D)

    @staticmethod
    def _combine_rounds(o: Tensor, lse: Tensor, order: Tensor) -> Tensor:
        """o (B, h, R, L, D) and lse (B, h, R, L) in sorted order; order (B, h, R, L) the sorted positions.
        Each round is weighted by its share of the probability mass, computed as the reference does (not as
        a softmax), which rounds differently for rows that see only themselves.
        In fp32 whatever o's dtype: half precision cannot tell -1e5 + log(R) from -1e5, so a row that sees only
        itself in every round would get weight 1 from each."""
        lse32 = lse.float()
        lse_u = torch.empty_like(lse32).scatter_(3, order, lse32)  # back to position order
        weights = round_weights(lse_u, dim=2)  # (B, h, R, L)
        w_sorted = torch.gather(weights, 3, order)  # each sorted slot's weight
        weighted = o.float() * w_sorted.unsqueeze(-1)
        out = torch.zeros(o.shape[0], o.shape[1], o.shape[3], o.shape[4], dtype=torch.float32, device=o.device)
        idx = order.reshape(o.shape[0], o.shape[1], -1, 1).expand(-1, -1, -1, o.shape[4])
        # rounds are summed in order for each position, as the reference's sum over the round axis
        return out.scatter_add_(2, idx, weighted.reshape(o.shape[0], o.shape[1], -1, o.shape[4])).to(o.dtype)


class LocalSelfAttention(nn.Module):
    def __init__(self, config: ReformerConfig, *, fused: bool = True) -> None:
        super().__init__()
        self.fused = fused
        self.c_kernel = True  # as LSHSelfAttention's
        self.heads = config.num_attention_heads
        self.head_size = config.attention_head_size
        self.chunk = config.local_attn_chunk_length
        self.before = config.local_num_chunks_before
        self.after = config.local_num_chunks_after
        self.dropout = config.local_attention_probs_dropout_prob
        self.causal = config.is_decoder
        self.query = nn.Linear(config.hidden_size, config.all_head_size, bias=False)
        self.key = nn.Linear(config.hidden_size, config.all_head_size, bias=False)
        self.value = nn.Linear(config.hidden_size, config.all_head_size, bias=False)

    def forward(
        self, x: Tensor, ctx: AttentionContext, buckets: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        b, t, _ = x.shape
        q = split_heads(self.query(x), self.heads, self.head_size)  # (B, H, L, D)
        k = split_heads(self.key(x), self.heads, self.head_size) / math.sqrt(self.head_size)
        v = split_heads(self.value(x), self.heads, self.head_size)
        if t <= self.chunk:
            return merge_heads(self._dense(q, k, v, ctx)), None
        c = self.chunk

        def dense(rows: Tensor, sub: AttentionContext) -> Tensor:
            return self._dense(q[rows, :, :c], k[rows, :, :c], v[rows, :, :c], sub)

        def chunked(rows: Tensor | None, sub: AttentionContext) -> Tensor:
            if rows is None:
                return self._chunked(q, k, v, sub)
            return self._chunked(q[rows], k[rows], v[rows], sub)

        return merge_heads(split_short_rows(v, ctx, c, dense, chunked)), None

    def _dense(self, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        pos = torch.arange(q.shape[2], device=q.device)
        kv = None if ctx.valid is None else ctx.valid[:, None, :]  # (B, 1, L)
        bias = attention_bias(pos, pos, kv, self.causal, False, q.dtype)
        out, _ = attend(q, k, v, bias, self.dropout if self.training else 0.0, ctx.generator, fused=self.fused)
        return out

    def _chunked(self, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        b, _, t, _ = q.shape
        dropout = self.dropout if self.training else 0.0
        pos = torch.arange(t, device=q.device)
        c, n = self.chunk, t // self.chunk
        own_chunks = torch.clamp((ctx.own_length + c - 1) // c, min=1)
        q_c = q.view(b, self.heads, n, c, self.head_size)  # (B, H, N, C, D)
        if self._sdpa_applies(ctx, dropout, own_chunks, n):
            return self._chunked_sdpa(q_c, k, v).reshape(b, self.heads, t, self.head_size)
        win = window_chunk_index(own_chunks, 1, n, self.before, self.after)  # (B, N, W)
        k_w = gather_chunks(k.view(b, self.heads, n, c, self.head_size), win)  # (B, H, N, W*C, D)
        v_w = gather_chunks(v.view(b, self.heads, n, c, self.head_size), win)
        qp = pos.view(1, 1, n, c).expand(b, 1, n, c)  # (B, 1, N, C)
        kp = gather_chunks(qp.unsqueeze(-1), win).squeeze(-1)  # (B, 1, N, W*C)
        kv = None if ctx.valid is None else torch.gather(ctx.valid[:, None, None, :].expand(b, 1, n, t), 3, kp)
        out = local_window_attend(q_c, k_w, v_w, qp, kp, kv, self.causal, dropout, ctx.generator,
                                  self.fused, self.c_kernel)  # (B, H, N, C, D)
        return out.reshape(b, self.heads, t, self.head_size)  # (B, H, L, D)

    @staticmethod
    def _sdpa_applies(ctx: AttentionContext, dropout: float, own_chunks: Tensor, n: int) -> bool:
        """Training on CPU (autograd on), no padding, every row of the batch's length, no dropout (the fused
        kernel's dropout would not draw from the layer's generator), not traced for export. (CUDA keeps
        the plain formulation: this path is measured and tested on CPU only.)"""
        return (ctx.own_length.device.type == "cpu" and ctx.valid is None and dropout == 0.0
                and torch.is_grad_enabled() and not torch.jit.is_tracing() and bool((own_chunks == n).all()))

    def _chunked_sdpa(self, q_c: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Training's local attention when every row has the batch's length and nothing is padded or
        dropped: PyTorch's fused attention over each chunk's window with a boolean causal mask (-inf where
        `attention_bias` adds -1e9: the same softmax, as every query sees at least itself). Local attention
        needs no log-sum-exp, so the fused kernel's own backward applies.
        q_c (B, H, N, C, D) -> (B, H, N, C, D)."""
        b, h, n, c, d = q_c.shape
        k_w = look_adjacent(k.view(b, h, n, c, d), self.before, self.after)  # (B, H, N, W*C, D)
        v_w = look_adjacent(v.view(b, h, n, c, d), self.before, self.after)
        mask = local_window_mask(n, c, self.before, self.after, self.causal, q_c.device)  # (1, N, C, W*C)
        out = F.scaled_dot_product_attention(q_c.reshape(b * h, n, c, d), k_w.reshape(b * h, n, -1, d),
                                             v_w.reshape(b * h, n, -1, d), attn_mask=mask, scale=1.0)
        return out.view(b, h, n, c, d)


_WINDOW_MASKS: dict[tuple[int, int, int, int, bool, str], Tensor | None] = {}


def local_window_mask(n: int, chunk: int, before: int, after: int, causal: bool, device: torch.device
                      ) -> Tensor | None:
    """The allowed keys of `look_adjacent` windows over n unpadded chunks, True where a query may attend:
    (1, N, C, W*C), cached per shape and device; None when every key is allowed (not causal)."""
    if not causal:
        return None
    key = (n, chunk, before, after, causal, str(device))
    if key not in _WINDOW_MASKS:
        pos = torch.arange(n * chunk, device=device).view(1, 1, n, chunk)  # (1, 1, N, C)
        kp = look_adjacent(pos.unsqueeze(-1), before, after).squeeze(-1)  # (1, 1, N, W*C)
        _WINDOW_MASKS[key] = (kp.unsqueeze(-2) <= pos.unsqueeze(-1)).squeeze(0)  # (1, N, C, W*C)
    return _WINDOW_MASKS[key]


def split_short_rows(
    v: Tensor, ctx: AttentionContext, chunk: int,
    dense: Callable[[Tensor, AttentionContext], Tensor],
    chunked: Callable[[Tensor | None, AttentionContext], Tensor],
) -> Tensor:
    """Rows whose own length fits in one chunk get dense attention over their first `chunk` positions, as
    the reference computes for them alone; the other rows get chunked attention. Returns (B, H, L, D)."""
    short = ctx.own_length <= chunk
    if not bool(short.any()):
        return chunked(None, ctx)
    out = torch.zeros_like(v)
    rows_short = short.nonzero().squeeze(1)
    out[rows_short, :, :chunk] = dense(rows_short, _subset(ctx, rows_short, chunk))
    if not bool(short.all()):
        rows_long = (~short).nonzero().squeeze(1)
        out[rows_long] = chunked(rows_long, _subset(ctx, rows_long, None))
    return out


def _subset(ctx: AttentionContext, rows: Tensor, length: int | None) -> AttentionContext:
    valid = None if ctx.valid is None else ctx.valid[rows][:, :length]
    return AttentionContext(valid=valid, own_length=ctx.own_length[rows], generator=ctx.generator)


def make_attention(kind: str, config: ReformerConfig, *, layer_index: int, fused: bool = True) -> nn.Module:
    """The attention module of layer `layer_index` (its index among all attention layers), of `kind`."""
    if kind == "lsh":
        return LSHSelfAttention(config, layer_index=layer_index, fused=fused)
    return LocalSelfAttention(config, fused=fused)


