"""The C kernels' sources and compiler flags: the one list both builds read, an install's (setup.py: one library
per variant) and a source checkout's first-use build (build.py), which also picks an installed variant by the
CPU flags named here.

No imports, and nothing but literals: setup.py loads this file by its path, before torch (which
`model/__init__.py` imports) is installed."""

# under csrc/ beside this file
SOURCES: tuple[str, ...] = ("window_attend.c", "lsh_attend.c", "decode_cache.c", "step_linear.c", "step_linear_q.c",
                            "step_layers.c", "extend_layers.c", "extend_windows.c",
                            "extend_merge.c", "extend_local.c", "extend_attend.c",
                            "chunk_attend.c")
HEADERS: tuple[str, ...] = ("step_kernels.h", "window_rows.h", "extend_windows.h")

# the variants an install builds, best first: their compiler flags, and the CPU flags each needs
# (x86-64-v3 and -v4 as gcc and clang define them); off x86-64 only `portable`
VARIANTS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "avx512": (("-march=x86-64-v4", "-mtune=generic"),
               frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "f16c",
                          "bmi2", "movbe"})),
    "avx2": (("-march=x86-64-v3", "-mtune=generic"), frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})),
    "portable": ((), frozenset()),
}
X86_MACHINES = ("x86_64", "AMD64", "amd64")  # platform.machine() names of x86-64

COMMON_FLAGS: tuple[str, ...] = ("-O3", "-fPIC", "-pthread")
# step_layers.c splits a step between OpenMP threads (the OpenMP runtime PyTorch has loaded: one pool of
# threads for both); a first-use build with a compiler without OpenMP builds it single-threaded
OPENMP = "-fopenmp"
LINK_FLAGS: tuple[str, ...] = ("-pthread", "-lm")


def variants_for(machine: str) -> list[str]:
    """The variants an install builds on this architecture (platform.machine()), best first."""
    return list(VARIANTS) if machine in X86_MACHINES else ["portable"]
