"""model/lsh/windows.py: the look-back windows against their definition, and the faster forms (the forward's
`look_adjacent` and `strided_windows`, the ONNX graph's `windows`) against the reference `gather_chunks`."""

from __future__ import annotations

import pytest
import torch

from export.onnx_graph import windows as graph_windows
from model.lsh.windows import gather_chunks, look_adjacent, strided_windows, window_chunk_index


def test_window_chunk_index_wraps_within_each_rows_own_length() -> None:
    rounds, chunks, before = 2, 4, 1
    win = window_chunk_index(torch.tensor([4, 3]), rounds, chunks, before, 0)  # (B, R*N, W)
    for b, own in enumerate((4, 3)):
        for r in range(rounds):
            for j in range(chunks):
                got = win[b, r * chunks + j].tolist()
                if j >= own:  # a chunk of padding only looks at itself
                    assert got == [r * chunks + j] * 2
                    continue
                flat = r * own + j  # the row's own layout: rounds * own chunks, circular
                prev = (flat - 1) % (rounds * own)
                assert got == [prev // own * chunks + prev % own, r * chunks + j]


@pytest.mark.parametrize("before, after", [(1, 0), (2, 0), (1, 1)])
def test_faster_windows_equal_the_gathered_ones(before: int, after: int) -> None:
    b, h, n, c, d = 2, 3, 5, 4, 6
    x = torch.randn(b, h, n, c, d, generator=torch.Generator().manual_seed(5))
    win = window_chunk_index(torch.full((b,), n), 1, n, before, after)  # every row of the batch's length
    want = gather_chunks(x, win)  # (B, H, N, W*C, D)
    assert torch.equal(look_adjacent(x, before, after), want)
    assert torch.equal(strided_windows(x.reshape(b, h, n * c, d), c, before, after), want)
    # the ONNX graph's gather along the chunk axis of one head per row
    per_head = graph_windows(x.reshape(b * h, n, c, d), win.repeat_interleave(h, dim=0))
    assert torch.equal(per_head.view(b, h, n, -1, d), want)
