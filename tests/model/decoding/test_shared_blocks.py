"""Forks share their parent's blocks (DecodeCache.fork): a forked state steps exactly as a state restored by copy
(take_snapshot + restore_snapshot, what forks did before), torch.equal on every step's logits and on every cached
tensor it reads, through index merges, past block boundaries, on the C and PyTorch paths; its shared blocks are
never written; they are held until their last holder is freed, and then every block comes back."""

from __future__ import annotations

import pytest
import torch

from model import ReformerLM
from model.decoding import DecodeCache, Decoder, prefill
from model.decoding.snapshot import restore_snapshot, take_snapshot

from ..helpers import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(layers: list[str], successor: int = 0, num_buckets: int | None = 8, seed: int = 0) -> ReformerLM:
    torch.manual_seed(seed)
    return ReformerLM(tiny_config(attn_layers=layers, vocab_size=258, initializer_range=0.3,
                                  lsh_successor_heads=successor, num_buckets=num_buckets)).eval()


def _same_state(cache: DecodeCache, a, b) -> None:  # type: ignore[no-untyped-def]
    """Every tensor the two states hold (keys, values, key factors, main orders, counts, recent orders, rings,
    buckets hashed ahead, lengths) is equal."""
    logits = torch.zeros(1)
    x, y = take_snapshot(cache, a, logits), take_snapshot(cache, b, logits)
    assert (x.length, x.num_buckets, x.index_len, x.ahead) == (y.length, y.num_buckets, y.index_len, y.ahead)
    assert x.tensors.keys() == y.tensors.keys()
    for name in x.tensors:
        assert torch.equal(x.tensors[name], y.tensors[name]), name


CASES = [
    # layers, successor heads, fixed bucket count (None: automatic, grows as the request does), prompt, steps
    (["local", "lsh", "local", "lsh"], 0, 8, 45, 20),
    (["lsh", "lsh"], 2, 8, 32, 14),  # the prompt ends at a block boundary
    (["local", "lsh"], 1, None, 61, 40),  # the automatic count changes at 64 positions: hashed ahead
]


@pytest.mark.parametrize("path", ["c", "torch"])
@pytest.mark.parametrize("layers,successor,buckets,prompt_len,steps", CASES,
                         ids=[f"{'-'.join(c[0])}-s{c[1]}-nb{c[2]}" for c in CASES])
