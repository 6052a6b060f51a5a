"""A sliced prefill's whole-prompt products in blocks of positions (model/decoding/prefill/row_blocks.py): no
piece of a long prompt's prefill runs the embeddings, a layer norm, an attention projection or the hash on
more than ROW_BLOCK rows, and the results keep their bits: the cache, the indexes and the logits equal a
prefill in one block per product, and a layer's sliced forward equals the full forward (`torch.equal`)."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest
import torch
from torch import Tensor

from model import ReformerLM
from model.attention import AttentionContext, LSHSelfAttention
from model.decoding import DecodeCache, prefill_steps
from model.decoding.prefill import row_blocks
from model.decoding.prefill.slices import layer_f_slices

from ..helpers import tiny_config
from .layer_inputs import random_batch


def _model(**overrides: Any) -> ReformerLM:
    torch.manual_seed(0)
    return ReformerLM(tiny_config(vocab_size=258, initializer_range=0.3, chunk_size_feed_forward=16,
                                  **overrides)).eval()


def _drain(gen: Generator[None, None, Any], piece: list[int] | None = None) -> tuple[Any, int]:
    """Run a generator to its end, counting its pieces in piece[0] as it goes: (its result, its yields)."""
    count = 0
    while True:
        try:
            next(gen)
            count += 1
            if piece is not None:
                piece[0] += 1
        except StopIteration as done:
            return done.value, count


@pytest.mark.parametrize("batch,block", [(1, 32), (1, 64), (3, 48), (4, 8192)])
def test_position_blocks_cover_the_positions_in_near_equal_blocks(batch: int, block: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(row_blocks, "ROW_BLOCK", block)
    per = max(row_blocks.MIN_BLOCK_ROWS, block // batch)
    for length in (1, 15, 16, 17, 31, 32, 33, 100, 203, 4097, 60_000):
        blocks = row_blocks.position_blocks(batch, length, torch.device("cpu"))
        assert blocks[0][0] == 0 and blocks[-1][1] == length
        assert all(a1 == b0 for (_, a1), (b0, _) in zip(blocks, blocks[1:]))
        sizes = [b - a for a, b in blocks]
        assert max(sizes) <= per and max(sizes) - min(sizes) <= 1
        assert len(blocks) == -(-length // per)  # the fewest that fit
        if len(blocks) > 1:
            assert min(sizes) >= row_blocks.MIN_BLOCK_ROWS // 2
        assert row_blocks.position_blocks(batch, length, torch.device("meta")) == [(0, length)]  # off the CPU


def _prefill(lm: ReformerLM, prompts: list[Tensor], spy: dict[str, list[tuple[int, int]]] | None = None,
             piece: list[int] | None = None) -> tuple[Tensor, list[Tensor], int]:
    """A sliced prefill of `prompts` into a cache of its own: (its logits, what it wrote into the cache, its
    yields); with `spy`, the calls of its whole-prompt products recorded there (`_watch`), pieces counted in
    piece[0]."""
    cache = DecodeCache.for_tokens(lm, 320, slots=len(prompts))
    piece = [0] if piece is None else piece
    if spy is not None:
        _watch(lm, spy, piece)
    (logits, states), yields = _drain(prefill_steps(lm, cache, prompts, [p.shape[0] + 8 for p in prompts]),
                                      piece)
    written = []
    for state, p in zip(states, prompts, strict=True):  # each prompt's rows of every pool and index
        assert state.length == p.shape[0]
        for li, (keys, values) in enumerate(zip(cache.keys, cache.values, strict=True)):
            held = cache.held_rows(li, state)  # a local layer's: the last window's, in its ring
            written += [keys.index_select(0, held), values.index_select(0, held)]
        rows = cache.slot_rows(state, 0, p.shape[0])
        for ix in cache.indexes:
            if ix is not None:
                written += [ix.order[rows], ix.main_counts[state.slot], ix.recent_counts[state.slot]]
    return logits, written, yields


def _inputs(lm: ReformerLM, lengths: list[int]) -> tuple[Tensor, AttentionContext]:
    """A random hidden state of a padded batch of these lengths, and its attention context."""
    g = torch.Generator().manual_seed(5)
    batch = random_batch(lm, lengths, g)
    x = torch.randn(*batch.input_ids.shape, lm.config.hidden_size, generator=g)
    return x, batch.context


def _watch(lm: ReformerLM, spy: dict[str, list[tuple[int, int]]], piece: list[int]) -> None:
    """Record (piece, rows) of every call of the whole-prompt products: the embeddings, the layer norms and
    the attention's Linears (rows: batch rows x positions, as F.linear sees them)."""
    def hook(name: str) -> Any:
        return lambda _m, args, _out: spy.setdefault(name, []).append(
            (piece[0], args[0].reshape(-1, args[0].shape[-1]).shape[0]))

    lm.embeddings.word_embeddings.register_forward_hook(
        lambda _m, args, _out: spy.setdefault("embeddings", []).append((piece[0], args[0].numel())))
    for i, layer in enumerate(lm.layers):
        layer.attention.layer_norm.register_forward_hook(hook(f"layer_norm{i}"))
        layer.attention.output.register_forward_hook(hook(f"output{i}"))
        for name, m in layer.attention.self_attention.named_children():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_hook(hook(f"{name}{i}"))


