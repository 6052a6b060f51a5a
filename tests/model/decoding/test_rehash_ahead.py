"""Hashing ahead for an automatic bucket count's change (model/decoding/rehash_ahead.py): the crossing step hashes only
what was written since the last slice, and decoding gives what the one-step rebuild gives."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import model.decoding.index_upkeep as decode
from model import ReformerLM
from model.decoding import DecodeCache, Decoder, prefill, rehash_ahead

from ..helpers import tiny_config


def _decode(lm: ReformerLM, prompt_len: int, steps: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Greedy logits of every step, and every LSH layer's index after each step."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, lm.config.vocab_size, (prompt_len,), generator=g)
    cache = DecodeCache.for_tokens(lm, prompt_len + steps + 1)
    decoder = Decoder(lm, cache)
    logits, states = prefill(lm, cache, [prompt], [prompt_len + steps + 1])
    out, orders = [logits[0]], []
    with torch.no_grad():
        for _ in range(steps):
            logits = decoder.step(logits.argmax(-1), states)
            out.append(logits[0])
            rows = cache.rows(torch.tensor([states[0].slot]), torch.arange(states[0].length).view(1, -1)).view(-1)
            state = states[0]
            # each LSH index's main order (its first index_len sorted items), recent order and bucket counts
            orders.append([t.clone() for li, ix in enumerate(cache.indexes) if ix is not None
                           for t in (ix.order[rows[: state.index_len[li]]], ix.recent[state.slot],
                                     ix.main_counts[state.slot], ix.recent_counts[state.slot])])
    # dropped once the count it was for is reached
    assert cache.hashed_ahead.get(states[0].slot) is None or states[0].length < 128
    return out, orders


def _model() -> ReformerLM:
    torch.manual_seed(0)
    return ReformerLM(tiny_config(attn_layers=["local", "lsh", "lsh"], num_buckets=None, vocab_size=258,
                                  initializer_range=0.3)).eval()


def test_decoding_with_keys_hashed_ahead_equals_the_one_step_rebuild(monkeypatch: pytest.MonkeyPatch) -> None:
    lm = _model()
    # chunk 8: the count changes at padded lengths 32 and 64, both crossed
    monkeypatch.setattr(rehash_ahead, "lead", lambda layers, length: 0)  # never ahead: the one-step rebuild
    plain_logits, plain_orders = _decode(lm, 20, 60)
    monkeypatch.undo()
    monkeypatch.setattr(rehash_ahead, "SLICE", 8)
    monkeypatch.setattr(rehash_ahead, "MARGIN", 40)
    ahead_logits, ahead_orders = _decode(lm, 20, 60)
    for a, b in zip(plain_logits, ahead_logits, strict=True):
        assert (a - b).abs().max().item() <= 1e-5
    for a, b in zip(plain_orders, ahead_orders, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_the_crossing_step_hashes_only_the_keys_written_since_the_last_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    lm = _model()
    monkeypatch.setattr(rehash_ahead, "SLICE", 8)
    monkeypatch.setattr(rehash_ahead, "MARGIN", 40)
    hashed: list[tuple[int, int]] = []  # (layer, keys) per hash of cached keys
    real = rehash_ahead._hash_positions

    def spy(cache: DecodeCache, layer: int, att: Any, rows: torch.Tensor, nb: Any) -> torch.Tensor:
        hashed.append((layer, int(rows.shape[0])))
        return real(cache, layer, att, rows, nb)

    monkeypatch.setattr(rehash_ahead, "_hash_positions", spy)
    whole: list[tuple[int, int]] = []  # (layer, length) of every rebuild that hashed all keys at once
    real_build = decode.build_index

    def build(*args: Any) -> None:
        if args[4] is not None:  # given the keys, not buckets hashed ahead
            whole.append((args[1], args[3].length))
        real_build(*args)

    monkeypatch.setattr(decode, "build_index", build)
    g = torch.Generator().manual_seed(3)
    cache = DecodeCache.for_tokens(lm, 90)
    decoder = Decoder(lm, cache)
    logits, (state,) = prefill(lm, cache, [torch.randint(3, 258, (12,), generator=g)], [90])
    steps = []  # (length before the step, whether it changed the index's count, the hashes it ran)
    with torch.no_grad():
        for _ in range(50):
            hashed.clear()
            before, count = state.length, list(state.num_buckets)
            logits = decoder.step(logits.argmax(-1), [state])
            steps.append((before, state.num_buckets != count, list(hashed)))
    assert not whole  # every rebuild came from keys hashed ahead
    # padded lengths 32 and 64 (chunks of 8): the steps that write positions 24 and 56
    assert [n for n, changed, _ in steps if changed] == [24, 56]
    for _, changed, h in steps:
        if changed:  # the tail of each LSH layer (at most SLICE and what was written since), not all n keys
            assert all(keys <= rehash_ahead.SLICE + 1 for _, keys in h)
        else:  # one slice at most
            assert len(h) <= 1 and all(keys == rehash_ahead.SLICE for _, keys in h)
    assert sum(len(h) for _, changed, h in steps if not changed) >= 2 * (48 // 8)  # most keys were hashed ahead


def test_a_prefill_close_to_a_change_hashes_ahead_before_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    lm = _model()
    monkeypatch.setattr(rehash_ahead, "SLICE", 8)
    g = torch.Generator().manual_seed(3)
    for prompt, reserve, ahead in ((20, 40, True), (20, 22, False)):  # the change is at 24: reached or not
        cache = DecodeCache.for_tokens(lm, 48)
        _, (state,) = prefill(lm, cache, [torch.randint(3, 258, (prompt,), generator=g)], [reserve])
        if not ahead:
            assert state.slot not in cache.hashed_ahead
            continue
        plan = cache.hashed_ahead.get(state.slot)
        assert plan is not None and str(plan.num_buckets) == "8"
        assert all(prompt - plan.hashed(li) < rehash_ahead.SLICE for li in (1, 2))
