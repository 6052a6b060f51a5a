"""Reversible residual layers (Y1 = X1 + Attn(X2), Y2 = X2 + FF(Y1)) and a backward pass that rebuilds
each layer's inputs from its outputs, so training memory does not grow with depth.

Unlike the reference, dropout draws from a per-layer generator seeded in the forward, so the backward's
recomputation sees exactly the forward's dropout masks, and LSH layers reuse the forward's buckets."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from .attention import AttentionContext, make_attention
from .chunking import seeded_dropout
from .config import ReformerConfig
from .feedforward import ChunkedFeedForward


def _generator(seed: int | None, like: Tensor) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator(device=like.device).manual_seed(seed)


class AttentionBlock(nn.Module):
    """f(X2) = Dropout(Linear(SelfAttention(LayerNorm(X2))))."""

    def __init__(self, kind: str, config: ReformerConfig, layer_index: int) -> None:
        super().__init__()
        self.kind = kind
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attention = make_attention(kind, config, layer_index=layer_index)
        self.output = nn.Linear(config.all_head_size, config.hidden_size, bias=False)
        self.dropout = config.hidden_dropout_prob

    def forward(
        self, x: Tensor, ctx: AttentionContext, buckets: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        h, buckets = self.self_attention(self.layer_norm(x), ctx, buckets)
        h = self.output(h)
        if self.training:
            h = seeded_dropout(h, self.dropout, ctx.generator)
        return h, buckets


class ReformerLayer(nn.Module):
    def __init__(self, kind: str, config: ReformerConfig, layer_index: int) -> None:
        """`layer_index`: the layer's index among all attention layers (`config.attn_layers`)."""
        super().__init__()
        self.attention = AttentionBlock(kind, config, layer_index)
        self.feed_forward = ChunkedFeedForward(config)
        # without dropout no generator is built: nothing would draw from it, and under torch.compile
        # creating one per layer call is a graph break
        self.uses_dropout = max(config.hidden_dropout_prob, config.lsh_attention_probs_dropout_prob,
                                config.local_attention_probs_dropout_prob) > 0.0

    def f(self, x2: Tensor, ctx: AttentionContext, seed: int | None, buckets: Tensor | None = None
          ) -> tuple[Tensor, Tensor | None]:
        if not self.uses_dropout:
            return self.attention(x2, ctx, buckets)
        return self.attention(x2, dataclasses.replace(ctx, generator=_generator(seed, x2)), buckets)

    def g(self, y1: Tensor, seed: int | None) -> Tensor:
        return self.feed_forward(y1, _generator(seed, y1) if self.uses_dropout else None)

    def forward(self, x1: Tensor, x2: Tensor, ctx: AttentionContext,
                seeds: tuple[int, int] | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        f_seed, g_seed = seeds if seeds is not None else (None, None)
        f_out, buckets = self.f(x2, ctx, f_seed)
        y1 = x1 + f_out
        y2 = x2 + self.g(y1, g_seed)
        return y1, y2, buckets


class _ReversibleStack(torch.autograd.Function):
    """Runs every layer without keeping activations; the backward recomputes them layer by layer."""

    @staticmethod
    def forward(ctx, x1: Tensor, x2: Tensor, layers: nn.ModuleList, att: AttentionContext,  # type: ignore[override]
                seeds: list[tuple[int, int]]) -> tuple[Tensor, Tensor]:
        all_buckets: list[Tensor | None] = []
        with torch.no_grad():
            for layer, s in zip(layers, seeds):
                x1, x2, buckets = layer(x1, x2, att, s)
                all_buckets.append(buckets)
        ctx.save_for_backward(x1, x2)
        ctx.layers, ctx.att, ctx.seeds, ctx.all_buckets = layers, att, seeds, all_buckets
        return x1, x2

    @staticmethod
    def backward(ctx, grad_y1: Tensor, grad_y2: Tensor):  # type: ignore[override]
        y1, y2 = ctx.saved_tensors
        for layer, (f_seed, g_seed), buckets in zip(
            reversed(ctx.layers), reversed(ctx.seeds), reversed(ctx.all_buckets)
        ):
            with torch.enable_grad():
                y1 = y1.detach().requires_grad_(True)
                g_out = layer.g(y1, g_seed)
                torch.autograd.backward(g_out, grad_y2)
            with torch.no_grad():
                x2 = y2 - g_out
                grad_y1 = grad_y1 + y1.grad
            del g_out
            with torch.enable_grad():
                x2 = x2.detach().requires_grad_(True)
                f_out, _ = layer.f(x2, ctx.att, f_seed, buckets)
                torch.autograd.backward(f_out, grad_y1)
            with torch.no_grad():
                x1 = y1 - f_out
                grad_y2 = grad_y2 + x2.grad
            del f_out
            y1, y2 = x1.detach(), x2.detach()
        return grad_y1, grad_y2, None, None, None


def run_layers(layers: nn.ModuleList, x1: Tensor, x2: Tensor, att: AttentionContext,
               seeds: list[tuple[int, int]] | None, reversible: bool) -> tuple[Tensor, Tensor]:
    """Reversible backward when training (seeds given) with gradients; plain autograd otherwise."""
    if reversible and seeds is not None and torch.is_grad_enabled() and (x1.requires_grad or x2.requires_grad):
        out: tuple[Tensor, Tensor] = _ReversibleStack.apply(x1, x2, layers, att, seeds)
        return out
    for i, layer in enumerate(layers):
        x1, x2, _ = layer(x1, x2, att, None if seeds is None else seeds[i])
    return x1, x2
