"""Finding and loading the C kernels' library.

An install (`pip install .`, the image's docker/install.sh) compiles csrc/*.c into one library per CPU variant
(setup.py: `portable` everywhere, plus `avx2` and `avx512` on x86-64), so a machine without a compiler runs
them. `load()` picks the best installed variant the CPU's flags allow, as ggml does. Where no variant is
installed (a source checkout before `pip install -e .`), it compiles one for this CPU (`-march=native`) into a
cache folder, once, under a file lock so two processes never build or prune at the same time; that path is a
development fallback, and `KernelStatus.source` says which one ran.

REFORMER_CPU_KERNELS: `auto` (default: use them when they load), `on` (the service refuses to start when they
cannot load, naming the reason), `off` (PyTorch ops only). REFORMER_CPU_KERNEL_VARIANT forces one installed
variant (`portable`, `avx2`, `avx512`).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.machinery
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import sources
from .bindings import CpuKernels
from .sources import COMMON_FLAGS, LINK_FLAGS, OPENMP, VARIANTS

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
# the sources, variants and flags: sources.py, the list setup.py reads too
SOURCES = tuple(HERE / "csrc" / name for name in sources.SOURCES)
HEADERS = tuple(HERE / "csrc" / name for name in sources.HEADERS)
LIBRARY = "_reformer_kernels"  # installed variants: model/kernels/_reformer_kernels_<variant><ext suffix>
ENV_SWITCH = "REFORMER_CPU_KERNELS"
ENV_VARIANT = "REFORMER_CPU_KERNEL_VARIANT"
ENV_DIR = "REFORMER_KERNEL_DIR"  # where first-use builds are kept (default: the user's cache folder)
MODES = ("auto", "on", "off")
KEEP_BUILDS = 4  # first-use builds kept in the cache folder: each edit of the sources makes a new one


def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def mode() -> str:
    """REFORMER_CPU_KERNELS as one of MODES (the older 0/1 spellings read as off/auto)."""
    raw = os.environ.get(ENV_SWITCH, "auto").strip().lower()
    raw = {"0": "off", "false": "off", "no": "off", "1": "auto", "true": "auto", "yes": "auto"}.get(raw, raw)
    if raw not in MODES:
        raise ValueError(f"{ENV_SWITCH} must be one of {', '.join(MODES)}; got {raw!r}")
    return raw


@dataclass(frozen=True)
class KernelStatus:
    """What `load()` found: `source` is `installed:<variant>`, `first-use build`, `off` or `unavailable`."""

    kernels: CpuKernels | None
    source: str
    reason: str = ""

    @property
    def loaded(self) -> bool:
        return self.kernels is not None


def installed(folder: Path = HERE) -> dict[str, Path]:
    """The variants installed beside this module."""
    found: dict[str, Path] = {}
    for name in VARIANTS:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = folder / f"{LIBRARY}_{name}{suffix}"
            if path.exists():
                found[name] = path
                break
    return found


def choose_variant(available: dict[str, Path], flags: frozenset[str], forced: str | None = None) -> str | None:
    """The best of `available` this CPU runs (every flag it needs present), or `forced` when installed."""
    if forced:
        if forced not in VARIANTS:
            raise ValueError(f"{ENV_VARIANT} must be one of {', '.join(VARIANTS)}; got {forced!r}")
        return forced if forced in available else None
    return next((name for name in VARIANTS if name in available and VARIANTS[name][1] <= flags), None)


def _cache_dir() -> Path:
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "reformer-serve" / "kernels"


def compile_library(compiler: str, target: Path, march: tuple[str, ...]) -> None:
    """csrc/*.c into the shared library `target`, with OpenMP where the compiler has it (written beside the
    target and renamed, so nobody loads a half-written file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    base = (*COMMON_FLAGS, *march, "-shared")
    try:
        for flags in ((*base, OPENMP), base):  # without OpenMP only when the compiler refuses it
            try:
                subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", tmp, *LINK_FLAGS], check=True,
                               capture_output=True, text=True, timeout=300)
                break
            except subprocess.CalledProcessError:
                if flags == base:
                    raise
                log.warning("the C kernels build without OpenMP: a step's layers run on one thread")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _prune(folder: Path, keep: Path) -> None:
    """Delete all but the KEEP_BUILDS newest first-use builds (never `keep`); the caller holds the lock."""
    builds = sorted(folder.glob("reformer_kernels-*.so"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in [p for p in builds if p != keep][KEEP_BUILDS - 1:]:
        try:
            old.unlink()
        except OSError:
            pass


def first_use_build() -> Path:
    """The library for this CPU in the cache folder, built under an exclusive file lock if missing."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler found and no installed build of the kernels")
    digest = hashlib.sha256()
    flags = " ".join((*COMMON_FLAGS, OPENMP, *LINK_FLAGS))
    for part in (*(src.read_bytes() for src in (*SOURCES, *HEADERS)), flags.encode(), compiler.encode(),
                 platform.machine().encode(), " ".join(sorted(cpu_flags())).encode()):
        digest.update(part)
    folder = _cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"reformer_kernels-{digest.hexdigest()[:16]}.so"
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder (and pruner) at a time; the others wait, then load
        if not target.exists():
            compile_library(compiler, target, ("-march=native",))
            _prune(folder, target)
        else:
            os.utime(target)  # newest: a concurrent prune keeps what is in use
    return target


@functools.lru_cache(maxsize=1)
def load() -> KernelStatus:
    """The kernels as the environment asks (see the module docstring); never raises for a missing build."""
    want = mode()
    if want == "off":
        return KernelStatus(None, "off", f"{ENV_SWITCH}=off")
    try:
        variant = choose_variant(installed(), cpu_flags(), os.environ.get(ENV_VARIANT) or None)
        if variant is not None:
            return KernelStatus(CpuKernels(installed()[variant]), f"installed:{variant}")
        if os.environ.get(ENV_VARIANT):
            return KernelStatus(None, "unavailable", f"{ENV_VARIANT}={os.environ[ENV_VARIANT]} is not installed")
        return KernelStatus(CpuKernels(first_use_build()), "first-use build")
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        detail = str(getattr(exc, "stderr", "") or exc).strip()
        log.warning("cpu kernels unavailable (%s): the CPU runs PyTorch ops", detail)
        return KernelStatus(None, "unavailable", detail)


def kernels() -> CpuKernels | None:
    """The loaded kernels, or None."""
    return load().kernels
