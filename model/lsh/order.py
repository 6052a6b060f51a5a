"""The bucket order: each hash round's positions sorted by (bucket, position), the layout LSH attention chunks.
The PyTorch reference for the forward, the ONNX graph, the sliced prefill and the decode index's builds; the C
counting sort `lsh_order` (model/kernels/) is tested against it and used where given."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..kernels import CpuKernels


def bucket_order(buckets: Tensor, count: int | None = None, kernel: CpuKernels | None = None) -> Tensor:
    """Positions (..., L) of each series of buckets (..., L) int64 sorted by (bucket, position): through the
    CPU `kernel`'s counting sort where given (buckets in [0, count); count None: their maximum + 1), else
    PyTorch's argsort of bucket * L + position. The same order either way (the keys are distinct, so any sort
    is stable here)."""
    length = buckets.shape[-1]
    if kernel is not None and buckets.is_cpu and length:
        return kernel.lsh_order(buckets, count if count is not None else int(buckets.max()) + 1)
    return torch.argsort(buckets * length + torch.arange(length, device=buckets.device), dim=-1)
