"""Bucket-sorted positions of one (layer, head, hash round), kept incrementally for decoding.

A full forward sorts every position by (bucket, position). Decoding appends one position at a time,
always the largest, so it lands at the end of its bucket: the sorted order is the concatenation of the
per-bucket lists, and a position's slot is the number of positions in buckets up to its own. Appending
and looking up a window of slots cost O(buckets + window), independent of the sequence length.
"""

from __future__ import annotations

from array import array

import numpy as np


class BucketIndex:
    def __init__(self, num_buckets: int) -> None:
        self.lists = [array("i") for _ in range(num_buckets)]
        self.counts = np.zeros(num_buckets, dtype=np.int64)

    @classmethod
    def from_buckets(cls, buckets: np.ndarray, num_buckets: int) -> BucketIndex:
        """buckets (L,): the bucket of every position 0..L-1."""
        index = cls(num_buckets)
        order = np.argsort(buckets.astype(np.int64) * max(len(buckets), 1) + np.arange(len(buckets)), kind="stable")
        counts = np.bincount(buckets, minlength=num_buckets)
        start = 0
        for b, n in enumerate(counts.tolist()):
            if n:
                index.lists[b].frombytes(order[start : start + n].astype(np.int32).tobytes())
            start += n
        index.counts = counts.astype(np.int64)
        return index

    def append(self, position: int, bucket: int) -> int:
        """Add the newest position; returns its slot in the sorted order."""
        self.lists[bucket].append(position)
        self.counts[bucket] += 1
        return int(self.counts[: bucket + 1].sum()) - 1

    def slots(self, start: int, stop: int) -> list[int]:
        """Positions at sorted slots [start, stop) (clipped to the positions that exist)."""
        total = int(self.counts.sum())
        stop = min(stop, total)
        if start >= stop:
            return []
        ends = np.cumsum(self.counts)
        b = int(np.searchsorted(ends, start, side="right"))
        out: list[int] = []
        offset = start - (int(ends[b - 1]) if b else 0)
        need = stop - start
        while need > 0:
            chunk = self.lists[b][offset : offset + need]
            out.extend(chunk)
            need -= len(chunk)
            b, offset = b + 1, 0
        return out

    def nbytes(self) -> int:
        return sum(a.itemsize * len(a) for a in self.lists) + self.counts.nbytes
