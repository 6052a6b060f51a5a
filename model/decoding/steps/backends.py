"""A decode step's backends, chosen once per decoder (model/decoding/step.py `Decoder`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...kernels import CpuKernels, kernels
from ...kernels.weights import WeightKind
from .fused import FusedStep
from .linear import StepLinears

if TYPE_CHECKING:
    from ..cache import DecodeCache


@dataclass
class StepBackends:
    """`window`: the C window functions (None: PyTorch gathers); `linears`: a step's products (C or F.linear);
    `fused`: the one-call step (None: layer by layer)."""

    window: CpuKernels | None
    linears: StepLinears
    fused: FusedStep | None

    @staticmethod
    def choose(cache: DecodeCache, weights: WeightKind = "float32") -> StepBackends:
        """The C kernels for a float32 model's CPU cache whose owner allows them (`DecodeCache.cpu_kernel`) when
        they load; the window functions only where the cache stores through them (`DecodeCache.kernel`: their
        build reads its pools). `weights`: what the C products keep the step's linear weights in
        (REFORMER_DECODE_WEIGHTS; linear.py)."""
        cpu = cache.cpu_kernel and cache.device.type == "cpu" and cache.dtype == torch.float32
        kernel = kernels() if cpu else None
        linears = StepLinears(kernel, weights)
        return StepBackends(window=cache.kernel, linears=linears,
                            fused=FusedStep(linears) if kernel is not None else None)

    def describe(self) -> dict[str, str]:
        """Which code runs a step's parts (what /info and reformer_backend_info report)."""
        if self.fused is not None and self.window is not None:
            step = "c-fused"
        elif self.window is not None or self.linears.kernel is not None:
            step = "c-per-layer"
        else:
            step = "torch"
        # the C products' weights; float32 wherever PyTorch runs them
        weights = self.linears.weights if self.linears.kernel is not None else "float32"
        return {"decode_step": step, "decode_attention": "c" if self.window is not None else "torch",
                "decode_weights": weights}


__all__ = ["StepBackends"]
