"""Invariant 5: cached incremental decoding equals recomputing the full forward (last-token logits within
1e-5 at every step) for models whose lower layers cannot depend on later tokens."""

from __future__ import annotations

import pytest
import torch

from model import ReformerLM

from .helpers import tiny_config


def _max_step_difference(lm: ReformerLM, prompt_len: int, steps: int) -> float:
    g = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(3, lm.config.vocab_size, (prompt_len,), generator=g)
    logits, state = lm.prefill(prompt)
    seq = prompt.tolist()
    worst = 0.0
    with torch.no_grad():
        for step in range(steps + 1):
            full = lm(torch.tensor([seq])).logits[0, -1]
            worst = max(worst, (full - logits).abs().max().item())
            if step == steps:
                break
            token = int(full.argmax())
            seq.append(token)
            logits = lm.decode_step(torch.tensor([token]), [state])[0]
    assert state.length == len(seq)
    return worst


CASES = [
    # (layers, hashes, prompt length): chunk 8, so lengths cross chunk multiples and non-multiples
    (["local", "local"], 1, 5),
    (["local", "local", "local"], 1, 29),
    (["lsh"], 1, 3),
    (["lsh"], 2, 16),
    (["local", "lsh"], 4, 45),
    (["local", "local", "lsh"], 8, 61),
]


@pytest.mark.parametrize("layers,hashes,prompt_len", CASES, ids=[f"{'-'.join(c[0])}-h{c[1]}-L{c[2]}" for c in CASES])
def test_cached_decoding_equals_full_recompute(layers: list[str], hashes: int, prompt_len: int) -> None:
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(attn_layers=layers, num_hashes=hashes, vocab_size=258,
                                initializer_range=0.3)).eval()
    assert _max_step_difference(lm, prompt_len, steps=20) <= 1e-5


def test_automatic_bucket_count_is_rehashed_as_the_length_grows() -> None:
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(attn_layers=["local", "lsh"], num_buckets=None, vocab_size=258,
                                initializer_range=0.3)).eval()
    assert _max_step_difference(lm, 14, steps=40) <= 1e-5  # 2*L/chunk doubles on the way


def test_batched_decode_steps_equal_single_ones() -> None:
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(vocab_size=258, initializer_range=0.3)).eval()
    prompts = [torch.randint(3, 258, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 33, 64)]
    singles, batch_states = [], []
    for p in prompts:
        _, s = lm.prefill(p)
        singles.append(s)
        batch_states.append(lm.prefill(p)[1])
    for step in range(5):
        tokens = torch.tensor([10 + step, 20 + step, 30 + step])
        together = lm.decode_step(tokens, batch_states)
        for i, s in enumerate(singles):
            alone = lm.decode_step(tokens[i : i + 1], [s])[0]
            assert torch.equal(together[i], alone)


def test_cache_memory_grows_with_the_sequence() -> None:
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(vocab_size=258)).eval()
    _, state = lm.prefill(torch.randint(3, 258, (40,)))
    before = state.nbytes()
    lm.decode_step(torch.tensor([5]), [state])
    assert state.nbytes() > before > 0 and state.length == 41
