"""A snapshot of a request's decode state, restored into another slot or another cache (or copied from one live
state to another), steps exactly as the original would: torch.equal on every step's logits, on every decode
path, across index merges, an automatic bucket count's growth, successor heads and half-precision pools."""

from __future__ import annotations

import pytest
import torch

from model import ReformerLM
from model.decoding import DecodeCache, Decoder, prefill
from model.decoding.snapshot import StateSnapshot, check_fits, restore_snapshot, take_snapshot

from ..helpers import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(layers: list[str], successor: int = 0, num_buckets: int | None = 8, seed: int = 0) -> ReformerLM:
    torch.manual_seed(seed)
    return ReformerLM(tiny_config(attn_layers=layers, vocab_size=258, initializer_range=0.3,
                                  lsh_successor_heads=successor, num_buckets=num_buckets)).eval()


def _steps(decoder: Decoder, state, first: torch.Tensor, steps: int) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """Greedy steps from `first` (the logits after the prompt): every step's logits."""
    out, logits = [], first
    with torch.no_grad():
        for _ in range(steps):
            logits = decoder.step(torch.tensor([int(logits.argmax())]), [state])[0]
            out.append(logits)
    return out


CASES = [
    # layers, successor heads, fixed bucket count (None: automatic, grows as the request does), prompt, steps
    (["local", "lsh", "local", "lsh"], 0, 8, 45, 20),
    (["lsh", "lsh"], 2, 8, 30, 12),
    (["local", "lsh"], 1, None, 61, 80),  # the automatic count changes at 64 positions: hashed ahead
]


@pytest.mark.parametrize("path", ["c", "torch"])
@pytest.mark.parametrize("layers,successor,buckets,prompt_len,steps", CASES,
                         ids=[f"{'-'.join(c[0])}-s{c[1]}-nb{c[2]}" for c in CASES])
def test_a_restored_snapshot_steps_as_the_original(layers: list[str], successor: int, buckets: int | None,
                                                   prompt_len: int, steps: int, path: str) -> None:
    lm = _model(layers, successor, buckets)
    total = prompt_len + steps + 1
    # recent 3: the index merges every 3 steps after the restore too
    cache = DecodeCache.for_tokens(lm, total, slots=3, recent=3, cpu_kernel=path == "c")
    decoder = Decoder(lm, cache)
    prompt = torch.randint(3, 258, (prompt_len,), generator=torch.Generator().manual_seed(5))
    first, (state,) = prefill(lm, cache, [prompt], [total])
    snap = take_snapshot(cache, state, first[0])
    # a second request's prefill takes other blocks first, so the restore lands in other rows and slot
    other = torch.randint(3, 258, (prompt_len + 7,), generator=torch.Generator().manual_seed(6))
    prefill(lm, cache, [other], [total])
    original = _steps(decoder, state, first[0], steps)
    restored_state = cache.allocate(total)
    assert restored_state.slot != state.slot
    restore_snapshot(cache, snap, restored_state)
    assert torch.equal(snap.logits, first[0].float())
    restored = _steps(decoder, restored_state, snap.logits, steps)
    for a, b in zip(original, restored, strict=True):
        assert torch.equal(a, b)
    # a fresh cache (another process, after a restart) steps the same too
    fresh = DecodeCache.for_tokens(lm, total, slots=1, recent=3, cpu_kernel=path == "c")
    again = fresh.allocate(total)
    restore_snapshot(fresh, snap, again)
    for a, b in zip(original, _steps(Decoder(lm, fresh), again, snap.logits, steps), strict=True):
        assert torch.equal(a, b)


def test_a_snapshot_is_not_changed_by_the_steps_after_it() -> None:
    lm = _model(["local", "lsh"], successor=1)
    cache = DecodeCache.for_tokens(lm, 80, slots=2, recent=3)
    prompt = torch.randint(3, 258, (40,), generator=torch.Generator().manual_seed(1))
    first, (state,) = prefill(lm, cache, [prompt], [80])
    snap = take_snapshot(cache, state, first[0])
    kept = {name: t.clone() for name, t in snap.tensors.items()}
    _steps(Decoder(lm, cache), state, first[0], 20)  # merges rewrite the order; the successor slot is written
    assert all(torch.equal(kept[name], t) for name, t in snap.tensors.items())


def test_a_fork_restored_from_a_live_state_then_steps_alone() -> None:
    """n / best_of: one prefill, copied; each copy steps as the original, whatever the others feed."""
    lm = _model(["local", "lsh", "local", "lsh"], successor=1)
    cache = DecodeCache.for_tokens(lm, 70, slots=3, recent=4)
    decoder = Decoder(lm, cache)
    prompt = torch.randint(3, 258, (33,), generator=torch.Generator().manual_seed(2))
    first, (a,) = prefill(lm, cache, [prompt], [70])
    b = cache.allocate(70)
    restore_snapshot(cache, take_snapshot(cache, a, first[0]), b)
    fed_a, fed_b = [5, 9, 11, 7, 3, 200, 17], [5, 9, 100, 7, 3, 8, 17]
    out_a, out_b = [], []
    with torch.no_grad():
        for ta, tb in zip(fed_a, fed_b, strict=True):
            both = decoder.step(torch.tensor([ta, tb]), [a, b])
            out_a.append(both[0])
            out_b.append(both[1])
    _, (c,) = prefill(lm, cache, [prompt], [70])  # b's tokens on a state of its own prefill
    with torch.no_grad():
        for tb, got in zip(fed_b, out_b, strict=True):
            assert torch.equal(decoder.step(torch.tensor([tb]), [c])[0], got)
    assert not torch.equal(out_a[2], out_b[2])


def test_a_snapshot_from_another_layout_is_refused_by_name() -> None:
    lm = _model(["local", "lsh"])
    cache = DecodeCache.for_tokens(lm, 40, slots=1)
    first, (state,) = prefill(lm, cache, [torch.arange(3, 30)], [40])
    snap = take_snapshot(cache, state, first[0])
    check_fits(cache, snap)
    half = DecodeCache.for_tokens(lm, 40, slots=1, kv_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="layer 0's ring"):
        check_fits(half, snap)
    broken = StateSnapshot(snap.length, snap.num_buckets, snap.index_len,
                           {k: v for k, v in snap.tensors.items() if not k.startswith("order.")})
    with pytest.raises(ValueError, match="bucket order"):
        check_fits(cache, broken)


def test_header_round_trip() -> None:
    lm = _model(["local", "lsh"], num_buckets=None)
    cache = DecodeCache.for_tokens(lm, 80, slots=1)
    first, (state,) = prefill(lm, cache, [torch.arange(3, 63)], [80])
    snap = take_snapshot(cache, state, first[0])
    snap.meta["key"] = "abc"
    back = StateSnapshot.from_header(snap.header(), snap.tensors)
    assert (back.length, back.num_buckets, back.index_len, back.ahead, back.meta) == (
        snap.length, snap.num_buckets, snap.index_len, snap.ahead, snap.meta)
