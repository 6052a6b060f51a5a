"""A kept state restored into a state that shares its first blocks with a live state of the same prefix
(DecodeCache.share_prefix, then restore_snapshot / restore_prefix writing only the rest) equals the state restored
by copy: torch.equal on every cached tensor and every step's logits after it, through merges, on the C and
PyTorch paths, whether the holder runs on (its later blocks are its own) or is freed first. Keys, values and
key factors of a causally read position are a function of the tokens up to it, so a holder whose prompt only
starts with the kept state's tokens holds the same bits there."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from model import ReformerLM
from model.decoding import DecodeCache, Decoder, DecodeState
from model.decoding.extend import open_indexes
from model.decoding.prefix_restore import PREFIX_BLOCK, BlockTails, restore_prefix
from model.decoding.snapshot import StateSnapshot, restore_snapshot, take_snapshot

from ..helpers import tiny_config
from .test_shared_blocks import _same_state

pytestmark = pytest.mark.usefixtures("one_thread")

RECENT = 7  # a merge every 7 steps
AFTER = 20  # steps after the restore


def _model() -> ReformerLM:
    torch.manual_seed(0)
    return ReformerLM(tiny_config(attn_layers=["local", "lsh", "local", "lsh"], vocab_size=258,
                                  initializer_range=0.3, lsh_successor_heads=1, num_buckets=8)).eval()


def _read(decoder: Decoder, tokens: Tensor, reserve: int, tails: BlockTails | None = None
          ) -> tuple[DecodeState, Tensor]:
    """A state that read `tokens` causally (the extend, stopping at each 256-token boundary to keep `tails`), as
    the causal prefill reads a prompt; the logits after its last token."""
    cache = decoder.cache
    state = cache.allocate(reserve)
    open_indexes(decoder, state)
    ids, logits = tokens.tolist(), torch.zeros(1)
    with torch.no_grad():
        while state.length < len(ids):
            end = min(len(ids), (state.length // PREFIX_BLOCK + 1) * PREFIX_BLOCK)
            logits = decoder.extend(state, ids[state.length : end])
            if tails is not None and state.length % PREFIX_BLOCK == 0:
                tails.keep(cache, state, logits)
    return state, logits


def _kept(decoder: Decoder, tokens: Tensor, reserve: int) -> StateSnapshot:
    """The snapshot (with its tails) the prefix cache keeps of a prompt of `tokens`, its state freed."""
    tails = BlockTails()
    state, logits = _read(decoder, tokens, reserve, tails)
    snap = take_snapshot(decoder.cache, state, logits)
    tails.attach(snap)
    decoder.cache.free(state)
    return snap


def _restore(decoder: Decoder, snap: StateSnapshot, state: DecodeState, length: int) -> None:
    if snap.length == length:
        restore_snapshot(decoder.cache, snap, state)
    else:
        restore_prefix(decoder.cache, decoder.lm.config, snap, state, length)


@pytest.mark.parametrize("holder_freed", ["first", "last"])
@pytest.mark.parametrize("cut", [False, True], ids=["snapshot", "cut-back"])
@pytest.mark.parametrize("path", ["c", "torch"])
def test_a_restore_sharing_a_live_prefix_steps_as_a_copy(path: str, cut: bool, holder_freed: str) -> None:
    lm = _model()
    length = 2 * PREFIX_BLOCK  # the boundary restored
    reserve = 3 * PREFIX_BLOCK + AFTER + 8
    cache = DecodeCache.for_tokens(lm, reserve, slots=4, recent=RECENT, cpu_kernel=path == "c")
    assert (cache.kernel is not None) == (path == "c")
    free_before = cache.free_blocks, cache.free_spare_orders, cache.free_slots
    decoder = Decoder(lm, cache)
    gen = torch.Generator().manual_seed(11)
    doc = torch.randint(3, 258, (length,), generator=gen)
    # the kept state: the document alone, or a longer prompt cut back to the document (restore_prefix)
    kept_tokens = torch.cat([doc, torch.randint(3, 258, (PREFIX_BLOCK,), generator=gen)]) if cut else doc
    snap = _kept(decoder, kept_tokens, reserve)
    # the holder: another prompt that starts with the document, read in other slices, still running
    holder, _ = _read(decoder, torch.cat([doc, torch.randint(3, 258, (37,), generator=gen)]), reserve)
    k = cache.shared_blocks(length)
    assert k == length // cache.block_size - 1 and cache.shared_blocks(holder.length) >= k
    sharer = cache.allocate(reserve, shared=k)
    cache.share_prefix(holder, sharer)
    _restore(decoder, snap, sharer, length)
    copy = cache.allocate(reserve)
    _restore(decoder, snap, copy, length)
    assert sharer.blocks[:k] == holder.blocks[:k] and not set(sharer.blocks[k:]) & set(holder.blocks)
    assert all(cache.refs(b) == 2 for b in holder.blocks[:k])
    _same_state(cache, sharer, copy)
    if holder_freed == "first":
        cache.free(holder)
        assert all(cache.refs(b) == 1 for b in sharer.blocks[:k])
    tokens = torch.randint(3, 258, (AFTER,), generator=gen)
    other = torch.randint(3, 258, (AFTER,), generator=gen)
    with torch.no_grad():
        for i in range(AFTER):
            if holder.slot >= 0:  # the holder reads on: its steps and merges never reach the sharer
                decoder.step(other[i : i + 1], [holder])
            a = decoder.step(tokens[i : i + 1], [sharer])[0]
            assert torch.equal(a, decoder.step(tokens[i : i + 1], [copy])[0]), i
            _same_state(cache, sharer, copy)
        more = torch.randint(3, 258, (6,), generator=gen).tolist()
        assert torch.equal(decoder.extend(sharer, more), decoder.extend(copy, more))
        _same_state(cache, sharer, copy)
    cache.free(sharer)
    if holder.slot >= 0:
        assert all(cache.refs(b) == 1 for b in holder.blocks[:k])
        cache.free(holder)
    cache.free(copy)
    assert all(cache.refs(b) == 0 for b in range(cache.blocks))
    assert (cache.free_blocks, cache.free_spare_orders, cache.free_slots) == free_before


def test_a_shared_prefix_is_held_once() -> None:
    """Four states of one 2,048-token document: one holds it, three restore it sharing its blocks; each of those
    holds only the block holding the document's last position and its own new tokens."""
    lm = _model()
    length, new = 8 * PREFIX_BLOCK, 16
    reserve = length + 40 + new
    cache = DecodeCache.for_tokens(lm, reserve, slots=4, recent=RECENT)
    decoder = Decoder(lm, cache)
    doc = torch.randint(3, 258, (length,), generator=torch.Generator().manual_seed(12))
    snap = _kept(decoder, doc, reserve)
    empty = cache.free_blocks
    holder, _ = _read(decoder, torch.cat([doc, torch.full((40,), 7)]), reserve)
    one = empty - cache.free_blocks
    k = cache.shared_blocks(length)
    for _ in range(3):
        state = cache.allocate(reserve, shared=k)
        cache.share_prefix(holder, state)
        restore_snapshot(cache, snap, state)
    four = empty - cache.free_blocks
    assert one == -(-reserve // cache.block_size)
    assert four == one + 3 * (one - k)
    assert four < 1.1 * one


def test_what_cannot_be_shared_is_refused() -> None:
    lm = _model()
    reserve = 2 * PREFIX_BLOCK + 8
    cache = DecodeCache.for_tokens(lm, reserve, slots=4, recent=RECENT)
    decoder = Decoder(lm, cache)
    doc = torch.randint(3, 258, (PREFIX_BLOCK,), generator=torch.Generator().manual_seed(13))
    snap = _kept(decoder, doc, reserve)
    holder, _ = _read(decoder, doc[:100], reserve)  # not past the boundary yet: 12 blocks final
    k = cache.shared_blocks(PREFIX_BLOCK)
    state = cache.allocate(reserve, shared=k)
    with pytest.raises(ValueError, match="shares at most 12"):
        cache.share_prefix(holder, state)
    with pytest.raises(ValueError, match="filled first"):  # shared blocks not filled
        restore_snapshot(cache, snap, state)
    cache.free(state)
    with torch.no_grad():
        decoder.extend(holder, doc[100:].tolist())
    state = cache.allocate(reserve, shared=k)
    cache.share_prefix(holder, state)
    with pytest.raises(ValueError, match="fresh"):
        cache.share_prefix(holder, state)  # filled already
    short = take_snapshot(cache, holder, torch.zeros(1))
    short.length, short.tensors = 100, {n: t[:100] if n.startswith(("kv.", "norms.")) else t
                                        for n, t in short.tensors.items()}
    with pytest.raises(ValueError, match="at most 12 shared"):  # the shared blocks reach past its positions
        restore_snapshot(cache, short, state)
    restore_snapshot(cache, snap, state)
    assert state.length == PREFIX_BLOCK
    cache.free(state)
    cache.free(holder)
    assert all(cache.refs(b) == 0 for b in range(cache.blocks))
