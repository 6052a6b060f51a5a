"""A prompt scored by its prefill: the same log-probabilities as the model's own forward over the prompt, the
next-token logits unchanged, unscored rows of the batch untouched."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch

from model import ReformerLM
from model.decoding import DecodeCache, prefill
from model.decoding.prefill import prefill_scored_steps
from model.decoding.prefill import scores as scores_module

from ..helpers import tiny_config


def _drain(gen: Generator[None, None, Any]) -> Any:
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value


def _model() -> ReformerLM:
    torch.manual_seed(0)
    return ReformerLM(tiny_config(vocab_size=258, initializer_range=0.3)).eval()


def test_prefill_scores_match_the_forward_and_keep_the_next_token_logits(monkeypatch: Any) -> None:
    monkeypatch.setattr(scores_module, "SCORE_ROWS", 16)  # several blocks per prompt
    lm = _model()
    torch.manual_seed(1)
    prompts = [torch.randint(3, 258, (70,)), torch.randint(3, 258, (41,)), torch.randint(3, 258, (1,))]
    cache = DecodeCache.for_tokens(lm, 128, slots=6)
    plain, plain_states = prefill(lm, cache, prompts, [80] * 3)
    logits, states, scores = _drain(prefill_scored_steps(lm, cache, prompts, [80] * 3, score=[3, None, 0]))
    torch.testing.assert_close(logits, plain, rtol=1e-4, atol=1e-4)
    assert scores[1] is None and len(states) == 3
    with torch.no_grad():
        full = torch.log_softmax(lm(prompts[0].unsqueeze(0)).logits[0].float(), dim=-1)  # (70, vocab)
    expected = full[:-1].gather(-1, prompts[0][1:].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(scores[0].logprobs, expected, rtol=1e-4, atol=1e-4)
    values, ids = torch.topk(full[:-1], 3, dim=-1)
    assert torch.equal(scores[0].top_ids, ids)
    torch.testing.assert_close(scores[0].top_logprobs, values, rtol=1e-4, atol=1e-4)
    assert scores[2].logprobs.shape == (0,) and scores[2].top_ids.shape == (0, 0)  # one token: nothing to score
    for state in [*plain_states, *states]:
        cache.free(state)
