"""The Dockerfile's ARGs pair torch, onnxruntime-gpu and the CUDA major the image asks of the driver only
as known releases go together: a pairing not in the table below fails, and so does a table entry whose CUDA
major differs.

Each entry was read off the wheel's own metadata on PyPI (`pip install --dry-run --report - --no-deps
--only-binary=:all: --platform manylinux_2_28_x86_64 --python-version 3.12 NAME==VERSION`, 2026-12-01):
- torch 2.13.0: Requires-Dist cuda-toolkit[...]==13.0.3, nvidia-cudnn-cu13==9.20.0.48 (CUDA 13);
- onnxruntime-gpu 1.31.1: extra cuda nvidia-cuda-runtime~=13.0, extra cudnn nvidia-cudnn-cu13~=9.0 (CUDA 13).
Add a release only after reading its metadata the same way.
"""

from __future__ import annotations

import re

import pytest

from tests.docker.conftest import REPO

# PyPI's Linux x86-64 wheel -> the CUDA major it is built for.
TORCH_CUDA = {"2.13.0": 13}
ONNXRUNTIME_GPU_CUDA = {"1.31.1": 13}
# Lowest NVIDIA Linux driver for each CUDA major (CUDA 13.0 release notes: >= 580).
DRIVER_FOR_CUDA = {13: 580}


def dockerfile_args(text: str) -> dict[str, str]:
    """Default of each `ARG NAME=value` (the first one wins, as in the build stage)."""
    found: dict[str, str] = {}
    for name, value in re.findall(r"^ARG (\w+)=(\S*)$", text, flags=re.M):
        found.setdefault(name, value)
    return found


def check_pairing(args: dict[str, str]) -> int:
    """The CUDA major of a coherent pairing; AssertionError naming what does not fit."""
    torch, ort, major = args["TORCH_VERSION"], args["ONNXRUNTIME_GPU_VERSION"], int(args["CUDA_MAJOR"])
    assert torch in TORCH_CUDA, f"torch {torch} is not a known pairing: read its wheel metadata, add it here"
    assert ort in ONNXRUNTIME_GPU_CUDA, f"onnxruntime-gpu {ort} is not a known pairing: add it after checking"
    assert TORCH_CUDA[torch] == major, f"torch {torch} is built for CUDA {TORCH_CUDA[torch]}, not {major}"
    assert ONNXRUNTIME_GPU_CUDA[ort] == major, (
        f"onnxruntime-gpu {ort} is built for CUDA {ONNXRUNTIME_GPU_CUDA[ort]}, not {major}")
    assert major in DRIVER_FOR_CUDA, f"no driver requirement recorded for CUDA {major}"
    return major


def test_dockerfile_pairs_one_cuda_major() -> None:
    text = (REPO / "Dockerfile").read_text()
    args = dockerfile_args(text)
    major = check_pairing(args)
    # The runtime stage asks the container toolkit for that major, and the docs state the driver it needs.
    assert 'NVIDIA_REQUIRE_CUDA="cuda>=${CUDA_MAJOR}.0"' in text
    deploy = (REPO / "docs/DEPLOY.md").read_text()
    assert f"CUDA {major}" in deploy and f">= {DRIVER_FOR_CUDA[major]}" in deploy


@pytest.mark.parametrize("change", [
    {"CUDA_MAJOR": "12"},                       # a CUDA 12 claim with CUDA 13 wheels
    {"TORCH_VERSION": "2.12.0"},                # a release nobody checked
    {"ONNXRUNTIME_GPU_VERSION": "1.20.1"},
])
def test_a_mismatched_or_unknown_pairing_fails(change: dict[str, str]) -> None:
    args = {**dockerfile_args((REPO / "Dockerfile").read_text()), **change}
    with pytest.raises(AssertionError):
        check_pairing(args)


def test_a_table_entry_of_another_major_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ONNXRUNTIME_GPU_CUDA, "1.31.1", 12)
    with pytest.raises(AssertionError, match="built for CUDA 12"):
        check_pairing(dockerfile_args((REPO / "Dockerfile").read_text()))
