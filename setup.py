"""Builds the C kernels with the package (pyproject.toml holds everything else): one shared library per CPU
variant of model/kernels/build.py's VARIANTS, loaded through ctypes (no Python module init), so a machine without
a compiler runs them. A variant whose build fails is skipped (`optional`); with none, the kernels fall back to a
first-use build where a compiler is present, else to PyTorch ops (`/info` says which)."""

from __future__ import annotations

import platform
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent
SOURCES = [f"model/kernels/csrc/{name}.c" for name in ("window_attend", "lsh_attend", "decode_cache", "step_linear",
                                                      "step_linear_q", "step_layers", "chunk_attend")]
HEADERS = [f"model/kernels/csrc/{name}.h" for name in ("step_kernels", "window_rows")]
# model/kernels/build.py's VARIANTS (flags only; that module is not importable before torch is installed)
MARCH = {"avx512": ["-march=x86-64-v4", "-mtune=generic"], "avx2": ["-march=x86-64-v3", "-mtune=generic"],
         "portable": []}
X86 = platform.machine() in ("x86_64", "AMD64", "amd64")


class BuildKernels(build_ext):
    """build_ext for plain shared libraries: no Python module init symbol is exported or needed."""

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return []


def kernels() -> list[Extension]:
    names = list(MARCH) if X86 else ["portable"]
    return [Extension(f"model.kernels._reformer_kernels_{name}", sources=SOURCES, depends=HEADERS,
        extra_compile_args=["-O3", "-fopenmp", "-pthread", *MARCH[name]],
        extra_link_args=["-fopenmp", "-pthread", "-lm"], optional=True) for name in names]


setup(ext_modules=kernels(), cmdclass={"build_ext": BuildKernels})
