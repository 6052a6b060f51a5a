"""A prompt scored by its own prefill: every position's next-token log-probabilities, from the hidden states the
prefill's forward computes anyway, in blocks of positions (a 64K-token prompt never holds 64K x vocab floats),
keeping only what is asked: the next prompt token's log-probability and the k most likely tokens.
`score_logits` and `join_scores` do the same for logits computed elsewhere (the causal prefill's extend,
service/engine/runner.py `extend_slices`), with the same arithmetic and conventions."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ...reformer import ReformerLM

# Positions whose logits exist at once while scoring: with a 258-token vocabulary ~1 MB of float32, with a
# 50K one ~200 MB.
SCORE_ROWS = 1024


@dataclass(frozen=True)
class PromptScores:
    """Row t is position t's prediction of prompt token t+1 (L-1 rows for an L-token prompt), float32 on the
    host: `logprobs` (L-1,), that token's log-probability; `top_ids` and `top_logprobs` (L-1, k), the k most
    likely tokens there, most likely first (k = 0: no columns)."""

    logprobs: Tensor
    top_ids: Tensor
    top_logprobs: Tensor


def score_logits(logits: Tensor, targets: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of next-token logits (n, vocab) and the token each row predicts (n,) int64: that token's
    log-probability (n,) float32, and the k most likely tokens' ids (n, k) int64 and log-probabilities (n, k)
    float32, most likely first, all on the host."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (n, vocab)
    chosen = logprobs.gather(-1, targets.to(logprobs.device).view(-1, 1)).squeeze(-1).cpu()
    values, top = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)  # (n, k)
    return chosen, top.cpu(), values.cpu()


def join_scores(parts: Sequence[tuple[Tensor, Tensor, Tensor]], k: int) -> PromptScores:
    """One prompt's `score_logits` blocks, in order, as its PromptScores (none: a one-token prompt)."""
    if not parts:
        return PromptScores(torch.zeros(0), torch.zeros(0, k, dtype=torch.long), torch.zeros(0, k))
    return PromptScores(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                        torch.cat([p[2] for p in parts]))


def score_prompts(lm: ReformerLM, x1: Tensor, x2: Tensor, ids: Tensor, lengths: Sequence[int],
                  asked: Sequence[int | None]) -> Generator[None, None, list[PromptScores | None]]:
    """x1, x2 (N, L, hidden): the last layer's two streams at every position; ids (N, L) the prompts; asked[i]:
    None (row i is not scored) or its k. Yields after each block of positions."""
    out: list[PromptScores | None] = []
    for i, k in enumerate(asked):
        if k is None:
            out.append(None)
            continue
        count = lengths[i] - 1
        parts = []
        for a in range(0, count, SCORE_ROWS):
            z = min(a + SCORE_ROWS, count)
            hidden = torch.cat([x1[i, a:z], x2[i, a:z]], dim=-1)  # (z-a, 2*hidden)
            # the token each position predicts
            parts.append(score_logits(lm.lm_head(lm.final_layer_norm(hidden)), ids[i, a + 1 : z + 1], k))
            yield
        out.append(join_scores(parts, k))
    return out
