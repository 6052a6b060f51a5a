"""What, besides the artifact and the settings, decides the bits a prefill writes: the code that computes it
and the machine it runs on. Computed at start, never hand-bumped, and part of the cache identity
(service/prefix_cache/keys.py), so that two servers share a state only when each would have computed it.

- the package's version and a sha256 of the model package's Python sources (model/**/*.py): any change to
  the code that computes a state changes the key, released or not;
- torch's version and the CUDA version it was built for;
- on the CPU, whether the C kernels run and which build (model/kernels/build.py `KernelStatus.source`, e.g.
  `installed:avx2`) with the sha256 of the library loaded, and the intra-op thread count: a prefill longer
  than model/decoding/threads.py SINGLE_THREAD_PREFILL_TOKENS runs on every thread, and a reduction split
  over another count of threads can round differently;
- on a GPU, its name and compute capability (another card may pick other kernels), and no thread count."""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
from pathlib import Path

import torch

MODEL_PACKAGE = Path(__file__).resolve().parents[2] / "model"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def code_digest(package: Path = MODEL_PACKAGE) -> str:
    """sha256 over the package's Python sources, by relative path (their order and names count too)."""
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix().encode()
        h.update(len(rel).to_bytes(4, "little") + rel)
        h.update(_sha256_file(path).encode())
    return h.hexdigest()


def package_version() -> str:
    try:
        return importlib.metadata.version("reformer-serve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "uninstalled"


def kernel_fingerprint(device: torch.device, cpu_kernels: bool) -> str:
    """`off`, or the C kernels' build and the sha256 of the library that loaded (`unavailable` when asked for
    but not loaded: the steps then run PyTorch ops, as with `off`, but the label keeps the two apart)."""
    if device.type != "cpu" or not cpu_kernels:
        return "off"
    from model.kernels import load

    status = load()
    if status.kernels is None:
        return status.source
    return f"{status.source}:{_sha256_file(status.kernels.path)}"


def runtime_fingerprint(device: torch.device, cpu_kernels: bool) -> dict[str, str]:
    """The fields the cache identity takes from the code and the machine (see the module docstring)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        hardware = f"{torch.cuda.get_device_name(index)} sm_{major}{minor}"
        threads = "-"
    else:
        hardware = f"{device.type} {platform.machine()}"
        threads = str(torch.get_num_threads())
    return {
        "package": package_version(),
        "code": code_digest(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "kernels": kernel_fingerprint(device, cpu_kernels),
        "threads": threads,
        "hardware": hardware,
    }