def test_a_fork_steps_as_a_restored_copy(layers: list[str], successor: int, buckets: int | None, prompt_len: int,
                                         steps: int, path: str) -> None:
    lm = _model(layers, successor, buckets)
    total = prompt_len + steps + 6  # room for the extend of 5 tokens after the steps
    # recent 3: the indexes merge every 3 steps, so the forks' own orders are rewritten many times
    cache = DecodeCache.for_tokens(lm, total, slots=4, recent=3, cpu_kernel=path == "c")
    decoder = Decoder(lm, cache)
    prompt = torch.randint(3, 258, (prompt_len,), generator=torch.Generator().manual_seed(5))
    first, (parent,) = prefill(lm, cache, [prompt], [total])
    shared = cache.shared_blocks(prompt_len)
    assert shared == (prompt_len - 1) // cache.block_size > 0
    fork = cache.allocate(total, shared=shared)
    cache.fork(parent, fork)
    copy = cache.allocate(total)
    restore_snapshot(cache, take_snapshot(cache, parent, first[0]), copy)
    assert fork.blocks[:shared] == parent.blocks[:shared] and not set(fork.blocks[shared:]) & set(parent.blocks)
    assert all(cache.refs(b) == 2 for b in parent.blocks[:shared])
    _same_state(cache, fork, copy)
    tokens = torch.randint(3, 258, (steps,), generator=torch.Generator().manual_seed(7))
    other = torch.randint(3, 258, (steps,), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        for i in range(steps):
            # the parent goes on with other tokens: its steps and merges never reach the fork
            decoder.step(other[i : i + 1], [parent])
            a = decoder.step(tokens[i : i + 1], [fork])[0]
            b = decoder.step(tokens[i : i + 1], [copy])[0]
            assert torch.equal(a, b), i
            _same_state(cache, fork, copy)
        # several tokens in one call (model/decoding/extend.py: the C extend on the C path)
        # (the parent's merges rewrote its own order rows, which the fork's order table does not point at)
        more = torch.randint(3, 258, (5,), generator=torch.Generator().manual_seed(9)).tolist()
        assert torch.equal(decoder.extend(fork, more), decoder.extend(copy, more))
        _same_state(cache, fork, copy)


@pytest.mark.parametrize("parent_first", [True, False])
def test_shared_blocks_are_held_until_their_last_holder_is_freed(parent_first: bool) -> None:
    lm = _model(["local", "lsh"], successor=1)
    cache = DecodeCache.for_tokens(lm, 80, slots=5, recent=3)
    free_blocks, free_slots, spare = cache.free_blocks, cache.free_slots, len(cache.allocator.free_orders)
    decoder = Decoder(lm, cache)
    prompt = torch.randint(3, 258, (50,), generator=torch.Generator().manual_seed(1))
    first, (parent,) = prefill(lm, cache, [prompt], [80])
    shared = cache.shared_blocks(50)
    forks = [cache.allocate(80, shared=shared) for _ in range(3)]
    for fork in forks:
        cache.fork(parent, fork)
    copy = cache.allocate(80)
    restore_snapshot(cache, take_snapshot(cache, parent, first[0]), copy)
    held = parent.blocks[:shared]
    assert all(cache.refs(b) == 4 for b in held)
    with torch.no_grad():
        if parent_first:
            cache.free(parent)
            assert all(cache.refs(b) == 3 for b in held) and not any(cache.allocator.is_free[b] for b in held)
        token = torch.tensor([9])
        want = decoder.step(token, [copy])[0]
        for fork in forks:
            assert torch.equal(decoder.step(token, [fork])[0], want)
        for fork in forks:
            cache.free(fork)
        if not parent_first:
            assert all(cache.refs(b) == 1 for b in held)
            cache.free(parent)
    cache.free(copy)
    assert all(cache.refs(b) == 0 for b in range(cache.blocks))
    assert (cache.free_blocks, cache.free_slots, len(cache.allocator.free_orders)) == (free_blocks, free_slots, spare)
    assert cache.allocated_bytes == 0


def test_no_step_writes_a_shared_block() -> None:
    lm = _model(["lsh", "lsh"], successor=2)
    cache = DecodeCache.for_tokens(lm, 60, slots=2, recent=3)
    decoder = Decoder(lm, cache)
    prompt = torch.randint(3, 258, (40,), generator=torch.Generator().manual_seed(2))
    _, (parent,) = prefill(lm, cache, [prompt], [60])
    fork = cache.allocate(60, shared=cache.shared_blocks(40))
    cache.fork(parent, fork)
    fork.length = fork.shared * cache.block_size  # its successor write would land in the last shared block
    with pytest.raises(AssertionError, match="shared"), torch.no_grad():
        decoder.step(torch.tensor([5]), [fork])
    with pytest.raises(ValueError):
        restore_snapshot(cache, take_snapshot(cache, parent, torch.zeros(1)), fork)
    # nor the parent, where it holds blocks with the fork
    parent.length = fork.shared * cache.block_size - 1
    with pytest.raises(AssertionError, match="shared"), torch.no_grad():
        decoder.step(torch.tensor([5]), [parent])


def test_forks_of_a_long_prompt_hold_it_once() -> None:
    """n = 4 choices of a prompt hold at most 1.1x the blocks of one; the bytes counted are one request's and each
    fork's own part (its own blocks, a spare order block per shared block, its slot)."""
    lm = _model(["local", "lsh"])
    prompt_len, new = 2000, 16
    cache = DecodeCache.for_tokens(lm, prompt_len + new, slots=4)
    _, (parent,) = prefill(lm, cache, [torch.randint(3, 258, (prompt_len,))], [prompt_len + new])
    one_blocks, one_bytes = cache.blocks - 1 - cache.free_blocks, cache.allocated_bytes
    shared = cache.shared_blocks(prompt_len)
    forks = []
    for _ in range(3):
        fork = cache.allocate(prompt_len + new, shared=shared)
        cache.fork(parent, fork)
        forks.append(fork)
    four_blocks = cache.blocks - 1 - cache.free_blocks
    assert four_blocks <= 1.1 * one_blocks
    assert cache.allocated_bytes == one_bytes + 3 * cache.bytes_for(prompt_len + new, shared)


def test_any_order_of_forks_and_frees_returns_every_block() -> None:
    """Random prefills, forks (of parents and of forks) and frees: each block's holder count is the number of live
    states listing it, a block is free exactly when none does, and once all are freed every block, spare order
    block and slot is back."""
    lm = _model(["local", "lsh"])
    cache = DecodeCache.for_tokens(lm, 120, slots=8, recent=3)
    decoder = Decoder(lm, cache)
    rng = torch.Generator().manual_seed(3)
    live: list = []  # type: ignore[type-arg]
    forks = of_forks = 0

    def check() -> None:
        held: dict[int, int] = {}
        for s in live:
            for b in s.blocks:
                held[b] = held.get(b, 0) + 1
        for b in range(1, cache.blocks):
            assert cache.refs(b) == held.get(b, 0) and cache.allocator.is_free[b] == (b not in held)
        assert cache.free_blocks == cache.blocks - 1 - len(held)
        spare = [b for s in live for b in s.order_blocks]
        assert len(spare) == len(set(spare)) and cache.free_spare_orders == cache.blocks - 1 - len(spare)

    with torch.no_grad():
        for _ in range(60):
            op = int(torch.randint(0, 3, (1,), generator=rng))
            if op == 0 and cache.free_slots and cache.fits_now(120):
                n = int(torch.randint(9, 60, (1,), generator=rng))
                _, (state,) = prefill(lm, cache, [torch.randint(3, 258, (n,), generator=rng)], [120])
                live.append(state)
            elif op == 1 and live and cache.free_slots:
                parent = live[int(torch.randint(0, len(live), (1,), generator=rng))]
                shared = cache.shared_blocks(parent.length)
                if parent.length < 119 and cache.fits_now(120, shared):
                    child = cache.allocate(120, shared=shared)
                    cache.fork(parent, child)
                    decoder.step(torch.tensor([7]), [child])
                    live.append(child)
                    forks += 1
                    of_forks += parent.shared > 0
            elif live:
                cache.free(live.pop(int(torch.randint(0, len(live), (1,), generator=rng))))
            check()
        while live:
            cache.free(live.pop())
            check()
    assert cache.allocated_bytes == 0 and cache.free_slots == 8
    assert forks >= 5 and of_forks >= 1


@pytest.mark.parametrize("path", ["c", "torch"])
def test_a_fork_that_shares_nothing_copies_everything(path: str) -> None:
    """With no spare order blocks to give (the engine's fallback), a fork of `shared=0` holds a copy of every
    block and steps as a restored copy."""
    lm = _model(["local", "lsh"], successor=1)
    cache = DecodeCache.for_tokens(lm, 70, slots=3, recent=3, cpu_kernel=path == "c")
    decoder = Decoder(lm, cache)
    first, (parent,) = prefill(lm, cache, [torch.randint(3, 258, (50,), generator=torch.Generator().manual_seed(4))],
                               [70])
    fork = cache.allocate(70)
    cache.fork(parent, fork)
    copy = cache.allocate(70)
    restore_snapshot(cache, take_snapshot(cache, parent, first[0]), copy)
    assert not set(fork.blocks) & set(parent.blocks) and all(cache.refs(b) == 1 for b in parent.blocks)
    with torch.no_grad():
        for token in range(5, 15):
            assert torch.equal(decoder.step(torch.tensor([token]), [fork])[0],
                               decoder.step(torch.tensor([token]), [copy])[0])
            _same_state(cache, fork, copy)
