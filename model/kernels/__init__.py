"""The C kernels of the CPU paths: sources (csrc/), the build and its variants (build.py), the ctypes bindings
(bindings.py) and the one Python definition of their interface (abi.py). Nothing here imports the model."""

from .bindings import CpuKernels, IndexArrays
from .build import KernelStatus, kernels, load

__all__ = ["CpuKernels", "IndexArrays", "KernelStatus", "kernels", "load"]