@pytest.mark.parametrize("buckets", [4, None], ids=["fixed-buckets", "automatic-buckets"])
@pytest.mark.parametrize("lengths,block", [([300], 64), ([300, 131, 257], 96)], ids=["one", "batch"])
def test_no_piece_runs_a_whole_prompt_product_on_more_than_a_block(lengths: list[int], block: int,
                                                                   buckets: int | None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    lm = _model(attn_layers=["local", "lsh", "local", "lsh"], num_buckets=buckets)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 258, (n,), generator=g) for n in lengths]
    whole, whole_written, whole_yields = _prefill(lm, prompts)  # ROW_BLOCK 8192: one block per product
    monkeypatch.setattr(row_blocks, "ROW_BLOCK", block)
    spy: dict[str, list[tuple[int, int]]] = {}
    piece = [0]
    real_hash = LSHSelfAttention.hash

    def hash_spy(self: LSHSelfAttention, qk: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        spy.setdefault("hash", []).append((piece[0], qk.shape[0] * qk.shape[2]))
        return real_hash(self, qk, *args, **kwargs)

    monkeypatch.setattr(LSHSelfAttention, "hash", hash_spy)
    blocked, written, yields = _prefill(lm, prompts, spy, piece)
    padded = len(lengths) * lm.config.padded_length(max(lengths))
    rows_per_piece: dict[int, int] = {}
    for name, calls in spy.items():
        # every position of every layer's products went through, in calls of at most a block's rows
        if not name.startswith("output3"):  # the last layer's output projection: the last positions only
            assert sum(rows for _, rows in calls) == padded * (2 if name == "hash" else 1), name  # 2 LSH layers
        assert max(rows for _, rows in calls) <= block, name
        for p, rows in calls:
            rows_per_piece[p] = rows_per_piece.get(p, 0) + rows
    assert max(rows_per_piece.values()) <= block  # and no piece runs two blocks of them
    assert yields > whole_yields + 4 * 8  # each layer's products cut into more pieces
    # the same bits as one block per product: the logits, every layer's cached keys and values, the indexes
    assert torch.equal(blocked, whole)
    assert len(written) == len(whole_written) and all(torch.equal(a, b) for a, b in zip(written, whole_written))


@pytest.mark.parametrize("kind", ["local", "lsh"])
@pytest.mark.parametrize("lengths", [[203], [131, 200, 77]], ids=["203", "131-200-77"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_layer_in_small_blocks_equals_the_full_layer(kind: str, lengths: list[int], threads: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 16-32 positions against the full forward's one call (tests/model/decoding/
    test_prefill_slices.py checks the default blocks), on one and on two intra-op threads."""
    monkeypatch.setattr(row_blocks, "ROW_BLOCK", 32)
    lm = _model(attn_layers=[kind, kind], num_hashes=3)
    layer = lm.layers[1]
    x, ctx = _inputs(lm, lengths)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            whole, _ = layer.f(x, ctx, None)
            sliced, yields = _drain(layer_f_slices(layer, x, ctx, 3))
    finally:
        torch.set_num_threads(before)
    assert yields > 5 * x.shape[1] // 32  # the layer norm, projections and output projection in blocks
    assert torch.equal(sliced, whole)
