"""Builds the C kernels with the package (pyproject.toml holds everything else): one shared library per CPU
variant of model/kernels/sources.py's VARIANTS, loaded through ctypes (no Python module init), so a machine without
a compiler runs them. A variant whose build fails is skipped (`optional`); with none, the kernels fall back to a
first-use build where a compiler is present, else to PyTorch ops (`/info` says which)."""

from __future__ import annotations

import platform
import runpy
from pathlib import Path
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent
CSRC = "model/kernels/csrc"


def kernel_sources() -> dict[str, Any]:
    """model/kernels/sources.py's names, loaded by path: the package imports torch, not installed yet here."""
    return runpy.run_path(str(ROOT / "model" / "kernels" / "sources.py"))


class BuildKernels(build_ext):
    """build_ext for plain shared libraries: no Python module init symbol is exported or needed."""

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return []


def kernels() -> list[Extension]:
    k = kernel_sources()
    return [Extension(f"model.kernels._reformer_kernels_{name}", sources=[f"{CSRC}/{f}" for f in k["SOURCES"]],
                      depends=[f"{CSRC}/{f}" for f in k["HEADERS"]],
                      extra_compile_args=[*k["COMMON_FLAGS"], k["OPENMP"], *k["VARIANTS"][name][0]],
                      extra_link_args=[k["OPENMP"], *k["LINK_FLAGS"]], optional=True)
            for name in k["variants_for"](platform.machine())]


setup(ext_modules=kernels(), cmdclass={"build_ext": BuildKernels})
