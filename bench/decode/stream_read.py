"""The memory-bandwidth anchor: how long one pass of plain reads over N bytes takes on this machine.

    python bench/decode/stream_read.py [--mb 149 297 594] [--threads 2] [--repeats 20]

A one-row decode step reads every packed weight once, so a pass over as many bytes as the weights, with nothing
else to do, is the least a step can take here: bench/decode/decode_weights.py reports each weight kind's step against
it, measured in the same run. The reader (bench/decode/csrc/stream_read.c) is compiled with this machine's compiler
into a temporary folder (a development tool: it needs `cc`), with the kernels' flags and OpenMP, and run on
`--threads` threads over a buffer of random bytes much larger than the last-level cache, so each pass comes
from memory. Prints a table with the load average.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "stream_read.c"


class StreamReader:
    """csrc/stream_read.c compiled and loaded; `seconds(nbytes)` times passes over a buffer of that size."""

    def __init__(self, threads: int) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="stream_read_")
        lib = Path(self._dir.name) / "stream_read.so"
        subprocess.run([os.environ.get("CC", "cc"), "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
                        str(SOURCE), "-o", str(lib)], check=True)
        self._lib = ctypes.CDLL(str(lib))
        self._lib.stream_read.restype = ctypes.c_uint64
        self._lib.stream_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        self.threads = threads

    def fold(self, words: torch.Tensor) -> int:
        """The XOR of a contiguous int64 tensor's words, as the timed pass computes it."""
        assert words.dtype == torch.int64 and words.is_contiguous()
        return int(self._lib.stream_read(words.data_ptr(), words.numel(), self.threads))

    def seconds(self, nbytes: int, repeats: int) -> list[float]:
        """`repeats` timed passes over a fresh buffer of `nbytes` (one untimed pass first faults its pages in)."""
        words = max(1, nbytes // 8)
        buf = torch.randint(-2**62, 2**62, (words,), dtype=torch.int64)
        self._lib.stream_read(buf.data_ptr(), words, self.threads)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self._lib.stream_read(buf.data_ptr(), words, self.threads)
            times.append(time.perf_counter() - t0)
        return times


def floor(reader: StreamReader, nbytes: int, repeats: int) -> dict[str, Any]:
    """A pass over `nbytes`: median and best time, and the bandwidth the median gives."""
    t = reader.seconds(nbytes, repeats)
    med = statistics.median(t)
    return {"bytes": nbytes, "repeats": repeats, "median_ms": 1000 * med, "min_ms": 1000 * min(t),
            "gb_per_s": nbytes / med / 1e9}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, nargs="+", default=[149.0, 297.0, 594.0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    load = os.getloadavg()
    reader = StreamReader(args.threads)
    print(f"load average before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {args.threads} threads")
    print(f"{'MB':>8} {'median ms':>10} {'min ms':>8} {'GB/s':>6}")
    for mb in args.mb:
        r = floor(reader, int(mb * 1e6), args.repeats)
        print(f"{mb:>8.0f} {r['median_ms']:>10.2f} {r['min_ms']:>8.2f} {r['gb_per_s']:>6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
