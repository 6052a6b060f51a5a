"""A merge of an LSH index's recent order that reads the request's pool rows from its block table
(`LSHIndex.merge_in_blocks`, the C kernel's lsh_merge_blocks) gives the order the PyTorch merge through a
list of those rows gives, and the full sort of every position: many positions, scattered blocks, block sizes
that are and are not powers of two, both item widths; and decoding over a cache of blocks that are not a power
of two gives the logits of one whose blocks are."""

from __future__ import annotations

import pytest
import torch

from model import ReformerLM
from model.decoding.lsh_index import LSHIndex
from model.kernels import CpuKernels, build

from ..helpers import decode_greedily, tiny_config


@pytest.fixture(scope="module")
def kernel() -> CpuKernels:
    k = build.kernels()
    assert k is not None, "the C kernels did not build (is a C compiler installed?)"
    return k


def _grown_index(kernel: CpuKernels, buckets: torch.Tensor, nb: int, main_len: int, block_size: int,
                 max_positions: int, g: torch.Generator) -> tuple[LSHIndex, torch.Tensor, torch.Tensor]:
    """An index of `nb` buckets whose slot 1 holds the first main_len positions of `buckets` (H, R, L) in its
    main order and the rest appended to its recent order, over blocks scattered through the pool; with that
    slot's block table row and pool rows (L,)."""
    heads, rounds, length = buckets.shape
    nblocks = -(-length // block_size)
    table = torch.randperm(nblocks + 5, generator=g)[:nblocks] + 1  # block 0 is scratch
    index = LSHIndex(3, heads, rounds, nb, (nblocks + 6) * block_size, torch.device("cpu"),
                     max_positions=max_positions, recent=length - main_len)
    at = torch.arange(length)
    rows = table[at // block_size] * block_size + at % block_size
    index.build(1, rows[:main_len], buckets[..., :main_len].contiguous())
    for t in range(main_len, length):  # the C insert: a row appending position t to slot 1 (abi.Meta columns)
        kernel.append(index.arrays(), torch.tensor([[1, t, 1, 1, 0, 1, 1]]), buckets[None, ..., t].contiguous())
    return index, table, rows


def _order(index: LSHIndex, rows: torch.Tensor) -> torch.Tensor:
    return index.order[rows].long() - index.shift  # (L, H*R) positions


@pytest.mark.parametrize("block_size", [8, 3])
@pytest.mark.parametrize("max_positions", [2**16, 2**20], ids=["int16-items", "int32-items"])
@pytest.mark.parametrize("spread", ["random", "first-bucket", "last-bucket"])
def test_a_merge_through_the_block_table_gives_the_merge_through_the_rows(
        kernel: CpuKernels, block_size: int, max_positions: int, spread: str) -> None:
    g = torch.Generator().manual_seed(block_size)
    heads, rounds, nb, main_len, recent = 2, 2, 97, 6000, 64
    buckets = torch.randint(0, nb, (heads, rounds, main_len + recent), generator=g)
    if spread != "random":  # every recent item in one bucket: at the front, every main item moves
        buckets[..., main_len:] = 0 if spread == "first-bucket" else nb - 1
    length = buckets.shape[-1]
    want = torch.argsort(buckets * length + torch.arange(length), dim=-1).reshape(heads * rounds, length).t()
    merged = []
    for how in ("rows-pytorch", "blocks-kernel", "blocks-pytorch"):
        index, table, rows = _grown_index(kernel, buckets, nb, main_len, block_size, max_positions,
                                          torch.Generator().manual_seed(1))
        assert index.items.dtype == (torch.int16 if max_positions <= 2**16 else torch.int32)
        counts = index.main_counts[1] + index.recent_counts[1]
        if how == "rows-pytorch":
            index.merge(1, rows, main_len, recent)
        else:
            index.merge_in_blocks(1, table, block_size, main_len, recent, kernel if how == "blocks-kernel" else None)
        assert torch.equal(index.main_counts[1], counts) and int(index.recent_counts.sum()) == 0
        merged.append(_order(index, rows))
    assert torch.equal(merged[0], want)
    assert torch.equal(merged[1], want) and torch.equal(merged[2], want)


def test_a_merge_through_a_block_outside_the_pool_is_refused(kernel: CpuKernels) -> None:
    g = torch.Generator().manual_seed(0)
    buckets = torch.randint(0, 5, (1, 1, 40), generator=g)
    index, table, _ = _grown_index(kernel, buckets, 5, 32, 8, 2**16, g)
    table[2] = 10_000
    with pytest.raises(IndexError, match="merge kernel"):
        index.merge_in_blocks(1, table, 8, 32, 8, kernel)
    with pytest.raises(ValueError, match="block table row"):
        index.merge_in_blocks(1, table[:3], 8, 32, 8, kernel)


def test_decoding_over_blocks_of_any_size_gives_the_same_logits() -> None:
    """The kernels find pool rows with a shift for blocks of a power of two and a division otherwise (the
    window's lookups and the merges, every 4 steps here): the same logits, bit for bit, and those of the
    PyTorch path within float error."""
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(vocab_size=258, attn_layers=["local", "lsh", "lsh"], num_buckets=8,
                                num_hashes=2)).eval()
    pow2 = decode_greedily(lm, [5, 30, 77], 24, cpu_kernel=True, recent=4, block_size=8, seed=3)
    assert torch.equal(decode_greedily(lm, [5, 30, 77], 24, cpu_kernel=True, recent=4, block_size=3, seed=3), pow2)
    plain = decode_greedily(lm, [5, 30, 77], 24, cpu_kernel=False, recent=4, block_size=3, seed=3)
    assert torch.equal(plain.argmax(-1), pow2.argmax(-1))
    # logits up to ~9 here (sharp attention): float32 sums in another order differ by a few ulps of that
    assert (plain - pow2).abs().max().item() <= 5e-5
