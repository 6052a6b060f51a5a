"""bench/decode/stream_read.py: the memory-read floor reads every word it is timed on."""

from __future__ import annotations

import functools
import shutil

import pytest
import torch

from bench.decode.stream_read import StreamReader, floor

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="the floor's reader is compiled with cc")


@pytest.mark.parametrize("threads", [1, 2])
def test_the_pass_folds_every_word(threads: int) -> None:
    reader = StreamReader(threads)
    g = torch.Generator().manual_seed(0)
    words = torch.randint(-2**62, 2**62, (100_003,), generator=g, dtype=torch.int64)
    expected = functools.reduce(lambda a, b: a ^ b, words.tolist()) & (2**64 - 1)
    assert reader.fold(words) == expected
    words[77_777] ^= 1 << 40  # one bit of one word in the second thread's half
    assert reader.fold(words) == expected ^ (1 << 40)


def test_floor_reports_the_bytes_it_read() -> None:
    r = floor(StreamReader(2), 4_000_000, 3)
    assert r["bytes"] == 4_000_000 and r["repeats"] == 3
    assert 0 < r["min_ms"] <= r["median_ms"]
    assert r["gb_per_s"] == pytest.approx(4_000_000 / (r["median_ms"] / 1000) / 1e9)
