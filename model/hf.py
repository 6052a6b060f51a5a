"""Weight-name mapping from `transformers`' ReformerModelWithLMHead to this package's modules."""

from __future__ import annotations

import re

from torch import Tensor

_RULES: list[tuple[str, str]] = [
    (r"^reformer\.embeddings\.", "embeddings."),
    (r"^reformer\.encoder\.layer_norm\.", "final_layer_norm."),
    (r"^reformer\.encoder\.layers\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attention.output."),
    (r"^reformer\.encoder\.layers\.(\d+)\.feed_forward\.dense\.dense\.", r"layers.\1.feed_forward.dense."),
    (r"^reformer\.encoder\.layers\.(\d+)\.feed_forward\.output\.dense\.", r"layers.\1.feed_forward.output."),
    (r"^reformer\.encoder\.layers\.", "layers."),
    (r"^lm_head\.decoder\.", "lm_head."),
]

# `lm_head.bias` is a separate, unused parameter in transformers 5 (in 4.x it aliases decoder.bias)
_IGNORED = {"lm_head.bias"}


def hf_state_dict_to_ours(state: dict[str, Tensor]) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for name, value in state.items():
        if name in _IGNORED:
            continue
        new = name
        for pattern, repl in _RULES:
            new, hits = re.subn(pattern, repl, new)
            if hits:
                break
        out[new] = value
    return out
