"""Decode-cache pools on transparent huge pages (Linux, CPU).

A long request's LSH windows read cache rows scattered over hundreds of megabytes, so with 4 KiB pages
nearly every window row is also a TLB miss. A pool mapped on its own (anonymous `mmap`, which Linux aligns
to 2 MiB when it is large) and marked `MADV_HUGEPAGE` is backed by 2 MiB pages as it is written, where the
host's `/sys/kernel/mm/transparent_hugepage/enabled` is `madvise` or `always`; with `never` it is plain
memory, as before. Pages are still touched only when written, and the memory goes back to the system when
the pool is freed. Anywhere else (CUDA, other systems, a pool under `MIN_BYTES`) a pool is `torch.empty`.
"""

from __future__ import annotations

import math
import mmap
import sys

import torch
from torch import Tensor

# below this a pool cannot fill one huge page: torch.empty
MIN_BYTES = 2 * 2**20


def pool_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised tensor of `shape`, on huge pages where the host allows (see the module docstring)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or not sys.platform.startswith("linux") or nbytes < max(MIN_BYTES, 1) \
            or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype, device=device)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without transparent huge pages: plain pages
        pass
    # the tensor holds the mapping (through the buffer it exports) for as long as it lives
    return torch.frombuffer(region, dtype=dtype).view(shape)
