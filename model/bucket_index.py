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
        self.total = 0
        # a Fenwick tree over the bucket sizes: prefix sums and slot lookups in O(log buckets)
        self._tree = [0] * (num_buckets + 1)
        self._top = 1 << (num_buckets.bit_length() - 1) if num_buckets else 0

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
        tree = index._tree
        for i, n in enumerate(counts.tolist(), start=1):  # linear-time Fenwick construction
            tree[i] += n
            parent = i + (i & -i)
            if parent <= num_buckets:
                tree[parent] += tree[i]
        index.total = int(counts.sum())
        return index

    @property
    def counts(self) -> np.ndarray:
        return np.array([len(lst) for lst in self.lists], dtype=np.int64)

    def _prefix(self, bucket: int) -> int:
        """Positions in buckets 0..bucket."""
        i, s = bucket + 1, 0
        while i > 0:
            s += self._tree[i]
            i -= i & -i
        return s

    def _locate(self, slot: int) -> tuple[int, int]:
        """(bucket holding sorted slot `slot`, positions in the buckets before it)."""
        pos, acc, step = 0, 0, self._top
        tree, n = self._tree, len(self._tree) - 1
        while step:
            nxt = pos + step
            if nxt <= n and acc + tree[nxt] <= slot:
                pos, acc = nxt, acc + tree[nxt]
            step >>= 1
        return pos, acc

    def append(self, position: int, bucket: int) -> int:
        """Add the newest position; returns its slot in the sorted order."""
        self.lists[bucket].append(position)
        self.total += 1
        i, n = bucket + 1, len(self._tree) - 1
        while i <= n:
            self._tree[i] += 1
            i += i & -i
        return self._prefix(bucket) - 1

    def slots(self, start: int, stop: int) -> list[int]:
        """Positions at sorted slots [start, stop) (clipped to the positions that exist)."""
        stop = min(stop, self.total)
        if start >= stop:
            return []
        b, before = self._locate(start)
        out: list[int] = []
        offset = start - before
        need = stop - start
        while need > 0:
            chunk = self.lists[b][offset : offset + need]
            out.extend(chunk)
            need -= len(chunk)
            b, offset = b + 1, 0
        return out

    def slot_of_last(self) -> int:
        """Slot of the newest position, which is always the last entry of its bucket."""
        newest = self.total - 1
        bucket = next(b for b, lst in enumerate(self.lists) if len(lst) and lst[-1] == newest)
        return self._prefix(bucket) - 1

    def nbytes(self) -> int:
        return sum(a.itemsize * len(a) for a in self.lists) + 8 * len(self._tree)
