"""Process-wide CPU settings that make the model's large elementwise passes fast; called once at start-up
by `reformer train` and `reformer serve` (never by the model's forward, so importing the model changes
nothing).

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
