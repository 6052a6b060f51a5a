"""A snapshot of a long prompt's state restored truncated to its first b positions (b a multiple of 256) equals
the state of a prompt of those b tokens alone, fed by the same decode steps: every cached tensor of the slot
torch.equal, and the same logits at every step after it. What cannot be truncated exactly is refused.

The truncated restore holds every position in its main bucket order (its recent order empty); the state fed b
tokens holds its last ones in its recent order. Where that split lies never changes a window
(model/decoding/lsh_index.py), so the cached tensors are compared after merging the reference's recent order
(on a copy: the logits after it are compared against the reference as it was fed, unmerged). A recent array's
items past its counts are dead (a merge leaves what it held before), so only its counts are compared there;
the steps after show nothing reads them."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from model import ReformerLM
from model.decoding import DecodeCache, Decoder, DecodeState, prefill
from model.decoding.prefix_restore import PREFIX_BLOCK, BlockTails, restore_prefix
from model.decoding.snapshot import StateSnapshot, restore_snapshot, take_snapshot

from ..helpers import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = ["local", "lsh", "local", "lsh"]
RECENT = 7  # a merge every 7 steps: dozens of merges, and a state at 256 or 512 with recent items left
AFTER = 24  # steps fed to both states after the restore (past the next merges)


def _model(num_buckets: int | None = 8, lsh_chunk: int = 8) -> ReformerLM:
    torch.manual_seed(0)
    return ReformerLM(tiny_config(attn_layers=LAYERS, vocab_size=258, initializer_range=0.3, lsh_successor_heads=1,
                                  num_buckets=num_buckets, lsh_attn_chunk_length=lsh_chunk)).eval()


def _feed(lm: ReformerLM, cache: DecodeCache, tokens: Tensor, reserve: int, tails: BlockTails | None = None
          ) -> tuple[DecodeState, Tensor]:
    """A state fed `tokens` one causal step at a time (the first by a one-token prefill: a fixed bucket count's
    index is built there), keeping `tails` at every boundary it passes; the logits after its last token."""
    first, (state,) = prefill(lm, cache, [tokens[:1]], [reserve])
    logits, decoder = first[0], Decoder(lm, cache)
    with torch.no_grad():
        for token in tokens[1:].tolist():
            if tails is not None and state.length % PREFIX_BLOCK == 0:
                tails.keep(cache, state, logits)
            logits = decoder.step([token], [state])[0]
    if tails is not None and state.length % PREFIX_BLOCK == 0:
        tails.keep(cache, state, logits)
    return state, logits


def _merged_copy(cache: DecodeCache, state: DecodeState, reserve: int) -> DecodeState:
    """A copy of `state` in another slot (an exact copy: tests/model/decoding/test_snapshot.py) with every LSH
    layer's recent order merged into its main order."""
    copy = cache.allocate(reserve)
    restore_snapshot(cache, take_snapshot(cache, state, torch.zeros(1)), copy)
    for li, index in enumerate(cache.indexes):
        if index is not None and copy.num_buckets[li] is not None:
            index.merge_in_blocks(copy.slot, cache.block_table[copy.slot], cache.block_size, copy.index_len[li],
                                  copy.length - copy.index_len[li], cache.kernel)
            copy.index_len[li] = copy.length
    return copy


def _slot_tensors(cache: DecodeCache, state: DecodeState) -> dict[str, Tensor]:
    """Everything the cache holds for `state` that a step can read (but the recent items past their counts)."""
    rows = cache.slot_rows(state, 0, state.length)
    out: dict[str, Tensor] = {}
    for li, index in enumerate(cache.indexes):
        if index is None:
            width = cache.ring.width
            out[f"ring.{li}"] = cache.kv[li][state.slot * width : (state.slot + 1) * width]
            continue
        norms = cache.norms[li]
        assert norms is not None
        out[f"kv.{li}"] = cache.kv[li][rows]
        out[f"norms.{li}"] = norms[rows]
        out[f"order.{li}"] = index.order[rows[: state.index_len[li]]]
        out[f"main_counts.{li}"] = index.main_counts[state.slot]
        out[f"recent_counts.{li}"] = index.recent_counts[state.slot]
    return out


def _same_steps(lm: ReformerLM, cache: DecodeCache, a: DecodeState, b: DecodeState, tokens: Tensor) -> None:
    decoder = Decoder(lm, cache)
    with torch.no_grad():
        for i, token in enumerate(tokens.tolist()):
            assert torch.equal(decoder.step([token], [a])[0], decoder.step([token], [b])[0]), i


