"""Process-wide CPU settings that make the model's large elementwise passes fast; called once at start-up
by `reformer train` and `reformer serve` (never by the model's forward, so importing the model changes
nothing). `reformer serve` also fits PyTorch's intra-op threads to a container's CPU quota
(`fit_threads_to_container`).

Timed by hand once (not a saved benchmark) on this project's 2-core machine (torch 2.13, AVX-512),
8.4M-element tensors, the size of one LSH layer's score blocks at window 512 x batch 16:
- glibc returns every allocation above its mmap threshold (at most 32 MB by default) to the kernel when
  freed, so the next one page-faults on every page: `x * x` took 31 ms, 7 ms with the threshold raised;
- `exp` of masked logits (about -1e9) produces denormals, which the CPU handles in microcode: 345 ms
  against 34 ms for ordinary inputs; flushing denormals to zero removes it. A denormal is below 1.2e-38,
  far under any tolerance the model is held to.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_KEEP_BYTES = 2**31 - 1  # mallopt takes an int: the largest threshold it accepts


def tune_cpu_runtime() -> dict[str, bool]:
    """Flush denormals to zero and keep freed large blocks in the heap (glibc); returns what took effect.
    Harmless where unsupported (other libc, non-x86 CPUs): the setting is skipped and reported False."""
    done = {"flush_denormal": bool(torch.set_flush_denormal(True)), "malloc_thresholds": False}
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        done["malloc_thresholds"] = bool(libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES))
    except (OSError, AttributeError):
        pass
    log.debug("cpu runtime: %s", done)
    return done


def container_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The CPUs a container's CPU quota allows, rounded up (cgroup v2 `cpu.max`, else v1's `cpu.cfs_quota_us`
    over `cpu.cfs_period_us`), or None without a quota. PyTorch sizes its thread pool from the host's cores,
    which a quota (`docker run --cpus`) does not change: more threads than the quota lets run at once wait at
    every barrier for a thread the scheduler has parked."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        if quota == "max":
            return None
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else max(1, math.ceil(quota_us / period_us))


def fit_threads_to_container(cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Lower PyTorch's intra-op threads to the container's CPU quota when it is smaller and the operator did
    not choose a count (OMP_NUM_THREADS); returns the new count, or None when it left them."""
    limit = container_cpus(cgroup)
    if limit is None or os.environ.get("OMP_NUM_THREADS") or limit >= torch.get_num_threads():
        return None
    torch.set_num_threads(limit)
    return limit
