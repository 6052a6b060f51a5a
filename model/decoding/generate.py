"""Generation for tools and tests: prefill once, then one cached decode step per new token."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..reformer import ReformerLM
from ..sampling import Sampler, SamplingParams
from .cache import DecodeCache
from .prefill import prefill
from .step import Decoder


@torch.no_grad()
def generate(lm: ReformerLM, prompt: Sequence[int], max_new_tokens: int, params: SamplingParams | None = None,
             stop_ids: Sequence[int] = (), use_cache: bool = True) -> list[int]:
    """New token ids after `prompt` (stops after a stop id, which is included)."""
    if not prompt:
        raise ValueError("generation needs a non-empty prompt")
    sampler = Sampler(params or SamplingParams())
    ids = list(prompt)
    out: list[int] = []
    device = next(lm.parameters()).device
    if use_cache:
        cache = DecodeCache.for_tokens(lm, len(ids) + max_new_tokens)
        decoder = Decoder(lm, cache)
        first, states = prefill(lm, cache, [torch.tensor(ids, device=device)], [len(ids) + max_new_tokens])
        logits = first[0]
    else:
        logits = lm(torch.tensor([ids], device=device)).logits[0, -1]
    for step in range(max_new_tokens):
        token, _ = sampler.next_token(logits, ids)
        ids.append(token)
        out.append(token)
        if token in stop_ids or step == max_new_tokens - 1:
            break
        if use_cache:
            logits = decoder.step(torch.tensor([token], device=device), states)[0]
        else:
            logits = lm(torch.tensor([ids], device=device)).logits[0, -1]
    return out
