"""A decode step's backends, chosen once per decoder (backends.py): on a float32 CPU cache with the C kernels
loaded, the whole step in one C call (fused.py) and, where that call does not apply, the PyTorch step
(torch_step.py) with its products, hashes and windows in C (linear.py, the kernels' window functions); anywhere
else the PyTorch step, replayed as CUDA graphs on a GPU (cuda_graphs.py). Every backend computes what
torch_step.py computes, each row alone on the C paths."""

from .backends import StepBackends

__all__ = ["StepBackends"]
