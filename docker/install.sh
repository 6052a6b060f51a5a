#!/usr/bin/env bash
# The image's install step (the Dockerfile's one RUN that installs Python packages), also run by
# tests/docker/test_install.py in a fresh venv with the CPU wheels, so a broken step fails the suite.
#
#   docker/install.sh VENV SRC
#
# Environment (the Dockerfile's ARGs):
#   VARIANT                  cuda (default) or cpu
#   TORCH_VERSION            exact torch release, e.g. 2.13.0; every install below is held to it, so pip
#                            never fetches another torch
#   TORCH_INDEX_URL          where torch comes from. Unset: PyPI for cuda (PyPI's Linux torch 2.13 is the
#                            CUDA 13 build; it brings its CUDA libraries as nvidia-* wheels),
#                            https://download.pytorch.org/whl/cpu for cpu. Set but empty: pip's own
#                            configuration decides (the tests: constraints-cpu.txt and local wheels)
#   ONNXRUNTIME_GPU_VERSION  onnxruntime-gpu release for cuda (its CUDA major must be torch's)
#   CUDA_MAJOR               the CUDA major torch and onnxruntime-gpu are built for; checked after install
#   PYTHON                   interpreter that makes the venv (default python3)
set -euo pipefail

VENV=${1:?usage: docker/install.sh VENV SRC}
SRC=${2:?usage: docker/install.sh VENV SRC}
VARIANT=${VARIANT:-cuda}
TORCH_VERSION=${TORCH_VERSION:?TORCH_VERSION is required (an exact release)}
CUDA_MAJOR=${CUDA_MAJOR:-13}
case "$VARIANT" in
  cuda) : "${ONNXRUNTIME_GPU_VERSION:?ONNXRUNTIME_GPU_VERSION is required for VARIANT=cuda}"
        DEFAULT_INDEX="" ;;
  cpu) DEFAULT_INDEX="https://download.pytorch.org/whl/cpu" ;;
  *) echo "install.sh: VARIANT must be cuda or cpu, not '$VARIANT'" >&2; exit 2 ;;
esac
if [[ -z ${TORCH_INDEX_URL+set} ]]; then TORCH_INDEX_URL=$DEFAULT_INDEX; fi

"${PYTHON:-python3}" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --quiet)
PIN="$VENV/torch-pin.txt"
echo "torch==$TORCH_VERSION" >"$PIN"

INDEX=()
[[ -n $TORCH_INDEX_URL ]] && INDEX=(--index-url "$TORCH_INDEX_URL")
"${PIP[@]}" "${INDEX[@]}" -c "$PIN" "torch==$TORCH_VERSION"
# A regular (not editable) install: the default artifact is package data of `export` and lands in
# site-packages with it.
"${PIP[@]}" -c "$PIN" "$SRC"
if [[ $VARIANT == cuda ]]; then
  # Both wheels provide the `onnxruntime` module: the CPU one the package depends on makes way for the
  # CUDA build; its cuda/cudnn extras name the same nvidia-* CUDA 13 wheels torch already brought.
  "$VENV/bin/python" -m pip uninstall --quiet -y onnxruntime
  "${PIP[@]}" -c "$PIN" "onnxruntime-gpu[cuda,cudnn]==$ONNXRUNTIME_GPU_VERSION"
fi

# What was installed is what was asked for (no GPU is needed to read the builds).
VARIANT=$VARIANT TORCH_VERSION=$TORCH_VERSION CUDA_MAJOR=$CUDA_MAJOR "$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import os

import onnxruntime
import torch

import export
import service  # noqa: F401 - the package imports

variant, major = os.environ["VARIANT"], os.environ["CUDA_MAJOR"]
assert torch.__version__.split("+")[0] == os.environ["TORCH_VERSION"], torch.__version__
if variant == "cuda":
    assert torch.version.cuda is not None and torch.version.cuda.split(".")[0] == major, torch.version.cuda
    assert "CUDAExecutionProvider" in onnxruntime.get_available_providers()
    assert not any(d.metadata["Name"] == "onnxruntime" for d in md.distributions()), "CPU onnxruntime left"
else:
    assert torch.version.cuda is None, f"a CUDA torch ({torch.version.cuda}) in the CPU image"
shipped = os.path.join(os.path.dirname(export.__file__), "default_artifact")
assert os.path.isdir(shipped) and os.listdir(shipped), "the default artifact was not installed"
print(f"installed: torch {torch.__version__} (CUDA {torch.version.cuda}), onnxruntime "
      f"{onnxruntime.__version__} {onnxruntime.get_available_providers()}")
PY
