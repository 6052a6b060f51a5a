"""What is done to one row of next-token logits before a token is chosen: a logit bias, the repetition,
frequency and presence penalties, and the sampling filters (top-k, top-p, typical-p). Each takes a (vocab,)
row and returns a new one; a filtered-out token's logit is -inf."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def apply_logit_bias(logits: Tensor, bias: Sequence[tuple[int, float]]) -> Tensor:
    """OpenAI's logit_bias: each (token id, value) added to that token's logit (ids past the vocabulary are
    refused before they get here)."""
    if not bias:
        return logits
    idx = torch.tensor([i for i, _ in bias], dtype=torch.long, device=logits.device)
    add = torch.tensor([v for _, v in bias], dtype=logits.dtype, device=logits.device)
    return logits.index_add(0, idx, add)


def apply_repetition_penalty(logits: Tensor, previous: Sequence[int], penalty: float) -> Tensor:
    """CTRL-style penalty as in transformers: positive logits divided, negative multiplied."""
    if penalty == 1.0 or not previous:
        return logits
    idx = torch.tensor(sorted(set(previous)), dtype=torch.long, device=logits.device)
    idx = idx[idx < logits.shape[-1]]
    picked = logits[idx]
    logits = logits.clone()
    logits[idx] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def apply_frequency_presence(logits: Tensor, generated: Sequence[int], frequency: float, presence: float) -> Tensor:
    """OpenAI's penalties over the tokens generated so far (not the prompt): each token's logit loses
    `frequency` times its count plus `presence` once it has appeared."""
    if (frequency == 0.0 and presence == 0.0) or not generated:
        return logits
    ids = torch.tensor(list(generated), dtype=torch.long, device=logits.device)
    counts = torch.bincount(ids[ids < logits.shape[-1]], minlength=logits.shape[-1]).to(logits.dtype)  # (vocab,)
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def filter_top_k_top_p(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop_sorted[0] = False  # even a top_p that rounds to 0 keeps the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def filter_typical_p(logits: Tensor, typical_p: float) -> Tensor:
    """Locally typical sampling (Meister et al.), as transformers' TypicalLogitsWarper: keep the tokens whose
    surprisal is closest to the distribution's entropy, the fewest whose mass reaches `typical_p` (at least
    one)."""
    if typical_p >= 1.0:
        return logits
    logprobs = torch.log_softmax(logits, dim=-1)
    entropy = -(logprobs * logprobs.exp()).nansum()  # -inf * 0 of filtered tokens is NaN: not counted
    distance = (-logprobs - entropy).abs()
    sorted_distance, order = torch.sort(distance)
    cum = torch.softmax(logits[order], dim=-1).cumsum(-1)
    last = int((cum < typical_p).sum().clamp(max=logits.shape[-1] - 1))
    drop_sorted = sorted_distance > sorted_distance[last]
    drop_sorted[0] = False
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
