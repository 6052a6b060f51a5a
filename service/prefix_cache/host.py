"""Where the prefix cache keeps its states: in host memory, on every device, under the memory tier's byte
budget (REFORMER_PREFIX_CACHE_BYTES; store.py).

On the CPU a snapshot (model/decoding/snapshot.py `take_snapshot`) is already a copy in host memory outside
the decode cache, and it is kept as it is: no copy. On a GPU a snapshot's tensors are copies in device
memory; kept there, every state the cache held took GPU memory outside any budget (next to a decode cache
sized from the free GPU memory at start). So on any other device every tensor is copied into host memory
(page-locked, `pin_memory`, when CUDA is available: the copy back is a plain DMA) before the state is kept,
and the device copy goes with the request's step. A restore copies the state back to the decode cache's
device (`restore_snapshot` and `restore_prefix` move each tensor with `.to(cache.device)`), so the device
holds a kept state only while a request restores it.

The device is a parameter, not read from the tensors: the copy is decided by where the decode cache lives,
which tests can name without a GPU (tests/service/prefix_cache/test_host_memory.py)."""

from __future__ import annotations

import dataclasses

import torch

from model.decoding.snapshot import StateSnapshot


def pin_host_memory() -> bool:
    """Whether host copies are page-locked: only where CUDA is available (pinning needs its driver)."""
    return torch.cuda.is_available()


def host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A fresh contiguous copy of `t` in host memory, page-locked when `pin`."""
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    out.copy_(t)
    return out


def to_host(snapshot: StateSnapshot, device: torch.device, pin: bool) -> StateSnapshot:
    """The snapshot to keep for a decode cache on `device`: on the CPU the snapshot itself; on any other
    device a snapshot whose every tensor is a host copy (`host_copy`), the rest of it shared."""
    if device.type == "cpu":
        return snapshot
    return dataclasses.replace(snapshot, tensors={name: host_copy(t, pin) for name, t in snapshot.tensors.items()})
