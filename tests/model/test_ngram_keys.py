"""model/ngram_keys.py: the causal depthwise convolution before an LSH layer's query/key projection starts as
the identity (the model is unchanged) and never reads a later position."""

from __future__ import annotations

import torch

from model.ngram_keys import CausalDepthwiseConv, add_ngram_keys
from tests.conftest import tiny_model


def test_identity_at_start_leaves_the_model_unchanged() -> None:
    lm = tiny_model(seed=1).eval()
    x = torch.randint(2, 258, (2, 80))
    with torch.no_grad():
        before = lm(x).logits
        assert add_ngram_keys(lm, 3) == lm.config.attn_layers.count("lsh")
        assert torch.equal(lm(x).logits, before)


def test_convolution_is_causal_and_mixes_the_last_width_positions() -> None:
    conv = CausalDepthwiseConv(4, 3)
    with torch.no_grad():
        conv.weight.copy_(torch.arange(12.0).view(4, 1, 3))
    x = torch.randn(1, 10, 4)
    y = conv(x)
    later = x.clone()
    later[0, 6:] += 1.0
    assert torch.equal(conv(later)[0, :6], y[0, :6])  # positions before 6 never see 6 or later
    t, c = 5, 2  # y[t] = w0 x[t-2] + w1 x[t-1] + w2 x[t]
    want = 6.0 * x[0, t - 2, c] + 7.0 * x[0, t - 1, c] + 8.0 * x[0, t, c]
    assert torch.allclose(y[0, t, c], want)
    assert torch.allclose(y[0, 0, c], 8.0 * x[0, 0, c])  # zeros before the first position
