"""model/lsh/masks.py: the additive bias of chunk windows."""

from __future__ import annotations

import torch

from model.lsh.masks import attention_bias, mask_value, self_mask_value


def test_attention_bias_rules() -> None:
    pos = torch.arange(4)
    valid = torch.tensor([True, True, False, True])
    neg, own = mask_value(torch.float32), self_mask_value(torch.float32)
    causal = attention_bias(pos, pos, valid, True, True, torch.float32)  # (Q, K)
    assert causal[2].tolist() == [0.0, 0.0, neg, neg]  # a padding key is masked, own position or not
    assert causal[1].tolist() == [0.0, own, neg, neg]
    strict = attention_bias(pos, pos, valid, True, False, torch.float32, strict=True)
    assert strict[1].tolist() == [0.0, neg, neg, neg]  # successor heads: earlier keys only
    assert strict[0].tolist() == [neg] * 4
    both_ways = attention_bias(pos, pos, None, False, True, torch.float32)
    assert both_ways[1].tolist() == [0.0, own, 0.0, 0.0]
    assert mask_value(torch.float16) == -1e4 and self_mask_value(torch.float16) == -1e3
