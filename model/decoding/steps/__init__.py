"""A decode step's backends, chosen once per cache: on a float32 CPU cache with the C kernels loaded, the whole
step in one C call (fused.py) and, where that call does not apply, the PyTorch step (torch_step.py) with its
products, hashes and windows in C (linear.py, the kernels' window functions); anywhere else the PyTorch step,
replayed as CUDA graphs on a GPU (cuda_graphs.py). Every backend computes what torch_step.py computes, each
row alone on the C paths."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels import CpuKernels, kernels
from ...kernels.weights import WeightKind
from .fused import FusedStep
from .linear import StepLinears


@dataclass
class StepBackends:
    """`window`: the C window functions (None: PyTorch gathers); `linears`: a step's products (C or F.linear);
    `fused`: the one-call step (None: layer by layer)."""

    window: CpuKernels | None
    linears: StepLinears
    fused: FusedStep | None

    @staticmethod
    def choose(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, cpu_kernel: bool = True,
               weights: WeightKind = "float32") -> StepBackends:
        """The C kernels for a float32 model on the CPU when `cpu_kernel` and they load; the window functions
        only where the build reads `kv_dtype` pools. `weights`: what the C products keep the step's linear
        weights in (REFORMER_DECODE_WEIGHTS; linear.py)."""
        kernel = kernels() if cpu_kernel and device.type == "cpu" and dtype == torch.float32 else None
        linears = StepLinears(kernel, weights)
        return StepBackends(window=kernel if kernel is not None and kv_dtype in kernel.reads else None,
                            linears=linears, fused=FusedStep(linears) if kernel is not None else None)

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