def _check_truncation(lm: ReformerLM, cache: DecodeCache, snap: StateSnapshot, tokens: Tensor, b: int,
                      reserve: int) -> None:
    """restore_prefix at b against a state fed tokens[:b]: the same tensors, logits and steps after."""
    ref, ref_logits = _feed(lm, cache, tokens[:b], reserve)
    assert all(n < b for n, nb in zip(ref.index_len, ref.num_buckets, strict=True) if nb is not None)  # some recent
    copy = _merged_copy(cache, ref, reserve)
    got = cache.allocate(reserve)
    logits = restore_prefix(cache, lm.config, snap, got, b)
    assert logits is not None and torch.equal(logits, ref_logits.float())
    assert (got.length, got.num_buckets, got.index_len) == (copy.length, copy.num_buckets, copy.index_len)
    want, have = _slot_tensors(cache, copy), _slot_tensors(cache, got)
    assert want.keys() == have.keys()
    for name in want:
        assert torch.equal(want[name], have[name]), name
    _same_steps(lm, cache, ref, got, tokens[b : b + AFTER])
    for state in (ref, copy, got):
        cache.free(state)


@pytest.mark.parametrize("path", ["c", "torch"])
def test_a_truncated_restore_is_the_state_of_the_prefix_alone(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each boundary twice: the second truncation to a boundary copies the orders the first built
    (`StateSnapshot.cut`) instead of reading the buckets back, with the same result."""
    from model.decoding import prefix_restore

    read_back: list[int] = []
    position_buckets = prefix_restore.position_buckets

    def counting(index: object, snap: StateSnapshot, layer: int) -> Tensor:
        read_back.append(layer)
        return position_buckets(index, snap, layer)  # type: ignore[arg-type]

    monkeypatch.setattr(prefix_restore, "position_buckets", counting)
    lm = _model()
    length = 3 * PREFIX_BLOCK
    reserve = length + AFTER + 1
    cache = DecodeCache.for_tokens(lm, reserve, slots=4, recent=RECENT, cpu_kernel=path == "c")
    assert (cache.kernel is not None) == (path == "c")
    tokens = torch.randint(3, 258, (length + AFTER,), generator=torch.Generator().manual_seed(3))
    tails = BlockTails()
    state, logits = _feed(lm, cache, tokens[:length], reserve, tails)
    snap = take_snapshot(cache, state, logits)
    tails.attach(snap)
    assert sorted(snap.tails) == [256, 512, 768]
    cache.free(state)
    lsh_layers = [li for li, index in enumerate(cache.indexes) if index is not None]
    for b in (PREFIX_BLOCK, 2 * PREFIX_BLOCK, length):
        for again in (False, True):
            read_back.clear()
            _check_truncation(lm, cache, snap, tokens, b, reserve)
            assert read_back == ([] if again else lsh_layers)
            assert snap.cut is not None and snap.cut[0] == b and sorted(snap.cut[1]) == lsh_layers


def test_a_truncation_at_the_full_length_is_the_plain_restore_merged() -> None:
    lm = _model()
    length, reserve = PREFIX_BLOCK, PREFIX_BLOCK + AFTER + 1
    cache = DecodeCache.for_tokens(lm, reserve, slots=4, recent=RECENT)
    tokens = torch.randint(3, 258, (length + AFTER,), generator=torch.Generator().manual_seed(4))
    tails = BlockTails()
    state, logits = _feed(lm, cache, tokens[:length], reserve, tails)
    snap = take_snapshot(cache, state, logits)
    tails.attach(snap)
    plain = cache.allocate(reserve)
    restore_snapshot(cache, snap, plain)
    merged = _merged_copy(cache, plain, reserve)
    got = cache.allocate(reserve)
    logits = restore_prefix(cache, lm.config, snap, got, length)
    assert logits is not None and torch.equal(logits, snap.logits)
    want, have = _slot_tensors(cache, merged), _slot_tensors(cache, got)
    assert all(torch.equal(want[name], have[name]) for name in want)
    _same_steps(lm, cache, plain, got, tokens[length:])


def test_an_automatic_bucket_count_truncates_where_it_did_not_change() -> None:
    """Tiny model, chunk 8: the count is [8, 8] at 256 positions and [8, 16] from 505 on (model/lsh/hashing.py)."""
    lm = _model(num_buckets=None)
    length = 3 * PREFIX_BLOCK
    reserve = length + AFTER + 1
    cache = DecodeCache.for_tokens(lm, reserve, slots=4, recent=RECENT)
    tokens = torch.randint(3, 258, (length + AFTER,), generator=torch.Generator().manual_seed(5))
    tails = BlockTails()
    state, logits = _feed(lm, cache, tokens[:length], reserve, tails)
    snap = take_snapshot(cache, state, logits)
    tails.attach(snap)
    assert str(snap.tails[256].num_buckets[1]) == "[8, 8]" and str(snap.num_buckets[1]) == "[8, 16]"
    cache.free(state)
    _check_truncation(lm, cache, snap, tokens, 2 * PREFIX_BLOCK, reserve)
    with pytest.raises(ValueError, match="bucket count changed"):
        restore_prefix(cache, lm.config, snap, cache.allocate(reserve), PREFIX_BLOCK)


def test_buckets_hashed_ahead_at_the_boundary_are_refused() -> None:
    """LSH chunk 20: the automatic count changes at the step that writes position 280, within rehash_ahead's
    lead of 256, so the state at 256 holds buckets hashed ahead."""
    lm = _model(num_buckets=None, lsh_chunk=20)
    reserve = PREFIX_BLOCK + 64
    cache = DecodeCache.for_tokens(lm, reserve, slots=2, recent=RECENT)
    tokens = torch.randint(3, 258, (PREFIX_BLOCK,), generator=torch.Generator().manual_seed(6))
    tails = BlockTails()
    state, logits = _feed(lm, cache, tokens, reserve, tails)
    assert tails.facts[PREFIX_BLOCK].ahead and not any(n.startswith("tail.256.ring") for n in tails.tensors)
    snap = take_snapshot(cache, state, logits)
    tails.attach(snap)
    with pytest.raises(ValueError, match="hashed ahead"):
        restore_prefix(cache, lm.config, snap, cache.allocate(reserve), PREFIX_BLOCK)


def test_what_cannot_be_truncated_is_refused() -> None:
    lm = _model()
    length = 2 * PREFIX_BLOCK
    cache = DecodeCache.for_tokens(lm, length, slots=3, recent=RECENT)
    tokens = torch.randint(3, 258, (length,), generator=torch.Generator().manual_seed(7))
    tails = BlockTails()
    state, logits = _feed(lm, cache, tokens, length, tails)
    bare = take_snapshot(cache, state, logits)
    snap = take_snapshot(cache, state, logits)
    tails.attach(snap)
    fresh = cache.allocate(length)
    for b in (0, 100, PREFIX_BLOCK + 8, 3 * PREFIX_BLOCK):
        with pytest.raises(ValueError, match="multiple of 256"):
            restore_prefix(cache, lm.config, snap, fresh, b)
    with pytest.raises(ValueError, match="no tail"):
        restore_prefix(cache, lm.config, bare, fresh, PREFIX_BLOCK)
    order = snap.tensors["order.1"].clone()
    order[0] = order[1]  # one position twice, another missing
    broken = StateSnapshot(snap.length, snap.num_buckets, snap.index_len, {**snap.tensors, "order.1": order},
                           tails=snap.tails)
    with pytest.raises(ValueError, match="every position once"):
        restore_prefix(cache, lm.config, broken, fresh, PREFIX_BLOCK)
    counts = snap.tensors["main_counts.1"].clone().reshape(-1)
    counts[1] += counts[0] + 1  # the same total, the first bucket holding -1 positions
    counts[0] = -1
    negative = StateSnapshot(snap.length, snap.num_buckets, snap.index_len,
                             {**snap.tensors, "main_counts.1": counts.view_as(snap.tensors["main_counts.1"])},
                             tails=snap.tails)
    with pytest.raises(ValueError, match="do not add up"):
        restore_prefix(cache, lm.config, negative, fresh, PREFIX_BLOCK)
    del snap.tensors[f"tail.{PREFIX_BLOCK}.ring.0"]
    with pytest.raises(ValueError, match="no ring of layer 0"):
        restore_prefix(cache, lm.config, snap, fresh, PREFIX_BLOCK)
    with pytest.raises(ValueError, match="multiple of 256 positions"):
        tails.keep(cache, fresh)  # length 0: no boundary passed
    assert fresh.length == 0  # nothing was written by a refusal


def test_tails_round_trip_through_the_header() -> None:
    lm = _model()
    cache = DecodeCache.for_tokens(lm, PREFIX_BLOCK, slots=1, recent=RECENT)
    tokens = torch.randint(3, 258, (PREFIX_BLOCK,), generator=torch.Generator().manual_seed(8))
    tails = BlockTails()
    state, logits = _feed(lm, cache, tokens, PREFIX_BLOCK, tails)
    snap = take_snapshot(cache, state, logits)
    tails.attach(snap)
    assert snap.nbytes == take_snapshot(cache, state, logits).nbytes + tails.nbytes
    assert StateSnapshot.from_header(snap.header(), snap.tensors).tails == snap.tails
    old = {k: v for k, v in snap.header().items() if k != "tails"}  # a file written before tails were kept
    assert StateSnapshot.from_header(old, snap.tensors).tails == {}
