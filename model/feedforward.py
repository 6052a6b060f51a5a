"""The position-wise feed-forward block, run over chunks of the sequence so its peak memory is bounded
by the chunk, not the sequence length."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .chunking import seeded_dropout
from .config import ReformerConfig


def activation(name: str) -> nn.Module:
    return {
        "relu": nn.ReLU(),
        "gelu": nn.GELU(),
        "gelu_new": nn.GELU(approximate="tanh"),
        "gelu_fast": nn.GELU(approximate="tanh"),
        "silu": nn.SiLU(),
        "swish": nn.SiLU(),
        "tanh": nn.Tanh(),
    }[name]


# eval forwards chunk the feed-forward even when the config does not, to bound memory at long lengths
EVAL_CHUNK = 4096


class ChunkedFeedForward(nn.Module):
    def __init__(self, config: ReformerConfig) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dense = nn.Linear(config.hidden_size, config.feed_forward_size)
        self.act = activation(config.hidden_act)
        self.output = nn.Linear(config.feed_forward_size, config.hidden_size)
        self.dropout = config.hidden_dropout_prob
        self.chunk = config.chunk_size_feed_forward

    def _forward_chunk(self, x: Tensor, generator: torch.Generator | None) -> Tensor:
        h = self.dense(self.layer_norm(x))
        # dropout before the activation, as in the reference
        h = seeded_dropout(h, self.dropout, generator) if self.training else h
        h = self.output(self.act(h))
        return seeded_dropout(h, self.dropout, generator) if self.training else h

    def forward(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        chunk = self.chunk or (0 if self.training else EVAL_CHUNK)
        t = x.shape[1]
        if chunk <= 0 or t <= chunk:
            return self._forward_chunk(x, generator)
        return torch.cat([self._forward_chunk(part, generator) for part in x.split(chunk, dim=1)], dim=1)


