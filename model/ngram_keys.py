"""N-gram keys for LSH layers (an experiment, not part of any shipped config): a short causal depthwise
convolution on an LSH layer's input before its shared query/key projection, so a key is a function of the
last few positions' states (an n-gram) rather than of one. Initialised to the identity (only the current
position's tap is 1), so a converted model starts as the model it was.

Why: a successor-value head copies by matching the current position's key against earlier ones; after one
wrong byte in a greedy copy the match is lost. Keys built from short n-grams may re-find the place.

Built by LSHSelfAttention when `ReformerConfig.lsh_key_conv_width` is above 0 (`reformer train --key-conv`).
Only the PyTorch forward and training compute it: cached decoding, the C kernels and ONNX export read
`query_key`'s weight directly, so they, and artifacts, refuse such a model (`ReformerConfig.refuse_key_conv`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class CausalDepthwiseConv(nn.Module):
    """y[t] = sum_k w[:, k] * x[t - (width - 1) + k] per channel (zeros before the first position)."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        if width < 1:
            raise ValueError(f"the convolution's width must be >= 1, got {width}")
        self.width = width
        weight = torch.zeros(channels, 1, width)
        weight[:, 0, -1] = 1.0  # identity: the current position only
        self.weight = nn.Parameter(weight)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        y = F.pad(x.transpose(1, 2), (self.width - 1, 0))  # (B, C, width - 1 + T): causal left padding
        return F.conv1d(y, self.weight, groups=c).transpose(1, 2)  # (B, T, C)
